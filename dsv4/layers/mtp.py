"""The preview checkpoint's classic MTP layer (spec section 8) as a drafter: mode `mtp`.

One V4 block (`mtp.0.*`: sliding-window attention, score-routed MoE, mHC) with its own
input and exit: for the tower's final C-stream state h_t at position t and the token at
t+1,

    x_t = e_proj(enorm(embed[tok_{t+1}])) (broadcast over the C streams) + h_proj(hnorm(h_t))
    out_t = block(x_t)                         at position t, attending to its own rows
    logits_t = head(norm(hc_head(out_t)))      the next-next token (t+2); shared embed and head

`forward` is exactly that over a whole sequence (the reference twin). Serving keeps the
layer's K=V rows in a ring per request (`RING` slots, the window `cfg.sliding_window`):
`ring_entries` computes a committed position's row from the target's final state there
(the step's taps in this mode) and the token after it. Drafting K tokens is K passes of
the block (`propose`): pass j at position p+j (p: the newest committed position, whose
successor is the anchor) reads the ring rows of positions (p+j-W, p) and the passes' own
rows p..p+j, feeds its output state to the next pass with the token it drew, and its
logits are draft j's distribution. The same layer is reused for every depth, as vLLM's
`mtp` method does (acceptance drops with depth). MTP has no confidence head: its
confidence logits are 0 (capacity-aware verification needs the DSpark head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4 import quant
from dsv4.config import ModelConfig
from dsv4.layers.dspark import RING, stage_config
from dsv4.layers.linear import Linear
from dsv4.layers.mhc import hc_head, hc_post
from dsv4.layers.norm import RMSNorm
from dsv4.layers.rope import apply_rope
from dsv4.model import Block, _hc_params
from dsv4.ops.registry import OpSet

MAX_DEPTH = 5  # drafts per round at most (the layer is applied once per draft)


class MTPLayer(Block):
    """`mtp.0`: a tower block plus e_proj / h_proj / enorm / hnorm on the way in and
    norm / hc_head on the way out."""

    def __init__(self, cfg: ModelConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(stage_config(cfg), 0, param_dtype=param_dtype, rngs=rngs)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        aq = cfg.fake_quant  # REF's act_quant before each FP8 GEMM
        self.e_proj = Linear(d, d, fmt=cfg.weight_format, param_dtype=param_dtype, rngs=rngs, act_quant=aq)
        self.h_proj = Linear(d, d, fmt=cfg.weight_format, param_dtype=param_dtype, rngs=rngs, act_quant=aq)
        self.enorm = RMSNorm(d, eps, param_dtype)
        self.hnorm = RMSNorm(d, eps, param_dtype)
        self.norm = RMSNorm(d, eps, param_dtype)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _hc_params(cfg, rngs, cfg.hc_mult, 1)

    def inputs(self, h_BTCD: jax.Array, next_ids_BT: jax.Array, embed_VD: jax.Array, ops: OpSet) -> jax.Array:
        """x [B, T, C, D]: the embedding of the next token and the previous state, projected."""
        e = self.e_proj(self.enorm(ops.embedding(embed_VD, next_ids_BT)), ops=ops)
        return e[:, :, None, :] + self.h_proj(self.hnorm(h_BTCD), ops=ops)

    def rows(self, x_BTCD: jax.Array, positions_BT: jax.Array, ops: OpSet):
        """(q, kv rows, mHC post, mHC comb) of the block's attention for inputs x."""
        cfg = self.cfg
        x, post, comb = self._pre(x_BTCD, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        q, _, kv = self.attn.project_in(self.attn_norm(x), positions_BT, ops)
        if cfg.fake_quant:
            kv = quant.fake_quant_kv(kv, cfg.qk_rope_head_dim)
        return q, kv, post, comb

    def exit_logits(self, out_BTCD: jax.Array, head_VD: jax.Array | quant.Fp8Rows) -> jax.Array:
        """f32 logits [B, T, V] from the layer's output state (its own hc_head and norm); the
        head dense (f32 matmul, as the tower) or row-wise FP8 (`quant.Fp8Rows`, opt-in)."""
        cfg = self.cfg
        y = hc_head(out_BTCD, self.hc_head_fn[...], self.hc_head_scale[...], self.hc_head_base[...],
                    norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
        y = self.norm(y).astype(jnp.float32)
        if isinstance(head_VD, quant.Fp8Rows):
            b, t, d = y.shape
            return quant.fp8_rows_matmul(y.reshape(b * t, d), head_VD).reshape(b, t, -1)
        return jnp.einsum("btd,vd->btv", y, head_VD.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


class MTPHead(nnx.Module):
    """The drafter of mode `mtp`: `mtp` holds the one layer (checkpoint names `mtp.0.*`)."""

    def __init__(self, cfg: ModelConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        if cfg.num_draft_stages != 1 or cfg.dspark_block_size:
            raise ValueError(f"the config has no classic MTP layer (num_draft_stages {cfg.num_draft_stages}, "
                             f"dspark_block_size {cfg.dspark_block_size}: that is a DSpark head)")
        self.cfg = cfg
        self.mtp = nnx.List([MTPLayer(cfg, param_dtype=param_dtype, rngs=rngs)])

    @property
    def block_size(self) -> int:
        return MAX_DEPTH

    @property
    def layer(self) -> MTPLayer:
        return self.mtp[0]

    def forward(self, h_BTCD: jax.Array, next_ids_BT: jax.Array, embed_VD: jax.Array, head_VD: jax.Array,
                ops: OpSet) -> jax.Array:
        """The reference: logits [B, T, V] (f32) for the token at t+2, for the tower's final
        states h at positions 0..T-1 and the tokens at 1..T, the block attending causally
        over its own rows (spec 8)."""
        layer = self.layer
        x = layer.inputs(h_BTCD, next_ids_BT, embed_VD, ops)
        return layer.exit_logits(layer(x, next_ids_BT, ops), head_VD)

    def ring_entries(self, taps_TCD: jax.Array, positions_T: jax.Array, next_ids_T: jax.Array,
                     embed_VD: jax.Array, ops: OpSet) -> jax.Array:
        """The layer's ring rows [1, T, H] of committed positions: taps are the tower's final
        C-stream states there, next_ids the tokens that follow them."""
        layer = self.layer
        x = layer.inputs(taps_TCD[None], next_ids_T[None], embed_VD, ops)
        return layer.rows(x, positions_T[None], ops)[1]

    def draft_logits(self, h_RCD: jax.Array, token_R: jax.Array, pos_R: jax.Array, ring_RSH: jax.Array,
                     ring_ok_RS: jax.Array, own_RJH: jax.Array, embed_VD: jax.Array, head_VD: jax.Array,
                     ops: OpSet) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One pass at positions pos (one row per request): (logits [R, V] f32, output state
        [R, C, D], this row's K=V [R, H]). Keys: the valid ring rows and own_RJH, the rows of
        the earlier passes of this round (J may be 0), then the row itself."""
        layer = self.layer
        cfg = self.cfg
        x = layer.inputs(h_RCD[:, None], token_R[:, None], embed_VD, ops)  # [R, 1, C, D]
        q, kv, post, comb = layer.rows(x, pos_R[:, None], ops)
        r, s = ring_ok_RS.shape
        j = own_RJH.shape[1]
        keys = jnp.concatenate([ring_RSH.astype(kv.dtype), own_RJH.astype(kv.dtype), kv], axis=1)  # [R, S+J+1, H]
        idx = jnp.concatenate([jnp.where(ring_ok_RS, jnp.arange(s)[None, :], -1),
                               jnp.broadcast_to(s + jnp.arange(j + 1)[None, :], (r, j + 1))], axis=1)
        o = ops.sparse_attention(q, keys, idx[:, None, :].astype(jnp.int32), layer.attn.attn_sink[...],
                                 cfg.head_dim ** -0.5)
        o = apply_rope(o, pos_R[:, None], layer.attn.freqs, inverse=True)
        out = hc_post(layer.attn.project_out(o, ops), x, post, comb)
        out = layer._ffn_round_trip(out, token_R[:, None], ops)
        return layer.exit_logits(out, head_VD)[:, 0], out[:, 0], kv[:, 0]

    def window_ok(self, ring_pos_RS: jax.Array, anchor_pos_R: jax.Array, pos_R: jax.Array) -> jax.Array:
        """Ring slots a pass at `pos` reads: committed positions before the anchor's
        predecessor p that lie in the window (pos - W, pos]."""
        w = min(self.cfg.sliding_window, RING)
        return (ring_pos_RS >= 0) & (ring_pos_RS < anchor_pos_R[:, None]) & (ring_pos_RS > (pos_R - w)[:, None])
