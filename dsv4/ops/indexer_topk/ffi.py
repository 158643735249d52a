"""indexer_topk through the FFI kernel (`dsv4_indexer_topk`, ffi_kernels/csrc): the same
signatures and semantics as `reference.py`, reading the stored keys in their own format."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import ffi_kernels
from dsv4.ops.ffi_tables import check_platform, codec, dense_table, i32, table_parts
from dsv4.state import EntryTable


def _call(q_TIJ, w_TI, keys, page_table_TP, entries_per_page: int, limit_T, topk: int, block: int) -> jax.Array:
    t = q_TIJ.shape[0]
    k = min(topk, page_table_TP.shape[1] * entries_per_page)
    if k == 0:
        return jnp.zeros((t, 0), jnp.int32)
    check_platform()
    # The second result is a score scratch [T, S], passed only where the kernel asks for one
    # ([T, 0] otherwise: nothing allocated, no score written to HBM).
    s = page_table_TP.shape[1] * entries_per_page
    scratch = ffi_kernels.indexer_scratch_columns(ffi_kernels.platform_of(jax.default_backend()), t,
                                                  s, q_TIJ.shape[1], q_TIJ.shape[2])
    out = (jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, scratch), jnp.float32))
    ids, _ = jax.ffi.ffi_call("dsv4_indexer_topk", out, vmap_method="sequential")(
        q_TIJ, w_TI.astype(jnp.float32), *keys, page_table_TP.astype(jnp.int32), limit_T.astype(jnp.int32),
        block=i32(block), entries_per_page=i32(entries_per_page))
    return ids


def indexer_topk_paged(q_TIJ: jax.Array, w_TI: jax.Array, keys: EntryTable, page_table_TP: jax.Array,
                       entries_per_page: int, limit_T: jax.Array, topk: int) -> jax.Array:
    """As `reference.indexer_topk_paged`."""
    return _call(q_TIJ, w_TI, table_parts(keys), page_table_TP, entries_per_page, limit_T, topk,
                 codec(keys.fmt).block)


def indexer_topk(q_BTIJ: jax.Array, k_BSJ: jax.Array, w_BTI: jax.Array, limit_BT: jax.Array,
                 topk: int) -> jax.Array:
    """As `reference.indexer_topk`: the keys become one dense table of B x S rows, batch row b
    one page of S entries."""
    b, t, i, j = q_BTIJ.shape
    s = k_BSJ.shape[1]
    if min(topk, s) == 0:
        return jnp.zeros((b, t, 0), jnp.int32)
    pages = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t)).reshape(b * t, 1)
    ids = _call(q_BTIJ.reshape(b * t, i, j), w_BTI.reshape(b * t, i), dense_table(k_BSJ.reshape(b * s, j)),
                pages, s, limit_BT.reshape(b * t), topk, 1)
    return ids.reshape(b, t, -1)
