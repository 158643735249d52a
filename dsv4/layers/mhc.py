"""mHC: manifold-constrained hyper-connections over C residual streams.

Everything runs in f32, per token. `comb[j, k]` moves source stream j into destination k;
Sinkhorn ends on a column normalisation so every destination gets a convex combination.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _mix(h_BTCD: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """The f32 projection shared by hc_pre and hc_head: (xf @ fn^T) * rsqrt(mean(xf^2) + eps)."""
    xf = h_BTCD.reshape(*h_BTCD.shape[:-2], -1).astype(jnp.float32)
    m = jnp.einsum("btx,mx->btm", xf, fn.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return m * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def hc_pre(h_BTCD: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array, *,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Collapse C streams into one block input. Returns (x_BTD, post_BTC, comb_BTCC) (f32 weights)."""
    c = h_BTCD.shape[-2]
    m = _mix(h_BTCD, fn, norm_eps)
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :c] * scale[0] + base[:c]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., c:2 * c] * scale[1] + base[c:2 * c])
    logits = m[..., 2 * c:].reshape(*m.shape[:-1], c, c) * scale[2] + base[2 * c:].reshape(c, c)
    comb = jax.nn.softmax(logits, axis=-1) + hc_eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + hc_eps)
    # A loop, not a Python unroll: XLA fuses each unrolled normalisation's sum together with
    # every earlier normalisation it depends on, so the unrolled program grows with the square
    # of the iterations (three quarters of the tiny model's step) and compiles much slower, on
    # every backend. On a GPU the loop costs a few small launches per iteration instead.
    comb = jax.lax.fori_loop(0, sinkhorn_iters - 1, functools.partial(_sinkhorn_pair, eps=hc_eps), comb)
    x = jnp.sum(pre[..., None] * h_BTCD.astype(jnp.float32), axis=-2)
    return x.astype(h_BTCD.dtype), post, comb


def _sinkhorn_pair(_, comb_BTCC: jax.Array, *, eps: float) -> jax.Array:
    """One row normalisation, then one column normalisation."""
    comb_BTCC = comb_BTCC / (jnp.sum(comb_BTCC, axis=-1, keepdims=True) + eps)
    return comb_BTCC / (jnp.sum(comb_BTCC, axis=-2, keepdims=True) + eps)


def hc_post(x_BTD: jax.Array, r_BTCD: jax.Array, post_BTC: jax.Array, comb_BTCC: jax.Array) -> jax.Array:
    """out[k] = post_k * x + sum_j comb[j, k] * r[j], in f32, cast to the stream dtype."""
    mixed = jnp.einsum("btjk,btjd->btkd", comb_BTCC, r_BTCD.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    out = post_BTC[..., None] * x_BTD.astype(jnp.float32)[..., None, :] + mixed
    return out.astype(r_BTCD.dtype)


def hc_head(h_BTCD: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array, *,
            norm_eps: float, hc_eps: float) -> jax.Array:
    """Tower exit C -> 1: a learned sigmoid-weighted sum of the streams (not a mean)."""
    m = _mix(h_BTCD, fn, norm_eps)
    pre = jax.nn.sigmoid(m * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + hc_eps
    return jnp.sum(pre[..., None] * h_BTCD.astype(jnp.float32), axis=-2).astype(h_BTCD.dtype)
