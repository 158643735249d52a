// indexer_topk on CUDA: the twin of dsv4/ops/indexer_topk/reference.py and of
// indexer_topk_cpu.cc (same arguments, same semantics).
//
// One block per query. (1) One warp per visible candidate computes its score into the query's
// score row, kept in shared memory when it fits there (Dsv4IndexerOnChipCandidates: S up to
// about 49k candidates, ~196k tokens of context at ratio 4, on an H200) and in the `scores`
// scratch result [T, S] otherwise (then the caller must pass one; [T, 0] means none). (2) A radix select over the scores' order-preserving bit
// patterns (4 passes of 8 bits) finds the k-th largest. (3) Every candidate above it is kept,
// and of those equal to it the lowest-numbered ones, in candidate order. (4) A bitonic sort
// orders the kept ones by (score desc, candidate asc), the reference's order.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "cuda_common.h"
#include "op_args.h"

extern "C" int64_t Dsv4IndexerOnChipCandidates(int64_t i, int64_t j);

namespace dsv4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTopk = 2048;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxSmemBytes = 40 * 1024;  // the q / selection region, before the score row

// Bytes of the q / selection region (q in f32 while scoring, then the kept scores and ids).
size_t RegionBytes(int64_t i, int64_t j) {
  return std::max<size_t>(i * j * sizeof(float), kMaxTopk * (sizeof(float) + sizeof(int32_t)));
}

// The shared memory a block of this device may opt in to (queried once per process).
int64_t OptInSharedBytes() {
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

// Static shared memory of the kernel (histogram, counters) and slack.
constexpr int64_t kStaticSharedBytes = 2 * 1024;

// Larger float -> larger key; -0 and +0 share a key (they tie in the reference).
__device__ __forceinline__ uint32_t OrderKey(float v) {
  const uint32_t b = FloatToBits(v == 0.0f ? 0.0f : v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ size_t RegionBytesDevice(int64_t i, int64_t j) {
  const size_t q = i * j * sizeof(float), sel = kMaxTopk * (sizeof(float) + sizeof(int32_t));
  return q > sel ? q : sel;
}

__device__ __forceinline__ bool Before(float sa, int32_t ia, float sb, int32_t ib) {
  return sa > sb || (sa == sb && ia < ib);
}

__global__ void IndexerTopkKernel(const void* q, Elem q_type, const float* w, TableView keys, const int32_t* page_table,
                                  int64_t p_n, int64_t epp, const int32_t* limit, float* scores, int32_t* ids,
                                  int64_t i_n, int64_t j_n, int64_t k_n) {
  extern __shared__ unsigned char smem[];
  __shared__ uint32_t hist[256];
  __shared__ uint32_t prefix, want_mask, remaining, n_above, n_equal_taken;
  __shared__ uint32_t warp_counts[kWarps];
  const int64_t t = blockIdx.x, s_n = p_n * epp;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t visible = keys.rows ? min(max(static_cast<int64_t>(limit[t]), int64_t{0}), s_n) : 0;
  const int64_t kept = min(k_n, visible);
  const size_t region = RegionBytesDevice(i_n, j_n);
  float* row_scores = scores ? scores + t * s_n : reinterpret_cast<float*>(smem + region);

  // (1) scores; q staged in shared memory in f32.
  float* q_s = reinterpret_cast<float*>(smem);
  for (int64_t e = threadIdx.x; e < i_n * j_n; e += kThreads) q_s[e] = LoadElem(q, q_type, t * i_n * j_n + e);
  __syncthreads();
  for (int64_t s = warp; s < visible; s += kWarps) {
    const int64_t page = page_table[t * p_n + s / epp];
    const int64_t row = page >= 0 ? min(page * epp + s % epp, keys.rows - 1) : keys.rows - 1;
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
  __syncthreads();

  // (2) radix select: the key of the kept-th largest score.
  if (threadIdx.x == 0) {
    prefix = 0;
    want_mask = 0;
    remaining = static_cast<uint32_t>(kept);
  }
  __syncthreads();
  for (int shift = 24; kept > 0 && shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int64_t s = threadIdx.x; s < visible; s += kThreads) {
      const uint32_t key = OrderKey(row_scores[s]);
      if ((key & want_mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t above = 0;
      for (int b = 255; b >= 0; --b) {
        if (above + hist[b] >= remaining) {
          prefix |= static_cast<uint32_t>(b) << shift;
          want_mask |= 0xffu << shift;
          remaining -= above;
          break;
        }
        above += hist[b];
      }
    }
    __syncthreads();
  }
  const uint32_t threshold = prefix;  // the key of the kept-th largest; `remaining` of its equals are kept

  // (3) collect into shared memory (the q region is free now).
  float* sel_score = reinterpret_cast<float*>(smem);
  int32_t* sel_id = reinterpret_cast<int32_t*>(smem + kMaxTopk * sizeof(float));
  if (threadIdx.x == 0) {
    n_above = 0;
    n_equal_taken = 0;
  }
  __syncthreads();
  for (int64_t s = threadIdx.x; kept > 0 && s < visible; s += kThreads) {
    const uint32_t key = OrderKey(row_scores[s]);
    if (key > threshold) {
      const uint32_t at = atomicAdd(&n_above, 1u);
      sel_score[at] = row_scores[s];
      sel_id[at] = static_cast<int32_t>(s);
    }
  }
  __syncthreads();
  // Equal to the threshold: the lowest-numbered `remaining`, chunk by chunk in candidate order.
  for (int64_t base = 0; kept > 0 && base < visible; base += kThreads) {
    const int64_t s = base + threadIdx.x;
    const bool eq = s < visible && OrderKey(row_scores[s]) == threshold;
    const uint32_t ballot = __ballot_sync(0xffffffffu, eq);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    uint32_t before = n_equal_taken;
    for (int v = 0; v < warp; ++v) before += warp_counts[v];
    before += __popc(ballot & ((1u << lane) - 1u));
    if (eq && before < remaining) {
      const uint32_t at = n_above + before;
      sel_score[at] = row_scores[s];
      sel_id[at] = static_cast<int32_t>(s);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int v = 0; v < kWarps; ++v) n_equal_taken += warp_counts[v];
    }
    __syncthreads();
  }

  // (4) bitonic sort of the kept entries (padded to a power of two with entries that sort last).
  int n_sort = 1;
  while (n_sort < kept) n_sort <<= 1;
  for (int e = static_cast<int>(kept) + threadIdx.x; e < n_sort; e += kThreads) {
    sel_score[e] = -INFINITY;
    sel_id[e] = INT_MAX;
  }
  __syncthreads();
  for (int size = 2; size <= n_sort; size <<= 1) {
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int e = threadIdx.x; e < n_sort; e += kThreads) {
        const int partner = e ^ stride;
        if (partner > e) {
          const bool ascending = (e & size) == 0;  // "ascending" = in the output order
          const bool swap = ascending ? Before(sel_score[partner], sel_id[partner], sel_score[e], sel_id[e])
                                      : Before(sel_score[e], sel_id[e], sel_score[partner], sel_id[partner]);
          if (swap) {
            const float ts = sel_score[e];
            const int32_t ti = sel_id[e];
            sel_score[e] = sel_score[partner];
            sel_id[e] = sel_id[partner];
            sel_score[partner] = ts;
            sel_id[partner] = ti;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int64_t k = threadIdx.x; k < k_n; k += kThreads) ids[t * k_n + k] = k < kept ? sel_id[k] : -1;
}

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
  const size_t smem = RegionBytes(a.i, a.j) + (on_chip ? a.s * sizeof(float) : 0);
  // Once per process: allow the device's whole opt-in shared memory (above the 48 KB default).
  static const cudaError_t attr = cudaFuncSetAttribute(
      IndexerTopkKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(OptInSharedBytes() - kStaticSharedBytes));
  if (attr != cudaSuccess) return ffi::Error::Internal(std::string("shared memory opt-in: ") + cudaGetErrorString(attr));
  IndexerTopkKernel<<<static_cast<unsigned>(a.t), kThreads, smem, stream>>>(
      q.untyped_data(), a.q_type, w.typed_data(), a.keys, page_table.typed_data(), a.p, a.epp, limit.typed_data(),
      on_chip ? nullptr : scores->typed_data(), ids->typed_data(), a.i, a.j, a.k);
  return LastCudaError("IndexerTopkKernel");
}

}  // namespace
}  // namespace dsv4

// The most candidates per query whose score row the CUDA kernel keeps in shared memory on the
// current device, for i heads of dim j (0 if none fit). Called by the handler and, through
// ctypes, by dsv4/ops/indexer_topk/ffi.py to decide whether to pass a scores scratch.
extern "C" int64_t Dsv4IndexerOnChipCandidates(int64_t i, int64_t j) {
  const int64_t free = dsv4::OptInSharedBytes() - dsv4::kStaticSharedBytes - static_cast<int64_t>(dsv4::RegionBytes(i, j));
  return free > 0 ? free / static_cast<int64_t>(sizeof(float)) : 0;
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
