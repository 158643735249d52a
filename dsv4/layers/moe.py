"""Mixture of experts: sqrtsoftplus router (score or hash selection), routed + shared SwiGLU experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.config import ModelConfig, RoutingKind
from dsv4.layers.linear import ExpertWeights, Linear
from dsv4.ops.moe_experts.reference import swiglu
from dsv4.ops.registry import OpSet


class Gate(nnx.Module):
    """Router. Scores are sqrt(softplus(x W^T)) in f32; `bias` shifts the SELECTION only,
    the unbiased scores weight the chosen experts. Hash layers select by `tid2eid[token]`."""

    def __init__(self, cfg: ModelConfig, layer: int, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.routing = cfg.mlp_layer_types[layer]
        e = cfg.n_routed_experts
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (e, cfg.hidden_size)) *
                                 cfg.hidden_size ** -0.5).astype(param_dtype))
        if self.routing is RoutingKind.HASH:
            # int64 on disk; every id is < E, so int32 is exact (and JAX runs without x64).
            self.tid2eid = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.num_experts_per_tok), jnp.int32))
        else:
            self.bias = nnx.Param(jnp.zeros((e,), jnp.float32))

    def __call__(self, x_TD: jax.Array, ids_T: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(selected experts [T, K] int32, routing weights [T, K] f32)."""
        cfg = self.cfg
        logits = jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), self.weight[...].astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
        scores = jnp.sqrt(jax.nn.softplus(logits))
        if self.routing is RoutingKind.HASH:
            sel = self.tid2eid[...][ids_T]
        else:
            _, sel = jax.lax.top_k(scores + self.bias[...], cfg.num_experts_per_tok)
        w = jnp.take_along_axis(scores, sel, axis=-1)
        if cfg.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        return sel.astype(jnp.int32), w * cfg.routed_scaling_factor


class SharedExpert(nnx.Module):
    """The always-on expert: the same clamped SwiGLU as the routed ones, weight 1."""

    def __init__(self, cfg: ModelConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        d, f, fmt, aq = cfg.hidden_size, cfg.moe_intermediate_size, cfg.weight_format, cfg.fake_quant
        self.limit = cfg.swiglu_limit
        self.w1 = Linear(d, f, fmt=fmt, param_dtype=param_dtype, rngs=rngs, act_quant=aq)
        self.w3 = Linear(d, f, fmt=fmt, param_dtype=param_dtype, rngs=rngs, act_quant=aq)
        self.w2 = Linear(f, d, fmt=fmt, param_dtype=param_dtype, rngs=rngs, act_quant=aq)

    def __call__(self, x_TD: jax.Array, ops: OpSet) -> jax.Array:
        a = swiglu(self.w1(x_TD, jnp.float32, ops), self.w3(x_TD, jnp.float32, ops), self.limit)
        return self.w2(a.astype(x_TD.dtype), jnp.float32, ops)


class Experts(nnx.Module):
    """Routed experts, stacked along E: w1, w3 [E, F, D] and w2 [E, D, F]."""

    def __init__(self, cfg: ModelConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        e, d, f, fmt = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.expert_format
        self.w1 = ExpertWeights(e, d, f, fmt=fmt, param_dtype=param_dtype, rngs=rngs)
        self.w3 = ExpertWeights(e, d, f, fmt=fmt, param_dtype=param_dtype, rngs=rngs)
        self.w2 = ExpertWeights(e, f, d, fmt=fmt, param_dtype=param_dtype, rngs=rngs)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate = Gate(cfg, layer, param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(cfg, param_dtype=param_dtype, rngs=rngs)
        self.shared_experts = SharedExpert(cfg, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x_BTD: jax.Array, ids_BT: jax.Array, ops: OpSet) -> jax.Array:
        b, t, d = x_BTD.shape
        x = x_BTD.reshape(b * t, d)
        sel, w = self.gate(x, ids_BT.reshape(-1))
        ex = self.experts
        routed = ops.moe_experts(x, sel, w, ex.w1.stack(), ex.w3.stack(), ex.w2.stack(), self.cfg.swiglu_limit,
                                 self.cfg.fake_quant)
        y = routed + self.shared_experts(x, ops)
        return y.astype(x.dtype).reshape(b, t, d)
