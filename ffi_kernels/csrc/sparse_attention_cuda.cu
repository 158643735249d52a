// sparse_attention on CUDA: the twin of dsv4/ops/sparse_attention/reference.py and of
// sparse_attention_cpu.cc (same arguments, same semantics; the CPU kernel ignores the
// decoded-table workspace). Three kernels:
//
// ProducerAttentionKernel (SM90a; the FLASH FP8 layout, one part a query: prefill): two
// computing warpgroups on wgmma and a producer warpgroup that fills their tiles (its section
// below). Its decoded-table mode, where the caller gives a workspace, copies the tiles from the
// tables decoded once a call (DecodeFlashTablesKernel) instead of decoding them per query.
//
// TensorCoreAttentionKernel (bf16 q; tables of bf16 or e4m3 values with bf16 rope, at most 16
// scale bytes a row; head dim a multiple of 32 up to 512): one block per (query, 64 heads), 8
// warps. Each tile of selected rows is decoded once into shared memory as bf16 (e4m3 x E8M0 is
// exact in bf16) and used by all 64 heads. Softmax online with the sink as the starting max
// (m = sink, l = 1), in base 2. Two decoded-tile buffers: while tile n is computed from one, the
// next tile is decoded into the other (one block barrier a tile where each thread decodes the
// bytes it loaded itself: the FLASH FP8 layout), and tile n + 3's slots are resolved from
// indices loaded a tile earlier. Two codes:
//   - mma.sync m16n8k16 (bf16 in, f32 accumulate; SM90 and SM120) over 32-row tiles. Warp w
//     owns heads 16 (w % 4) .. +16 and output columns (w / 4) * H/2 .. +H/2; the two warps of a
//     head group each compute its S over half of the head dim and add the other's half from
//     shared memory, so both hold the whole S (a + b == b + a). A tile's stored bytes are copied
//     into a staging buffer two tiles ahead (cp.async; FLASH FP8: into registers).
//   - wgmma (the FLASH FP8 layout in the SM90a code) over 64-row tiles: warpgroup w computes S
//     for all 64 heads over the tile's rows 32w .. +32 and the whole head dim, the two exchange
//     row maxima and bf16 P, and each multiplies the whole P by V for its 256 output columns
//     (the kernel's comment says why this split).
// Few queries (decode) would leave most SMs idle, so the caller may split each query's slots
// into S parts (grid z; only part 0 counts the sink). Up to kMaxClusterParts parts run as one
// thread-block cluster (fewer, longer parts where clusters of S blocks would not all be
// resident at once): each block leaves its unnormalised output, max and denominator in its
// shared memory and the cluster's blocks merge them over distributed shared memory, each
// writing a slice of the output (MergeClusterParts). More parts write them to the split
// scratch and CombineSplitsKernel merges them.
//
// ScalarAttentionKernel (everything else: f32 inputs, odd widths): one warp per head, f32 FMA.
#include <cuda_bf16.h>
#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "cuda_common.h"
#include "cuda_tiles.h"
#include "op_args.h"
#include "wgmma.h"

namespace dsv4 {
namespace {

constexpr int kHeadsPerBlock = 8;
constexpr int kChunk = 16;
constexpr int kMaxHeadDim = 512;
constexpr int kPerLane = kMaxHeadDim / 32;

struct Slot {
  int table;  // 0 ring, 1 fresh, 2 compressed, -1 none
  int64_t row;
};

// The stored index of selected slot j (< end) of a query: window slot j or compressed slot
// j - w_n; -1 past the end. (A global load: the tensor-core kernel issues it a tile early.)
__device__ __forceinline__ int32_t SlotIndex(int64_t j, int64_t end, int64_t w_n, const int32_t* window_idx,
                                             const int32_t* comp_idx) {
  if (j >= end) return -1;
  return j < w_n ? window_idx[j] : comp_idx[j - w_n];
}

// Which table row slot j with stored index i reads: a window index below the ring's rows is a
// ring row, above it a fresh row (clipped to the fresh rows); a compressed index a pool row.
__device__ __forceinline__ Slot SlotOf(int64_t j, int32_t i, int64_t w_n, int64_t ring_rows, int64_t fresh_rows,
                                       int64_t comp_rows) {
  if (i < 0) return {-1, 0};
  if (j < w_n) {
    if (i < ring_rows) return {0, i};
    if (fresh_rows == 0) return {-1, 0};
    const int64_t f = i - ring_rows;
    return {1, f < fresh_rows ? f : fresh_rows - 1};
  }
  if (i >= comp_rows) return {-1, 0};
  return {2, i};
}

__device__ Slot ResolveSlot(int64_t j, int64_t w_n, const int32_t* window_idx, const int32_t* comp_idx,
                            int64_t ring_rows, int64_t fresh_rows, int64_t comp_rows) {
  return SlotOf(j, SlotIndex(j, INT64_MAX, w_n, window_idx, comp_idx), w_n, ring_rows, fresh_rows, comp_rows);
}

__global__ void ScalarAttentionKernel(const void* q, Elem q_type, TableView ring, TableView fresh, TableView comp,
                                      const int32_t* window_idx, int64_t w_n, const int32_t* comp_idx, int64_t x_n,
                                      const float* sink, void* out, int64_t n_n, int64_t h_n, float scale) {
  __shared__ float kv[kChunk][kMaxHeadDim];
  __shared__ Slot slots[kChunk];
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t head = static_cast<int64_t>(blockIdx.y) * kHeadsPerBlock + warp;
  const bool active = head < n_n;
  const int64_t qo = (t * n_n + (active ? head : 0)) * h_n;

  float qr[kPerLane], acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t k = lane + 32 * i;
    qr[i] = active && k < h_n ? LoadElem(q, q_type, qo + k) : 0.0f;
    acc[i] = 0.0f;
  }
  float m = active ? sink[head] : 0.0f, l = 1.0f;
  const TableView* tables[3] = {&ring, &fresh, &comp};
  const int64_t total = w_n + x_n;
  for (int64_t base = 0; base < total; base += kChunk) {
    if (threadIdx.x < kChunk) {
      const int64_t j = base + threadIdx.x;
      slots[threadIdx.x] = j < total ? ResolveSlot(j, w_n, window_idx + t * w_n, comp_idx + t * x_n, ring.rows,
                                                   fresh.rows, comp.rows)
                                     : Slot{-1, 0};
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < kChunk * h_n; e += blockDim.x) {
      const int r = static_cast<int>(e / h_n);
      const int64_t k = e % h_n;
      const Slot s = slots[r];
      kv[r][k] = s.table >= 0 ? DecodeEntry(*tables[s.table], s.row, k) : 0.0f;
    }
    __syncthreads();
    if (active) {
      for (int r = 0; r < kChunk; ++r) {
        if (slots[r].table < 0) continue;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int64_t k = lane + 32 * i;
          if (k < h_n) dot += qr[i] * kv[r][k];
        }
        const float s = WarpSum(dot) * scale;
        const float m_new = fmaxf(m, s);
        const float c = expf(m - m_new), p = expf(s - m_new);
        l = l * c + p;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int64_t k = lane + 32 * i;
          acc[i] = acc[i] * c + (k < h_n ? p * kv[r][k] : 0.0f);
        }
        m = m_new;
      }
    }
    __syncthreads();
  }
  if (!active) return;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t k = lane + 32 * i;
    if (k < h_n) StoreFloat(out, q_type, qo + k, acc[i] / l);
  }
}

// ---------------------------------------------------------------- tensor-core path

constexpr int kTcHeads = 64;  // heads per block: 4 groups of 16 (the mma's M)
constexpr int kTcThreads = 256;
constexpr int kTile = 32;  // selected rows per shared-memory tile
// Row padding in bf16 elements: consecutive rows start 16 B apart modulo 128 B, so the eight
// row addresses of an ldmatrix hit different banks.
constexpr int kPad = 8;
constexpr int kMaxOutBlocks = kMaxHeadDim / 2 / 8;  // 8-column blocks of a warp's output half
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kEmptyMax = -1e30f;  // the running max of a split part with no rows yet (finite: no inf - inf)
constexpr float kMaxSlack = 8.0f;    // how far (log2) scores may pass the running max before it moves
constexpr int kMaxScales = 16;       // scale bytes per row the staging holds (TensorCoreServes)
constexpr int kScaleLoads = kTile * kMaxScales / kTcThreads;  // a tile's scale bytes per thread

// A staged row of table t: its stored value bytes, then its rope from the next 16-byte
// boundary (16-byte reads); the staging stride of a tile row is the largest of the three
// tables' staged rows, padded by ConflictFreeStride.
DSV4_HD int64_t RopeOffset(const TableView& t) { return (t.value_bytes() + 15) / 16 * 16; }
DSV4_HD int64_t RowBytes(const TableView& t) { return RopeOffset(t) + t.rope_width * 2; }

// Rows of `bytes` padded to an odd number of 16-byte units, so that the same 16-byte column of
// eight consecutive rows lies in eight different bank groups (shared memory serves a warp's
// 16-byte accesses eight lanes at a time, conflict-free when those eight differ).
constexpr int64_t ConflictFreeStride(int64_t bytes) {
  const int64_t units = (bytes + 15) / 16;
  return 16 * (units % 2 == 1 ? units : units + 1);
}

int64_t StageStride(const TableView& ring, const TableView& fresh, const TableView& comp) {
  int64_t most = 0;
  for (const TableView* t : {&ring, &fresh, &comp}) {
    if (t->rows > 0) most = std::max(most, RowBytes(*t));  // an empty table is never read
  }
  return ConflictFreeStride(most);
}

constexpr int kTcWarps = kTcThreads / 32;
constexpr int kScoreBlocks = kTile / 8;  // 8-row blocks of a tile: a warp's S fragments
constexpr int kSlotBuffers = 4;          // tiles whose slots are live at once (the kernel's pipeline)
constexpr int kTileRowsFlash = 2 * kTile;  // rows of a tile of the FLASH FP8 wgmma code (a warpgroup's 32 each)
constexpr int kMaxClusterParts = 8;      // split parts merged on chip (the portable cluster size)

// Shared memory: q [64][h + pad] and two decoded tiles [2][rows][h + pad] in bf16 (rows: kTile,
// or kTileRowsFlash for the FLASH FP8 layout), the staged raw tile [32][stage] and its scale
// bytes [32][16], then the exchange between warps: each warp's half-dim S fragments [8 warps][4
// blocks][32 lanes] float4 (mma.sync), or each warpgroup's P [2][64][32] bf16 and row maxima
// [2][64] f32 (wgmma).
constexpr int64_t kExchangeBytes = kTcWarps * kScoreBlocks * 32 * sizeof(float4);
static_assert(2 * kTcHeads * kTile * 2 + 2 * kTcHeads * 4 <= kExchangeBytes, "the wgmma exchange fits");
// The cluster merge's f32 o_s takes the q and tile rows' room (64 + 2 * 32 >= 2 * 64 bf16 rows);
// its (m, l) pairs and weights the exchange's.
static_assert(kTcHeads <= 2 * kTile && kTcHeads * (sizeof(float2) + kMaxClusterParts * sizeof(float)) <= kExchangeBytes,
              "the cluster merge fits");
int64_t TensorCoreSharedBytes(int64_t h, int64_t stage, int64_t rows) {
  return (kTcHeads + 2 * rows) * (h + kPad) * 2 + kTile * stage + kTile * kMaxScales + kExchangeBytes;
}

struct TableViews {
  TableView t[3];  // ring, fresh, compressed
};

// A barrier for the two warps of head group `group` (warps group and group + 4): named barrier
// 1 + group (0 is __syncthreads'), 64 threads.
__device__ __forceinline__ void PairBarrier(int group) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(1 + group) : "memory");
}

__device__ __forceinline__ float QuadMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float QuadSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Starts copying the stored bytes of a tile's rows into the staging buffer (8-byte cp.async:
// every row of values and rope is a multiple of 8 bytes) and loads this thread's share of
// their scale bytes into `scales` (no cp.async of single bytes); a row is skipped when its
// slot is empty.
__device__ __forceinline__ void StageTile(const Slot* slots, const TableView* views, unsigned char* stage,
                                          int stage_ld, uint8_t (&scales)[kScaleLoads]) {
  const int units = stage_ld / 8;
  for (int e = threadIdx.x; e < kTile * units; e += kTcThreads) {
    const int r = e / units, u = e % units;
    const Slot slot = slots[r];
    if (slot.table < 0) continue;
    const TableView& v = views[slot.table];
    const int64_t value_bytes = v.value_bytes(), rope_at = RopeOffset(v), at = 8 * static_cast<int64_t>(u);
    if (at < value_bytes) {
      CopyAsync8(stage + r * stage_ld + at, static_cast<const unsigned char*>(v.values) + slot.row * value_bytes + at);
    } else if (at >= rope_at && at < rope_at + 2 * v.rope_width) {
      CopyAsync8(stage + r * stage_ld + at,
                 static_cast<const unsigned char*>(v.rope) + slot.row * 2 * v.rope_width + (at - rope_at));
    }
  }
#pragma unroll
  for (int i = 0; i < kScaleLoads; ++i) {
    const int e = threadIdx.x + i * kTcThreads, r = e / kMaxScales, c = e % kMaxScales;
    const Slot slot = slots[r];
    scales[i] = 127;
    if (slot.table >= 0 && c < views[slot.table].scales_width) {
      scales[i] = views[slot.table].scales[slot.row * views[slot.table].scales_width + c];
    }
  }
}

// The model's stored K=V row (KV_FP8 at FLASH dims): 448 e4m3 values with one E8M0 scale per
// 64, then 64 bf16 rope values; 576 bytes besides the scales, decoded to 512 bf16. When every
// table is in this layout the kernel stages and decodes with these constants (no per-chunk
// table lookups, divisions or format branches: those were most of a tile's instructions).
namespace flash_fp8 {
constexpr int kValues = 448, kBlock = 64, kScales = 7, kRope = 64, kHead = 512;
constexpr int kRopeUnits = 2 * kRope / 16;  // its rope's 16-byte units
}  // namespace flash_fp8

bool IsFlashFp8(const TableView& t) {
  using namespace flash_fp8;
  return t.rows == 0 || (t.values_type == Elem::kE4m3 && t.values_width == kValues && t.scales_width == kScales &&
                         t.block == kBlock && t.rope_type == Elem::kBf16 && t.rope_width == kRope);
}

// The FLASH FP8 tile's loads and decode, each thread on bytes of its own: thread t takes row
// t % 32 and part p = t / 32 of it (a warp's lanes are the tile's rows), scale block p < 7 (64
// e4m3 bytes, its scale byte) and 16-byte rope unit p. The bytes go to registers a tile ahead of
// their decode, not through a shared-memory staging buffer: a 32-row tile's staging was 38 KB of
// the ~230 KB of shared-memory traffic a tile costs, and shared-memory bandwidth bounds the
// kernel. Decoded rows in either layout put the eight lanes of each 16-byte store in eight bank
// groups: no shared-memory conflicts.
struct FlashFp8Part {
  uint4 values[flash_fp8::kBlock / 16];  // scale block `part` (parts below kScales)
  uint4 rope;                            // rope unit `part`
  uint8_t scale;                         // the block's E8M0 scale byte
};

__device__ __forceinline__ void LoadFlashFp8Part(const Slot* slots, const TableView* views, FlashFp8Part& raw) {
  using namespace flash_fp8;
  static_assert(kTcThreads == kTile * kRopeUnits && kScales <= kRopeUnits, "a warp per rope unit and scale block");
  raw.scale = 127;
  const int r = threadIdx.x % kTile, part = threadIdx.x / kTile;
  const Slot slot = slots[r];
  if (slot.table < 0) return;  // (the registers keep stale bytes: decoded, then not stored)
  const TableView& v = views[slot.table];
  if (part < kScales) {
    const unsigned char* values = static_cast<const unsigned char*>(v.values) + slot.row * kValues;
    const uint4* src = reinterpret_cast<const uint4*>(values + kBlock * part);
#pragma unroll
    for (int k = 0; k < kBlock / 16; ++k) raw.values[k] = __ldg(src + k);
    raw.scale = v.scales[slot.row * kScales + part];
  }
  raw.rope = __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(v.rope) + slot.row * (2 * kRope)) +
                   part);
}

// The decode of this thread's part of a FLASH FP8 tile (LoadFlashFp8Part's) into kv: rows of ld
// values, or (kCoreLayout) wgmma.h's core-matrix layout of 64 chunks a row.
template <bool kCoreLayout>
__device__ __forceinline__ void DecodeFlashFp8Tile(const Slot* tile, const FlashFp8Part& raw, uint16_t* kv, int ld) {
  using namespace flash_fp8;
  auto chunk = [&](int r, int c) {  // row r's 16-byte chunk c (values 8c .. 8c + 7)
    unsigned char* bytes = reinterpret_cast<unsigned char*>(kv);
    const int offset = kCoreLayout ? CoreChunkOffset(r, c, kHead / 8) : 2 * (r * ld + 8 * c);
    return reinterpret_cast<uint4*>(bytes + offset);
  };
  // An empty slot's row is stored as zeros by masking its words, not by choosing between the
  // decoded and a zero value: the choice compiled to a branch around each eight-value group, so
  // the groups' conversions ran one after another through the same registers (in the SASS).
  const int r = threadIdx.x % kTile, part = threadIdx.x / kTile;
  const uint32_t keep = tile[r].table >= 0 ? ~0u : 0u;
  auto masked = [keep](uint4 w) { return make_uint4(w.x & keep, w.y & keep, w.z & keep, w.w & keep); };
  if (part < kScales) {
    const float scale = E8m0ToFloat(raw.scale);
#pragma unroll
    for (int k = 0; k < kBlock / 16; ++k) {
      const uint4 w = raw.values[k];
      *chunk(r, kBlock / 8 * part + 2 * k) = masked(E4m3EightToBf16(make_uint2(w.x, w.y), scale));
      *chunk(r, kBlock / 8 * part + 2 * k + 1) = masked(E4m3EightToBf16(make_uint2(w.z, w.w), scale));
    }
  }
  *chunk(r, kValues / 8 + part) = masked(raw.rope);
}

// The on-chip merge of a cluster's split parts (the file comment): out = sum_s w_s o_s with
// w_s = 2^(m_s - M) / sum_s' 2^(m_s' - M) l_s' and M = max_s m_s. Each block has put its part in
// its own shared memory (o_s: [kTcHeads][h + kPad] f32; ml_s: [kTcHeads] (m, l)); the weights of
// a row are computed once, by one thread a row into this block's weight_s ([kMaxClusterParts]
// [kTcHeads] f32, not read by the peers), and block s of the S then writes the rows' 8-column
// units s, s + S, ... of the block's heads, each unit's loads from all parts issued together.
// (Written per float4 unit, each recomputing its row's weights from remote (m, l) loads with
// exp2f and four IEEE divisions, the merge held 28% of a 38-us C64 decode call's stall samples
// on an H200; this form took 5.9 us off the call.) The cluster barriers make the parts visible
// before the merge and keep every block's shared memory alive until its peers have read it.
__device__ void MergeClusterParts(const float* o_s, const float2* ml_s, float* weight_s, uint16_t* out, int64_t t,
                                  int64_t head0, int64_t n_n, int h_n) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int parts = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  if (threadIdx.x < kTcHeads) {
    const int r = threadIdx.x;
    float2 ml[kMaxClusterParts];
    float big = kEmptyMax;
#pragma unroll
    for (int p = 0; p < kMaxClusterParts; ++p) {
      if (p < parts) ml[p] = cluster.map_shared_rank(ml_s, p)[r], big = fmaxf(big, ml[p].x);
    }
    float denom = 0.0f;
#pragma unroll
    for (int p = 0; p < kMaxClusterParts; ++p) {
      if (p < parts) ml[p].x = exp2f(ml[p].x - big), denom += ml[p].x * ml[p].y;
    }
    const float inverse = 1.0f / denom;  // > 0 for a head's row: part 0 carries the sink
#pragma unroll
    for (int p = 0; p < kMaxClusterParts; ++p) {
      if (p < parts) weight_s[p * kTcHeads + r] = ml[p].x * inverse;
    }
  }
  __syncthreads();
  const int units_per_row = h_n / 8, ld = h_n + kPad;
  for (int u = rank * kTcThreads + threadIdx.x; u < kTcHeads * units_per_row; u += parts * kTcThreads) {
    const int r = u / units_per_row, k = 8 * (u % units_per_row);
    if (head0 + r >= n_n) continue;
    float4 lo[kMaxClusterParts], hi[kMaxClusterParts];
#pragma unroll
    for (int p = 0; p < kMaxClusterParts; ++p) {
      if (p < parts) {
        const float4* unit = reinterpret_cast<const float4*>(cluster.map_shared_rank(o_s, p) + r * ld + k);
        lo[p] = unit[0], hi[p] = unit[1];
      }
    }
    float acc[8] = {};
#pragma unroll
    for (int p = 0; p < kMaxClusterParts; ++p) {
      if (p < parts) {
        const float w = weight_s[p * kTcHeads + r];
        acc[0] += w * lo[p].x, acc[1] += w * lo[p].y, acc[2] += w * lo[p].z, acc[3] += w * lo[p].w;
        acc[4] += w * hi[p].x, acc[5] += w * hi[p].y, acc[6] += w * hi[p].z, acc[7] += w * hi[p].w;
      }
    }
    *reinterpret_cast<uint4*>(out + (t * n_n + head0 + r) * h_n + k) =
        make_uint4(PackBf16(acc[0], acc[1]), PackBf16(acc[2], acc[3]), PackBf16(acc[4], acc[5]),
                   PackBf16(acc[6], acc[7]));
  }
  cluster.sync();
}

// The P V products of both FLASH FP8 wgmma kernels, over a warpgroup's 256 columns of O: P from
// the warpgroup's own registers (its own tile) or from the other's shared-memory P tile, V the
// decoded tile read with its rows along K (MN-major).
using OwnPvAtom = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K,
                                                                cute::SM90::GMMA::Major::MN>;
using OtherPvAtom = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                                  cute::SM90::GMMA::Major::MN>;

// A warpgroup's P (bf16 A fragments of its S accumulators: register e of k-step ks holds heads
// row_lo (e even) or row_hi, rows 16 ks + 8 (e / 2) + 2c and + 1) into its core-matrix tile
// [64 heads][kRowsP rows] in shared memory, fenced for the other warpgroup's wgmma.
template <int kRowsP>
__device__ __forceinline__ void StorePTile(const uint32_t (&p_frag)[kRowsP / 16][4], int row_lo, int row_hi, int c,
                                           unsigned char* p_tile) {
#pragma unroll
  for (int ks = 0; ks < kRowsP / 16; ++ks) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      *reinterpret_cast<uint32_t*>(p_tile + CoreChunkOffset(e % 2 ? row_hi : row_lo, 2 * ks + e / 2, kRowsP / 8) +
                                   4 * c) = p_frag[ks][e];
    }
  }
  FenceSharedForAsyncProxy();
}

// Query t's q rows for heads head0 .. head0 + kTcHeads - 1 (h values each) into q_s by `cp.async`,
// copied by the block's threads `thread` = first, first + 1, ... in steps of `threads`; rows past
// the last head (head0 + r >= n_n) are zeros. kCoreLayout: wgmma.h's core-matrix layout, in
// CoreLayoutCopyOrder (a warp's stores fill 512 contiguous bytes: no bank conflicts); otherwise
// rows of ld values. The caller commits and waits.
template <bool kCoreLayout>
__device__ __forceinline__ void CopyQHeads(const uint16_t* q, int64_t t, int64_t head0, int64_t n_n, int h, int ld,
                                           void* q_s, int thread, int threads) {
  const int chunks = h / 8;  // 16-byte chunks a row
  for (int e = thread; e < kTcHeads * chunks; e += threads) {
    int r = e / chunks, c = e % chunks;
    if constexpr (kCoreLayout) CoreLayoutCopyOrder(e, chunks, r, c);
    void* dst = kCoreLayout ? static_cast<void*>(static_cast<unsigned char*>(q_s) + CoreChunkOffset(r, c, chunks))
                            : static_cast<void*>(static_cast<uint16_t*>(q_s) + r * ld + 8 * c);
    const int64_t head = head0 + r;
    if (head < n_n) {
      CopyAsync16(dst, q + (t * n_n + head) * h + 8 * c);
    } else {
      *static_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
}

// ---------------------------------------------------------------- producer warpgroup
//
// ProducerAttentionKernel: the alternating-tile schedule of the FLASH FP8 wgmma code (SM90a, one
// part a query: prefill) with a third warpgroup that resolves, loads and decodes every tile, so
// that the tile loads leave the computing warpgroups. Warpgroups 0 and 1 compute: warpgroup w
// runs S and the softmax of tiles 2s + w, read from decoded buffer w, and keeps O's columns
// 256 w .. +256 for every tile (its own tile's P from registers, the other's from shared memory;
// while one is in its softmax the other's products run: FlashMLA's sparse prefill split).
// Warpgroup 2 fills the buffers in tile order: for each column half of tile m it loads the
// bytes into registers, waits until that half of buffer m % 2 is free (tile m - 2 read it for the
// last time), and decodes them there; the half freed first is loaded first. Half h of a buffer
// is read last by warpgroup h (its P V; the owner's S comes before the P exchange that precedes
// the other's P V), so warpgroup h frees it. setmaxnreg moves registers from the producer (which
// holds one half's bytes) to the computing warpgroups (O's 128 accumulators, S's 32, P's 16).
namespace producer {
constexpr int kThreads = 384;
constexpr int kSlotRing = 4;  // tiles whose slots are live at once (the kernel's comment)
// Launched at 168 registers a thread (65536 / 384): the producer gives back 168 - 88 = 80 a
// thread, the two computing warpgroups take 2 x (208 - 168) = 80 of them.
constexpr int kLaunchRegisters = 168, kComputeRegisters = 208, kProducerRegisters = 88;
static_assert(2 * (kComputeRegisters - kLaunchRegisters) <= kLaunchRegisters - kProducerRegisters,
              "setmaxnreg takes no more than it gives back (else the computing warpgroups wait forever)");
// Named barriers (0 is __syncthreads'), 256 threads each: one side arrives, the other syncs.
enum Barrier : int {
  kMaxA = 1,    // warpgroup 0's running max after its tile (0 arrives, 1 syncs)
  kMaxB,        // warpgroup 1's, after the tile that follows (1 arrives, 0 syncs)
  kPA,          // P of tile A in shared memory (0 arrives, 1 syncs)
  kPB,          // P of tile B (1 arrives, 0 syncs)
  kFull00,      // kFull00 + 2 b + h: half h of buffer b filled (the producer arrives, warpgroup b
  kFull01,      // syncs; its S starts on the half filled first)
  kFull10,
  kFull11,
  kFree00,      // kFree00 + 2 b + h: half h of buffer b read for the last time (warpgroup h
  kFree01,      // arrives, the producer syncs)
  kFree10,
  kFree11,
  kCompute,     // warpgroups 0 and 1 among themselves
};
__device__ __forceinline__ int FreeBarrier(int buffer, int half) { return kFree00 + 2 * buffer + half; }
__device__ __forceinline__ int FullBarrier(int buffer, int half) { return kFull00 + 2 * buffer + half; }
}  // namespace producer

__device__ __forceinline__ void BarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void BarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// setmaxnreg (SM90a): this warpgroup's registers a thread raised or lowered to kRegisters.
template <int kRegisters>
__device__ __forceinline__ void RaiseRegisters() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

template <int kRegisters>
__device__ __forceinline__ void LowerRegisters() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

// A warpgroup thread's bytes of one column half of a 64-row FLASH FP8 tile: row i % 64 (i the
// thread's index in its warpgroup), part p = i / 64. The left half (columns 0..255: scale blocks
// 0..3) gives part p blocks 2p and 2p + 1; the right half (256..511: blocks 4..6, then the 64
// bf16 rope values) gives part 0 blocks 4 and 5 and rope units 0 and 1, part 1 block 6 and rope
// units 2..7. They come in two quarters, loaded and decoded one after the other, so that one is in
// flight while the other is decoded: quarter 0 is the first block (four 16-byte units and its
// E8M0 byte); quarter 1 the rest (the left half's second block; part 0's block 5 and rope units
// 0 and 1; part 1's rope units 2..7).
template <int kQuarter>
struct FlashQuarter {
  uint4 bytes[kQuarter == 0 ? 4 : 6];  // the e4m3 values of its block (if any), then its rope units
  uint8_t scale;                       // its block's E8M0 byte
};

template <bool kRight>
__device__ __forceinline__ int FlashHalfFirstBlock(int part) {
  return kRight ? 4 + 2 * part : 2 * part;
}

// Whether quarter kQuarter of this part of the half has a scale block (the right half's part 1
// has only block 6, in its quarter 0).
template <bool kRight, int kQuarter>
__device__ __forceinline__ bool FlashQuarterHasBlock(int part) {
  return !(kRight && kQuarter == 1 && part == 1);
}

template <bool kRight, int kQuarter>
__device__ __forceinline__ void LoadFlashQuarter(Slot slot, const TableView* views, FlashQuarter<kQuarter>& raw) {
  using namespace flash_fp8;
  constexpr int kUnits = sizeof(raw.bytes) / sizeof(uint4);
  const int part = (threadIdx.x % 128) / kTileRowsFlash;  // warp-uniform
  // Every byte defined on every path (zeros for an empty slot, then masked anyway): otherwise the
  // previous tile's bytes stay live through the loads, as far as the compiler can tell.
#pragma unroll
  for (int k = 0; k < kUnits; ++k) raw.bytes[k] = make_uint4(0, 0, 0, 0);
  raw.scale = 127;
  if (slot.table < 0) return;
  const TableView& v = views[slot.table];
  if (FlashQuarterHasBlock<kRight, kQuarter>(part)) {
    const int block = FlashHalfFirstBlock<kRight>(part) + kQuarter;
    const uint4* values = reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(v.values) +
                                                         slot.row * kValues + kBlock * block);
#pragma unroll
    for (int k = 0; k < kBlock / 16; ++k) raw.bytes[k] = __ldg(values + k);
    raw.scale = v.scales[slot.row * kScales + block];
  }
  if constexpr (kRight && kQuarter == 1) {
    const uint4* rope =
        reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(v.rope) + slot.row * (2 * kRope));
    if (part == 0) {
      raw.bytes[4] = __ldg(rope);
      raw.bytes[5] = __ldg(rope + 1);
    } else {
#pragma unroll
      for (int u = 0; u < 6; ++u) raw.bytes[u] = __ldg(rope + 2 + u);
    }
  }
}

// The decode of LoadFlashQuarter's bytes into the tile `kv` (wgmma.h's core-matrix layout, 64
// chunks a row). An empty slot's row comes out as zeros with no mask: its bytes were loaded as
// zeros and its scale as 1.
template <bool kRight, int kQuarter>
__device__ __forceinline__ void DecodeFlashQuarter(const FlashQuarter<kQuarter>& raw, unsigned char* kv) {
  using namespace flash_fp8;
  const int i = threadIdx.x % 128, r = i % kTileRowsFlash, part = i / kTileRowsFlash;
  auto store = [&](int c, uint4 w) {  // row r's chunk c (values 8c .. 8c + 7)
    *reinterpret_cast<uint4*>(kv + CoreChunkOffset(r, c, kHead / 8)) = w;
  };
  if (FlashQuarterHasBlock<kRight, kQuarter>(part)) {
    const int block = FlashHalfFirstBlock<kRight>(part) + kQuarter;
    const float scale = E8m0ToFloat(raw.scale);
#pragma unroll
    for (int k = 0; k < kBlock / 16; ++k) {
      const uint4 w = raw.bytes[k];
      store(kBlock / 8 * block + 2 * k, E4m3EightToBf16(make_uint2(w.x, w.y), scale));
      store(kBlock / 8 * block + 2 * k + 1, E4m3EightToBf16(make_uint2(w.z, w.w), scale));
    }
  }
  if constexpr (kRight && kQuarter == 1) {
    if (part == 0) {
      store(kValues / 8, raw.bytes[4]);
      store(kValues / 8 + 1, raw.bytes[5]);
    } else {
#pragma unroll
      for (int u = 0; u < 6; ++u) store(kValues / 8 + 2 + u, raw.bytes[u]);
    }
  }
}

// Shared memory of ProducerAttentionKernel: q [64 heads][512] and two decoded tiles [2][64][512]
// in bf16 (q in the core-matrix layout; the tiles in it too, or in the 128-byte-swizzle layout of
// the decoded-table mode), then each computing warpgroup's P [2][64 heads][64 rows] bf16.
constexpr int64_t kProducerSharedBytes =
    (kTcHeads + 2 * kTileRowsFlash) * flash_fp8::kHead * 2 + 2 * kTcHeads * kTileRowsFlash * 2;

// ---------------------------------------------------------------- decoded tables
//
// A long prefill chunk reads each stored row for many of its queries (the 64k chunk of the
// benchmark ~500 times a row), and ProducerAttentionKernel's FLASH FP8 mode decodes the row
// every time, through registers that hold only one half tile's bytes in flight (so a load's
// latency is exposed once a pair of tiles; BENCHMARKS.md, twenty-sixth to twenty-eighth
// sessions). Given a workspace (dsv4/ops/sparse_attention/ffi.py sizes it: only where each row
// is read often enough), DecodeFlashTablesKernel decodes the three tables once into bf16 rows
// [ring rows | fresh rows | pool rows][512] (the same conversion as the producer's, so the
// same bf16 values), and the kernel's decoded-table mode copies its tiles from there with
// cp.async: no registers hold bytes in flight and there is no decode in the loop.
__global__ void DecodeFlashTablesKernel(TableViews tables, uint16_t* decoded, int64_t rows) {
  using namespace flash_fp8;
  constexpr int kChunks = kHead / 8;  // 16-byte chunks of a decoded row: 56 of values, 8 of rope
  const int64_t fresh_at = tables.t[0].rows, comp_at = fresh_at + tables.t[1].rows;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < rows * kChunks; e += stride) {
    const int64_t row = e / kChunks;
    const int c = static_cast<int>(e % kChunks);
    const int table = row < fresh_at ? 0 : row < comp_at ? 1 : 2;
    const TableView& v = tables.t[table];
    const int64_t r = row - (table == 0 ? 0 : table == 1 ? fresh_at : comp_at);
    uint4 chunk;
    if (c < kValues / 8) {
      const uint2 bytes = *reinterpret_cast<const uint2*>(static_cast<const unsigned char*>(v.values) + r * kValues + 8 * c);
      chunk = E4m3EightToBf16(bytes, E8m0ToFloat(v.scales[r * kScales + c / (kBlock / 8)]));
    } else {
      chunk = reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(v.rope) + r * (2 * kRope))[c - kValues / 8];
    }
    reinterpret_cast<uint4*>(decoded)[e] = chunk;
  }
}

// The tiles of the decoded-table mode, in wgmma's 128-byte-swizzle layout (WgmmaDescriptorSwizzle128):
// column group g (values 64 g .. +64) of a [64 rows][512] tile is 64 rows of 128 bytes, row r at
// r * 128 with its chunk u (8 values) at ((u ^ r % 8) * 16). Read with the rows as N it is S's
// K-major operand; with the rows along K, P V's MN-major one. A warp's cp.async of four rows of a
// group then writes four whole 128-byte lines (the core-matrix layout would put a row's eight
// chunks in eight core matrices: cp.async writes shared memory a source line at a time, so that
// took 8x the wavefronts, as q's copy does; twenty-seventh session).
constexpr int kSwizzleGroupBytes = kTileRowsFlash * 128;

// The byte offset of an S k-step (16 values: K-major) and of a P V k-step (16 rows: MN-major)
// in either tile layout.
template <bool kSwizzled>
__device__ __forceinline__ uint32_t ScoreKStepBytes(int kk) {
  return kSwizzled ? (kk / 4) * kSwizzleGroupBytes + (kk % 4) * 32 : kk * 2 * 128;
}
template <bool kSwizzled>
__device__ __forceinline__ uint32_t ValueKStepBytes(int ks) {
  return kSwizzled ? ks * 2 * 1024 : ks * 2 * (flash_fp8::kHead / 8) * 128;
}

// The producer warpgroup of the decoded-table mode: the FLASH FP8 mode's schedule (tile m into
// buffer m % 2, each half copied once the computing warpgroups have freed it, in the order they
// free them; the slots of tile m into ring entry m % kSlotRing at the same points), with the
// copies in flight in cp.async groups instead of registers. Thread i of the warpgroup copies
// rows 16 (i / 32) + 4 k + (i % 32) / 8 (k < 4) of every tile, chunk i % 8 of each of the half's
// four column groups: a warp instruction reads four rows' 128 contiguous bytes and writes four
// whole lines of shared memory. An empty slot's row is copied as zeros (cp.async's zero fill),
// so that P = 0 never meets stale shared memory.
__device__ __forceinline__ void ProduceDecodedTiles(const uint16_t* decoded, const int32_t* w_idx,
                                                    const int32_t* x_idx, int64_t w_n, int64_t end, int64_t pairs,
                                                    const TableView* views, Slot (*slots)[kTileRowsFlash],
                                                    unsigned char* kv_s) {
  using namespace producer;
  constexpr int kH = flash_fp8::kHead, kRows = kTileRowsFlash, kTileBytes = kRows * kH * 2;
  const int i = threadIdx.x % 128, u = i % 8, row0 = 16 * (i / 32) + (i % 32) / 8;
  const uint32_t tiles_at = static_cast<uint32_t>(__cvta_generic_to_shared(kv_s));
  if (tiles_at % 1024 != 0) __trap();  // the swizzle's atoms (the kernel's shared-memory alignment)
  const int64_t fresh_at = views[0].rows, comp_at = fresh_at + views[1].rows;  // the workspace's row order
  int32_t ahead[4];  // the stored index of each of this thread's rows of the next tile
#pragma unroll
  for (int k = 0; k < 4; ++k) ahead[k] = SlotIndex(row0 + 4 * k, end, w_n, w_idx, x_idx);
  // This thread's rows of tile m: each one's decoded row (at this thread's chunk), nullptr for
  // an empty slot; the slots go to the ring (one thread a row writes them).
  auto resolve = [&](int64_t m, const uint16_t* (&src)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = row0 + 4 * k;
      const int64_t j = m * kRows + r;
      const Slot slot = SlotOf(j, ahead[k], w_n, views[0].rows, views[1].rows, views[2].rows);
      ahead[k] = SlotIndex(j + kRows, end, w_n, w_idx, x_idx);
      if (u == 0) slots[m % kSlotRing][r] = slot;
      const int64_t at = slot.table == 0 ? 0 : slot.table == 1 ? fresh_at : comp_at;
      src[k] = slot.table < 0 ? nullptr : decoded + (at + slot.row) * kH + 8 * u;
    }
  };
  // Column half `half` of this thread's rows into tile buffer `buffer`, as one cp.async group.
  auto copy_half = [&](const uint16_t* const (&src)[4], int buffer, int half) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = row0 + 4 * k;
      const uint32_t row_at = tiles_at + buffer * kTileBytes + r * 128 + ((u ^ (r % 8)) * 16);
#pragma unroll
      for (int g = 4 * half; g < 4 * half + 4; ++g) {
        CopyAsync16OrZeros(row_at + g * kSwizzleGroupBytes, src[k] ? src[k] + 64 * g : decoded, src[k] != nullptr);
      }
    }
    cute::cp_async_fence();
  };
  // A half's barrier as soon as its group has landed (fenced for the wgmma reads).
  auto filled = [&](int buffer, int half) {
    FenceSharedForAsyncProxy();
    BarrierArrive(FullBarrier(buffer, half), 256);
  };
  const uint16_t* a[4];
  const uint16_t* b[4];
  resolve(0, a);
  resolve(1, b);
#pragma unroll 1
  for (int64_t s = 0; s < pairs; ++s) {
    const bool again = s > 0, has_next = s + 1 < pairs;
    if (again) BarrierSync(FreeBarrier(0, 0), 256);
    copy_half(a, 0, 0);
    if (again) BarrierSync(FreeBarrier(1, 1), 256);
    copy_half(b, 1, 1);
    if (!again) {  // the first pair: every half is free; all four in flight at once
      copy_half(a, 0, 1);
      copy_half(b, 1, 0);
      cute::cp_async_wait<3>();
      filled(0, 0);
      cute::cp_async_wait<1>();
      filled(0, 1);
      filled(1, 1);
      cute::cp_async_wait<0>();
      filled(1, 0);
    } else {
      cute::cp_async_wait<1>();
      filled(0, 0);
      cute::cp_async_wait<0>();
      filled(1, 1);
      BarrierSync(FreeBarrier(0, 1), 256);
      copy_half(a, 0, 1);
      cute::cp_async_wait<0>();
      filled(0, 1);
    }
    if (has_next) resolve(2 * s + 2, a);  // (tile 2s - 2 is past its softmax: its frees were synced)
    if (again) {
      BarrierSync(FreeBarrier(1, 0), 256);
      copy_half(b, 1, 0);
      cute::cp_async_wait<0>();
      filled(1, 0);
    }
    if (has_next) resolve(2 * s + 3, b);
  }
}

// kDecoded: the decoded-table mode (its tiles copied from `decoded`, DecodeFlashTablesKernel's
// rows, into the 128-byte-swizzle layout); else the FLASH FP8 mode (decoded = nullptr).
template <bool kDecoded>
__global__ void __launch_bounds__(producer::kThreads, 1)
    ProducerAttentionKernel(const uint16_t* q, TableViews tables, const int32_t* window_idx, int64_t w_n,
                            const int32_t* comp_idx, int64_t x_n, const float* sink, uint16_t* out, int64_t n_n,
                            float scale_log2, const uint16_t* decoded) {
  using namespace producer;
  constexpr int kH = flash_fp8::kHead, kRows = kTileRowsFlash, kChunks = kH / 8, kGroupBytes = kChunks * 128;
  constexpr int kPChunks = kRows / 8, kPGroupBytes = kPChunks * 128, kPBytes = kTcHeads * kRows * 2;
  constexpr int kBlocks = kRows / 8;  // 8-row blocks of S (the m64n64 accumulator's columns)
  // (1024-byte alignment: the swizzled tiles' atoms; q's 64 KB keep the tiles aligned.)
  extern __shared__ __align__(1024) unsigned char producer_smem[];
  __shared__ Slot slots[kSlotRing][kRows];
  __shared__ TableView views[3];
  __shared__ float max_s[2][kTcHeads];  // the running max after each computing warpgroup's tile (then l)
  unsigned char* q_s = producer_smem;               // [kTcHeads][kH]
  unsigned char* kv_s = q_s + kTcHeads * kH * 2;    // [2][kRows][kH]: tile m in buffer m % 2
  unsigned char* p_s = kv_s + 2 * kRows * kH * 2;   // [2][kTcHeads][kRows]
  const int64_t t = blockIdx.x, head0 = static_cast<int64_t>(blockIdx.y) * kTcHeads;
  const int32_t* w_idx = window_idx + t * w_n;
  const int32_t* x_idx = comp_idx + t * x_n;
  // At least one pair: with no slots the tiles are empty (P = 0) and every barrier still meets.
  const int64_t end = w_n + x_n, pairs = max(static_cast<int64_t>(1), (end + 2 * kRows - 1) / (2 * kRows));
  const int wg = WarpgroupIndex();
  if (threadIdx.x < 3) views[threadIdx.x] = tables.t[threadIdx.x];
  __syncthreads();  // views staged (the last barrier of all three warpgroups)
  if constexpr (!kWgmmaCompiled) __trap();  // the host launches it only where the SM90a code runs

  if (wg == 2) {
    // The producer, a pair of tiles (A = 2s in buffer 0, B = 2s + 1 in buffer 1) at a time; a
    // last odd tile past the end is all empty slots, decoded to zeros, which its P of 0
    // multiplies (stale shared memory could hold NaN). The halves go in the order they are
    // freed: A's left (warpgroup 0's own P V), B's right (warpgroup 1's), then A's right and B's
    // left (each the other's P V, near the end of the pair). One half's bytes are in registers at
    // a time (the computing warpgroups need 208 registers: at 200 ptxas serialises their wgmma),
    // as two quarters: each quarter is loaded as soon as the one before it in its register set
    // (two quarters earlier) is decoded, so that it is in flight while the other set is decoded
    // and while the free of its half is awaited (one half at a time left each load's latency
    // between two decodes: the computing warpgroups then waited on the full barriers).
    LowerRegisters<kProducerRegisters>();
    if constexpr (kDecoded) {
      ProduceDecodedTiles(decoded, w_idx, x_idx, w_n, end, pairs, views, slots, kv_s);
      return;
    }
    const int i = threadIdx.x % 128, r = i % kRows;
    unsigned char* buffer_a = kv_s;
    unsigned char* buffer_b = kv_s + kRows * kH * 2;
    int32_t ahead = SlotIndex(r, end, w_n, w_idx, x_idx);  // row r's stored index, a tile early
    // Row r of tile m: its slot, into ring entry m % kSlotRing (tile m - kSlotRing's, last read in
    // that tile's softmax, before the frees of it that this warpgroup has synced on since).
    auto resolve = [&](int64_t m) {
      const int64_t j = m * kRows + r;
      const Slot slot = SlotOf(j, ahead, w_n, views[0].rows, views[1].rows, views[2].rows);
      ahead = SlotIndex(j + kRows, end, w_n, w_idx, x_idx);
      if (i < kRows) slots[m % kSlotRing][r] = slot;
      return slot;
    };
    FlashQuarter<0> x0;
    FlashQuarter<1> x1;
    Slot a = resolve(0), b = resolve(1);
    LoadFlashQuarter<false, 0>(a, views, x0);
    LoadFlashQuarter<false, 1>(a, views, x1);
#pragma unroll 1
    for (int64_t s = 0; s < pairs; ++s) {
      const bool again = s > 0, has_next = s + 1 < pairs;
      if (again) BarrierSync(FreeBarrier(0, 0), 256);
      DecodeFlashQuarter<false, 0>(x0, buffer_a);
      LoadFlashQuarter<true, 0>(b, views, x0);
      DecodeFlashQuarter<false, 1>(x1, buffer_a);
      FenceSharedForAsyncProxy();
      BarrierArrive(FullBarrier(0, 0), 256);
      LoadFlashQuarter<true, 1>(b, views, x1);
      if (again) BarrierSync(FreeBarrier(1, 1), 256);
      DecodeFlashQuarter<true, 0>(x0, buffer_b);
      LoadFlashQuarter<true, 0>(a, views, x0);
      DecodeFlashQuarter<true, 1>(x1, buffer_b);
      FenceSharedForAsyncProxy();
      BarrierArrive(FullBarrier(1, 1), 256);
      LoadFlashQuarter<true, 1>(a, views, x1);
      if (again) BarrierSync(FreeBarrier(0, 1), 256);
      DecodeFlashQuarter<true, 0>(x0, buffer_a);
      LoadFlashQuarter<false, 0>(b, views, x0);
      DecodeFlashQuarter<true, 1>(x1, buffer_a);
      FenceSharedForAsyncProxy();  // read by warpgroup 0's wgmma
      BarrierArrive(FullBarrier(0, 1), 256);
      LoadFlashQuarter<false, 1>(b, views, x1);
      if (has_next) {  // (tiles 2s - 2 and 2s - 1 are past their softmax: their frees were synced)
        a = resolve(2 * s + 2);
      }
      if (again) BarrierSync(FreeBarrier(1, 0), 256);
      DecodeFlashQuarter<false, 0>(x0, buffer_b);
      if (has_next) LoadFlashQuarter<false, 0>(a, views, x0);
      DecodeFlashQuarter<false, 1>(x1, buffer_b);
      FenceSharedForAsyncProxy();  // read by warpgroup 1's wgmma
      BarrierArrive(FullBarrier(1, 0), 256);
      if (has_next) {
        LoadFlashQuarter<false, 1>(a, views, x1);
        b = resolve(2 * s + 3);
      }
    }
    return;
  }

  // The computing warpgroups (the alternating schedule: see the kernel's comment and the
  // barriers' roles). A running max is shared along the sequence of tiles: A's from B's
  // previous one, B's from A's; each warpgroup rescales its own O and l when it adopts a new
  // one, so both end in the same frame. The sink's exp(0) is counted by warpgroup 0.
  RaiseRegisters<kComputeRegisters>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp % 4, g = lane / 4, c = lane % 4;
  CopyQHeads<true>(q, t, head0, n_n, kH, 0, q_s, threadIdx.x, 2 * 128);
  CopyAsyncCommitAndWaitAll();
  FenceSharedForAsyncProxy();  // q (and its zero rows) read by wgmma
  BarrierSync(kCompute, 256);  // q landed

  using ScoreAtom = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                                 cute::SM90::GMMA::Major::K>;
  const int64_t head_lo = head0 + group * 16 + g, head_hi = head_lo + 8;
  const int row_lo = group * 16 + g, row_hi = row_lo + 8;  // this thread's heads in the block
  float m_lo = head_lo < n_n ? sink[head_lo] * kLog2e : 0.0f;
  float m_hi = head_hi < n_n ? sink[head_hi] * kLog2e : 0.0f;
  float l_lo = c == 0 && wg == 0 ? 1.0f : 0.0f, l_hi = l_lo;
  float o[kMaxOutBlocks][4];
#pragma unroll
  for (int b = 0; b < kMaxOutBlocks; ++b) o[b][0] = o[b][1] = o[b][2] = o[b][3] = 0.0f;
  float(&o_acc)[kMaxOutBlocks * 4] = reinterpret_cast<float(&)[kMaxOutBlocks * 4]>(o);

  const unsigned char* kv_own = kv_s + wg * kRows * kH * 2;
  const unsigned char* kv_other = kv_s + (wg ^ 1) * kRows * kH * 2;
  const uint64_t q_desc = WgmmaDescriptor(q_s, 128, kGroupBytes);
  // K and V over this warpgroup's columns (the tile read with its rows along K: MN-major).
  const uint64_t k_own = kDecoded ? WgmmaDescriptorSwizzle128(kv_own, 16, 1024) : WgmmaDescriptor(kv_own, 128, kGroupBytes);
  const uint64_t v_own = kDecoded ? WgmmaDescriptorSwizzle128(kv_own + wg * 4 * kSwizzleGroupBytes, kSwizzleGroupBytes, 1024)
                                  : WgmmaDescriptor(kv_own + wg * (kChunks / 2) * 128, kGroupBytes, 128);
  const uint64_t v_other = kDecoded
                               ? WgmmaDescriptorSwizzle128(kv_other + wg * 4 * kSwizzleGroupBytes, kSwizzleGroupBytes, 1024)
                               : WgmmaDescriptor(kv_other + wg * (kChunks / 2) * 128, kGroupBytes, 128);
  const uint64_t p_other = WgmmaDescriptor(p_s + (wg ^ 1) * kPBytes, 128, kPGroupBytes);
  unsigned char* p_own = p_s + wg * kPBytes;

  float acc[kBlocks * 4];  // S of this warpgroup's tile: [8-row block b][4]
  auto issue_scores = [&]() {
    // The wgmma's accumulators are in-out operands: without this the previous tile's P would
    // count as live up to here (the first k-step ignores them).
#pragma unroll
    for (int e = 0; e < kBlocks * 4; ++e) acc[e] = 0.0f;
    // The descriptors made opaque here: they are the same every tile, and the compiler
    // otherwise hoists all 64 k-step descriptors out of the loop and spills them.
    uint64_t q_at = q_desc, k_at = k_own;
    asm volatile("" : "+l"(q_at), "+l"(k_at));
    FenceOperands(acc);
    // The half of the tile filled first (warpgroup w's own half w: it freed it first), then the
    // other, each once its barrier says it is there.
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      const int half = wg ^ part;
      BarrierSync(FullBarrier(wg, half), 256);
      const uint64_t q_half = WgmmaDescriptorAt(q_at, half * (kH / 32) * 2 * 128);
      const uint64_t k_half = WgmmaDescriptorAt(k_at, half * ScoreKStepBytes<kDecoded>(kH / 32));
      cute::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < kH / 32; ++kk) {  // two 16-byte chunks a k-step
        WgmmaSs<ScoreAtom>(WgmmaDescriptorAt(q_half, kk * 2 * 128),
                           WgmmaDescriptorAt(k_half, ScoreKStepBytes<kDecoded>(kk)), acc, part > 0 || kk > 0);
      }
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    FenceOperands(acc);
  };
  issue_scores();  // this warpgroup's first tile, as its halves are filled

#pragma unroll 1
  for (int64_t s = 0; s < pairs; ++s) {
    const Slot* tile = slots[(2 * s + wg) % kSlotRing];
    const bool has_next = s + 1 < pairs;
    // The softmax: masked rows, the rows' maxima against the reference max (B: A's, just
    // published), moved only past kMaxSlack (as the other codes' lazy max).
    float max_lo = -INFINITY, max_hi = -INFINITY;
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = tile[b * 8 + 2 * c + e].table >= 0;
        acc[4 * b + e] = valid ? acc[4 * b + e] * scale_log2 : -INFINITY;
        acc[4 * b + 2 + e] = valid ? acc[4 * b + 2 + e] * scale_log2 : -INFINITY;
        max_lo = fmaxf(max_lo, acc[4 * b + e]);
        max_hi = fmaxf(max_hi, acc[4 * b + 2 + e]);
      }
    }
    max_lo = QuadMax(max_lo), max_hi = QuadMax(max_hi);
    float ref_lo = m_lo, ref_hi = m_hi;
    if (wg == 1) {
      BarrierSync(kMaxA, 256);
      ref_lo = max_s[0][row_lo], ref_hi = max_s[0][row_hi];
    }
    const bool move = __any_sync(0xffffffffu, max_lo > ref_lo + kMaxSlack || max_hi > ref_hi + kMaxSlack);
    const float new_lo = move ? fmaxf(ref_lo, max_lo) : ref_lo, new_hi = move ? fmaxf(ref_hi, max_hi) : ref_hi;
    auto rescale = [&](float to_lo, float to_hi) {  // O and l from frame m to frame `to`
      if (__any_sync(0xffffffffu, to_lo != m_lo || to_hi != m_hi)) {
        const float f_lo = exp2f(m_lo - to_lo), f_hi = exp2f(m_hi - to_hi);
        l_lo *= f_lo, l_hi *= f_hi;
#pragma unroll
        for (int b = 0; b < kMaxOutBlocks; ++b) o[b][0] *= f_lo, o[b][1] *= f_lo, o[b][2] *= f_hi, o[b][3] *= f_hi;
      }
      m_lo = to_lo, m_hi = to_hi;
    };
    rescale(new_lo, new_hi);
    float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        acc[4 * b + e] = exp2f(acc[4 * b + e] - m_lo);
        acc[4 * b + 2 + e] = exp2f(acc[4 * b + 2 + e] - m_hi);
        sum_lo += acc[4 * b + e];
        sum_hi += acc[4 * b + 2 + e];
      }
    }
    l_lo += sum_lo, l_hi += sum_hi;
    uint32_t p_frag[kRows / 16][4];  // P as bf16 A fragments (k-step ks: rows 16 ks .. +16)
#pragma unroll
    for (int ks = 0; ks < kRows / 16; ++ks) {
      p_frag[ks][0] = PackBf16(acc[8 * ks], acc[8 * ks + 1]);
      p_frag[ks][1] = PackBf16(acc[8 * ks + 2], acc[8 * ks + 3]);
      p_frag[ks][2] = PackBf16(acc[8 * ks + 4], acc[8 * ks + 5]);
      p_frag[ks][3] = PackBf16(acc[8 * ks + 6], acc[8 * ks + 7]);
    }
    if (c == 0) max_s[wg][row_lo] = m_lo, max_s[wg][row_hi] = m_hi;
    BarrierArrive(wg == 0 ? kMaxA : kMaxB, 256);
    auto store_p = [&]() { StorePTile<kRows>(p_frag, row_lo, row_hi, c, p_own); };
    // O += P V over this warpgroup's columns of the other's tile; then that half of the other's
    // buffer is free.
    auto other_products = [&]() {
      FenceOperands(o_acc);
      cute::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < kRows / 16; ++ks) {
        WgmmaSs<OtherPvAtom>(WgmmaDescriptorAt(p_other, ks * 2 * 128),
                             WgmmaDescriptorAt(v_other, ValueKStepBytes<kDecoded>(ks)), o_acc, true);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      FenceOperands(o_acc);
      if (has_next) BarrierArrive(FreeBarrier(wg ^ 1, wg), 256);
    };
    auto own_products_done = [&]() {
      cute::warpgroup_wait<0>();
      FenceOperands(o_acc);
      FenceOperands(p_frag[0]), FenceOperands(p_frag[1]), FenceOperands(p_frag[2]), FenceOperands(p_frag[3]);
      if (has_next) BarrierArrive(FreeBarrier(wg, wg), 256);  // S and this P V were its last reads
    };
    // O += P V over this warpgroup's columns of its own tile (B stores its P first: a wgmma's
    // register operand may not be read while it is in flight).
    if (wg == 1) {
      store_p();
      BarrierArrive(kPB, 256);
    }
    FenceOperands(o_acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < kRows / 16; ++ks) {
      WgmmaRs<OwnPvAtom>(p_frag[ks], WgmmaDescriptorAt(v_own, ValueKStepBytes<kDecoded>(ks)), o_acc, true);
    }
    cute::warpgroup_commit_batch();
    if (wg == 0) {
      own_products_done();
      BarrierSync(kMaxB, 256);
      const float b_lo = max_s[1][row_lo], b_hi = max_s[1][row_hi];
      if (__any_sync(0xffffffffu, b_lo != m_lo || b_hi != m_hi)) {  // P_A into B's frame too
        const uint32_t f_lo = PackBf16(exp2f(m_lo - b_lo), exp2f(m_lo - b_lo));
        const uint32_t f_hi = PackBf16(exp2f(m_hi - b_hi), exp2f(m_hi - b_hi));
#pragma unroll
        for (int ks = 0; ks < kRows / 16; ++ks) {
#pragma unroll
          for (int e = 0; e < 4; ++e) p_frag[ks][e] = Bf16x2Mul(p_frag[ks][e], e % 2 ? f_hi : f_lo);
        }
      }
      rescale(b_lo, b_hi);
      store_p();
      BarrierArrive(kPA, 256);
      BarrierSync(kPB, 256);
      other_products();
    } else {
      own_products_done();
      BarrierSync(kPA, 256);
      other_products();
    }
    if (has_next) {
      issue_scores();  // this warpgroup's next tile, as its halves are filled
    }
  }
  // The denominator: each warpgroup summed its own tiles' P (and warpgroup 0 the sink), in the
  // same final frame.
  l_lo = QuadSum(l_lo), l_hi = QuadSum(l_hi);
  BarrierSync(kCompute, 256);  // every max_s read done
  if (c == 0) max_s[wg][row_lo] = l_lo, max_s[wg][row_hi] = l_hi;
  BarrierSync(kCompute, 256);
  l_lo += max_s[wg ^ 1][row_lo];
  l_hi += max_s[wg ^ 1][row_hi];
  // The normalised output through shared memory (the q and tile region: every read of it is
  // done, the producer's last write came before this warpgroup's last S), in 16-byte stores.
  constexpr int ld = kH + kPad;
  uint16_t* out_s = reinterpret_cast<uint16_t*>(producer_smem);  // [kTcHeads][ld]
  const float inv_lo = 1.0f / l_lo, inv_hi = 1.0f / l_hi;
#pragma unroll
  for (int b = 0; b < kMaxOutBlocks; ++b) {
    const int col = wg * (kH / 2) + b * 8 + 2 * c;
    *reinterpret_cast<uint32_t*>(out_s + row_lo * ld + col) = PackBf16(o[b][0] * inv_lo, o[b][1] * inv_lo);
    *reinterpret_cast<uint32_t*>(out_s + row_hi * ld + col) = PackBf16(o[b][2] * inv_hi, o[b][3] * inv_hi);
  }
  BarrierSync(kCompute, 256);
  for (int e = threadIdx.x; e < kTcHeads * kChunks; e += 2 * 128) {
    const int row = e / kChunks, k = 8 * (e % kChunks);
    if (head0 + row < n_n) {
      *reinterpret_cast<uint4*>(out + (t * n_n + head0 + row) * kH + k) =
          *reinterpret_cast<const uint4*>(out_s + row * ld + k);
    }
  }
}

// kFixedH: the head dim as a compile-time constant (512, the model's), so that the loops over
// it unroll and its divisions become shifts; 0 reads it from h_arg. kFlashFp8: every table is
// in the FLASH FP8 layout (IsFlashFp8; kFixedH is then 512).
template <int kFixedH, bool kFlashFp8>
__global__ void __launch_bounds__(kTcThreads)
    TensorCoreAttentionKernel(const uint16_t* q, TableViews tables, const int32_t* window_idx, int64_t w_n,
                              const int32_t* comp_idx, int64_t x_n, const float* sink, uint16_t* out, int64_t n_n,
                              int64_t h_arg, float scale_log2, int64_t rows_per_split, int stage_ld, float* split_o,
                              float* split_ml, bool cluster_merge) {
  const int h_n = kFixedH ? kFixedH : static_cast<int>(h_arg);
  extern __shared__ __align__(16) uint16_t smem[];
  // kWgmma (the FLASH FP8 layout, SM90a code): S = Q K^T and O += P V on wgmma over 64-row
  // tiles, q and the tiles in wgmma.h's core-matrix layout (no row padding); otherwise mma.sync
  // over 32-row tiles from padded rows.
  constexpr bool kWgmma = kFlashFp8 && kWgmmaCompiled;
  constexpr int kRows = kWgmma ? kTileRowsFlash : kTile;  // a tile's rows
  // Tile n's slots are slots[n % 4]: resolved in iteration n - 3, staged and decoded in the
  // iterations before n, its mask in n.
  __shared__ Slot slots[kSlotBuffers][kTileRowsFlash];
  __shared__ TableView views[3];
  const int ld = h_n + kPad, row_elems = kWgmma ? h_n : ld;
  uint16_t* q_s = smem;                         // [kTcHeads][row_elems]
  uint16_t* kv_s = smem + kTcHeads * row_elems;  // [2][kRows][row_elems]: tile n in kv_s[n % 2]
  unsigned char* stage = reinterpret_cast<unsigned char*>(kv_s + 2 * kRows * row_elems);  // [kTile][stage_ld]
  uint8_t* scales_s = stage + kTile * stage_ld;                                     // [kTile][kMaxScales]
  float4* half_s = reinterpret_cast<float4*>(scales_s + kTile * kMaxScales);        // the exchange (kExchangeBytes)
  const int64_t t = blockIdx.x, head0 = static_cast<int64_t>(blockIdx.y) * kTcHeads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp % 4, half = warp / 4, g = lane / 4, c = lane % 4;
  const int chunks = h_n / 8;  // 16-byte chunks per decoded row
  const int32_t* w_idx = window_idx + t * w_n;
  const int32_t* x_idx = comp_idx + t * x_n;

  const int64_t total = w_n + x_n, first = blockIdx.z * rows_per_split;
  const int64_t end = min(total, first + rows_per_split);
  // Row r < kRows of tiles 0 .. 2: their stored indices loaded first, so that the chain index ->
  // slot -> tile load -> decode starts ahead of q's copies (which the slots do not wait for);
  // next_index: the stored index of row r of the next tile to resolve (tile 3's here).
  int32_t first_index[kSlotBuffers - 1];
  int32_t next_index = -1;
  if (threadIdx.x < kRows) {
#pragma unroll
    for (int d = 0; d < kSlotBuffers - 1; ++d) {
      first_index[d] = SlotIndex(first + d * kRows + threadIdx.x, end, w_n, w_idx, x_idx);
    }
    next_index = SlotIndex(first + (kSlotBuffers - 1) * kRows + threadIdx.x, end, w_n, w_idx, x_idx);
  }
  if (threadIdx.x < 3) views[threadIdx.x] = tables.t[threadIdx.x];
  CopyQHeads<kWgmma>(q, t, head0, n_n, h_n, ld, q_s, threadIdx.x, kTcThreads);  // lands with the first tile
  static_assert(!kFlashFp8 || kFixedH == flash_fp8::kHead, "the FLASH FP8 layout decodes to 512 values");
  uint8_t scale_regs[kScaleLoads];  // this thread's scale bytes of the tile being staged
  FlashFp8Part raw;                 // FLASH FP8: this thread's bytes of the 32 rows being staged
  // Stages the bytes of the 32 rows of slots `rows` (cp.async, or FLASH FP8: loads to registers)
  // and loads this thread's scale bytes of them.
  auto stage_rows = [&](const Slot* rows) {
    if constexpr (kFlashFp8) {
      LoadFlashFp8Part(rows, views, raw);
    } else {
      StageTile(rows, views, stage, stage_ld, scale_regs);
    }
  };
  // Decodes the staged rows (slots `rows`) into `kv`. FLASH FP8: each thread decodes its own
  // registers, so no barrier; otherwise, once this thread's copies have landed, the staged bytes
  // and scales are shared, so a barrier before the decode and one after it (the staging free).
  auto decode_rows = [&](const Slot* rows, uint16_t* kv) {
    if constexpr (kFlashFp8) {
      DecodeFlashFp8Tile<kWgmma>(rows, raw, kv, ld);
      if constexpr (kWgmma) FenceSharedForAsyncProxy();  // read by a later wgmma, after a barrier
    } else {
      CopyAsyncCommitAndWaitAll();
#pragma unroll
      for (int i = 0; i < kScaleLoads; ++i) scales_s[threadIdx.x + i * kTcThreads] = scale_regs[i];
      __syncthreads();
      for (int e = threadIdx.x; e < kTile * chunks; e += kTcThreads) {
        const int r = e / chunks, k = 8 * (e % chunks);
        uint4 decoded = make_uint4(0, 0, 0, 0);
        if (rows[r].table >= 0) {
          const TableView& v = views[rows[r].table];
          const unsigned char* row = stage + r * stage_ld;
          decoded = DecodeEight(v, k, RawEightOfRow(v, row, row + RopeOffset(v), scales_s + r * kMaxScales, k));
        }
        *reinterpret_cast<uint4*>(kv + r * ld + k) = decoded;
      }
      __syncthreads();
    }
  };
  auto decoded_tile = [&](int i) { return kv_s + (i % 2) * kRows * row_elems; };  // tile i's buffer
  // Tile n + 3's slots (buffer n - 1's: its mask was used in iteration n - 1), by threads < kRows,
  // each from the index it loaded an iteration earlier.
  auto resolve_ahead = [&](int64_t base, int n) {
    if (threadIdx.x < kRows) {
      const int64_t j = base + (kSlotBuffers - 1) * kRows + threadIdx.x;
      slots[(n + kSlotBuffers - 1) % kSlotBuffers][threadIdx.x] =
          SlotOf(j, next_index, w_n, views[0].rows, views[1].rows, views[2].rows);
      next_index = SlotIndex(j + kRows, end, w_n, w_idx, x_idx);
    }
  };
  __syncthreads();  // views staged
  if (threadIdx.x < kRows) {
#pragma unroll
    for (int d = 0; d < kSlotBuffers - 1; ++d) {
      slots[d][threadIdx.x] = SlotOf(first + d * kRows + threadIdx.x, first_index[d], w_n, views[0].rows,
                                     views[1].rows, views[2].rows);
    }
  }
  __syncthreads();  // tiles 0 .. 2 resolved

  const int64_t head_lo = head0 + group * 16 + g, head_hi = head_lo + 8;
  const int row_lo = group * 16 + g, row_hi = row_lo + 8;  // this thread's heads in the block
  const bool with_sink = blockIdx.z == 0;  // split parts after the first start empty
  float m_lo = !with_sink ? kEmptyMax : head_lo < n_n ? sink[head_lo] * kLog2e : 0.0f;
  float m_hi = !with_sink ? kEmptyMax : head_hi < n_n ? sink[head_hi] * kLog2e : 0.0f;
  // The sink's exp(0), counted once per quad (and on wgmma, where each warpgroup sums the
  // softmax over its own rows, by warpgroup 0 only).
  float l_lo = with_sink && c == 0 && (!kWgmma || half == 0) ? 1.0f : 0.0f, l_hi = l_lo;
  const int out_blocks = h_n / 16, col0 = half * (h_n / 2);
  float o[kMaxOutBlocks][4];
#pragma unroll
  for (int b = 0; b < kMaxOutBlocks; ++b) o[b][0] = o[b][1] = o[b][2] = o[b][3] = 0.0f;
  float(&o_acc)[kMaxOutBlocks * 4] = reinterpret_cast<float(&)[kMaxOutBlocks * 4]>(o);

  // The online softmax (base 2) of S over 32 rows (slots `rows`) for this thread's two heads:
  // unselected rows masked out, and the rows' maxima with the running max into max_lo / max_hi.
  auto mask_and_max = [&](const Slot* rows, float (&sc)[kScoreBlocks][4], float& max_lo, float& max_hi) {
    max_lo = m_lo, max_hi = m_hi;
#pragma unroll
    for (int b = 0; b < kScoreBlocks; ++b) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const bool valid = rows[b * 8 + 2 * c + i].table >= 0;
        sc[b][i] = valid ? sc[b][i] * scale_log2 : -INFINITY;
        sc[b][2 + i] = valid ? sc[b][2 + i] * scale_log2 : -INFINITY;
        max_lo = fmaxf(max_lo, sc[b][i]);
        max_hi = fmaxf(max_hi, sc[b][2 + i]);
      }
    }
    max_lo = QuadMax(max_lo), max_hi = QuadMax(max_hi);
  };
  // Then P = 2^(S - m) as bf16 A fragments (two 16-row k-steps), its sums into l. A lazy running
  // max (as in FlashAttention-4): m moves only when a row of the warp outgrows it by more than
  // kMaxSlack, so that most tiles skip the 128 multiplies that rescale o and l. Meanwhile P <=
  // 2^kMaxSlack, which the f32 sums and bf16 P carry at the same relative precision. (Every warp
  // holding a head sees the same maxima, so they move together.)
  auto exponentiate = [&](float (&sc)[kScoreBlocks][4], float max_lo, float max_hi, uint32_t (&p_frag)[kTile / 16][4]) {
    if (__any_sync(0xffffffffu, max_lo > m_lo + kMaxSlack || max_hi > m_hi + kMaxSlack)) {
      const float c_lo = exp2f(m_lo - max_lo), c_hi = exp2f(m_hi - max_hi);
      m_lo = max_lo, m_hi = max_hi;
      l_lo *= c_lo, l_hi *= c_hi;
#pragma unroll
      for (int b = 0; b < kMaxOutBlocks; ++b) {
        o[b][0] *= c_lo, o[b][1] *= c_lo, o[b][2] *= c_hi, o[b][3] *= c_hi;
      }
    }
    float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
    for (int b = 0; b < kScoreBlocks; ++b) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        sc[b][i] = exp2f(sc[b][i] - m_lo);
        sc[b][2 + i] = exp2f(sc[b][2 + i] - m_hi);
        sum_lo += sc[b][i];
        sum_hi += sc[b][2 + i];
      }
    }
    l_lo += sum_lo, l_hi += sum_hi;
#pragma unroll
    for (int ks = 0; ks < kTile / 16; ++ks) {
      p_frag[ks][0] = PackBf16(sc[2 * ks][0], sc[2 * ks][1]);
      p_frag[ks][1] = PackBf16(sc[2 * ks][2], sc[2 * ks][3]);
      p_frag[ks][2] = PackBf16(sc[2 * ks + 1][0], sc[2 * ks + 1][1]);
      p_frag[ks][3] = PackBf16(sc[2 * ks + 1][2], sc[2 * ks + 1][3]);
    }
  };

  if constexpr (kWgmma) {
    // A tile is 64 rows; warpgroup w computes S = Q K^T for all 64 heads over its 32 rows 32w ..
    // 32w + 31 and the whole head dim (m64n32k16 from shared memory), so each row's S is
    // computed once and no partial sums cross between the warpgroups. The two exchange their
    // rows' maxima (both then hold the same running max), each turns its S into P, and they
    // exchange P (bf16, 4 KB a warpgroup); each then multiplies the whole 64-row P by V for its
    // own 256 output columns: its own P from registers, the other's from shared memory. (The
    // split of S by rows, not by the head dim, is FlashMLA's; it moves ~24 KB a 32-row tile less
    // through shared memory than exchanging fp32 partial S did, and each warp exponentiates
    // only its own rows.)
    //
    // Pipeline: tile n + 1's rows 0 .. 31 are decoded while tile n's S runs and its rows 32 ..
    // 63 while tile n's P V does, each from registers loaded half an iteration earlier (so one
    // 32-row part is held at a time); one block barrier a tile hands the buffers over.
    using ScoreAtom = cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                                   cute::SM90::GMMA::Major::K>;
    // Core matrices of q and the tiles: 128 bytes apart along K (a row's next chunk), kGroupBytes
    // along M / N; of P [64 heads][32 rows]: 128 bytes along K, kPGroupBytes along M.
    constexpr int kChunks = flash_fp8::kHead / 8, kGroupBytes = kChunks * 128;
    constexpr int kPChunks = kTile / 8, kPGroupBytes = kPChunks * 128;
    const int wg = WarpgroupIndex();  // == half, uniform
    unsigned char* p_s = reinterpret_cast<unsigned char*>(half_s);      // [2 warpgroups][kTcHeads][kTile] bf16
    float* max_s = reinterpret_cast<float*>(p_s + 2 * kTcHeads * kTile * 2);  // [2 warpgroups][kTcHeads]
    const uint64_t q_desc = WgmmaDescriptor(q_s, 128, kGroupBytes);
    const uint64_t p_other = WgmmaDescriptor(p_s + (wg ^ 1) * kTcHeads * kTile * 2, 128, kPGroupBytes);
    unsigned char* p_own = p_s + half * kTcHeads * kTile * 2;

    // Tile 0 decoded (both halves, always: a half past the end decodes to zeros, which its P of
    // 0 may multiply; stale shared memory could hold NaN), the first half of tile 1 loaded.
    stage_rows(slots[0]);
    decode_rows(slots[0], decoded_tile(0));
    stage_rows(slots[0] + kTile);
    decode_rows(slots[0] + kTile, decoded_tile(0) + kTile * row_elems);
    if (first + kRows < end) stage_rows(slots[1]);
    CopyAsyncCommitAndWaitAll();  // q's copies
    __syncthreads();              // tile 0 decoded, q landed

    int n = 0;
    for (int64_t base = first; base < end; base += kRows, ++n) {
      const Slot* tile = slots[n % kSlotBuffers];
      const Slot* next = slots[(n + 1) % kSlotBuffers];
      const unsigned char* kv = reinterpret_cast<const unsigned char*>(decoded_tile(n));
      const bool has_next = base + kRows < end;

      float sc[kScoreBlocks][4];
      float(&acc)[kScoreBlocks * 4] = reinterpret_cast<float(&)[kScoreBlocks * 4]>(sc);
      const uint64_t k_own = WgmmaDescriptor(kv + wg * (kTile / 8) * kGroupBytes, 128, kGroupBytes);
      FenceOperands(acc);
      cute::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < flash_fp8::kHead / 16; ++kk) {  // two 16-byte chunks a k-step
        WgmmaSs<ScoreAtom>(WgmmaDescriptorAt(q_desc, kk * 2 * 128), WgmmaDescriptorAt(k_own, kk * 2 * 128), acc,
                           kk > 0);
      }
      cute::warpgroup_commit_batch();
      if (has_next) {  // tile n + 1's first half, then the loads of its second
        decode_rows(next, decoded_tile(n + 1));
        stage_rows(next + kTile);
      }
      cute::warpgroup_wait<0>();
      FenceOperands(acc);

      float max_lo, max_hi;
      mask_and_max(tile + half * kTile, sc, max_lo, max_hi);
      if (c == 0) max_s[half * kTcHeads + row_lo] = max_lo, max_s[half * kTcHeads + row_hi] = max_hi;
      __syncthreads();  // both warpgroups' row maxima
      max_lo = fmaxf(max_lo, max_s[(half ^ 1) * kTcHeads + row_lo]);
      max_hi = fmaxf(max_hi, max_s[(half ^ 1) * kTcHeads + row_hi]);
      uint32_t p_frag[kTile / 16][4];
      exponentiate(sc, max_lo, max_hi, p_frag);
      StorePTile<kTile>(p_frag, row_lo, row_hi, c, p_own);
      __syncthreads();  // both warpgroups' P

      // O += P V for this warpgroup's 256 columns over all 64 rows (V: the tile read with its
      // rows along K, an MN-major operand; a k-step is 16 rows, two 8-row groups). Left in
      // flight while tile n + 1's second half is decoded; waited for before the block barrier.
      const uint64_t v_half = WgmmaDescriptor(kv + wg * (kChunks / 2) * 128, kGroupBytes, 128);
      FenceOperands(o_acc);
      cute::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < kTile / 16; ++ks) {
        WgmmaRs<OwnPvAtom>(p_frag[ks], WgmmaDescriptorAt(v_half, (wg * kTile / 16 + ks) * 2 * kGroupBytes), o_acc,
                         true);
      }
#pragma unroll
      for (int ks = 0; ks < kTile / 16; ++ks) {
        WgmmaSs<OtherPvAtom>(WgmmaDescriptorAt(p_other, ks * 2 * 128),
                           WgmmaDescriptorAt(v_half, ((wg ^ 1) * kTile / 16 + ks) * 2 * kGroupBytes), o_acc, true);
      }
      cute::warpgroup_commit_batch();
      if (has_next) {  // tile n + 1's second half, then the loads of tile n + 2's first
        decode_rows(next + kTile, decoded_tile(n + 1) + kTile * row_elems);
        if (base + 2 * kRows < end) stage_rows(slots[(n + 2) % kSlotBuffers]);
      }
      resolve_ahead(base, n);
      cute::warpgroup_wait<0>();
      FenceOperands(o_acc);
      FenceOperands(p_frag[0]);
      FenceOperands(p_frag[1]);
      __syncthreads();  // tile n + 1 decoded, tile n + 3's slots resolved, every warp done with tile n
    }
    // The denominator: each warpgroup summed its own rows' P.
    l_lo = QuadSum(l_lo), l_hi = QuadSum(l_hi);
    if (c == 0) max_s[half * kTcHeads + row_lo] = l_lo, max_s[half * kTcHeads + row_hi] = l_hi;
    __syncthreads();
    l_lo += max_s[(half ^ 1) * kTcHeads + row_lo];
    l_hi += max_s[(half ^ 1) * kTcHeads + row_hi];
  } else {
    // mma.sync: S = Q K^T over 32-row tiles, each warp over half the head dim for its group's
    // 16 heads (the group's two warps' halves added through shared memory); O += P V over the
    // warp's output half. Pipeline: while tile n is computed from kv_s[n % 2], tile n + 1 is
    // decoded into the other buffer by whichever warps are done with tile n (one block barrier a
    // tile), tile n + 2's bytes are on their way (cp.async, no registers held) and tile n + 3's
    // slots resolved.
    stage_rows(slots[0]);
    decode_rows(slots[0], decoded_tile(0));
    if (first + kTile < end) stage_rows(slots[1]);
    CopyAsyncCommitAndWaitAll();  // q's copies (and, not FLASH FP8, nothing else: decode_rows waited)
    __syncthreads();              // tile 0 decoded, q landed

    int n = 0;
    for (int64_t base = first; base < end; base += kTile, ++n) {
      const Slot* tile = slots[n % kSlotBuffers];
      const uint16_t* kv = decoded_tile(n);
      float sc[kScoreBlocks][4];
#pragma unroll
      for (int b = 0; b < kScoreBlocks; ++b) sc[b][0] = sc[b][1] = sc[b][2] = sc[b][3] = 0.0f;
      const int k_begin = half * (h_n / 2);
#pragma unroll 4
      for (int k0 = k_begin; k0 < k_begin + h_n / 2; k0 += 16) {
        uint32_t a[4];
        LdMatrixX4(a, q_s + (group * 16 + lane % 16) * ld + k0 + (lane / 16) * 8);
#pragma unroll
        for (int b = 0; b < kScoreBlocks; b += 2) {
          uint32_t kb[4];
          const int m = lane / 8;
          LdMatrixX4(kb, kv + (b * 8 + (m / 2) * 8 + lane % 8) * ld + k0 + (m % 2) * 8);
          Mma(sc[b], a, kb[0], kb[1]);
          Mma(sc[b + 1], a, kb[2], kb[3]);
        }
      }
#pragma unroll
      for (int b = 0; b < kScoreBlocks; ++b) {
        half_s[(warp * kScoreBlocks + b) * 32 + lane] = make_float4(sc[b][0], sc[b][1], sc[b][2], sc[b][3]);
      }
      PairBarrier(group);  // (the next tile's writes come after the loop's block barriers)
#pragma unroll
      for (int b = 0; b < kScoreBlocks; ++b) {
        const float4 other = half_s[((warp ^ 4) * kScoreBlocks + b) * 32 + lane];
        sc[b][0] += other.x, sc[b][1] += other.y, sc[b][2] += other.z, sc[b][3] += other.w;
      }
      float max_lo, max_hi;
      mask_and_max(tile, sc, max_lo, max_hi);
      uint32_t p_frag[kTile / 16][4];
      exponentiate(sc, max_lo, max_hi, p_frag);
#pragma unroll
      for (int ks = 0; ks < kTile / 16; ++ks) {
#pragma unroll
        for (int b = 0; b < kMaxOutBlocks; b += 2) {
          if (b < out_blocks) {
            uint32_t vb[4];
            const int m = lane / 8;
            LdMatrixX4Trans(vb, kv + (ks * 16 + (m % 2) * 8 + lane % 8) * ld + col0 + b * 8 + (m / 2) * 8);
            Mma(o[b], p_frag[ks], vb[0], vb[1]);
            Mma(o[b + 1], p_frag[ks], vb[2], vb[3]);
          }
        }
      }
      // Tile n + 1 into the other buffer (every warp finished tile n - 1 there: the last
      // barrier), tile n + 2's copies, tile n + 3's slots.
      if (base + kTile < end) {
        decode_rows(slots[(n + 1) % kSlotBuffers], decoded_tile(n + 1));
        if (base + 2 * kTile < end) stage_rows(slots[(n + 2) % kSlotBuffers]);
      }
      resolve_ahead(base, n);
      __syncthreads();  // tile n + 1 decoded, tile n + 3's slots resolved, every warp done with tile n
    }
    l_lo = QuadSum(l_lo), l_hi = QuadSum(l_hi);
  }
  CopyAsyncCommitAndWaitAll();  // nothing may be in flight at exit (an empty part staged nothing)

  if (gridDim.z > 1 && cluster_merge) {  // a split part, merged over the cluster
    __syncthreads();  // every thread's copies landed: the tiles' shared memory is free
    float* o_s = reinterpret_cast<float*>(smem);                      // [kTcHeads][h + kPad]
    float2* ml_s = reinterpret_cast<float2*>(o_s + kTcHeads * ld);    // [kTcHeads]
    float* weight_s = reinterpret_cast<float*>(ml_s + kTcHeads);      // [kMaxClusterParts][kTcHeads]
#pragma unroll
    for (int b = 0; b < kMaxOutBlocks; ++b) {
      if (b >= out_blocks) break;
      const int col = col0 + b * 8 + 2 * c;
      *reinterpret_cast<float2*>(o_s + row_lo * ld + col) = {o[b][0], o[b][1]};
      *reinterpret_cast<float2*>(o_s + row_hi * ld + col) = {o[b][2], o[b][3]};
    }
    if (c == 0 && half == 0) {
      ml_s[row_lo] = {m_lo, l_lo};
      ml_s[row_hi] = {m_hi, l_hi};
    }
    MergeClusterParts(o_s, ml_s, weight_s, out, t, head0, n_n, h_n);
    return;
  }
  if (gridDim.z > 1) {  // a split part: unnormalised output, max and denominator
    const int64_t part = (static_cast<int64_t>(blockIdx.z) * gridDim.x + t) * n_n;
#pragma unroll
    for (int b = 0; b < kMaxOutBlocks; ++b) {
      if (b >= out_blocks) break;
      const int64_t col = col0 + b * 8 + 2 * c;
      if (head_lo < n_n) *reinterpret_cast<float2*>(split_o + (part + head_lo) * h_n + col) = {o[b][0], o[b][1]};
      if (head_hi < n_n) *reinterpret_cast<float2*>(split_o + (part + head_hi) * h_n + col) = {o[b][2], o[b][3]};
    }
    if (c == 0 && half == 0) {
      if (head_lo < n_n) *reinterpret_cast<float2*>(split_ml + (part + head_lo) * 2) = {m_lo, l_lo};
      if (head_hi < n_n) *reinterpret_cast<float2*>(split_ml + (part + head_hi) * 2) = {m_hi, l_hi};
    }
    return;
  }
  // The normalised output leaves through shared memory (the q and tile region: every warp is
  // past its last read of it), so that each row is written in 16-byte stores; stored straight
  // from the accumulators it took a 4-byte store a lane per column pair, which filled the
  // load/store queue (~8% of a 64k chunk's time on an H200).
  __syncthreads();
  uint16_t* out_s = smem;  // [kTcHeads][ld]: rows ld = h + kPad apart, so the lanes' stores are conflict-free
  const float inv_lo = 1.0f / l_lo, inv_hi = 1.0f / l_hi;
#pragma unroll
  for (int b = 0; b < kMaxOutBlocks; ++b) {
    if (b >= out_blocks) break;
    const int col = col0 + b * 8 + 2 * c;
    *reinterpret_cast<uint32_t*>(out_s + row_lo * ld + col) = PackBf16(o[b][0] * inv_lo, o[b][1] * inv_lo);
    *reinterpret_cast<uint32_t*>(out_s + row_hi * ld + col) = PackBf16(o[b][2] * inv_hi, o[b][3] * inv_hi);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kTcHeads * chunks; e += kTcThreads) {
    const int r = e / chunks, k = 8 * (e % chunks);
    if (head0 + r < n_n) {
      *reinterpret_cast<uint4*>(out + (t * n_n + head0 + r) * h_n + k) =
          *reinterpret_cast<const uint4*>(out_s + r * ld + k);
    }
  }
}

// Merges the S split parts of each (query, head) row: out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s
// with M = max_s m_s (part 0 carries the sink, so M is finite). One warp per 128 columns of a
// row (so that decode's few rows still make many warps) and no block barrier: the lanes reduce
// the parts' maxima and denominators by shuffles and put the parts' weights 2^(m_s - M) in the
// warp's slice of shared memory, then each lane merges four columns (float4 loads, all parts'
// loads independent).
constexpr int kCombineWarps = 8;
constexpr int kCombineColumns = 4 * 32;  // a warp's columns

__global__ void __launch_bounds__(kCombineWarps * 32)
    CombineSplitsKernel(const float* split_o, const float* split_ml, uint16_t* out, int64_t splits, int64_t tn,
                        int64_t h_n) {
  extern __shared__ float combine_s[];  // [kCombineWarps][splits] weights
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t column_blocks = (h_n + kCombineColumns - 1) / kCombineColumns;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kCombineWarps + warp;
  const int64_t row = unit / column_blocks, k = unit % column_blocks * kCombineColumns + 4 * lane;  // row: t * N + head
  if (row >= tn) return;
  const float2* ml = reinterpret_cast<const float2*>(split_ml);  // part p of this row: ml[p * tn + row]
  float* weight = combine_s + warp * splits;
  float big = kEmptyMax;
  for (int64_t p = lane; p < splits; p += 32) big = fmaxf(big, ml[p * tn + row].x);
  big = WarpMax(big);
  float denom = 0.0f;
  for (int64_t p = lane; p < splits; p += 32) {
    const float2 v = ml[p * tn + row];
    weight[p] = exp2f(v.x - big);
    denom += weight[p] * v.y;
  }
  denom = WarpSum(denom);
  __syncwarp();  // the weights visible to the whole warp
  if (k >= h_n) return;  // (h_n is a multiple of 32 on this path: a lane's four columns are all in or all out)
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
  for (int64_t p = 0; p < splits; ++p) {
    const float4 o = *reinterpret_cast<const float4*>(split_o + (p * tn + row) * h_n + k);
    const float wp = weight[p];
    acc.x += wp * o.x, acc.y += wp * o.y, acc.z += wp * o.z, acc.w += wp * o.w;
  }
  *reinterpret_cast<uint2*>(out + row * h_n + k) =
      make_uint2(PackBf16(acc.x / denom, acc.y / denom), PackBf16(acc.z / denom, acc.w / denom));
}

// The dynamic shared memory the tensor-core kernel may use on this device: its largest need
// (head dim 512: bf16 rows, or the FLASH FP8 layout's 64-row tiles) where the device allows it
// beside the kernel's static arrays (~4.3 KB), else what it allows; arguments needing more go to
// the scalar kernel (so on SM120, 99 KB a block, the FLASH dims do: untested there).
constexpr int64_t kTcStaticBytes = 6 * 1024;
int64_t TensorCoreSharedLimit() {
  static const int64_t limit =
      std::min<int64_t>(std::max(TensorCoreSharedBytes(kMaxHeadDim, 2 * kMaxHeadDim + 16, kTile),
                                 TensorCoreSharedBytes(kMaxHeadDim, 0, kTileRowsFlash)),
                        OptInSharedBytes() - kTcStaticBytes);
  return limit;
}

// Whether every table is in the FLASH FP8 layout at the model's head dim (the kernel's
// TensorCoreAttentionKernel<kMaxHeadDim, true> variant).
bool AllFlashFp8(const AttentionArgs& a) {
  return a.h == kMaxHeadDim && IsFlashFp8(a.ring) && IsFlashFp8(a.fresh) && IsFlashFp8(a.comp);
}

// The kernel's shared-memory staging stride: none for the FLASH FP8 layout, whose bytes are
// staged in registers (LoadFlashFp8Part).
int64_t TensorCoreStageStride(const AttentionArgs& a) {
  return AllFlashFp8(a) ? 0 : StageStride(a.ring, a.fresh, a.comp);
}

// The rows of the kernel's tiles (and the unit of its split parts): kTileRowsFlash for the FLASH
// FP8 layout (its wgmma code; the mma.sync code runs such a tile as two), else kTile.
int64_t TensorCoreTileRows(const AttentionArgs& a) { return AllFlashFp8(a) ? kTileRowsFlash : kTile; }

// Whether the tensor-core kernel serves these arguments (else the scalar kernel does).
bool TensorCoreServes(const AttentionArgs& a) {
  if (a.q_type != Elem::kBf16 || a.h % 32 != 0 || a.h > kMaxHeadDim) return false;
  for (const TableView* t : {&a.ring, &a.fresh, &a.comp}) {
    if (t->rows == 0) continue;  // never read
    if (t->values_type != Elem::kBf16 && t->values_type != Elem::kE4m3) return false;
    if (t->values_width % 8 != 0 || (t->scales_width != 0 && t->block % 8 != 0)) return false;
    if (t->scales_width > kMaxScales) return false;
    if (t->rope_width != 0 && (t->rope_type != Elem::kBf16 || t->rope_width % 8 != 0)) return false;
  }
  return TensorCoreSharedBytes(a.h, TensorCoreStageStride(a), TensorCoreTileRows(a)) <= TensorCoreSharedLimit();
}

// ProducerAttentionKernel<kDecoded> for one unsplit query a block (prefill), after decoding the
// tables into `decoded` when it is given (a.decoded_rows > 0).
template <bool kDecoded>
ffi::Error LaunchProducer(cudaStream_t stream, const AttentionArgs& a, const void* q, const int32_t* window_idx,
                          const int32_t* comp_idx, const float* sink, void* out, uint16_t* decoded, float scale) {
  static const cudaError_t attr = cudaFuncSetAttribute(
      ProducerAttentionKernel<kDecoded>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kProducerSharedBytes));
  if (attr != cudaSuccess) return ffi::Error::Internal(std::string("shared memory opt-in: ") + cudaGetErrorString(attr));
  const TableViews tables{{a.ring, a.fresh, a.comp}};
  if constexpr (kDecoded) {
    constexpr int kThreads = 256;
    const int64_t chunks = a.decoded_rows * (flash_fp8::kHead / 8);
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((chunks + kThreads - 1) / kThreads, 1 << 16));
    DecodeFlashTablesKernel<<<blocks, kThreads, 0, stream>>>(tables, decoded, a.decoded_rows);
    if (auto e = LastCudaError("DecodeFlashTablesKernel"); e.failure()) return e;
  }
  ProducerAttentionKernel<kDecoded>
      <<<dim3(static_cast<unsigned>(a.t), static_cast<unsigned>((a.n + kTcHeads - 1) / kTcHeads)), producer::kThreads,
         kProducerSharedBytes, stream>>>(static_cast<const uint16_t*>(q), tables, window_idx, a.w, comp_idx, a.x,
                                         sink, static_cast<uint16_t*>(out), a.n, scale * kLog2e, decoded);
  return LastCudaError("ProducerAttentionKernel");
}

// Whether ProducerAttentionKernel<kDecoded> was built with exactly kLaunchRegisters a thread, the
// pool its setmaxnreg calls balance (a -maxrregcount build or another ptxas could give fewer:
// they would hang). This also keeps it off a plain sm_90 build, whose body is only the __trap
// (28 registers); the tensor-core kernel serves there.
template <bool kDecoded>
bool ProducerRegistersBalance() {
  static const bool ok = [] {
    cudaFuncAttributes f{};
    const bool read = cudaFuncGetAttributes(&f, ProducerAttentionKernel<kDecoded>) == cudaSuccess;
    if (!read) (void)cudaGetLastError();
    return read && f.numRegs == producer::kLaunchRegisters;
  }();
  return ok;
}

// Whether an unsplit FLASH FP8 call on the current device uses a decoded-table workspace when
// given one: an SM90 device and ProducerAttentionKernel<true> built with its register budget.
bool DecodedTablesServed() { return WgmmaOnDevice() && ProducerRegistersBalance<true>(); }

// How `tiles` tiles split into at most `splits` parts: *per_split tiles a part and *used parts
// (no empty trailing parts; 1 part for splits <= 1).
void SplitTiles(int64_t tiles, int64_t splits, int64_t* per_split, int64_t* used) {
  splits = std::max<int64_t>(1, std::min(splits, tiles));
  *per_split = (tiles + splits - 1) / splits;
  *used = splits > 1 ? (tiles + *per_split - 1) / *per_split : 1;
}

// The launch attribute that makes a query's `parts` split parts (grid z) one cluster.
cudaLaunchAttribute PartsCluster(int64_t parts) {
  cudaLaunchAttribute cluster = {};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = static_cast<unsigned>(parts);
  return cluster;
}

// How many clusters of `parts` blocks of `kernel` (with `shared_bytes` of dynamic shared memory)
// can be resident at once on the current device; 0 if it cannot be read. Asked once per kernel,
// cluster size and shared memory (the answer depends on all three).
int ResidentClusters(const void* kernel, int64_t parts, size_t shared_bytes) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int64_t, size_t>, int> resident;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, parts, shared_bytes);
  auto it = resident.find(key);
  if (it == resident.end()) {
    cudaLaunchConfig_t one = {};
    one.gridDim = dim3(1, 1, static_cast<unsigned>(parts));
    one.blockDim = dim3(kTcThreads);
    one.dynamicSmemBytes = shared_bytes;
    cudaLaunchAttribute cluster[1] = {PartsCluster(parts)};
    one.attrs = cluster;
    one.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &one) != cudaSuccess) {
      (void)cudaGetLastError();  // not an error of a launch: the caller merges through the scratch
      clusters = 0;
    }
    it = resident.emplace(key, clusters).first;
  }
  return it->second;
}

ffi::Error LaunchTensorCore(cudaStream_t stream, const AttentionArgs& a, const void* q, const int32_t* window_idx,
                            const int32_t* comp_idx, const float* sink, void* out, float* split_o, float* split_ml,
                            uint16_t* decoded, float scale) {
  // Once per process: allow the kernel's shared memory above the 48 KB default.
  const int most = static_cast<int>(TensorCoreSharedLimit());
  static const cudaError_t attr[3] = {
      cudaFuncSetAttribute(TensorCoreAttentionKernel<0, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, most),
      cudaFuncSetAttribute(TensorCoreAttentionKernel<kMaxHeadDim, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           most),
      cudaFuncSetAttribute(TensorCoreAttentionKernel<kMaxHeadDim, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           most)};
  const bool fixed = a.h == kMaxHeadDim;
  const bool flash_fp8 = AllFlashFp8(a);
  const int variant = flash_fp8 ? 2 : fixed ? 1 : 0;
  if (attr[variant] != cudaSuccess) {
    return ffi::Error::Internal(std::string("shared memory opt-in: ") + cudaGetErrorString(attr[variant]));
  }
  const int64_t tile_rows = TensorCoreTileRows(a);
  const int64_t tiles = (a.w + a.x + tile_rows - 1) / tile_rows;
  int64_t per_split = 0, used = 0;
  SplitTiles(tiles, a.splits, &per_split, &used);
  if (flash_fp8 && used == 1 && WgmmaOnDevice()) {
    if (a.decoded_rows > 0 && DecodedTablesServed()) {
      return LaunchProducer<true>(stream, a, q, window_idx, comp_idx, sink, out, decoded, scale);
    }
    if (ProducerRegistersBalance<false>()) {
      return LaunchProducer<false>(stream, a, q, window_idx, comp_idx, sink, out, nullptr, scale);
    }
  }
  const int64_t stage = TensorCoreStageStride(a);
  auto* kernel = flash_fp8 ? TensorCoreAttentionKernel<kMaxHeadDim, true>
                 : fixed   ? TensorCoreAttentionKernel<kMaxHeadDim, false>
                           : TensorCoreAttentionKernel<0, false>;
  const size_t shared_bytes = TensorCoreSharedBytes(a.h, stage, tile_rows);
  const int64_t clusters_needed = a.t * ((a.n + kTcHeads - 1) / kTcHeads);  // one a (query, head block)
  // Split parts run as one cluster, merged on chip, when there are few enough of them and all
  // the clusters are resident at once (clusters must fit within a GPU processing cluster, so
  // fewer of them than blocks / parts may be: a second wave would cost more than the merge
  // saves; on an H200, 32 clusters of 4 of these blocks ran as 1.5x the one-wave time). Where
  // clusters of `used` parts are not all resident, fewer parts whose clusters are (down to
  // two) are taken instead: longer parts, but no scratch round trip and no CombineSplitsKernel.
  // Measured on an H100 (BENCHMARKS.md, 2026-12-07), FLASH decode C32 asks for 4 parts, whose
  // 32 clusters are not resident: through the scratch 36.5 us, as 3 parts in clusters 30.4 us,
  // as 2 in clusters 31.1 us.
  bool cluster_merge = false;
  if (used > 1 && used <= kMaxClusterParts) {
    const void* func = reinterpret_cast<const void*>(kernel);
    for (int64_t s = used; s >= 2 && !cluster_merge; --s) {
      int64_t s_per_split = 0, s_used = 0;
      SplitTiles(tiles, s, &s_per_split, &s_used);
      if (s_used == s && clusters_needed <= ResidentClusters(func, s, shared_bytes)) {
        per_split = s_per_split, used = s, cluster_merge = true;
      }
    }
  }
  const dim3 grid(static_cast<unsigned>(a.t), static_cast<unsigned>((a.n + kTcHeads - 1) / kTcHeads),
                  static_cast<unsigned>(used));
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kTcThreads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute cluster[1] = {PartsCluster(used)};
  config.attrs = cluster;
  config.numAttrs = cluster_merge ? 1 : 0;
  const int64_t rows_per_split = std::max<int64_t>(per_split, 1) * tile_rows;
  const cudaError_t launched = cudaLaunchKernelEx(
      &config, kernel, static_cast<const uint16_t*>(q), TableViews{{a.ring, a.fresh, a.comp}}, window_idx, a.w,
      comp_idx, a.x, sink, static_cast<uint16_t*>(out), a.n, a.h, scale * kLog2e, rows_per_split,
      static_cast<int>(stage), split_o, split_ml, cluster_merge);
  if (launched != cudaSuccess) {
    return ffi::Error::Internal(std::string("TensorCoreAttentionKernel: ") + cudaGetErrorString(launched));
  }
  if (auto e = LastCudaError("TensorCoreAttentionKernel"); e.failure() || used == 1 || cluster_merge) return e;
  const int64_t rows = a.t * a.n, units = rows * ((a.h + kCombineColumns - 1) / kCombineColumns);
  CombineSplitsKernel<<<static_cast<unsigned>((units + kCombineWarps - 1) / kCombineWarps), kCombineWarps * 32,
                        kCombineWarps * used * sizeof(float), stream>>>(split_o, split_ml,
                                                                         static_cast<uint16_t*>(out), used, rows, a.h);
  return LastCudaError("CombineSplitsKernel");
}

ffi::Error SparseAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer ring_values,
                               ffi::AnyBuffer ring_scales, ffi::AnyBuffer ring_rope, ffi::AnyBuffer fresh_values,
                               ffi::AnyBuffer fresh_scales, ffi::AnyBuffer fresh_rope, ffi::Buffer<ffi::S32> window_idx,
                               ffi::AnyBuffer comp_values, ffi::AnyBuffer comp_scales, ffi::AnyBuffer comp_rope,
                               ffi::Buffer<ffi::S32> comp_idx, ffi::Buffer<ffi::F32> sink,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> split_o,
                               ffi::Result<ffi::Buffer<ffi::F32>> split_ml, ffi::Result<ffi::AnyBuffer> decoded,
                               float scale, int32_t block) {
  AttentionArgs a;
  if (auto e = ParseAttention(q, {ring_values, ring_scales, ring_rope}, {fresh_values, fresh_scales, fresh_rope},
                              window_idx, {comp_values, comp_scales, comp_rope}, comp_idx, sink,
                              out->element_type(), split_o->dimensions(), split_ml->dimensions(),
                              decoded->element_type(), decoded->dimensions(), block, &a);
      e.failure()) {
    return e;
  }
  if (a.h > kMaxHeadDim) return Invalid("head dim above 512 is not supported by the CUDA kernel");
  if (a.t == 0 || a.n == 0) return ffi::Error::Success();
  if (TensorCoreServes(a)) {
    return LaunchTensorCore(stream, a, q.untyped_data(), window_idx.typed_data(), comp_idx.typed_data(),
                            sink.typed_data(), out->untyped_data(), split_o->typed_data(), split_ml->typed_data(),
                            static_cast<uint16_t*>(decoded->untyped_data()), scale);
  }
  const dim3 grid(static_cast<unsigned>(a.t), static_cast<unsigned>((a.n + kHeadsPerBlock - 1) / kHeadsPerBlock));
  ScalarAttentionKernel<<<grid, 32 * kHeadsPerBlock, 0, stream>>>(
      q.untyped_data(), a.q_type, a.ring, a.fresh, a.comp, window_idx.typed_data(), a.w, comp_idx.typed_data(), a.x,
      sink.typed_data(), out->untyped_data(), a.n, a.h, scale);
  return LastCudaError("ScalarAttentionKernel");
}

}  // namespace
}  // namespace dsv4

// The current device's multiprocessor count (0 if it cannot be read): dsv4/ops/sparse_attention/ffi.py
// sizes the split scratch from it, through ctypes.
extern "C" int64_t Dsv4MultiprocessorCount() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  return count;
}

// 1 if an unsplit FLASH FP8 call on the current device would use a decoded-table workspace
// (DecodedTablesServed), else 0: through ctypes, dsv4/ops/sparse_attention/ffi.py asks for the
// workspace only then (elsewhere it would be allocated and ignored).
extern "C" int64_t Dsv4DecodedTablesServed() { return dsv4::DecodedTablesServed() ? 1 : 0; }

namespace ffi = xla::ffi;

// The arguments are those of Dsv4SparseAttentionCpu (sparse_attention_cpu.cc), after the stream.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SparseAttentionCuda, dsv4::SparseAttentionCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()       // q
                                  .Arg<ffi::AnyBuffer>()       // ring values
                                  .Arg<ffi::AnyBuffer>()       // ring scales
                                  .Arg<ffi::AnyBuffer>()       // ring rope
                                  .Arg<ffi::AnyBuffer>()       // fresh values
                                  .Arg<ffi::AnyBuffer>()       // fresh scales
                                  .Arg<ffi::AnyBuffer>()       // fresh rope
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window_idx
                                  .Arg<ffi::AnyBuffer>()       // compressed values
                                  .Arg<ffi::AnyBuffer>()       // compressed scales
                                  .Arg<ffi::AnyBuffer>()       // compressed rope
                                  .Arg<ffi::Buffer<ffi::S32>>()  // compressed_idx
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sink
                                  .Ret<ffi::AnyBuffer>()       // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // split partial outputs
                                  .Ret<ffi::Buffer<ffi::F32>>()  // split max / denominator
                                  .Ret<ffi::AnyBuffer>()       // decoded-table workspace
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("block"),
                              {ffi::Traits::kCmdBufferCompatible});
