// Host-side argument checks shared by the CPU and CUDA handlers: FFI buffers -> TableView,
// with an InvalidArgument error that names the argument for every mismatch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "tables.h"
#include "xla/ffi/api/ffi.h"

namespace dsv4 {

namespace ffi = xla::ffi;

inline std::optional<Elem> ElemOf(ffi::DataType dt) {
  switch (dt) {
    case ffi::DataType::F32: return Elem::kF32;
    case ffi::DataType::BF16: return Elem::kBf16;
    case ffi::DataType::F8E4M3FN: return Elem::kE4m3;
    case ffi::DataType::S8:
    case ffi::DataType::U8: return Elem::kE2m1x2;  // packed e2m1 bytes
    default: return std::nullopt;
  }
}

inline ffi::Error Invalid(const std::string& what) { return ffi::Error::InvalidArgument("dsv4 ffi: " + what); }

inline int64_t Dim(const ffi::AnyBuffer& b, int i) { return b.dimensions()[i]; }

inline ffi::Error CheckRank(const ffi::AnyBuffer& b, size_t rank, const char* name) {
  if (b.dimensions().size() != rank) {
    return Invalid(std::string(name) + " must have rank " + std::to_string(rank) + ", got " +
                   std::to_string(b.dimensions().size()));
  }
  return ffi::Error::Success();
}

// The three parts of a table (values, scales, rope: each [rows, width]; width 0 for an absent part).
inline ffi::Error MakeTable(const ffi::AnyBuffer& values, const ffi::AnyBuffer& scales, const ffi::AnyBuffer& rope,
                            int64_t block, const char* name, TableView* out) {
  const std::string n(name);
  for (const ffi::AnyBuffer* b : {&values, &scales, &rope}) {
    if (b->dimensions().size() != 2) return Invalid(n + " parts must be [rows, width]");
  }
  const int64_t rows = Dim(values, 0);
  if (Dim(scales, 0) != rows || Dim(rope, 0) != rows) return Invalid(n + " parts disagree on the row count");
  const auto vt = ElemOf(values.element_type());
  if (!vt) return Invalid(n + " values must be f32, bf16, float8_e4m3fn or packed e2m1 (int8)");
  if (scales.element_type() != ffi::DataType::U8) return Invalid(n + " scales must be uint8 E8M0 bytes");
  TableView t;
  t.values = values.untyped_data();
  t.values_type = *vt;
  t.values_width = Dim(values, 1) * (*vt == Elem::kE2m1x2 ? 2 : 1);
  t.scales = static_cast<const uint8_t*>(scales.untyped_data());
  t.scales_width = Dim(scales, 1);
  t.block = block;
  if (t.scales_width && (block <= 0 || (t.values_width + block - 1) / block != t.scales_width)) {
    return Invalid(n + " has " + std::to_string(t.scales_width) + " scales per row for " +
                   std::to_string(t.values_width) + " values in blocks of " + std::to_string(block));
  }
  if (!t.scales_width && *vt == Elem::kE2m1x2) return Invalid(n + " packed e2m1 values need scales");
  t.rope_width = Dim(rope, 1);
  if (t.rope_width) {
    const auto rt = ElemOf(rope.element_type());
    if (!rt || (*rt != Elem::kF32 && *rt != Elem::kBf16)) return Invalid(n + " rope must be f32 or bf16");
    t.rope_type = *rt;
  }
  t.rope = rope.untyped_data();
  t.rows = rows;
  *out = t;
  return ffi::Error::Success();
}

}  // namespace dsv4
