// kv_write on the CPU: the twin of dsv4/ops/kv_write/reference.py (EntryTable.write).
#include <cstring>

#include "op_args.h"

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
  KvWriteArgs a;
  if (auto e = ParseKvWrite({values, scales, rope}, rows, x, grid_attr, quant_width, block, &a); e.failure()) return e;
  AliasOrCopy(values, values_out);
  AliasOrCopy(scales, scales_out);
  AliasOrCopy(rope, rope_out);
  const WritableTable t =
      Writable(a.table, values_out->untyped_data(), scales_out->untyped_data(), rope_out->untyped_data());
  const int64_t q_w = a.quant_width, width = a.width;
  const int64_t n_blocks = q_w ? (q_w + block - 1) / block : 0;
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t row = rows.typed_data()[i];
    if (row < 0 || row >= t.rows) continue;  // padding and dropped writes
    for (int64_t b = 0; b < n_blocks; ++b) {
      WriteQuantBlock(t, row, x.untyped_data(), a.x_type, i * width, a.grid, q_w, block, b);
    }
    for (int64_t k = q_w; k < width; ++k) {
      WritePlainColumn(t, row, k, LoadElem(x.untyped_data(), a.x_type, i * width + k));
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4KvWriteCpu, dsv4::KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()       // table values [R, Wv] (aliased to result 0)
                                  .Arg<ffi::AnyBuffer>()       // table scales [R, nb] u8 (aliased to result 1)
                                  .Arg<ffi::AnyBuffer>()       // table rope [R, Wr] (aliased to result 2)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [n]: target row; outside [0, R) dropped
                                  .Arg<ffi::AnyBuffer>()       // new entries [n, Wv + Wr] in the table's dtype
                                  .Ret<ffi::AnyBuffer>()       // table values'
                                  .Ret<ffi::AnyBuffer>()       // table scales'
                                  .Ret<ffi::AnyBuffer>()       // table rope'
                                  .Attr<int32_t>("grid")       // 0 store as is, 1 e4m3 grid, 2 e2m1 grid
                                  .Attr<int32_t>("quant_width")  // leading columns rounded to the grid
                                  .Attr<int32_t>("block"));    // columns per scale
