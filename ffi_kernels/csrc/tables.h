// A read-only view of one stored entry table (dsv4.state.EntryTable) as the kernels see it:
// up to three parts per row, each [rows, width]:
//   values  f32 | bf16 | float8_e4m3fn | packed e2m1 (two per byte, low nibble first)
//   scales  one E8M0 byte per `block` values (width 0: the values are not scaled)
//   rope    f32 | bf16 passthrough columns after the values (width 0: none)
// Entry k of a row decodes to values[k] * 2^(scale[k / block] - 127) for k < values width and
// to rope[k - values width] after it, exactly as quant.decode_* compute it in f32.
#pragma once

#include <cstdint>

#include "numerics.h"

namespace dsv4 {

enum class Elem : int32_t { kF32 = 0, kBf16 = 1, kE4m3 = 2, kE2m1x2 = 3 };  // order: TableView::value_bytes

struct TableView {
  const void* values = nullptr;
  Elem values_type = Elem::kF32;
  int64_t values_width = 0;  // decoded values per row (packed e2m1: twice the bytes)
  const uint8_t* scales = nullptr;
  int64_t scales_width = 0;
  int64_t block = 1;
  const void* rope = nullptr;
  Elem rope_type = Elem::kF32;
  int64_t rope_width = 0;
  int64_t rows = 0;

  DSV4_HD int64_t width() const { return values_width + rope_width; }
  // Stored bytes of one row's values part: 32, 16, 8 or 4 bits a value, halving with each
  // Elem after kF32 (no branch: the GPU kernels compute it per load).
  DSV4_HD int64_t value_bytes() const { return values_width * (32 >> static_cast<int>(values_type)) / 8; }
};

DSV4_HD float LoadElem(const void* base, Elem type, int64_t i) {
  switch (type) {
    case Elem::kF32: return static_cast<const float*>(base)[i];
    case Elem::kBf16: return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case Elem::kE4m3: return E4m3ToFloat(static_cast<const uint8_t*>(base)[i]);
    case Elem::kE2m1x2: {
      const uint8_t byte = static_cast<const uint8_t*>(base)[i / 2];
      return E2m1ToFloat((i & 1) ? (byte >> 4) : (byte & 0xfu));
    }
  }
  return 0.0f;
}

// Stores v as element i of an f32 or bf16 array (round to nearest even for bf16).
DSV4_HD void StoreFloat(void* base, Elem type, int64_t i, float v) {
  if (type == Elem::kF32) {
    static_cast<float*>(base)[i] = v;
  } else {
    static_cast<uint16_t*>(base)[i] = FloatToBf16(v);
  }
}

// Entry k (< t.width()) of row `row` (< t.rows), decoded to f32.
DSV4_HD float DecodeEntry(const TableView& t, int64_t row, int64_t k) {
  if (k >= t.values_width) return LoadElem(t.rope, t.rope_type, row * t.rope_width + (k - t.values_width));
  const float v = LoadElem(t.values, t.values_type, row * t.values_width + k);
  return t.scales_width ? v * E8m0ToFloat(t.scales[row * t.scales_width + k / t.block]) : v;
}

// Row `row` of t decoded to f32 into out[0 .. t.width()): DecodeEntry of every entry, with the
// scale read once a block instead of once an entry (host code: the CPU kernels). An unscaled
// table multiplies by 1, which leaves every value as it is.
inline void DecodeRow(const TableView& t, int64_t row, float* out) {
  const int64_t step = t.scales_width ? t.block : t.values_width;
  for (int64_t k0 = 0; k0 < t.values_width; k0 += step) {
    const int64_t k1 = k0 + step < t.values_width ? k0 + step : t.values_width;
    const float scale = t.scales_width ? E8m0ToFloat(t.scales[row * t.scales_width + k0 / t.block]) : 1.0f;
    for (int64_t k = k0; k < k1; ++k) out[k] = LoadElem(t.values, t.values_type, row * t.values_width + k) * scale;
  }
  for (int64_t k = 0; k < t.rope_width; ++k) {
    out[t.values_width + k] = LoadElem(t.rope, t.rope_type, row * t.rope_width + k);
  }
}

// a . b over n floats, in eight interleaved partial sums that the compiler can vectorise (a
// single running sum is a chain of dependent adds that it may not reorder).
inline float Dot(const float* a, const float* b, int64_t n) {
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int i = 0; i < 8; ++i) part[i] += a[k + i] * b[k + i];
  }
  float tail = 0.0f;
  for (; k < n; ++k) tail += a[k] * b[k];
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7])) + tail;
}

}  // namespace dsv4
