// sparse_attention on the CPU: the twin of dsv4/ops/sparse_attention/reference.py
// (`sparse_attention_paged`), reading the stored tables in their own formats.
//
// For query t and head n: o = sum_j exp(s_j - m) kv_j / (sum_j exp(s_j - m) + exp(sink_n - m)),
// s_j = scale * q . kv_j over the rows selected for t, m = max(sink_n, max_j s_j). Each selected
// row is decoded once and used by every head (MQA: one shared K=V latent).
#include <algorithm>
#include <cmath>
#include <vector>

#include "op_args.h"

namespace dsv4 {
namespace {

struct Selected {
  const TableView* table;
  int64_t row;
};

// The rows query t reads: window slots (ring rows, then this step's fresh rows) and compressed slots.
void SelectRows(const TableView& ring, const TableView& fresh, const TableView& comp, const int32_t* window_idx,
                int64_t w, const int32_t* comp_idx, int64_t x, std::vector<Selected>* out) {
  out->clear();
  for (int64_t j = 0; j < w; ++j) {
    const int64_t i = window_idx[j];
    if (i < 0) continue;
    if (i < ring.rows) {
      out->push_back({&ring, i});
    } else if (fresh.rows > 0) {  // past the fresh rows reads the last one, as the reference's clipped gather
      out->push_back({&fresh, std::min<int64_t>(i - ring.rows, fresh.rows - 1)});
    }
  }
  for (int64_t j = 0; j < x; ++j) {
    const int64_t c = comp_idx[j];
    if (c >= 0 && c < comp.rows) out->push_back({&comp, c});
  }
}

ffi::Error SparseAttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer ring_values, ffi::AnyBuffer ring_scales,
                               ffi::AnyBuffer ring_rope, ffi::AnyBuffer fresh_values, ffi::AnyBuffer fresh_scales,
                               ffi::AnyBuffer fresh_rope, ffi::Buffer<ffi::S32> window_idx,
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
  const int64_t t_n = a.t, n_n = a.n, h_n = a.h, w_n = a.w, x_n = a.x;
  const TableView &ring = a.ring, &fresh = a.fresh, &comp = a.comp;
  const Elem q_type = a.q_type;

  std::vector<Selected> rows;
  std::vector<float> kv, q_row(h_n), s, o(h_n);
  for (int64_t t = 0; t < t_n; ++t) {
    SelectRows(ring, fresh, comp, window_idx.typed_data() + t * w_n, w_n, comp_idx.typed_data() + t * x_n, x_n,
               &rows);
    const int64_t m_n = static_cast<int64_t>(rows.size());
    kv.resize(m_n * h_n);
    for (int64_t j = 0; j < m_n; ++j) DecodeRow(*rows[j].table, rows[j].row, kv.data() + j * h_n);
    s.resize(m_n);
    for (int64_t n = 0; n < n_n; ++n) {
      const int64_t qo = (t * n_n + n) * h_n;
      for (int64_t k = 0; k < h_n; ++k) q_row[k] = LoadElem(q.untyped_data(), q_type, qo + k);
      const float sink_n = sink.typed_data()[n];
      float m = sink_n;
      for (int64_t j = 0; j < m_n; ++j) {
        s[j] = Dot(q_row.data(), kv.data() + j * h_n, h_n) * scale;
        m = std::max(m, s[j]);
      }
      float denom = std::exp(sink_n - m);
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t j = 0; j < m_n; ++j) {
        const float p = std::exp(s[j] - m);
        denom += p;
        for (int64_t k = 0; k < h_n; ++k) o[k] += p * kv[j * h_n + k];
      }
      for (int64_t k = 0; k < h_n; ++k) StoreFloat(out->untyped_data(), q_type, qo + k, o[k] / denom);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

namespace ffi = xla::ffi;

// The arguments, in order (see dsv4/ops/sparse_attention/ffi.py, which builds them):
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SparseAttentionCpu, dsv4::SparseAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()       // q [T, N, H] f32 | bf16
                                  .Arg<ffi::AnyBuffer>()       // ring values [Rr, Hv]
                                  .Arg<ffi::AnyBuffer>()       // ring scales [Rr, Hv/block] u8 (or [Rr, 0])
                                  .Arg<ffi::AnyBuffer>()       // ring rope [Rr, H - Hv] (or [Rr, 0])
                                  .Arg<ffi::AnyBuffer>()       // fresh values [Rf, Hv]: this step's rows
                                  .Arg<ffi::AnyBuffer>()       // fresh scales
                                  .Arg<ffi::AnyBuffer>()       // fresh rope
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window_idx [T, W]: ring row or Rr + fresh row; -1
                                  .Arg<ffi::AnyBuffer>()       // compressed values [Rc, Hv] (Rc may be 0)
                                  .Arg<ffi::AnyBuffer>()       // compressed scales
                                  .Arg<ffi::AnyBuffer>()       // compressed rope
                                  .Arg<ffi::Buffer<ffi::S32>>()  // compressed_idx [T, X]: pool row; -1 or >= Rc none
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sink [N]
                                  .Ret<ffi::AnyBuffer>()       // out [T, N, H], q's dtype
                                  .Ret<ffi::Buffer<ffi::F32>>()  // split scratch [S, T, N, H] (CUDA only)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // split scratch [S, T, N, 2] (CUDA only)
                                  .Ret<ffi::AnyBuffer>()       // decoded tables [0 or Rr + Rf + Rc, H] bf16 (CUDA only)
                                  .Attr<float>("scale")        // softmax scale
                                  .Attr<int32_t>("block"));    // values per scale byte
