// The argument checks of each op, shared by its CPU and CUDA handlers: FFI buffers in, the
// shapes and table views the kernels use out, or an InvalidArgument error naming the problem.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "act_quant.h"
#include "ffi_args.h"
#include "kv_write.h"

namespace dsv4 {

inline std::optional<Elem> FloatElem(const ffi::AnyBuffer& b) {
  const auto e = ElemOf(b.element_type());
  return e && (*e == Elem::kF32 || *e == Elem::kBf16) ? e : std::nullopt;
}

struct AttentionArgs {
  Elem q_type;
  int64_t t, n, h, w, x;  // queries, heads, head dim, window slots, compressed slots
  int64_t splits;         // parts of each query's slots run by separate blocks (CUDA; 1 = unsplit)
  TableView ring, fresh, comp;
  int64_t decoded_rows;   // rows of the decoded-table workspace (CUDA prefill): 0, or every table's rows
};

// The split scratch results [S, T, N, H] (partial outputs) and [S, T, N, 2] (their max and
// denominator), f32; S = 0 (nothing allocated) or 1 means unsplit. Only the CUDA kernel uses them.
inline ffi::Error ParseSplitScratch(ffi::Span<const int64_t> o_dims, ffi::Span<const int64_t> ml_dims,
                                    AttentionArgs* a) {
  const bool o_ok = o_dims.size() == 4 && o_dims[1] == a->t && o_dims[2] == a->n && o_dims[3] == a->h;
  const bool ml_ok = ml_dims.size() == 4 && ml_dims[0] == o_dims[0] && ml_dims[1] == a->t && ml_dims[2] == a->n &&
                     ml_dims[3] == 2;
  if (!o_ok || !ml_ok) return Invalid("split scratch must be [S, T, N, H] and [S, T, N, 2]");
  a->splits = o_dims[0] > 1 ? o_dims[0] : 1;
  return ffi::Error::Success();
}

// The decoded-table workspace [D, H] bf16: D = 0 (none) or the three tables' rows together (the
// CUDA kernel decodes the FLASH FP8 tables into it once a call; the CPU kernel ignores it).
inline ffi::Error ParseDecodedTables(ffi::DataType type, ffi::Span<const int64_t> dims, AttentionArgs* a) {
  const int64_t rows = a->ring.rows + a->fresh.rows + a->comp.rows;
  if (type != ffi::DataType::BF16 || dims.size() != 2 || dims[1] != a->h || (dims[0] != 0 && dims[0] != rows)) {
    return Invalid("the decoded-table workspace must be [0 or the tables' rows together, H] bf16");
  }
  a->decoded_rows = dims[0];
  return ffi::Error::Success();
}

inline ffi::Error ParseAttention(const ffi::AnyBuffer& q, const ffi::AnyBuffer (&ring)[3],
                                 const ffi::AnyBuffer (&fresh)[3], const ffi::Buffer<ffi::S32>& window_idx,
                                 const ffi::AnyBuffer (&comp)[3], const ffi::Buffer<ffi::S32>& comp_idx,
                                 const ffi::Buffer<ffi::F32>& sink, ffi::DataType out_type,
                                 ffi::Span<const int64_t> split_o_dims, ffi::Span<const int64_t> split_ml_dims,
                                 ffi::DataType decoded_type, ffi::Span<const int64_t> decoded_dims, int32_t block,
                                 AttentionArgs* a) {
  if (auto e = CheckRank(q, 3, "q"); e.failure()) return e;
  const auto q_type = FloatElem(q);
  if (!q_type) return Invalid("q must be f32 or bf16");
  if (out_type != q.element_type()) return Invalid("the output must have q's dtype");
  a->q_type = *q_type;
  a->t = Dim(q, 0), a->n = Dim(q, 1), a->h = Dim(q, 2);
  if (auto e = MakeTable(ring[0], ring[1], ring[2], block, "ring", &a->ring); e.failure()) return e;
  if (auto e = MakeTable(fresh[0], fresh[1], fresh[2], block, "fresh", &a->fresh); e.failure()) return e;
  if (auto e = MakeTable(comp[0], comp[1], comp[2], block, "compressed", &a->comp); e.failure()) return e;
  for (const TableView* t : {&a->ring, &a->fresh, &a->comp}) {
    if (t->width() != a->h) return Invalid("every table's entries must be as wide as q's head dim");
  }
  const auto wd = window_idx.dimensions(), cd = comp_idx.dimensions();
  if (wd.size() != 2 || wd[0] != a->t) return Invalid("window_idx must be [T, W]");
  if (cd.size() != 2 || cd[0] != a->t) return Invalid("compressed_idx must be [T, X]");
  if (sink.dimensions().size() != 1 || sink.dimensions()[0] != a->n) return Invalid("sink must be [N]");
  a->w = wd[1], a->x = cd[1];
  if (auto e = ParseSplitScratch(split_o_dims, split_ml_dims, a); e.failure()) return e;
  return ParseDecodedTables(decoded_type, decoded_dims, a);
}

struct IndexerArgs {
  Elem q_type;
  int64_t t, i, j, p, epp, s, k;  // queries, heads, head dim, pages, entries per page, S = p x epp, kept slots
  bool scratch;  // scores scratch given ([T, S]); else [T, 0] and the kernel keeps the score rows itself
  TableView keys;
};

inline ffi::Error ParseIndexer(const ffi::AnyBuffer& q, const ffi::Buffer<ffi::F32>& w,
                               const ffi::AnyBuffer (&keys)[3], const ffi::Buffer<ffi::S32>& page_table,
                               const ffi::Buffer<ffi::S32>& limit, ffi::Span<const int64_t> ids_dims,
                               ffi::Span<const int64_t> scores_dims, int32_t block, int32_t entries_per_page,
                               IndexerArgs* a) {
  if (auto e = CheckRank(q, 3, "q"); e.failure()) return e;
  const auto q_type = FloatElem(q);
  if (!q_type) return Invalid("q must be f32 or bf16");
  a->q_type = *q_type;
  a->t = Dim(q, 0), a->i = Dim(q, 1), a->j = Dim(q, 2);
  if (auto e = MakeTable(keys[0], keys[1], keys[2], block, "keys", &a->keys); e.failure()) return e;
  if (a->keys.width() != a->j) return Invalid("key entries must be as wide as q's head dim");
  const auto wd = w.dimensions(), pd = page_table.dimensions();
  if (wd.size() != 2 || wd[0] != a->t || wd[1] != a->i) return Invalid("w must be [T, I]");
  if (pd.size() != 2 || pd[0] != a->t) return Invalid("page_table must be [T, P]");
  if (entries_per_page <= 0) return Invalid("entries_per_page must be positive");
  if (limit.dimensions().size() != 1 || limit.dimensions()[0] != a->t) return Invalid("limit must be [T]");
  a->p = pd[1], a->epp = entries_per_page, a->s = a->p * a->epp;
  if (a->s > INT32_MAX) return Invalid("at most 2^31 - 1 candidates per query (P x entries_per_page)");
  if (ids_dims.size() != 2 || ids_dims[0] != a->t || ids_dims[1] > a->s) {
    return Invalid("ids must be [T, k] with k <= S");
  }
  a->k = ids_dims[1];
  if (scores_dims.size() != 2 || scores_dims[0] != a->t || (scores_dims[1] != a->s && scores_dims[1] != 0)) {
    return Invalid("scores scratch must be [T, S] or [T, 0]");
  }
  a->scratch = scores_dims[1] == a->s && a->s > 0;
  return ffi::Error::Success();
}

struct KvWriteArgs {
  TableView table;
  Elem x_type;
  int64_t n, width, quant_width;  // new rows, entry width, columns rounded to the grid (0 without one)
  Grid grid;
};

inline ffi::Error ParseKvWrite(const ffi::AnyBuffer (&table)[3], const ffi::Buffer<ffi::S32>& rows,
                               const ffi::AnyBuffer& x, int32_t grid_attr, int32_t quant_width, int32_t block,
                               KvWriteArgs* a) {
  if (auto e = MakeTable(table[0], table[1], table[2], block, "table", &a->table); e.failure()) return e;
  const TableView& v = a->table;
  if (grid_attr < 0 || grid_attr > 2) return Invalid("grid must be 0 (none), 1 (e4m3) or 2 (e2m1)");
  a->grid = static_cast<Grid>(grid_attr);
  if (auto e = CheckRank(x, 2, "new entries"); e.failure()) return e;
  const auto x_type = FloatElem(x);
  if (!x_type) return Invalid("new entries must be f32 or bf16");
  a->x_type = *x_type;
  a->n = Dim(x, 0), a->width = Dim(x, 1);
  if (a->width != v.width()) return Invalid("new entries must be as wide as the table's entries");
  if (rows.dimensions().size() != 1 || rows.dimensions()[0] != a->n) return Invalid("rows must be [n]");
  if (quant_width < 0 || quant_width > v.values_width) return Invalid("quant_width exceeds the values part");
  const bool coded = v.values_type == Elem::kE4m3 || v.values_type == Elem::kE2m1x2;
  if (coded && (a->grid == Grid::kNone || quant_width != v.values_width)) {
    return Invalid("fp8/fp4 values need a grid over the whole values part");
  }
  // An even block keeps every packed e2m1 byte inside one block (one writer per byte on the GPU).
  if (a->grid != Grid::kNone && (quant_width == 0 || block <= 0 || block % 2)) {
    return Invalid("a grid needs quant_width and an even block");
  }
  if (v.scales_width && v.scales_width != (quant_width + block - 1) / block) {
    return Invalid("scales must hold one byte per block of the quantised columns");
  }
  a->quant_width = a->grid == Grid::kNone ? 0 : quant_width;
  return ffi::Error::Success();
}

struct Fp8LinearArgs {
  Elem x_type, y_type;
  int64_t t, k, n;   // rows of x (its leading dims together), reduced dim, output features
  int64_t k_blocks;  // ceil(K / 128): act_quant blocks of a row, weight scale columns
};

inline ffi::Error ParseFp8Linear(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::Buffer<ffi::U8>& w_scale,
                                 ffi::DataType y_type, ffi::Span<const int64_t> y_dims, Fp8LinearArgs* a) {
  const auto x_type = FloatElem(x);
  if (!x_type || x.dimensions().size() == 0) return Invalid("x must be f32 or bf16 [..., K]");
  const auto y_elem = ElemOf(y_type);
  if (!y_elem || (*y_elem != Elem::kF32 && *y_elem != Elem::kBf16)) return Invalid("y must be f32 or bf16");
  if (auto e = CheckRank(w, 2, "weight"); e.failure()) return e;
  if (w.element_type() != ffi::DataType::F8E4M3FN) return Invalid("weight must be float8_e4m3fn");
  const auto x_dims = x.dimensions();
  a->x_type = *x_type, a->y_type = *y_elem;
  a->k = x_dims.back(), a->n = Dim(w, 0);
  a->t = 1;
  for (size_t i = 0; i + 1 < x_dims.size(); ++i) a->t *= x_dims[i];
  if (Dim(w, 1) != a->k) return Invalid("weight must be [N, K] with x's K");
  a->k_blocks = (a->k + kActBlock - 1) / kActBlock;
  const auto s_dims = w_scale.dimensions();
  if (s_dims.size() != 2 || s_dims[0] != (a->n + kWeightBlock - 1) / kWeightBlock || s_dims[1] != a->k_blocks) {
    return Invalid("weight scales must be [ceil(N/128), ceil(K/128)]");
  }
  bool same = y_dims.size() == x_dims.size() && y_dims.back() == a->n;
  for (size_t i = 0; same && i + 1 < x_dims.size(); ++i) same = y_dims[i] == x_dims[i];
  if (!same) return Invalid("y must be [..., N] with x's leading dims");
  return ffi::Error::Success();
}

constexpr int64_t kFp4Group = 32;  // quant.FP4_GROUP: columns per FP4 expert scale

// One stored expert stack [E, out, in]: FP4 (packed e2m1 [E, out, in/2], scales [E, out, in/32])
// or FP8 (e4m3 [E, out, in], scales [E, ceil(out/128), ceil(in/128)]).
struct ExpertStackView {
  const uint8_t* weight;
  const uint8_t* scale;
  bool fp4;
  int64_t e, out, in;
};

inline ffi::Error MakeExpertStack(const ffi::AnyBuffer& w, const ffi::Buffer<ffi::U8>& s, const char* name,
                                  ExpertStackView* v) {
  const std::string n(name);
  if (auto e = CheckRank(w, 3, name); e.failure()) return e;
  const bool fp4 = w.element_type() == ffi::DataType::S8 || w.element_type() == ffi::DataType::U8;
  if (!fp4 && w.element_type() != ffi::DataType::F8E4M3FN) {
    return Invalid(n + " must be float8_e4m3fn or packed e2m1 (int8)");
  }
  *v = {static_cast<const uint8_t*>(w.untyped_data()), s.typed_data(), fp4, Dim(w, 0), Dim(w, 1),
        Dim(w, 2) * (fp4 ? 2 : 1)};
  const auto sd = s.dimensions();
  const bool ok = sd.size() == 3 && sd[0] == v->e &&
                  (fp4 ? sd[1] == v->out && v->in % kFp4Group == 0 && sd[2] == v->in / kFp4Group
                       : sd[1] == (v->out + kWeightBlock - 1) / kWeightBlock &&
                             sd[2] == (v->in + kWeightBlock - 1) / kWeightBlock);
  if (!ok) return Invalid(n + " scales do not match its weight (FP4: [E, out, in/32]; FP8: [E, out/128, in/128])");
  return ffi::Error::Success();
}

struct MoeArgs {
  Elem x_type;
  int64_t t, d, k, e, f;  // tokens, hidden, assignments a token, local experts, intermediate
  ExpertStackView w1, w3, w2;
};

inline ffi::Error ParseMoe(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& sel, const ffi::Buffer<ffi::F32>& w,
                           const ffi::AnyBuffer* (&&stacks)[3], const ffi::Buffer<ffi::U8>* (&&scales)[3],
                           ffi::Span<const int64_t> y_dims, MoeArgs* a) {
  if (auto e = CheckRank(x, 2, "x"); e.failure()) return e;
  const auto x_type = FloatElem(x);
  if (!x_type) return Invalid("x must be f32 or bf16");
  a->x_type = *x_type, a->t = Dim(x, 0), a->d = Dim(x, 1);
  const auto sel_dims = sel.dimensions();
  if (sel_dims.size() != 2 || sel_dims[0] != a->t) return Invalid("selected experts must be [T, K]");
  a->k = sel_dims[1];
  const auto w_dims = w.dimensions();
  if (w_dims.size() != 2 || w_dims[0] != a->t || w_dims[1] != a->k) return Invalid("routing weights must be [T, K]");
  const char* names[3] = {"w1", "w3", "w2"};
  ExpertStackView* views[3] = {&a->w1, &a->w3, &a->w2};
  for (int i = 0; i < 3; ++i) {
    if (auto e = MakeExpertStack(*stacks[i], *scales[i], names[i], views[i]); e.failure()) return e;
  }
  a->e = a->w1.e, a->f = a->w1.out;
  const bool same = a->w3.e == a->e && a->w2.e == a->e && a->w3.out == a->f && a->w3.in == a->d &&
                    a->w1.in == a->d && a->w2.out == a->d && a->w2.in == a->f && a->w1.fp4 == a->w3.fp4 &&
                    a->w1.fp4 == a->w2.fp4;
  if (!same) return Invalid("w1, w3 must be [E, F, D] and w2 [E, D, F], in one format, with x's D");
  if (y_dims.size() != 2 || y_dims[0] != a->t || y_dims[1] != a->d) return Invalid("y must be [T, D]");
  return ffi::Error::Success();
}

// The activation scratch of the per-token CUDA kernels, [T, K, F] f32.
inline ffi::Error CheckActivationScratch(ffi::Span<const int64_t> dims, const MoeArgs& a) {
  if (dims.size() != 3 || dims[0] != a.t || dims[1] != a.k || dims[2] != a.f) {
    return Invalid("the activation scratch must be [T, K, F]");
  }
  return ffi::Error::Success();
}

// The most token tiles any routing of `assignments` over `experts` can need: each expert's last
// tile may be partial (moe_experts/ffi.py's max_tiles).
inline int64_t GroupedMaxTiles(int64_t assignments, int64_t experts, int64_t tile_tokens) {
  return assignments / tile_tokens + std::min(experts, assignments);
}

// The grouped CUDA form's plan and scratch (see moe_experts_cuda.cu).
inline ffi::Error CheckGroupedMoe(ffi::Span<const int64_t> order, ffi::Span<const int64_t> groups,
                                  ffi::Span<const int64_t> xq, ffi::Span<const int64_t> xs,
                                  ffi::Span<const int64_t> aq, ffi::Span<const int64_t> as,
                                  ffi::Span<const int64_t> part, int32_t tile_tokens, const MoeArgs& a) {
  if (tile_tokens != 8 && tile_tokens != 16 && tile_tokens != 32) return Invalid("tile must be 8, 16 or 32");
  if (a.d % 32 != 0 || a.f % 32 != 0) return Invalid("the grouped form needs D and F multiples of 32");
  const int64_t tk = a.t * a.k, db = (a.d + kActBlock - 1) / kActBlock, fb = (a.f + kActBlock - 1) / kActBlock;
  auto is = [](ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
    return dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin());
  };
  if (!is(order, {tk}) || !is(groups, {a.e, 3})) return Invalid("the routing plan must be order [T K] and groups [E, 3]");
  if (!is(xq, {a.t, a.d}) || !is(xs, {a.t, db}) || !is(aq, {tk, a.f}) || !is(as, {tk, fb}) || !is(part, {tk, a.d})) {
    return Invalid("the scratch must be xq [T, D], xs [T, D/128], aq [T K, F], as [T K, F/128], part [T K, D]");
  }
  return ffi::Error::Success();
}

}  // namespace dsv4
