"""y = act_quant(x) @ W^T for an FP8 weight, as REF's FP8 linears compute it (spec 6.1, 6.2).

x [..., K] (f32 or bf16) is quantised to e4m3 with one power-of-two scale per 128 elements
(`dsv4.quant.act_quant`); W [N, K] is float8_e4m3fn with one E8M0 byte per 128x128 block. Every
product of two e4m3 values is exact in f32 and so is every power-of-two scale, so REF's
blockwise FP8 GEMM (f32 partial sums, each scaled by its two blocks' scales) equals a matmul of
the dequantised operands accumulated in f32, up to the order of the sum. This twin computes the
latter in x's dtype (both dequantised operands are exact in bf16) and returns `out_dtype`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4 import quant


def fp8_linear(x: jax.Array, weight_NK: jax.Array, scale: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """[..., N] in out_dtype. weight float8_e4m3fn [N, K]; scale uint8 E8M0 [ceil(N/128), ceil(K/128)]."""
    w = quant.dequant_fp8_block(weight_NK, scale, x.dtype)
    y = jnp.einsum("...k,nk->...n", quant.fake_act_quant(x), w, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)
