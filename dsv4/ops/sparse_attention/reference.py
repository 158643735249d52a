"""Pure-JAX semantics of sparse attention with sinks (the oracle every kernel is tested against).

One shared K=V latent row per key (MQA): for query (b, t) and head n,

    o = sum_j exp(s_j - m) kv_j / (sum_j exp(s_j - m) + exp(sink_n - m)),  s_j = scale * q . kv_j

over the rows kv[b, idx[b, t, j]] with idx >= 0; -1 marks an empty slot (no value, no
weight). The sink adds to the denominator only. m includes the sink (more robust than the
official kernel, which leaves it out of the running max; identical whenever nothing
overflows). A query whose index set is empty returns zeros.

Two entry points share that math:
- `sparse_attention`: whole-sequence form, keys are a dense [B, S, H] array;
- `sparse_attention_paged`: the decode-step form over stored tables (`dsv4.state.EntryTable`):
  a window index set into the virtual table [ring rows ; this step's rows] and a compressed
  index set into the paged pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.ops.tiling import map_in_tiles
from dsv4.state import EntryTable

# Queries attended per tile in the paged form: bounds the gathered [tile, X, H] rows of a
# long prefill chunk (the reference gathers every selected row before the softmax).
QUERY_TILE = 512


def attend(q_TNH: jax.Array, kv_TXH: jax.Array, valid_TX: jax.Array, sink_N: jax.Array, scale: float) -> jax.Array:
    """The sink softmax of queries [T,N,H] over their own gathered rows [T,X,H]; f32 math, q's dtype out."""
    kv_f = kv_TXH.astype(jnp.float32)
    s_TNX = jnp.einsum("tnh,txh->tnx", q_TNH.astype(jnp.float32), kv_f, precision=jax.lax.Precision.HIGHEST) * scale
    s_TNX = jnp.where(valid_TX[:, None, :], s_TNX, -jnp.inf)
    sink = sink_N.astype(jnp.float32)[None, :]
    m_TN = jnp.maximum(jnp.max(s_TNX, axis=-1), sink)
    p_TNX = jnp.exp(s_TNX - m_TN[..., None])
    denom_TN = jnp.sum(p_TNX, axis=-1) + jnp.exp(sink - m_TN)
    o_TNH = jnp.einsum("tnx,txh->tnh", p_TNX, kv_f, precision=jax.lax.Precision.HIGHEST)
    return (o_TNH / denom_TN[..., None]).astype(q_TNH.dtype)


def sparse_attention(q_BTNH: jax.Array, kv_BSH: jax.Array, idx_BTX: jax.Array, sink_N: jax.Array,
                     scale: float) -> jax.Array:
    """Attention of q [B,T,N,H] over kv [B,S,H] rows listed in idx [B,T,X] (int32, -1 = none)."""
    valid_BTX = idx_BTX >= 0
    safe = jnp.where(valid_BTX, idx_BTX, 0)
    kv_BTXH = jax.vmap(lambda kv, ix: kv[ix])(kv_BSH, safe)  # gather per batch row
    return jax.vmap(attend, in_axes=(0, 0, 0, None, None))(q_BTNH, kv_BTXH, valid_BTX, sink_N, scale)


def sparse_attention_paged(q_TNH: jax.Array, window: tuple[EntryTable, EntryTable], window_idx_TW: jax.Array,
                           compressed: EntryTable | None, compressed_idx_TX: jax.Array | None,
                           sink_N: jax.Array, scale: float) -> jax.Array:
    """Attention of the step's queries q [T,N,H] over stored entries.

    window = (ring, fresh): `window_idx` [T,W] indexes rows of ring, then rows of fresh
    (index ring.rows + i is fresh row i); -1 = none. `compressed_idx` [T,X] indexes rows of
    the compressed pool; -1 (or any row past its end) = none.
    """
    ring, fresh = window

    def tile(args):
        q, w_idx, c_idx = args
        is_fresh = w_idx >= ring.rows
        kv = jnp.where(is_fresh[..., None], fresh.gather(w_idx - ring.rows), ring.gather(w_idx))
        valid = w_idx >= 0
        if compressed is not None:
            kv = jnp.concatenate([kv, compressed.gather(c_idx)], axis=1)
            valid = jnp.concatenate([valid, (c_idx >= 0) & (c_idx < compressed.rows)], axis=1)
        return attend(q, kv, valid, sink_N, scale)

    c_idx = compressed_idx_TX if compressed is not None else jnp.zeros((q_TNH.shape[0], 0), jnp.int32)
    return map_in_tiles(tile, (q_TNH, window_idx_TW, c_idx), QUERY_TILE)
