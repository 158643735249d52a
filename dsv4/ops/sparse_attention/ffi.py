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


def _call(q_TNH, ring, fresh, window_idx_TW, comp, comp_idx_TX, sink_N, scale: float, block: int) -> jax.Array:
    check_platform()
    t, n, h = q_TNH.shape
    parts = split_parts(q_TNH, window_idx_TW.shape[1] + comp_idx_TX.shape[1])
    scratch = parts if parts > 1 else 0  # [S, ...] partial outputs, max and denominator; none unsplit
    out = (jax.ShapeDtypeStruct(q_TNH.shape, q_TNH.dtype), jax.ShapeDtypeStruct((scratch, t, n, h), jnp.float32),
           jax.ShapeDtypeStruct((scratch, t, n, 2), jnp.float32))
    result, _, _ = jax.ffi.ffi_call("dsv4_sparse_attention", out, vmap_method="sequential")(
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
