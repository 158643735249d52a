"""Tests for dsv4/quant.py: exact decoding against ml_dtypes, layout conventions (nibble order,
block indexing), quant/dequant round trips, and fake-quant properties.

Oracles are independent of the code under test: ml_dtypes for element formats, numpy loops
for block indexing, numpy float64 for scales.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsv4 import quant

# Tolerances per element format (STYLE.md: one table). "rel" is half an ulp relative to |x|
# for normal numbers; "sub" is the absolute error floor of the subnormal range, in units of scale.
TOL = {
    "e4m3": {"rel": 2.0**-4, "sub": 2.0**-10},
    "e2m1": {"rel": 0.25, "sub": 0.25},
}


def _np(x):
    return np.asarray(jax.device_get(x))


def _same_bits_f32(a, b):
    """Equal as float32 including NaN positions and the sign of zero."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    m = ~np.isnan(a)
    np.testing.assert_array_equal(a[m], b[m])
    np.testing.assert_array_equal(np.signbit(a[m]), np.signbit(b[m]))


def _ml_e2m1(codes):
    """ml_dtypes decode of 4-bit e2m1 codes (one code per byte, low nibble)."""
    return np.asarray(codes, np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


# ---------------------------------------------------------------- constants and E8M0


def test_constants_and_code_table_match_ml_dtypes():
    assert (quant.FP8_BLOCK, quant.FP4_GROUP, quant.E8M0_BIAS) == (128, 32, 127)
    table = np.asarray(quant.FP4_CODE_TABLE)
    assert table.dtype == np.float32 and table.shape == (16,)
    _same_bits_f32(table, _ml_e2m1(np.arange(16)))


def test_e8m0_to_float_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    got = _np(quant.e8m0_to_float(jnp.asarray(b)))
    assert got.dtype == np.float32
    want = np.ldexp(1.0, b[:255].astype(np.int64) - 127).astype(np.float32)
    want = np.append(want, np.float32(np.nan))
    _same_bits_f32(got, want)
    assert got[127] == 1.0 and got[128] == 2.0 and got[126] == 0.5
    assert got[0] == np.float32(2.0**-127) and got[0] > 0
    assert np.isnan(got[255])


def test_e8m0_to_float_rejects_non_bytes():
    with pytest.raises(ValueError, match="uint8"):
        quant.e8m0_to_float(jnp.asarray([127], jnp.int32))


def test_float_to_e8m0_exact_and_rounds_up():
    b = np.arange(255, dtype=np.uint8)
    powers = np.ldexp(1.0, b.astype(np.int64) - 127).astype(np.float32)
    np.testing.assert_array_equal(_np(quant.float_to_e8m0(jnp.asarray(powers))), b)
    x = np.array([3.0, 1.0000001, 0.75, 448.0, 1e-4 / 448, 0.0, -1.0, np.inf, np.nan, 2.0**128 * 0.75],
                 np.float32)
    want = np.array([129, 128, 127, 136, 105, 0, 255, 255, 255, 255], np.uint8)
    np.testing.assert_array_equal(_np(quant.float_to_e8m0(jnp.asarray(x))), want)


# ---------------------------------------------------------------- FP8 weights


def test_dequant_fp8_every_byte_pattern_matches_ml_dtypes():
    w = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(2, 128)
    ref = w.astype(np.float32)
    got = quant.dequant_fp8_block(jnp.asarray(w), jnp.asarray([[127]], jnp.uint8), jnp.float32)
    _same_bits_f32(_np(got), ref)
    # Scale byte 130 = x8; powers of two keep every finite value exact.
    got8 = quant.dequant_fp8_block(jnp.asarray(w), jnp.asarray([[130]], jnp.uint8), jnp.float32)
    _same_bits_f32(_np(got8), ref * 8)


def _loop_dequant_fp8(w, s):
    """Naive oracle: one element at a time, W[o, i] * 2**(s[o//128, i//128] - 127)."""
    w = np.asarray(w).astype(np.float32)
    out = np.empty(w.shape, np.float64)
    for idx in np.ndindex(*w.shape[:-2]):
        for o in range(w.shape[-2]):
            for i in range(w.shape[-1]):
                out[idx + (o, i)] = w[idx + (o, i)] * 2.0 ** (int(s[idx + (o // 128, i // 128)]) - 127)
    return out


@pytest.mark.parametrize("shape", [(200, 300), (3, 130, 129), (2, 1, 128, 257)])
def test_dequant_fp8_block_indexing_ragged_and_batched(shape):
    rng = np.random.default_rng(0)
    *lead, o, i = shape
    w = rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn)
    s = rng.integers(118, 137, size=(*lead, -(-o // 128), -(-i // 128))).astype(np.uint8)
    got = _np(quant.dequant_fp8_block(jnp.asarray(w), jnp.asarray(s), jnp.float32))
    assert got.shape == shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, _loop_dequant_fp8(w, s).astype(np.float32))
    got_bf16 = quant.dequant_fp8_block(jnp.asarray(w), jnp.asarray(s), jnp.bfloat16)
    assert got_bf16.dtype == jnp.bfloat16


def test_dequant_fp8_bad_shapes_raise():
    w = jnp.zeros((200, 300), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale shape"):
        quant.dequant_fp8_block(w, jnp.zeros((1, 3), jnp.uint8), jnp.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        quant.dequant_fp8_block(w.astype(jnp.float32), jnp.zeros((2, 3), jnp.uint8), jnp.float32)


def test_quant_fp8_round_trip_exact_for_representable():
    """Blocks built as e4m3 values times a known power of two, each containing +-448, round-trip
    bit-exactly and recover the scale byte."""
    rng = np.random.default_rng(1)
    shape = (2, 200, 260)
    blocks = (2, 2, 3)
    s_bytes = rng.integers(110, 140, size=blocks).astype(np.uint8)
    q = rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * 40
    q = q.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    for e in range(2):
        for bo in range(2):
            for bi in range(3):
                q[e, bo * 128, bi * 128] = 448.0 if (bo + bi) % 2 else -448.0
    scale_full = np.ldexp(1.0, s_bytes.astype(np.int64) - 127)
    w = (q * np.repeat(np.repeat(scale_full, 128, 1), 128, 2)[:, :200, :260]).astype(np.float32)
    wq, sq = quant.quant_fp8_block(jnp.asarray(w))
    assert wq.dtype == jnp.float8_e4m3fn and sq.dtype == jnp.uint8
    assert wq.shape == shape and sq.shape == blocks
    np.testing.assert_array_equal(_np(sq), s_bytes)
    np.testing.assert_array_equal(_np(wq).astype(np.float32), q)
    np.testing.assert_array_equal(_np(quant.dequant_fp8_block(wq, sq, jnp.float32)), w)


def test_quant_fp8_scale_rule_and_error_bound():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((130, 250)) * np.exp(rng.uniform(-6, 6, (130, 1)))).astype(np.float32)
    wq, sq = quant.quant_fp8_block(jnp.asarray(w))
    s = np.ldexp(1.0, _np(sq).astype(np.int64) - 127)
    for bo in range(2):
        for bi in range(2):
            amax = np.abs(w[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128]).max()
            assert amax / 448 <= s[bo, bi] < 2 * amax / 448  # smallest power of two >= amax/448
    back = _np(quant.dequant_fp8_block(wq, sq, jnp.float32))
    s_full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:130, :250]
    bound = np.maximum(TOL["e4m3"]["rel"] * np.abs(w), TOL["e4m3"]["sub"] * s_full)
    assert np.all(np.abs(back - w) <= bound)
    # All-zero input: floored amax gives a finite scale and zero values.
    zq, zs = quant.quant_fp8_block(jnp.zeros((4, 4)))
    assert _np(zs)[0, 0] == 127 - 22 and not np.any(_np(zq).astype(np.float32))


# ---------------------------------------------------------------- FP4 experts


def test_unpack_fp4_nibble_order_hand_built():
    # 0x72: low nibble 2 (1.0) is the FIRST element, high nibble 7 (6.0) the second.
    # 0xF9 (int8 -7): low 9 (-0.5), high 15 (-6.0). 0x08: low 8 (-0.0), high 0 (+0.0).
    packed = np.array([[0x72, 0xF9 - 256, 0x08]], np.int8)
    got = _np(quant.unpack_fp4(jnp.asarray(packed)))
    _same_bits_f32(got, np.array([[1.0, 6.0, -0.5, -6.0, -0.0, 0.0]], np.float32))


def test_unpack_fp4_all_bytes_match_ml_dtypes():
    b = np.arange(256, dtype=np.uint8)
    got = _np(quant.unpack_fp4(jnp.asarray(b.view(np.int8))))
    want = np.stack([_ml_e2m1(b & 0xF), _ml_e2m1(b >> 4)], axis=-1).reshape(-1)
    _same_bits_f32(got, want)


def test_pack_fp4_inverts_unpack_and_rejects_off_grid():
    b = np.arange(256, dtype=np.uint8).view(np.int8).reshape(4, 64)
    packed = quant.pack_fp4(quant.unpack_fp4(jnp.asarray(b)))
    assert packed.dtype == jnp.int8
    np.testing.assert_array_equal(_np(packed), b)
    for bad in ([0.7, 1.0], [8.0, 0.0], [np.nan, 0.0], [np.inf, 0.0], [0.25, 0.0]):
        with pytest.raises(ValueError, match="representable"):
            quant.pack_fp4(np.array(bad, np.float32))
    with pytest.raises(ValueError, match="even"):
        quant.pack_fp4(np.zeros(3, np.float32))


def _loop_dequant_fp4(vals, s):
    out = np.empty(vals.shape, np.float64)
    for idx in np.ndindex(*vals.shape[:-1]):
        for k in range(vals.shape[-1]):
            out[idx + (k,)] = vals[idx + (k,)] * 2.0 ** (int(s[idx + (k // 32,)]) - 127)
    return out


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 96), (2, 40)])
def test_dequant_fp4_scale_indexing_batched(shape):
    rng = np.random.default_rng(3)
    *lead, o, k = shape
    codes = rng.integers(0, 16, size=shape)
    vals = np.asarray(quant.FP4_CODE_TABLE)[codes]
    packed = quant.pack_fp4(vals)
    s = rng.integers(120, 135, size=(*lead, o, -(-k // 32))).astype(np.uint8)
    got = _np(quant.dequant_fp4(packed, jnp.asarray(s), jnp.float32))
    np.testing.assert_array_equal(got, _loop_dequant_fp4(vals, s).astype(np.float32))
    assert quant.dequant_fp4(packed, jnp.asarray(s), jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="scale shape"):
        quant.dequant_fp4(packed, jnp.asarray(s[..., :1, :]), jnp.float32)


def test_quant_fp4_round_trip_exact_for_representable():
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 16, size=(3, 6, 128))
    codes[..., ::32] = rng.choice([7, 15], size=(3, 6, 4))  # each group holds +-6 -> scale recoverable
    vals = np.asarray(quant.FP4_CODE_TABLE)[codes]
    s_bytes = rng.integers(115, 140, size=(3, 6, 4))  # 6*s above the 1e-4 amax floor.astype(np.uint8)
    w = (vals * np.repeat(np.ldexp(1.0, s_bytes.astype(np.int64) - 127), 32, -1)).astype(np.float32)
    packed, s = quant.quant_fp4(jnp.asarray(w))
    assert packed.dtype == jnp.int8 and packed.shape == (3, 6, 64) and s.dtype == jnp.uint8
    np.testing.assert_array_equal(_np(s), s_bytes)
    # Byte-exact, including code 8 (-0): the sign of zero must survive quantisation.
    np.testing.assert_array_equal(_np(packed), _np(quant.pack_fp4(vals)))
    _same_bits_f32(_np(quant.dequant_fp4(packed, s, jnp.float32)), w)


def test_quant_fp4_scale_rule_and_error_bound():
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((7, 96)) * np.exp(rng.uniform(-5, 5, (7, 1)))).astype(np.float32)
    packed, sq = quant.quant_fp4(jnp.asarray(w))
    s = np.ldexp(1.0, _np(sq).astype(np.int64) - 127)
    amax = np.abs(w.reshape(7, 3, 32)).max(-1)
    assert np.all((amax / 6 <= s) & (s < 2 * amax / 6))
    back = _np(quant.dequant_fp4(packed, sq, jnp.float32))
    s_full = np.repeat(s, 32, -1)
    bound = np.maximum(TOL["e2m1"]["rel"] * np.abs(w), TOL["e2m1"]["sub"] * s_full)
    assert np.all(np.abs(back - w) <= bound)
    with pytest.raises(ValueError, match="even"):
        quant.quant_fp4(jnp.zeros((2, 33)))


def test_fp4_rounding_matches_ml_dtypes_including_ties():
    """With a 6.0 in the block the scale is exactly 1, so fake_quant_fp4 is a bare e2m1 rounding."""
    grid = np.concatenate([np.arange(-6.0, 6.01, 0.125), [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.1]])
    n = (-len(grid)) % 31
    grid = np.concatenate([grid, np.zeros(n)]).astype(np.float32).reshape(-1, 31)
    x = np.concatenate([np.full((grid.shape[0], 1), 6.0, np.float32), grid], axis=-1)
    got = _np(quant.fake_quant_fp4(jnp.asarray(x)))
    _same_bits_f32(got, x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


# ---------------------------------------------------------------- fake quant


def _np_fake_fp8(x, block):
    """Independent numpy oracle: float64 scale via log2, ml_dtypes e4m3 cast, ragged last block."""
    x = np.asarray(x, np.float32)
    out = np.empty_like(x)
    d = x.shape[-1]
    for start in range(0, d, block):
        g = x[..., start:start + block]
        amax = np.maximum(np.abs(g).max(-1, keepdims=True).astype(np.float64), 1e-4)
        s = 2.0 ** np.ceil(np.log2(amax / 448.0))
        q = (g / s).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        out[..., start:start + block] = q * s
    return out


@pytest.mark.parametrize("shape,block", [((3, 5, 448), 64), ((4, 100), 64), ((2, 256), 128)])
def test_fake_quant_fp8_matches_numpy_oracle(shape, block):
    rng = np.random.default_rng(6)
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape[:-1] + (1,)))).astype(np.float32)
    x[..., :block] *= 1e-7  # a block below the amax floor
    got = _np(quant.fake_quant_fp8(jnp.asarray(x), block=block))
    np.testing.assert_array_equal(got, _np_fake_fp8(x, block))


def test_fake_quant_fp8_properties_bf16():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((4, 9, 448)) * 3, jnp.bfloat16)
    y = quant.fake_quant_fp8(x)
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape
    np.testing.assert_array_equal(_np(quant.fake_quant_fp8(y)), _np(y))  # idempotent
    xf = _np(x.astype(jnp.float32))
    yf = _np(y.astype(jnp.float32))
    assert not np.array_equal(xf, yf)  # it really quantises
    # Error bound: half an e4m3 ulp, or the subnormal floor relative to the block scale.
    s = 2.0 ** np.ceil(np.log2(np.abs(xf).reshape(4, 9, 7, 64).max(-1) / 448))
    s_full = np.repeat(s, 64, -1)
    assert np.all(np.abs(yf - xf) <= np.maximum(TOL["e4m3"]["rel"] * np.abs(xf), TOL["e4m3"]["sub"] * s_full))
    np.testing.assert_array_equal(_np(quant.fake_quant_fp8(jnp.zeros((2, 64)))), 0.0)


# ---------------------------------------------------------------- activation quantisation (spec 6.2)


def _e4m3_grid_and_ties() -> np.ndarray:
    """Every finite e4m3fn value of either sign and every midpoint between neighbours (the ties)."""
    pos = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    pos = pos[np.isfinite(pos) & (pos >= 0)]
    mids = (pos[:-1] + pos[1:]) / 2  # exact in f32: 3-bit mantissas
    half = np.concatenate([pos, mids])
    return np.concatenate([half, -half])


def test_act_quant_rounds_every_e4m3_value_and_tie_as_ml_dtypes():
    """With a 448 in each 128-block the scale is exactly 1, so the values are a bare e4m3
    rounding of x: ties to even, as ml_dtypes casts."""
    x = _e4m3_grid_and_ties()
    x = np.concatenate([x, np.zeros((-len(x)) % 127, np.float32)]).reshape(-1, 127)
    x = np.concatenate([np.full((x.shape[0], 1), 448.0, np.float32), x], axis=-1)
    values, scale = quant.act_quant(jnp.asarray(x))
    assert values.dtype == jnp.float8_e4m3fn and values.shape == x.shape and scale.shape == (x.shape[0], 1)
    np.testing.assert_array_equal(_np(scale), 1.0)
    _same_bits_f32(_np(values.astype(jnp.float32)), x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


@pytest.mark.parametrize("shape", [(3, 256), (2, 5, 384), (4, 200), (1, 64)])  # ragged K: its own last block
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_act_quant_blocks_of_128_match_the_numpy_oracle(shape, dtype):
    rng = np.random.default_rng(shape[-1])
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape[:-1] + (1,)))).astype(np.float32)
    x[..., :64] *= 1e-7  # part of a block far below the others' magnitude
    if shape[-1] > 128:
        x[0, ..., 128:256] = 0.0  # an all-zero block: the floored amax
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    values, scale = quant.act_quant(jnp.asarray(x, dtype))
    assert scale.shape == shape[:-1] + (math.ceil(shape[-1] / 128),) and scale.dtype == jnp.float32
    amax = np.maximum(np.abs(np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (-shape[-1]) % 128)]))
                      .reshape(*shape[:-1], -1, 128).max(-1).astype(np.float64), 1e-4)
    np.testing.assert_array_equal(_np(scale), 2.0 ** np.ceil(np.log2(amax / 448.0)))
    want = _np_fake_fp8(x, 128)
    fake = quant.fake_act_quant(jnp.asarray(x, dtype))
    assert fake.dtype == dtype
    _same_bits_f32(_np(fake.astype(jnp.float32)), want)  # exact in bf16 as in f32
    _same_bits_f32(_np(quant.dequant_act(values, scale, jnp.float32)), want)


def test_fake_quantisers_take_arrays_with_no_rows():
    """A compressed layer's entries of a prompt shorter than its ratio: [B, 0, D]."""
    empty = jnp.zeros((2, 0, 80), jnp.bfloat16)
    for out in (quant.fake_quant_kv(empty, 16), quant.fake_act_quant(empty), quant.fake_quant_indexer(empty[..., :64])):
        assert out.shape[:2] == (2, 0) and out.dtype == jnp.bfloat16
    values, scale = quant.act_quant(empty)
    assert values.shape == (2, 0, 80) and scale.shape == (2, 0, 1)


@pytest.mark.parametrize("d,rope", [(512, 64), (80, 16), (64, 64), (40, 8)])
def test_fake_quant_kv_leaves_rope_untouched(d, rope):
    rng = np.random.default_rng(8)
    kv = jnp.asarray(rng.standard_normal((2, 3, d)) * 5, jnp.bfloat16)
    out = quant.fake_quant_kv(kv, rope)
    assert out.dtype == kv.dtype and out.shape == kv.shape
    np.testing.assert_array_equal(_np(out[..., d - rope:]), _np(kv[..., d - rope:]))
    if d > rope:
        np.testing.assert_array_equal(_np(out[..., :d - rope]), _np(quant.fake_quant_fp8(kv[..., :d - rope], 64)))
        assert not np.array_equal(_np(out[..., :d - rope]), _np(kv[..., :d - rope]))
    with pytest.raises(ValueError, match="rope_dim"):
        quant.fake_quant_kv(kv, d + 1)


def test_fake_quant_kv_block_is_64_not_whole_row():
    """A huge value in one 64-block must not coarsen the next block's quantisation."""
    kv = np.full((1, 512), 0.01, np.float32)
    kv[0, :64] = 1000.0
    out = _np(quant.fake_quant_kv(jnp.asarray(kv), 64))
    # Own scale 2**-15: 0.01 / 2**-15 = 327.68 -> e4m3 320. Had block 0's scale 4 leaked in,
    # 0.0025 would be an e4m3 subnormal -> 2**-9 * 4 = 0.0078125.
    np.testing.assert_array_equal(out[0, 64:448], np.float32(320 * 2.0**-15))
    np.testing.assert_array_equal(out[0, 448:], np.float32(0.01))
    assert out[0, 0] == 1024.0  # scale 4: 1000 / 4 = 250 -> e4m3 256 -> x4


def test_hadamard_matrix_sylvester_and_orthogonal():
    for n in (1, 2, 8, 128):
        h = _np(quant.hadamard_matrix(n))
        assert h.dtype == np.float32 and h.shape == (n, n)
        assert set(np.unique(h)) <= {-1.0, 1.0}
        np.testing.assert_array_equal(h @ h.T, n * np.eye(n))
        if n > 1:
            half = _np(quant.hadamard_matrix(n // 2))
            np.testing.assert_array_equal(h, np.block([[half, half], [half, -half]]))
    np.testing.assert_array_equal(_np(quant.hadamard_matrix(2)), [[1, 1], [1, -1]])
    for bad in (0, 3, 96):
        with pytest.raises(ValueError, match="power of two"):
            quant.hadamard_matrix(bad)


def test_hadamard_rotate_orthonormal():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 5, 128)).astype(np.float32)
    y = _np(quant.hadamard_rotate(jnp.asarray(x)))
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(y, x @ _np(quant.hadamard_matrix(128)) / math.sqrt(128), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(quant.hadamard_rotate(jnp.asarray(y))), x, rtol=1e-5, atol=1e-5)
    e0 = np.zeros(128, np.float32)
    e0[0] = 1.0
    np.testing.assert_allclose(_np(quant.hadamard_rotate(jnp.asarray(e0))), np.full(128, 128**-0.5), rtol=1e-6)
    assert quant.hadamard_rotate(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


def test_fake_quant_fp4_properties():
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((4, 3, 128)) * 2, jnp.bfloat16)
    y = quant.fake_quant_fp4(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_np(quant.fake_quant_fp4(y)), _np(y))  # idempotent
    yf = _np(y.astype(jnp.float32)).reshape(4, 3, 4, 32)
    xf = _np(x.astype(jnp.float32)).reshape(4, 3, 4, 32)
    s = 2.0 ** np.ceil(np.log2(np.abs(xf).max(-1, keepdims=True) / 6))
    assert np.all(np.isin(np.abs(yf / s), np.asarray(quant.FP4_CODE_TABLE)[:8]))  # on the e2m1 grid
    assert len(np.unique(yf)) > 8  # per-block scales differ


def test_fake_quant_indexer_is_rotate_then_fp4():
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((2, 4, 128)), jnp.bfloat16)
    got = _np(quant.fake_quant_indexer(x).astype(jnp.float32))
    want = _np(quant.fake_quant_fp4(quant.hadamard_rotate(x), block=32).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    # Without the rotation the result differs (the Hadamard changes what fp4 loses).
    assert not np.array_equal(got, _np(quant.fake_quant_fp4(x).astype(jnp.float32)))


def test_functions_are_jittable():
    rng = np.random.default_rng(12)
    w = rng.standard_normal((2, 130, 64)).astype(np.float32)
    wq, sq = jax.jit(quant.quant_fp8_block)(jnp.asarray(w))
    np.testing.assert_array_equal(
        _np(jax.jit(quant.dequant_fp8_block, static_argnums=2)(wq, sq, jnp.float32)),
        _np(quant.dequant_fp8_block(*quant.quant_fp8_block(jnp.asarray(w)), jnp.float32)),
    )
    p, s = jax.jit(quant.quant_fp4)(jnp.asarray(w))
    np.testing.assert_array_equal(_np(p), _np(quant.quant_fp4(jnp.asarray(w))[0]))
    kv = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    np.testing.assert_array_equal(
        _np(jax.jit(quant.fake_quant_kv, static_argnums=1)(kv, 64)), _np(quant.fake_quant_kv(kv, 64))
    )
    np.testing.assert_array_equal(
        _np(jax.jit(quant.fake_quant_indexer)(kv[:, :128])), _np(quant.fake_quant_indexer(kv[:, :128]))
    )


def test_round_e4m3_matches_ml_dtypes_on_every_tie_and_binade():
    from dsv4.quant import _round_e4m3

    grid = np.asarray(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max, np.float32)
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.unique(codes[np.isfinite(codes)])
    mids = (finite[1:] + finite[:-1]) / 2  # exact ties
    probes = np.concatenate([finite, mids, mids * (1 + 1e-6), mids * (1 - 1e-6),
                             np.linspace(-grid, grid, 4001, dtype=np.float32)]).astype(np.float32)
    expected = probes.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(_round_e4m3(jnp.asarray(probes))), expected)


# ---------------------------------------------------------------- decode-state storage codecs


def _bits(a):
    """Raw bit pattern of a float array (uint of the same width), so -0 != +0 and NaNs compare."""
    a = np.asarray(jax.device_get(a))
    return a.view(f"u{a.dtype.itemsize}")


def _codec_input(seed, shape, dtype):
    """Random [..., D] with element magnitudes across 1e-6..1e4, some narrow-range rows (whole
    blocks near the amax floor or near the top) and one +0 row and one -0 row."""
    rng = np.random.default_rng(seed)
    exps = rng.uniform(-6, 4, shape)
    rows = exps.reshape(-1, shape[-1])
    centre = rng.uniform(-6, 4, (rows.shape[0], 1))
    narrow = rng.random(rows.shape[0]) < 0.5
    rows[narrow] = np.clip(centre + rng.uniform(-1, 1, rows.shape), -6, 4)[narrow]
    x = (rng.standard_normal(shape) * 10.0**exps).reshape(-1, shape[-1])
    if x.shape[0] >= 3:
        x[0] = 0.0
        x[1] = -0.0
    return jnp.asarray(x.reshape(shape), dtype)


_LEADS = [(), (3,), (2, 3), (1, 2, 2)]
# (D, R): FLASH 512/64 (7 full blocks), ragged non-rope widths 32 / 100 = 64 + 36, one exact
# block, no rope (all fp8) and all rope (nothing quantised).
_KV_DIMS = [(512, 64), (40, 8), (100, 0), (80, 16), (24, 24)]


# Every new shape compiles three programs, so few random draws; the named cases always run.
@settings(max_examples=6, deadline=None, database=None)
@given(lead=st.sampled_from(_LEADS), dims=st.sampled_from(_KV_DIMS),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float32]), seed=st.integers(0, 2**31 - 1))
@example(lead=(2, 3), dims=(512, 64), dtype=jnp.bfloat16, seed=0)
@example(lead=(3,), dims=(40, 8), dtype=jnp.bfloat16, seed=1)
@example(lead=(2, 3), dims=(40, 8), dtype=jnp.float32, seed=2)
@example(lead=(), dims=(100, 0), dtype=jnp.float32, seed=3)
def test_kv_fp8_codec_round_trip_is_fake_quant_bit_exact(lead, dims, dtype, seed):
    d, rope = dims
    nope = d - rope
    kv = _codec_input(seed, (*lead, d), dtype)
    q, s, r = quant.encode_kv_fp8(kv, rope)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (*lead, nope)
    assert s.dtype == jnp.uint8 and s.shape == (*lead, -(-nope // 64))
    assert r.dtype == kv.dtype and r.shape == (*lead, rope)
    np.testing.assert_array_equal(_bits(r), _bits(kv[..., nope:]))
    got = quant.decode_kv_fp8(q, s, r, dtype)
    want = quant.fake_quant_kv(kv, rope)
    assert got.dtype == want.dtype and got.shape == want.shape
    # Bit compare: the fake path keeps -0 (copysign in the rounding) and so must the codec.
    np.testing.assert_array_equal(_bits(got), _bits(want))
    if nope and lead:  # the -0 row really reaches the output as -0, so the sign is exercised
        assert np.all(_bits(want).reshape(-1, d)[1, :nope] == _bits(jnp.asarray(-0.0, dtype)))


@settings(max_examples=6, deadline=None, database=None)
@given(lead=st.sampled_from(_LEADS), j=st.sampled_from([32, 128]),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float32]), seed=st.integers(0, 2**31 - 1))
@example(lead=(2, 3), j=128, dtype=jnp.bfloat16, seed=0)
@example(lead=(3,), j=128, dtype=jnp.float32, seed=1)
@example(lead=(1, 2, 2), j=32, dtype=jnp.bfloat16, seed=2)
@example(lead=(), j=32, dtype=jnp.float32, seed=3)
def test_indexer_codecs_round_trip_is_fake_quant_bit_exact(lead, j, dtype, seed):
    x = _codec_input(seed, (*lead, j), dtype)
    want = quant.fake_quant_indexer(x)
    packed, s4 = quant.encode_indexer_fp4(x)
    vals, s8 = quant.encode_indexer_fp8(x)
    assert packed.dtype == jnp.int8 and packed.shape == (*lead, j // 2)
    assert vals.dtype == jnp.float8_e4m3fn and vals.shape == (*lead, j)
    assert s4.dtype == s8.dtype == jnp.uint8 and s4.shape == (*lead, j // 32)
    # Both formats hold the same e2m1 numbers and scales; fp4 nibbles agree with pack_fp4's order.
    np.testing.assert_array_equal(_np(s4), _np(s8))
    np.testing.assert_array_equal(_bits(quant.unpack_fp4(packed)), _bits(vals.astype(jnp.float32)))
    assert np.all(np.isin(np.abs(_np(vals).astype(np.float32)), quant.FP4_CODE_TABLE[:8]))
    for got in (quant.decode_indexer_fp4(packed, s4, dtype), quant.decode_indexer_fp8(vals, s8, dtype)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_kv_fp8_codec_stored_values_and_scales():
    """The stored form itself (not only its round trip): per-64 E8M0 bytes and e4m3 elements."""
    kv = np.full((2, 512), 0.01, np.float32)
    kv[0, :64] = 1000.0
    kv[1, :448] = 0.0
    q, s, r = quant.encode_kv_fp8(jnp.asarray(kv), 64)
    # Row 0: block 0 scale 4 (byte 129), 1000/4 = 250 -> e4m3 256; other blocks 2**-15 (byte 112),
    # 0.01 * 2**15 = 327.68 -> 320. Row 1 is all zero: floored amax 1e-4 -> 2**-22 (byte 105).
    np.testing.assert_array_equal(_np(s), [[129] + [112] * 6, [105] * 7])
    qf = _np(q).astype(np.float32)
    np.testing.assert_array_equal(qf[0, :64], 256.0)
    np.testing.assert_array_equal(qf[0, 64:], 320.0)
    np.testing.assert_array_equal(qf[1], 0.0)
    np.testing.assert_array_equal(_np(r), kv[:, 448:])


def test_codec_shapes_at_flash_size():
    """Abstract evaluation only (costs nothing): FLASH KV 512 = 448 + 64 rope, indexer J = 128."""
    kv = jax.ShapeDtypeStruct((4, 8192, 512), jnp.bfloat16)
    q, s, r = jax.eval_shape(lambda x: quant.encode_kv_fp8(x, 64), kv)
    assert (q.shape, q.dtype, s.shape, s.dtype, r.shape, r.dtype) == (
        (4, 8192, 448), jnp.float8_e4m3fn, (4, 8192, 7), jnp.uint8, (4, 8192, 64), jnp.bfloat16)
    out = jax.eval_shape(lambda *a: quant.decode_kv_fp8(*a, jnp.bfloat16), q, s, r)
    assert (out.shape, out.dtype) == (kv.shape, kv.dtype)
    k = jax.ShapeDtypeStruct((4, 8192, 128), jnp.bfloat16)
    p, s4 = jax.eval_shape(quant.encode_indexer_fp4, k)
    v, s8 = jax.eval_shape(quant.encode_indexer_fp8, k)
    assert (p.shape, p.dtype, s4.shape, v.shape, v.dtype, s8.shape) == (
        (4, 8192, 64), jnp.int8, (4, 8192, 4), (4, 8192, 128), jnp.float8_e4m3fn, (4, 8192, 4))


def test_codecs_compose_under_jit_and_vmap():
    rng = np.random.default_rng(13)
    kv = jnp.asarray(rng.standard_normal((3, 2, 80)), jnp.bfloat16)
    f = jax.jit(jax.vmap(lambda x: quant.decode_kv_fp8(*quant.encode_kv_fp8(x, 16), jnp.bfloat16)))
    np.testing.assert_array_equal(_bits(f(kv)), _bits(quant.fake_quant_kv(kv, 16)))
    x = kv[..., :64]
    g = jax.jit(jax.vmap(lambda y: quant.decode_indexer_fp4(*quant.encode_indexer_fp4(y), jnp.bfloat16)))
    np.testing.assert_array_equal(_bits(g(x)), _bits(quant.fake_quant_indexer(x)))


def test_codecs_reject_bad_arguments():
    kv = jnp.zeros((2, 40), jnp.bfloat16)
    for rope in (-1, 41):
        with pytest.raises(ValueError, match="rope_dim"):
            quant.encode_kv_fp8(kv, rope)
    q, s, r = quant.encode_kv_fp8(kv, 8)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        quant.decode_kv_fp8(q.astype(jnp.bfloat16), s, r, jnp.bfloat16)
    with pytest.raises(ValueError, match="scale shape"):
        quant.decode_kv_fp8(q, jnp.zeros((2, 2), jnp.uint8), r, jnp.bfloat16)
    with pytest.raises(ValueError, match="uint8"):
        quant.decode_kv_fp8(q, s.astype(jnp.int32), r, jnp.bfloat16)
    with pytest.raises(ValueError, match="leading dims"):
        quant.decode_kv_fp8(q, s, r[:1], jnp.bfloat16)
    for enc in (quant.encode_indexer_fp4, quant.encode_indexer_fp8):
        with pytest.raises(ValueError, match="multiple of 32"):
            enc(jnp.zeros((2, 48)))
        with pytest.raises(ValueError, match="power of two"):  # J % 32 == 0 but no Hadamard of 96
            enc(jnp.zeros((2, 96)))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.decode_indexer_fp4(jnp.zeros((2, 24), jnp.int8), jnp.zeros((2, 1), jnp.uint8), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.decode_indexer_fp8(jnp.zeros((2, 48), jnp.float8_e4m3fn), jnp.zeros((2, 1), jnp.uint8), jnp.float32)
    p, s4 = quant.encode_indexer_fp4(jnp.zeros((2, 64)))
    with pytest.raises(ValueError, match="scale shape"):
        quant.decode_indexer_fp4(p, s4[:, :1], jnp.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        quant.decode_indexer_fp8(jnp.zeros((2, 64)), s4, jnp.float32)
