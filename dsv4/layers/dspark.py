"""The DSpark draft head (spec section 9): three V4 blocks that draft a block of K tokens in one pass.

Module attribute names are the checkpoint's: the head's state paths are the official
`mtp.S.*` names (`mtp.0.attn.wq_a.weight`, `mtp.2.markov_head.markov_w1.weight`, ...), with
routed experts stacked along E as in the tower. The head shares the target's embedding and
LM head; it owns none.

Data flow:
- Context (9.3): the target's taps (the C-stream means of the outputs of
  `cfg.dspark_target_layer_ids`) at a committed position t become
  main_x_t = main_norm(main_proj(concat(taps))) (stage 0's weights), and each stage S stores
  ctx_t = rope(kv_norm_S(wkv_S(main_x_t)), t) (fake-quantised like the tower's KV) in its
  own ring slot t % R (R = `RING`). `ring_entries` computes ctx for all stages at once.
- Drafting (9.4): the block [anchor, noise x (K-1)] at positions p+1..p+K runs through the
  stages as full blocks (mHC, attention, MoE). Attention is MQA over the stage's ring
  entries for positions (p-R, p] (`ring_pos` says which position each slot holds; a slot
  holding anything else, e.g. a prefix-cache position whose hidden state was never
  computed here, is masked out) and the block's own K=V rows, all K queries seeing all K
  block rows (no causal mask inside the block). The block's K=V rows are never stored.
- Exit: hc_head -> norm -> the target's head gives base logits U [K, V] for the tokens at
  p+2..p+K+1; the Markov head adds markov_w2 @ markov_w1[prev] left to right, where prev is
  the anchor for slot 0 and the draft just sampled for later slots; the confidence head
  reads concat(xh_k, markov_w1[prev_k]).

Fake quantisation of the block's own K=V rows follows the tower's attention (inferred: the
spec's pseudo-code does not say).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4 import quant
from dsv4.config import AttentionKind, ModelConfig, RoutingKind
from dsv4.layers.linear import Linear
from dsv4.layers.mhc import hc_head, hc_post
from dsv4.layers.norm import RMSNorm
from dsv4.layers.rope import apply_rope
from dsv4.model import Block, _hc_params
from dsv4.ops.registry import OpSet

RING = 128  # context slots per stage and request (the draft's sliding window)


def stage_config(cfg: ModelConfig) -> ModelConfig:
    """The config of one draft stage as a one-layer tower: sliding-window attention (no
    compressor or indexer), score routing (never hash), no taps."""
    return cfg.replace(num_hidden_layers=1, layer_types=(AttentionKind.SLIDING,), mlp_layer_types=(RoutingKind.SCORE,),
                       dspark_target_layer_ids=(), num_draft_stages=0)


class MarkovHead(nnx.Module):
    def __init__(self, vocab: int, rank: int, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.markov_w1 = _Table(vocab, rank, 1.0, param_dtype, rngs)  # previous-token embedding
        self.markov_w2 = _Table(vocab, rank, rank ** -0.5, param_dtype, rngs)  # rank -> vocab unembedding


class ConfidenceHead(nnx.Module):
    def __init__(self, dim: int, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.proj = _Table(1, dim, dim ** -0.5, param_dtype, rngs)  # [1, D + rank], no bias


class _Table(nnx.Module):
    def __init__(self, rows: int, cols: int, std: float, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (rows, cols)) * std).astype(param_dtype))


class DSparkStage(Block):
    """One draft stage: a tower block (sliding attention, score-routed MoE), plus the context
    projection on the first stage and the exit heads on the last."""

    def __init__(self, cfg: ModelConfig, stage: int, n_stages: int, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(stage_config(cfg), 0, param_dtype=param_dtype, rngs=rngs)
        d = cfg.hidden_size
        if stage == 0:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * d, d, fmt=cfg.weight_format,
                                    param_dtype=param_dtype, rngs=rngs, act_quant=cfg.fake_quant)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype)
        if stage == n_stages - 1:
            self.norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype)
            self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _hc_params(cfg, rngs, cfg.hc_mult, 1)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, param_dtype, rngs)
            self.confidence_head = ConfidenceHead(d + cfg.dspark_markov_rank, param_dtype, rngs)

    def context_kv(self, main_x_TD: jax.Array, positions_T: jax.Array, ops: OpSet) -> jax.Array:
        """This stage's ring entries [T, H] for context rows main_x at `positions`."""
        cfg = self.cfg
        kv = apply_rope(self.attn.kv_norm(self.attn.wkv(main_x_TD, ops=ops)), positions_T, self.attn.freqs)
        return quant.fake_quant_kv(kv, cfg.qk_rope_head_dim) if cfg.fake_quant else kv

    def draft(self, h_RKCD: jax.Array, ids_RK: jax.Array, ring_RSH: jax.Array, ring_ok_RS: jax.Array,
              positions_RK: jax.Array, ops: OpSet) -> jax.Array:
        """The block through this stage: attention over the valid ring slots and every block row."""
        cfg = self.cfg
        attn = self.attn
        x, post, comb = self._pre(h_RKCD, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        xb = self.attn_norm(x)
        q, _, kb = attn.project_in(xb, positions_RK, ops)
        if cfg.fake_quant:
            kb = quant.fake_quant_kv(kb, cfg.qk_rope_head_dim)
        r, k = ids_RK.shape
        s = ring_RSH.shape[1]
        kv = jnp.concatenate([ring_RSH.astype(kb.dtype), kb], axis=1)  # [R, S + K, H]
        rows = jnp.concatenate([jnp.where(ring_ok_RS, jnp.arange(s)[None, :], -1),
                                jnp.broadcast_to(s + jnp.arange(k)[None, :], (r, k))], axis=1)  # [R, S + K]
        idx = jnp.broadcast_to(rows[:, None, :], (r, k, s + k)).astype(jnp.int32)  # same list for every query
        o = ops.sparse_attention(q, kv, idx, attn.attn_sink[...], cfg.head_dim ** -0.5)
        o = apply_rope(o, positions_RK, attn.freqs, inverse=True)
        h_RKCD = hc_post(attn.project_out(o, ops), h_RKCD, post, comb)
        return self._ffn_round_trip(h_RKCD, ids_RK, ops)


class DSparkHead(nnx.Module):
    """The draft head: `mtp` holds the stages (checkpoint names `mtp.S.*`)."""

    def __init__(self, cfg: ModelConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        if cfg.num_draft_stages < 1 or cfg.dspark_block_size < 1 or not cfg.dspark_target_layer_ids:
            raise ValueError("the config has no DSpark head (num_draft_stages, dspark_block_size and "
                             "dspark_target_layer_ids must be set)")
        if cfg.dspark_markov_rank < 1:
            raise ValueError(f"dspark_markov_rank must be >= 1, got {cfg.dspark_markov_rank}")
        self.cfg = cfg
        n = cfg.num_draft_stages
        self.mtp = nnx.List([DSparkStage(cfg, s, n, param_dtype=param_dtype, rngs=rngs) for s in range(n)])

    @property
    def block_size(self) -> int:
        return self.cfg.dspark_block_size

    def ring_entries(self, taps_TXD: jax.Array, positions_T: jax.Array, ops: OpSet) -> jax.Array:
        """Every stage's ring entries [stages, T, H] for committed positions with these taps."""
        first = self.mtp[0]
        t = taps_TXD.shape[0]
        main_x = first.main_norm(first.main_proj(taps_TXD.reshape(t, -1), ops=ops))
        return jnp.stack([stage.context_kv(main_x, positions_T, ops) for stage in self.mtp])

    def base_logits(self, anchor_R: jax.Array, anchor_pos_R: jax.Array, rings_ZRSH: jax.Array,
                    ring_pos_RS: jax.Array, embed_VD: jax.Array, head_VD: jax.Array | quant.Fp8Rows,
                    ops: OpSet, depth: int | None = None) -> tuple[jax.Array, jax.Array]:
        """(base logits U [R, K, V] f32, exit hidden xh [R, K, D]) of one block per request.

        depth: how many of the block's drafts to return (default: all of them; load-aware and
        capacity-aware verification check fewer). The block always runs at the length the head
        was trained on, as the reference DSpark does: its rows attend to each other both ways,
        so a shorter block would draft other tokens than the full block's first `depth`.

        head_VD: the target's LM head, dense (an f32 matmul, as the reference), or as
        `quant.Fp8Rows` (`quant.quant_fp8_rows(head)`, made once) for the opt-in row-wise FP8
        draft head: the drafts' logits change slightly, verification stays exact because q is
        computed from the same logits the drafts are drawn from.

        anchor_R: the token at position anchor_pos + 1 (the target's newest); rings_ZRSH
        [stages, R, S, H] with ring_pos_RS [R, S] the position each slot holds (-1: none).
        Slot j is read iff anchor_pos - S < ring_pos[j] <= anchor_pos.
        """
        cfg = self.cfg
        depth = self.block_size if depth is None else depth
        if not 1 <= depth <= self.block_size:
            raise ValueError(f"depth must lie in [1, {self.block_size}], got {depth}")
        k = self.block_size
        r = anchor_R.shape[0]
        ids = jnp.concatenate([anchor_R[:, None].astype(jnp.int32),
                               jnp.full((r, k - 1), cfg.dspark_noise_token_id, jnp.int32)], axis=1)
        positions = anchor_pos_R[:, None] + 1 + jnp.arange(k)[None, :]
        s = ring_pos_RS.shape[1]
        p = anchor_pos_R[:, None]
        ring_ok = (ring_pos_RS > p - s) & (ring_pos_RS <= p) & (ring_pos_RS >= 0)
        x = ops.embedding(embed_VD, ids)
        h = jnp.broadcast_to(x[:, :, None, :], (r, k, cfg.hc_mult, cfg.hidden_size))
        for z, stage in enumerate(self.mtp):
            h = stage.draft(h, ids, rings_ZRSH[z], ring_ok, positions, ops)
        last = self.mtp[-1]
        xh = hc_head(h[:, :depth], last.hc_head_fn[...], last.hc_head_scale[...], last.hc_head_base[...],
                     norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
        y = last.norm(xh).astype(jnp.float32)
        if isinstance(head_VD, quant.Fp8Rows):
            u = quant.fp8_rows_matmul(y.reshape(r * depth, -1), head_VD).reshape(r, depth, -1)
        else:
            u = jnp.einsum("rkd,vd->rkv", y, head_VD.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        return u, xh

    def markov_bias(self, prev_R: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(bias [R, V] f32 added to a slot's base logits, e [R, rank] the previous token's row)."""
        mk = self.mtp[-1].markov_head
        e = mk.markov_w1.weight[...][prev_R].astype(jnp.float32)
        bias = jnp.einsum("rk,vk->rv", e, mk.markov_w2.weight[...].astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
        return bias, e

    def confidence_logit(self, xh_RD: jax.Array, e_RM: jax.Array) -> jax.Array:
        """The confidence head's logit [R] (sigmoid and temperature are the scheduler's)."""
        w = self.mtp[-1].confidence_head.proj.weight[...].astype(jnp.float32)[0]
        return jnp.concatenate([xh_RD.astype(jnp.float32), e_RM], axis=-1) @ w
