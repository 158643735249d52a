// The FP8 tensor-core tile of the GEMM kernels (moe_experts_cuda.cu's grouped form): a block of
// kTileWarps warps takes kTileRows rows of a weight (16 a warp, one mma's rows) and a tile of
// 8 x kNb activation rows (the mma's columns), the reduced dim 32 at a time, each k32 step scaled
// by its weight scale (FP8: 128 x 128 blocks; FP4: 1 x 32) and activation scale (1 x 128) in f32
// outside the tensor core. Activations are quantised first (QuantizeRowsKernel: act_quant,
// e4m3 bytes and f32 scales), weights are read as stored (FP4 codes converted in registers).
// Needs the reduced dim a multiple of 32 (whole k32 steps, aligned 8-byte loads).
#pragma once

#include <cuda_runtime.h>

#include "act_quant_cuda.h"
#include "fp8_mma_cuda.h"
#include "op_args.h"

namespace dsv4 {
namespace {

constexpr int kRowsPerWarp = 16;  // an mma's rows
constexpr int kTileWarps = 8;
constexpr int kTileRows = kRowsPerWarp * kTileWarps;
constexpr int kTileThreads = 32 * kTileWarps;
static_assert(kTileRows == kActBlock, "a block's rows are one act_quant block (moe_experts' gate/up epilogue)");

// act_quant of `rows` rows of `width` (f32 | bf16) into e4m3 bytes q [rows, width] and f32
// scales [rows, ceil(width / 128)], a warp per 128-block.
__global__ void QuantizeRowsKernel(const void* src, Elem type, int64_t rows, int64_t width, uint8_t* q,
                                   float* scales) {
  const int64_t blocks = (width + kActBlock - 1) / kActBlock;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (p >= rows * blocks) return;
  const int64_t r = p / blocks, lo = (p % blocks) * kActBlock;
  WarpQuantizeActBlock(src, type, r * width + lo, min(kActBlock, width - lo), q + r * width + lo, scales + p);
}

inline ffi::Error LaunchQuantizeRows(cudaStream_t stream, const void* src, Elem type, int64_t rows, int64_t width,
                                     uint8_t* q, float* scales) {
  const int64_t warps = rows * ((width + kActBlock - 1) / kActBlock);
  if (warps == 0) return ffi::Error::Success();
  QuantizeRowsKernel<<<static_cast<unsigned>((warps + kTileWarps - 1) / kTileWarps), kTileThreads, 0, stream>>>(
      src, type, rows, width, q, scales);
  return LastCudaError("QuantizeRowsKernel");
}

// The A fragment of the warp's rows (row0 + g, row0 + g + 8) of expert e, k32 step at k, with
// each row's weight scale; rows past the stack's end are zero.
__device__ __forceinline__ void LoadWeightFragment(const ExpertStackView& s, int64_t e, int64_t row0, int64_t k,
                                                   uint32_t (&a)[4], float (&w_scale)[2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + g + 8 * h;
    if (row >= s.out) {
      a[h] = a[h + 2] = 0u;
      w_scale[h] = 0.0f;
      continue;
    }
    if (s.fp4) {  // 8 codes (4 bytes) of the row's 32-group at k
      const uint32_t codes = *reinterpret_cast<const uint32_t*>(s.weight + (e * s.out + row) * (s.in / 2) + k / 2 + 4 * q);
      a[h] = E2m1x4ToE4m3x4(codes & 0xffffu);
      a[h + 2] = E2m1x4ToE4m3x4(codes >> 16);
      w_scale[h] = E8m0ToFloat(s.scale[(e * s.out + row) * (s.in / kFp4Group) + k / kFp4Group]);
    } else {  // 8 e4m3 values of one 128 x 128 block
      const uint2 v = *reinterpret_cast<const uint2*>(s.weight + (e * s.out + row) * s.in + k + 8 * q);
      a[h] = v.x;
      a[h + 2] = v.y;
      const int64_t in_blocks = (s.in + kWeightBlock - 1) / kWeightBlock;
      w_scale[h] = E8m0ToFloat(
          s.scale[(e * ((s.out + kWeightBlock - 1) / kWeightBlock) + row / kWeightBlock) * in_blocks + k / kWeightBlock]);
    }
  }
}

// One warp's products over the whole reduced dim: for each of kStacks weight stacks, its 16 rows
// from row0 x the tile's assignments (8 x kNb columns) against the quantised rows bq (e4m3, `in`
// bytes a row) with their scales bs (ceil(in / 128) a row). b_row[nb]: the bq row of this lane's
// column g of n-block nb; c_row[nb][c]: that of the lane's output column 2q + c (-1: none).
template <int kStacks, int kNb>
__device__ void WarpTileProducts(const ExpertStackView (&stacks)[kStacks], int64_t e, int64_t row0,
                                 const uint8_t* bq, const float* bs, const int64_t (&b_row)[kNb],
                                 const int64_t (&c_row)[kNb][2], float (&acc)[kStacks][kNb][4]) {
  const int q = threadIdx.x % 4;
  const int64_t in = stacks[0].in, in_blocks = (in + kActBlock - 1) / kActBlock;
#pragma unroll
  for (int m = 0; m < kStacks; ++m)
#pragma unroll
    for (int nb = 0; nb < kNb; ++nb)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][nb][i] = 0.0f;
#pragma unroll 4
  for (int64_t k = 0; k < in; k += 32) {
    uint32_t b[kNb][2];
    float x_scale[kNb][2];
#pragma unroll
    for (int nb = 0; nb < kNb; ++nb) {
      uint2 v = make_uint2(0u, 0u);
      if (b_row[nb] >= 0) v = *reinterpret_cast<const uint2*>(bq + b_row[nb] * in + k + 8 * q);
      b[nb][0] = v.x;
      b[nb][1] = v.y;
#pragma unroll
      for (int c = 0; c < 2; ++c) x_scale[nb][c] = c_row[nb][c] >= 0 ? bs[c_row[nb][c] * in_blocks + k / kActBlock] : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < kStacks; ++m) {
      uint32_t a[4];
      float w_scale[2];
      LoadWeightFragment(stacks[m], e, row0, k, a, w_scale);
#pragma unroll
      for (int nb = 0; nb < kNb; ++nb) {
        float d[4];
        MmaE4m3(d, a, b[nb]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][nb][i] = fmaf(d[i], w_scale[i / 2] * x_scale[nb][i % 2], acc[m][nb][i]);
      }
    }
  }
}

}  // namespace
}  // namespace dsv4
