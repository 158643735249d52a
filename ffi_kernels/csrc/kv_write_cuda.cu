// kv_write on CUDA: the twin of dsv4/ops/kv_write/reference.py and of kv_write_cpu.cc.
//
// One block per new entry. The entry is first read into shared memory as f32 by all threads
// (coalesced; every later read is on chip, so no thread waits on a chain of global loads);
// then warp w quantises scale blocks w, w + 4, ...: the block's largest magnitude by a warp
// reduction, one value (e4m3, dense) or one packed e2m1 byte (two values: a block is an even
// number of values, so no two lanes or warps share a byte) per lane; then the threads store
// the remaining columns. The table parts are aliased to the results; XLA gives the same
// buffers, and a copy is made on the stream when it does not.
#include <cuda_runtime.h>

#include "cuda_common.h"
#include "op_args.h"

namespace dsv4 {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxWidth = 48 * 1024 / sizeof(float);  // the entry in f32 within the default shared memory

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__global__ void KvWriteKernel(WritableTable t, const int32_t* rows, const void* x, Elem x_type, int64_t width,
                              Grid grid, int64_t quant_width, int64_t block) {
  extern __shared__ float entry[];  // [width]
  const int64_t i = blockIdx.x;
  const int64_t row = rows[i];
  if (row < 0 || row >= t.rows) return;  // padding and dropped writes
  for (int64_t k = threadIdx.x; k < width; k += kThreads) entry[k] = LoadElem(x, x_type, i * width + k);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n_blocks = quant_width ? (quant_width + block - 1) / block : 0;
  for (int64_t b = warp; b < n_blocks; b += kWarps) {
    const int64_t lo = b * block, hi = min(lo + block, quant_width);
    float amax = 0.0f;
    for (int64_t k = lo + lane; k < hi; k += 32) amax = fmaxf(amax, fabsf(entry[k]));
    const uint8_t scale_byte = GridScaleByte(grid, WarpMax(amax));
    const float scale = E8m0ToFloat(scale_byte);
    if (lane == 0 && t.scales_width) t.scales[row * t.scales_width + b] = scale_byte;
    if (t.values_type != Elem::kE2m1x2) {
      for (int64_t k = lo + lane; k < hi; k += 32) StoreQuantValue(t, row, k, grid, entry[k], scale);
      continue;
    }
    for (int64_t k = lo + 2 * lane; k < hi; k += 64) {  // values k, k + 1: one byte when both are in the block
      const int64_t at = row * t.values_width + k;
      const uint8_t code = E2m1Code(grid, entry[k], scale);
      const uint8_t next = k + 1 < hi ? E2m1Code(grid, entry[k + 1], scale) : uint8_t{0};
      if (k + 1 < hi && at % 2 == 0) {
        static_cast<uint8_t*>(t.values)[at / 2] = static_cast<uint8_t>(code | (next << 4));
      } else {
        StoreE2m1Nibble(t, at, code);
        if (k + 1 < hi) StoreE2m1Nibble(t, at + 1, next);
      }
    }
  }
  for (int64_t k = quant_width + threadIdx.x; k < width; k += kThreads) WritePlainColumn(t, row, k, entry[k]);
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
  if (a.width > kMaxWidth) return Invalid("entries wider than 12288 are not supported by the CUDA kernel");
  if (auto e = CopyIfNotAliased(stream, values, values_out); e.failure()) return e;
  if (auto e = CopyIfNotAliased(stream, scales, scales_out); e.failure()) return e;
  if (auto e = CopyIfNotAliased(stream, rope, rope_out); e.failure()) return e;
  if (a.n == 0) return ffi::Error::Success();
  const WritableTable t =
      Writable(a.table, values_out->untyped_data(), scales_out->untyped_data(), rope_out->untyped_data());
  KvWriteKernel<<<static_cast<unsigned>(a.n), kThreads, a.width * sizeof(float), stream>>>(
      t, rows.typed_data(), x.untyped_data(), a.x_type, a.width, a.grid, a.quant_width, block);
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
