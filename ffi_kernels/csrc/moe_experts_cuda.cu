// moe_experts on CUDA: the twin of dsv4/ops/moe_experts/reference.py (act_quant on) and of
// moe_experts_cpu.cc. Two forms, chosen by dsv4/ops/moe_experts/ffi.py from the token count:
//
// Per token (Dsv4MoeExpertsCuda; decode's one or two tokens), two kernels, each block one token:
// - GateUpKernel, grid (F / kWarps, T): the block quantises x[t] into shared memory (act_quant);
//   warp w takes row f of W1 and W3 and, for each of the token's K assignments, sums the row
//   against x (lanes on 16-byte weight chunks: 32 FP4 codes with their 1x32 scale, or 16 e4m3
//   values of one 128x128 block) and stores a = dtype(silu(min(g, L)) * clamp(u, -L, L) * w)
//   to the activation scratch [T, K, F] (f32).
// - DownKernel, grid (D / kWarps, T): the block quantises the token's K activation rows into
//   shared memory; warp w takes row d of W2 and sums its K assignments in order, so y[t, d] is
//   written once, with no atomics (the same result whatever the batch).
//
// Grouped by expert (Dsv4MoeExpertsGroupedCuda; more tokens): the assignments sorted by expert
// (the routing plan, built in XLA: `order`, and per expert its first sorted position, its count
// and its running count of token tiles), so that each expert's weights are read once per tile of
// up to 8 x kNb of its assignments rather than once per token. FP8 tensor cores (fp8_mma_cuda.h):
// - QuantizeRowsKernel: act_quant of x into xq (e4m3) and xs (scales), once per token.
// - GroupedGateUpKernel, grid (tiles, F / 128): warp w takes 16 rows of W1 and W3 and the tile's
//   assignments (mma: rows x assignments, k 32 at a time, each step scaled by its weight and
//   activation scales); the epilogue forms the activations as above and, the block holding a
//   whole 128-block of F, quantises them (act_quant) into aq, as.
// - GroupedDownKernel, grid (tiles, D / 128): the same over W2 and aq, to one f32 row per
//   assignment (`part`); ReduceKernel sums each token's K rows in order (no atomics).
// Assignments to experts outside [0, E) (another device's) add nothing.
#include <cuda_runtime.h>

#include "act_quant_cuda.h"
#include "fp8_tile_cuda.h"
#include "op_args.h"

namespace dsv4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kChunkBytes = 16;  // weight bytes a lane loads at once (a uint4)
constexpr int64_t kSharedBytes = 48 * 1024;

// Values a lane's chunk holds: 32 packed e2m1 codes or 16 e4m3 values.
DSV4_HD int64_t ChunkValues(const ExpertStackView& s) { return s.fp4 ? 2 * kChunkBytes : kChunkBytes; }

// Shared bytes of `rows` quantised activation rows of `width`: e4m3 values (each row rounded up
// to 16 bytes, so every row starts aligned), then the f32 scales.
DSV4_HD int64_t RowStride(int64_t width) { return (width + 15) / 16 * 16; }
DSV4_HD int64_t SharedBytes(int64_t rows, int64_t width) {
  return rows * RowStride(width) + rows * ((width + kActBlock - 1) / kActBlock) * static_cast<int64_t>(sizeof(float));
}

// The scaled dot of row `row` of expert e of stack s, over the lane's chunks, with one quantised
// activation row (xq e4m3 bytes, xs f32 scales per 128); the lane's partial, to be warp-summed.
__device__ float LaneRowDot(const ExpertStackView& s, int64_t e, int64_t row, const uint8_t* xq, const float* xs) {
  const int lane = threadIdx.x % 32;
  const int64_t per_chunk = ChunkValues(s);
  const int64_t in_blocks = (s.in + kWeightBlock - 1) / kWeightBlock;
  float acc = 0.0f;
  // Unrolled so that a lane has several 16-byte loads in flight (FLASH's rows are 4 chunks a lane).
#pragma unroll 4
  for (int64_t c0 = lane * per_chunk; c0 < s.in; c0 += 32 * per_chunk) {
    const int64_t n = min(per_chunk, s.in - c0);
    float part = 0.0f, w_scale;
    float xv[16];
    if (s.fp4) {  // in % 32 == 0 (checked): whole chunks, 16-byte aligned, one scale group each
      const uint8_t* codes = s.weight + (e * s.out + row) * (s.in / 2) + c0 / 2;
      const uint4 raw = *reinterpret_cast<const uint4*>(codes);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
      w_scale = E8m0ToFloat(s.scale[(e * s.out + row) * (s.in / kFp4Group) + c0 / kFp4Group]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        DecodeE4m3x16(*reinterpret_cast<const uint4*>(xq + c0 + 16 * half), xv);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const uint32_t byte = (words[(8 * half + i / 2) / 4] >> (8 * ((8 * half + i / 2) % 4))) & 0xffu;
          part = fmaf(xv[i], E2m1ToFloat(static_cast<uint8_t>((i & 1) ? byte >> 4 : byte & 0xfu)), part);
        }
      }
    } else {
      const uint8_t* values = s.weight + (e * s.out + row) * s.in + c0;
      const bool aligned = s.in % 16 == 0;
      float wv[16];
      LoadE4m3x16(values, n, aligned, wv);
      LoadE4m3x16(xq + c0, n, aligned, xv);
      w_scale = E8m0ToFloat(s.scale[(e * ((s.out + kWeightBlock - 1) / kWeightBlock) + row / kWeightBlock) * in_blocks +
                                    c0 / kWeightBlock]);
#pragma unroll
      for (int i = 0; i < 16; ++i) part = fmaf(xv[i], wv[i], part);
    }
    acc = fmaf(part, xs[c0 / kActBlock] * w_scale, acc);
  }
  return acc;
}

// Quantises `rows` activation rows of `width` (row r at element offset + r * width of src, f32 |
// bf16) into shared memory, a warp per (row, 128-block).
__device__ void QuantizeRows(const void* src, Elem type, int64_t offset, int64_t rows, int64_t width, uint8_t* xq,
                             float* xs) {
  const int64_t blocks = (width + kActBlock - 1) / kActBlock;
  for (int64_t p = threadIdx.x / 32; p < rows * blocks; p += kWarps) {
    const int64_t r = p / blocks, lo = (p % blocks) * kActBlock;
    WarpQuantizeActBlock(src, type, offset + r * width + lo, min(kActBlock, width - lo),
                         xq + r * RowStride(width) + lo, xs + p);
  }
  __syncthreads();
}

__device__ __forceinline__ bool Local(int32_t e, int64_t experts) { return e >= 0 && e < experts; }

__global__ void __launch_bounds__(kThreads) GateUpKernel(MoeArgs a, const void* x, const int32_t* sel,
                                                         const float* route_w, float limit, float* act) {
  extern __shared__ __align__(16) uint8_t shared[];
  const int64_t t = blockIdx.y;
  uint8_t* xq = shared;
  float* xs = reinterpret_cast<float*>(shared + RowStride(a.d));
  QuantizeRows(x, a.x_type, t * a.d, 1, a.d, xq, xs);
  const int64_t f = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (f >= a.f) return;
  for (int64_t j = 0; j < a.k; ++j) {
    const int32_t e = sel[t * a.k + j];
    if (!Local(e, a.e)) continue;
    // Both rows' loads are issued before either warp sum waits on them.
    const float g_part = LaneRowDot(a.w1, e, f, xq, xs), u_part = LaneRowDot(a.w3, e, f, xq, xs);
    const float g = WarpSum(g_part), u = WarpSum(u_part);
    if (threadIdx.x % 32 == 0) {
      const float gc = fminf(g, limit);
      const float v = gc / (1.0f + expf(-gc)) * fminf(fmaxf(u, -limit), limit) * route_w[t * a.k + j];
      act[(t * a.k + j) * a.f + f] = a.x_type == Elem::kBf16 ? Bf16ToFloat(FloatToBf16(v)) : v;  // x's dtype
    }
  }
}

__global__ void __launch_bounds__(kThreads) DownKernel(MoeArgs a, const int32_t* sel, const float* act, float* y) {
  extern __shared__ __align__(16) uint8_t shared[];
  const int64_t t = blockIdx.y;
  uint8_t* aq = shared;  // [K, F] e4m3, rows RowStride(F) apart
  float* as = reinterpret_cast<float*>(shared + a.k * RowStride(a.f));
  QuantizeRows(act, Elem::kF32, t * a.k * a.f, a.k, a.f, aq, as);
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (d >= a.d) return;
  const int64_t f_blocks = (a.f + kActBlock - 1) / kActBlock;
  // The lane's partials of the K experts, in order, then one warp sum: the experts' loads overlap.
  float part = 0.0f;
  for (int64_t j = 0; j < a.k; ++j) {
    const int32_t e = sel[t * a.k + j];
    if (Local(e, a.e)) part += LaneRowDot(a.w2, e, d, aq + j * RowStride(a.f), as + j * f_blocks);
  }
  const float out = WarpSum(part);
  if (threadIdx.x % 32 == 0) y[t * a.d + d] = out;
}

ffi::Error MoeExpertsCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> sel,
                          ffi::Buffer<ffi::F32> route_w, ffi::AnyBuffer w1, ffi::Buffer<ffi::U8> s1, ffi::AnyBuffer w3,
                          ffi::Buffer<ffi::U8> s3, ffi::AnyBuffer w2, ffi::Buffer<ffi::U8> s2,
                          ffi::Result<ffi::Buffer<ffi::F32>> y, ffi::Result<ffi::Buffer<ffi::F32>> act, float limit) {
  MoeArgs a;
  if (auto e = ParseMoe(x, sel, route_w, {&w1, &w3, &w2}, {&s1, &s3, &s2}, y->dimensions(), &a); e.failure()) {
    return e;
  }
  if (auto e = CheckActivationScratch(act->dimensions(), a); e.failure()) return e;
  if (a.t == 0 || a.d == 0) return ffi::Error::Success();
  if (SharedBytes(1, a.d) > kSharedBytes || SharedBytes(a.k, a.f) > kSharedBytes) {
    return Invalid("moe_experts: D or K x F too large for the CUDA kernel's shared memory");
  }
  if (a.t > 65535) return Invalid("moe_experts: too many tokens for one call of the CUDA kernel");
  if (a.f > 0) {
    const dim3 gate_grid(static_cast<unsigned>((a.f + kWarps - 1) / kWarps), static_cast<unsigned>(a.t));
    GateUpKernel<<<gate_grid, kThreads, SharedBytes(1, a.d), stream>>>(a, x.untyped_data(), sel.typed_data(),
                                                                       route_w.typed_data(), limit, act->typed_data());
    if (auto e = LastCudaError("GateUpKernel"); e.failure()) return e;
  }
  const dim3 down_grid(static_cast<unsigned>((a.d + kWarps - 1) / kWarps), static_cast<unsigned>(a.t));
  DownKernel<<<down_grid, kThreads, SharedBytes(a.k, a.f), stream>>>(a, sel.typed_data(), act->typed_data(),
                                                                     y->typed_data());
  return LastCudaError("DownKernel");
}

// ---------------------------------------------------------------- grouped by expert

// The routing plan: the tile of assignments a block takes.
struct Tile {
  int64_t expert, first, count;  // order[first, first + count) are the expert's assignments
};

// Tile `b` of the plan (groups [E, 3]: first sorted position, count, running tile count), or
// false past the last tile (the grid is sized for the most tiles any routing can need).
__device__ bool FindTile(const int32_t* groups, int64_t experts, int64_t tile_tokens, int64_t b, Tile* tile) {
  int64_t lo = 0, hi = experts;  // the first expert whose running tile count exceeds b
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (groups[3 * mid + 2] > b) hi = mid; else lo = mid + 1;
  }
  if (lo == experts) return false;
  const int64_t first = groups[3 * lo], count = groups[3 * lo + 1], tiles_end = groups[3 * lo + 2];
  const int64_t local = b - (tiles_end - (count + tile_tokens - 1) / tile_tokens);
  *tile = {lo, first + local * tile_tokens, min(tile_tokens, count - local * tile_tokens)};
  return true;
}

// The tile's assignments (order[...], -1 past its count) into assigns[0 .. 8 kNb), and the
// activation rows the products read into cols: tokens (assignment / K) or the assignments.
template <int kNb>
__device__ void TileColumns(const int32_t* order, const Tile& tile, int64_t k, bool tokens, int64_t* assigns,
                            int64_t* cols) {
  const int c = threadIdx.x;
  if (c < 8 * kNb) {
    const int64_t assign = c < tile.count ? order[tile.first + c] : -1;
    assigns[c] = assign;
    cols[c] = assign < 0 ? -1 : tokens ? assign / k : assign;
  }
  __syncthreads();
}

template <int kNb>
__global__ void __launch_bounds__(kTileThreads) GroupedGateUpKernel(MoeArgs a, const uint8_t* xq, const float* xs,
                                                                    const int32_t* order, const int32_t* groups,
                                                                    const float* route_w, float limit, int stages,
                                                                    uint8_t* aq, float* as) {
  extern __shared__ __align__(16) uint8_t shared[];
  __shared__ float block_amax[kTileWarps][8 * kNb];
  __shared__ int64_t assigns[8 * kNb], cols[8 * kNb];
  Tile tile;
  if (!FindTile(groups, a.e, 8 * kNb, blockIdx.x, &tile)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int64_t f_block = blockIdx.y, block_row0 = f_block * kTileRows, row0 = block_row0 + kRowsPerWarp * warp;
  TileColumns<kNb>(order, tile, a.k, true, assigns, cols);
  float acc[2][kNb][4];
  const ExpertStackView stacks[2] = {a.w1, a.w3};
  BlockTileProducts<2, kNb>(stacks, tile.expert, block_row0, xq, xs, cols, shared, stages, acc);

  // The activations, in x's dtype, then the amax of each column over the block's 128 rows.
  float act[kNb][4], amax[kNb][2];
#pragma unroll
  for (int nb = 0; nb < kNb; ++nb) {
    amax[nb][0] = amax[nb][1] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = row0 + g + 8 * (i / 2), assign = assigns[8 * nb + 2 * q + i % 2];
      float v = 0.0f;
      if (row < a.f && assign >= 0) {
        const float gc = fminf(acc[0][nb][i], limit);
        v = gc / (1.0f + expf(-gc)) * fminf(fmaxf(acc[1][nb][i], -limit), limit) * route_w[assign];
        if (a.x_type == Elem::kBf16) v = Bf16ToFloat(FloatToBf16(v));
      }
      act[nb][i] = v;
      amax[nb][i % 2] = fmaxf(amax[nb][i % 2], fabsf(v));
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      for (int o = 4; o < 32; o <<= 1) amax[nb][c] = fmaxf(amax[nb][c], __shfl_xor_sync(0xffffffffu, amax[nb][c], o));
      if (g == 0) block_amax[warp][8 * nb + 2 * q + c] = amax[nb][c];
    }
  }
  __syncthreads();
  const int64_t f_blocks = (a.f + kActBlock - 1) / kActBlock;
#pragma unroll
  for (int nb = 0; nb < kNb; ++nb) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int64_t assign = assigns[8 * nb + 2 * q + c];
      if (assign < 0) continue;
      float m = 0.0f;
#pragma unroll
      for (int w = 0; w < kTileWarps; ++w) m = fmaxf(m, block_amax[w][8 * nb + 2 * q + c]);
      const float scale = E8m0ToFloat(BlockScaleByte(m, kFp8Max));
      if (warp == 0 && g == 0) as[assign * f_blocks + f_block] = scale;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = row0 + g + 8 * h;
        if (row < a.f) aq[assign * a.f + row] = GridFloatToE4m3(RoundE4m3(act[nb][2 * h + c] / scale));
      }
    }
  }
}

template <int kNb>
__global__ void __launch_bounds__(kTileThreads) GroupedDownKernel(MoeArgs a, const uint8_t* aq, const float* as,
                                                                  const int32_t* order, const int32_t* groups,
                                                                  int stages, float* part) {
  extern __shared__ __align__(16) uint8_t shared[];
  __shared__ int64_t assigns[8 * kNb], cols[8 * kNb];
  Tile tile;
  if (!FindTile(groups, a.e, 8 * kNb, blockIdx.x, &tile)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int64_t block_row0 = static_cast<int64_t>(blockIdx.y) * kTileRows, row0 = block_row0 + kRowsPerWarp * warp;
  TileColumns<kNb>(order, tile, a.k, false, assigns, cols);
  float acc[1][kNb][4];
  const ExpertStackView stacks[1] = {a.w2};
  BlockTileProducts<1, kNb>(stacks, tile.expert, block_row0, aq, as, cols, shared, stages, acc);
#pragma unroll
  for (int nb = 0; nb < kNb; ++nb) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = row0 + g + 8 * (i / 2), assign = assigns[8 * nb + 2 * q + i % 2];
      if (row < a.d && assign >= 0) part[assign * a.d + row] = acc[0][nb][i];
    }
  }
}

// y[t, d] = the sum over the token's local assignments j = 0..K-1, in order, of part[t K + j, d].
__global__ void __launch_bounds__(kThreads) ReduceKernel(MoeArgs a, const int32_t* sel, const float* part, float* y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= a.t * a.d) return;
  const int64_t t = i / a.d, d = i % a.d;
  float out = 0.0f;
  for (int64_t j = 0; j < a.k; ++j) {
    if (Local(sel[t * a.k + j], a.e)) out += part[(t * a.k + j) * a.d + d];
  }
  y[i] = out;
}

template <int kNb>
ffi::Error LaunchGrouped(cudaStream_t stream, const MoeArgs& a, int64_t max_tiles, const uint8_t* xq, const float* xs,
                         const int32_t* order, const int32_t* groups, const float* route_w, float limit, uint8_t* aq,
                         float* as, float* part) {
  const bool fp4 = a.w1.fp4;
  const int gate_stages = PipelineStages<2, kNb>(fp4), down_stages = PipelineStages<1, kNb>(fp4);
  if (gate_stages == 0 || down_stages == 0) return Invalid("moe_experts: the device has too little shared memory");
  const dim3 gate_grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((a.f + kTileRows - 1) / kTileRows));
  if (auto e = LaunchPipelined(GroupedGateUpKernel<kNb>, "GroupedGateUpKernel", gate_grid,
                               gate_stages * StageBytes<2, kNb>(fp4), stream, a, xq, xs, order, groups, route_w, limit,
                               gate_stages, aq, as);
      e.failure()) {
    return e;
  }
  const dim3 down_grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((a.d + kTileRows - 1) / kTileRows));
  return LaunchPipelined(GroupedDownKernel<kNb>, "GroupedDownKernel", down_grid, down_stages * StageBytes<1, kNb>(fp4),
                         stream, a, aq, as, order, groups, down_stages, part);
}

ffi::Error MoeExpertsGroupedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> sel,
                                 ffi::Buffer<ffi::F32> route_w, ffi::AnyBuffer w1, ffi::Buffer<ffi::U8> s1,
                                 ffi::AnyBuffer w3, ffi::Buffer<ffi::U8> s3, ffi::AnyBuffer w2, ffi::Buffer<ffi::U8> s2,
                                 ffi::Buffer<ffi::S32> order, ffi::Buffer<ffi::S32> groups,
                                 ffi::Result<ffi::Buffer<ffi::F32>> y, ffi::Result<ffi::Buffer<ffi::U8>> xq,
                                 ffi::Result<ffi::Buffer<ffi::F32>> xs, ffi::Result<ffi::Buffer<ffi::U8>> aq,
                                 ffi::Result<ffi::Buffer<ffi::F32>> as, ffi::Result<ffi::Buffer<ffi::F32>> part,
                                 float limit, int32_t tile_tokens) {
  MoeArgs a;
  if (auto e = ParseMoe(x, sel, route_w, {&w1, &w3, &w2}, {&s1, &s3, &s2}, y->dimensions(), &a); e.failure()) {
    return e;
  }
  if (auto e = CheckGroupedMoe(order.dimensions(), groups.dimensions(), xq->dimensions(), xs->dimensions(),
                               aq->dimensions(), as->dimensions(), part->dimensions(), tile_tokens, a);
      e.failure()) {
    return e;
  }
  if (a.t == 0 || a.d == 0) return ffi::Error::Success();
  const int64_t assignments = a.t * a.k;
  const int64_t reduce_blocks = (a.t * a.d + kThreads - 1) / kThreads;
  if (assignments > 0 && a.f > 0) {
    if (auto e = LaunchQuantizeRows(stream, x.untyped_data(), a.x_type, a.t, a.d, xq->typed_data(), xs->typed_data());
        e.failure()) {
      return e;
    }
    const int64_t max_tiles = GroupedMaxTiles(assignments, a.e, tile_tokens);
    const auto launch = tile_tokens == 8 ? LaunchGrouped<1> : tile_tokens == 16 ? LaunchGrouped<2> : LaunchGrouped<4>;
    if (auto e = launch(stream, a, max_tiles, xq->typed_data(), xs->typed_data(), order.typed_data(),
                        groups.typed_data(), route_w.typed_data(), limit, aq->typed_data(), as->typed_data(),
                        part->typed_data());
        e.failure()) {
      return e;
    }
  } else if (cudaMemsetAsync(part->typed_data(), 0, part->size_bytes(), stream) != cudaSuccess) {
    return LastCudaError("moe_experts zero fill");
  }
  ReduceKernel<<<static_cast<unsigned>(reduce_blocks), kThreads, 0, stream>>>(a, sel.typed_data(), part->typed_data(),
                                                                             y->typed_data());
  return LastCudaError("ReduceKernel");
}

}  // namespace
}  // namespace dsv4

namespace ffi = xla::ffi;

namespace {

// The stream, then the arguments of Dsv4MoeExpertsCpu (moe_experts_cpu.cc): both CUDA forms'.
auto BindMoeArgs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()         // x [T, D]
      .Arg<ffi::Buffer<ffi::S32>>()  // selected experts [T, K]
      .Arg<ffi::Buffer<ffi::F32>>()  // routing weights [T, K]
      .Arg<ffi::AnyBuffer>()         // w1
      .Arg<ffi::Buffer<ffi::U8>>()   // w1 scales
      .Arg<ffi::AnyBuffer>()         // w3
      .Arg<ffi::Buffer<ffi::U8>>()   // w3 scales
      .Arg<ffi::AnyBuffer>()         // w2
      .Arg<ffi::Buffer<ffi::U8>>();  // w2 scales
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4MoeExpertsCuda, dsv4::MoeExpertsCuda,
                              BindMoeArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // activation scratch [T, K, F]
                                  .Attr<float>("limit"),
                              {ffi::Traits::kCmdBufferCompatible});

// Then the routing plan and the scratch (moe_experts/ffi.py sizes them).
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4MoeExpertsGroupedCuda, dsv4::MoeExpertsGroupedCuda,
                              BindMoeArgs()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // order [T K]: assignments sorted by expert
                                  .Arg<ffi::Buffer<ffi::S32>>()  // groups [E, 3]: first, count, running tiles
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, D]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // xq [T, D] e4m3
                                  .Ret<ffi::Buffer<ffi::F32>>()  // xs [T, ceil(D / 128)]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // aq [T K, F] e4m3
                                  .Ret<ffi::Buffer<ffi::F32>>()  // as [T K, ceil(F / 128)]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // part [T K, D]
                                  .Attr<float>("limit")
                                  .Attr<int32_t>("tile"),
                              {ffi::Traits::kCmdBufferCompatible});
