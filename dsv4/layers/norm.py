"""RMSNorm: statistics and gain in f32, result in the input dtype (as the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last axis; `weight=None` is gain-less."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Learned-gain RMSNorm; the gain is stored in the checkpoint's dtype and applied in f32."""

    def __init__(self, dim: int, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
