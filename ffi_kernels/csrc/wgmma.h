// SM90 warpgroup matrix multiplies (wgmma) for the CUDA kernels: CuTe's SM90 GMMA atoms called
// on plain register arrays, and the shared-memory layout and descriptors they read.
//
// Operands in shared memory use the no-swizzle layout of 8 x 16-byte core matrices: a matrix of
// rows x (chunks * 8) bf16 stores row r's 16-byte chunk c (8 values) at byte
// ((r / 8) * chunks + c) * 128 + (r % 8) * 16 (CoreChunkOffset), so that each 8 x 8 block is 128
// contiguous bytes. Read with the rows as M or N and the chunks along K it is a K-major operand;
// read with the rows along K and the chunks as N it is an MN-major one: the same bytes serve
// S = Q K^T and O = P V in attention. A descriptor gives the byte distance between core
// matrices adjacent along K (the leading byte offset) and along M or N (the stride byte offset).
//
// Accumulator layout of m64nNk16 (f32; PTX ISA): warp w of the warpgroup holds rows 16 w + g
// and 16 w + g + 8 (lane = 4 g + c); acc[4 j + i] is row 16 w + g + 8 (i / 2), column
// 8 j + 2 c + i % 2, the layout of mma.sync m16n8k16's accumulators repeated over 8-column
// blocks j. A register operand (the RS form) has mma.sync m16n8k16's A fragment layout.
//
// Only the SM90a compilation has wgmma (kWgmmaCompiled); elsewhere the atoms trap, so kernels
// select their wgmma paths with `if constexpr (kWgmmaCompiled)`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <utility>

namespace dsv4 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kWgmmaCompiled = true;
#else
constexpr bool kWgmmaCompiled = false;
#endif

// Host: whether the device runs this build's SM90a code, where the kWgmmaCompiled paths have
// their bodies: compute capability 9 (the build's 90a; an SM120 device runs its 120a code).
// Queried once per process, like the multiprocessor count and the shared-memory opt-in: a
// process's GPUs are one kind.
inline bool WgmmaOnDevice() {
  static const bool sm90 = [] {
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return major == 9;
  }();
  return sm90;
}

// Byte offset of row r's 16-byte chunk c in a core-matrix layout of `chunks` chunks a row.
__device__ __forceinline__ int CoreChunkOffset(int r, int c, int chunks) {
  return ((r / 8) * chunks + c) * 128 + (r % 8) * 16;
}

// The row and chunk that copy number e of a [rows][chunks] matrix into the core-matrix layout
// takes (rows a multiple of 8): eight consecutive copies take one chunk of a core matrix's eight
// rows, so that a warp's 32 16-byte stores fill 512 contiguous bytes of shared memory while its
// loads read 64 contiguous bytes of each of eight rows. (Taken row by row, a warp's stores were
// 128 bytes apart: eight-way bank conflicts, 8x the wavefronts of the copy of attention's q.)
__device__ __forceinline__ void CoreLayoutCopyOrder(int e, int chunks, int& row, int& chunk) {
  row = e / (8 * chunks) * 8 + e % 8;
  chunk = e / 8 % chunks;
}

// The descriptor of a no-swizzle operand at `start` (16-byte aligned shared memory): core
// matrices `k_bytes` apart along K and `mn_bytes` apart along M or N.
__device__ __forceinline__ uint64_t WgmmaDescriptor(const void* start, uint32_t k_bytes, uint32_t mn_bytes) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(start));
  return static_cast<uint64_t>((address >> 4) & 0x3fff) | static_cast<uint64_t>((k_bytes >> 4) & 0x3fff) << 16 |
         static_cast<uint64_t>((mn_bytes >> 4) & 0x3fff) << 32;
}

// The descriptor of an operand in the 128-byte-swizzle layout (SWIZZLE_128B): rows of 128 bytes
// (64 bf16), eight of them an atom of 1024 bytes in which row r's 16-byte chunk u lies at
// ((u ^ r) * 16), the XOR taken of address bits (so atoms start at multiples of 1024 bytes).
// The fields keep the PTX names, whose roles depend on the operand's major-ness (CuTe's
// make_gmma_desc): K-major, `stride` is the distance between 8-row groups along M or N and
// `leading` is unused (16); MN-major, `leading` is the distance between 64-element groups
// along M or N and `stride` the distance between 8-row groups along K. A k-step within an atom
// moves the start address by its bytes (WgmmaDescriptorAt), as CuTe's descriptor iterator does.
__device__ __forceinline__ uint64_t WgmmaDescriptorSwizzle128(const void* start, uint32_t leading, uint32_t stride) {
  return WgmmaDescriptor(start, leading, stride) | static_cast<uint64_t>(1) << 62;
}

// `descriptor` moved `bytes` further along its operand (the start address field counts 16-byte
// units and an operand lies within shared memory, so the add never carries out of it).
__device__ __forceinline__ uint64_t WgmmaDescriptorAt(uint64_t descriptor, uint32_t bytes) {
  return descriptor + (bytes >> 4);
}

// v (the same at every lane) broadcast from lane 0, so that the compiler knows it is one value
// across the warp: descriptors computed from it live in uniform registers (from a per-thread
// value, every wgmma waited on four register-to-uniform moves of its descriptors).
__device__ __forceinline__ int WarpUniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }

// This thread's warpgroup (WarpUniform).
__device__ __forceinline__ int WarpgroupIndex() { return WarpUniform(static_cast<int>(threadIdx.x / 128)); }

// Makes this thread's generic-proxy shared-memory writes visible to the wgmma reads (async
// proxy) that follow a barrier.
__device__ __forceinline__ void FenceSharedForAsyncProxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Keeps the compiler from moving reads or writes of these registers across the wgmma issue and
// wait around them (an operand of an asynchronous wgmma must stay where it is until the wait).
template <class T, int N>
__device__ __forceinline__ void FenceOperands(T (&regs)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) cute::warpgroup_fence_operand(regs[e]);
}

namespace detail {
template <class Atom, int N, size_t... I>
__device__ __forceinline__ void FmaSs(uint64_t a, uint64_t b, float (&acc)[N], cute::SM90::GMMA::ScaleOut scale,
                                      std::index_sequence<I...>) {
  Atom::fma(a, b, acc[I]..., scale);
}
template <class Atom, int N, size_t... I>
__device__ __forceinline__ void FmaRs(const uint32_t (&a)[4], uint64_t b, float (&acc)[N],
                                      cute::SM90::GMMA::ScaleOut scale, std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], b, acc[I]..., scale);
}
}  // namespace detail

// acc (= or +=) A B with both operands in shared memory (descriptors); Atom is a CuTe
// SM90::GMMA MMA_64xNx16_F32BF16BF16_SS with N / 2 accumulators.
template <class Atom, int N>
__device__ __forceinline__ void WgmmaSs(uint64_t a, uint64_t b, float (&acc)[N], bool accumulate) {
  detail::FmaSs<Atom>(a, b, acc, accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero,
                      std::make_index_sequence<N>{});
}

// acc (= or +=) A B with A in registers (mma.sync's A fragment layout) and B in shared memory.
template <class Atom, int N>
__device__ __forceinline__ void WgmmaRs(const uint32_t (&a)[4], uint64_t b, float (&acc)[N], bool accumulate) {
  detail::FmaRs<Atom>(a, b, acc, accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero,
                      std::make_index_sequence<N>{});
}

}  // namespace dsv4
