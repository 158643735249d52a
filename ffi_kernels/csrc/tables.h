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

}  // namespace dsv4
