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
- `moe_experts_grouped`: sort the T*K assignments by expert and run each routed expert's rows
  through its own dequantised matrices, one expert at a time (prefill-sized batches: memory for
  one expert's matrices, not the stack's);
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
    """Sort the T*K assignments by expert, then one expert at a time: dequantise its stored
    matrices (only experts with assignments; one at a time, never the whole stack) and run its
    rows in windows of `_window_rows` rows; unsort and sum over K. f32 [T, D]."""
    dt = x_TD.dtype
    x_TD = _gemm_input(x_TD, act_quant)
    t, k = sel_TK.shape
    n_experts, m = w1.num_experts, sel_TK.size
    flat = sel_TK.reshape(-1)
    # Assignments to experts held elsewhere sort last, past every expert's rows, and stay zero.
    flat = jnp.where((flat >= 0) & (flat < n_experts), flat, n_experts)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts)
    starts = jnp.cumsum(sizes) - sizes
    window = _window_rows(m, n_experts)
    # Padded by one window so that a window starting at any row stays inside the arrays.
    x_MD = jnp.pad(x_TD[order // k], ((0, window), (0, 0)))
    w_M = jnp.pad(w_TK.reshape(-1)[order].astype(jnp.float32), (0, window))

    def expert(y_MD, e):
        def run(y_MD):
            m1, m3, m2 = (stack.take(e, dt) for stack in (w1, w3, w2))

            def rows_window(i, y_MD):
                lo = starts[e] + i * window
                xs = jax.lax.dynamic_slice_in_dim(x_MD, lo, window)
                g = jnp.einsum("rd,fd->rf", xs, m1, preferred_element_type=jnp.float32)
                u = jnp.einsum("rd,fd->rf", xs, m3, preferred_element_type=jnp.float32)
                ws = jax.lax.dynamic_slice_in_dim(w_M, lo, window)
                a = _gemm_input((swiglu(g, u, limit) * ws[:, None]).astype(dt), act_quant)
                out = jnp.einsum("rf,df->rd", a, m2, preferred_element_type=jnp.float32)
                mine = lo + jnp.arange(window) < starts[e] + sizes[e]  # the window may run into the next expert
                old = jax.lax.dynamic_slice_in_dim(y_MD, lo, window)
                return jax.lax.dynamic_update_slice_in_dim(y_MD, old + jnp.where(mine[:, None], out, 0.0), lo, 0)

            return jax.lax.fori_loop(0, (sizes[e] + window - 1) // window, rows_window, y_MD)

        return jax.lax.cond(sizes[e] > 0, run, lambda y: y, y_MD), None

    y_MD, _ = jax.lax.scan(expert, jnp.zeros((m + window, x_TD.shape[1]), jnp.float32), jnp.arange(n_experts))
    y = jnp.zeros((m, x_TD.shape[1]), jnp.float32).at[order].set(y_MD[:m])
    return jnp.sum(y.reshape(t, k, -1), axis=1)


def _window_rows(assignments: int, experts: int) -> int:
    """Rows an expert's GEMMs take at a time: the mean rows per expert rounded up to a power of
    two (at least 8), so a balanced batch runs each expert in one window."""
    mean = -(-assignments // experts)
    return max(8, 1 << (mean - 1).bit_length())
