// Helpers of the CUDA handlers: launch-error checks and warp reductions.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "ffi_args.h"

namespace dsv4 {

inline ffi::Error LastCudaError(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(kernel) + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace dsv4
