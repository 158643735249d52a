// indexer_topk on the CPU: the twin of dsv4/ops/indexer_topk/reference.py (`indexer_topk_paged`).
//
// score[t, s] = sum_i w[t, i] * relu(q[t, i] . k[row(t, s)]) over the entries s < limit[t] of
// query t's request, row(t, s) = page_table[t, s / epp] * epp + s % epp (epp entries per page;
// an unallocated page reads the last row, as the reference's clipped gather); the best
// min(topk, S) entries, best first, ties to the lower s; slots left over are -1.
#include <algorithm>
#include <vector>

#include "op_args.h"

namespace dsv4 {
namespace {

ffi::Error IndexerTopkImpl(ffi::AnyBuffer q, ffi::Buffer<ffi::F32> w, ffi::AnyBuffer key_values,
                           ffi::AnyBuffer key_scales, ffi::AnyBuffer key_rope, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> limit, ffi::Result<ffi::Buffer<ffi::S32>> ids,
                           ffi::Result<ffi::Buffer<ffi::F32>> scores, int32_t block, int32_t entries_per_page) {
  IndexerArgs a;
  if (auto e = ParseIndexer(q, w, {key_values, key_scales, key_rope}, page_table, limit, ids->dimensions(),
                            scores->dimensions(), block, entries_per_page, &a);
      e.failure()) {
    return e;
  }
  const int64_t t_n = a.t, i_n = a.i, j_n = a.j, p_n = a.p, epp = a.epp, s_n = a.s, k_n = a.k;
  const TableView& keys = a.keys;

  std::vector<float> q_t(i_n * j_n), key(j_n), own_scores(a.scratch ? 0 : s_n);
  std::vector<int32_t> order;
  for (int64_t t = 0; t < t_n; ++t) {
    for (int64_t e = 0; e < i_n * j_n; ++e) q_t[e] = LoadElem(q.untyped_data(), a.q_type, t * i_n * j_n + e);
    const float* w_t = w.typed_data() + t * i_n;
    float* score = a.scratch ? scores->typed_data() + t * s_n : own_scores.data();
    const int64_t visible = keys.rows ? std::clamp<int64_t>(limit.typed_data()[t], 0, s_n) : 0;
    order.resize(visible);
    for (int64_t s = 0; s < visible; ++s) {
      const int64_t page = page_table.typed_data()[t * p_n + s / epp];
      const int64_t row = page >= 0 ? std::min<int64_t>(page * epp + s % epp, keys.rows - 1) : keys.rows - 1;
      DecodeRow(keys, row, key.data());
      float total = 0.0f;
      for (int64_t i = 0; i < i_n; ++i) total += w_t[i] * std::max(Dot(q_t.data() + i * j_n, key.data(), j_n), 0.0f);
      score[s] = total;
      order[s] = static_cast<int32_t>(s);
    }
    const int64_t kept = std::min(k_n, visible);
    std::partial_sort(order.begin(), order.begin() + kept, order.end(), [&](int32_t x, int32_t y) {
      return score[x] > score[y] || (score[x] == score[y] && x < y);
    });
    int32_t* out = ids->typed_data() + t * k_n;
    for (int64_t k = 0; k < k_n; ++k) out[k] = k < kept ? order[k] : -1;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4IndexerTopkCpu, dsv4::IndexerTopkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()       // q [T, I, J] f32 | bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [T, I] (score scale folded in)
                                  .Arg<ffi::AnyBuffer>()       // key values [Rk, J] (packed e2m1: [Rk, J/2])
                                  .Arg<ffi::AnyBuffer>()       // key scales [Rk, J/block] u8 (or [Rk, 0])
                                  .Arg<ffi::AnyBuffer>()       // key rope [Rk, 0] (indexer keys have none)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table [T, P]; -1 = unallocated
                                  .Arg<ffi::Buffer<ffi::S32>>()  // limit [T]: candidates s < limit are visible
                                  .Ret<ffi::Buffer<ffi::S32>>()  // ids [T, min(topk, S)], -1 = none
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scores scratch [T, S] or [T, 0] (none)
                                  .Attr<int32_t>("block")      // values per scale byte
                                  .Attr<int32_t>("entries_per_page"));  // S = P x entries_per_page
