// Helpers of the CUDA handlers: launch-error checks and warp reductions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi_args.h"

namespace dsv4 {

inline ffi::Error LastCudaError(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(kernel) + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// The shared memory a block may opt in to on the current device (queried once per process;
// 48 KB, the default every device allows, if the query fails): 227 KB on SM90, 99 KB on SM120.
inline int64_t OptInSharedBytes() {
  static const int64_t bytes = [] {
    int device = 0, value = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
      return int64_t{48 * 1024};
    }
    return static_cast<int64_t>(value);
  }();
  return bytes;
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
