// indexer_topk on CUDA: the twin of dsv4/ops/indexer_topk/reference.py and of
// indexer_topk_cpu.cc (same arguments, same semantics).
//
// (1) Scores. With bf16 q (up to 64 heads of dim <= 128, a multiple of 16) on tensor cores:
// tiles of 64 candidates are decoded once into shared memory as bf16 (every e2m1/e4m3 x E8M0
// value is exact there) and Q K^T is an mma.sync product, its ReLU-weighted head sum reduced
// in registers; a tile's key loads are issued before the previous tile's products, so they
// overlap. Otherwise one warp per candidate in f32 FMA. Where the scores go:
//   - fused (no scratch, [T, 0]): one block per query scores its visible candidates and
//     streams them into its selection (below): no score reaches HBM, and the block's shared
//     memory does not grow with the context. This serves the prefill chunk, whose thousands
//     of queries fill the GPU. With the model's FP4 keys and enough queries, a block takes
//     two queries with the same page-table row and scores both on each decoded tile: with
//     mma.sync (IndexerTopkKernel), or on SM90 with wgmma, one warpgroup a block decoding the
//     keys straight into the product's register operand (IndexerTopkRsKernel, WgmmaRsScores).
//   - scored (a [T, S] scratch): IndexerScoreKernel spreads each query's candidates over many
//     blocks and writes the scores to the scratch, then the selection kernel streams them back.
//     Dsv4IndexerScratchColumns asks for this for decode, where one block per query would
//     leave most multiprocessors idle (a few queries' score rows, ~4 KB each at a 4k context,
//     against the keys' 70 KB read).
// (2) Selection, streamed: each candidate is one 64-bit sort key (SortKey: the score's
// order-preserving bits above the candidate's complement, so larger keys rank first and equal
// scores go to the lower candidate, the reference's order; keys are distinct). Keys at or
// above a bound join a pool in shared memory of k + kPoolSlack entries; when the pool may
// overflow, a radix select (8-bit digits from the top, each histogram's bin found by a
// block-wide scan, stopping once a bin holds exactly the keys still wanted) keeps its k
// largest and raises the bound to them, so that a key below it, beaten by k kept ones, never
// joins again. At the end the pool's k largest are selected the same way and sorted by a
// bitonic network (score desc, candidate asc).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda_common.h"
#include "cuda_tiles.h"
#include "op_args.h"
#include "wgmma.h"

extern "C" int64_t Dsv4IndexerScratchColumns(int64_t t, int64_t s, int64_t i, int64_t j);
extern "C" int64_t Dsv4MultiprocessorCount();  // sparse_attention_cuda.cu

namespace dsv4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTopk = 2048;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxSmemBytes = 40 * 1024;  // the scoring region (RegionBytes), before the selection's pool
constexpr int kMmaRows = 64;               // tensor-core scoring: heads (padded) and candidates per tile
constexpr int kMmaMaxDim = 128;
constexpr int kMmaGroups = kMmaRows / 16;  // head groups of 16 (the mma's M)
constexpr int kPad = 8;                    // bf16 row padding: conflict-free ldmatrix rows

// How a kernel scores: f32 FMA, tensor cores on any key layout, or tensor cores on the model's
// FP4 index keys (ScorerFor: constant-offset loads and a branch-free decode); on SM90 the fused
// kernel scores those keys on wgmma from registers (kWgmmaRsIndexFp4, WgmmaRsScores: only
// IndexerTopkRsKernel uses it, never ScorerFor).
enum class Scorer { kScalar, kMma, kMmaIndexFp4, kWgmmaRsIndexFp4 };

// The model's stored index key (INDEX_FP4 at FLASH dims): 128 e2m1 codes packed two a byte,
// one E8M0 scale per 32.
namespace index_fp4 {
constexpr int kDim = 128, kBlock = 32;
constexpr int kBytes = kDim / 2;           // packed codes a row
constexpr int kQuarters = kDim / kBlock;   // 16-byte quarters a row, one scale each
}  // namespace index_fp4

// Bytes of the scoring inputs in shared memory for `queries` (1 or 2) queries scored together:
// q in f32 for the scalar scorer (one query); for the tensor-core one, two key tiles in bf16
// (q's space until its fragments are in registers: one query's q and a key tile, or two
// queries' q) plus two sets of each query's head-group partial sums; rounded up to 16 bytes
// (the pools follow it).
DSV4_HD size_t RegionBytes(int64_t i, int64_t j, int queries = 1) {
  const size_t scalar = i * j * sizeof(float);
  const size_t mma =
      j <= kMmaMaxDim ? 2 * kMmaRows * (j + kPad) * 2 + 2 * queries * kMmaGroups * kMmaRows * sizeof(float) : 0;
  return ((scalar > mma ? scalar : mma) + 15) / 16 * 16;
}

// The bitonic sort's warp segment (see RegisterStages): the shortest sorted length.
constexpr int kSegment = 64;

// The smallest power of two >= max(n, kSegment): the sorted length of n entries.
DSV4_HD constexpr int SortLength(int64_t n) {
  int n_sort = kSegment;
  while (n_sort < n) n_sort <<= 1;
  return n_sort;
}

// The selection's pool (the file comment): k kept keys and room for the candidates that may
// join before the next compaction (a compaction keeps k; see AfterStep for how close to full
// the pool may get). At least the sorted length of k entries, since the kept keys are sorted in
// place padded to it: SortLength(k) <= k + 1024 for every k (the RS kernel's smaller slack,
// wgmma_rs::kPoolSlack, holds it for every k but 1025..1279: the host sends those elsewhere).
constexpr int64_t kPoolSlack = 1024;
DSV4_HD constexpr int64_t PoolCapacity(int64_t k, int64_t slack = kPoolSlack) { return k + slack; }
DSV4_HD constexpr size_t PoolBytes(int64_t k, int64_t slack = kPoolSlack) {
  return static_cast<size_t>(PoolCapacity(k, slack)) * sizeof(uint64_t);
}
// Queries a fused block may score together (they share each decoded key tile; see
// IndexerTopkKernel), each with its own pool.
constexpr int kMaxPairedQueries = 2;

// Larger float -> larger key; -0 and +0 share a key (they tie in the reference).
__device__ __forceinline__ uint32_t OrderKey(float v) {
  const uint32_t b = FloatToBits(v == 0.0f ? 0.0f : v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The stored row of the candidate at `offset` in a page with page-table entry `page`: the
// page's row, or the last row for an unallocated page (the reference's clipped gather),
// clipped to the table too.
__device__ __forceinline__ int64_t RowInPage(int64_t page, int64_t epp, int64_t offset, int64_t rows) {
  return page >= 0 ? min(page * epp + offset, rows - 1) : rows - 1;
}

// The stored row of candidate s (RowInPage).
__device__ __forceinline__ int64_t CandidateRow(const int32_t* pages, int64_t epp, int64_t s, int64_t rows) {
  // 32-bit division (S < 2^31; a 64-bit one is a long software routine on the GPU).
  const int32_t s32 = static_cast<int32_t>(s), epp32 = static_cast<int32_t>(epp);
  return RowInPage(pages[s32 / epp32], epp, s32 % epp32, rows);
}

// One thread's candidate in each successive tile of kTile candidates (s = s0, s0 + kTile, ...)
// and the row it reads (RowInPage, as CandidateRow). Next() loads the candidate's page-table
// entry and steps to the next tile; Row() of what it returned, called a tile later, forms the
// row when the entry has long arrived. The page and the offset in it advance by additions (the
// division by the page size would cost a tile more than the rest of this).
template <int kTile>
struct TileCandidates {
  struct Pending {
    int32_t entry;   // the page-table entry (-1: unallocated page)
    int32_t offset;  // the candidate's offset in its page
    bool valid;      // s < end
  };
  const int32_t* pages;
  int64_t rows;
  int32_t s, end, epp, page, offset, step_pages, step_offset, last_page;
  // end > 0: past it, the last visible candidate's page entry is loaded and not used. (With a
  // branch around the load, the entry's register was also written with a default, and the
  // compiler made that write wait for the loads in flight, the keys just issued among them.)
  __device__ TileCandidates(const int32_t* pages, int64_t epp, int64_t s0, int64_t end, int64_t rows)
      : pages(pages), rows(rows), s(static_cast<int32_t>(s0)), end(static_cast<int32_t>(end)),
        epp(static_cast<int32_t>(epp)) {
    // 32-bit divisions (S < 2^31), once.
    page = s / this->epp, offset = s % this->epp;
    step_pages = kTile / this->epp, step_offset = kTile % this->epp;
    last_page = (this->end - 1) / this->epp;
  }
  __device__ __forceinline__ Pending Next() {
    const Pending p{pages[min(page, last_page)], offset, s < end};
    s += kTile, page += step_pages, offset += step_offset;
    if (offset >= epp) offset -= epp, ++page;
    return p;
  }
  __device__ __forceinline__ int64_t Row(const Pending& p) const {
    return p.valid ? RowInPage(p.entry, epp, p.offset, rows) : -1;
  }
  // Row() in 32-bit arithmetic, for tables with rows + 2 epp < 2^31 (the caller's check): the
  // entry is first clipped to the page past the table's last row, so that entry x epp + offset
  // cannot overflow and still clips to the last row.
  __device__ __forceinline__ int32_t Row32(const Pending& p) const {
    const int32_t last = static_cast<int32_t>(rows) - 1;
    const int32_t entry = min(p.entry, last / epp + 1);
    const int32_t row = p.entry >= 0 ? min(entry * epp + p.offset, last) : last;
    return p.valid ? row : -1;
  }
};

// The candidates query t may see: its causal limit, clipped to [0, S] (none without keys).
__device__ __forceinline__ int64_t VisibleCandidates(const TableView& keys, const int32_t* limit, int64_t t,
                                                     int64_t s_n) {
  return keys.rows ? min(max(static_cast<int64_t>(limit[t]), int64_t{0}), s_n) : 0;
}

// One thread's share of an FP4 key tile (the model's layout): quarter `quarter` of a row (16
// bytes: 32 codes, one E8M0 scale block), loaded a tile ahead into registers and decoded into
// four 8-value bf16 chunks (zeros for an empty slot, row -1).
struct Fp4Quarter {
  uint4 codes;
  uint8_t scale;
  __device__ __forceinline__ void Load(const TableView& keys, int64_t row, int quarter) {
    codes = make_uint4(0, 0, 0, 0);  // decodes to zeros
    scale = 127;
    if (row >= 0) {
      codes = *reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(keys.values) +
                                              row * index_fp4::kBytes + 16 * quarter);
      scale = keys.scales[row * index_fp4::kQuarters + quarter];
    }
  }
  // Load's bytes from `values_q` (the table's values + 16 quarter) and `scales_q` (its scales +
  // quarter) for a 32-bit row: one wide multiply-add an address.
  __device__ __forceinline__ void Load32(const unsigned char* values_q, const uint8_t* scales_q, int32_t row) {
    codes = make_uint4(0, 0, 0, 0);  // decodes to zeros
    scale = 127;
    if (row >= 0) {
      codes = *reinterpret_cast<const uint4*>(values_q + static_cast<uint32_t>(row) * uint64_t{index_fp4::kBytes});
      scale = scales_q[static_cast<uint32_t>(row) * uint64_t{index_fp4::kQuarters}];
    }
  }
  __device__ __forceinline__ void Decode(uint4 (&out)[4]) const {
    const E2m1Scale s = E2m1ScaleOf(scale);
    out[0] = E2m1EightToBf16(codes.x, s);
    out[1] = E2m1EightToBf16(codes.y, s);
    out[2] = E2m1EightToBf16(codes.z, s);
    out[3] = E2m1EightToBf16(codes.w, s);
  }
};

// Where a scoring loop's scores go (Sink): Emit(u, s, score, valid) is called by whole warps,
// u being which of the loop's queries (0 but for paired FP4 scoring) and the lanes with a
// candidate marked valid, and Barrier() by the whole block between tiles (it is the block
// barrier of the loop's pipeline). RowSink writes a score row in global memory (the scored
// mode's scratch); PoolSink streams them into the selection.
struct RowSink {
  float* row;
  __device__ void Emit(int, int64_t s, float score, bool valid) {
    if (valid) row[s] = score;
  }
  __device__ void Barrier() { __syncthreads(); }
};

// Scores of candidates [begin, end) of kQueries queries ts[] (sharing their page-table row;
// query u sees those below ends[u], end being the largest) into `sink` on tensor cores (the
// file comment). Warp w: head group w % 4 (heads 16 (w % 4) .. +16) and candidates
// 32 (w / 4) .. +32 of the tile, for every query, as S^T = K Q^T (candidates are the mma's
// rows, heads its columns), so that a lane's accumulators hold 4 of the group's heads for
// each of its candidates: their w_i relu(dot) are summed in registers, then over the 4 lanes
// of a row by two shuffles, and the four head groups' sums are added in a fixed order. With
// two queries each key fragment loaded from shared memory feeds both queries' products, and
// each tile is loaded, decoded and waited for once for both.
// q's fragments stay in registers for the whole loop, which frees q's shared memory for a
// second key buffer: while tile n's products run from one buffer, its keys having been decoded
// during tile n - 1, tile n + 1's keys (loaded into registers a tile ahead) are decoded into
// the other, so one block barrier a tile suffices.
// kIndexFp4: the keys are in the model's FP4 layout (ScorerFor): thread u * 64 + r loads
// quarter u of row r (16 bytes: 32 codes, one scale block) and decodes it with constant
// offsets (a quarter-warp's 16-byte stores then fall in distinct banks); otherwise each
// thread loads and decodes four generic 8-value chunks.
template <bool kIndexFp4, int kQueries, class Sink>
__device__ void MmaScores(const uint16_t* q, const float* w, const TableView& keys, const int32_t* page_table,
                          int64_t p_n, int64_t epp, const int64_t* ts, int64_t begin, const int64_t* ends,
                          int64_t end, int64_t i_n, int64_t j_arg, unsigned char* smem, Sink& sink) {
  static_assert(kQueries >= 1 && kQueries <= kMaxPairedQueries, "q's shared memory holds two key tiles");
  __shared__ float w_s[kQueries][kMmaRows];
  __shared__ int64_t rows_s[2][kMmaRows];  // stored row of each candidate of the tile (-1 past the end)
  const int64_t j_n = kIndexFp4 ? index_fp4::kDim : j_arg;
  const int ld = static_cast<int>(j_n) + kPad;
  // q [kQueries][kMmaRows heads][ld] until its fragments are in registers, then the two key
  // buffers [kMmaRows candidates][ld] (with one query the first is free from the start); then
  // the head groups' sums [2][kQueries][kMmaGroups][kMmaRows].
  uint16_t* q_s = reinterpret_cast<uint16_t*>(smem);
  auto key_buffer = [&](int b) { return q_s + (1 - b) * kMmaRows * ld; };
  float* part = reinterpret_cast<float*>(q_s + 2 * kMmaRows * ld);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = warp % kMmaGroups, half = warp / kMmaGroups;
  const int g = lane / 4, c = lane % 4, chunks = static_cast<int>(j_n / 8);
  const int32_t* pages = page_table + ts[0] * p_n;
  for (int e = threadIdx.x; e < kQueries * kMmaRows * chunks; e += kThreads) {  // all copies in flight at once
    const int u = e / (kMmaRows * chunks), r = e / chunks % kMmaRows, k = 8 * (e % chunks);
    uint16_t* dst = q_s + (u * kMmaRows + r) * ld + k;
    if (r < i_n) {
      CopyAsync16(dst, q + (ts[u] * i_n + r) * j_n + k);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
  if (threadIdx.x < kMmaRows) {
    const int64_t s = begin + threadIdx.x;
#pragma unroll
    for (int u = 0; u < kQueries; ++u) w_s[u][threadIdx.x] = threadIdx.x < i_n ? w[ts[u] * i_n + threadIdx.x] : 0.0f;
    rows_s[0][threadIdx.x] = s < end ? CandidateRow(pages, epp, s, keys.rows) : -1;
  }
  __syncthreads();  // the first tile's rows and w resolved (q is still on its way)
  float w_head[kQueries][2][2];  // w of heads 8 h + 2c (+ 1) of this warp's group (the accumulators' columns)
#pragma unroll
  for (int u = 0; u < kQueries; ++u) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      w_head[u][h][0] = w_s[u][group * 16 + 8 * h + 2 * c];
      w_head[u][h][1] = w_s[u][group * 16 + 8 * h + 2 * c + 1];
    }
  }
  constexpr int kFill = kMmaRows * (kMmaMaxDim / 8) / kThreads;  // 16-byte chunks per thread per tile
  RawEight raw[kFill];  // generic layout: this thread's chunks of the next tile
  Fp4Quarter fp4;       // FP4 layout: this thread's quarter row of the next tile
  auto load_tile = [&](const int64_t* rows) {
    if constexpr (kIndexFp4) {
      static_assert(kMmaRows * index_fp4::kQuarters == kThreads, "one quarter row a thread");
      fp4.Load(keys, rows[threadIdx.x % kMmaRows], threadIdx.x / kMmaRows);
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
      const int quarter_row = threadIdx.x % kMmaRows, quarter = threadIdx.x / kMmaRows;
      uint4 chunks[4];
      fp4.Decode(chunks);
      uint4* out = reinterpret_cast<uint4*>(dst + quarter_row * ld + index_fp4::kBlock * quarter);
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] = chunks[e];
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
  // q's B fragments for the whole loop: query u, k-step kk, heads 0-7 of the group (k 16 kk..,
  // 16 kk + 8..), then heads 8-15.
  uint32_t qb[kQueries][kMmaMaxDim / 16][4];
  {
    const int mat = lane / 8;  // the ldmatrix matrix this lane addresses
    const uint16_t* q_rows = q_s + (group * 16 + (mat / 2) * 8 + lane % 8) * ld + (mat % 2) * 8;
#pragma unroll
    for (int u = 0; u < kQueries; ++u) {
#pragma unroll
      for (int kk = 0; kk < kMmaMaxDim / 16; ++kk) {
        if (16 * kk < j_n) LdMatrixX4(qb[u][kk], q_rows + u * kMmaRows * ld + 16 * kk);
      }
    }
  }
  if constexpr (kQueries > 1) __syncthreads();  // every warp's q read: key buffer 0 is the second query's q
  decode_tile(key_buffer(0), rows_s[0]);
  __syncthreads();  // the first tile decoded; q_s read by every warp (it becomes key buffer 1)
  if (begin + kMmaRows < end) load_tile(rows_s[1]);
  const int k_rows = (half * 32 + lane % 16) * ld + (lane / 16) * 8;  // this lane's ldmatrix row
  // Tile n (n = 0, 1, ...): products from buffer n % 2 into part[n % 2]; tile n + 1 decoded into
  // the other buffer and tile n + 2's rows resolved into rows_s[n % 2]; one barrier; tile n + 2's
  // keys loaded (in flight during the next products) and tile n's scores summed.
  for (int64_t base = begin, n = 0; base < end; base += kMmaRows, ++n) {
    const int b = static_cast<int>(n % 2);
    // acc[u][m][h]: query u, candidates 16 m + g (+ 8) of the warp's 32, heads 8 h + 2c (+ 1)
    // of its group.
    float acc[kQueries][2][2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kMmaMaxDim / 16; ++kk) {
      if (16 * kk < j_n) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          uint32_t ka[4];
          LdMatrixX4(ka, key_buffer(b) + k_rows + m * 16 * ld + 16 * kk);
#pragma unroll
          for (int u = 0; u < kQueries; ++u) {
            Mma(acc[u][m][0], ka, qb[u][kk][0], qb[u][kk][1]);
            Mma(acc[u][m][1], ka, qb[u][kk][2], qb[u][kk][3]);
          }
        }
      }
    }
    float* part_b = part + b * kQueries * kMmaGroups * kMmaRows;
#pragma unroll
    for (int u = 0; u < kQueries; ++u) {
#pragma unroll
      for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // candidate 16 m + g, then 16 m + g + 8
          float v = 0.0f;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            v += w_head[u][h][0] * fmaxf(acc[u][m][h][2 * r], 0.0f);
            v += w_head[u][h][1] * fmaxf(acc[u][m][h][2 * r + 1], 0.0f);
          }
          v += __shfl_xor_sync(0xffffffffu, v, 1);
          v += __shfl_xor_sync(0xffffffffu, v, 2);
          if (c == 0) part_b[(u * kMmaGroups + group) * kMmaRows + half * 32 + m * 16 + r * 8 + g] = v;
        }
      }
    }
    if (base + kMmaRows < end) decode_tile(key_buffer(b ^ 1), rows_s[b ^ 1]);
    resolve_rows(rows_s[b], base + 2 * kMmaRows);
    sink.Barrier();  // tile n's sums written and buffer b read; tile n + 1 decoded; rows of n + 2
    if (base + 2 * kMmaRows < end) load_tile(rows_s[b]);
    if (threadIdx.x < kQueries * kMmaRows) {  // whole warps (0 and 1 a query)
      const int u = threadIdx.x / kMmaRows, r = threadIdx.x % kMmaRows;
      const float* sums = part_b + u * kMmaGroups * kMmaRows;
      sink.Emit(u, base + r,
                ((sums[r] + sums[kMmaRows + r]) + sums[2 * kMmaRows + r]) + sums[3 * kMmaRows + r],
                base + r < ends[u]);
    }
  }
}

// The weighted head sum of each of this lane's two candidates (rows row0 and row0 + 8 of the
// accumulators) over one query's 64 heads, acc[4 (j0 + j) + 2 r + h] being candidate row0 + 8 r,
// head 8 j + 2c + h: a lane's 16 heads in four chains of four (one chain of 16 waited for each
// add's latency), then over the row's four lanes. Returns what lane c emits: row0's sum for
// c = 0, row0 + 8's for c = 1 (one append to the pool a warp and tile).
template <int N>
__device__ __forceinline__ float HeadSums(const float (&acc)[N], int j0, const float (&w_head)[8][2], int c) {
  float sums[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float chain[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        chain[(2 * j + h) % 4] += w_head[j][h] * fmaxf(acc[4 * (j0 + j) + 2 * r + h], 0.0f);
      }
    }
    sums[r] = (chain[0] + chain[1]) + (chain[2] + chain[3]);
    sums[r] += __shfl_xor_sync(0xffffffffu, sums[r], 1);
    sums[r] += __shfl_xor_sync(0xffffffffu, sums[r], 2);
  }
  return c == 0 ? sums[0] : sums[1];
}

// One or two queries a warpgroup on SM90 with the keys as wgmma's register operand (RS): a
// block of one warpgroup scores kQueries queries (two: a request's consecutive tokens, the same
// page-table row) as S^T = K [Q_0; Q_1]^T, m64n(64 kQueries)k16, its A fragments (the tile's
// keys) decoded straight from the loaded FP4 bytes into registers, once for all its queries, and
// q (B) read from shared memory. No decoded tile goes through shared memory (no stores, no
// fence, no buffer to hand over), so the products read at most half the shared memory of the SS
// form and a block waits on nothing but its own loads and products; the blocks a multiprocessor
// runs (wgmma_rs::kBlocksPerSm) are independent, so one's head sums and selection overlap
// another's products. Two queries a warpgroup (m64n128k16) rather than one (m64n64k16): the
// decode, the most instructions of a tile, then serves both (measured 2026-12-03: one query a
// warpgroup, four blocks a multiprocessor, was 24% slower on the 64k chunk than two).
// The K index is permuted (a dot product does not depend on the order of its terms): lane
// 4 g + c holds in k-step kk the A fragment's columns 16 kk + 2c, +1, +8, +9, and these are
// made elements 32 c + 4 kk .. +3 of the stored row (element m of a stored row, with x = m / 32,
// kk = m % 32 / 4, i = m % 4, has K index 16 kk + 2 x + (i < 2 ? i : i + 6)), so the thread's 32
// elements of a row over the 8 k-steps are its quarter c: one 16-byte load and one E8M0 scale,
// two bytes a k-step. q is stored in shared memory in that order once.
namespace wgmma_rs {
constexpr int kThreads = 128;                        // one warpgroup
constexpr int kQueries = 2;                          // queries a block (paired; see the kernel)
constexpr int kBlocksPerSm = 4;                      // 128 registers a thread (w in shared memory)
constexpr int kPoolSlack = 768;                      // four blocks' shared memory at k = 512 (RsFits)
constexpr int kChunks = index_fp4::kDim / 8;         // 16-byte chunks of a q row
constexpr int kSteps = index_fp4::kDim / 16;         // k-steps a tile
constexpr size_t kQBytes = kMmaRows * kChunks * 16;  // one query's q: 64 heads x 128 bf16, core-matrix layout
}  // namespace wgmma_rs

// Dynamic shared memory of IndexerTopkRsKernel with `queries` queries a block: q, then the pools.
DSV4_HD constexpr size_t RsSharedBytes(int queries, int64_t k) {
  return queries * (wgmma_rs::kQBytes + PoolBytes(k, wgmma_rs::kPoolSlack));
}

// Whether the RS kernel's pools hold top-k's sort (its padding to SortLength(k)): not for k in
// 1025..1279, which the host gives the mma.sync kernels (their slack holds every k).
DSV4_HD constexpr bool RsFits(int64_t k) { return SortLength(k) <= k + wgmma_rs::kPoolSlack; }
static_assert(RsFits(512) && RsFits(1024) && !RsFits(1025) && !RsFits(1279) && RsFits(1280) && RsFits(2048),
              "the RS pools' slack against the sorted length");

template <int kQueries>
struct RsGmma;  // the CuTe atom of kQueries queries' 64 heads each
template <>
struct RsGmma<1> {
  using Atom = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
};
template <>
struct RsGmma<2> {
  using Atom = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
};

// Scores of candidates [begin, ends[u]) of queries ts[] into `sink` (one warpgroup, 128 threads).
template <int kQueries, class Sink>
__device__ void WgmmaRsScores(const uint16_t* q, const float* w, const TableView& keys, const int32_t* page_table,
                              int64_t p_n, int64_t epp, const int64_t* ts, int64_t begin, const int64_t* ends,
                              int64_t end, int64_t i_n, unsigned char* smem, Sink& sink) {
  constexpr int kSteps = wgmma_rs::kSteps, kChunks = wgmma_rs::kChunks;
  static_assert(kQueries == 1 || kQueries == 2, "one or two queries a warpgroup");
  using Gmma = typename RsGmma<kQueries>::Atom;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  // This lane's candidates: rows row0 and row0 + 8 of each tile (the A fragment's and the
  // accumulators' rows), quarter c of each.
  const int row0 = 16 * warp + g;
  const int32_t* pages = page_table + ts[0] * p_n;
  TileCandidates<kMmaRows> cand0(pages, epp, begin + row0, end, keys.rows),
      cand1(pages, epp, begin + row0 + 8, end, keys.rows);
  Fp4Quarter fp4[2];  // this thread's quarters of the next tile's two rows
  auto next0 = cand0.Next(), next1 = cand1.Next();  // tile 0's entries
  // (32-bit rows: the host launches this only for tables with rows + 2 epp < 2^31.)
  const unsigned char* values_q = static_cast<const unsigned char*>(keys.values) + 16 * c;
  const uint8_t* scales_q = keys.scales + c;
  fp4[0].Load32(values_q, scales_q, cand0.Row32(next0));
  fp4[1].Load32(values_q, scales_q, cand1.Row32(next1));
  next0 = cand0.Next(), next1 = cand1.Next();  // tile 1's entries
  // q in the permuted K order (above); query u's head h is row 64 u + h of the B operand,
  // padded heads zeros. Elements 8 j .. 8 j + 7 of quarter x (word y: elements 8 j + 2 y, + 1)
  // have K index 32 j + 8 y + 2 x (+ 1): chunk 4 j + y of the row holds word y of the four
  // quarters' pieces j. So a thread moves piece j of each quarter of a row (4 x 16 bytes) into
  // its 4 chunks. A row's chunks share their banks, so consecutive threads take consecutive
  // rows: each 8 lanes of a 16-byte store fill the 32 banks once.
  static_assert(index_fp4::kQuarters == 4 && index_fp4::kBlock == 32, "a chunk: one word of each quarter");
  constexpr int kRows = kQueries * kMmaRows, kPieces = index_fp4::kBlock / 8;
  static_assert(kRows * kPieces % wgmma_rs::kThreads == 0, "whole rounds");
#pragma unroll 2  // (two rounds of loads in flight; all four would make the tile loop spill)
  for (int round = 0; round < kRows * kPieces / wgmma_rs::kThreads; ++round) {
    const int e = threadIdx.x + round * wgmma_rs::kThreads, row = e % kRows, j = e / kRows, head = row % kMmaRows;
    const int64_t t = row < kMmaRows ? ts[0] : ts[kQueries - 1];
    uint4 piece[index_fp4::kQuarters];
#pragma unroll
    for (int x = 0; x < index_fp4::kQuarters; ++x) {
      piece[x] = head < i_n ? *reinterpret_cast<const uint4*>(q + (t * i_n + head) * index_fp4::kDim +
                                                              index_fp4::kBlock * x + 8 * j)
                            : make_uint4(0, 0, 0, 0);
    }
    unsigned char* chunks = smem + CoreChunkOffset(row, 4 * j, kChunks);
    *reinterpret_cast<uint4*>(chunks) = make_uint4(piece[0].x, piece[1].x, piece[2].x, piece[3].x);
    *reinterpret_cast<uint4*>(chunks + 128) = make_uint4(piece[0].y, piece[1].y, piece[2].y, piece[3].y);
    *reinterpret_cast<uint4*>(chunks + 256) = make_uint4(piece[0].z, piece[1].z, piece[2].z, piece[3].z);
    *reinterpret_cast<uint4*>(chunks + 384) = make_uint4(piece[0].w, piece[1].w, piece[2].w, piece[3].w);
  }
  // w of each query's 64 heads (0 for padded ones) in shared memory: its 32 registers a thread
  // let four blocks share a multiprocessor.
  __shared__ float w_s[kQueries][kMmaRows];
  if (threadIdx.x < kQueries * kMmaRows) {
    const int u = threadIdx.x / kMmaRows, head = threadIdx.x % kMmaRows;
    w_s[u][head] = head < i_n ? w[(u == 0 ? ts[0] : ts[kQueries - 1]) * i_n + head] : 0.0f;
  }
  FenceSharedForAsyncProxy();
  __syncthreads();  // q in shared memory
  const uint64_t q_desc = WgmmaDescriptor(smem, 128, kChunks * 128);
  // Tile n: its keys decoded from registers into the A fragments; tile n + 1's keys loaded (in
  // flight for the rest of the tile) and tile n + 2's page-table entries; the products issued and
  // waited for; the scores emitted; the sink's barrier.
  for (int64_t base = begin; base < end; base += kMmaRows) {
    // a[kk]: k-step kk's fragment: rows row0 / row0 + 8, elements 4 kk, 4 kk + 1 of the quarter
    // (byte 2 kk), then 4 kk + 2, 4 kk + 3 (byte 2 kk + 1). Decode gives a word's four bytes'
    // bf16 pairs in order, a word holding two k-steps.
    uint32_t a[kSteps][4];
    {
      uint4 d0[4], d1[4];
      fp4[0].Decode(d0);
      fp4[1].Decode(d1);
#pragma unroll
      for (int kk = 0; kk < kSteps; kk += 2) {
        const uint4 r0 = d0[kk / 2], r1 = d1[kk / 2];
        a[kk][0] = r0.x, a[kk][1] = r1.x, a[kk][2] = r0.y, a[kk][3] = r1.y;
        a[kk + 1][0] = r0.z, a[kk + 1][1] = r1.z, a[kk + 1][2] = r0.w, a[kk + 1][3] = r1.w;
      }
    }
    if (base + kMmaRows < end) {
      fp4[0].Load32(values_q, scales_q, cand0.Row32(next0));
      fp4[1].Load32(values_q, scales_q, cand1.Row32(next1));
    }
    next0 = cand0.Next(), next1 = cand1.Next();
    float acc[32 * kQueries];
    FenceOperands(acc);
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) FenceOperands(a[kk]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      WgmmaRs<Gmma>(a[kk], WgmmaDescriptorAt(q_desc, kk * 2 * 128), acc, kk > 0);
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    FenceOperands(acc);
    const int64_t s = base + row0 + 8 * (c & 1);
#pragma unroll
    for (int u = 0; u < kQueries; ++u) {
      float w_head[8][2];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 pair = *reinterpret_cast<const float2*>(&w_s[u][8 * j + 2 * c]);
        w_head[j][0] = pair.x, w_head[j][1] = pair.y;
      }
      sink.Emit(u, s, HeadSums(acc, 8 * u, w_head, c), c < 2 && s < (u == 0 ? ends[0] : ends[kQueries - 1]));
    }
    sink.Barrier();
  }
}

// Scores of candidates [begin, end) of query t into `sink` in f32 FMA: q in f32 in shared
// memory, one warp per candidate, kWarps candidates between the sink's barriers.
template <class Sink>
__device__ void ScalarScores(const void* q, Elem q_type, const float* w, const TableView& keys,
                             const int32_t* page_table, int64_t p_n, int64_t epp, int64_t t, int64_t begin,
                             int64_t end, int64_t i_n, int64_t j_n, unsigned char* smem, Sink& sink) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* q_s = reinterpret_cast<float*>(smem);
  for (int64_t e = threadIdx.x; e < i_n * j_n; e += kThreads) q_s[e] = LoadElem(q, q_type, t * i_n * j_n + e);
  __syncthreads();
  for (int64_t tile = begin; tile < end; tile += kWarps) {
    const int64_t s = tile + warp;
    float total = 0.0f;
    if (s < end) {
      const int64_t row = CandidateRow(page_table + t * p_n, epp, s, keys.rows);
      float k_r[kMaxHeadDim / 32];
#pragma unroll
      for (int u = 0; u < kMaxHeadDim / 32; ++u) {
        const int64_t j = lane + 32 * u;
        k_r[u] = j < j_n ? DecodeEntry(keys, row, j) : 0.0f;
      }
      for (int64_t i = 0; i < i_n; ++i) {
        float dot = 0.0f;
#pragma unroll
        for (int u = 0; u < kMaxHeadDim / 32; ++u) {
          const int64_t j = lane + 32 * u;
          if (j < j_n) dot += q_s[i * j_n + j] * k_r[u];
        }
        total += w[t * i_n + i] * fmaxf(WarpSum(dot), 0.0f);
      }
    }
    sink.Emit(0, s, total, lane == 0 && s < end);
    sink.Barrier();
  }
}

// Scores of candidates [begin, ends[u]) of kQueries queries ts[] (more than one only for the
// tensor-core scorers, and only for queries with the same page-table row) into `sink`.
template <Scorer kScorer, int kQueries, class Sink>
__device__ void Scores(const void* q, Elem q_type, const float* w, const TableView& keys, const int32_t* page_table,
                       int64_t p_n, int64_t epp, const int64_t* ts, int64_t begin, const int64_t* ends, int64_t i_n,
                       int64_t j_n, unsigned char* smem, Sink& sink) {
  int64_t end = ends[0];
  for (int u = 1; u < kQueries; ++u) end = max(end, ends[u]);
  if constexpr (kScorer == Scorer::kWgmmaRsIndexFp4) {
    WgmmaRsScores<kQueries>(static_cast<const uint16_t*>(q), w, keys, page_table, p_n, epp, ts, begin, ends, end, i_n,
                            smem, sink);
  } else if constexpr (kScorer != Scorer::kScalar) {
    MmaScores<kScorer == Scorer::kMmaIndexFp4, kQueries>(static_cast<const uint16_t*>(q), w, keys, page_table, p_n,
                                                         epp, ts, begin, ends, end, i_n, j_n, smem, sink);
  } else {
    static_assert(kQueries == 1, "the scalar scorer scores one query at a time");
    ScalarScores(q, q_type, w, keys, page_table, p_n, epp, ts[0], begin, end, i_n, j_n, smem, sink);
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
  RowSink sink{scores + t * s_n};
  Scores<kScorer, 1>(q, q_type, w, keys, page_table, p_n, epp, &t, begin, &end, i_n, j_n, smem, sink);
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
// (kSegment; lane l holds entries l and l + 32 of it; partners of stride < 32 are exchanged by
// shuffles), so only the stages of stride >= 64 need shared memory and a block barrier: for
// 512 entries 6 barrier stages instead of 45.

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

// The stages of stride <= 32 on each warp's segments (kBlock threads): for `size` kSegment
// (SortKeys's first call), every stage of blocks 2 .. kSegment (each segment sorted,
// alternately ascending and descending); for a larger block `size`, its strides 32 .. 1. Both
// unrolled, so that every stride is a constant (shuffles with immediate lane masks, no loop).
template <int kBlock>
__device__ void RegisterStages(uint64_t* keys, int n_sort, int size) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int base = warp * kSegment; base < n_sort; base += kBlock / 32 * kSegment) {
    uint64_t key[2] = {keys[base + lane], keys[base + lane + 32]};
    if (size <= kSegment) {
#pragma unroll
      for (int block = 2; block <= kSegment; block <<= 1) {
#pragma unroll
        for (int stride = block / 2; stride > 0; stride >>= 1) RegisterStage(base, block, stride, key);
      }
    } else {
#pragma unroll
      for (int stride = 32; stride > 0; stride >>= 1) RegisterStage(base, size, stride, key);
    }
    keys[base + lane] = key[0];
    keys[base + lane + 32] = key[1];
  }
}

// The stages of block `size` with strides `low` .. `low` << (bits - 1) (all >= kSegment), in
// one pass over shared memory: each thread takes groups of 2^bits entries that those strides
// pair among themselves (base + j * low, j < 2^bits), runs the stages on them in registers,
// highest stride first, and stores them back; one block barrier for `bits` stages.
template <int kBlock, int kBits>
__device__ void GroupStages(uint64_t* keys, int n_sort, int size, int low) {
  constexpr int kGroup = 1 << kBits;
  for (int g = threadIdx.x; g < n_sort / kGroup; g += kBlock) {
    const int base = (g & (low - 1)) | ((g & ~(low - 1)) << kBits);  // zeros at the strides' bits
    const bool ascending = (base & size) == 0;                       // (size's bit is above them)
    uint64_t key[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) key[j] = keys[base + j * low];
#pragma unroll
    for (int bit = kGroup / 2; bit > 0; bit >>= 1) {
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        if ((j & bit) == 0 && ascending == (key[j | bit] > key[j])) {
          const uint64_t k0 = key[j];
          key[j] = key[j | bit];
          key[j | bit] = k0;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) keys[base + j * low] = key[j];
  }
}

// The most strides a GroupStages pass takes (2^kMaxGroupBits keys in registers a thread).
constexpr int kMaxGroupBits = 3;
static_assert(kMaxGroupBits >= 1 && kMaxGroupBits <= 3, "SortKeys instantiates GroupStages for 1 to 3 strides");

// Sorts keys [0, n_sort) (a power of two >= kSegment) largest first: blocks up to 64 entries
// wholly in registers, then for each larger block its strides >= 64 in shared memory, up to
// kMaxGroupBits a pass (GroupStages), and the rest in registers (kBlock threads).
template <int kBlock>
__device__ void SortKeys(uint64_t* keys, int n_sort) {
  RegisterStages<kBlock>(keys, n_sort, kSegment);
  __syncthreads();
  for (int size = 2 * kSegment; size <= n_sort; size <<= 1) {
    for (int stride = size / 2; stride >= kSegment;) {  // the highest stride of the passes left
      const int bits = min(kMaxGroupBits, 31 - __clz(stride / kSegment) + 1);
      const int low = stride >> (bits - 1);
      if (bits == 3) {
        GroupStages<kBlock, 3>(keys, n_sort, size, low);
      } else if (bits == 2) {
        GroupStages<kBlock, 2>(keys, n_sort, size, low);
      } else {
        GroupStages<kBlock, 1>(keys, n_sort, size, low);
      }
      __syncthreads();
      stride = low / 2;
    }
    RegisterStages<kBlock>(keys, n_sort, size);
    __syncthreads();
  }
}

// ---------------------------------------------------------------- streamed selection

// The selection's shared state: the pool's count and bound, and the radix select's.
struct Selection {
  uint32_t hist[256];
  uint32_t warp_counts[kWarps];
  uint64_t prefix, mask;  // the digits of the wanted key decided so far, and which they are
  uint32_t remaining;     // keys still wanted from the bin being searched
  uint32_t settled;       // the last bin holds exactly the keys still wanted
  uint32_t count;         // keys in the pool
  uint64_t bound;         // keys below it never join the pool
};

// Counts per radix bin -> the bin of the remaining-th largest key: thread b holds bins
// 255 - kBins b .. 255 - kBins b - kBins + 1 (kBins = 256 / kBlock, high to low), an inclusive
// block scan of their totals gives the keys in bins at or above them, and the one thread whose
// bin holds the remaining-th updates the selection state; `settled` when that bin holds exactly
// the keys still wanted (all of them are kept: the lower digits need no pass).
template <int kBlock>
__device__ void FindBin(Selection& sel, int shift) {
  static_assert(256 % kBlock == 0 && kBlock % 32 == 0, "whole warps, whole bins a thread");
  constexpr int kBins = 256 / kBlock;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, top = 255 - kBins * static_cast<int>(threadIdx.x);
  uint32_t count[kBins], total = 0;
#pragma unroll
  for (int e = 0; e < kBins; ++e) total += count[e] = sel.hist[top - e];
  uint32_t at_or_above = total;
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t v = __shfl_up_sync(0xffffffffu, at_or_above, o);
    if (lane >= o) at_or_above += v;
  }
  if (lane == 31) sel.warp_counts[warp] = at_or_above;
  __syncthreads();
  for (int v = 0; v < warp; ++v) at_or_above += sel.warp_counts[v];
  const uint32_t want = sel.remaining;
  uint32_t above = at_or_above - total;
  __syncthreads();  // every thread has read `remaining` and the warp totals
#pragma unroll
  for (int e = 0; e < kBins; ++e) {
    if (above < want && above + count[e] >= want) {
      sel.prefix |= static_cast<uint64_t>(top - e) << shift;
      sel.mask |= uint64_t{0xff} << shift;
      sel.remaining = want - above;
      sel.settled = count[e] == want - above;
    }
    above += count[e];
  }
}

// Keeps the kth largest of the distinct keys pool[0, n) (1 <= kth <= n) in pool[0, kth) and
// raises the bound to them: the radix select leaves `prefix` = the kth largest key's decided
// digits with zeros below, so exactly the kept keys are >= prefix, and a later key below it
// is beaten by kth kept ones. Block-wide (every one of the kBlock threads calls it, with the
// same n and kth).
template <int kBlock>
__device__ void KeepLargest(Selection& sel, uint64_t* pool, int n, int kth) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    sel.prefix = 0;
    sel.mask = 0;
    sel.remaining = static_cast<uint32_t>(kth);
    sel.settled = 0;
  }
  __syncthreads();
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kBlock) sel.hist[b] = 0;
    __syncthreads();
    const uint64_t mask = sel.mask, prefix = sel.prefix;
    for (int e = threadIdx.x; e < n; e += kBlock) {
      const uint64_t key = pool[e];
      if ((key & mask) == prefix) atomicAdd(&sel.hist[(key >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    FindBin<kBlock>(sel, shift);
    __syncthreads();
    if (sel.settled) break;  // (read after the barrier: the same at every thread)
  }
  const uint64_t bound = sel.prefix;
  // Stable in-place compaction (a kept key moves to a lower or the same index), kBlock at a time.
  uint32_t written = 0;
  for (int base = 0; base < n; base += kBlock) {
    const int e = base + static_cast<int>(threadIdx.x);
    const uint64_t key = e < n ? pool[e] : 0;
    const bool keep = e < n && key >= bound;
    const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) sel.warp_counts[warp] = __popc(ballot);
    __syncthreads();  // this chunk read; its warps' counts visible
    uint32_t before = written, total = 0;
    for (int v = 0; v < kBlock / 32; ++v) {
      if (v < warp) before += sel.warp_counts[v];
      total += sel.warp_counts[v];
    }
    if (keep) pool[before + __popc(ballot & ((1u << lane) - 1u))] = key;
    written += total;
    __syncthreads();  // this chunk written before the next is read; the counts free
  }
  if (threadIdx.x == 0) {
    sel.count = written;
    sel.bound = bound;
  }
  __syncthreads();
}

// Adds the keys of this warp's valid lanes that reach the bound to the pool. Written per lane:
// the compiler aggregates the warp's atomics on the one address into one (a vote, one shared
// atomic, a shuffle and each lane's rank among the joining lanes), which a hand-written leader
// atomic only duplicated (it aggregated that one lane's atomic again: ~29 more instructions a
// tile of the RS kernel). Called by whole warps.
__device__ __forceinline__ void Append(Selection& sel, uint64_t* pool, uint64_t key, bool valid) {
  if (valid && key >= sel.bound) pool[atomicAdd(&sel.count, 1u)] = key;
}

// The block barrier after a step of the stream, which appended at most `step` keys to each of
// kQueries pools (query u's at pool + u * capacity): when the next step could overflow a pool,
// it is compacted to its k largest (KeepLargest) behind the barrier. Lane u of warp 0 reads
// pool u's count before the barrier, while up to `step` appends of other warps may still be on
// their way: with the next step's, 3 x step of room suffices. The barrier's count carries
// which pools are full: lanes 2^u - 1 .. 2^(u+1) - 2 vote for pool u, so it sums 2^u over them.
template <int kQueries, int kBlock>
__device__ __forceinline__ void AfterStep(Selection* sel, uint64_t* pool, int capacity, int k, int step) {
  bool vote = false;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const bool full = lane < kQueries &&
                      static_cast<int64_t>(*reinterpret_cast<volatile uint32_t*>(&sel[lane].count)) + 3 * step >
                          capacity;
    const uint32_t fulls = __ballot_sync(0xffffffffu, full);
    const int u = 31 - __clz(lane + 1);  // floor(log2(lane + 1))
    vote = u < kQueries && (fulls >> u & 1u);
  }
  const int fulls = __syncthreads_count(vote);
#pragma unroll
  for (int u = 0; u < kQueries; ++u) {
    if (fulls >> u & 1) KeepLargest<kBlock>(sel[u], pool + u * capacity, static_cast<int>(sel[u].count), k);
  }
}

// The fused mode's sink: each score joins its query's selection as it is computed (MmaScores
// emits a tile of kMmaRows a query between barriers, ScalarScores kWarps).
template <int kQueries, int kBlock>
struct PoolSink {
  Selection* sel;
  uint64_t* pool;
  int capacity, k;
  __device__ void Emit(int u, int64_t s, float score, bool valid) {
    Append(sel[u], pool + u * capacity, SortKey(score, s), valid);
  }
  __device__ void Barrier() { AfterStep<kQueries, kBlock>(sel, pool, capacity, k, kMmaRows); }
};

// Queries ts[0 .. kQueries) (the same page-table row where more than one): their visible
// candidates' scores, computed here (fused) or read from the scores scratch (scored mode, one
// query), stream through each query's pool; then each query's kept keys are selected, sorted
// and written as candidate ids (-1 past the visible ones). Block-wide (kBlock threads: the
// kernel's kThreads, or the one warpgroup of kWgmmaRsIndexFp4); `sel` and the pools (from
// `pool`, PoolCapacity(k_n, kSlack) each) are the caller's shared memory.
template <Scorer kScorer, int kQueries, int kBlock = kThreads, int kSlack = kPoolSlack>
__device__ void SelectTopk(const void* q, Elem q_type, const float* w, const TableView& keys,
                           const int32_t* page_table, int64_t p_n, int64_t epp, const int32_t* limit,
                           const float* scores, int32_t* ids, int64_t i_n, int64_t j_n, int64_t k_n, const int64_t* ts,
                           unsigned char* smem, Selection* sel, uint64_t* pool) {
  const int64_t s_n = p_n * epp;
  const int capacity = static_cast<int>(PoolCapacity(k_n, kSlack));
  int64_t visible[kQueries];
  int kept[kQueries], most = 0;
#pragma unroll
  for (int u = 0; u < kQueries; ++u) {
    visible[u] = VisibleCandidates(keys, limit, ts[u], s_n);
    kept[u] = static_cast<int>(min(k_n, visible[u]));
    most = max(most, kept[u]);
  }
  if (threadIdx.x < kQueries) {
    sel[threadIdx.x].count = 0;
    sel[threadIdx.x].bound = 0;  // every candidate's key is above 0 (its low half is ~candidate >= 2^31)
  }
  __syncthreads();
  if (most > 0) {  // (the same at every thread)
    if (!scores) {
      PoolSink<kQueries, kBlock> sink{sel, pool, capacity, static_cast<int>(k_n)};
      Scores<kScorer, kQueries>(q, q_type, w, keys, page_table, p_n, epp, ts, 0, visible, i_n, j_n, smem, sink);
    } else if constexpr (kQueries == 1) {  // scored mode (never paired)
      // The row is read kRowLoads steps at a time, all their loads issued before the first
      // append (a 4k context's 1024 candidates in one round trip): the step barriers would
      // otherwise put one load latency in each step.
      constexpr int kRowLoads = 4;
      const float* row = scores + ts[0] * s_n;
      for (int64_t base = 0; base < visible[0]; base += kRowLoads * kBlock) {
        float score[kRowLoads];
#pragma unroll
        for (int r = 0; r < kRowLoads; ++r) {
          const int64_t s = base + r * kBlock + threadIdx.x;
          score[r] = s < visible[0] ? row[s] : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < kRowLoads; ++r) {
          const int64_t step = base + r * kBlock, s = step + threadIdx.x;
          if (step >= visible[0]) break;  // (the same at every thread)
          Append(sel[0], pool, SortKey(score[r], s), s < visible[0]);
          AfterStep<1, kBlock>(sel, pool, capacity, static_cast<int>(k_n), kBlock);
        }
      }
    }
    __syncthreads();  // the last appends done
  }
#pragma unroll
  for (int u = 0; u < kQueries; ++u) {
    uint64_t* kept_keys = pool + u * capacity;
    if (kept[u] > 0) {  // (the same at every thread)
      const int n = static_cast<int>(sel[u].count);
      if (n > kept[u]) KeepLargest<kBlock>(sel[u], kept_keys, n, kept[u]);
      // Bitonic sort of the kept keys, padded to a power of two (at least one warp segment)
      // with zeros, which sort last.
      const int n_sort = SortLength(kept[u]);
      for (int e = kept[u] + threadIdx.x; e < n_sort; e += kBlock) kept_keys[e] = 0;
      __syncthreads();
      SortKeys<kBlock>(kept_keys, n_sort);
    }
    for (int64_t k = threadIdx.x; k < k_n; k += kBlock) {
      ids[ts[u] * k_n + k] = k < kept[u] ? CandidateOf(kept_keys[k]) : -1;
    }
  }
}

// Whether queries t0 and t1 have the same page-table row over their first `pages` pages.
// Block-wide (kBlock threads).
template <int kBlock = kThreads>
__device__ bool SamePages(const int32_t* page_table, int64_t p_n, int64_t t0, int64_t t1, int64_t pages) {
  bool same = true;
  for (int64_t p = threadIdx.x; p < pages; p += kBlock) same &= page_table[t0 * p_n + p] == page_table[t1 * p_n + p];
  return __syncthreads_and(same);
}

// Selects queries ts[0] and ts[1] (the second only if below t_n): both at once by
// select(std::integral_constant<int, 2>, ts) when their page-table rows agree over what they see
// (a request's consecutive chunk tokens), else one after the other by
// select(std::integral_constant<int, 1>, &ts[u]). Block-wide (kBlock threads).
template <int kBlock, class Select>
__device__ void SelectPairOrEach(const TableView& keys, const int32_t* page_table, int64_t p_n, int64_t epp,
                                 const int32_t* limit, int64_t t_n, const int64_t (&ts)[2], Select select) {
  bool paired = false;
  if (ts[1] < t_n) {  // (the same at every thread)
    const int64_t s_n = p_n * epp;
    const int64_t seen = max(VisibleCandidates(keys, limit, ts[0], s_n), VisibleCandidates(keys, limit, ts[1], s_n));
    paired = SamePages<kBlock>(page_table, p_n, ts[0], ts[1], (seen + epp - 1) / epp);
  }
  if (paired) {
    select(std::integral_constant<int, 2>{}, ts);
  } else {
    for (int u = 0; u < 2 && ts[u] < t_n; ++u) {
      if (u > 0) __syncthreads();  // the first query's ids read from its pool
      select(std::integral_constant<int, 1>{}, &ts[u]);
    }
  }
}

// The selection kernel: block b selects queries kQueries b .. +kQueries (SelectTopk). Paired
// (kQueries = 2, fused FP4 scoring on a long chunk; see the launch): two queries with the same
// page-table row over what they see (a request's consecutive chunk tokens) are scored together,
// each decoded key tile serving both; otherwise they run one after the other. Its shared
// memory for FP4 keys and k = 512 (~50 KB fused, ~63 KB paired on mma.sync); registers are
// capped so that TopkBlocksPerSm blocks share a multiprocessor (three with FP4 keys: 80
// registers; two paired: 128). (On SM90 the fused FP4 calls run IndexerTopkRsKernel instead,
// but for tables of 2^31 rows or more and k in 1025..1279: see the host's choice.)
constexpr int TopkBlocksPerSm(Scorer s, int queries) {
  return queries > 1 ? 2 : s == Scorer::kScalar ? 4 : s == Scorer::kMmaIndexFp4 ? 3 : 2;
}
template <Scorer kScorer, int kQueries>
__global__ void __launch_bounds__(kThreads, TopkBlocksPerSm(kScorer, kQueries))
    IndexerTopkKernel(const void* q, Elem q_type, const float* w, TableView keys, const int32_t* page_table,
                      int64_t p_n, int64_t epp, const int32_t* limit, const float* scores, int32_t* ids, int64_t t_n,
                      int64_t i_n, int64_t j_n, int64_t k_n) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Selection sel[kQueries];
  const size_t region = scores ? 0 : RegionBytes(i_n, j_n, kQueries);
  auto* pool = reinterpret_cast<uint64_t*>(smem + region);
  const int64_t t0 = kQueries * static_cast<int64_t>(blockIdx.x);
  auto select = [&](auto queries, const int64_t* ts) {
    SelectTopk<kScorer, decltype(queries)::value>(q, q_type, w, keys, page_table, p_n, epp, limit, scores, ids, i_n,
                                                  j_n, k_n, ts, smem, sel, pool);
  };
  if constexpr (kQueries == 1) {
    select(std::integral_constant<int, 1>{}, &t0);
  } else {
    static_assert(kQueries == 2, "queries are paired");
    SelectPairOrEach<kThreads>(keys, page_table, p_n, epp, limit, t_n, {t0, t0 + 1}, select);
  }
}

// The fused kernel of WgmmaRsScores (SM90a code; the host launches it only on SM90), one
// warpgroup a block. Paired: block b selects queries 2b and 2b + 1; two queries with the same
// page-table row over what they see (a request's consecutive chunk tokens) are scored together,
// each decoded key tile serving both; otherwise they run one after the other. Unpaired: block b
// selects query b. Its shared memory holds q (wgmma_rs::kQBytes a query) and the pools (paired,
// k = 512: 52 KB, so that four blocks share a multiprocessor; k = 2048: 76 KB).
__global__ void __launch_bounds__(wgmma_rs::kThreads, wgmma_rs::kBlocksPerSm)
    IndexerTopkRsKernel(const void* q, const float* w, TableView keys, const int32_t* page_table, int64_t p_n,
                        int64_t epp, const int32_t* limit, int32_t* ids, int64_t t_n, int64_t i_n, int64_t k_n,
                        bool paired_blocks) {
  if constexpr (kWgmmaCompiled) {
    constexpr int kBlock = wgmma_rs::kThreads;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ Selection sel[wgmma_rs::kQueries];
    // (q of one query a block unpaired, two paired: the launch's shared memory.)
    auto* pool = reinterpret_cast<uint64_t*>(smem + (paired_blocks ? wgmma_rs::kQueries : 1) * wgmma_rs::kQBytes);
    auto select = [&](auto queries, const int64_t* ts) {
      SelectTopk<Scorer::kWgmmaRsIndexFp4, decltype(queries)::value, kBlock, wgmma_rs::kPoolSlack>(
          q, Elem::kBf16, w, keys, page_table, p_n, epp, limit, nullptr, ids, i_n, index_fp4::kDim, k_n, ts, smem,
          sel, pool);
    };
    if (paired_blocks) {
      const int64_t t0 = 2 * static_cast<int64_t>(blockIdx.x);
      SelectPairOrEach<kBlock>(keys, page_table, p_n, epp, limit, t_n, {t0, t0 + 1}, select);
    } else {
      const int64_t t = blockIdx.x;
      select(std::integral_constant<int, 1>{}, &t);
    }
  } else {
    __trap();  // (no wgmma in this compilation; the host never launches it here)
  }
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

// The kernels of each scorer, in Scorer's order (the selection kernel one query a block), and
// the paired selection kernel (FP4 keys only: the generic tensor-core scorer's next-tile
// chunks leave no registers for a second query's fragments).
constexpr decltype(&IndexerScoreKernel<Scorer::kScalar>) kScoreKernels[] = {
    IndexerScoreKernel<Scorer::kScalar>, IndexerScoreKernel<Scorer::kMma>, IndexerScoreKernel<Scorer::kMmaIndexFp4>};
constexpr decltype(&IndexerTopkKernel<Scorer::kScalar, 1>) kTopkKernels[] = {
    IndexerTopkKernel<Scorer::kScalar, 1>, IndexerTopkKernel<Scorer::kMma, 1>,
    IndexerTopkKernel<Scorer::kMmaIndexFp4, 1>};
constexpr auto kPairedTopkKernel = IndexerTopkKernel<Scorer::kMmaIndexFp4, kMaxPairedQueries>;

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
  if (a.t == 0 || a.k == 0) return ffi::Error::Success();
  const Scorer scorer = ScorerFor(a);
  const int kernel_index = static_cast<int>(scorer);
  static const int64_t sms = std::max<int64_t>(Dsv4MultiprocessorCount(), 1);  // once per process
  if (a.scratch) {  // scored mode: the scores over many blocks, then the selection
    // Tiles per block: as few as keep the grid in one wave of resident blocks.
    const int64_t slots = ScoreBlocksPerSm(scorer) * sms, tiles = (a.s + kMmaRows - 1) / kMmaRows;
    const int64_t per_block = kMmaRows * std::max<int64_t>(1, (a.t * tiles + slots - 1) / slots);
    const dim3 grid(static_cast<unsigned>(a.t), static_cast<unsigned>((a.s + per_block - 1) / per_block));
    kScoreKernels[kernel_index]<<<grid, kThreads, RegionBytes(a.i, a.j), stream>>>(
        q.untyped_data(), a.q_type, w.typed_data(), a.keys, page_table.typed_data(), a.p, a.epp, limit.typed_data(),
        scores->typed_data(), a.i, a.j, per_block);
    if (auto e = LastCudaError("IndexerScoreKernel"); e.failure()) return e;
    kTopkKernels[kernel_index]<<<static_cast<unsigned>(a.t), kThreads, PoolBytes(a.k), stream>>>(
        q.untyped_data(), a.q_type, w.typed_data(), a.keys, page_table.typed_data(), a.p, a.epp, limit.typed_data(),
        scores->typed_data(), ids->typed_data(), a.t, a.i, a.j, a.k);
    return LastCudaError("IndexerTopkKernel");
  }
  // Fused. Paired (FP4 keys) when the pairs alone give every multiprocessor its resident
  // blocks of the mma.sync pair kernel (the RS kernel's threshold too): with fewer queries, one
  // query a block finishes sooner.
  const bool paired = scorer == Scorer::kMmaIndexFp4 &&
                      a.t >= kMaxPairedQueries * TopkBlocksPerSm(scorer, kMaxPairedQueries) * sms;
  // On SM90 the model's FP4 keys are scored on wgmma with the keys in registers (WgmmaRsScores),
  // where its 32-bit rows and its pools (RsFits) allow; otherwise by the mma.sync kernels below.
  const bool wgmma = WgmmaOnDevice();
  const bool rows32 = a.keys.rows + 2 * a.epp < (int64_t{1} << 31);  // WgmmaRsScores' 32-bit rows
  if (scorer == Scorer::kMmaIndexFp4 && wgmma && rows32 && RsFits(a.k)) {
    static const cudaError_t attr =
        cudaFuncSetAttribute(IndexerTopkRsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             RsSharedBytes(wgmma_rs::kQueries, kMaxTopk));
    if (attr != cudaSuccess) {
      return ffi::Error::Internal(std::string("shared memory opt-in: ") + cudaGetErrorString(attr));
    }
    const int queries = paired ? wgmma_rs::kQueries : 1;
    const int64_t blocks = (a.t + queries - 1) / queries;
    IndexerTopkRsKernel<<<static_cast<unsigned>(blocks), wgmma_rs::kThreads, RsSharedBytes(queries, a.k),
                          stream>>>(
        q.untyped_data(), w.typed_data(), a.keys, page_table.typed_data(), a.p, a.epp, limit.typed_data(),
        ids->typed_data(), a.t, a.i, a.k, paired);
    return LastCudaError("IndexerTopkRsKernel");
  }
  const int queries = paired ? kMaxPairedQueries : 1;
  auto* kernel = paired ? kPairedTopkKernel : kTopkKernels[kernel_index];
  // Once per process and kernel: allow its largest shared memory (above the 48 KB default).
  static const size_t most = kMaxSmemBytes + PoolBytes(kMaxTopk),
                      most_paired = RegionBytes(64, index_fp4::kDim, kMaxPairedQueries) +
                                    kMaxPairedQueries * PoolBytes(kMaxTopk);
  static const cudaError_t attr[4] = {
      cudaFuncSetAttribute(kTopkKernels[0], cudaFuncAttributeMaxDynamicSharedMemorySize, most),
      cudaFuncSetAttribute(kTopkKernels[1], cudaFuncAttributeMaxDynamicSharedMemorySize, most),
      cudaFuncSetAttribute(kTopkKernels[2], cudaFuncAttributeMaxDynamicSharedMemorySize, most),
      cudaFuncSetAttribute(kPairedTopkKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, most_paired)};
  if (const cudaError_t e = attr[paired ? 3 : kernel_index]; e != cudaSuccess) {
    return ffi::Error::Internal(std::string("shared memory opt-in: ") + cudaGetErrorString(e));
  }
  const int64_t blocks = (a.t + queries - 1) / queries;
  const size_t smem = RegionBytes(a.i, a.j, queries) + queries * PoolBytes(a.k);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(q.untyped_data(), a.q_type, w.typed_data(),
                                                                   a.keys, page_table.typed_data(), a.p, a.epp,
                                                                   limit.typed_data(), nullptr, ids->typed_data(), a.t,
                                                                   a.i, a.j, a.k);
  return LastCudaError("IndexerTopkKernel");
}

}  // namespace
}  // namespace dsv4

// The columns of the scores scratch the caller passes for T queries of S candidates (i heads
// of dim j): S (scored mode, the file comment) when fewer queries than multiprocessors would
// each be one block and the row spans more than one tile; else 0 (fused, at any S: its
// shared memory does not grow with S). Called through ctypes by dsv4/ops/indexer_topk/ffi.py.
extern "C" int64_t Dsv4IndexerScratchColumns(int64_t t, int64_t s, int64_t i, int64_t j) {
  (void)i, (void)j;
  const bool few_queries = t < Dsv4MultiprocessorCount() && s > dsv4::kMmaRows;
  return few_queries ? s : 0;
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
