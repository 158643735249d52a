// sparse_attention on CUDA: the twin of dsv4/ops/sparse_attention/reference.py and of
// sparse_attention_cpu.cc (same arguments, same semantics).
//
// Grid (T, ceil(N / kHeadsPerBlock)); one warp per head. The block walks the query's slots in
// chunks of kChunk rows: the chunk's rows are decoded once into shared memory (f32) and read by
// all the block's heads, whose softmax runs online (running max and denominator, started at
// the sink: m = sink, l = 1). No tensor cores yet: this is the correctness-first version that
// the roofline benchmark (bench/ffi_bench.py) measures against.
#include <cuda_runtime.h>

#include "cuda_common.h"
#include "op_args.h"

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

__device__ Slot ResolveSlot(int64_t j, int64_t w_n, const int32_t* window_idx, const int32_t* comp_idx,
                            int64_t ring_rows, int64_t fresh_rows, int64_t comp_rows) {
  if (j < w_n) {
    const int64_t i = window_idx[j];
    if (i < 0) return {-1, 0};
    if (i < ring_rows) return {0, i};
    if (fresh_rows == 0) return {-1, 0};
    const int64_t f = i - ring_rows;
    return {1, f < fresh_rows ? f : fresh_rows - 1};
  }
  const int64_t c = comp_idx[j - w_n];
  if (c < 0 || c >= comp_rows) return {-1, 0};
  return {2, c};
}

__global__ void SparseAttentionKernel(const void* q, Elem q_type, TableView ring, TableView fresh, TableView comp,
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

ffi::Error SparseAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer ring_values,
                               ffi::AnyBuffer ring_scales, ffi::AnyBuffer ring_rope, ffi::AnyBuffer fresh_values,
                               ffi::AnyBuffer fresh_scales, ffi::AnyBuffer fresh_rope, ffi::Buffer<ffi::S32> window_idx,
                               ffi::AnyBuffer comp_values, ffi::AnyBuffer comp_scales, ffi::AnyBuffer comp_rope,
                               ffi::Buffer<ffi::S32> comp_idx, ffi::Buffer<ffi::F32> sink,
                               ffi::Result<ffi::AnyBuffer> out, float scale, int32_t block) {
  AttentionArgs a;
  if (auto e = ParseAttention(q, {ring_values, ring_scales, ring_rope}, {fresh_values, fresh_scales, fresh_rope},
                              window_idx, {comp_values, comp_scales, comp_rope}, comp_idx, sink,
                              out->element_type(), block, &a);
      e.failure()) {
    return e;
  }
  if (a.h > kMaxHeadDim) return Invalid("head dim above 512 is not supported by the CUDA kernel");
  if (a.t == 0 || a.n == 0) return ffi::Error::Success();
  const dim3 grid(static_cast<unsigned>(a.t), static_cast<unsigned>((a.n + kHeadsPerBlock - 1) / kHeadsPerBlock));
  SparseAttentionKernel<<<grid, 32 * kHeadsPerBlock, 0, stream>>>(
      q.untyped_data(), a.q_type, a.ring, a.fresh, a.comp, window_idx.typed_data(), a.w, comp_idx.typed_data(), a.x,
      sink.typed_data(), out->untyped_data(), a.n, a.h, scale);
  return LastCudaError("SparseAttentionKernel");
}

}  // namespace
}  // namespace dsv4

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
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("block"),
                              {ffi::Traits::kCmdBufferCompatible});
