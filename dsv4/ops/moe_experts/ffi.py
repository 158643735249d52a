"""moe_experts through the FFI kernel (`dsv4_moe_experts`, ffi_kernels/csrc): the routed experts'
GEMMs on the stored FP4/FP8 weights with FP8 activations (act_quant), the clamped SwiGLU, the
routing weights and the sum over each token's experts in one call.

The kernel computes REF's quantised experts only: with dense weights, without act_quant, or
where the platform's library has no such kernel yet, the reference runs instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.config import WeightFormat
from dsv4.ops.ffi_tables import check_platform, kernel_built
from dsv4.ops.moe_experts import reference
from dsv4.ops.moe_experts.stack import ExpertStack

TARGET = "dsv4_moe_experts"


def moe_experts(x_TD: jax.Array, sel_TK: jax.Array, w_TK: jax.Array, w1: ExpertStack, w3: ExpertStack,
                w2: ExpertStack, limit: float, act_quant: bool = False) -> jax.Array:
    """As `reference.moe_experts`. f32 [T, D]."""
    check_platform()
    if not (act_quant and kernel_built(TARGET) and w1.fmt in (WeightFormat.FP4, WeightFormat.FP8)):
        return reference.moe_experts(x_TD, sel_TK, w_TK, w1, w3, w2, limit, act_quant)
    out = jax.ShapeDtypeStruct(x_TD.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        x_TD, sel_TK.astype(jnp.int32), w_TK.astype(jnp.float32), w1.weight, w1.scale, w3.weight, w3.scale,
        w2.weight, w2.scale, limit=np.float32(limit))
