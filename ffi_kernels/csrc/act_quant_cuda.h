// act_quant on CUDA, a warp per 128-block, and the decode of e4m3 bytes 16 at a time: shared by
// the GEMM kernels (moe_experts_cuda.cu, fp8_tile_cuda.h).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "act_quant.h"
#include "cuda_common.h"

namespace dsv4 {

// One 128-block of an activation row (x[offset, offset + len), f32 | bf16) quantised by one warp:
// the e4m3 bytes to `values` [len], the scale to *scale (written by lane 0).
__device__ __forceinline__ void WarpQuantizeActBlock(const void* x, Elem x_type, int64_t offset, int64_t len,
                                                     uint8_t* values, float* scale) {
  const int lane = threadIdx.x % 32;
  float v[kActBlock / 32];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kActBlock / 32; ++i) {
    const int64_t k = lane + 32 * i;
    v[i] = k < len ? LoadElem(x, x_type, offset + k) : 0.0f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  const float s = E8m0ToFloat(BlockScaleByte(WarpMax(amax), kFp8Max));
#pragma unroll
  for (int i = 0; i < kActBlock / 32; ++i) {
    const int64_t k = lane + 32 * i;
    if (k < len) values[k] = GridFloatToE4m3(RoundE4m3(v[i] / s));
  }
  if (lane == 0) *scale = s;
}

// 16 e4m3 bytes -> f32, two at a time through the hardware's fp8x2 -> half2 conversion (exact).
__device__ __forceinline__ void DecodeE4m3x16(const uint4& raw, float* out) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>((words[i] >> (16 * j)) & 0xffffu);
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      out[4 * i + 2 * j] = f.x;
      out[4 * i + 2 * j + 1] = f.y;
    }
  }
}

// n (<= 16) e4m3 bytes at p -> f32, the rest 0: one 16-byte load where p is aligned and n is 16,
// else byte by byte (a K that is not a multiple of 16 leaves rows unaligned).
__device__ __forceinline__ void LoadE4m3x16(const uint8_t* p, int64_t n, bool aligned, float* out) {
  if (aligned && n == 16) {
    DecodeE4m3x16(*reinterpret_cast<const uint4*>(p), out);
    return;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) out[i] = i < n ? E4m3ToFloat(p[i]) : 0.0f;
}

}  // namespace dsv4
