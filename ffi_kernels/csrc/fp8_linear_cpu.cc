// fp8_linear on the CPU: the twin of dsv4/ops/fp8_linear/reference.py.
//
// y[t, n] = sum over K blocks b of (sum_{k in b} xq[t, k] * w[n, k]) * xs[t, b] * ws[n / 128, b],
// with xq, xs = act_quant(x[t]) (e4m3 per 128 of K) and w e4m3 [N, K] with E8M0 scales per
// 128 x 128 block; f32 throughout, y stored in its own dtype.
#include <algorithm>
#include <array>
#include <vector>

#include "act_quant.h"
#include "op_args.h"

namespace dsv4 {
namespace {

ffi::Error Fp8LinearImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::U8> w_scale,
                         ffi::Result<ffi::AnyBuffer> y) {
  Fp8LinearArgs a;
  if (auto e = ParseFp8Linear(x, w, w_scale, y->element_type(), y->dimensions(), &a); e.failure()) return e;
  std::array<float, 256> e4m3;  // every e4m3 byte decoded once
  for (int v = 0; v < 256; ++v) e4m3[v] = E4m3ToFloat(static_cast<uint8_t>(v));
  const uint8_t* wb = static_cast<const uint8_t*>(w.untyped_data());
  const uint8_t* ws = w_scale.typed_data();
  std::vector<float> xq(a.k), xs(a.k_blocks);
  for (int64_t t = 0; t < a.t; ++t) {
    for (int64_t b = 0; b < a.k_blocks; ++b) {
      const int64_t lo = b * kActBlock, len = std::min(kActBlock, a.k - lo);
      xs[b] = QuantizeActBlock(x.untyped_data(), a.x_type, t * a.k + lo, len, xq.data() + lo);
    }
    for (int64_t n = 0; n < a.n; ++n) {
      const uint8_t* w_row = wb + n * a.k;
      const uint8_t* s_row = ws + (n / kWeightBlock) * a.k_blocks;
      float acc = 0.0f;
      for (int64_t b = 0; b < a.k_blocks; ++b) {
        const int64_t lo = b * kActBlock, hi = std::min(lo + kActBlock, a.k);
        float part = 0.0f;
        for (int64_t k = lo; k < hi; ++k) part += xq[k] * e4m3[w_row[k]];
        acc += part * (xs[b] * E8m0ToFloat(s_row[b]));
      }
      StoreFloat(y->untyped_data(), a.y_type, t * a.n + n, acc);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4Fp8LinearCpu, dsv4::Fp8LinearImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()        // x [..., K] f32 | bf16 (quantised here)
                                  .Arg<ffi::AnyBuffer>()        // weight [N, K] float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::U8>>()  // weight scales [ceil(N/128), ceil(K/128)] E8M0
                                  .Ret<ffi::AnyBuffer>());      // y [..., N] f32 | bf16
