"""Interleaved partial RoPE on the LAST R dims of a vector (pairs (2i, 2i+1)).

Two frequency tables exist: the main one (theta 1e4, no YaRN) for sliding-only layers and
draft stages, and the compress one (theta 1.6e5 + YaRN) for every compressed layer. The
same table serves q, the window KV, compressed entries (at the pool's first position) and
the indexer's q and keys of that layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.config import ModelConfig, rope_frequencies


def layer_frequencies(cfg: ModelConfig, layer: int | None) -> tuple[float, ...]:
    """Per-pair frequencies [R/2] for tower layer `layer` (None: a draft stage).

    A tuple (static, hashable) so modules can hold it as plain configuration.
    """
    if layer is not None and cfg.uses_yarn_rope(layer):
        return tuple(rope_frequencies(cfg.compress_rope_theta, cfg.qk_rope_head_dim, cfg.yarn))
    return tuple(rope_frequencies(cfg.rope_theta, cfg.qk_rope_head_dim, None))


def apply_rope(x: jax.Array, positions: jax.Array, freqs: tuple[float, ...], inverse: bool = False) -> jax.Array:
    """Rotate the last 2*len(freqs) dims of `x` [..., T, (heads,) W] at `positions` [..., T].

    `positions` broadcasts against x's leading axes; when x has a heads axis after T,
    positions are expanded over it. The rotation runs in f32 and is cast back.
    `inverse=True` rotates by -angle (used on the attention output).
    """
    freqs_f32 = np.asarray(freqs, np.float32)
    r = 2 * freqs_f32.shape[0]
    pos = positions.astype(jnp.float32)
    while pos.ndim < x.ndim - 1:
        pos = pos[..., None]
    angle = pos[..., None] * jnp.asarray(freqs_f32)  # [..., R/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    rot = x[..., -r:].astype(jnp.float32).reshape(*x.shape[:-1], r // 2, 2)
    a, b = rot[..., 0], rot[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], r)
    return jnp.concatenate([x[..., :-r], out.astype(x.dtype)], axis=-1)
