"""Weight containers that may stay quantized in memory.

A `Linear` holds either a dense weight (`weight` in the param dtype) or the on-disk FP8
form (`weight` float8_e4m3fn [out, in] + `scale` E8M0 bytes [ceil(out/128), ceil(in/128)]),
dequantised inside the jitted matmul so XLA fuses the decode into the GEMM's operand.
Attribute names are the official checkpoint names (`X.weight`, `X.scale`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4 import quant
from dsv4.config import WeightFormat
from dsv4.ops.fp8_linear.reference import fp8_linear as fp8_linear_ref
from dsv4.ops.moe_experts.stack import ExpertStack
from dsv4.ops.registry import OpSet


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return jax.random.normal(rngs.params(), shape, jnp.float32) * std


class Linear(nnx.Module):
    """y = x @ W^T with W [out, in], dense or FP8 block-quantized.

    `act_quant`: x passes through REF's activation quantisation first (`quant.fake_act_quant`,
    spec 6.2), as before every GEMM whose checkpoint weight is FP8. It is a property of the
    model (`ModelConfig.fake_quant`), not of how the weight is held: a checkpoint loaded
    dequantised computes the same. An FP8 weight with `act_quant` is REF's FP8 GEMM, which the
    op set's `fp8_linear` runs (an FFI kernel under `Backend.FFI`).
    """

    def __init__(self, in_features: int, out_features: int, *, fmt: WeightFormat, param_dtype: jnp.dtype,
                 rngs: nnx.Rngs, act_quant: bool = False):
        self.in_features, self.out_features = in_features, out_features
        self.fmt = fmt
        self.act_quant = act_quant
        w = _init(rngs, (out_features, in_features), in_features ** -0.5)
        if fmt is WeightFormat.FP8:
            self.weight = nnx.Param(w.astype(jnp.float8_e4m3fn))
            scale_shape = (math.ceil(out_features / quant.FP8_BLOCK), math.ceil(in_features / quant.FP8_BLOCK))
            self.scale = nnx.Param(jnp.full(scale_shape, quant.E8M0_BIAS, jnp.uint8))
        elif fmt is WeightFormat.BF16:
            self.weight = nnx.Param(w.astype(param_dtype))
        else:
            raise ValueError(f"Linear: unsupported weight format {fmt}")

    def dense(self, dtype: jnp.dtype) -> jax.Array:
        """The weight [out, in] in `dtype` (a dequantisation when held as FP8)."""
        if self.fmt is WeightFormat.FP8:
            return quant.dequant_fp8_block(self.weight[...], self.scale[...], dtype)
        return self.weight[...].astype(dtype)

    def __call__(self, x: jax.Array, out_dtype: jnp.dtype | None = None, ops: OpSet | None = None) -> jax.Array:
        """Matmul in x's dtype with f32 accumulation; result in `out_dtype` (default x.dtype).
        `ops`: whose `fp8_linear` runs an FP8 weight with `act_quant` (None: the reference)."""
        out_dtype = out_dtype or x.dtype
        if self.act_quant and self.fmt is WeightFormat.FP8:
            fp8_linear = ops.fp8_linear if ops is not None else fp8_linear_ref
            return fp8_linear(x, self.weight[...], self.scale[...], out_dtype)
        if self.act_quant:
            x = quant.fake_act_quant(x)
        y = jnp.einsum("...i,oi->...o", x, self.dense(x.dtype), preferred_element_type=jnp.float32)
        return y.astype(out_dtype)


class ExpertWeights(nnx.Module):
    """One stacked expert matrix [E, out, in]: dense, FP8 (128x128 blocks) or FP4 (1x32 groups).

    The checkpoint stores one tensor per expert (`experts.{e}.w1.weight`); the loader stacks
    them along E.
    """

    def __init__(self, n_experts: int, in_features: int, out_features: int, *, fmt: WeightFormat,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.fmt = fmt
        shape = (n_experts, out_features, in_features)
        w = _init(rngs, shape, in_features ** -0.5)
        if fmt is WeightFormat.FP4:
            if in_features % quant.FP4_GROUP:
                raise ValueError(f"FP4 experts need in_features % {quant.FP4_GROUP} == 0, got {in_features}")
            self.weight = nnx.Param(jnp.zeros((n_experts, out_features, in_features // 2), jnp.int8))
            self.scale = nnx.Param(
                jnp.full((n_experts, out_features, in_features // quant.FP4_GROUP), quant.E8M0_BIAS, jnp.uint8))
        elif fmt is WeightFormat.FP8:
            self.weight = nnx.Param(w.astype(jnp.float8_e4m3fn))
            self.scale = nnx.Param(jnp.full(
                (n_experts, math.ceil(out_features / quant.FP8_BLOCK), math.ceil(in_features / quant.FP8_BLOCK)),
                quant.E8M0_BIAS, jnp.uint8))
        else:
            self.weight = nnx.Param(w.astype(param_dtype))

    def stack(self) -> ExpertStack:
        """The stored tensors, for the MoE op to dequantise what it reads."""
        scale = self.scale[...] if self.fmt in (WeightFormat.FP4, WeightFormat.FP8) else None
        return ExpertStack(self.weight[...], scale, self.fmt)
