"""The FFI kernels (ffi_kernels/csrc) against their pure-JAX twins (dsv4/ops/*/reference.py).

CPU here and in CI (the CPU library is built by `pip install`); the same tests run on the GPU
on the device machine, where the CUDA library serves the same targets.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffi_kernels
from dsv4 import quant
from dsv4.ops.indexer_topk import ffi as indexer_ffi, reference as indexer_ref
from dsv4.ops.kv_write import ffi as kv_write_ffi, reference as kv_write_ref
from dsv4.ops.ffi_tables import kernel_built
from dsv4.ops.registry import Backend, ops_for
from dsv4.ops.sparse_attention import ffi as attn_ffi, reference as attn_ref
from dsv4.state import EntryFormat, EntryTable

KV_FORMATS = [EntryFormat.DENSE, EntryFormat.DENSE_KV_QAT, EntryFormat.KV_FP8]
INDEX_FORMATS = [EntryFormat.DENSE, EntryFormat.DENSE_INDEX_QAT, EntryFormat.INDEX_FP8, EntryFormat.INDEX_FP4]


# The references run jitted, as one program each: run op by op, a GPU compiles every primitive of
# them on its own, which made single tests take minutes there.
ref_table_write = jax.jit(kv_write_ref.table_write)
ref_sparse_attention = jax.jit(attn_ref.sparse_attention, static_argnums=4)
ref_sparse_attention_paged = jax.jit(attn_ref.sparse_attention_paged, static_argnums=6)
ref_indexer_topk = jax.jit(indexer_ref.indexer_topk, static_argnums=4)
ref_indexer_topk_paged = jax.jit(indexer_ref.indexer_topk_paged, static_argnums=(4, 6))


def _platform() -> str:
    return ffi_kernels.platform_of(jax.default_backend())


def test_the_library_of_this_platform_is_built_and_registered():
    # Not a skip: CI's `pip install` must have built the CPU library, and a missing one must fail.
    path = ffi_kernels.require(_platform())
    assert path.is_file()


def test_a_missing_library_says_how_to_build_it(monkeypatch):
    monkeypatch.setattr(ffi_kernels, "REGISTERED", {})
    with pytest.raises(ffi_kernels.FfiNotBuiltError, match="pip install"):
        attn_ffi.sparse_attention(jnp.zeros((1, 1, 1, 8)), jnp.zeros((1, 2, 8)), jnp.zeros((1, 1, 2), jnp.int32),
                                  jnp.zeros((1,)), 1.0)
    with pytest.raises(ffi_kernels.FfiNotBuiltError, match="no FFI kernels exist"):
        ffi_kernels.require("tpu")


def test_the_ffi_backend_is_an_opset():
    ops = ops_for("ffi")
    assert ops.sparse_attention_paged is attn_ffi.sparse_attention_paged
    assert ops.table_write is kv_write_ffi.table_write
    assert ops_for(Backend.REFERENCE).table_write is kv_write_ref.table_write


# ---------------------------------------------------------------- tables


def _table(rng, fmt: EntryFormat, rows: int, width: int, rope: int, dtype, *, scale=1.0) -> EntryTable:
    """A table of `rows` random entries written by the reference codec (every row filled)."""
    values = jnp.asarray(scale * rng.normal(size=(rows, width)), dtype)
    return EntryTable.zeros(rows, width, fmt, rope, dtype).write(jnp.arange(rows), values)


def _bits(a) -> np.ndarray:
    a = np.asarray(jax.device_get(a))
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def _assert_same_table(got: EntryTable, want: EntryTable):
    assert len(got.arrays) == len(want.arrays)
    for g, w in zip(got.arrays, want.arrays):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(_bits(g), _bits(w))


# ---------------------------------------------------------------- kv_write


@pytest.mark.parametrize("fmt", KV_FORMATS + INDEX_FORMATS[1:])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kv_write_stores_what_the_reference_stores_bit_for_bit(fmt, dtype):
    rng = np.random.default_rng(3)
    index = fmt in INDEX_FORMATS[1:]
    # KV: 84 quantised columns = one full and one ragged 64-block, then 16 rope columns.
    width, rope = (64, 0) if index else (100, 16)
    table = _table(rng, fmt, 12, width, rope, dtype)
    n = 7
    values = rng.normal(size=(n, width)) * rng.choice([1e-3, 1.0, 300.0], size=(n, 1))
    values[1, :32] = 0.0  # an all-zero block: the floored scale
    values[2, 3] = 1e4  # saturates the grid's largest value in its block
    rows = np.array([4, -1, 0, 11, 12, 7, 2], np.int32)  # -1 and 12 (= rows) are dropped
    args = (jnp.asarray(rows), jnp.asarray(values, dtype))
    want = ref_table_write(table, *args)
    got = jax.jit(kv_write_ffi.table_write)(table, *args)
    _assert_same_table(got, want)
    untouched = [r for r in range(12) if r not in rows]
    for g, old in zip(got.arrays, table.arrays):
        np.testing.assert_array_equal(_bits(g)[untouched], _bits(old)[untouched])


def test_kv_write_with_no_kept_rows_changes_nothing():
    rng = np.random.default_rng(4)
    table = _table(rng, EntryFormat.KV_FP8, 5, 40, 8, jnp.bfloat16)
    got = kv_write_ffi.table_write(table, jnp.full((3,), -1, jnp.int32), jnp.ones((3, 40), jnp.bfloat16))
    _assert_same_table(got, table)


# ---------------------------------------------------------------- sparse attention


def _window_idx(rng, t, w, ring_rows, fresh_rows):
    """[T, W] with ring rows, fresh rows (ring_rows + i) and -1, duplicate-free per query."""
    idx = np.full((t, w), -1, np.int32)
    pool = ring_rows + fresh_rows
    for i in range(t):
        m = rng.integers(0, min(w, pool) + 1)
        idx[i, rng.choice(w, m, replace=False)] = rng.choice(pool, m, replace=False)
    return idx


def _comp_idx(rng, t, x, rows):
    idx = np.full((t, x), -1, np.int32)
    for i in range(t):
        m = rng.integers(0, min(x, rows) + 1)
        idx[i, rng.choice(x, m, replace=False)] = rng.choice(rows, m, replace=False)
    idx[0, -1] = rows  # past the pool: no entry
    return idx


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [1, 6, 13])  # one decode query, a K+1 verify block, a prefill chunk
@pytest.mark.parametrize("with_pool", [True, False])
def test_sparse_attention_paged_matches_the_reference(fmt, dtype, t, with_pool):
    rng = np.random.default_rng(t)
    n, h, rope = 5, 80, 16
    ring = _table(rng, fmt, 20, h, rope, dtype)
    fresh = EntryTable.from_values(jnp.asarray(rng.normal(size=(t, h)), dtype), like=ring)
    window_idx = jnp.asarray(_window_idx(rng, t, 9, ring.rows, t))
    comp, comp_idx = None, None
    if with_pool:
        comp = _table(rng, fmt, 11, h, rope, dtype, scale=2.0)
        comp_idx = jnp.asarray(_comp_idx(rng, t, 6, comp.rows))
    q = jnp.asarray(rng.normal(size=(t, n, h)), dtype)
    sink = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
    args = (q, (ring, fresh), window_idx, comp, comp_idx, sink, h ** -0.5)
    want = ref_sparse_attention_paged(*args)
    got = jax.jit(attn_ffi.sparse_attention_paged, static_argnums=6)(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    _close(got, want, dtype)


def _check_bf16_attention(rng, fmt, n, h, rope, t, *, comp_rows, comp_slots, comp_scale=1.0, q_scale=1.0,
                          empty_from=None):
    """bf16 attention over a 50-row ring (40 window slots) and a pool of `comp_rows` rows
    (`comp_slots` slots, those from `empty_from` on all -1) in `fmt`, through the FFI kernel
    (jitted) vs the reference."""
    dtype = jnp.bfloat16
    ring = _table(rng, fmt, 50, h, rope, dtype)
    fresh = EntryTable.from_values(jnp.asarray(rng.normal(size=(t, h)), dtype), like=ring)
    window_idx = jnp.asarray(_window_idx(rng, t, 40, ring.rows, t))
    comp = _table(rng, fmt, comp_rows, h, rope, dtype, scale=comp_scale)
    comp_idx = _comp_idx(rng, t, comp_slots, comp.rows)
    if empty_from is not None:
        comp_idx[:, empty_from:] = -1
    comp_idx = jnp.asarray(comp_idx)
    q = jnp.asarray(q_scale * rng.normal(size=(t, n, h)), dtype)
    sink = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
    args = (q, (ring, fresh), window_idx, comp, comp_idx, sink, h ** -0.5)
    _close(jax.jit(attn_ffi.sparse_attention_paged, static_argnums=6)(*args),
           ref_sparse_attention_paged(*args), dtype)


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("n, h, rope", [(70, 96, 32), (64, 512, 64), (70, 512, 64)])
@pytest.mark.parametrize("t", [3, 200])
def test_bf16_attention_on_the_tensor_core_path_matches_the_reference(fmt, n, h, rope, t):
    # bf16 with a head dim that is a multiple of 32: the CUDA library's tensor-core kernel (64
    # heads per block, so 70 heads take a second, mostly empty block; 70 selected rows are three
    # 32-row tiles, the last one partly masked); 3 queries split their rows over blocks
    # (split_parts), 200 do not. FP8 at 512 + 64 is the model's layout, which has a kernel
    # variant of its own (on SM90 on wgmma). The CPU library runs its one kernel.
    _check_bf16_attention(np.random.default_rng(h), fmt, n, h, rope, t, comp_rows=40, comp_slots=30, comp_scale=2.0)


@pytest.mark.parametrize("t", [3, 40])
def test_attention_with_logits_over_many_octaves_matches_the_reference(t):
    # q scaled so that the logits spread over tens of octaves: the online softmax's running max
    # jumps from tile to tile (O and l rescaled by factors far from 1) and differs between the
    # split parts that CUDA merges (t = 3).
    _check_bf16_attention(np.random.default_rng(40 + t), EntryFormat.KV_FP8, 64, 512, 64, t, comp_rows=90,
                          comp_slots=60, q_scale=8.0)


@pytest.mark.parametrize("t", [3, 24])
def test_fp8_attention_over_many_tiles_matches_the_reference(t):
    # The model's FP8 layout with 400 selected pool rows a query besides the window: 14 32-row
    # tiles (7 of the wgmma code's 64-row ones), so the CUDA kernel's tile pipeline wraps its
    # decoded-tile buffers and slot ring many times; 3 queries split their rows over blocks, 24
    # do not.
    _check_bf16_attention(np.random.default_rng(7 + t), EntryFormat.KV_FP8, 64, 512, 64, t, comp_rows=600,
                          comp_slots=400)


@pytest.mark.parametrize("t", [26, 32])
def test_fp8_attention_at_decode_batch_sizes_that_merge_in_smaller_clusters_matches_the_reference(t):
    # The model's FP8 layout, 640 slots a query (ten 64-row tiles) as at decode C32: on a
    # 132-multiprocessor GPU split_parts asks for 5 parts (t = 26) or 4 (t = 32), and where
    # clusters of that many blocks are not all resident (an H100 or H200: 32 clusters of 4 are
    # not) the CUDA handler takes the largest smaller count whose clusters are, merged on chip
    # (sparse_attention_cuda.cu, LaunchTensorCore). The CPU library runs its one kernel.
    _check_bf16_attention(np.random.default_rng(t), EntryFormat.KV_FP8, 64, 512, 64, t, comp_rows=800,
                          comp_slots=600)


@pytest.mark.parametrize("n, comp_slots, empty_from", [(64, 280, None), (70, 600, None), (64, 600, 100)])
@pytest.mark.parametrize("t", [1, 5])
def test_fp8_attention_split_at_decode_sizes_in_tiles_or_whole_pairs_matches_the_reference(n, comp_slots,
                                                                                         empty_from, t):
    # Decode sizes in the model's FP8 layout, split by the CUDA handler into parts of one 64-row
    # tile (5 parts merged in a cluster, 10 through the scratch: more than 8); with
    # bench/experiments/2026-12-07_attention_producer_split_decode.patch (SM90), into parts of
    # whole pairs of tiles on the producer kernel. 40 + 280 slots are 5 tiles (in pairs: a last
    # part of one tile and an empty one), 640 are 10; 70 heads make two head blocks a query, so
    # twice the parts. With the pool's slots from 100 on empty, the parts past the first hold no
    # entry at all: they must add nothing to the merge. q scaled so that the parts' maxima lie
    # many octaves apart.
    _check_bf16_attention(np.random.default_rng(n + comp_slots + t), EntryFormat.KV_FP8, n, 512, 64, t,
                          comp_rows=800, comp_slots=comp_slots, q_scale=8.0, empty_from=empty_from)


def _decode_tables(monkeypatch, decoded: bool) -> None:
    """Makes every unsplit FP8 call ask for the decoded-table workspace (decoded) or none.

    On CUDA (SM90) the kernel then copies its tiles from the tables decoded once, or decodes
    them itself; on CPU, where no workspace is otherwise asked for, the handler is given one and
    must leave the result unchanged.
    """
    monkeypatch.setattr(attn_ffi, "_DECODE_MIN_READS", 0 if decoded else 10 ** 9)
    if decoded and jax.default_backend() == "cpu":
        monkeypatch.setattr(ffi_kernels, "decoded_tables_served", lambda platform: True)


@pytest.mark.parametrize("decoded", [False, True])
@pytest.mark.parametrize("comp_slots", [20, 60, 120, 400])
def test_fp8_attention_unsplit_over_odd_and_even_tile_counts_matches_the_reference(monkeypatch, comp_slots,
                                                                                   decoded):
    # One part a query (as prefill), the model's FP8 layout: 40 window slots plus 20 / 60 / 120 /
    # 400 pool slots are 1 / 2 / 3 / 7 of the CUDA kernel's 64-row tiles, odd and even counts (a
    # schedule that pairs tiles, as bench/experiments' alternating-tile patch, then meets an
    # empty last tile); q scaled so that the running max moves between tiles by many octaves.
    # Both of the SM90 kernel's modes: tiles decoded by its producer, or copied from the tables
    # decoded once (`decoded`).
    monkeypatch.setattr(attn_ffi, "split_parts", lambda q, slots: 1)
    _decode_tables(monkeypatch, decoded)
    _check_bf16_attention(np.random.default_rng(comp_slots), EntryFormat.KV_FP8, 64, 512, 64, 5, comp_rows=600,
                          comp_slots=comp_slots, q_scale=8.0)


@pytest.mark.parametrize("decoded", [False, True])
@pytest.mark.parametrize("n, t, comp_slots", [(64, 300, 120), (70, 300, 400), (64, 133, 20)])
def test_fp8_attention_unsplit_over_more_queries_than_multiprocessors_matches_the_reference(
        monkeypatch, n, t, comp_slots, decoded):
    # One part a query, the model's FP8 layout, more (query, 64-head) items than an H200's 132
    # multiprocessors: the case in which a persistent CUDA kernel (one block a multiprocessor,
    # over items b, b + 132, ...; bench/experiments/2026-12-04_attention_producer_persistent.patch)
    # carries its slot ring and tile buffers from one item to the next: 40
    # window plus 120 pool slots are three 64-row tiles (two pairs, the last tile empty); 70
    # heads make two items a query (the second with 6 heads) over 7 tiles; 133 queries of one
    # tile give block 0 alone a second item. Both modes of the SM90 kernel (`decoded`).
    monkeypatch.setattr(attn_ffi, "split_parts", lambda q, slots: 1)
    _decode_tables(monkeypatch, decoded)
    _check_bf16_attention(np.random.default_rng(t + comp_slots), EntryFormat.KV_FP8, n, 512, 64, t, comp_rows=600,
                          comp_slots=comp_slots, q_scale=4.0)


@pytest.mark.parametrize("ring_fmt, fresh_fmt, pool_fmt", [
    (EntryFormat.KV_FP8, EntryFormat.DENSE, EntryFormat.KV_FP8),  # FP8 ring and pool, bf16 fresh rows
    (EntryFormat.DENSE, EntryFormat.DENSE, EntryFormat.KV_FP8),   # bf16 window, FP8 pool
    (EntryFormat.KV_FP8, EntryFormat.KV_FP8, EntryFormat.DENSE),  # FP8 window, bf16 pool
])
@pytest.mark.parametrize("t", [2, 40])
def test_attention_over_mixed_fp8_and_bf16_tables_matches_the_reference(ring_fmt, fresh_fmt, pool_fmt, t):
    # Each selected row is decoded in its own table's format; on CUDA the tensor-core kernel
    # stages rows of different stored widths (576 vs 1024 bytes here) in one tile.
    rng = np.random.default_rng(t)
    n, h, rope = 64, 512, 64
    ring = _table(rng, ring_fmt, 50, h, rope, jnp.bfloat16)
    fresh_like = _table(rng, fresh_fmt, 1, h, rope, jnp.bfloat16)
    fresh = EntryTable.from_values(jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16), like=fresh_like)
    pool = _table(rng, pool_fmt, 70, h, rope, jnp.bfloat16, scale=2.0)
    window_idx = jnp.asarray(_window_idx(rng, t, 40, ring.rows, t))
    comp_idx = jnp.asarray(_comp_idx(rng, t, 30, pool.rows))
    q = jnp.asarray(rng.normal(size=(t, n, h)), jnp.bfloat16)
    sink = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
    args = (q, (ring, fresh), window_idx, pool, comp_idx, sink, h ** -0.5)
    _close(jax.jit(attn_ffi.sparse_attention_paged, static_argnums=6)(*args),
           ref_sparse_attention_paged(*args), jnp.bfloat16)


def test_the_decoded_table_workspace_is_asked_for_only_where_rows_are_read_often(monkeypatch):
    monkeypatch.setattr(ffi_kernels, "decoded_tables_served", lambda platform: True)
    sds = jax.ShapeDtypeStruct
    q = lambda t, dtype=jnp.bfloat16: sds((t, 64, 512), dtype)  # noqa: E731
    fp8 = lambda rows: (sds((rows, 448), jnp.float8_e4m3fn), sds((rows, 7), jnp.uint8),  # noqa: E731
                        sds((rows, 64), jnp.bfloat16))
    dense = lambda rows: (sds((rows, 512), jnp.bfloat16), sds((rows, 0), jnp.uint8),  # noqa: E731
                          sds((rows, 0), jnp.bfloat16))
    tables = (fp8(134), fp8(4096), fp8(1024))  # ring, fresh, pool: 5254 rows
    assert attn_ffi.decoded_rows(q(4096), tables, 640, 1) == 5254  # each row read ~500 times
    assert attn_ffi.decoded_rows(q(64), tables, 640, 1) == 0  # ~8 reads a row: not quite enough
    assert attn_ffi.decoded_rows(q(66), tables, 640, 1) == 5254
    assert attn_ffi.decoded_rows(q(4096), tables, 640, 2) == 0  # split (decode)
    assert attn_ffi.decoded_rows(q(4096, jnp.float32), tables, 640, 1) == 0
    assert attn_ffi.decoded_rows(q(4096), (fp8(134), dense(4096), fp8(1024)), 640, 1) == 0  # not all FP8
    assert attn_ffi.decoded_rows(q(4096), (fp8(134), fp8(4096), dense(0)), 640, 1) == 4230  # no pool
    assert attn_ffi.decoded_rows(q(1 << 16), (fp8(1), fp8(0), fp8(1 << 18)), 640, 1) == 0  # over 256 MiB
    assert attn_ffi.decoded_rows(q(1 << 16), (fp8(0), fp8(0), fp8(1 << 18)), 640, 1) == 1 << 18  # at it
    monkeypatch.setattr(ffi_kernels, "decoded_tables_served", lambda platform: False)
    assert attn_ffi.decoded_rows(q(4096), tables, 640, 1) == 0  # off CUDA, or a GPU other than SM90


def test_a_decoded_table_workspace_of_the_wrong_rows_is_refused(monkeypatch):
    # The workspace is all the tables' rows or none: the handler (CPU here, CUDA on the device)
    # rejects any other size rather than read or write past it.
    monkeypatch.setattr(attn_ffi, "decoded_rows", lambda q, tables, slots, parts: 3)
    with pytest.raises(Exception, match="decoded-table workspace must be"):
        _check_bf16_attention(np.random.default_rng(0), EntryFormat.KV_FP8, 64, 512, 64, 2, comp_rows=20,
                              comp_slots=10)


def test_decode_splits_each_query_until_the_gpu_is_busy(monkeypatch):
    monkeypatch.setattr(ffi_kernels, "multiprocessors", lambda platform: 132)
    q = lambda t, n=64, h=512, dtype=jnp.bfloat16: jax.ShapeDtypeStruct((t, n, h), dtype)  # noqa: E731
    assert attn_ffi.split_parts(q(1), 640) == 20  # one 32-row tile per part
    assert attn_ffi.split_parts(q(32), 640) == 4  # 128 blocks: one wave (5 parts would need two)
    assert attn_ffi.split_parts(q(64), 640) == 2
    assert attn_ffi.split_parts(q(32, n=128), 640) == 2  # two head blocks per query
    assert attn_ffi.split_parts(q(100), 640) == 1  # 100 blocks already in one wave
    assert attn_ffi.split_parts(q(200), 640) == 1  # prefill fills the GPU unsplit
    assert attn_ffi.split_parts(q(1, dtype=jnp.float32), 640) == 1  # the scalar kernel does not split
    assert attn_ffi.split_parts(q(1, h=80), 640) == 1
    monkeypatch.setattr(ffi_kernels, "multiprocessors", lambda platform: None)
    assert attn_ffi.split_parts(q(1), 640) == 1  # off CUDA


@pytest.mark.parametrize("parts", [3, 12])
def test_a_split_scratch_leaves_the_result_unchanged(monkeypatch, parts):
    # On CUDA up to 8 split parts run as one cluster and merge on chip; 12 (of 380 slots: twelve
    # 32-row tiles) go through the scratch and CombineSplitsKernel. Every library accepts the scratch.
    rng = np.random.default_rng(8)
    t, n, h, rope = 2, 6, 64, 16
    ring = _table(rng, EntryFormat.KV_FP8, 400, h, rope, jnp.bfloat16)
    fresh = EntryTable.from_values(jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16), like=ring)
    window_idx = jnp.asarray(_window_idx(rng, t, 380, ring.rows, t))
    q = jnp.asarray(rng.normal(size=(t, n, h)), jnp.bfloat16)
    sink = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
    args = (q, (ring, fresh), window_idx, None, None, sink, h ** -0.5)
    monkeypatch.setattr(attn_ffi, "split_parts", lambda q, slots: parts)
    _close(attn_ffi.sparse_attention_paged(*args), ref_sparse_attention_paged(*args), jnp.bfloat16)


def test_sparse_attention_paged_with_nothing_selected_is_zero():
    rng = np.random.default_rng(0)
    ring = _table(rng, EntryFormat.KV_FP8, 4, 40, 8, jnp.float32)
    fresh = EntryTable.from_values(jnp.ones((2, 40)), like=ring)
    q = jnp.asarray(rng.normal(size=(2, 3, 40)), jnp.float32)
    out = attn_ffi.sparse_attention_paged(q, (ring, fresh), jnp.full((2, 5), -1, jnp.int32), ring,
                                          jnp.full((2, 3), -1, jnp.int32), jnp.zeros((3,)), 0.1)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_whole_sequence_sparse_attention_matches_the_reference(dtype):
    rng = np.random.default_rng(5)
    b, t, n, h, s, x = 2, 7, 3, 24, 9, 5
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), dtype)
    kv = jnp.asarray(rng.normal(size=(b, s, h)), dtype)
    idx = np.full((b, t, x), -1, np.int32)
    for bi in range(b):
        for ti in range(1, t):  # query 0 of each row selects nothing
            m = rng.integers(1, x + 1)
            idx[bi, ti, rng.choice(x, m, replace=False)] = rng.choice(s, m, replace=False)
    sink = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
    want = ref_sparse_attention(q, kv, jnp.asarray(idx), sink, 0.3)
    got = attn_ffi.sparse_attention(q, kv, jnp.asarray(idx), sink, 0.3)
    _close(got, want, dtype)


# ---------------------------------------------------------------- indexer top-k


def _indexer_case(rng, fmt, dtype, t, pages, epp, rows):
    i, j = 4, 64
    keys = _table(rng, fmt, rows, j, 0, dtype)
    q = jnp.asarray(rng.normal(size=(t, i, j)), dtype)
    w = jnp.asarray(rng.normal(size=(t, i)), jnp.float32)
    # Distinct pages per query; page 7 runs past the 30 rows (clipped reads), -1 is unallocated.
    page_table = np.stack([rng.permutation(8)[:pages] for _ in range(t)]).astype(np.int32)
    page_table[1, 0] = -1
    return q, w, keys, jnp.asarray(page_table)


@pytest.mark.parametrize("fmt", INDEX_FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("topk", [3, 16, 40])  # 40 > S: the output keeps min(topk, S) slots
def test_indexer_topk_paged_matches_the_reference(fmt, dtype, topk):
    rng = np.random.default_rng(topk)
    t, pages, epp = 6, 6, 4
    q, w, keys, page_table = _indexer_case(rng, fmt, dtype, t, pages, epp, rows=30)
    limit = jnp.asarray([0, 3, 5, 24, 30, 17], jnp.int32)  # none visible, a few, some, all, past S
    want = ref_indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    got = jax.jit(indexer_ffi.indexer_topk_paged, static_argnums=(4, 6))(q, w, keys, page_table, epp, limit, topk)
    assert got.shape == want.shape == (t, min(topk, pages * epp))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (np.asarray(got)[0] == -1).all()


def _indexer_mode(monkeypatch, mode: str) -> None:
    """Makes the handler score through a [T, S] scratch ("scored") or stream each query's scores
    into its selection on chip ("fused"), whatever the shapes would pick."""
    monkeypatch.setattr(ffi_kernels, "indexer_scratch_columns",
                        lambda platform, t, s, i, j: s if mode == "scored" else 0)


@pytest.mark.parametrize("mode", ["fused", "scored"])
@pytest.mark.parametrize("fmt", [EntryFormat.INDEX_FP8, EntryFormat.INDEX_FP4])
@pytest.mark.parametrize("topk", [16, 100])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])  # CUDA: tensor-core / scalar scorer
def test_indexer_topk_fused_and_scored_modes_match_the_reference(monkeypatch, mode, fmt, topk, dtype):
    # Fused: each query's scores stay on chip. Scored: the scores go through a [T, S] scratch
    # (on CUDA a separate pass over many blocks, as for decode). 160 candidates are three
    # 64-candidate tiles, the last one partial; repeated pages give equal scores, so the
    # selection must break ties by candidate. FP4 keys of dim 128 are the model's layout,
    # which the CUDA tensor-core scorer reads on a path of its own.
    _indexer_mode(monkeypatch, mode)
    rng = np.random.default_rng(topk)
    t, pages, epp = 5, 10, 16
    j = 128 if fmt is EntryFormat.INDEX_FP4 else 64
    keys = _table(rng, fmt, 8 * epp, j, 0, dtype)
    q = jnp.asarray(rng.normal(size=(t, 4, j)), dtype)
    w = jnp.asarray(rng.normal(size=(t, 4)), jnp.float32)
    page_table = rng.integers(0, 9, size=(t, pages)).astype(np.int32)  # page 8 is past the table: clipped
    page_table[2, 3] = -1
    limit = jnp.asarray([0, 70, 130, 160, 200], jnp.int32)
    want = ref_indexer_topk_paged(q, w, keys, jnp.asarray(page_table), epp, limit, topk)
    got = indexer_ffi.indexer_topk_paged(q, w, keys, jnp.asarray(page_table), epp, limit, topk)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("mode", ["fused", "scored"])
@pytest.mark.parametrize("topk", [100, 2048])
def test_indexer_topk_keeps_up_to_2048_of_thousands_with_ties(monkeypatch, mode, topk):
    # Up to the most the CUDA kernel keeps (2048), from visible counts on both sides of it (and
    # none, and fewer than topk) in one call; 48 pages drawn from 12 make every score appear
    # several times, so ties at the radix threshold are split by candidate.
    _indexer_mode(monkeypatch, mode)
    rng = np.random.default_rng(topk)
    t, pages, epp = 5, 48, 64
    keys = _table(rng, EntryFormat.INDEX_FP4, 12 * epp, 128, 0, jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(t, 4, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(t, 4)), jnp.float32)
    page_table = jnp.asarray(rng.integers(0, 12, size=(t, pages)), jnp.int32)
    limit = jnp.asarray([2048, 2049, 3071, 0, 1000], jnp.int32)
    want = ref_indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    got = indexer_ffi.indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("t", [5, 600])  # on CUDA: one query a block; two (at least 4 queries a multiprocessor)
def test_indexer_topk_keeps_a_top_k_just_above_a_power_of_two(monkeypatch, t):
    # The kept keys are sorted in place padded to a power of two: 1100 to 2048, the most
    # padding a k needs, which a selection pool must hold. (On SM90 the RS kernel's pools are
    # smaller and the host gives such k to the mma.sync kernels instead.) Integer q and w make
    # every score exact, so ties (many) go to the lower candidate in both.
    _indexer_mode(monkeypatch, "fused")
    rng = np.random.default_rng(t)
    i, pages, epp, topk = 8, 24, 64, 1100
    keys = _table(rng, EntryFormat.INDEX_FP4, pages * epp, 128, 0, jnp.bfloat16, scale=4.0)
    q = jnp.asarray(rng.integers(-4, 5, size=(t, i, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.integers(-3, 4, size=(t, i)), jnp.float32)
    page_table = jnp.asarray(np.tile(rng.permutation(pages), (t, 1)), jnp.int32)  # one request: pairs
    limit = rng.integers(topk, pages * epp + 1, size=t)
    limit[::4] = rng.integers(0, topk, size=len(limit[::4]))  # and fewer visible than k
    limit = jnp.asarray(limit, jnp.int32)
    want = ref_indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    got = indexer_ffi.indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("mode", ["fused", "scored"])
@pytest.mark.parametrize("key_scale, mixed", [(4.0, True), (1e30, False)])
def test_indexer_topk_fp4_keys_with_large_scales(monkeypatch, mode, key_scale, mixed):
    # The CUDA decode of the model's FP4 keys scales in one bf16 multiply while 2^(s - 1) is a
    # bf16 (E8M0 byte s <= 128) and in two above: keys scaled to both sides of that bound (and
    # mixed within a tile) must give the reference's ids.
    _indexer_mode(monkeypatch, mode)
    rng = np.random.default_rng(9)
    t, pages, epp = 3, 4, 32
    keys = _table(rng, EntryFormat.INDEX_FP4, pages * epp, 128, 0, jnp.bfloat16, scale=key_scale)
    scale_bytes = np.asarray(keys.arrays[1])
    assert (scale_bytes > 128).any() and (scale_bytes <= 128).any() == mixed
    q = jnp.asarray(rng.normal(size=(t, 4, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(t, 4)), jnp.float32)
    page_table = jnp.asarray(np.stack([rng.permutation(pages) for _ in range(t)]), jnp.int32)
    limit = jnp.asarray([pages * epp, 100, 40], jnp.int32)
    want = ref_indexer_topk_paged(q, w, keys, page_table, epp, limit, 32)
    got = indexer_ffi.indexer_topk_paged(q, w, keys, page_table, epp, limit, 32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("ascending", [True, False])
def test_indexer_topk_streams_a_long_context_through_its_pool(monkeypatch, ascending):
    # 64k candidates per query, fused: on CUDA one block per query streams them through a pool
    # of k + 1024 keys in shared memory and compacts it to its k largest whenever it may fill.
    # Keys whose scores ascend with the candidate (for query 0, whose pages are in order) make
    # many candidates join (each new level of the quantised scores beats the whole pool), so
    # many compactions; random keys few. The ascending scores tie in long runs (FP8 keys), which
    # the selection must split by candidate.
    _indexer_mode(monkeypatch, "fused")
    rng = np.random.default_rng(6)
    i, j, epp, topk, pages = 2, 32, 1024, 64, 64
    rows = pages * epp
    values = rng.normal(size=(rows, j))
    if ascending:
        values = np.linspace(0.01, 1.0, rows)[:, None] + 0.001 * values
    keys = EntryTable.zeros(rows, j, EntryFormat.INDEX_FP8, 0, jnp.bfloat16).write(
        jnp.arange(rows), jnp.asarray(values, jnp.bfloat16))
    q = jnp.asarray(np.abs(rng.normal(size=(2, i, j))), jnp.bfloat16)
    w = jnp.asarray(np.abs(rng.normal(size=(2, i))), jnp.float32)
    page_table = jnp.asarray(np.stack([np.arange(pages), rng.permutation(pages)]), jnp.int32)
    limit = jnp.asarray([rows, rows - 100], jnp.int32)
    want = ref_indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    got = indexer_ffi.indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("heads", [8, 64])  # padded to the tensor-core tile's 64, and FLASH's count
def test_indexer_topk_pairs_a_requests_queries_on_a_long_chunk(monkeypatch, heads):
    # On CUDA a fused call with at least 4 queries a multiprocessor (a prefill chunk) scores
    # queries 2b and 2b + 1 in one block, sharing each decoded FP4 key tile, when their page
    # rows agree over what they see; otherwise one after the other. Here three requests of 301,
    # 200 and 300 queries (801: the last block has one query): the second's rows agree with the
    # first's on the first two pages only and its limits stay within them, so pair (300, 301)
    # spans two requests and is scored together; pair (500, 501) is not. Causal limits differ
    # within pairs, and every seventh query sees nothing. (On SM90 paired queries are scored
    # with wgmma, elsewhere with mma.sync.)
    _indexer_mode(monkeypatch, "fused")
    rng = np.random.default_rng(11)
    t, i, pages, epp, topk = 801, heads, 16, 32, 64
    keys = _table(rng, EntryFormat.INDEX_FP4, 40 * epp, 128, 0, jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(t, i, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(t, i)), jnp.float32)
    first, last = rng.permutation(40)[:pages], rng.permutation(40)[:pages]
    second = np.concatenate([first[:2], rng.permutation(40)[:pages - 2]])
    request = np.repeat([0, 1, 2], [301, 200, 300])
    page_table = jnp.asarray(np.stack([(first, second, last)[r] for r in request]), jnp.int32)
    limit = rng.integers(0, pages * epp + 1, size=t)
    limit[request == 1] = rng.integers(0, 2 * epp + 1, size=200)
    limit[300] = 50
    limit[::7] = 0
    limit = jnp.asarray(limit, jnp.int32)
    want = ref_indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    got = indexer_ffi.indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("epp", [48, 96])
def test_indexer_topk_pairs_follow_pages_of_any_size(monkeypatch, epp):
    # The paired kernel (CUDA, at least 4 queries a multiprocessor) follows each thread's
    # candidate from one 64-candidate tile to the next by additions to its page and offset:
    # pages of 48 or 96 entries put the tiles' boundaries at changing offsets within a page. An
    # unallocated page (-1) and a page past the table's rows read its last row (the reference's
    # clipped gather). Keys scaled so that some E8M0 bytes exceed 128 (the FP4 decode's second
    # multiply), mixed within tiles. One request: every pair is scored together.
    # q and w are small integers, so every score is exact in float32 whatever the order of its
    # sums: the ids must match exactly, ties going to the lower candidate. (With normal q and w,
    # two scores of query 24 at epp 48 lie 7e-6 apart, under float32's step at 141, and the
    # kernel's order of sums and the reference's round them to opposite orders.)
    _indexer_mode(monkeypatch, "fused")
    rng = np.random.default_rng(epp)
    t, i, pages, stored, topk = 600, 8, 12, 10, 64
    keys = _table(rng, EntryFormat.INDEX_FP4, stored * epp, 128, 0, jnp.bfloat16, scale=4.0)
    scale_bytes = np.asarray(keys.arrays[1])
    assert (scale_bytes > 128).any() and (scale_bytes <= 128).any()
    q = jnp.asarray(rng.integers(-4, 5, size=(t, i, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.integers(-3, 4, size=(t, i)), jnp.float32)
    row = np.concatenate([rng.permutation(stored), [-1, stored]])  # 12 pages, two without rows
    rng.shuffle(row)
    page_table = jnp.asarray(np.tile(row, (t, 1)), jnp.int32)
    limit = rng.integers(0, pages * epp + 1, size=t)
    limit[::5] = pages * epp
    limit = jnp.asarray(limit, jnp.int32)
    want = ref_indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    got = indexer_ffi.indexer_topk_paged(q, w, keys, page_table, epp, limit, topk)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_indexer_topk_ties_go_to_the_lower_candidate():
    # Negative dots give every candidate a zero score after the ReLU: an all-tie row.
    q = -jnp.ones((1, 2, 32), jnp.float32)
    keys = EntryTable.zeros(4, 32, EntryFormat.DENSE, 0, jnp.float32).write(jnp.arange(4), jnp.ones((4, 32)))
    got = indexer_ffi.indexer_topk_paged(q, jnp.ones((1, 2)), keys, jnp.asarray([[1, 0]], jnp.int32), 2,
                                         jnp.asarray([3]), 3)
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, 2]])


def test_whole_sequence_indexer_topk_matches_the_reference():
    rng = np.random.default_rng(9)
    b, t, i, j, s = 2, 8, 3, 32, 8
    q = jnp.asarray(rng.normal(size=(b, t, i, j)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, j)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, i)), jnp.float32)
    limit = jnp.asarray((np.arange(t)[None] + 1) // 2 * np.ones((b, 1), np.int32), jnp.int32)
    for topk in (2, 5, 12):
        want = ref_indexer_topk(q, k, w, limit, topk)
        got = indexer_ffi.indexer_topk(q, k, w, limit, topk)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert indexer_ffi.indexer_topk(q, k[:, :0], w, limit * 0, 4).shape == (b, t, 0)


# ---------------------------------------------------------------- fp8_linear


def _fp8_weight(rng, n, k):
    """An FP8 weight [N, K] with its 128 x 128 E8M0 scales spread over many octaves."""
    w = rng.normal(size=(n, k)) * np.exp(rng.uniform(-3, 3, size=(n, 1)))
    return quant.quant_fp8_block(jnp.asarray(w, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead, k, n", [((1,), 64, 48), ((5,), 256, 130), ((2, 3), 200, 256), ((17,), 384, 7),
                                        ((3, 24), 160, 130), ((40,), 200, 64)])
def test_fp8_linear_matches_the_reference(dtype, lead, k, n):
    # K and N on and off the 128 blocks; activations whose 128-blocks differ by many octaves
    # (each its own act_quant scale), and one all-zero block (the floored scale).
    from dsv4.ops.fp8_linear import ffi as fp8_ffi, reference as fp8_ref

    rng = np.random.default_rng(k + n)
    w, ws = _fp8_weight(rng, n, k)
    x = rng.normal(size=lead + (k,)) * np.exp(rng.uniform(-4, 4, size=lead + (k,)))
    x[..., :min(k, 128)] *= 0.0 if k > 128 else 1.0
    x = jnp.asarray(x, dtype)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        want = jax.jit(fp8_ref.fp8_linear, static_argnums=3)(x, w, ws, out_dtype)
        got = jax.jit(fp8_ffi.fp8_linear, static_argnums=3)(x, w, ws, out_dtype)
        assert got.dtype == want.dtype == out_dtype and got.shape == want.shape == lead + (n,)
        # Sums in another order: within the tolerance of the largest output (outputs that
        # cancel to near zero keep the absolute error of the terms they sum).
        tol = 1e-5 if out_dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=tol,
                                   atol=tol * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


def test_fp8_linear_quantises_its_input_and_refuses_bad_shapes():
    from dsv4.ops.fp8_linear import ffi as fp8_ffi

    rng = np.random.default_rng(3)
    w, ws = _fp8_weight(rng, 16, 128)
    x = jnp.asarray(rng.normal(size=(4, 128)), jnp.float32)
    got = jax.jit(fp8_ffi.fp8_linear, static_argnums=3)(x, w, ws, jnp.float32)
    exact = x @ quant.dequant_fp8_block(w, ws, jnp.float32).T  # no activation quantisation
    assert not np.allclose(np.asarray(got), np.asarray(exact), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="weight must be"):
        jax.jit(fp8_ffi.fp8_linear, static_argnums=3)(x[:, :64], w, ws, jnp.float32)
    if kernel_built(fp8_ffi.TARGET):  # the kernel checks its operands too
        call = jax.ffi.ffi_call(fp8_ffi.TARGET, jax.ShapeDtypeStruct((4, 16), jnp.float32), vmap_method="sequential")
        with pytest.raises(Exception, match="weight must be"):
            jax.jit(call)(x[:, :64], w, ws).block_until_ready()


# ---------------------------------------------------------------- moe_experts


def _expert_stack(rng, fmt, e, out, inner, scale=0.2):
    from dsv4.config import WeightFormat
    from dsv4.ops.moe_experts import ExpertStack

    m = jnp.asarray(rng.normal(size=(e, out, inner)) * scale * np.exp(rng.uniform(-1, 1, (e, out, 1))), jnp.float32)
    return ExpertStack(*(quant.quant_fp4(m) if fmt is WeightFormat.FP4 else quant.quant_fp8_block(m)), fmt)


MOE_ROUTINGS = {
    "random": lambda rng, t, e, k: np.stack([rng.choice(e, k, replace=False) for _ in range(t)]),
    "hot": lambda rng, t, e, k: np.concatenate([np.zeros((t, 1), int), rng.integers(1, e, (t, k - 1))], axis=1),
    # -1 padding, ids past E (another device's experts), and a token's slots repeating one
    # expert: each slot counts on its own, as on every reference path.
    "edges": lambda rng, t, e, k: np.where(rng.random((t, k)) < 0.3, rng.choice([-1, e, e + 3], (t, k)),
                                           np.repeat(rng.integers(0, e, (t, 1)), k, axis=1)),
}


@pytest.mark.parametrize("routing", sorted(MOE_ROUTINGS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt_name", ["FP4", "FP8"])
@pytest.mark.parametrize("t", [1, 13, 30, 200])  # CUDA: per token; grouped in tiles of 8, 16 and 32
def test_moe_experts_matches_the_reference(routing, dtype, fmt_name, t):
    # Shapes off the 128 blocks (D 192 = 1.5 blocks, F 160); a SwiGLU limit the random gates
    # and ups cross on both sides; experts that get no token, or every token ("hot").
    from dsv4.config import WeightFormat
    from dsv4.ops.moe_experts import ffi as moe_ffi, moe_experts_loop

    fmt = WeightFormat[fmt_name]
    rng = np.random.default_rng([t, len(routing), len(fmt_name)])
    e, k, d, f, limit = 6, 3, 192, 160, 1.5
    w1, w3, w2 = (_expert_stack(rng, fmt, e, *shape) for shape in ((f, d), (f, d), (d, f)))
    x = jnp.asarray(rng.normal(size=(t, d)) * np.exp(rng.uniform(-2, 2, (t, 1))), dtype)
    sel = jnp.asarray(MOE_ROUTINGS[routing](rng, t, e, k), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    run = {name: jax.jit(op, static_argnames=("limit", "act_quant")) for name, op in
           (("ffi", moe_ffi.moe_experts), ("loop", moe_experts_loop))}
    want = run["loop"](x, sel, w, w1, w3, w2, limit=limit, act_quant=True)
    got = run["ffi"](x, sel, w, w1, w3, w2, limit=limit, act_quant=True)
    assert got.dtype == want.dtype == jnp.float32 and got.shape == want.shape == (t, d)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol * float(jnp.max(jnp.abs(want))))
    if routing == "edges":
        away = ~np.any((np.asarray(sel) >= 0) & (np.asarray(sel) < e), axis=1)
        assert (np.asarray(got)[away] == 0).all()


@pytest.mark.parametrize("routing", sorted(MOE_ROUTINGS))
@pytest.mark.parametrize("t, e, k, tile", [(1, 6, 3, 8), (13, 6, 3, 8), (200, 6, 3, 32), (40, 256, 6, 8)])
def test_the_routing_plan_tiles_every_local_assignment_once(routing, t, e, k, tile):
    # The kernel's view of the plan (FindTile in moe_experts_cuda.cu): tile b belongs to the first
    # expert whose running tile count exceeds b, and covers up to `tile` of its sorted assignments.
    from dsv4.ops.moe_experts.ffi import max_tiles, routing_plan

    sel = MOE_ROUTINGS[routing](np.random.default_rng(t), t, e, k)
    order, groups = (np.asarray(a) for a in routing_plan(jnp.asarray(sel, jnp.int32), e, tile))
    seen = []
    for b in range(max_tiles(t * k, e, tile)):
        expert = int(np.searchsorted(groups[:, 2], b, side="right"))
        if expert == e:
            continue
        first, count, tiles_end = groups[expert]
        local = b - (tiles_end - -(-count // tile))
        tile_ids = order[first + local * tile: first + min((local + 1) * tile, count)]
        assert 0 < len(tile_ids) <= tile and (sel.reshape(-1)[tile_ids] == expert).all()
        seen.extend(tile_ids.tolist())
    local_ids = np.flatnonzero((sel.reshape(-1) >= 0) & (sel.reshape(-1) < e))
    assert sorted(seen) == local_ids.tolist()


def test_moe_experts_without_act_quant_or_with_dense_weights_is_the_reference():
    from dsv4.ops.moe_experts import ExpertStack, ffi as moe_ffi, moe_experts

    rng = np.random.default_rng(2)
    stacks = [ExpertStack.dense_stack(jnp.asarray(rng.normal(size=s), jnp.float32)) for s in ((4, 8, 16),) * 2]
    stacks.append(ExpertStack.dense_stack(jnp.asarray(rng.normal(size=(4, 16, 8)), jnp.float32)))
    x = jnp.asarray(rng.normal(size=(3, 16)), jnp.float32)
    sel, w = jnp.asarray([[0, 1], [2, 3], [1, 1]], jnp.int32), jnp.ones((3, 2), jnp.float32)
    for act_quant in (False, True):
        np.testing.assert_array_equal(np.asarray(moe_ffi.moe_experts(x, sel, w, *stacks, 2.0, act_quant)),
                                      np.asarray(moe_experts(x, sel, w, *stacks, 2.0, act_quant)))


# ---------------------------------------------------------------- the whole model


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The same tiny fake-quant checkpoint loaded with the reference and the FFI backends."""
    from checkpoints.testing import write_tiny_checkpoint
    import dsv4
    from dsv4.config import TINY

    cfg = TINY.replace(fake_quant=True)
    path = tmp_path_factory.mktemp("ffi_ckpt")
    write_tiny_checkpoint(cfg, path, seed=7, quantized=True, float_dtype="F32")
    return {b: dsv4.load_pretrained(path, dtype="float32", quantized=True, fake_quant=True, backend=b)
            for b in ("reference", "ffi")}


def _step_logits(model, kv, idx, seqs):
    import math

    from dsv4.batch import Bucket
    from dsv4.state import StateGeometry
    from tests.decode_driver import MIXED_SCHEDULE, Driver, run_schedule

    page, max_len = 16, 128
    per_seq = math.ceil(max_len / page)
    geometry = StateGeometry(num_slots=2, num_pages=2 * per_seq, page_tokens=page, max_pages_per_seq=per_seq,
                             max_spec_tokens=2, dtype=jnp.float32, kv_format=kv, index_format=idx)
    driver = Driver(model, geometry, Bucket(tokens=64, requests=2, outputs=64))
    return run_schedule(driver, seqs, MIXED_SCHEDULE), driver.state


def test_the_model_with_backend_ffi_gives_the_reference_logits(tiny_pair):
    from dsv4.state import IndexKeyFormat, KVFormat
    from tests.tolerances import assert_close_up_to_quant_flips

    rng = np.random.default_rng(5)
    cfg = tiny_pair["reference"].config
    seqs = [rng.integers(0, cfg.vocab_size, n) for n in (75, 50)]
    ids = np.zeros((2, 75), np.int32)
    ids[0], ids[1, :50] = seqs[0], seqs[1]
    want = np.asarray(tiny_pair["reference"].logits(ids))
    got = np.asarray(tiny_pair["ffi"].logits(ids))
    assert_close_up_to_quant_flips(got, want)  # fake_quant: activations are quantised (act_quant)
    for kv, idx in [(KVFormat.DENSE, IndexKeyFormat.DENSE), (KVFormat.FP8, IndexKeyFormat.FP4),
                    (KVFormat.FP8, IndexKeyFormat.FP8)]:
        want, want_state = _step_logits(tiny_pair["reference"], kv, idx, seqs)
        got, got_state = _step_logits(tiny_pair["ffi"], kv, idx, seqs)
        for a, b in zip(got, want):
            assert_close_up_to_quant_flips(a, b)
        # The first layer's stored window holds the same entries (its writes are bit-exact at the
        # op level; here wkv's FP8 GEMM sums in the kernel's order, and a FP8-stored entry may
        # then round across a grid step).
        rows = np.arange(got_state[0].window.rows)
        assert_close_up_to_quant_flips(got_state[0].window.gather(rows), want_state[0].window.gather(rows))


def test_generate_with_backend_ffi_gives_the_reference_tokens(tiny_pair):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, tiny_pair["reference"].config.vocab_size, n).tolist() for n in (3, 40)]
    want = tiny_pair["reference"].generate(prompts, 12, max_num_seqs=2, max_num_batched_tokens=32)
    got = tiny_pair["ffi"].generate(prompts, 12, max_num_seqs=2, max_num_batched_tokens=32)
    assert got == want


@pytest.mark.parametrize("deployment, sizes", [("tp", (4,)), ("dp_tp", (2, 2))])
def test_backend_ffi_on_a_mesh_runs_shard_locally_and_generates_like_one_device(tmp_path, deployment, sizes):
    import math

    import dsv4
    from checkpoints.testing import write_tiny_checkpoint
    from dsv4 import sharding as sh
    from tests.test_sharding import SHARDABLE_TINY
    from tests.devices import require_devices
    from tests.tolerances import REL

    require_devices(math.prod(sizes))
    write_tiny_checkpoint(SHARDABLE_TINY, tmp_path, seed=5)
    placement = sh.Placement(sh.make_mesh(sh.Deployment(deployment), sizes), sh.Deployment(deployment))
    local = placement.shard_ops(ops_for("ffi"))
    assert local.sparse_attention_paged is not attn_ffi.sparse_attention_paged  # wrapped in shard_map
    assert placement.shard_ops(ops_for("reference")).sparse_attention_paged is attn_ref.sparse_attention_paged
    plain = dsv4.load_pretrained(tmp_path, dtype="float32")
    sharded = dsv4.load_pretrained(tmp_path, dtype="float32", placement=placement, backend="ffi")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [5] * 20]
    kw = dict(max_num_seqs=2, max_num_batched_tokens=16)
    assert sharded.generate(prompts, 6, **kw) == plain.generate(prompts, 6, **kw)
    want = np.asarray(plain.logits([prompts[0]]))
    err = np.max(np.abs(np.asarray(sharded.logits([prompts[0]])) - want)) / np.max(np.abs(want))
    assert err <= REL[np.dtype(np.float32)], err


# ---------------------------------------------------------------- GPU: command buffers

# Run in a fresh process: XLA_FLAGS and the log settings are read once, when the GPU backend starts.
# It prints the name of a dsv4 custom call and whether the compiled HLO already holds command
# buffers (older XLA forms them on HLO); newer XLA forms them on the thunk sequence after the
# HLO, which only its log shows ("Creating command buffer thunk ... with the following thunks").
_COMMAND_BUFFER_CHECK = """
import re, sys
import jax, jax.numpy as jnp, numpy as np
import dsv4
from checkpoints.testing import write_tiny_checkpoint
from dsv4.config import TINY
from dsv4.ops.sparse_attention import ffi as attn_ffi, reference as attn_ref

jax.config.update("jax_default_matmul_precision", "highest")
q = jnp.ones((1, 2, 4, 64), jnp.float32)
kv = jnp.ones((1, 8, 64), jnp.float32)
idx = jnp.zeros((1, 2, 3), jnp.int32)
f, g = [jax.jit(lambda q, kv, m=m: m.sparse_attention(q * 2, kv, idx, jnp.zeros((4,)), 1.0) + 1)
        for m in (attn_ffi, attn_ref)]
text = f.lower(q, kv).compile().as_text()
call = re.search(r'%([\\w.-]+) = [^\\n]*custom_call_target="dsv4_sparse_attention"', text)
assert call, text
print("ffi-call:", call.group(1), "hlo-command-buffer:", "command_buffer" in text, flush=True)
np.testing.assert_allclose(np.asarray(f(q, kv)), np.asarray(g(q, kv)), rtol=1e-6)
cfg = TINY.replace(fake_quant=True)
write_tiny_checkpoint(cfg, sys.argv[1], seed=3, quantized=True, float_dtype="F32")
got, want = [dsv4.load_pretrained(sys.argv[1], dtype="float32", quantized=True, fake_quant=True, backend=b)
             .generate([[1, 2, 3], list(range(5, 40))], 10, max_num_seqs=2, max_num_batched_tokens=32)
             for b in ("ffi", "reference")]
assert got == want, (got, want)
print("ok")
"""


def _captured_in_a_command_buffer(stdout: str, stderr: str) -> bool:
    found = re.search(r"ffi-call: (\S+) hlo-command-buffer: (True|False)", stdout)
    assert found, stdout
    name, on_hlo = found.groups()
    thunk_lines = [line for line in stderr.splitlines() if "Creating command buffer thunk" in line]
    return on_hlo == "True" or any(re.search(rf"\b{re.escape(name)}\b", line) for line in thunk_lines)


@pytest.mark.gpu
def test_the_step_runs_under_command_buffers_and_generates_like_the_reference(tmp_path):
    import os
    import subprocess
    import sys

    flags = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    # No preallocation: this test's own process already holds most of the GPU's memory. The
    # conversion pass's log names the thunks it puts in each command buffer.
    env = dict(os.environ, XLA_FLAGS=" ".join(filter(None, [os.environ.get("XLA_FLAGS"), flags])),
               XLA_PYTHON_CLIENT_PREALLOCATE="false",
               TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_conversion_pass=2",
               PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _COMMAND_BUFFER_CHECK, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    buffer_lines = "\n".join(line[:300] for line in done.stderr.splitlines() if "command buffer" in line.lower())
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr[-3000:]
    assert _captured_in_a_command_buffer(done.stdout, done.stderr), done.stdout + buffer_lines[-3000:]
