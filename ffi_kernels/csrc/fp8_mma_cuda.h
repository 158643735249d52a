// FP8 tensor-core products of one warp (mma.sync m16n8k32, e4m3 x e4m3 -> f32; sm_89 and later)
// and the exact e2m1 -> e4m3 conversion that lets FP4 weights use them.
//
// Fragments of D[16, 8] = A[16, 32] x B[32, 8]^T, lane = 4 * g + q (g = lane / 4, q = lane % 4):
//   A: a[0] = row g, k 4q..4q+3; a[1] = row g+8, the same k; a[2], a[3] = the same rows, k 16+4q..
//   B: b[0] = column g, k 4q..4q+3; b[1] = column g, k 16+4q..16+4q+3
//   D: d[0], d[1] = row g, columns 2q, 2q+1; d[2], d[3] = row g+8, the same columns
// (four e4m3 values to a register, the lowest k in the lowest byte). A dot product does not depend
// on the order of its k, so the kernels feed the mma a permuted k: lane q's registers a[0], a[2]
// (and b[0], b[1]) hold the 8 consecutive stored values 8q..8q+7 of the 32, one 8-byte load (one
// 4-byte load of FP4 codes), A and B permuted alike.
#pragma once

#include <cstdint>

namespace dsv4 {

// Four e2m1 codes (bits 4i..4i+3 hold code i) -> four e4m3 bytes (byte i). Exact: e4m3 holds
// every e2m1 value. The magnitudes come from a byte permute of the eight e4m3 encodings.
__device__ __forceinline__ uint32_t E2m1x4ToE4m3x4(uint32_t codes) {
  constexpr uint32_t kLow = 0x3C383000u;   // e4m3 of 0, 0.5, 1, 1.5 (bytes 0..3)
  constexpr uint32_t kHigh = 0x4C484440u;  // e4m3 of 2, 3, 4, 6 (bytes 4..7)
  const uint32_t magnitude = __byte_perm(kLow, kHigh, codes & 0x7777u);
  const uint32_t sign = ((codes & 0x8u) << 4) | ((codes & 0x80u) << 8) | ((codes & 0x800u) << 12) |
                        ((codes & 0x8000u) << 16);
  return magnitude | sign;
}

// d = A x B over one k32 step, from zero (each step has its own scales, applied by the caller).
__device__ __forceinline__ void MmaE4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
#else
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  __trap();  // built only for architectures with FP8 mma (CMake: 90a, 120a)
#endif
}

}  // namespace dsv4
