"""Attention: sliding window (all layers) + CSA (indexer-selected 4:1 entries) or HCA (all 128:1 entries).

Whole-sequence semantics (the sequence starts at position 0; no cache). Query t sees:
- window keys t-W+1 .. t (the query's own position included);
- CSA: up to `index_topk` compressed entries j < (t+1)//r chosen by the lightning indexer;
- HCA: every compressed entry j < (t+1)//r.
All selected rows go through one softmax with the per-head sink (`dsv4.ops.sparse_attention`).
K = V: one shared H-wide latent per token; its last R dims carry RoPE, so the output is
de-rotated at the query position before the grouped low-rank output projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4 import quant
from dsv4.config import AttentionKind, ModelConfig, WeightFormat
from dsv4.layers.linear import Linear
from dsv4.layers.norm import RMSNorm, rms_norm
from dsv4.layers.rope import apply_rope, layer_frequencies
from dsv4.ops.registry import OpSet


class Compressor(nnx.Module):
    """Pools every `ratio` tokens into one `dim`-wide entry with a per-channel softmax gate.

    Overlapped form (CSA, and the indexer's own compressor): entry j pools 2*ratio slots:
    block j-1 through the first `dim` channels and block j through the second `dim`
    channels (block -1 contributes nothing). Plain form (HCA): block j through its only
    `dim` channels. Projections and pooling run in f32 (as the reference).
    """

    def __init__(self, cfg: ModelConfig, *, dim: int, ratio: int, overlap: bool, param_dtype: jnp.dtype,
                 rngs: nnx.Rngs):
        coff = 2 if overlap else 1
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.wkv = Linear(cfg.hidden_size, coff * dim, fmt=WeightFormat.BF16, param_dtype=param_dtype, rngs=rngs)
        self.wgate = Linear(cfg.hidden_size, coff * dim, fmt=WeightFormat.BF16, param_dtype=param_dtype, rngs=rngs)
        self.ape = nnx.Param(jnp.zeros((ratio, coff * dim), jnp.float32))
        self.norm = RMSNorm(dim, cfg.rms_norm_eps, param_dtype)

    def __call__(self, x_BTD: jax.Array, freqs: tuple[float, ...]) -> jax.Array:
        """Entries [B, T//ratio, dim] of the complete blocks of x (positions 0..T-1)."""
        b, t, _ = x_BTD.shape
        r, d = self.ratio, self.dim
        n = t // r
        if n == 0:  # shorter than one pool: nothing completed yet
            return jnp.zeros((b, 0, d), x_BTD.dtype)
        xf = x_BTD[:, :n * r].astype(jnp.float32)
        kv = self.wkv(xf)  # f32
        gate = self.wgate(xf) + jnp.tile(self.ape[...], (n, 1))[None]
        kv = kv.reshape(b, n, r, -1)
        gate = gate.reshape(b, n, r, -1)
        if self.overlap:
            prev_kv = jnp.pad(kv[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
            prev_gate = jnp.pad(gate[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
            kv = jnp.concatenate([prev_kv, kv[..., d:]], axis=2)  # [B, n, 2r, d]
            gate = jnp.concatenate([prev_gate, gate[..., d:]], axis=2)
        pooled = jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2)  # [B, n, d]
        entries = self.norm(pooled.astype(x_BTD.dtype))
        positions = (jnp.arange(n) * r)[None, :]
        return apply_rope(entries, positions, freqs)


class Indexer(nnx.Module):
    """Lightning indexer: scores compressed keys with sum_i w_i relu(q_i . k) and keeps the top-k."""

    def __init__(self, cfg: ModelConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        n_i, d_j = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, n_i * d_j, fmt=cfg.weight_format, param_dtype=param_dtype, rngs=rngs)
        self.weights_proj = Linear(cfg.hidden_size, n_i, fmt=WeightFormat.BF16, param_dtype=param_dtype, rngs=rngs)
        self.compressor = Compressor(cfg, dim=d_j, ratio=cfg.csa_ratio, overlap=True, param_dtype=param_dtype,
                                     rngs=rngs)

    def __call__(self, x_BTD: jax.Array, qr_BTL: jax.Array, freqs: tuple[float, ...], ops: OpSet) -> jax.Array:
        """Selected entry ids [B, T, min(topk, T//ratio)], -1 where nothing visible is left."""
        cfg = self.cfg
        b, t, _ = x_BTD.shape
        positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
        q = self.wq_b(qr_BTL).reshape(b, t, cfg.index_n_heads, cfg.index_head_dim)
        q = apply_rope(q, positions, freqs)
        keys = self.compressor(x_BTD, freqs)
        if cfg.fake_quant:
            q, keys = quant.fake_quant_indexer(q), quant.fake_quant_indexer(keys)
        # The score scale is folded into the head weights, so selection is scale-invariant.
        w = self.weights_proj(x_BTD).astype(jnp.float32) * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
        limit = (positions + 1) // cfg.csa_ratio
        return ops.indexer_topk(q, keys, w, limit, cfg.index_topk)


class Attention(nnx.Module):
    """Low-rank query, one shared K=V latent, sinks, grouped low-rank output projection."""

    def __init__(self, cfg: ModelConfig, layer: int, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg, self.layer = cfg, layer
        self.kind = cfg.layer_types[layer]
        fmt = cfg.weight_format
        d, n, h = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.wq_a = Linear(d, cfg.q_lora_rank, fmt=fmt, param_dtype=param_dtype, rngs=rngs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, param_dtype)
        self.wq_b = Linear(cfg.q_lora_rank, n * h, fmt=fmt, param_dtype=param_dtype, rngs=rngs)
        self.wkv = Linear(d, h, fmt=fmt, param_dtype=param_dtype, rngs=rngs)
        self.kv_norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype)
        self.attn_sink = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.wo_a = Linear(cfg.group_in_dim, cfg.o_groups * cfg.o_lora_rank, fmt=fmt, param_dtype=param_dtype,
                           rngs=rngs)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, d, fmt=fmt, param_dtype=param_dtype, rngs=rngs)
        if self.kind is not AttentionKind.SLIDING:
            overlap = self.kind is AttentionKind.CSA
            self.compressor = Compressor(cfg, dim=h, ratio=cfg.compress_ratio(layer), overlap=overlap,
                                         param_dtype=param_dtype, rngs=rngs)
        if self.kind is AttentionKind.CSA:
            self.indexer = Indexer(cfg, param_dtype=param_dtype, rngs=rngs)
        self.freqs = layer_frequencies(cfg, layer)

    def __call__(self, x_BTD: jax.Array, ops: OpSet) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x_BTD.shape
        n, h = cfg.num_attention_heads, cfg.head_dim
        positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))

        qr = self.q_norm(self.wq_a(x_BTD))
        q = self.wq_b(qr).reshape(b, t, n, h)
        q = rms_norm(q, None, cfg.rms_norm_eps)  # per head, all H dims, before RoPE
        q = apply_rope(q, positions, self.freqs)
        kv = self.kv_norm(self.wkv(x_BTD))
        kv = apply_rope(kv, positions, self.freqs)
        if cfg.fake_quant:
            kv = quant.fake_quant_kv(kv, cfg.qk_rope_head_dim)

        idx = _window_indices(t, cfg.sliding_window)[None].repeat(b, axis=0)
        kv_all = kv
        if self.kind is not AttentionKind.SLIDING:
            entries = self.compressor(x_BTD, self.freqs)
            if cfg.fake_quant:
                entries = quant.fake_quant_kv(entries, cfg.qk_rope_head_dim)
            if self.kind is AttentionKind.CSA:
                sel = self.indexer(x_BTD, qr, self.freqs, ops)
            else:
                sel = _all_visible_entries(t, self.compressor.ratio)[None].repeat(b, axis=0)
            idx = jnp.concatenate([idx, jnp.where(sel >= 0, sel + t, -1)], axis=-1)
            kv_all = jnp.concatenate([kv, entries], axis=1)

        o = ops.sparse_attention(q, kv_all, idx, self.attn_sink[...], h ** -0.5)
        o = apply_rope(o, positions, self.freqs, inverse=True)
        return self.project_out(o)

    def project_out(self, o_BTNH: jax.Array) -> jax.Array:
        """Grouped output projection: group g (heads g*N/G ..) -> rank L via its own block of wo_a, then wo_b."""
        cfg = self.cfg
        b, t = o_BTNH.shape[:2]
        g, rank = cfg.o_groups, cfg.o_lora_rank
        og = o_BTNH.reshape(b, t, g, cfg.group_in_dim)
        wo_a = self.wo_a.dense(og.dtype).reshape(g, rank, cfg.group_in_dim)
        z = jnp.einsum("btgi,gli->btgl", og, wo_a, preferred_element_type=jnp.float32).astype(og.dtype)
        return self.wo_b(z.reshape(b, t, g * rank))


def _window_indices(t: int, window: int) -> jax.Array:
    """[T, min(W, T)] key positions t-W'+1 .. t per query, -1 before the sequence start."""
    w = min(window, t)
    idx = jnp.arange(t)[:, None] - (w - 1) + jnp.arange(w)[None, :]
    return jnp.where(idx >= 0, idx, -1).astype(jnp.int32)


def _all_visible_entries(t: int, ratio: int) -> jax.Array:
    """[T, T//ratio] entry ids j visible to query t (j < (t+1)//ratio), -1 otherwise."""
    n = t // ratio
    j = jnp.arange(n)[None, :]
    limit = (jnp.arange(t)[:, None] + 1) // ratio
    return jnp.where(j < limit, j, -1).astype(jnp.int32)
