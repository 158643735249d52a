"""Run a row-wise function over tiles of its leading axis, to bound the memory of gathers.

The reference ops gather every selected row before reducing (attention rows, indexer keys,
expert weights per assignment); over a long prefill chunk that is more memory than a GPU
has, so they process `tile` rows at a time under `jax.lax.map` (a sequential loop).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp


def map_in_tiles(fn: Callable, args: tuple, tile: int):
    """fn(args) computed `tile` leading rows at a time; every array in `args` has the same leading
    length T, and every output has leading length T. Rows are independent in `fn`, so padding
    the last tile (with zeros) and slicing it off changes nothing."""
    t = jax.tree_util.tree_leaves(args)[0].shape[0]
    if t <= tile:
        return fn(args)
    n = math.ceil(t / tile)

    def to_tiles(a):
        a = jnp.pad(a, [(0, n * tile - t)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(n, tile, *a.shape[1:])

    out = jax.lax.map(fn, jax.tree_util.tree_map(to_tiles, args))
    return jax.tree_util.tree_map(lambda o: o.reshape(n * tile, *o.shape[2:])[:t], out)
