"""fp8_linear through the FFI kernel (`dsv4_fp8_linear`, ffi_kernels/csrc): act_quant of x and
the blockwise FP8 GEMM in one call. Where the platform's library has no such kernel yet, the
reference (XLA's dot on the dequantised operands) runs instead."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.ops.ffi_tables import check_platform, kernel_built
from dsv4.ops.fp8_linear import reference

TARGET = "dsv4_fp8_linear"


def fp8_linear(x: jax.Array, weight_NK: jax.Array, scale: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """As `reference.fp8_linear`; a weight that does not fit x is refused here, with one message
    whichever implementation would run."""
    check_platform()
    if weight_NK.ndim != 2 or weight_NK.shape[1] != x.shape[-1]:
        raise ValueError(f"fp8_linear: weight must be [N, K] with x's K = {x.shape[-1]}, got {weight_NK.shape}")
    if not kernel_built(TARGET):
        return reference.fp8_linear(x, weight_NK, scale, out_dtype)
    out = jax.ShapeDtypeStruct((*x.shape[:-1], weight_NK.shape[0]), jnp.dtype(out_dtype))
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, weight_NK, scale)
