// REF's act_quant (dsv4.quant.act_quant, spec 6.2) on one block of an activation row, shared by
// the CPU and CUDA GEMM kernels: e4m3 values with one power-of-two scale per 128 elements.
#pragma once

#include <cstdint>

#include "tables.h"

namespace dsv4 {

constexpr int64_t kActBlock = 128;  // quant.ACT_BLOCK: elements of the reduced dim per scale
constexpr int64_t kWeightBlock = 128;  // quant.FP8_BLOCK: FP8 weight scale blocks are 128 x 128

// Quantises x[offset, offset + len) (f32 | bf16) as one act_quant block: writes the e4m3 grid
// values (held in f32, exact) to `values` and returns the block's scale.
DSV4_HD float QuantizeActBlock(const void* x, Elem x_type, int64_t offset, int64_t len, float* values) {
  float amax = 0.0f;
  for (int64_t k = 0; k < len; ++k) amax = fmaxf(amax, fabsf(LoadElem(x, x_type, offset + k)));
  const float scale = E8m0ToFloat(BlockScaleByte(amax, kFp8Max));
  for (int64_t k = 0; k < len; ++k) values[k] = RoundE4m3(LoadElem(x, x_type, offset + k) / scale);
  return scale;
}

}  // namespace dsv4
