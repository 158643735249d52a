// kv_write on the CPU: the twin of dsv4/ops/kv_write/reference.py (EntryTable.write).
#include <cstring>

#include "ffi_args.h"
#include "kv_write.h"

namespace dsv4 {
namespace {

// Copies an input part into its aliased output when XLA did not give both the same buffer.
void AliasOrCopy(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (in.untyped_data() != out->untyped_data() && in.size_bytes()) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
}

ffi::Error KvWriteImpl(ffi::AnyBuffer values, ffi::AnyBuffer scales, ffi::AnyBuffer rope, ffi::Buffer<ffi::S32> rows,
                       ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> values_out, ffi::Result<ffi::AnyBuffer> scales_out,
                       ffi::Result<ffi::AnyBuffer> rope_out, int32_t grid_attr, int32_t quant_width, int32_t block) {
  TableView view;
  if (auto e = MakeTable(values, scales, rope, block, "table", &view); e.failure()) return e;
  const Grid grid = static_cast<Grid>(grid_attr);
  if (auto e = CheckRank(x, 2, "new entries"); e.failure()) return e;
  const auto x_type = ElemOf(x.element_type());
  if (!x_type || (*x_type != Elem::kF32 && *x_type != Elem::kBf16)) return Invalid("new entries must be f32 or bf16");
  const int64_t n = Dim(x, 0), width = Dim(x, 1);
  if (width != view.width()) return Invalid("new entries must be as wide as the table's entries");
  if (rows.dimensions().size() != 1 || rows.dimensions()[0] != n) return Invalid("rows must be [n]");
  if (quant_width < 0 || quant_width > view.values_width) return Invalid("quant_width exceeds the values part");
  const bool coded = view.values_type == Elem::kE4m3 || view.values_type == Elem::kE2m1x2;
  if (coded && (grid == Grid::kNone || quant_width != view.values_width)) {
    return Invalid("fp8/fp4 values need a grid over the whole values part");
  }
  if (grid != Grid::kNone && (quant_width == 0 || block <= 0)) return Invalid("a grid needs quant_width and block");
  if (view.scales_width && view.scales_width != (quant_width + block - 1) / block) {
    return Invalid("scales must hold one byte per block of the quantised columns");
  }
  AliasOrCopy(values, values_out);
  AliasOrCopy(scales, scales_out);
  AliasOrCopy(rope, rope_out);
  const WritableTable t{values_out->untyped_data(), view.values_type, view.values_width,
                        static_cast<uint8_t*>(scales_out->untyped_data()), view.scales_width,
                        rope_out->untyped_data(), view.rope_type, view.rope_width, view.rows};
  const int64_t q_w = grid == Grid::kNone ? 0 : quant_width;
  const int64_t n_blocks = q_w ? (q_w + block - 1) / block : 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = rows.typed_data()[i];
    if (row < 0 || row >= t.rows) continue;  // padding and dropped writes
    for (int64_t b = 0; b < n_blocks; ++b) WriteQuantBlock(t, row, x.untyped_data(), *x_type, i * width, grid, q_w, block, b);
    for (int64_t k = q_w; k < width; ++k) WritePlainColumn(t, row, x.untyped_data(), *x_type, i * width, k);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4KvWriteCpu, dsv4::KvWriteImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // table values [R, Wv] (aliased to result 0)
                                  .Arg<xla::ffi::AnyBuffer>()  // table scales [R, nb] u8 (aliased to result 1)
                                  .Arg<xla::ffi::AnyBuffer>()  // table rope [R, Wr] (aliased to result 2)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // rows [n]: target row; outside [0, R) dropped
                                  .Arg<xla::ffi::AnyBuffer>()  // new entries [n, Wv + Wr] in the table's dtype
                                  .Ret<xla::ffi::AnyBuffer>()  // table values'
                                  .Ret<xla::ffi::AnyBuffer>()  // table scales'
                                  .Ret<xla::ffi::AnyBuffer>()  // table rope'
                                  .Attr<int32_t>("grid")         // 0 store as is, 1 e4m3 grid, 2 e2m1 grid
                                  .Attr<int32_t>("quant_width")  // leading columns rounded to the grid
                                  .Attr<int32_t>("block"));      // columns per scale
