"""sparse_attention through the FFI kernel (`dsv4_sparse_attention`, ffi_kernels/csrc): the same
signatures and semantics as `reference.py`, reading the stored tables in their own formats."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import ffi_kernels
from dsv4.ops.ffi_tables import check_platform, codec, dense_table, i32, table_parts
from dsv4.state import EntryTable


# The CUDA kernels' shapes (sparse_attention_cuda.cu): rows per tile (the smallest; the model's
# FP8 layout runs 64-row tiles, and the kernel then cuts fewer parts than asked where a part
# would be less than a tile), heads per block.
_TILE_ROWS, _BLOCK_HEADS = 32, 64

# The decoded-table workspace (sparse_attention_cuda.cu, "decoded tables"): on SM90 an unsplit
# call over tables all in the model's FP8 layout can decode them once into bf16 rows and copy
# its tiles from there, instead of decoding every selected row for every query. It pays where
# rows are read many times (a prefill chunk: the benchmark's 64k chunk reads each ~500 times),
# and it costs a temporary [rows, 512] bf16 buffer, so it is asked for only where each row is
# read at least _DECODE_MIN_READS times on average and the buffer is at most _DECODE_MAX_BYTES
# (a larger pool keeps the per-query decode: same results, slower). Measured on an H100
# (BENCHMARKS.md, 2026-12-06): the decode pass costs ~0.5 ns a row (82k rows in 0.043 ms, ~3
# TB/s), and the workspace saves ~0.18 ns a read (the 64k chunk's 42M reads, 20.84 -> 13.33
# ms), so it breaks even at ~3 reads a row; 8 leaves room for the buffer's memory.
_DECODE_MIN_READS = 8
_DECODE_MAX_BYTES = 256 << 20
_FLASH_FP8 = dict(values=448, scales=7, rope=64, head=512)  # the kernel's FLASH FP8 row layout


def split_parts(q_TNH: jax.Array, slots: int) -> int:
    """How many parts the CUDA kernel splits each query's `slots` selected rows into.

    Decode has few queries: T x ceil(N / 64) blocks would leave most of the GPU's
    multiprocessors idle, so each query's rows are split into as many parts as keep every block
    in one wave (blocks x parts <= multiprocessors: the kernel runs one block per
    multiprocessor, and a second, mostly empty wave would cost as much as the first), at most
    one 32-row tile per part. 1 (unsplit) when the blocks already fill half the GPU, off CUDA,
    or where the tensor-core kernel does not serve (f32 q, head dims not a multiple of 32).
    """
    t, n, h = q_TNH.shape
    sms = ffi_kernels.multiprocessors(ffi_kernels.platform_of(jax.default_backend()))
    if sms is None or q_TNH.dtype != jnp.bfloat16 or h % 32 or t == 0:
        return 1
    blocks = t * -(-n // _BLOCK_HEADS)
    return max(1, min(-(-slots // _TILE_ROWS), sms // blocks))


def decoded_rows(q_TNH: jax.Array, tables: tuple[tuple[jax.Array, jax.Array, jax.Array], ...], slots: int,
                 parts: int) -> int:
    """Rows of the decoded-table workspace the CUDA kernel is given: every table's rows, or 0.

    Nonzero where the CUDA handler uses it (an SM90 GPU: `ffi_kernels.decoded_tables_served`),
    for an unsplit call (`parts` 1) with bf16 q at head dim 512 over tables (values, scales,
    rope) all in the model's FP8 layout (or empty), when the T x `slots` selected rows read each
    table row at least _DECODE_MIN_READS times on average and the [rows, 512] bf16 buffer is at
    most _DECODE_MAX_BYTES.
    """
    t, _, h = q_TNH.shape
    if not ffi_kernels.decoded_tables_served(ffi_kernels.platform_of(jax.default_backend())):
        return 0
    if parts != 1 or q_TNH.dtype != jnp.bfloat16 or h != _FLASH_FP8["head"]:
        return 0
    for values, scales, rope in tables:
        if values.shape[0] and (values.dtype != jnp.float8_e4m3fn or values.shape[1] != _FLASH_FP8["values"]
                                or scales.shape[1] != _FLASH_FP8["scales"] or rope.shape[1] != _FLASH_FP8["rope"]):
            return 0
    rows = sum(values.shape[0] for values, _, _ in tables)
    if rows == 0 or t * slots < _DECODE_MIN_READS * rows or rows * h * 2 > _DECODE_MAX_BYTES:
        return 0
    return rows


def _call(q_TNH, ring, fresh, window_idx_TW, comp, comp_idx_TX, sink_N, scale: float, block: int) -> jax.Array:
    check_platform()
    t, n, h = q_TNH.shape
    slots = window_idx_TW.shape[1] + comp_idx_TX.shape[1]
    parts = split_parts(q_TNH, slots)
    scratch = parts if parts > 1 else 0  # [S, ...] partial outputs, max and denominator; none unsplit
    out = (jax.ShapeDtypeStruct(q_TNH.shape, q_TNH.dtype), jax.ShapeDtypeStruct((scratch, t, n, h), jnp.float32),
           jax.ShapeDtypeStruct((scratch, t, n, 2), jnp.float32),
           jax.ShapeDtypeStruct((decoded_rows(q_TNH, (ring, fresh, comp), slots, parts), h), jnp.bfloat16))
    result, _, _, _ = jax.ffi.ffi_call("dsv4_sparse_attention", out, vmap_method="sequential")(
        q_TNH, *ring, *fresh, window_idx_TW.astype(jnp.int32), *comp, comp_idx_TX.astype(jnp.int32),
        sink_N.astype(jnp.float32), scale=np.float32(scale), block=i32(block))
    return result


def sparse_attention_paged(q_TNH: jax.Array, window: tuple[EntryTable, EntryTable], window_idx_TW: jax.Array,
                           compressed: EntryTable | None, compressed_idx_TX: jax.Array | None,
                           sink_N: jax.Array, scale: float) -> jax.Array:
    """As `reference.sparse_attention_paged`."""
    ring, fresh = window
    t, h = q_TNH.shape[0], q_TNH.shape[-1]
    if compressed is None:
        comp = dense_table(jnp.zeros((0, h), q_TNH.dtype))
        compressed_idx_TX = jnp.zeros((t, 0), jnp.int32)
    else:
        comp = table_parts(compressed)
    blocks = {codec(tb.fmt).block for tb in (ring, fresh, compressed) if tb is not None and len(tb.arrays) > 1}
    if len(blocks) > 1:
        raise ValueError(f"the window and compressed tables use different scale blocks {sorted(blocks)}")
    return _call(q_TNH, table_parts(ring), table_parts(fresh), window_idx_TW, comp, compressed_idx_TX, sink_N,
                 scale, blocks.pop() if blocks else 1)


def sparse_attention(q_BTNH: jax.Array, kv_BSH: jax.Array, idx_BTX: jax.Array, sink_N: jax.Array,
                     scale: float) -> jax.Array:
    """As `reference.sparse_attention`: the keys become one dense table of B x S rows."""
    b, t, n, h = q_BTNH.shape
    s = kv_BSH.shape[1]
    rows = jnp.where(idx_BTX >= 0, idx_BTX + (jnp.arange(b) * s)[:, None, None], -1).reshape(b * t, -1)
    empty = dense_table(jnp.zeros((0, h), kv_BSH.dtype))
    out = _call(q_BTNH.reshape(b * t, n, h), dense_table(kv_BSH.reshape(b * s, h)), empty, rows, empty,
                jnp.zeros((b * t, 0), jnp.int32), sink_N, scale, 1)
    return out.reshape(b, t, n, h)
