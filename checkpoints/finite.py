"""Whether loaded weights hold NaN or infinities: a checkpoint with them would be served as
all-zero token ids (the argmax of NaN logits) without a word, so loading refuses it.

The check runs on the devices after loading, as one compiled program over every parameter
(memory-bound: tens of milliseconds for the full model on a GPU). Floating-point weights fail
on NaN or +-Inf (e4m3 has NaN codes and no infinities); `uint8` parameters are E8M0 scales,
whose code 0xff is NaN; packed FP4 (int8) and integer tables cannot be non-finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.inventory import path_name

E8M0_NAN = 0xFF


def _not_finite(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.floating):
        return ~jnp.all(jnp.isfinite(x))
    if x.dtype == jnp.uint8:
        return jnp.any(x == E8M0_NAN)
    return jnp.zeros((), jnp.bool_)


@jax.jit
def _flags(values: list[jax.Array]) -> jax.Array:
    return jnp.stack([_not_finite(x) for x in values]) if values else jnp.zeros((0,), jnp.bool_)


def nonfinite_parameters(module: nnx.Module) -> list[str]:
    """The names (state paths, as `path_name`) of the module's parameters that hold a NaN or an
    infinity (an E8M0 NaN code for scales)."""
    flat = list(nnx.to_flat_state(nnx.state(module)))
    flags = np.asarray(_flags([var.get_value() for _, var in flat]))
    return [path_name(path) for (path, _), bad in zip(flat, flags) if bad]
