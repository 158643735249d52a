// Scalar codecs shared by the CPU and CUDA kernels: bf16, float8_e4m3fn, E8M0 scales, packed
// e2m1, and the blockwise quantisers of dsv4/quant.py, bit-exact with them.
//
// Everything here is a pure function of its arguments, usable from host and device code.
#pragma once

#include <math.h>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DSV4_HD __host__ __device__ __forceinline__
#else
#define DSV4_HD inline
#endif

namespace dsv4 {

constexpr float kFp8Max = 448.0f;   // largest finite float8_e4m3fn
constexpr float kFp4Max = 6.0f;     // largest e2m1
constexpr float kAmaxFloor = 1e-4f; // quant.py _AMAX_FLOOR: an all-zero block still gets a normal scale

DSV4_HD float BitsToFloat(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

DSV4_HD uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

DSV4_HD float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, as XLA's f32 -> bf16 convert; NaN stays a (quiet) NaN.
DSV4_HD uint16_t FloatToBf16(float f) {
  uint32_t b = FloatToBits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff are NaN.
DSV4_HD float E4m3ToFloat(uint8_t v) {
  const uint32_t sign = v >> 7, exp = (v >> 3) & 0xfu, mant = v & 0x7u;
  float mag;
  if (exp == 0xfu && mant == 0x7u) {
    mag = BitsToFloat(0x7fc00000u);
  } else if (exp == 0) {
    mag = static_cast<float>(mant) * 0.001953125f;  // subnormal: mant * 2^-9
  } else {
    mag = BitsToFloat(((exp + 120u) << 23) | (mant << 20));  // rebias 7 -> 127
  }
  return sign ? -mag : mag;
}

// The e4m3 code of a value already on the e4m3 grid (|v| <= 448), signed zeros kept.
DSV4_HD uint8_t GridFloatToE4m3(float v) {
  const uint32_t b = FloatToBits(v);
  const uint8_t sign = static_cast<uint8_t>((b >> 31) << 7);
  const float mag = fabsf(v);
  if (mag < 0.015625f) {  // below 2^-6: subnormal, step 2^-9
    return sign | static_cast<uint8_t>(mag * 512.0f);
  }
  const uint32_t mb = FloatToBits(mag);
  const uint32_t exp = (mb >> 23) - 120u;  // rebias 127 -> 7
  const uint32_t mant = (mb >> 20) & 0x7u;
  return sign | static_cast<uint8_t>((exp << 3) | mant);
}

// E8M0 byte b -> 2^(b - 127); byte 0 is 2^-127 (an f32 subnormal, written as bits), 255 is NaN.
DSV4_HD float E8m0ToFloat(uint8_t b) {
  if (b == 255) return BitsToFloat(0x7fc00000u);
  if (b == 0) return BitsToFloat(0x00400000u);
  return BitsToFloat(static_cast<uint32_t>(b) << 23);
}

// Positive float -> E8M0 byte rounding UP to a power of two (quant.float_to_e8m0).
DSV4_HD uint8_t FloatToE8m0(float x) {
  const uint32_t bits = FloatToBits(x);
  const int exp = static_cast<int>((bits >> 23) & 0xffu);
  const uint32_t mant = bits & 0x7fffffu;
  const uint32_t sign = bits >> 31;
  int byte = exp == 0 ? (mant > 0x400000u ? 1 : 0) : exp + (mant != 0 ? 1 : 0);
  const bool bad = (sign != 0 && bits != 0x80000000u) || exp == 0xff || byte > 254;
  return bad ? 255 : static_cast<uint8_t>(byte);
}

// e2m1 code -> value (bit 3 is the sign; code 8 is -0): 0, 0.5, 1, 1.5, 2, 3, 4, 6. Built from
// bits (exponent e = code bits 1-2, mantissa bit 0) rather than a table, which a GPU keeps in
// local memory.
DSV4_HD float E2m1ToFloat(uint8_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t mag = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3f000000u : 0u);  // 0.5 = 0x3f000000
  return BitsToFloat(mag | (static_cast<uint32_t>(code & 8u) << 28));
}

// The code of a value already on the e2m1 grid, sign bit kept (-0 -> 8).
DSV4_HD uint8_t GridFloatToE2m1(float v) {
  const float bounds[7] = {0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float mag = fabsf(v);
  uint8_t idx = 0;
  for (int i = 0; i < 7; ++i) idx += mag >= bounds[i] ? 1 : 0;
  return static_cast<uint8_t>(idx + ((FloatToBits(v) >> 31) ? 8u : 0u));
}

// Round half to even (the default FP rounding mode; rintf follows it, as jnp.round does).
DSV4_HD float RoundHalfEven(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return nearbyintf(x);
#endif
}

// Nearest float8_e4m3fn value of y (ties to even), saturating at +-448 (quant._round_e4m3).
DSV4_HD float RoundE4m3(float y) {
  const float mag = fminf(fabsf(y), kFp8Max);
  int e;
  frexpf(mag, &e);
  const int step_exp = e - 4 > -9 ? e - 4 : -9;
  const float step = ldexpf(1.0f, step_exp);
  return copysignf(RoundHalfEven(mag / step) * step, y);
}

// Nearest e2m1 value of y (ties to even code), saturating at +-6 (quant._round_e2m1).
DSV4_HD float RoundE2m1(float y) {
  const float mag = fminf(fabsf(y), kFp4Max);
  const float step = mag < 2.0f ? 0.5f : (mag < 4.0f ? 1.0f : 2.0f);
  return copysignf(RoundHalfEven(mag / step) * step, y);
}

// The power-of-two block scale of quant._block_scale, as its E8M0 byte.
DSV4_HD uint8_t BlockScaleByte(float amax, float qmax) {
  return FloatToE8m0(fmaxf(amax, kAmaxFloor) / qmax);
}

}  // namespace dsv4
