// moe_experts on the CPU: the twin of dsv4/ops/moe_experts/reference.py with act_quant on.
//
// For each token t and each of its K assignments (expert e = sel[t, k], weight w[t, k]; ids
// outside [0, E) belong to other devices and add nothing):
//   g, u = act_quant(x[t]) @ W1[e]^T, @ W3[e]^T      (f32 partial sums per weight scale group)
//   a    = dtype(silu(min(g, L)) * clamp(u, -L, L) * w[t, k])
//   y[t] += act_quant(a) @ W2[e]^T
// Weights are stored FP4 (e2m1 codes, two a byte, one E8M0 scale per row and 32 columns) or FP8
// (e4m3, one E8M0 scale per 128 x 128 block); y is f32 [T, D].
#include <algorithm>
#include <cmath>
#include <vector>

#include "act_quant.h"
#include "op_args.h"

namespace dsv4 {
namespace {

// Row `row` of expert `e` of a stored stack, decoded to f32 (codes times their scales).
void DecodeExpertRow(const ExpertStackView& s, int64_t e, int64_t row, float* out) {
  if (s.fp4) {
    const uint8_t* codes = s.weight + (e * s.out + row) * (s.in / 2);
    const uint8_t* scales = s.scale + (e * s.out + row) * (s.in / kFp4Group);
    for (int64_t k = 0; k < s.in; ++k) {
      const uint8_t byte = codes[k / 2];
      out[k] = E2m1ToFloat((k & 1) ? (byte >> 4) : (byte & 0xfu)) * E8m0ToFloat(scales[k / kFp4Group]);
    }
  } else {
    const uint8_t* values = s.weight + (e * s.out + row) * s.in;
    const int64_t blocks = (s.in + kWeightBlock - 1) / kWeightBlock;
    const uint8_t* scales = s.scale + (e * ((s.out + kWeightBlock - 1) / kWeightBlock) + row / kWeightBlock) * blocks;
    for (int64_t k = 0; k < s.in; ++k) out[k] = E4m3ToFloat(values[k]) * E8m0ToFloat(scales[k / kWeightBlock]);
  }
}

// act_quant of v [n] in place: each 128-block replaced by its e4m3 values times their scale.
void FakeActQuant(std::vector<float>& v) {
  const int64_t n = static_cast<int64_t>(v.size());
  std::vector<float> q(kActBlock);
  for (int64_t lo = 0; lo < n; lo += kActBlock) {
    const int64_t len = std::min(kActBlock, n - lo);
    const float scale = QuantizeActBlock(v.data(), Elem::kF32, lo, len, q.data());
    for (int64_t k = 0; k < len; ++k) v[lo + k] = q[k] * scale;
  }
}

// y [rows] += m [rows, cols] @ v [cols] for expert e of stack s, row by row.
void ExpertMatVec(const ExpertStackView& s, int64_t e, const std::vector<float>& v, std::vector<float>& row_buf,
                  float* y) {
  for (int64_t r = 0; r < s.out; ++r) {
    DecodeExpertRow(s, e, r, row_buf.data());
    float acc = 0.0f;
    for (int64_t k = 0; k < s.in; ++k) acc += v[k] * row_buf[k];
    y[r] = acc;
  }
}

float Silu(float g) { return g / (1.0f + std::exp(-g)); }

ffi::Error MoeExpertsImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> sel, ffi::Buffer<ffi::F32> route_w,
                          ffi::AnyBuffer w1, ffi::Buffer<ffi::U8> s1, ffi::AnyBuffer w3, ffi::Buffer<ffi::U8> s3,
                          ffi::AnyBuffer w2, ffi::Buffer<ffi::U8> s2, ffi::Result<ffi::Buffer<ffi::F32>> y,
                          float limit) {
  MoeArgs a;
  if (auto e = ParseMoe(x, sel, route_w, {&w1, &w3, &w2}, {&s1, &s3, &s2}, y->dimensions(), &a); e.failure()) {
    return e;
  }
  const int64_t d = a.d, f = a.f;
  std::vector<float> xt(d), g(f), u(f), act(f), out(d), row_buf(std::max(d, f));
  float* yp = y->typed_data();
  for (int64_t t = 0; t < a.t; ++t) {
    for (int64_t k = 0; k < d; ++k) xt[k] = LoadElem(x.untyped_data(), a.x_type, t * d + k);
    FakeActQuant(xt);
    std::fill(yp + t * d, yp + (t + 1) * d, 0.0f);
    for (int64_t j = 0; j < a.k; ++j) {
      const int32_t e = sel.typed_data()[t * a.k + j];
      if (e < 0 || e >= a.e) continue;  // another device's expert
      const float weight = route_w.typed_data()[t * a.k + j];
      ExpertMatVec(a.w1, e, xt, row_buf, g.data());
      ExpertMatVec(a.w3, e, xt, row_buf, u.data());
      for (int64_t i = 0; i < f; ++i) {
        const float v = Silu(std::fmin(g[i], limit)) * std::fmin(std::fmax(u[i], -limit), limit) * weight;
        act[i] = a.x_type == Elem::kBf16 ? Bf16ToFloat(FloatToBf16(v)) : v;  // the cast to x's dtype
      }
      FakeActQuant(act);
      ExpertMatVec(a.w2, e, act, row_buf, out.data());
      for (int64_t i = 0; i < d; ++i) yp[t * d + i] += out[i];
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace dsv4

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4MoeExpertsCpu, dsv4::MoeExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // x [T, D] f32 | bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // selected experts [T, K]; outside [0, E): none
                                  .Arg<ffi::Buffer<ffi::F32>>()  // routing weights [T, K]
                                  .Arg<ffi::AnyBuffer>()         // w1 [E, F, D] e4m3 | [E, F, D/2] packed e2m1
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w1 scales [E, F/128, D/128] | [E, F, D/32]
                                  .Arg<ffi::AnyBuffer>()         // w3, as w1
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w3 scales
                                  .Arg<ffi::AnyBuffer>()         // w2 [E, D, F] e4m3 | [E, D, F/2] packed e2m1
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w2 scales
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, D]
                                  .Attr<float>("limit"));        // SwiGLU clamp
