// indexer_topk on CUDA: the twin of dsv4/ops/indexer_topk/reference.py and of
// indexer_topk_cpu.cc (same arguments, same semantics).
//
// (1) Scores. With bf16 q (up to 64 heads of dim <= 128, a multiple of 16) on tensor cores:
// tiles of 64 candidates are decoded once into shared memory as bf16 (every e2m1/e4m3 x E8M0
// value is exact there) and Q K^T is an mma.sync product, its ReLU-weighted head sum reduced
// in registers; a tile's key loads are issued before the previous tile's products, so they
// overlap. Otherwise one warp per candidate in f32 FMA. Where the scores go:
//   - fused (no scratch, [T, 0]): one block per query scores its visible candidates into a
//     score row in shared memory (Dsv4IndexerOnChipCandidates: up to ~48k candidates, ~190k
//     tokens of context at ratio 4, on an H200) and selects from it: no score reaches HBM.
//     This serves the prefill chunk, whose thousands of queries fill the GPU.
//   - scored (a [T, S] scratch): IndexerScoreKernel spreads each query's candidates over many
//     blocks and writes the scores to the scratch, then the selection kernel reads them back.
//     Dsv4IndexerScratchColumns asks for this when the score row does not fit on chip, and
//     for decode, where one block per query would leave most multiprocessors idle (a few
//     queries' score rows, ~4 KB each at a 4k context, against the keys' 70 KB read).
// (2) A radix select over the scores' order-preserving bit patterns (4 passes of 8 bits, each
// histogram's bin found by a block-wide scan) finds the k-th largest. (3) Every candidate
// above it is kept, and of those equal to it the lowest-numbered ones. (4) A bitonic sort
// orders the kept ones by (score desc, candidate asc), the reference's order, each entry
// sorted as one 64-bit key. (Sorting every candidate instead, for decode's 1024, measured
// ~1 us slower than select-then-sort on an H200.)
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_common.h"
#include "cuda_tiles.h"
#include "op_args.h"

extern "C" int64_t Dsv4IndexerOnChipCandidates(int64_t i, int64_t j);
extern "C" int64_t Dsv4IndexerScratchColumns(int64_t t, int64_t s, int64_t i, int64_t j);
extern "C" int64_t Dsv4MultiprocessorCount();  // sparse_attention_cuda.cu

namespace dsv4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTopk = 2048;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxSmemBytes = 40 * 1024;  // the scoring / selection region, before the score row
constexpr int kMmaRows = 64;               // tensor-core scoring: heads (padded) and candidates per tile
constexpr int kMmaMaxDim = 128;
constexpr int kMmaGroups = kMmaRows / 16;  // head groups of 16 (the mma's M)
constexpr int kPad = 8;                    // bf16 row padding: conflict-free ldmatrix rows

// How a kernel scores: f32 FMA, tensor cores on any key layout, or tensor cores on the model's
// FP4 index keys (ScorerFor: constant-offset loads and a branch-free decode).
enum class Scorer { kScalar, kMma, kMmaIndexFp4 };

// The model's stored index key (INDEX_FP4 at FLASH dims): 128 e2m1 codes packed two a byte,
// one E8M0 scale per 32.
namespace index_fp4 {
constexpr int kDim = 128, kBlock = 32;
constexpr int kBytes = kDim / 2;           // packed codes a row
constexpr int kQuarters = kDim / kBlock;   // 16-byte quarters a row, one scale each
}  // namespace index_fp4

// Bytes of the region before the score row: the scoring inputs (q in f32 for the scalar
// scorer; q and one key tile in bf16, q's space then being the second key buffer, plus two sets
// of the head groups' partial sums for the tensor-core one), then the kept entries' 64-bit sort
// keys of the selection.
DSV4_HD size_t RegionBytes(int64_t i, int64_t j) {
  const size_t scalar = i * j * sizeof(float), sel = kMaxTopk * sizeof(uint64_t);
  const size_t mma = j <= kMmaMaxDim ? 2 * kMmaRows * (j + kPad) * 2 + 2 * kMmaGroups * kMmaRows * sizeof(float) : 0;
  const size_t most = scalar > sel ? scalar : sel;
  return most > mma ? most : mma;
}

// Static shared memory of the fused kernel (histogram, counters, a tile's stored rows; 2.3 KB
// on SM90) and slack.
constexpr int64_t kStaticSharedBytes = 4 * 1024;

// Larger float -> larger key; -0 and +0 share a key (they tie in the reference).
__device__ __forceinline__ uint32_t OrderKey(float v) {
  const uint32_t b = FloatToBits(v == 0.0f ? 0.0f : v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The stored row of candidate s: its page's row, or the last row for an unallocated page (the
// reference's clipped gather), clipped to the table too.
__device__ __forceinline__ int64_t CandidateRow(const int32_t* pages, int64_t epp, int64_t s, int64_t rows) {
  // 32-bit division (S < 2^31; a 64-bit one is a long software routine on the GPU).
  const int32_t s32 = static_cast<int32_t>(s), epp32 = static_cast<int32_t>(epp);
  const int64_t page = pages[s32 / epp32];
  return page >= 0 ? min(page * epp + s32 % epp32, rows - 1) : rows - 1;
}

// The candidates query t may see: its causal limit, clipped to [0, S] (none without keys).
__device__ __forceinline__ int64_t VisibleCandidates(const TableView& keys, const int32_t* limit, int64_t t,
                                                     int64_t s_n) {
  return keys.rows ? min(max(static_cast<int64_t>(limit[t]), int64_t{0}), s_n) : 0;
}

// Scores of candidates [begin, end) of query t into row_scores[begin, end) on tensor cores (the
// file comment). Warp w: head group w % 4 (heads 16 (w % 4) .. +16) and candidates
// 32 (w / 4) .. +32 of the tile, as S^T = K Q^T (candidates are the mma's rows, heads its
// columns), so that a lane's accumulators hold 4 of the group's heads for each of its
// candidates: their w_i relu(dot) are summed in registers, then over the 4 lanes of a row by
// two shuffles, and the four head groups' sums are added in a fixed order.
// q's fragments stay in registers for the whole loop, which frees q's shared memory for a
// second key buffer: while tile n's products run from one buffer, its keys having been decoded
// during tile n - 1, tile n + 1's keys (loaded into registers a tile ahead) are decoded into
// the other, so one block barrier a tile suffices.
// kIndexFp4: the keys are in the model's FP4 layout (ScorerFor): thread u * 64 + r loads
// quarter u of row r (16 bytes: 32 codes, one scale block) and decodes it with constant
// offsets (a quarter-warp's 16-byte stores then fall in distinct banks); otherwise each
// thread loads and decodes four generic 8-value chunks.
template <bool kIndexFp4>
__device__ void MmaScores(const uint16_t* q, const float* w, const TableView& keys, const int32_t* page_table,
                          int64_t p_n, int64_t epp, int64_t t, int64_t begin, int64_t end, int64_t i_n, int64_t j_arg,
                          unsigned char* smem, float* row_scores) {
  __shared__ float w_s[kMmaRows];
  __shared__ int64_t rows_s[2][kMmaRows];  // stored row of each candidate of the tile (-1 past the end)
  const int64_t j_n = kIndexFp4 ? index_fp4::kDim : j_arg;
  const int ld = static_cast<int>(j_n) + kPad;
  // q [kMmaRows heads][ld] until its fragments are in registers, then the second of the two key
  // buffers [kMmaRows candidates][ld]; then the head groups' sums [2][kMmaGroups][kMmaRows].
  uint16_t* q_s = reinterpret_cast<uint16_t*>(smem);
  auto key_buffer = [&](int b) { return q_s + (1 - b) * kMmaRows * ld; };
  float* part = reinterpret_cast<float*>(q_s + 2 * kMmaRows * ld);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = warp % kMmaGroups, half = warp / kMmaGroups;
  const int g = lane / 4, c = lane % 4, chunks = static_cast<int>(j_n / 8);
  const int32_t* pages = page_table + t * p_n;
  for (int e = threadIdx.x; e < kMmaRows * chunks; e += kThreads) {  // all copies in flight at once
    const int r = e / chunks, k = 8 * (e % chunks);
    if (r < i_n) {
      CopyAsync16(q_s + r * ld + k, q + (t * i_n + r) * j_n + k);
    } else {
      *reinterpret_cast<uint4*>(q_s + r * ld + k) = make_uint4(0, 0, 0, 0);
    }
  }
  if (threadIdx.x < kMmaRows) {
    const int64_t s = begin + threadIdx.x;
    w_s[threadIdx.x] = threadIdx.x < i_n ? w[t * i_n + threadIdx.x] : 0.0f;
    rows_s[0][threadIdx.x] = s < end ? CandidateRow(pages, epp, s, keys.rows) : -1;
  }
  __syncthreads();  // the first tile's rows and w resolved (q is still on its way)
  float w_head[2][2];  // w of heads 8 h + 2c (+ 1) of this warp's group (the accumulators' columns)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    w_head[h][0] = w_s[group * 16 + 8 * h + 2 * c];
    w_head[h][1] = w_s[group * 16 + 8 * h + 2 * c + 1];
  }
  constexpr int kFill = kMmaRows * (kMmaMaxDim / 8) / kThreads;  // 16-byte chunks per thread per tile
  RawEight raw[kFill];  // generic layout: this thread's chunks of the next tile
  uint4 codes;          // FP4 layout: this thread's quarter row of the next tile, and its scale
  uint8_t codes_scale;
  auto load_tile = [&](const int64_t* rows) {
    if constexpr (kIndexFp4) {
      static_assert(kMmaRows * index_fp4::kQuarters == kThreads, "one quarter row a thread");
      const int quarter = threadIdx.x / kMmaRows;
      const int64_t row = rows[threadIdx.x % kMmaRows];
      codes = make_uint4(0, 0, 0, 0);  // decodes to zeros
      codes_scale = 127;
      if (row >= 0) {
        codes = *reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(keys.values) +
                                                row * index_fp4::kBytes + 16 * quarter);
        codes_scale = keys.scales[row * index_fp4::kQuarters + quarter];
      }
    } else {
#pragma unroll
      for (int u = 0; u < kFill; ++u) {
        const int e = threadIdx.x + u * kThreads, r = e / chunks, k = 8 * (e % chunks);
        raw[u] = {make_uint4(0, 0, 0, 0), 127};
        if (e < kMmaRows * chunks && rows[r] >= 0) raw[u] = LoadEight(keys, rows[r], k);
      }
    }
  };
  // The decode of the loaded tile into `dst` (generic layout: zeros for empty slots, `rows`).
  auto decode_tile = [&](uint16_t* dst, const int64_t* rows) {
    if constexpr (kIndexFp4) {
      const E2m1Scale scale = E2m1ScaleOf(codes_scale);
      const int quarter_row = threadIdx.x % kMmaRows, quarter = threadIdx.x / kMmaRows;
      uint4* out = reinterpret_cast<uint4*>(dst + quarter_row * ld + index_fp4::kBlock * quarter);
      out[0] = E2m1EightToBf16(codes.x, scale);
      out[1] = E2m1EightToBf16(codes.y, scale);
      out[2] = E2m1EightToBf16(codes.z, scale);
      out[3] = E2m1EightToBf16(codes.w, scale);
    } else {
#pragma unroll
      for (int u = 0; u < kFill; ++u) {
        const int e = threadIdx.x + u * kThreads, r = e / chunks, k = 8 * (e % chunks);
        if (e < kMmaRows * chunks) {
          *reinterpret_cast<uint4*>(dst + r * ld + k) =
              rows[r] >= 0 ? DecodeEight(keys, k, raw[u]) : make_uint4(0, 0, 0, 0);
        }
      }
    }
  };
  auto resolve_rows = [&](int64_t* rows, int64_t tile_begin) {
    if (threadIdx.x < kMmaRows) {
      const int64_t s = tile_begin + threadIdx.x;
      rows[threadIdx.x] = s < end ? CandidateRow(pages, epp, s, keys.rows) : -1;
    }
  };
  load_tile(rows_s[0]);          // the first keys in flight together with q: one memory latency, not two
  CopyAsyncCommitAndWaitAll();  // this thread's q copies landed
  resolve_rows(rows_s[1], begin + kMmaRows);
  __syncthreads();  // q in shared memory, the second tile's rows resolved
  // q's B fragments for the whole loop: k-step kk, heads 0-7 of the group (k 16 kk.., 16 kk + 8..),
  // then heads 8-15.
  uint32_t qb[kMmaMaxDim / 16][4];
  {
    const int mat = lane / 8;  // the ldmatrix matrix this lane addresses
    const uint16_t* q_rows = q_s + (group * 16 + (mat / 2) * 8 + lane % 8) * ld + (mat % 2) * 8;
#pragma unroll
    for (int kk = 0; kk < kMmaMaxDim / 16; ++kk) {
      if (16 * kk < j_n) LdMatrixX4(qb[kk], q_rows + 16 * kk);
    }
  }
  decode_tile(key_buffer(0), rows_s[0]);
  __syncthreads();  // the first tile decoded; q_s read by every warp (it becomes key buffer 1)
  if (begin + kMmaRows < end) load_tile(rows_s[1]);
  const int k_rows = (half * 32 + lane % 16) * ld + (lane / 16) * 8;  // this lane's ldmatrix row
  // Tile n (n = 0, 1, ...): products from buffer n % 2 into part[n % 2]; tile n + 1 decoded into
  // the other buffer and tile n + 2's rows resolved into rows_s[n % 2]; one barrier; tile n + 2's
  // keys loaded (in flight during the next products) and tile n's scores summed.
  for (int64_t base = begin, n = 0; base < end; base += kMmaRows, ++n) {
    const int b = static_cast<int>(n % 2);
    // acc[m][h]: candidates 16 m + g (+ 8) of the warp's 32, heads 8 h + 2c (+ 1) of its group.
    float acc[2][2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kMmaMaxDim / 16; ++kk) {
      if (16 * kk < j_n) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          uint32_t ka[4];
          LdMatrixX4(ka, key_buffer(b) + k_rows + m * 16 * ld + 16 * kk);
          Mma(acc[m][0], ka, qb[kk][0], qb[kk][1]);
          Mma(acc[m][1], ka, qb[kk][2], qb[kk][3]);
        }
      }
    }
    float* part_b = part + b * kMmaGroups * kMmaRows;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // candidate 16 m + g, then 16 m + g + 8
        float v = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          v += w_head[h][0] * fmaxf(acc[m][h][2 * r], 0.0f);
          v += w_head[h][1] * fmaxf(acc[m][h][2 * r + 1], 0.0f);
        }
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (c == 0) part_b[group * kMmaRows + half * 32 + m * 16 + r * 8 + g] = v;
      }
    }
    if (base + kMmaRows < end) decode_tile(key_buffer(b ^ 1), rows_s[b ^ 1]);
    resolve_rows(rows_s[b], base + 2 * kMmaRows);
    __syncthreads();  // tile n's sums written and buffer b read; tile n + 1 decoded; rows of n + 2
    if (base + 2 * kMmaRows < end) load_tile(rows_s[b]);
    if (threadIdx.x < kMmaRows && base + threadIdx.x < end) {
      const int r = threadIdx.x;
      row_scores[base + r] =
          ((part_b[r] + part_b[kMmaRows + r]) + part_b[2 * kMmaRows + r]) + part_b[3 * kMmaRows + r];
    }
  }
}

// Scores of candidates [begin, end) of query t into row_scores[begin, end) in f32 FMA: q in
// f32 in shared memory, one warp per candidate.
__device__ void ScalarScores(const void* q, Elem q_type, const float* w, const TableView& keys,
                             const int32_t* page_table, int64_t p_n, int64_t epp, int64_t t, int64_t begin,
                             int64_t end, int64_t i_n, int64_t j_n, unsigned char* smem, float* row_scores) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* q_s = reinterpret_cast<float*>(smem);
  for (int64_t e = threadIdx.x; e < i_n * j_n; e += kThreads) q_s[e] = LoadElem(q, q_type, t * i_n * j_n + e);
  __syncthreads();
  for (int64_t s = begin + warp; s < end; s += kWarps) {
    const int64_t row = CandidateRow(page_table + t * p_n, epp, s, keys.rows);
    float k_r[kMaxHeadDim / 32];
#pragma unroll
    for (int u = 0; u < kMaxHeadDim / 32; ++u) {
      const int64_t j = lane + 32 * u;
      k_r[u] = j < j_n ? DecodeEntry(keys, row, j) : 0.0f;
    }
    float total = 0.0f;
    for (int64_t i = 0; i < i_n; ++i) {
      float dot = 0.0f;
#pragma unroll
      for (int u = 0; u < kMaxHeadDim / 32; ++u) {
        const int64_t j = lane + 32 * u;
        if (j < j_n) dot += q_s[i * j_n + j] * k_r[u];
      }
      total += w[t * i_n + i] * fmaxf(WarpSum(dot), 0.0f);
    }
    if (lane == 0) row_scores[s] = total;
  }
}

template <Scorer kScorer>
__device__ void Scores(const void* q, Elem q_type, const float* w, const TableView& keys, const int32_t* page_table,
                       int64_t p_n, int64_t epp, int64_t t, int64_t begin, int64_t end, int64_t i_n, int64_t j_n,
                       unsigned char* smem, float* row_scores) {
  if constexpr (kScorer != Scorer::kScalar) {
    MmaScores<kScorer == Scorer::kMmaIndexFp4>(static_cast<const uint16_t*>(q), w, keys, page_table, p_n, epp, t,
                                               begin, end, i_n, j_n, smem, row_scores);
  } else {
    ScalarScores(q, q_type, w, keys, page_table, p_n, epp, t, begin, end, i_n, j_n, smem, row_scores);
  }
}

// The scored mode's first kernel: block (t, y) scores candidates [y, y + 1) x per_block of
// query t into its row of the [T, S] scratch. Its registers are capped so that
// ScoreBlocksPerSm(kScorer) blocks share a multiprocessor, as the grid assumes (the shared
// memory, ~38 KB a block, allows five): four for the scalar scorer (64 registers), three for
// the FP4 one (80; it needs 72, q's fragments being held), two for the generic tensor-core one
// (128; its next tile's raw chunks take 20 more).
constexpr int ScoreBlocksPerSm(Scorer s) { return s == Scorer::kScalar ? 4 : s == Scorer::kMmaIndexFp4 ? 3 : 2; }
template <Scorer kScorer>
__global__ void __launch_bounds__(kThreads, ScoreBlocksPerSm(kScorer))
    IndexerScoreKernel(const void* q, Elem q_type, const float* w, TableView keys, const int32_t* page_table,
                       int64_t p_n, int64_t epp, const int32_t* limit, float* scores, int64_t i_n, int64_t j_n,
                       int64_t per_block) {
  extern __shared__ unsigned char smem[];
  const int64_t t = blockIdx.x, s_n = p_n * epp, begin = blockIdx.y * per_block;
  const int64_t end = min(VisibleCandidates(keys, limit, t, s_n), begin + per_block);
  if (begin >= end) return;
  Scores<kScorer>(q, q_type, w, keys, page_table, p_n, epp, t, begin, end, i_n, j_n, smem, scores + t * s_n);
}

// Counts per radix bin -> the bin of the remaining-th largest key: thread b holds bin 255 - b,
// an inclusive block scan gives the keys in bins at or above it, and the one thread whose
// bin holds the remaining-th updates the shared selection state; `settled` when that bin
// holds exactly the keys still wanted (all of them are kept: the lower bits need no pass).
__device__ void FindBin(const uint32_t* hist, int shift, uint32_t* warp_totals, uint32_t* prefix, uint32_t* want_mask,
                        uint32_t* remaining, uint32_t* settled) {
  static_assert(kThreads == 256, "one radix bin per thread");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, bin = 255 - static_cast<int>(threadIdx.x);
  const uint32_t count = hist[bin];
  uint32_t at_or_above = count;
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t v = __shfl_up_sync(0xffffffffu, at_or_above, o);
    if (lane >= o) at_or_above += v;
  }
  if (lane == 31) warp_totals[warp] = at_or_above;
  __syncthreads();
  for (int v = 0; v < warp; ++v) at_or_above += warp_totals[v];
  const uint32_t want = *remaining, above = at_or_above - count;
  __syncthreads();  // every thread has read `remaining`
  if (above < want && at_or_above >= want) {
    *prefix |= static_cast<uint32_t>(bin) << shift;
    *want_mask |= 0xffu << shift;
    *remaining = want - above;
    *settled = count == want - above;
  }
}

// Selected entries are sorted as one 64-bit key each: the score's order key above the
// candidate's complement, so that larger keys come first and, among equal scores, lower
// candidates (the reference's order); one compare and one 64-bit shuffle per exchange. 0 (the
// padding) sorts after every candidate.
__device__ __forceinline__ uint64_t SortKey(float score, int64_t candidate) {
  return static_cast<uint64_t>(OrderKey(score)) << 32 | static_cast<uint32_t>(~static_cast<uint32_t>(candidate));
}

__device__ __forceinline__ int32_t CandidateOf(uint64_t key) {
  return static_cast<int32_t>(~static_cast<uint32_t>(key));
}

// The bitonic network's stages of stride <= 32 run in registers, a warp per 64-entry segment
// (lane l holds entries l and l + 32 of it; partners of stride < 32 are exchanged by
// shuffles), so only the stages of stride >= 64 need shared memory and a block barrier: for
// 512 entries 6 barrier stages instead of 45.
constexpr int kSegment = 64;

// One compare-exchange stage of the network (block `size`, partner distance `stride` <= 32)
// on a warp's segment in registers: within an ascending block ("ascending" = output order,
// larger keys first) the lower entry of a pair keeps the larger key.
__device__ __forceinline__ void RegisterStage(int base, int size, int stride, uint64_t (&key)[2]) {
  const int lane = threadIdx.x % 32;
  if (stride == 32) {  // entries lane and lane + 32: both in this lane
    const bool ascending = ((base + lane) & size) == 0;
    if (ascending == (key[1] > key[0])) {
      const uint64_t k0 = key[0];
      key[0] = key[1];
      key[1] = k0;
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, key[k], stride);
    const bool lower = (lane & stride) == 0, ascending = ((base + lane + 32 * k) & size) == 0;
    // The lower entry of an ascending pair (or the upper of a descending one) takes the larger.
    if ((lower == ascending) == (other > key[k])) key[k] = other;
  }
}

// Every stage of blocks `first_size` .. `last_size` with stride <= min(32, size / 2), on each
// warp's segments.
__device__ void RegisterStages(uint64_t* keys, int n_sort, int first_size, int last_size) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int base = warp * kSegment; base < n_sort; base += kWarps * kSegment) {
    uint64_t key[2] = {keys[base + lane], keys[base + lane + 32]};
    for (int size = first_size; size <= last_size; size <<= 1) {
      for (int stride = min(32, size / 2); stride > 0; stride >>= 1) RegisterStage(base, size, stride, key);
    }
    keys[base + lane] = key[0];
    keys[base + lane + 32] = key[1];
  }
}

// Sorts keys [0, n_sort) (a power of two >= kSegment) largest first: blocks up to 64 entries
// wholly in registers, then for each larger block its strides >= 64 in shared memory and the
// rest in registers.
__device__ void SortKeys(uint64_t* keys, int n_sort) {
  RegisterStages(keys, n_sort, 2, kSegment);
  __syncthreads();
  for (int size = 2 * kSegment; size <= n_sort; size <<= 1) {
    for (int stride = size / 2; stride >= kSegment; stride >>= 1) {
      for (int e = threadIdx.x; e < n_sort; e += kThreads) {
        const int partner = e ^ stride;
        if (partner > e) {
          const bool ascending = (e & size) == 0;
          const uint64_t mine = keys[e], other = keys[partner];
          if (ascending == (other > mine)) keys[e] = other, keys[partner] = mine;
        }
      }
      __syncthreads();
    }
    RegisterStages(keys, n_sort, size, size);
    __syncthreads();
  }
}

// The smallest power of two >= max(n, kSegment): the sorted length of n entries.
__device__ __forceinline__ int SortLength(int64_t n) {
  int n_sort = kSegment;
  while (n_sort < n) n_sort <<= 1;
  return n_sort;
}

template <Scorer kScorer>
__global__ void IndexerTopkKernel(const void* q, Elem q_type, const float* w, TableView keys, const int32_t* page_table,
                                  int64_t p_n, int64_t epp, const int32_t* limit, const float* scores, int32_t* ids,
                                  int64_t i_n, int64_t j_n, int64_t k_n) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ uint32_t hist[256];
  __shared__ uint32_t prefix, want_mask, remaining, settled, n_above, n_equal, n_equal_taken;
  __shared__ uint32_t warp_counts[kWarps];
  const int64_t t = blockIdx.x, s_n = p_n * epp;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t visible = VisibleCandidates(keys, limit, t, s_n);
  const int64_t kept = min(k_n, visible);
  const size_t region = RegionBytes(i_n, j_n);

  // (1) scores: already in the scratch (scored mode), or computed here into shared memory.
  float* on_chip_row = reinterpret_cast<float*>(smem + region);
  if (!scores) {
    Scores<kScorer>(q, q_type, w, keys, page_table, p_n, epp, t, 0, visible, i_n, j_n, smem, on_chip_row);
  }
  const float* row_scores = scores ? scores + t * s_n : on_chip_row;
  __syncthreads();

  uint64_t* sel = reinterpret_cast<uint64_t*>(smem);  // the kept entries' sort keys (the scoring region is free)

  // (2) radix select: the key of the kept-th largest score.
  if (threadIdx.x == 0) {
    prefix = 0;
    want_mask = 0;
    remaining = static_cast<uint32_t>(kept);
    settled = 0;
  }
  __syncthreads();
  for (int shift = 24; kept > 0 && shift >= 0 && !settled; shift -= 8) {
    hist[threadIdx.x] = 0;
    __syncthreads();
    for (int64_t s = threadIdx.x; s < visible; s += kThreads) {
      const uint32_t key = OrderKey(row_scores[s]);
      if ((key & want_mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    FindBin(hist, shift, warp_counts, &prefix, &want_mask, &remaining, &settled);
    __syncthreads();
  }
  // Keys compare on the bits decided so far (all 32 unless a pass settled early): `threshold`
  // is the (masked) key of the kept-th largest, and `remaining` of its equals are kept.
  const uint32_t mask = want_mask, threshold = prefix;

  // (3) collect the sort keys into `sel`: every score above the threshold; of those equal to it
  // all when exactly `remaining` are (the usual case), else the lowest-numbered `remaining`,
  // chunk by chunk in candidate order.
  if (threadIdx.x == 0) {
    n_above = 0;
    n_equal = 0;
    n_equal_taken = 0;
  }
  __syncthreads();
  for (int64_t s = threadIdx.x; kept > 0 && s < visible; s += kThreads) {
    const uint32_t key = OrderKey(row_scores[s]) & mask;
    if (key > threshold) {
      const uint32_t at = atomicAdd(&n_above, 1u);
      sel[at] = SortKey(row_scores[s], s);
    } else if (key == threshold) {
      atomicAdd(&n_equal, 1u);
    }
  }
  __syncthreads();
  const bool all_equals = n_equal == remaining;
  for (int64_t s = threadIdx.x; kept > 0 && all_equals && s < visible; s += kThreads) {
    if ((OrderKey(row_scores[s]) & mask) == threshold) {
      const uint32_t at = n_above + atomicAdd(&n_equal_taken, 1u);
      sel[at] = SortKey(row_scores[s], s);
    }
  }
  for (int64_t base = 0; kept > 0 && !all_equals && base < visible; base += kThreads) {
    const int64_t s = base + threadIdx.x;
    const bool eq = s < visible && (OrderKey(row_scores[s]) & mask) == threshold;
    const uint32_t ballot = __ballot_sync(0xffffffffu, eq);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    uint32_t before = n_equal_taken;
    for (int v = 0; v < warp; ++v) before += warp_counts[v];
    before += __popc(ballot & ((1u << lane) - 1u));
    if (eq && before < remaining) {
      const uint32_t at = n_above + before;
      sel[at] = SortKey(row_scores[s], s);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int v = 0; v < kWarps; ++v) n_equal_taken += warp_counts[v];
    }
    __syncthreads();
  }
  __syncthreads();

  // (4) bitonic sort of the kept entries (padded to a power of two, at least one warp segment,
  // with keys that sort last).
  const int n_sort = SortLength(kept);
  for (int e = static_cast<int>(kept) + threadIdx.x; e < n_sort; e += kThreads) sel[e] = 0;
  __syncthreads();
  SortKeys(sel, n_sort);
  for (int64_t k = threadIdx.x; k < k_n; k += kThreads) ids[t * k_n + k] = k < kept ? CandidateOf(sel[k]) : -1;
}

// How these arguments are scored (Scorer).
Scorer ScorerFor(const IndexerArgs& a) {
  const TableView& k = a.keys;
  const bool values = k.values_type == Elem::kBf16 || k.values_type == Elem::kE4m3 || k.values_type == Elem::kE2m1x2;
  const bool mma = a.q_type == Elem::kBf16 && a.i <= kMmaRows && a.j % 16 == 0 && a.j <= kMmaMaxDim &&
                   k.rope_width == 0 && values && k.values_width % 8 == 0 && (k.scales_width == 0 || k.block % 8 == 0);
  if (!mma) return Scorer::kScalar;
  const bool index_fp4 = k.values_type == Elem::kE2m1x2 && a.j == index_fp4::kDim && k.values_width == a.j &&
                         k.block == index_fp4::kBlock && k.scales_width == index_fp4::kQuarters;
  return index_fp4 ? Scorer::kMmaIndexFp4 : Scorer::kMma;
}

// The kernels of each scorer, in Scorer's order.
constexpr decltype(&IndexerScoreKernel<Scorer::kScalar>) kScoreKernels[] = {
    IndexerScoreKernel<Scorer::kScalar>, IndexerScoreKernel<Scorer::kMma>, IndexerScoreKernel<Scorer::kMmaIndexFp4>};
constexpr decltype(&IndexerTopkKernel<Scorer::kScalar>) kTopkKernels[] = {
    IndexerTopkKernel<Scorer::kScalar>, IndexerTopkKernel<Scorer::kMma>, IndexerTopkKernel<Scorer::kMmaIndexFp4>};

ffi::Error IndexerTopkCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> w, ffi::AnyBuffer key_values,
                           ffi::AnyBuffer key_scales, ffi::AnyBuffer key_rope, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> limit, ffi::Result<ffi::Buffer<ffi::S32>> ids,
                           ffi::Result<ffi::Buffer<ffi::F32>> scores, int32_t block, int32_t entries_per_page) {
  IndexerArgs a;
  if (auto e = ParseIndexer(q, w, {key_values, key_scales, key_rope}, page_table, limit, ids->dimensions(),
                            scores->dimensions(), block, entries_per_page, &a);
      e.failure()) {
    return e;
  }
  if (a.k > kMaxTopk) return Invalid("the CUDA kernel keeps at most 2048 entries per query");
  if (a.j > kMaxHeadDim) return Invalid("indexer head dim above 256 is not supported by the CUDA kernel");
  if (RegionBytes(a.i, a.j) > kMaxSmemBytes) {
    return Invalid("indexer heads x head dim exceed the CUDA kernel's shared memory");
  }
  const bool on_chip = a.s <= Dsv4IndexerOnChipCandidates(a.i, a.j);
  if (!on_chip && !a.scratch) {
    return Invalid("the score rows do not fit in shared memory: pass a scores scratch [T, S]");
  }
  if (a.t == 0 || a.k == 0) return ffi::Error::Success();
  const int scorer = static_cast<int>(ScorerFor(a));
  const size_t region = RegionBytes(a.i, a.j);
  if (a.scratch) {  // scored mode: the scores over many blocks, then the selection
    // Tiles per block: as few as keep the grid in one wave of resident blocks.
    auto* score = kScoreKernels[scorer];
    static const int64_t sms = std::max<int64_t>(Dsv4MultiprocessorCount(), 1);  // once per process
    const int64_t slots = ScoreBlocksPerSm(static_cast<Scorer>(scorer)) * sms, tiles = (a.s + kMmaRows - 1) / kMmaRows;
    const int64_t per_block = kMmaRows * std::max<int64_t>(1, (a.t * tiles + slots - 1) / slots);
    const dim3 grid(static_cast<unsigned>(a.t), static_cast<unsigned>((a.s + per_block - 1) / per_block));
    score<<<grid, kThreads, region, stream>>>(q.untyped_data(), a.q_type, w.typed_data(), a.keys,
                                              page_table.typed_data(), a.p, a.epp, limit.typed_data(),
                                              scores->typed_data(), a.i, a.j, per_block);
    if (auto e = LastCudaError("IndexerScoreKernel"); e.failure()) return e;
    auto* select = kTopkKernels[scorer];
    select<<<static_cast<unsigned>(a.t), kThreads, region, stream>>>(
        q.untyped_data(), a.q_type, w.typed_data(), a.keys, page_table.typed_data(), a.p, a.epp, limit.typed_data(),
        scores->typed_data(), ids->typed_data(), a.i, a.j, a.k);
    return LastCudaError("IndexerTopkKernel");
  }
  auto* kernel = kTopkKernels[scorer];
  // Once per process and kernel: allow the device's whole opt-in shared memory (above 48 KB).
  static const cudaError_t attr[3] = {
      cudaFuncSetAttribute(kTopkKernels[0], cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(OptInSharedBytes() - kStaticSharedBytes)),
      cudaFuncSetAttribute(kTopkKernels[1], cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(OptInSharedBytes() - kStaticSharedBytes)),
      cudaFuncSetAttribute(kTopkKernels[2], cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(OptInSharedBytes() - kStaticSharedBytes))};
  if (attr[scorer] != cudaSuccess) {
    return ffi::Error::Internal(std::string("shared memory opt-in: ") + cudaGetErrorString(attr[scorer]));
  }
  kernel<<<static_cast<unsigned>(a.t), kThreads, region + a.s * sizeof(float), stream>>>(
      q.untyped_data(), a.q_type, w.typed_data(), a.keys, page_table.typed_data(), a.p, a.epp, limit.typed_data(),
      nullptr, ids->typed_data(), a.i, a.j, a.k);
  return LastCudaError("IndexerTopkKernel");
}

}  // namespace
}  // namespace dsv4

// The most candidates per query whose score row the CUDA kernel keeps in shared memory on the
// current device, for i heads of dim j (0 if none fit). Called by the handler and, through
// ctypes, by dsv4/ops/indexer_topk/ffi.py to decide whether to pass a scores scratch.
extern "C" int64_t Dsv4IndexerOnChipCandidates(int64_t i, int64_t j) {
  const int64_t region = static_cast<int64_t>(dsv4::RegionBytes(i, j));
  const int64_t free = dsv4::OptInSharedBytes() - dsv4::kStaticSharedBytes - region;
  return free > 0 ? free / static_cast<int64_t>(sizeof(float)) : 0;
}

// The columns of the scores scratch the caller passes for T queries of S candidates (i heads
// of dim j): S (scored mode, the file comment) when the score row does not fit on chip, or
// when fewer queries than multiprocessors would each be one block and the row spans more than
// one tile; else 0 (fused). Called through ctypes by dsv4/ops/indexer_topk/ffi.py.
extern "C" int64_t Dsv4IndexerScratchColumns(int64_t t, int64_t s, int64_t i, int64_t j) {
  const bool beyond_chip = s > Dsv4IndexerOnChipCandidates(i, j);
  const bool few_queries = t < Dsv4MultiprocessorCount() && s > dsv4::kMmaRows;
  return beyond_chip || few_queries ? s : 0;
}

namespace ffi = xla::ffi;

// The arguments are those of Dsv4IndexerTopkCpu (indexer_topk_cpu.cc), after the stream.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4IndexerTopkCuda, dsv4::IndexerTopkCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()       // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::AnyBuffer>()       // key values
                                  .Arg<ffi::AnyBuffer>()       // key scales
                                  .Arg<ffi::AnyBuffer>()       // key rope
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // limit
                                  .Ret<ffi::Buffer<ffi::S32>>()  // ids
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scores scratch [T, S] or [T, 0] (none)
                                  .Attr<int32_t>("block")
                                  .Attr<int32_t>("entries_per_page"),
                              {ffi::Traits::kCmdBufferCompatible});
