"""Per-request, batch-invariant sampling inside the step.

Every random draw is keyed by (request seed, position of the token being drawn, stream), so
a request's tokens depend on its own seed, prompt and parameters only, never on its batch
neighbours or on padding (DESIGN invariant 4). Separate streams keep target sampling,
draft sampling, acceptance uniforms and recovery sampling independent.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp


class Stream(enum.IntEnum):
    """Which random stream a draw belongs to."""

    TARGET = 0  # the target model's next token
    DRAFT = 1  # draft proposals
    ACCEPT = 2  # acceptance uniforms of speculative verification
    RECOVERY = 3  # the resample after a rejection


def row_key(seed: jax.Array, position: jax.Array, stream: Stream) -> jax.Array:
    """The key of one draw: seed, then the token position, then the stream."""
    key = jax.random.key(seed.astype(jnp.uint32))
    return jax.random.fold_in(jax.random.fold_in(key, position.astype(jnp.uint32)), int(stream))


def sample(logits_OV: jax.Array, temperature_O: jax.Array, seed_O: jax.Array, position_O: jax.Array) -> jax.Array:
    """Next tokens [O] (int32): argmax where temperature is 0, else a draw from softmax(logits / T).

    The draw is Gumbel-max on the row's own TARGET-stream key; `position` is the position
    the sampled token will take.
    """
    greedy = jnp.argmax(logits_OV, axis=-1)
    keys = jax.vmap(row_key, in_axes=(0, 0, None))(seed_O, position_O, Stream.TARGET)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits_OV.shape[-1:], jnp.float32))(keys)
    hot = temperature_O > 0
    scaled = logits_OV.astype(jnp.float32) / jnp.where(hot, temperature_O, 1.0)[:, None]
    drawn = jnp.argmax(scaled + gumbel, axis=-1)
    return jnp.where(hot, drawn, greedy).astype(jnp.int32)
