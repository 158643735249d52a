"""Pure-JAX semantics of the lightning indexer (the oracle for kernels).

score[b, t, s] = sum_i w[b, t, i] * relu(q[b, t, i] . k[b, s])      (f32)

Query t may select entry s only if s < limit[b, t] (the number of compressed entries
completed at or before t). The top-k keeps min(topk, S) slots; a slot that lands on an
invisible entry (fewer visible entries than slots) is -1. Ties among equal scores are
broken by the lower entry id (jax.lax.top_k); the official reference leaves them
unspecified, so tests avoid exact ties.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def indexer_scores(q_BTIJ: jax.Array, k_BSJ: jax.Array, w_BTI: jax.Array) -> jax.Array:
    """ReLU-weighted head sum [B,T,S] in f32. Scales are folded into `w` by the caller."""
    dots = jnp.einsum("btij,bsj->btis", q_BTIJ.astype(jnp.float32), k_BSJ.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("btis,bti->bts", jax.nn.relu(dots), w_BTI.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def indexer_topk(q_BTIJ: jax.Array, k_BSJ: jax.Array, w_BTI: jax.Array, limit_BT: jax.Array,
                 topk: int) -> jax.Array:
    """Entry ids [B,T,min(topk,S)] (int32), best first, -1 where no visible entry is left."""
    n_entries = k_BSJ.shape[1]
    k = min(topk, n_entries)
    if k == 0:
        return jnp.zeros((*q_BTIJ.shape[:2], 0), jnp.int32)
    scores = indexer_scores(q_BTIJ, k_BSJ, w_BTI)
    visible = jnp.arange(n_entries)[None, None, :] < limit_BT[..., None]
    scores = jnp.where(visible, scores, -jnp.inf)
    _, ids = jax.lax.top_k(scores, k)
    ids = ids.astype(jnp.int32)
    return jnp.where(ids < limit_BT[..., None], ids, -1)
