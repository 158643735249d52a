// The FP8 tensor-core tile of the GEMM kernels (moe_experts_cuda.cu's grouped form): a block of
// kTileWarps warps takes kTileRows rows of a weight (16 a warp, one mma's rows) and a tile of
// 8 x kNb activation rows (the mma's columns), the reduced dim 32 at a time, each k32 step scaled
// by its weight scale (FP8: 128 x 128 blocks; FP4: 1 x 32) and activation scale (1 x 128) in f32
// outside the tensor core. Activations are quantised first (QuantizeRowsKernel: act_quant,
// e4m3 bytes and f32 scales), weights are read as stored (FP4 codes converted in registers).
// Needs the reduced dim a multiple of 32 (whole k32 steps, aligned 8-byte loads).
#pragma once

#include <cuda_runtime.h>

#include <cute/arch/copy_sm80.hpp>

#include "act_quant_cuda.h"
#include "cuda_tiles.h"
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

// ---- the pipelined block mainloop
//
// A block streams the reduced dim in stages of kStageK: each stage's weight tiles (kStacks x
// kTileRows rows, as stored) and the tile's activation rows (8 x kNb columns, e4m3) go to shared
// memory by 16-byte cp.async, kStages - 1 stages ahead of the tensor cores. Shared rows are padded
// so that a warp's fragment reads hit distinct banks (FP4: 20-word rows for 4-byte reads; e4m3:
// 40-word rows for 8-byte reads, a half-warp's four rows eight banks apart).

constexpr int kStageK = 128;  // = kActBlock: one activation scale per column and stage
static_assert(kStageK == kActBlock, "a stage is one act_quant block");
constexpr int kMaxStages = 3;

DSV4_HD int WeightRowBytes(bool fp4) { return fp4 ? kStageK / 2 + 16 : kStageK + 32; }
constexpr int kActRowBytes = kStageK + 32;

template <int kStacks, int kNb>
DSV4_HD int64_t StageBytes(bool fp4) {
  return static_cast<int64_t>(kStacks) * kTileRows * WeightRowBytes(fp4) + 8 * kNb * kActRowBytes;
}

constexpr int64_t kStaticSharedAllowance = 4096;  // the kernels' own __shared__ arrays

// The stages a block pipelines (2 or 3) within the shared memory a block may opt in to; 0 when
// not even two fit.
template <int kStacks, int kNb>
inline int PipelineStages(bool fp4) {
  const int64_t fit = (OptInSharedBytes() - kStaticSharedAllowance) / StageBytes<kStacks, kNb>(fp4);
  return fit < 2 ? 0 : static_cast<int>(fit < kMaxStages ? fit : kMaxStages);
}

// Starts the copies of stage kb into buffer `stage`: the block's weight rows row0.. of expert e
// of each stack, and the activation rows cols[0 .. 8 kNb) of bq (`in` bytes a row; -1: zeros).
// Rows past a stack's end and k past `in` are zero-filled (in % 32 == 0: whole 16-byte chunks).
template <int kStacks, int kNb>
__device__ void LoadStage(const ExpertStackView (&stacks)[kStacks], int64_t e, int64_t row0, const uint8_t* bq,
                          const int64_t* cols, int64_t kb, uint8_t* stage) {
  const bool fp4 = stacks[0].fp4;
  const int64_t in = stacks[0].in, row_bytes = fp4 ? in / 2 : in;  // stored bytes of a weight row
  const int chunks = (fp4 ? kStageK / 2 : kStageK) / 16;             // 16-byte chunks of a row a stage
  const int wrb = WeightRowBytes(fp4);
#pragma unroll
  for (int m = 0; m < kStacks; ++m) {
    const ExpertStackView& s = stacks[m];
    uint8_t* tile = stage + m * kTileRows * wrb;
    for (int c = threadIdx.x; c < kTileRows * chunks; c += kTileThreads) {
      const int r = c / chunks, ch = c % chunks;
      const int64_t row = row0 + r, byte = kb * (fp4 ? kStageK / 2 : kStageK) + 16 * ch;
      const bool valid = row < s.out && byte < row_bytes;
      const uint8_t* src = valid ? s.weight + (e * s.out + row) * row_bytes + byte : s.weight;
      CopyAsync16OrZeros(static_cast<uint32_t>(__cvta_generic_to_shared(tile + r * wrb + 16 * ch)), src, valid);
    }
  }
  uint8_t* act = stage + kStacks * kTileRows * wrb;
  for (int c = threadIdx.x; c < 8 * kNb * (kStageK / 16); c += kTileThreads) {
    const int r = c / (kStageK / 16), ch = c % (kStageK / 16);
    const int64_t byte = kb * kStageK + 16 * ch;
    const bool valid = cols[r] >= 0 && byte < in;
    const uint8_t* src = valid ? bq + cols[r] * in + byte : bq;
    CopyAsync16OrZeros(static_cast<uint32_t>(__cvta_generic_to_shared(act + r * kActRowBytes + 16 * ch)), src, valid);
  }
}

// The weight scale of local row r (of the block's rows from row0) of stack s, expert e, at k.
__device__ __forceinline__ float WeightScale(const ExpertStackView& s, int64_t e, int64_t row, int64_t k) {
  if (row >= s.out) return 0.0f;
  if (s.fp4) return E8m0ToFloat(s.scale[(e * s.out + row) * (s.in / kFp4Group) + k / kFp4Group]);
  const int64_t in_blocks = (s.in + kWeightBlock - 1) / kWeightBlock;
  return E8m0ToFloat(
      s.scale[(e * ((s.out + kWeightBlock - 1) / kWeightBlock) + row / kWeightBlock) * in_blocks + k / kWeightBlock]);
}

// The tensor-core products of the stage in `stage` (reduced-dim block kb) into this warp's
// accumulators: its 16 rows (warp * 16 + g, + 8) of each stack x the 8 kNb columns, each k32
// step's product scaled by its weight scale and the column's activation scale (x_scale).
template <int kStacks, int kNb>
__device__ void StageProducts(const ExpertStackView (&stacks)[kStacks], int64_t e, int64_t row0, int64_t kb,
                              const uint8_t* stage, const float (&x_scale)[kNb][2],
                              float (&acc)[kStacks][kNb][4]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const bool fp4 = stacks[0].fp4;
  const int wrb = WeightRowBytes(fp4);
  const uint8_t* act = stage + kStacks * kTileRows * wrb;
  const int local = kRowsPerWarp * warp + g;
#pragma unroll
  for (int j = 0; j < kStageK / 32; ++j) {
    const int64_t k = kb * kStageK + 32 * j;
    if (k >= stacks[0].in) break;
    uint32_t b[kNb][2];
#pragma unroll
    for (int nb = 0; nb < kNb; ++nb) {
      const uint2 v = *reinterpret_cast<const uint2*>(act + (8 * nb + g) * kActRowBytes + 32 * j + 8 * q);
      b[nb][0] = v.x;
      b[nb][1] = v.y;
    }
#pragma unroll
    for (int m = 0; m < kStacks; ++m) {
      const uint8_t* tile = stage + m * kTileRows * wrb;
      uint32_t a[4];
      float w_scale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint8_t* row = tile + (local + 8 * h) * wrb;
        if (fp4) {  // codes 8q..8q+7 of the k32 group
          const uint32_t codes = *reinterpret_cast<const uint32_t*>(row + 16 * j + 4 * q);
          a[h] = E2m1x4ToE4m3x4(codes & 0xffffu);
          a[h + 2] = E2m1x4ToE4m3x4(codes >> 16);
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(row + 32 * j + 8 * q);
          a[h] = v.x;
          a[h + 2] = v.y;
        }
        w_scale[h] = WeightScale(stacks[m], e, row0 + local + 8 * h, k);
      }
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

// The block's products over the whole reduced dim (stacks' `in`, a multiple of 32): warp w's
// accumulators hold rows row0 + 16 w + g (+ 8) of each stack x the columns cols[0 .. 8 kNb)
// (rows of bq, e4m3, and of their scales bs, ceil(in / 128) a row; -1: none, zero). cols is in
// shared memory, written before the call; `shared` holds `stages` x StageBytes bytes.
template <int kStacks, int kNb>
__device__ void BlockTileProducts(const ExpertStackView (&stacks)[kStacks], int64_t e, int64_t row0,
                                  const uint8_t* bq, const float* bs, const int64_t* cols, uint8_t* shared,
                                  int stages, float (&acc)[kStacks][kNb][4]) {
  const int q = threadIdx.x % 4;
  const int64_t in = stacks[0].in, k_blocks = (in + kStageK - 1) / kStageK;
  const int64_t stage_bytes = StageBytes<kStacks, kNb>(stacks[0].fp4);
#pragma unroll
  for (int m = 0; m < kStacks; ++m)
#pragma unroll
    for (int nb = 0; nb < kNb; ++nb)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][nb][i] = 0.0f;
  for (int s = 0; s < stages - 1; ++s) {  // the prologue: stages 0 .. stages - 2 in flight
    if (s < k_blocks) LoadStage<kStacks, kNb>(stacks, e, row0, bq, cols, s, shared + s * stage_bytes);
    cute::cp_async_fence();
  }
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    // Every copy but the newest stages - 2 groups has landed: stage kb is in; every warp is past
    // stage kb - 1, whose buffer the next load reuses.
    if (stages == 3) cute::cp_async_wait<1>(); else cute::cp_async_wait<0>();
    __syncthreads();
    const int64_t next = kb + stages - 1;
    if (next < k_blocks) LoadStage<kStacks, kNb>(stacks, e, row0, bq, cols, next, shared + (next % stages) * stage_bytes);
    cute::cp_async_fence();
    float x_scale[kNb][2];
#pragma unroll
    for (int nb = 0; nb < kNb; ++nb)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int64_t col = cols[8 * nb + 2 * q + c];
        x_scale[nb][c] = col >= 0 ? bs[col * k_blocks + kb] : 0.0f;
      }
    StageProducts<kStacks, kNb>(stacks, e, row0, kb, shared + (kb % stages) * stage_bytes, x_scale, acc);
  }
  cute::cp_async_wait<0>();
}

// A pipelined kernel's launch: its dynamic shared memory opted in to on the current device
// (asked at every launch: a process may drive several GPUs).
template <typename Kernel, typename... Args>
ffi::Error LaunchPipelined(Kernel kernel, const char* name, dim3 grid, int64_t shared_bytes, cudaStream_t stream,
                           Args... args) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)) !=
      cudaSuccess) {
    return LastCudaError(name);
  }
  kernel<<<grid, kTileThreads, shared_bytes, stream>>>(args...);
  return LastCudaError(name);
}

}  // namespace
}  // namespace dsv4
