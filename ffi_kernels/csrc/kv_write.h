// kv_write: quantise-and-store of new entries into a table (dsv4.state.EntryTable.write with the
// model's fake-quant codec), shared by the CPU and CUDA kernels: one function encodes one row.
#pragma once

#include <cstdint>

#include "tables.h"

namespace dsv4 {

// The grid the leading `quant_width` columns are rounded to (the rest are stored as they come).
enum class Grid : int32_t { kNone = 0, kE4m3 = 1, kE2m1 = 2 };

struct WritableTable {
  void* values;
  Elem values_type;
  int64_t values_width;  // decoded values per row
  uint8_t* scales;
  int64_t scales_width;
  void* rope;
  Elem rope_type;
  int64_t rope_width;
  int64_t rows;
};

// The writable parts (the aliased results) of the table `v` describes.
inline WritableTable Writable(const TableView& v, void* values, void* scales, void* rope) {
  return {values, v.values_type, v.values_width, static_cast<uint8_t*>(scales), v.scales_width,
          rope, v.rope_type, v.rope_width, v.rows};
}

DSV4_HD float RoundToGrid(Grid grid, float y) { return grid == Grid::kE4m3 ? RoundE4m3(y) : RoundE2m1(y); }

// The E8M0 scale byte of a block whose largest magnitude is amax (quant._quantize_blocks).
DSV4_HD uint8_t GridScaleByte(Grid grid, float amax) {
  return BlockScaleByte(amax, grid == Grid::kE4m3 ? kFp8Max : kFp4Max);
}

// The e2m1 code of input value v in a block of the given scale.
DSV4_HD uint8_t E2m1Code(Grid grid, float v, float scale) { return GridFloatToE2m1(RoundToGrid(grid, v / scale)); }

// Sets the nibble of packed e2m1 value `at` (of the whole values array; low nibble first),
// keeping the other nibble of its byte.
DSV4_HD void StoreE2m1Nibble(const WritableTable& t, int64_t at, uint8_t code) {
  uint8_t* byte = static_cast<uint8_t*>(t.values) + at / 2;
  *byte = (at & 1) ? static_cast<uint8_t>((*byte & 0x0fu) | (code << 4)) : static_cast<uint8_t>((*byte & 0xf0u) | code);
}

// Stores input value v of column k (< quant_width) of row `row`, quantised in a block of the
// given scale, for every values type but packed e2m1 (E2m1Code / StoreE2m1Nibble).
DSV4_HD void StoreQuantValue(const WritableTable& t, int64_t row, int64_t k, Grid grid, float v, float scale) {
  const float g = RoundToGrid(grid, v / scale);
  const int64_t at = row * t.values_width + k;
  if (t.values_type == Elem::kE4m3) {
    static_cast<uint8_t*>(t.values)[at] = GridFloatToE4m3(g);
  } else {
    StoreFloat(t.values, t.values_type, at, g * scale);  // dense fake-quant values
  }
}

// Encodes block `b` (columns [b * block, min((b + 1) * block, quant_width))) of one input row
// `x` (f32 | bf16, `x_type`) into row `row` of `t`, as quant._quantize_blocks then the codec.
DSV4_HD void WriteQuantBlock(const WritableTable& t, int64_t row, const void* x, Elem x_type, int64_t x_offset,
                             Grid grid, int64_t quant_width, int64_t block, int64_t b) {
  const int64_t lo = b * block, hi = lo + block < quant_width ? lo + block : quant_width;
  float amax = 0.0f;
  for (int64_t k = lo; k < hi; ++k) amax = fmaxf(amax, fabsf(LoadElem(x, x_type, x_offset + k)));
  const uint8_t scale_byte = GridScaleByte(grid, amax);
  const float scale = E8m0ToFloat(scale_byte);
  if (t.scales_width) t.scales[row * t.scales_width + b] = scale_byte;
  for (int64_t k = lo; k < hi; ++k) {
    const float v = LoadElem(x, x_type, x_offset + k);
    if (t.values_type == Elem::kE2m1x2) {
      StoreE2m1Nibble(t, row * t.values_width + k, E2m1Code(grid, v, scale));
    } else {
      StoreQuantValue(t, row, k, grid, v, scale);
    }
  }
}

// Column k (>= quant_width) of a row: stored as it is, in the values part or the rope after it.
DSV4_HD void WritePlainColumn(const WritableTable& t, int64_t row, int64_t k, float v) {
  if (k < t.values_width) {
    StoreFloat(t.values, t.values_type, row * t.values_width + k, v);
  } else {
    StoreFloat(t.rope, t.rope_type, row * t.rope_width + (k - t.values_width), v);
  }
}

}  // namespace dsv4
