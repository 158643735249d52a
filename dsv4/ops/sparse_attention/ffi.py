"""sparse_attention through the FFI kernel (`dsv4_sparse_attention`, ffi_kernels/csrc): the same
signatures and semantics as `reference.py`, reading the stored tables in their own formats."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.ops.ffi_tables import check_platform, codec, dense_table, i32, table_parts
from dsv4.state import EntryTable


def _call(q_TNH, ring, fresh, window_idx_TW, comp, comp_idx_TX, sink_N, scale: float, block: int) -> jax.Array:
    check_platform()
    out = jax.ShapeDtypeStruct(q_TNH.shape, q_TNH.dtype)
    return jax.ffi.ffi_call("dsv4_sparse_attention", out, vmap_method="sequential")(
        q_TNH, *ring, *fresh, window_idx_TW.astype(jnp.int32), *comp, comp_idx_TX.astype(jnp.int32),
        sink_N.astype(jnp.float32), scale=np.float32(scale), block=i32(block))


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
