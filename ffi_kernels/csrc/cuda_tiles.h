// Tensor-core building blocks of the CUDA kernels: CuTe's SM75/SM80 atoms for ldmatrix, mma.sync
// (bf16 in, f32 accumulate) and cp.async (so the same code serves SM90 and SM120), and the
// 8-entry loads that turn a stored table row into bf16 tiles in shared memory (the e4m3
// conversion instruction needs SM89+: the library builds for 90a and 120a).
//
// Fragment layout of mma m16n8k16 (PTX ISA): lane = 4 g + c holds rows g and g + 8 of the 16x8
// accumulator, columns 2c and 2c + 1 (d[0], d[1] row g; d[2], d[3] row g + 8).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "tables.h"

namespace dsv4 {

// Four 8x8 b16 matrices from shared memory (lane l gives the address of row l % 8 of matrix l / 8).
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* p) {
  cute::SM75_U32x4_LDSM_N::copy(*static_cast<const cute::uint128_t*>(p), r[0], r[1], r[2], r[3]);
}

// As LdMatrixX4, each matrix transposed.
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* p) {
  cute::SM75_U16x8_LDSM_T::copy(*static_cast<const cute::uint128_t*>(p), r[0], r[1], r[2], r[3]);
}

// Asynchronous 16- and 8-byte copies global -> shared (completed by CopyAsyncCommitAndWaitAll).
__device__ __forceinline__ void CopyAsync16(void* dst_shared, const void* src_global) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>::copy(*static_cast<const cute::uint128_t*>(src_global),
                                                         *static_cast<cute::uint128_t*>(dst_shared));
}

__device__ __forceinline__ void CopyAsync8(void* dst_shared, const void* src_global) {
  cute::SM80_CP_ASYNC_CACHEALWAYS<uint64_t>::copy(*static_cast<const uint64_t*>(src_global),
                                                  *static_cast<uint64_t*>(dst_shared));
}

// A 16-byte cp.async to the shared-memory address `dst_shared` (a 32-bit shared-window address,
// for callers that compute swizzled addresses), or 16 zero bytes when !valid (src then unread).
__device__ __forceinline__ void CopyAsync16OrZeros(uint32_t dst_shared, const void* src_global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_shared), "l"(src_global),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Waits for every asynchronous copy this thread has issued.
__device__ __forceinline__ void CopyAsyncCommitAndWaitAll() {
  cute::cp_async_fence();
  cute::cp_async_wait<0>();
}

// d += a b with a 16x16 bf16 (row major), b 16x8 bf16 (column major), d 16x8 f32.
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2],
                                           d[3]);
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Two e4m3 (the low byte first) -> two floats, exactly (every e4m3 is an f16): the SM89+
// conversion instruction, then a widening.
__device__ __forceinline__ float2 E4m3x2ToFloat2(uint32_t two) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(static_cast<uint16_t>(two)));
  return __half22float2(*reinterpret_cast<const __half2*>(&h2));
}

// Entries k0 .. k0+7 of a row (k0 a multiple of 8; the 8 lie in one part and one scale block),
// loaded raw (so that a thread's loads for a whole tile are in flight together) and then
// decoded to eight bf16 in one 16-byte word.
struct RawEight {
  uint4 bits;     // 8 bf16 (rope, bf16 values), 8 e4m3 in .x/.y or 8 e2m1 nibbles in .x
  uint8_t scale;  // E8M0 byte (127 = 1 when the part is unscaled)
};

// Entries k0 .. k0+7, raw, of one row of t whose parts start at `values`, `rope` and `scales`:
// the row in the table (LoadEight) or a staged copy of it in shared memory.
__device__ __forceinline__ RawEight RawEightOfRow(const TableView& t, const unsigned char* values,
                                                  const unsigned char* rope, const uint8_t* scales, int64_t k0) {
  if (k0 >= t.values_width) return {*reinterpret_cast<const uint4*>(rope + 2 * (k0 - t.values_width)), 127};
  // 32-bit division: a 64-bit one is a long routine on the GPU.
  const uint8_t scale = t.scales_width ? scales[static_cast<int>(k0) / static_cast<int>(t.block)] : uint8_t{127};
  if (t.values_type == Elem::kE4m3) {
    const uint2 raw = *reinterpret_cast<const uint2*>(values + k0);
    return {make_uint4(raw.x, raw.y, 0, 0), scale};
  }
  if (t.values_type == Elem::kE2m1x2) {  // two per byte, low nibble first
    return {make_uint4(*reinterpret_cast<const uint32_t*>(values + k0 / 2), 0, 0, 0), scale};
  }
  return {*reinterpret_cast<const uint4*>(values + 2 * k0), scale};
}

__device__ __forceinline__ RawEight LoadEight(const TableView& t, int64_t row, int64_t k0) {
  return RawEightOfRow(t, static_cast<const unsigned char*>(t.values) + row * t.value_bytes(),
                       static_cast<const unsigned char*>(t.rope) + row * 2 * t.rope_width,
                       t.scales + row * t.scales_width, k0);
}

// Eight e4m3 (the low byte first) times a power-of-two scale -> eight bf16, exactly.
__device__ __forceinline__ uint4 E4m3EightToBf16(uint2 bits, float scale) {
  const float2 a = E4m3x2ToFloat2(bits.x), b = E4m3x2ToFloat2(bits.x >> 16);
  const float2 c = E4m3x2ToFloat2(bits.y), d = E4m3x2ToFloat2(bits.y >> 16);
  return make_uint4(PackBf16(a.x * scale, a.y * scale), PackBf16(b.x * scale, b.y * scale),
                    PackBf16(c.x * scale, c.y * scale), PackBf16(d.x * scale, d.y * scale));
}

// d = a * b, two bf16 at once (an fma with -0 added, so that every product keeps its sign and
// is rounded once; subnormal inputs and results are kept: bf16 arithmetic has no flush mode).
__device__ __forceinline__ uint32_t Bf16x2Mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// The bf16x2 multipliers that turn an e2m1 code placed in a bf16's bits (E2m1EightToBf16: the
// code's value times 2^-126) into value x 2^(s - 127), for E8M0 byte s: 2^(s - 1) in one
// multiply where that is a bf16 (s <= 128), else 2^126 and then the scale (NaN for s = 255).
struct E2m1Scale {
  uint32_t first, second;  // second = 0: one multiply
};

__device__ __forceinline__ E2m1Scale E2m1ScaleOf(uint8_t s) {
  if (s <= 128) return {((s + 126u) << 7) * 0x00010001u, 0u};
  return {(253u << 7) * 0x00010001u, (s == 255 ? 0x7fc0u : static_cast<uint32_t>(s) << 7) * 0x00010001u};
}

// Eight e2m1 codes (nibbles, the lowest first) times their power-of-two scale -> eight bf16,
// exactly (a value of two significant bits scaled by a power of two). A nibble's sign goes to a
// bf16's sign bit and its e1 e0 m bits to bits 8..6 (the exponent's low bits and the top
// mantissa bit), which makes the code's value times 2^-126 (a subnormal for e1 e0 = 0); the
// scale's multiplies then give the product. Integer ops on two codes at a time, no table.
__device__ __forceinline__ uint4 E2m1EightToBf16(uint32_t codes, const E2m1Scale& scale) {
  // pairs[i]: nibble i in the low half, nibble i + 4 in the high half (a shift by 12 - 4i puts
  // them at bits 12..15 and 28..31, whence the masks move them into place).
  uint32_t pairs[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t x = codes << (12 - 4 * i);
    pairs[i] = (x & 0x80008000u) | ((x & 0x70007000u) >> 6);
  }
  // In order: codes 0 1 (the low halves of pairs 0 and 1), 2 3, 4 5 (their high halves), 6 7.
  uint32_t out[4] = {__byte_perm(pairs[0], pairs[1], 0x5410), __byte_perm(pairs[2], pairs[3], 0x5410),
                     __byte_perm(pairs[0], pairs[1], 0x7632), __byte_perm(pairs[2], pairs[3], 0x7632)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[i] = Bf16x2Mul(out[i], scale.first);
    if (scale.second) out[i] = Bf16x2Mul(out[i], scale.second);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

__device__ __forceinline__ uint4 DecodeEight(const TableView& t, int64_t k0, const RawEight& r) {
  const Elem type = k0 < t.values_width ? t.values_type : Elem::kBf16;
  if (type == Elem::kBf16 && r.scale == 127) return r.bits;  // bf16 as stored
  if (type == Elem::kE2m1x2) return E2m1EightToBf16(r.bits.x, E2m1ScaleOf(r.scale));
  const float scale = E8m0ToFloat(r.scale);
  if (type == Elem::kE4m3) return E4m3EightToBf16(make_uint2(r.bits.x, r.bits.y), scale);
  const uint32_t words[4] = {r.bits.x, r.bits.y, r.bits.z, r.bits.w};
  float v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = Bf16ToFloat(static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2))));
  return make_uint4(PackBf16(v[0] * scale, v[1] * scale), PackBf16(v[2] * scale, v[3] * scale),
                    PackBf16(v[4] * scale, v[5] * scale), PackBf16(v[6] * scale, v[7] * scale));
}

}  // namespace dsv4
