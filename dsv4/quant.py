"""Numeric formats of DeepSeek-V4-Flash: FP8/FP4 weight (de)quantisation and QAT fake quant.

Spec sections 6.1-6.4 (weights) and 5.5/5.6 (KV and indexer fake quantisation).

Lifecycle: the ``dequant_*`` functions run at checkpoint load (or inside a jitted layer when
weights stay packed); the ``quant_*`` / ``pack_fp4`` functions are their inverses, used to write
quantised test checkpoints; the ``fake_quant_*`` functions run inside the forward pass wherever
REF stores values that carry only FP8/FP4 information (KV cache, indexer query and keys), and
``fake_act_quant`` (with ``act_quant`` its storage form) before every FP8/FP4-weight GEMM; the
``encode_*`` / ``decode_*`` codecs store that same information narrow in a decode-state cache
(written once per token, read every step) and decode to exactly the fake-quant result, so a
cache-backed decode matches the teacher-forced forward bit for bit.

Everything here is a pure function of its arguments and is wrapped in ``jax.jit`` (dtype, block
and rope_dim arguments static), so eager callers such as checkpoint loaders and tests compile one
program per shape instead of dispatching op by op. The exceptions are ``hadamard_matrix`` (a
host-built constant) and ``pack_fp4``, which checks concrete values on the host (it must be able
to raise on a non-representable input). Nothing happens at import beyond creating the wrappers.

Conventions shared by every scale rule (spec 6.2, "ue8m0"):
  scale = amax / qmax rounded UP to a power of two, so that |x / scale| <= qmax always holds and
  the quantised value never saturates. amax is floored at ``_AMAX_FLOOR`` first, so an all-zero
  block gets a finite, normal scale instead of 0 (E8M0 cannot encode 0) or log2(0) = -inf.
  Because every scale is a power of two, ``x / scale`` and ``q * scale`` are exact in f32, and
  the only rounding is the cast to the narrow element type.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

FP8_BLOCK = 128  # weight scale block (rows and columns), spec 6.1
FP4_GROUP = 32  # FP4 expert scale group along K, spec 6.4
KV_FP8_BLOCK = 64  # FP8 scale block of the KV cache's non-rope dims, spec 6.3
INDEXER_FP4_BLOCK = 32  # FP4 scale block of indexer queries and keys, spec 5.5/5.6
ACT_BLOCK = 128  # activation scale block along the reduced dim before FP8/FP4 GEMMs, spec 6.2
E8M0_BIAS = 127  # E8M0 byte b encodes 2**(b - 127); b = 255 is NaN

# e2m1 code -> value; bit 3 is the sign, so code 8 is -0 (kept: ml_dtypes decodes it as -0.0).
FP4_CODE_TABLE = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP4_MAX = 6.0  # largest e2m1
# Same floor as tokamax's quantize_fp8_ue8m0 and DeepSeek's act_quant kernels (spec 6.2). With
# it the smallest scale is 2**-22 (fp8) / 2**-15 (fp4): normal f32, never flushed to zero.
_AMAX_FLOOR = 1e-4
_E8M0_NAN = 255


@jax.jit
def e8m0_to_float(scale_u8: ArrayLike) -> jax.Array:
    """Decode E8M0 scale bytes (read from safetensors as uint8) to float32 2**(b - 127).

    Built by placing the byte in the f32 exponent field rather than with exp2/ldexp so the
    result is exact for every byte, including byte 0 (2**-127, an f32 subnormal, which is
    written as its bit pattern because arithmetic on CPU flushes it to zero). Byte 255 -> NaN.
    """
    b = jnp.asarray(scale_u8)
    if b.dtype != jnp.uint8:
        raise ValueError(f"E8M0 scales must be uint8 raw bytes, got dtype {b.dtype}")
    b32 = b.astype(jnp.uint32)
    bits = jnp.where(b32 == 0, jnp.uint32(0x00400000), b32 << 23)
    out = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(b32 == _E8M0_NAN, jnp.float32(jnp.nan), out)


@jax.jit
def float_to_e8m0(x: ArrayLike) -> jax.Array:
    """Encode positive floats as E8M0 bytes, rounding UP to a power of two (exact for powers of two).

    Works on the f32 bit pattern (exponent field, plus one when any mantissa bit is set) so that
    it is exact with no log2 rounding and no dependence on denormal flushing. Zero and values
    below 2**-127 round up to byte 0; values above 2**127, negatives, inf and NaN -> 255 (NaN),
    since E8M0 has no sign, zero or infinity.
    """
    xf = jnp.asarray(x, jnp.float32)
    bits = jax.lax.bitcast_convert_type(xf, jnp.uint32)
    exp = ((bits >> 23) & 0xFF).astype(jnp.int32)
    mant = bits & jnp.uint32(0x7FFFFF)
    sign = bits >> 31
    normal_byte = exp + (mant != 0).astype(jnp.int32)
    # Subnormal f32: x = mant * 2**-149; 2**-127 is mant 0x400000; anything above rounds to 2**-126.
    sub_byte = (mant > jnp.uint32(0x400000)).astype(jnp.int32)
    byte = jnp.where(exp == 0, sub_byte, normal_byte)
    bad = (sign != 0) & (bits != jnp.uint32(0x80000000))  # -0.0 is treated like +0.0
    bad = bad | (exp == 0xFF) | (byte > 254)
    return jnp.where(bad, _E8M0_NAN, byte).astype(jnp.uint8)


def _round_up_pow2(y: jax.Array) -> jax.Array:
    """Smallest power of two >= y for positive normal f32 y (exact; no log2)."""
    return e8m0_to_float(float_to_e8m0(y))


def _block_scale(amax: jax.Array, qmax: float) -> jax.Array:
    """Power-of-two scale for a block: amax (floored) / qmax rounded up (spec 6.2 rule)."""
    return _round_up_pow2(jnp.maximum(amax, _AMAX_FLOOR) / qmax)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """Zero-pad ``axis`` up to a multiple; zeros never raise a block's amax."""
    n = x.shape[axis]
    pad = _ceil_div(n, multiple) * multiple - n
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _tile_2d(x: jax.Array, block: int) -> jax.Array:
    """[..., O, I] -> [..., O/b, b, I/b, b] after zero-padding O and I to multiples of b."""
    x = _pad_axis(_pad_axis(x, -2, block), -1, block)
    *lead, o, i = x.shape
    return x.reshape(*lead, o // block, block, i // block, block)


def _group_last(x: jax.Array, block: int) -> jax.Array:
    """[..., D] -> [..., D/b, b] after zero-padding D to a multiple of b."""
    x = _pad_axis(x, -1, block)
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _ungroup(g: jax.Array) -> jax.Array:
    """Inverse of ``_group_last`` (padding kept): [..., D/b, b] -> [..., D]. The width is spelled
    out, as -1 cannot be inferred where a leading dim is 0 (a layer with no entries yet)."""
    return g.reshape(*g.shape[:-2], g.shape[-2] * g.shape[-1])


def _quantize_blocks(x: jax.Array, block: int, qmax: float, round_fn) -> tuple[jax.Array, jax.Array]:
    """Blockwise quantisation of the last axis shared by every activation-side quantiser.

    x [..., D] (any float dtype, read as f32) -> (grid values f32 [..., ceil(D/b), b], scale f32
    [..., ceil(D/b), 1]) with scale = max(amax, 1e-4) / qmax rounded up to a power of two and
    values = round_fn(x / scale), exact narrow-format numbers held in f32. A ragged last block is
    zero-padded (zeros never raise its amax); the padding's values are 0 and are sliced off by
    the callers.
    """
    g = _group_last(jnp.asarray(x).astype(jnp.float32), block)
    scale = _block_scale(jnp.max(jnp.abs(g), axis=-1, keepdims=True), qmax)
    return round_fn(g / scale), scale


def _dequantize_blocks(vals: jax.Array, scale: jax.Array, d: int, out_dtype: DTypeLike) -> jax.Array:
    """Inverse of ``_quantize_blocks``: f32 values [..., nb, b] * scale [..., nb, 1] -> [..., d].

    The product is exact (power-of-two scale, no under/overflow for the floored scales), so the
    only rounding is the final cast to out_dtype.
    """
    out = vals.astype(jnp.float32) * scale
    return _ungroup(out)[..., :d].astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def dequant_fp8_block(w_fp8: ArrayLike, scale_u8: ArrayLike, out_dtype: DTypeLike) -> jax.Array:
    """W[..., o, i] = f32(w[..., o, i]) * 2**(scale[..., o//128, i//128] - 127), cast to out_dtype.

    Leading batch dims (stacked experts [E, O, I] with scales [E, ceil(O/128), ceil(I/128)]) are
    allowed. Ragged edges are handled by padding to whole blocks and slicing back, so the scale is
    broadcast per block instead of materialised at full weight size.
    """
    w = jnp.asarray(w_fp8)
    s = jnp.asarray(scale_u8)
    if w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"FP8 weights must be float8_e4m3fn, got dtype {w.dtype}")
    if w.ndim < 2:
        raise ValueError(f"FP8 weights need at least 2 dims [..., out, in], got shape {w.shape}")
    *lead, o, i = w.shape
    want = (*lead, _ceil_div(o, FP8_BLOCK), _ceil_div(i, FP8_BLOCK))
    if s.shape != want:
        raise ValueError(f"FP8 scale shape {s.shape} does not match weight {w.shape}: want {want}")
    tiles = _tile_2d(w.astype(jnp.float32), FP8_BLOCK)
    out = tiles * e8m0_to_float(s)[..., :, None, :, None]
    out = out.reshape(*lead, want[-2] * FP8_BLOCK, want[-1] * FP8_BLOCK)[..., :o, :i]
    return out.astype(out_dtype)


@jax.jit
def quant_fp8_block(w_f32: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``dequant_fp8_block`` for writing test checkpoints: (float8_e4m3fn w, uint8 scale).

    Per 128x128 block: scale = max(amax, 1e-4) / 448 rounded up to a power of two, value =
    e4m3(w / scale) with round-to-nearest-even. Leading batch dims allowed.
    """
    w = jnp.asarray(w_f32, jnp.float32)
    if w.ndim < 2:
        raise ValueError(f"weights need at least 2 dims [..., out, in], got shape {w.shape}")
    *lead, o, i = w.shape
    tiles = _tile_2d(w, FP8_BLOCK)
    scale = _block_scale(jnp.max(jnp.abs(tiles), axis=(-3, -1)), _FP8_MAX)
    q = (tiles / scale[..., :, None, :, None]).astype(jnp.float8_e4m3fn)
    q = q.reshape(*lead, tiles.shape[-4] * FP8_BLOCK, tiles.shape[-2] * FP8_BLOCK)[..., :o, :i]
    return q, float_to_e8m0(scale)


@jax.jit
def unpack_fp4(packed_i8: ArrayLike) -> jax.Array:
    """Decode packed e2m1 bytes [..., n] (int8 storage, spec 6.4) to float32 values [..., 2n].

    The LOW nibble is the even (first) element and the high nibble the odd one; swapping them
    would still give plausible-looking weights, which is why the order is tested with a hand-built
    byte. Decoding is a 16-entry table lookup (FP4_CODE_TABLE).
    """
    p = jnp.asarray(packed_i8)
    if p.dtype not in (jnp.int8, jnp.uint8):
        raise ValueError(f"packed FP4 must be int8 (or uint8) bytes, got dtype {p.dtype}")
    b = jax.lax.bitcast_convert_type(p, jnp.uint8) if p.dtype == jnp.int8 else p
    codes = jnp.stack([b & 0x0F, b >> 4], axis=-1).astype(jnp.int32)
    vals = jnp.take(jnp.asarray(FP4_CODE_TABLE), codes)
    return vals.reshape(*p.shape[:-1], p.shape[-1] * 2)


def _fp4_codes(v: jax.Array) -> jax.Array:
    """e2m1 code (0..15) of f32 values already on the e2m1 grid; sign bit kept (so -0 -> 8)."""
    mag = jnp.abs(v)
    idx = jnp.sum(mag[..., None] >= jnp.asarray(FP4_CODE_TABLE[1:8]), axis=-1)
    return (idx + 8 * jnp.signbit(v).astype(idx.dtype)).astype(jnp.uint8)


def _pack_codes(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., 2n] -> int8 bytes [..., n], low nibble = even element."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return jax.lax.bitcast_convert_type(packed.astype(jnp.uint8), jnp.int8)


def pack_fp4(values: ArrayLike) -> jax.Array:
    """Pack values that are already exact e2m1 numbers [..., 2n] into int8 bytes [..., n].

    Host-side (not jittable): it inspects concrete values and raises ValueError for anything off
    the e2m1 grid (including NaN/inf) or an odd last dim, because silently rounding here would
    hide a bug in whoever produced the values. Use ``quant_fp4`` to quantise arbitrary floats.
    """
    v = np.asarray(values, dtype=np.float32)
    if v.ndim < 1 or v.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim to pair nibbles, got shape {v.shape}")
    on_grid = np.isin(np.abs(v), FP4_CODE_TABLE[:8])
    if not on_grid.all():
        bad = v[~on_grid].ravel()[:5]
        raise ValueError(f"pack_fp4: values not exactly representable in e2m1, e.g. {bad.tolist()}")
    return _pack_codes(_fp4_codes(jnp.asarray(v)))


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def dequant_fp4(packed_i8: ArrayLike, scale_u8: ArrayLike, out_dtype: DTypeLike) -> jax.Array:
    """W[..., o, k] = code(o, k) * 2**(scale[..., o, k // 32] - 127), cast to out_dtype (spec 6.4).

    packed [..., O, K/2] int8, scale [..., O, ceil(K/32)] uint8; leading batch dims (experts)
    allowed.
    """
    vals = unpack_fp4(packed_i8)
    s = jnp.asarray(scale_u8)
    *lead, o, k = vals.shape
    want = (*lead, o, _ceil_div(k, FP4_GROUP))
    if s.shape != want:
        raise ValueError(f"FP4 scale shape {s.shape} does not match unpacked weight {vals.shape}: want {want}")
    return _dequantize_blocks(_group_last(vals, FP4_GROUP), e8m0_to_float(s)[..., None], k, out_dtype)


def _round_e2m1(y: jax.Array) -> jax.Array:
    """Round f32 to the nearest e2m1 value, ties to even code, saturating at +-6.

    Done arithmetically rather than with astype(float4_e2m1fn) so it does not depend on every
    XLA backend supporting 4-bit converts; the test checks it against ml_dtypes. On each binade
    the grid is uniform (step 0.5 below 2, 1 on [2, 4), 2 on [4, 6]) and the parity of k in
    value = k * step equals the parity of the code, so round-half-even of y / step is exactly
    ties-to-even-code. Sign is reapplied with copysign so -0.1 -> -0, as ml_dtypes does.
    """
    mag = jnp.minimum(jnp.abs(y), _FP4_MAX)
    step = jnp.where(mag < 2.0, 0.5, jnp.where(mag < 4.0, 1.0, 2.0))
    return jnp.copysign(jnp.round(mag / step) * step, y)


def _round_e4m3(y: jax.Array) -> jax.Array:
    """Round f32 to the nearest float8_e4m3fn value (ties to even), saturating at +-448.

    Arithmetic, not astype(float8_e4m3fn).astype(float32): XLA on GPU removes such a convert
    round trip (excess-precision simplification), which silently skipped the fake quant on the
    H200. e4m3fn has 3 mantissa bits, so on the binade [2^(e-1), 2^e) the grid step is
    2^(e-4); subnormals (below 2^-6) share the step 2^-9. round-half-even of y / step is then
    exactly ties-to-even; the test checks it against ml_dtypes.
    """
    mag = jnp.minimum(jnp.abs(y), _FP8_MAX)
    _, e = jnp.frexp(mag)
    step = jnp.ldexp(jnp.ones_like(mag), jnp.maximum(e - 4, -9))
    return jnp.copysign(jnp.round(mag / step) * step, y)


@jax.jit
def quant_fp4(w_f32: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``dequant_fp4`` for writing test checkpoints: (int8 packed [..., K/2], uint8 scale).

    Per row and 32 K elements: scale = max(amax, 1e-4) / 6 rounded up to a power of two, value =
    nearest e2m1 of w / scale (ties to even). K must be even (two codes per byte).
    """
    w = jnp.asarray(w_f32, jnp.float32)
    if w.ndim < 1 or w.shape[-1] % 2:
        raise ValueError(f"quant_fp4 needs an even last dim to pack nibbles, got shape {w.shape}")
    vals, scale = _quantize_blocks(w, FP4_GROUP, _FP4_MAX, _round_e2m1)
    vals = _ungroup(vals)[..., : w.shape[-1]]
    return _pack_codes(_fp4_codes(vals)), float_to_e8m0(scale[..., 0])


def _fake_quant(x: jax.Array, block: int, qmax: float, round_fn) -> jax.Array:
    """Shared body of the fake quantisers: quantise per block, dequantise, recast to x.dtype.

    The storage codecs (``encode_*`` / ``decode_*``) split this same pair of calls around the
    narrow storage types, which is what makes their round trip bit-exact with it.
    """
    vals, scale = _quantize_blocks(x, block, qmax, round_fn)
    return _dequantize_blocks(vals, scale, x.shape[-1], x.dtype)


@functools.partial(jax.jit, static_argnames=("block",))
def fake_quant_fp8(x: ArrayLike, block: int = 64) -> jax.Array:
    """QAT simulation of REF's FP8 KV (spec 6.3): quantise to e4m3 and straight back, in f32.

    Per ``block`` contiguous elements of the last axis: scale = max(amax, 1e-4) / 448 rounded up
    to a power of two; returns x.dtype(f32(e4m3(x / scale)) * scale). A ragged last block is
    zero-padded (zeros do not change its amax) and sliced off. The result is idempotent and, for
    bf16 x, exactly representable in bf16 (3 mantissa bits times a power of two).
    """
    return _fake_quant(jnp.asarray(x), block, _FP8_MAX, _round_e4m3)


@jax.jit
def act_quant(x: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """REF's ``act_quant`` (spec 6.2), the input of every FP8/FP4-weight GEMM.

    x [..., K] -> (values float8_e4m3fn [..., K], scales f32 [..., ceil(K/128)]): per 128
    contiguous elements of the reduced axis, scale = max(amax, 1e-4) / 448 rounded up to a power
    of two and value = e4m3(x / scale), ties to even. The GEMM multiplies the values and scales
    each block's partial product by its activation and weight scales.
    """
    x = jnp.asarray(x)
    vals, scale = _quantize_blocks(x, ACT_BLOCK, _FP8_MAX, _round_e4m3)
    vals = _ungroup(vals)[..., : x.shape[-1]]
    return vals.astype(jnp.float8_e4m3fn), scale[..., 0]


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def dequant_act(values_f8: ArrayLike, scale_f32: ArrayLike, out_dtype: DTypeLike) -> jax.Array:
    """Inverse of ``act_quant``: values [..., K] times their block's scale, in out_dtype (exact)."""
    v = jnp.asarray(values_f8).astype(jnp.float32)
    g = _group_last(v, ACT_BLOCK)
    return _dequantize_blocks(g, jnp.asarray(scale_f32, jnp.float32)[..., None], v.shape[-1], out_dtype)


@jax.jit
def fake_act_quant(x: ArrayLike) -> jax.Array:
    """``act_quant`` and straight back, in x.dtype: what REF's FP8 GEMMs see of x.

    Exact in bf16 and f32 (an e4m3 value times a power of two), so a matmul of this with the
    dequantised weight, accumulated in f32, is REF's FP8 GEMM up to the order of the sum.
    """
    return fake_quant_fp8(x, block=ACT_BLOCK)


def _kv_nope_width(d: int, rope_dim: int) -> int:
    if not 0 <= rope_dim <= d:
        raise ValueError(f"rope_dim {rope_dim} must lie in [0, {d}] for KV width {d}")
    return d - rope_dim


@functools.partial(jax.jit, static_argnames=("rope_dim",))
def fake_quant_kv(kv: ArrayLike, rope_dim: int) -> jax.Array:
    """Fake-quantise a KV entry: fp8 (block 64) on kv[..., :D - rope_dim], rope dims untouched.

    FLASH entries are 512 = 448 non-rope (7 blocks of 64) + 64 rope (spec 6.3, 5.5). Tiny test
    configs may have a non-rope width that is not a multiple of 64; its last block is then
    shorter (zero-padded for the amax), which reduces to REF's rule whenever the width divides.
    """
    kv = jnp.asarray(kv)
    nope = _kv_nope_width(kv.shape[-1], rope_dim)
    if nope == 0:
        return kv
    return jnp.concatenate([fake_quant_fp8(kv[..., :nope], block=KV_FP8_BLOCK), kv[..., nope:]], axis=-1)


def hadamard_matrix(n: int) -> jax.Array:
    """Unnormalised Sylvester Hadamard matrix [n, n] of +-1 (float32): H_2n = [[H, H], [H, -H]].

    This is the ordering fast_hadamard_transform (used by REF's rotate_activation) applies; a
    different Hadamard ordering would be orthonormal too but change what fp4 rounding loses.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return jnp.asarray(h)


@jax.jit
def hadamard_rotate(x: ArrayLike) -> jax.Array:
    """Orthonormal Hadamard rotation of the last axis, x @ H / sqrt(n), returned in x.dtype.

    Computed in f32 with HIGHEST precision (GPU f32 matmuls otherwise may use TF32) and rounded
    once to x.dtype, as REF's bf16-in/bf16-out transform does before its fp4 quantisation.
    """
    x = jnp.asarray(x)
    n = x.shape[-1]
    h = hadamard_matrix(n)
    y = jnp.matmul(x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST) * (1.0 / math.sqrt(n))
    if x.dtype != jnp.float32:
        # An explicit rounding: XLA on GPU may drop a bare f32 -> bf16 -> f32 convert pair inside a
        # fusion (excess precision), which would quantise the unrounded rotation there and the
        # rounded one wherever the rotation is materialised (the FFI kv_write's input).
        info = jnp.finfo(x.dtype)
        y = jax.lax.reduce_precision(y, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return y.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("block",))
def fake_quant_fp4(x: ArrayLike, block: int = 32) -> jax.Array:
    """QAT simulation of FP4 (spec 6.3, indexer q/k): e2m1 with a power-of-two scale per block.

    Per ``block`` elements of the last axis: scale = max(amax, 1e-4) / 6 rounded up to a power of
    two (the amax/6 rule is inferred in the spec), round to nearest e2m1, dequantise in f32 and
    cast back to x.dtype. A ragged last block is zero-padded for the amax.
    """
    return _fake_quant(jnp.asarray(x), block, _FP4_MAX, _round_e2m1)


@jax.jit
def fake_quant_indexer(x: ArrayLike) -> jax.Array:
    """Indexer QAT (spec 5.5/5.6): orthonormal Hadamard on the last axis, then fp4 per 32."""
    return fake_quant_fp4(hadamard_rotate(x), block=INDEXER_FP4_BLOCK)


# ---------------------------------------------------------------- decode-state storage codecs
#
# The fake quantisers above return values in the activation dtype that carry only FP8/FP4
# information; the codecs below store that same information in its narrow form (e4m3 or packed
# e2m1 elements plus one E8M0 byte per block) so a decode-state cache holds ~1 byte per element
# instead of 2. Each encoder runs ``_quantize_blocks`` exactly as the matching fake quantiser
# does and each decoder runs its ``_dequantize_blocks``, with only exact conversions between
# (grid values -> e4m3 / e2m1 codes, power-of-two scales -> E8M0 bytes); hence
# decode(encode(x)) == fake_quant(x) bit for bit, signed zeros included. The casts to float8
# only ever see values already on the grid (see ``_round_e4m3`` for why rounding never relies
# on a float8 round trip).


@functools.partial(jax.jit, static_argnames=("rope_dim",))
def encode_kv_fp8(kv: ArrayLike, rope_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Store a KV entry [..., D] as REF's FP8 cache does: (nope_f8, scale_u8, rope).

    nope_f8 float8_e4m3fn [..., D - rope_dim]; scale_u8 uint8 E8M0 [..., ceil((D - rope_dim) / 64)]
    (a ragged last block is scaled by its own amax, as in ``fake_quant_kv``); rope = the last
    rope_dim dims unchanged, in kv's dtype. 0 <= rope_dim <= D, as for ``fake_quant_kv``.
    ``decode_kv_fp8(*encode_kv_fp8(kv, R), kv.dtype)`` equals ``fake_quant_kv(kv, R)`` bit-exactly.
    """
    kv = jnp.asarray(kv)
    nope = _kv_nope_width(kv.shape[-1], rope_dim)
    vals, scale = _quantize_blocks(kv[..., :nope], KV_FP8_BLOCK, _FP8_MAX, _round_e4m3)
    nope_f8 = _ungroup(vals)[..., :nope].astype(jnp.float8_e4m3fn)
    return nope_f8, float_to_e8m0(scale[..., 0]), kv[..., nope:]


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def decode_kv_fp8(nope_f8: ArrayLike, scale_u8: ArrayLike, rope: ArrayLike, out_dtype: DTypeLike) -> jax.Array:
    """Inverse of ``encode_kv_fp8``: [..., D - R] e4m3, [..., ceil((D - R) / 64)] E8M0, [..., R] -> [..., D].

    Non-rope dims are e4m3 * 2**(scale - 127) per 64-block, rope dims are passed through; both
    are cast to out_dtype and concatenated in that order.
    """
    q = jnp.asarray(nope_f8)
    s = jnp.asarray(scale_u8)
    rope = jnp.asarray(rope)
    if q.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"KV non-rope values must be float8_e4m3fn, got dtype {q.dtype}")
    *lead, nope = q.shape
    want = (*lead, _ceil_div(nope, KV_FP8_BLOCK))
    if s.shape != want:
        raise ValueError(f"KV scale shape {s.shape} does not match values {q.shape}: want {want}")
    if rope.shape[:-1] != tuple(lead):
        raise ValueError(f"KV rope shape {rope.shape} does not share leading dims with values {q.shape}")
    vals = _group_last(q.astype(jnp.float32), KV_FP8_BLOCK)
    out = _dequantize_blocks(vals, e8m0_to_float(s)[..., None], nope, out_dtype)
    return jnp.concatenate([out, rope.astype(out_dtype)], axis=-1)


def _indexer_width(j: int) -> int:
    if j % INDEXER_FP4_BLOCK:
        raise ValueError(f"indexer width {j} must be a multiple of {INDEXER_FP4_BLOCK} for the FP4 codecs")
    return j


def _quantize_indexer(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``fake_quant_indexer`` up to the dequantise: e2m1 grid values f32 [..., J] and scale bytes."""
    _indexer_width(x.shape[-1])
    vals, scale = _quantize_blocks(hadamard_rotate(x), INDEXER_FP4_BLOCK, _FP4_MAX, _round_e2m1)
    return _ungroup(vals), float_to_e8m0(scale[..., 0])


def _dequantize_indexer(vals: jax.Array, scale_u8: jax.Array, out_dtype: DTypeLike) -> jax.Array:
    """f32 e2m1 grid values [..., J] and E8M0 bytes [..., J/32] -> rotated indexer values [..., J]."""
    *lead, j = vals.shape
    _indexer_width(j)
    s = jnp.asarray(scale_u8)
    want = (*lead, j // INDEXER_FP4_BLOCK)
    if s.shape != want:
        raise ValueError(f"indexer scale shape {s.shape} does not match values {vals.shape}: want {want}")
    return _dequantize_blocks(_group_last(vals, INDEXER_FP4_BLOCK), e8m0_to_float(s)[..., None], j, out_dtype)


@jax.jit
def encode_indexer_fp4(x: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Store indexer keys [..., J] as packed e2m1: (int8 [..., J/2], uint8 E8M0 [..., J/32]).

    Hadamard-rotates, then quantises per 32 exactly as ``fake_quant_indexer``; nibble order as
    ``pack_fp4`` (low nibble = even element), and -0 keeps its code (8). J % 32 == 0 is required
    (ValueError otherwise), and the rotation needs J a power of two.
    """
    vals, scale = _quantize_indexer(jnp.asarray(x))
    return _pack_codes(_fp4_codes(vals)), scale


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def decode_indexer_fp4(packed_i8: ArrayLike, scale_u8: ArrayLike, out_dtype: DTypeLike) -> jax.Array:
    """Inverse of ``encode_indexer_fp4`` -> [..., J] in out_dtype, still in the rotated basis.

    With out_dtype = x.dtype it equals ``fake_quant_indexer(x)`` bit-exactly.
    """
    return _dequantize_indexer(unpack_fp4(packed_i8), scale_u8, out_dtype)


@jax.jit
def encode_indexer_fp8(x: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """As ``encode_indexer_fp4`` but one float8_e4m3fn per element: (e4m3 [..., J], uint8 [..., J/32]).

    The elements are the same e2m1 grid values (every e2m1 number is exact in e4m3), so this is
    the same information in a layout that FP8 matmul kernels can read without unpacking nibbles.
    """
    vals, scale = _quantize_indexer(jnp.asarray(x))
    return vals.astype(jnp.float8_e4m3fn), scale


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def decode_indexer_fp8(vals_f8: ArrayLike, scale_u8: ArrayLike, out_dtype: DTypeLike) -> jax.Array:
    """Inverse of ``encode_indexer_fp8`` -> [..., J] in out_dtype, still in the rotated basis.

    With out_dtype = x.dtype it equals ``fake_quant_indexer(x)`` bit-exactly.
    """
    q = jnp.asarray(vals_f8)
    if q.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"indexer FP8 values must be float8_e4m3fn, got dtype {q.dtype}")
    return _dequantize_indexer(q.astype(jnp.float32), scale_u8, out_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """A matrix [N, D] stored as float8_e4m3fn codes with one f32 scale per row:
    row n = codes[n] * scale[n] (scale = amax(|row|) / 448, so each row uses the full range)."""

    codes: jax.Array  # [N, D] float8_e4m3fn
    scale: jax.Array  # [N] f32


def quant_fp8_rows(w: ArrayLike) -> Fp8Rows:
    """Row-wise FP8 of a matrix [N, D] (a zero row gets scale 1)."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-1)
    scale = jnp.where(amax > 0, amax / _FP8_MAX, 1.0)
    return Fp8Rows(codes=(w / scale[:, None]).astype(jnp.float8_e4m3fn), scale=scale)


def fp8_rows_matmul(x_TD: ArrayLike, w: Fp8Rows) -> jax.Array:
    """x @ w^T [T, N] in f32 with both operands in FP8: x quantised per row (token) on the fly,
    the product of codes accumulated in f32 (FP8 tensor cores where the device has them), then
    scaled by the two rows' scales."""
    x = jnp.asarray(x_TD, jnp.float32)
    xq = quant_fp8_rows(x)
    acc = jnp.einsum("td,nd->tn", xq.codes, w.codes, preferred_element_type=jnp.float32)
    return acc * xq.scale[:, None] * w.scale[None, :]
