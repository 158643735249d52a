"""Routed experts: y[t] = sum_k bf(act(x[t] W1_e^T, x[t] W3_e^T) * w[t,k]) W2_e^T, e = sel[t,k].

act(g, u) = silu(min(g, limit)) * clamp(u, -limit, limit). As in the official reference the
routing weight multiplies the activation in f32 BEFORE `w2`, the product is cast to the
activation dtype, and expert outputs accumulate in f32. With `act_quant` both GEMM inputs (x
before w1/w3, the activation before w2) pass through REF's FP8 activation quantisation
(`dsv4.quant.fake_act_quant`, spec 6.2), as the official FP4/FP8 expert GEMMs do.

The weights arrive as stored (`ExpertStack`: FP4 / FP8 / dense), and an assignment whose
expert id lies outside [0, E) contributes nothing: under expert parallelism each device runs
the op on its own E/n experts with ids shifted by its first expert (`dsv4.sharding`).

Implementations with one signature:
- `moe_experts_loop`: a deliberately naive loop over experts (the oracle);
- `moe_experts_grouped`: dequantise every expert, sort the T*K assignments by expert and run
  `jax.lax.ragged_dot` grouped GEMMs (prefill-sized batches);
- `moe_experts_gathered`: dequantise only the T*K routed experts' matrices, one per
  assignment, and run batched per-row products (decode-sized batches: reads T*K experts
  instead of E);
- `moe_experts`: the registry's entry, gathered when T*K < E, grouped otherwise (a static
  choice from the shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4 import quant
from dsv4.ops.moe_experts.stack import ExpertStack
from dsv4.ops.tiling import map_in_tiles

TOKEN_TILE = 1024  # tokens per grouped GEMM (bounds the ragged_dot intermediate)


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """Clamped SwiGLU in f32: the up projection both sides, the gate from above only."""
    g = jnp.minimum(g.astype(jnp.float32), limit)
    u = jnp.clip(u.astype(jnp.float32), -limit, limit)
    return jax.nn.silu(g) * u


def _gemm_input(x: jax.Array, act_quant: bool) -> jax.Array:
    return quant.fake_act_quant(x) if act_quant else x


def moe_experts_loop(x_TD: jax.Array, sel_TK: jax.Array, w_TK: jax.Array, w1: ExpertStack, w3: ExpertStack,
                     w2: ExpertStack, limit: float, act_quant: bool = False) -> jax.Array:
    """Oracle: every expert in id order over the tokens routed to it, each of a token's K
    assignments on its own (a token that lists an expert twice gets it twice, with each
    weight, as on the other paths). Returns f32 [T, D]."""
    dt = x_TD.dtype
    x_TD = _gemm_input(x_TD, act_quant)
    w1_EFD, w3_EFD, w2_EDF = w1.dense(dt), w3.dense(dt), w2.dense(dt)
    y = jnp.zeros(x_TD.shape, jnp.float32)
    for e in range(w1.num_experts):
        g = jnp.einsum("td,fd->tf", x_TD, w1_EFD[e], preferred_element_type=jnp.float32)
        u = jnp.einsum("td,fd->tf", x_TD, w3_EFD[e], preferred_element_type=jnp.float32)
        for slot in range(sel_TK.shape[1]):
            routed_T = sel_TK[:, slot] == e
            we_T = jnp.where(routed_T, w_TK[:, slot].astype(jnp.float32), 0.0)
            a = _gemm_input((swiglu(g, u, limit) * we_T[:, None]).astype(dt), act_quant)
            contrib = jnp.einsum("tf,df->td", a, w2_EDF[e], preferred_element_type=jnp.float32)
            y = y + jnp.where(routed_T[:, None], contrib, 0.0)
    return y


def moe_experts(x_TD: jax.Array, sel_TK: jax.Array, w_TK: jax.Array, w1: ExpertStack, w3: ExpertStack,
                w2: ExpertStack, limit: float, act_quant: bool = False) -> jax.Array:
    """Gathered when the batch routes fewer assignments than there are experts, else grouped."""
    if sel_TK.size < w1.num_experts:
        return moe_experts_gathered(x_TD, sel_TK, w_TK, w1, w3, w2, limit, act_quant)
    return moe_experts_grouped(x_TD, sel_TK, w_TK, w1, w3, w2, limit, act_quant)


def moe_experts_gathered(x_TD: jax.Array, sel_TK: jax.Array, w_TK: jax.Array, w1: ExpertStack, w3: ExpertStack,
                         w2: ExpertStack, limit: float, act_quant: bool = False) -> jax.Array:
    """Each assignment's own expert matrices, dequantised from the stored bytes. f32 [T, D]."""
    dt = x_TD.dtype
    x_TD = _gemm_input(x_TD, act_quant)
    here = (sel_TK >= 0) & (sel_TK < w1.num_experts)
    ids = jnp.where(here, sel_TK, 0)
    g = jnp.einsum("td,tkfd->tkf", x_TD, w1.take(ids, dt), preferred_element_type=jnp.float32)
    u = jnp.einsum("td,tkfd->tkf", x_TD, w3.take(ids, dt), preferred_element_type=jnp.float32)
    a = _gemm_input((swiglu(g, u, limit) * w_TK[..., None].astype(jnp.float32)).astype(dt), act_quant)
    out = jnp.einsum("tkf,tkdf->tkd", a, w2.take(ids, dt), preferred_element_type=jnp.float32)
    return jnp.sum(jnp.where(here[..., None], out, 0.0), axis=1)


def moe_experts_grouped(x_TD: jax.Array, sel_TK: jax.Array, w_TK: jax.Array, w1: ExpertStack, w3: ExpertStack,
                        w2: ExpertStack, limit: float, act_quant: bool = False) -> jax.Array:
    """Sort assignments by expert, two ragged_dot grouped GEMMs, unsort, sum over K. f32 [T, D].

    Runs TOKEN_TILE tokens at a time: XLA may lower ragged_dot to a dense dot of every row
    against every expert, whose intermediate grows with T * K * E.
    """
    dt = x_TD.dtype
    dense = (w1.dense(dt), w3.dense(dt), w2.dense(dt))
    x_TD = _gemm_input(x_TD, act_quant)
    return map_in_tiles(lambda a: _grouped(*a, *dense, limit, act_quant), (x_TD, sel_TK, w_TK), TOKEN_TILE)


def _grouped(x_TD: jax.Array, sel_TK: jax.Array, w_TK: jax.Array, w1_EFD: jax.Array, w3_EFD: jax.Array,
             w2_EDF: jax.Array, limit: float, act_quant: bool) -> jax.Array:
    t, k = sel_TK.shape
    n_experts = w1_EFD.shape[0]
    flat_sel = sel_TK.reshape(-1)
    # Assignments to experts elsewhere sort last, past every group, and are masked out.
    here = (flat_sel >= 0) & (flat_sel < n_experts)
    flat_sel = jnp.where(here, flat_sel, n_experts)
    order = jnp.argsort(flat_sel, stable=True)
    token_of = order // k
    x_MD = x_TD[token_of]
    sizes = jnp.bincount(flat_sel, length=n_experts).astype(jnp.int32)
    g = jax.lax.ragged_dot(x_MD, jnp.swapaxes(w1_EFD, 1, 2), sizes, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(x_MD, jnp.swapaxes(w3_EFD, 1, 2), sizes, preferred_element_type=jnp.float32)
    a = (swiglu(g, u, limit) * w_TK.reshape(-1)[order][:, None].astype(jnp.float32)).astype(x_TD.dtype)
    a = _gemm_input(a, act_quant)
    out_MD = jax.lax.ragged_dot(a, jnp.swapaxes(w2_EDF, 1, 2), sizes, preferred_element_type=jnp.float32)
    out_MD = jnp.where(here[order][:, None], out_MD, 0.0)
    y = jnp.zeros((t * k, x_TD.shape[1]), jnp.float32).at[order].set(out_MD)
    return jnp.sum(y.reshape(t, k, -1), axis=1)
