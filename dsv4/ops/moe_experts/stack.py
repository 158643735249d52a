"""`ExpertStack`: the routed experts' matrices as the checkpoint stores them, handed to the op.

The op receives the stored form (FP4 packed + scales, FP8 blocks + scales, or dense) rather
than a dequantised [E, out, in] array, so that it decides what to dequantise: a decode step
that routes 6 tokens reads 6 experts, not all 256, and under expert parallelism each device
sees only its own experts' rows (`dsv4.sharding` runs the op in `shard_map`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv4 import quant
from dsv4.config import WeightFormat


@dataclasses.dataclass(frozen=True)
class ExpertStack:
    """Stacked expert matrices [E, out, in]; `scale` leads with E too (None when dense)."""

    weight: jax.Array  # FP4: int8 [E, out, in/2]; FP8: float8_e4m3fn [E, out, in]; dense: [E, out, in]
    scale: jax.Array | None  # FP4: uint8 [E, out, in/32]; FP8: uint8 [E, out/128, in/128]
    fmt: WeightFormat

    @classmethod
    def dense_stack(cls, w_EOI: jax.Array) -> ExpertStack:
        """A stack of plain (already dequantised) matrices."""
        return cls(jnp.asarray(w_EOI), None, WeightFormat.BF16)

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def dense(self, dtype: jnp.dtype) -> jax.Array:
        """Every expert dequantised: [E, out, in] in dtype."""
        return _dequant(self.fmt, self.weight, self.scale, dtype)

    def take(self, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """The experts `ids` (any shape, every id in [0, E)) dequantised: [*ids.shape, out, in].
        Only those experts' stored bytes are read."""
        scale = None if self.scale is None else self.scale[ids]
        return _dequant(self.fmt, self.weight[ids], scale, dtype)


def _dequant(fmt: WeightFormat, weight: jax.Array, scale: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    if fmt is WeightFormat.FP4:
        return quant.dequant_fp4(weight, scale, dtype)
    if fmt is WeightFormat.FP8:
        return quant.dequant_fp8_block(weight, scale, dtype)
    return weight.astype(dtype)


jax.tree_util.register_dataclass(ExpertStack, data_fields=["weight", "scale"], meta_fields=["fmt"])
