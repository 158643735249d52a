"""Pure-JAX semantics of sparse attention with sinks (the oracle every kernel is tested against).

One shared K=V latent row per key (MQA): for query (b, t) and head n,

    o = sum_j exp(s_j - m) kv_j / (sum_j exp(s_j - m) + exp(sink_n - m)),  s_j = scale * q . kv_j

over the rows kv[b, idx[b, t, j]] with idx >= 0; -1 marks an empty slot (no value, no
weight). The sink adds to the denominator only. m includes the sink (more robust than the
official kernel, which leaves it out of the running max; identical whenever nothing
overflows). A query whose index set is empty returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sparse_attention(q_BTNH: jax.Array, kv_BSH: jax.Array, idx_BTX: jax.Array, sink_N: jax.Array,
                     scale: float) -> jax.Array:
    """Attention of q [B,T,N,H] over kv [B,S,H] rows listed in idx [B,T,X] (int32, -1 = none).

    Scores, softmax and the weighted sum run in f32; the result has q's dtype.
    """
    valid_BTX = idx_BTX >= 0
    safe = jnp.where(valid_BTX, idx_BTX, 0)
    kv_BTXH = jax.vmap(lambda kv, ix: kv[ix])(kv_BSH, safe)  # gather per batch row
    kv_f = kv_BTXH.astype(jnp.float32)
    s_BTNX = jnp.einsum("btnh,btxh->btnx", q_BTNH.astype(jnp.float32), kv_f,
                        precision=jax.lax.Precision.HIGHEST) * scale
    s_BTNX = jnp.where(valid_BTX[:, :, None, :], s_BTNX, -jnp.inf)
    sink = sink_N.astype(jnp.float32)[None, None, :]
    m_BTN = jnp.maximum(jnp.max(s_BTNX, axis=-1), sink)
    p_BTNX = jnp.exp(s_BTNX - m_BTN[..., None])
    denom_BTN = jnp.sum(p_BTNX, axis=-1) + jnp.exp(sink - m_BTN)
    o_BTNH = jnp.einsum("btnx,btxh->btnh", p_BTNX, kv_f, precision=jax.lax.Precision.HIGHEST)
    return (o_BTNH / denom_BTN[..., None]).astype(q_BTNH.dtype)
