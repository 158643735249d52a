"""Pure-JAX semantics of the lightning indexer (the oracle for kernels).

score[t, s] = sum_i w[t, i] * relu(q[t, i] . k[s])      (f32)

Query t may select entry s only if s < limit[t] (the number of compressed entries
completed at or before t). The top-k keeps min(topk, S) slots; a slot that lands on an
invisible entry (fewer visible entries than slots) is -1. Ties among equal scores are
broken by the lower entry id (jax.lax.top_k); the official reference leaves them
unspecified, so tests avoid exact ties.

`indexer_topk` is the whole-sequence form (keys [B, S, J] shared by a row's queries);
`indexer_topk_paged` the decode-step form: query t's candidates are its request's entries
0..S-1 (S = P x entries_per_page), entry s stored at row
page_table[t, s // entries_per_page] * entries_per_page + s % entries_per_page of the key
table. Passing the page table rather than every candidate's row keeps the operand [T, P]
instead of [T, S] (a 64k-token chunk would otherwise carry 4 GB of row ids).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.ops.tiling import map_in_tiles
from dsv4.state import EntryTable

# Queries scored per tile in the paged form: bounds the gathered [tile, S, J] candidate keys.
QUERY_TILE = 256


def _head_sum(dots_XIS: jax.Array, w_XI: jax.Array) -> jax.Array:
    """sum_i w_i relu(dot_i) in f32 over any leading axes X."""
    return jnp.einsum("...is,...i->...s", jax.nn.relu(dots_XIS), w_XI.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def _scores(q_TIJ: jax.Array, k_TSJ: jax.Array, w_TI: jax.Array) -> jax.Array:
    """ReLU-weighted head sum [T,S] in f32, each query against its own keys."""
    dots = jnp.einsum("tij,tsj->tis", q_TIJ.astype(jnp.float32), k_TSJ.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return _head_sum(dots, w_TI)


def _top_visible(scores_TS: jax.Array, limit_T: jax.Array, topk: int) -> jax.Array:
    n_entries = scores_TS.shape[-1]
    k = min(topk, n_entries)
    if k == 0:
        return jnp.zeros((*scores_TS.shape[:-1], 0), jnp.int32)
    visible = jnp.arange(n_entries) < limit_T[..., None]
    _, ids = jax.lax.top_k(jnp.where(visible, scores_TS, -jnp.inf), k)
    ids = ids.astype(jnp.int32)
    return jnp.where(ids < limit_T[..., None], ids, -1)


def indexer_scores(q_BTIJ: jax.Array, k_BSJ: jax.Array, w_BTI: jax.Array) -> jax.Array:
    """ReLU-weighted head sum [B,T,S] in f32. Scales are folded into `w` by the caller."""
    dots = jnp.einsum("btij,bsj->btis", q_BTIJ.astype(jnp.float32), k_BSJ.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return _head_sum(dots, w_BTI)


def indexer_topk(q_BTIJ: jax.Array, k_BSJ: jax.Array, w_BTI: jax.Array, limit_BT: jax.Array,
                 topk: int) -> jax.Array:
    """Entry ids [B,T,min(topk,S)] (int32), best first, -1 where no visible entry is left."""
    return _top_visible(indexer_scores(q_BTIJ, k_BSJ, w_BTI), limit_BT, topk)


def candidate_rows(page_table_TP: jax.Array, entries_per_page: int, drop_row: int) -> jax.Array:
    """Key-table rows [T, P * entries_per_page] of every entry of each query's request;
    entries on unallocated pages (-1) give `drop_row`."""
    s = jnp.arange(page_table_TP.shape[1] * entries_per_page)
    page = page_table_TP[:, s // entries_per_page]
    return jnp.where(page >= 0, page * entries_per_page + s % entries_per_page, drop_row)


def indexer_topk_paged(q_TIJ: jax.Array, w_TI: jax.Array, keys: EntryTable, page_table_TP: jax.Array,
                       entries_per_page: int, limit_T: jax.Array, topk: int) -> jax.Array:
    """Entry ids [T, min(topk, S)] of the step's queries, S = P x entries_per_page; only
    entries s < limit[t] are visible to query t."""

    def tile(args):
        q, w, pages, limit = args
        rows = candidate_rows(pages, entries_per_page, keys.drop_row)
        return _top_visible(_scores(q, keys.gather(rows), w), limit, topk)

    return map_in_tiles(tile, (q_TIJ, w_TI, page_table_TP, limit_T), QUERY_TILE)
