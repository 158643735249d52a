"""The DeepSeek-V4 target tower: embed -> blocks (mHC x attention, mHC x MoE) -> hc_head -> norm -> head.

Module attribute names are the official checkpoint names, so a parameter's path in the
NNX state is its checkpoint name (`layers.3.attn.wq_a.weight`); the one exception is the
routed experts, stacked along E (`layers.N.ffn.experts.w1.weight` holds every
`layers.N.ffn.experts.{e}.w1.weight`).

Lifecycle: build abstractly (`nnx.eval_shape`), fill from a checkpoint
(`checkpoints.load`), then `forward(ids)` runs the whole sequence from position 0 (no
cache), or `step(state, batch)` runs a ragged batch of many requests' new tokens against
their stored decode state (`dsv4.state`, `dsv4.batch`); both give the same logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4.batch import StepBatch, StepContext
from dsv4.config import ModelConfig, WeightFormat
from dsv4.layers.attention import Attention
from dsv4.layers.mhc import hc_head, hc_post, hc_pre
from dsv4.layers.moe import MoE
from dsv4.layers.norm import RMSNorm
from dsv4.ops.registry import OpSet
from dsv4.state import DecodeState, LayerState, StateGeometry


def storage_config(cfg: ModelConfig, quantized: bool) -> ModelConfig:
    """The config whose weight formats describe memory: as on disk, or all dense."""
    if quantized:
        return cfg
    return cfg.replace(weight_format=WeightFormat.BF16, expert_format=WeightFormat.BF16)


def _hc_params(cfg: ModelConfig, rngs: nnx.Rngs, rows: int, n_scales: int) -> tuple[nnx.Param, ...]:
    fn = jax.random.normal(rngs.params(), (rows, cfg.hc_mult * cfg.hidden_size), jnp.float32) * 0.02
    return (nnx.Param(fn), nnx.Param(jnp.zeros((rows,), jnp.float32)), nnx.Param(jnp.ones((n_scales,), jnp.float32)))


class Block(nnx.Module):
    """One tower layer: two mHC round trips (attention, then MoE)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _hc_params(cfg, rngs, cfg.hc_mix_dim, 3)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _hc_params(cfg, rngs, cfg.hc_mix_dim, 3)
        self.attn = Attention(cfg, layer, param_dtype=param_dtype, rngs=rngs)
        self.ffn = MoE(cfg, layer, param_dtype=param_dtype, rngs=rngs)

    def _pre(self, h: jax.Array, fn: nnx.Param, scale: nnx.Param, base: nnx.Param):
        cfg = self.cfg
        return hc_pre(h, fn[...], scale[...], base[...], norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                      sinkhorn_iters=cfg.hc_sinkhorn_iters)

    def _ffn_round_trip(self, h_BTCD: jax.Array, ids_BT: jax.Array, ops: OpSet) -> jax.Array:
        x, post, comb = self._pre(h_BTCD, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        return hc_post(self.ffn(self.ffn_norm(x), ids_BT, ops), h_BTCD, post, comb)

    def __call__(self, h_BTCD: jax.Array, ids_BT: jax.Array, ops: OpSet) -> jax.Array:
        x, post, comb = self._pre(h_BTCD, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        h_BTCD = hc_post(self.attn(self.attn_norm(x), ops), h_BTCD, post, comb)
        return self._ffn_round_trip(h_BTCD, ids_BT, ops)

    def step(self, h_1TCD: jax.Array, ids_1T: jax.Array, ctx: StepContext, st: LayerState,
             geometry: StateGeometry, ops: OpSet) -> tuple[LayerState, jax.Array]:
        """The block over a step's flat token rows (batch axis 1), attention against the stored state."""
        x, post, comb = self._pre(h_1TCD, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        st, y = self.attn.step(self.attn_norm(x)[0], ctx, st, geometry, ops)
        h_1TCD = hc_post(y[None], h_1TCD, post, comb)
        return st, self._ffn_round_trip(h_1TCD, ids_1T, ops)


class Transformer(nnx.Module):
    """The target tower. `cfg` gives the architecture; weight formats in `cfg` give the memory layout."""

    def __init__(self, cfg: ModelConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed = _Embedding(v, d, param_dtype, rngs)
        self.layers = nnx.List([Block(cfg, i, param_dtype=param_dtype, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _hc_params(cfg, rngs, cfg.hc_mult, 1)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype)
        self.head = _Embedding(v, d, param_dtype, rngs)  # [V, D], untied

    def embed_streams(self, ids_BT: jax.Array, ops: OpSet) -> jax.Array:
        """The embedding copied into the C residual streams, [B, T, C, D]."""
        x = ops.embedding(self.embed.weight[...], ids_BT)
        return jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.cfg.hc_mult, x.shape[-1]))

    def hidden_streams(self, ids_BT: jax.Array, ops: OpSet) -> jax.Array:
        """The C-stream residual after the last block, [B, T, C, D]."""
        h = self.embed_streams(ids_BT, ops)
        for block in self.layers:
            h = block(h, ids_BT, ops)
        return h

    def forward(self, ids_BT: jax.Array, ops: OpSet) -> jax.Array:
        """Full-sequence logits [B, T, V] in f32 for token ids [B, T] at positions 0..T-1."""
        return self.logits(self.hidden_streams(ids_BT, ops))

    def step(self, state: DecodeState, batch: StepBatch, geometry: StateGeometry,
             ops: OpSet) -> tuple[DecodeState, jax.Array, jax.Array]:
        """One ragged decode step: (state', logits [O, V] f32 at batch.out_rows, taps [Ot, n_taps, D]).

        Taps are the C-stream means of the outputs of `cfg.dspark_target_layer_ids` at
        batch.tap_rows (what the DSpark head reads), or with a classic MTP layer
        (`cfg.draft_kind == "mtp"`) the final C-stream state there ([Ot, C, D], what it reads).
        Rows of -1 in out_rows / tap_rows give unspecified values the caller ignores.
        """
        ctx = StepContext.build(batch)
        t = batch.tokens.shape[0]
        ids = batch.tokens[None]
        h = self.embed_streams(ids, ops)
        tap_rows = jnp.clip(batch.tap_rows, 0, t - 1)
        new_state, taps = [], []
        for i, block in enumerate(self.layers):
            st, h = block.step(h, ids, ctx, state[i], geometry, ops)
            new_state.append(st)
            if i in self.cfg.dspark_target_layer_ids:
                taps.append(jnp.mean(h[0, tap_rows].astype(jnp.float32), axis=1).astype(h.dtype))
        if self.cfg.draft_kind == "mtp":
            taps_arr = h[0, tap_rows]
        else:
            taps_arr = jnp.stack(taps, axis=1) if taps else jnp.zeros((tap_rows.shape[0], 0, h.shape[-1]), h.dtype)
        logits = self.logits(h[:, jnp.clip(batch.out_rows, 0, t - 1)])[0]
        return tuple(new_state), logits, taps_arr

    def logits(self, h_BTCD: jax.Array) -> jax.Array:
        """f32 logits [B, T, V] from the final C-stream residual: hc_head -> norm -> head."""
        cfg = self.cfg
        h = h_BTCD
        y = hc_head(h, self.hc_head_fn[...], self.hc_head_scale[...], self.hc_head_base[...],
                    norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
        y = self.norm(y).astype(jnp.float32)
        # The reference keeps the head in f32 and computes logits in f32.
        return jnp.einsum("btd,vd->btv", y, self.head.weight[...].astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)


class _Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (vocab, dim)) * dim ** -0.5).astype(param_dtype))
