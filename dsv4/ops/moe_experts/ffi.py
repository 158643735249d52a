"""moe_experts through the FFI kernels (ffi_kernels/csrc/moe_experts_*): the routed experts'
GEMMs on the stored FP4/FP8 weights with FP8 activations (act_quant), the clamped SwiGLU, the
routing weights and the sum over each token's experts in one call.

Two forms:
- per token (`dsv4_moe_experts`, CPU and CUDA): each token streams its K experts' rows; the
  CUDA kernel's one scratch result holds the activations between its two GEMMs.
- grouped by expert (`dsv4_moe_experts_grouped`, CUDA, above PER_TOKEN_MAX_TOKENS tokens): the
  assignments sorted by expert (`routing_plan`, here in XLA) and taken in tiles of 8, 16 or 32,
  so that each expert's weights are read once per tile, on FP8 tensor cores.

The kernels compute REF's quantised experts only: with dense weights, without act_quant, or
where the platform's library has no such kernel yet, the reference runs instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import ffi_kernels
from dsv4.config import WeightFormat
from dsv4.ops.ffi_tables import check_platform, kernel_built
from dsv4.ops.moe_experts import reference
from dsv4.ops.moe_experts.stack import ExpertStack

TARGET = "dsv4_moe_experts"
GROUPED_TARGET = "dsv4_moe_experts_grouped"
# Up to this many tokens each token streams its own experts' rows: decode's one or two tokens
# touch K experts each, and the routing plan's sort would cost more than it saves.
PER_TOKEN_MAX_TOKENS = 2
TILE_SIZES = (8, 16, 32)  # assignments per tile: one, two or four n-blocks of the 16 x 8 x 32 mma


def tile_tokens(assignments: int, experts: int) -> int:
    """The tile for `assignments` spread over `experts`: the smallest that holds an expert's mean
    share, so that small batches waste no columns and large ones reuse each weight more."""
    mean = assignments / max(experts, 1)
    return next((size for size in TILE_SIZES if mean <= size), TILE_SIZES[-1])


def max_tiles(assignments: int, experts: int, tile: int) -> int:
    """The most tiles any routing can need (each expert's last tile may be partial); the grid."""
    return assignments // tile + min(experts, assignments)


def routing_plan(sel_TK: jax.Array, experts: int, tile: int) -> tuple[jax.Array, jax.Array]:
    """(order [T K], groups [E, 3]) for the grouped kernel: the assignments (t K + j) sorted by
    expert, assignments to experts outside [0, E) last (and in no tile); per expert its first
    position in `order`, its count and the running count of tiles up to and including it."""
    flat = sel_TK.reshape(-1).astype(jnp.int32)
    key = jnp.where((flat >= 0) & (flat < experts), flat, experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.bincount(key, length=experts + 1)[:experts].astype(jnp.int32)
    first = jnp.cumsum(counts) - counts
    tiles_end = jnp.cumsum((counts + tile - 1) // tile)
    return order, jnp.stack([first, counts, tiles_end], axis=1).astype(jnp.int32)


def moe_experts(x_TD: jax.Array, sel_TK: jax.Array, w_TK: jax.Array, w1: ExpertStack, w3: ExpertStack,
                w2: ExpertStack, limit: float, act_quant: bool = False) -> jax.Array:
    """As `reference.moe_experts`. f32 [T, D]."""
    check_platform()
    if not (act_quant and kernel_built(TARGET) and w1.fmt in (WeightFormat.FP4, WeightFormat.FP8)):
        return reference.moe_experts(x_TD, sel_TK, w_TK, w1, w3, w2, limit, act_quant)
    (t, d), (_, k), e, f = x_TD.shape, sel_TK.shape, w1.num_experts, w1.weight.shape[1]
    args = (x_TD, sel_TK.astype(jnp.int32), w_TK.astype(jnp.float32), w1.weight, w1.scale, w3.weight, w3.scale,
            w2.weight, w2.scale)
    y = jax.ShapeDtypeStruct((t, d), jnp.float32)
    if t > PER_TOKEN_MAX_TOKENS and d % 32 == 0 and f % 32 == 0 and kernel_built(GROUPED_TARGET):
        tile = tile_tokens(t * k, e)
        scratch = [((t, d), jnp.uint8), ((t, -(-d // 128)), jnp.float32), ((t * k, f), jnp.uint8),
                   ((t * k, -(-f // 128)), jnp.float32), ((t * k, d), jnp.float32)]
        out = (y, *(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in scratch))
        return jax.ffi.ffi_call(GROUPED_TARGET, out, vmap_method="sequential")(
            *args, *routing_plan(sel_TK, e, tile), limit=np.float32(limit), tile=np.int32(tile))[0]
    if ffi_kernels.platform_of(jax.default_backend()) == "cuda":
        # The per-token kernels' scratch: the activations between their two GEMMs.
        y, _ = jax.ffi.ffi_call(TARGET, (y, jax.ShapeDtypeStruct((t, k, f), jnp.float32)), vmap_method="sequential")(
            *args, limit=np.float32(limit))
        return y
    return jax.ffi.ffi_call(TARGET, y, vmap_method="sequential")(*args, limit=np.float32(limit))
