// kv_write on CUDA: the twin of dsv4/ops/kv_write/reference.py and of kv_write_cpu.cc.
//
// One block per new entry: thread b quantises scale block b of the row (a block of the KV
// format is 64 values, of the indexer's 32: whole bytes of packed e2m1, so no two threads
// share a byte), then the threads store the remaining columns. The table parts are aliased to
// the results; XLA gives the same buffers, and a copy is made on the stream when it does not.
#include <cuda_runtime.h>

#include "cuda_common.h"
#include "op_args.h"

namespace dsv4 {
namespace {

constexpr int kThreads = 128;

__global__ void KvWriteKernel(WritableTable t, const int32_t* rows, const void* x, Elem x_type, int64_t width,
                              Grid grid, int64_t quant_width, int64_t block) {
  const int64_t i = blockIdx.x;
  const int64_t row = rows[i];
  if (row < 0 || row >= t.rows) return;  // padding and dropped writes
  const int64_t n_blocks = quant_width ? (quant_width + block - 1) / block : 0;
  for (int64_t b = threadIdx.x; b < n_blocks; b += kThreads) {
    WriteQuantBlock(t, row, x, x_type, i * width, grid, quant_width, block, b);
  }
  for (int64_t k = quant_width + threadIdx.x; k < width; k += kThreads) {
    WritePlainColumn(t, row, x, x_type, i * width, k);
  }
}

ffi::Error CopyIfNotAliased(cudaStream_t stream, const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (in.untyped_data() == out->untyped_data() || in.size_bytes() == 0) return ffi::Error::Success();
  if (cudaMemcpyAsync(out->untyped_data(), in.untyped_data(), in.size_bytes(), cudaMemcpyDeviceToDevice, stream) !=
      cudaSuccess) {
    return LastCudaError("kv_write copy");
  }
  return ffi::Error::Success();
}

ffi::Error KvWriteCuda(cudaStream_t stream, ffi::AnyBuffer values, ffi::AnyBuffer scales, ffi::AnyBuffer rope,
                       ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> values_out,
                       ffi::Result<ffi::AnyBuffer> scales_out, ffi::Result<ffi::AnyBuffer> rope_out, int32_t grid_attr,
                       int32_t quant_width, int32_t block) {
  KvWriteArgs a;
  if (auto e = ParseKvWrite({values, scales, rope}, rows, x, grid_attr, quant_width, block, &a); e.failure()) return e;
  if (auto e = CopyIfNotAliased(stream, values, values_out); e.failure()) return e;
  if (auto e = CopyIfNotAliased(stream, scales, scales_out); e.failure()) return e;
  if (auto e = CopyIfNotAliased(stream, rope, rope_out); e.failure()) return e;
  if (a.n == 0) return ffi::Error::Success();
  const WritableTable t =
      Writable(a.table, values_out->untyped_data(), scales_out->untyped_data(), rope_out->untyped_data());
  KvWriteKernel<<<static_cast<unsigned>(a.n), kThreads, 0, stream>>>(t, rows.typed_data(), x.untyped_data(), a.x_type,
                                                                     a.width, a.grid, a.quant_width, block);
  return LastCudaError("KvWriteKernel");
}

}  // namespace
}  // namespace dsv4

namespace ffi = xla::ffi;

// The arguments are those of Dsv4KvWriteCpu (kv_write_cpu.cc), after the stream.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4KvWriteCuda, dsv4::KvWriteCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()       // table values
                                  .Arg<ffi::AnyBuffer>()       // table scales
                                  .Arg<ffi::AnyBuffer>()       // table rope
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows
                                  .Arg<ffi::AnyBuffer>()       // new entries
                                  .Ret<ffi::AnyBuffer>()       // table values'
                                  .Ret<ffi::AnyBuffer>()       // table scales'
                                  .Ret<ffi::AnyBuffer>()       // table rope'
                                  .Attr<int32_t>("grid")
                                  .Attr<int32_t>("quant_width")
                                  .Attr<int32_t>("block"),
                              {ffi::Traits::kCmdBufferCompatible});
