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

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4 import quant
from dsv4.batch import StepContext
from dsv4.config import AttentionKind, ModelConfig, WeightFormat
from dsv4.layers.linear import Linear
from dsv4.layers.norm import RMSNorm, rms_norm
from dsv4.layers.rope import apply_rope, layer_frequencies
from dsv4.ops.registry import OpSet
from dsv4.state import CompressorRing, EntryTable, LayerState, StateGeometry


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

    def project(self, x_TD: jax.Array, positions_T: jax.Array) -> tuple[jax.Array, jax.Array]:
        """f32 value and gate projections [..., coff*dim]; the gate includes ape[pos % ratio]."""
        xf = x_TD.astype(jnp.float32)
        return self.wkv(xf), self.wgate(xf) + self.ape[...][positions_T % self.ratio]

    def pool(self, kv_XPd: jax.Array, gate_XPd: jax.Array, blocks_X: jax.Array, dtype, freqs) -> jax.Array:
        """Entries [X, dim] from their P gathered slots: per-channel softmax over slots, RMSNorm,
        RoPE at the entry's first position."""
        pooled = jnp.sum(kv_XPd * jax.nn.softmax(gate_XPd, axis=-2), axis=-2)
        return apply_rope(self.norm(pooled.astype(dtype)), blocks_X * self.ratio, freqs)

    def __call__(self, x_BTD: jax.Array, freqs: tuple[float, ...]) -> jax.Array:
        """Entries [B, T//ratio, dim] of the complete blocks of x (positions 0..T-1)."""
        b, t, _ = x_BTD.shape
        r, d = self.ratio, self.dim
        n = t // r
        if n == 0:  # shorter than one pool: nothing completed yet
            return jnp.zeros((b, 0, d), x_BTD.dtype)
        kv, gate = self.project(x_BTD[:, :n * r], jnp.arange(n * r))
        kv = kv.reshape(b, n, r, -1)
        gate = gate.reshape(b, n, r, -1)
        if self.overlap:
            prev_kv = jnp.pad(kv[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
            prev_gate = jnp.pad(gate[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
            kv = jnp.concatenate([prev_kv, kv[..., d:]], axis=2)  # [B, n, 2r, d]
            gate = jnp.concatenate([prev_gate, gate[..., d:]], axis=2)
        return self.pool(kv, gate, jnp.arange(n)[None], x_BTD.dtype, freqs)

    def step(self, x_TD: jax.Array, ctx: StepContext, ring: CompressorRing, ring_size: int, pool: EntryTable,
             entries_per_page: int, freqs: tuple[float, ...], ops: OpSet) -> tuple[CompressorRing, EntryTable]:
        """Write the entries the step's tokens complete into `pool`: (ring', pool').

        At most T//ratio + R entries complete in a step (a static bound). An entry pools its
        window's projections from the step's own rows where the request computed them in
        this step, and from the slot's ring for earlier positions. The pool is written raw;
        its codec applies the QAT transform when fake quant is on.
        """
        t = x_TD.shape[0]
        r, d = self.ratio, self.dim
        kv, gate = self.project(x_TD, ctx.positions)
        closes = ctx.valid & (ctx.positions % r == r - 1)
        (rows,) = jnp.nonzero(closes, size=min(t, t // r + ctx.num_requests), fill_value=t)
        safe = jnp.minimum(rows, t - 1)
        blocks = ctx.positions[safe] // r
        span = (2 if self.overlap else 1) * r
        key_pos = (blocks - (span // r - 1))[:, None] * r + jnp.arange(span)[None, :]
        hist = ctx.history_rows(key_pos, ring_size, ring.kv.shape[0], tokens=safe)
        from_step = hist >= ring.kv.shape[0]

        def gather(ring_vals: jax.Array, step_vals: jax.Array) -> jax.Array:
            a = ring_vals[jnp.clip(hist, 0, ring_vals.shape[0] - 1)]
            b = step_vals[jnp.clip(hist - ring_vals.shape[0], 0, t - 1)]
            v = jnp.where(from_step[..., None], b, a)
            if self.overlap:  # previous window through the first d channels, own window the second
                v = jnp.concatenate([v[:, :r, :d], v[:, r:, d:]], axis=1)
            return v

        present = (hist >= 0)[..., None]
        kv_slots = jnp.where(present, gather(ring.kv, kv), 0.0)
        gate_slots = jnp.where(present, gather(ring.gate, gate), -jnp.inf)
        entries = self.pool(kv_slots, gate_slots, blocks, x_TD.dtype, freqs)
        write = ctx.ring_write_rows(ring_size, ring.kv.shape[0])
        ring = CompressorRing(kv=ring.kv.at[write].set(kv, mode="drop"),
                              gate=ring.gate.at[write].set(gate, mode="drop"))
        entry_ids = jnp.where(rows < t, blocks, -1)[:, None]
        pool_rows = ctx.entry_rows(entry_ids, entries_per_page, pool.drop_row, tokens=safe)[:, 0]
        return ring, ops.table_write(pool, pool_rows, entries)


class Indexer(nnx.Module):
    """Lightning indexer: scores compressed keys with sum_i w_i relu(q_i . k) and keeps the top-k."""

    def __init__(self, cfg: ModelConfig, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        n_i, d_j = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, n_i * d_j, fmt=cfg.weight_format, param_dtype=param_dtype, rngs=rngs,
                           act_quant=cfg.fake_quant)
        self.weights_proj = Linear(cfg.hidden_size, n_i, fmt=WeightFormat.BF16, param_dtype=param_dtype, rngs=rngs)
        self.compressor = Compressor(cfg, dim=d_j, ratio=cfg.csa_ratio, overlap=True, param_dtype=param_dtype,
                                     rngs=rngs)

    def __call__(self, x_BTD: jax.Array, qr_BTL: jax.Array, freqs: tuple[float, ...], ops: OpSet) -> jax.Array:
        """Selected entry ids [B, T, min(topk, T//ratio)], -1 where nothing visible is left."""
        cfg = self.cfg
        b, t, _ = x_BTD.shape
        positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
        q = self.wq_b(qr_BTL, ops=ops).reshape(b, t, cfg.index_n_heads, cfg.index_head_dim)
        q = apply_rope(q, positions, freqs)
        keys = self.compressor(x_BTD, freqs)
        if cfg.fake_quant:
            q, keys = quant.fake_quant_indexer(q), quant.fake_quant_indexer(keys)
        w = self._head_weights(x_BTD)
        limit = (positions + 1) // cfg.csa_ratio
        return ops.indexer_topk(q, keys, w, limit, cfg.index_topk)


    def step(self, x_TD: jax.Array, qr_TL: jax.Array, ctx: StepContext, keys: EntryTable, ring: CompressorRing,
             geometry: StateGeometry, freqs: tuple[float, ...],
             ops: OpSet) -> tuple[EntryTable, CompressorRing, jax.Array]:
        """(keys', ring', selected entry ids [T, min(topk, entries per request)]) for the step's tokens."""
        cfg, t = self.cfg, x_TD.shape[0]
        r = cfg.csa_ratio
        epp = geometry.entries_per_page(r)
        q = apply_rope(self.wq_b(qr_TL, ops=ops).reshape(t, cfg.index_n_heads, cfg.index_head_dim), ctx.positions, freqs)
        ring, keys = self.compressor.step(x_TD, ctx, ring, geometry.compressor_ring_size(r, True), keys, epp, freqs,
                                          ops)
        if cfg.fake_quant:
            q = quant.fake_quant_indexer(q)
        w = self._head_weights(x_TD)
        limit = jnp.where(ctx.valid, (ctx.positions + 1) // r, 0)
        return keys, ring, ops.indexer_topk_paged(q, w, keys, ctx.page_table, epp, limit, cfg.index_topk)

    def _head_weights(self, x: jax.Array) -> jax.Array:
        # The score scale is folded into the head weights, so selection is scale-invariant.
        cfg = self.cfg
        return self.weights_proj(x).astype(jnp.float32) * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)


class Attention(nnx.Module):
    """Low-rank query, one shared K=V latent, sinks, grouped low-rank output projection."""

    def __init__(self, cfg: ModelConfig, layer: int, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg, self.layer = cfg, layer
        self.kind = cfg.layer_types[layer]
        fmt = cfg.weight_format
        d, n, h = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        aq = cfg.fake_quant  # REF's act_quant before each FP8 GEMM; wo_a is dequantised, unquantised input
        self.wq_a = Linear(d, cfg.q_lora_rank, fmt=fmt, param_dtype=param_dtype, rngs=rngs, act_quant=aq)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, param_dtype)
        self.wq_b = Linear(cfg.q_lora_rank, n * h, fmt=fmt, param_dtype=param_dtype, rngs=rngs, act_quant=aq)
        self.wkv = Linear(d, h, fmt=fmt, param_dtype=param_dtype, rngs=rngs, act_quant=aq)
        self.kv_norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype)
        self.attn_sink = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.wo_a = Linear(cfg.group_in_dim, cfg.o_groups * cfg.o_lora_rank, fmt=fmt, param_dtype=param_dtype,
                           rngs=rngs)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, d, fmt=fmt, param_dtype=param_dtype, rngs=rngs,
                           act_quant=aq)
        if self.kind is not AttentionKind.SLIDING:
            overlap = self.kind is AttentionKind.CSA
            self.compressor = Compressor(cfg, dim=h, ratio=cfg.compress_ratio(layer), overlap=overlap,
                                         param_dtype=param_dtype, rngs=rngs)
        if self.kind is AttentionKind.CSA:
            self.indexer = Indexer(cfg, param_dtype=param_dtype, rngs=rngs)
        self.freqs = layer_frequencies(cfg, layer)

    def project_in(self, x: jax.Array, positions: jax.Array, ops: OpSet) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(q [..., N, H] normed and rotated, q low-rank latent qr [..., L], kv [..., H] rotated, raw)."""
        cfg = self.cfg
        qr = self.q_norm(self.wq_a(x, ops=ops))
        q = self.wq_b(qr, ops=ops).reshape(*x.shape[:-1], cfg.num_attention_heads, cfg.head_dim)
        q = rms_norm(q, None, cfg.rms_norm_eps)  # per head, all H dims, before RoPE
        q = apply_rope(q, positions, self.freqs)
        kv = apply_rope(self.kv_norm(self.wkv(x, ops=ops)), positions, self.freqs)
        return q, qr, kv

    def __call__(self, x_BTD: jax.Array, ops: OpSet) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x_BTD.shape
        h = cfg.head_dim
        positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
        q, qr, kv = self.project_in(x_BTD, positions, ops)
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
        return self.project_out(o, ops)

    def step(self, x_TD: jax.Array, ctx: StepContext, st: LayerState, geometry: StateGeometry,
             ops: OpSet) -> tuple[LayerState, jax.Array]:
        """The step's tokens (flat, ragged over requests) against the stored state: (state', out [T, D]).

        Reads the window from the ring as it was BEFORE this step (a long chunk's own writes
        may wrap onto keys its first tokens still need) plus the step's fresh rows; compressed
        entries completed in this step are written first, then read like older ones.
        """
        cfg = self.cfg
        q, qr, kv = self.project_in(x_TD, ctx.positions, ops)
        ring_size = geometry.ring_size(cfg)
        fresh = EntryTable.from_values(kv, like=st.window)
        w = cfg.sliding_window
        key_pos = ctx.positions[:, None] - (w - 1) + jnp.arange(w)[None, :]
        window_idx = ctx.history_rows(key_pos, ring_size, st.window.rows)
        ring_rows = ctx.ring_write_rows(ring_size, st.window.drop_row)
        new_st = dataclasses.replace(st, window=ops.table_write(st.window, ring_rows, kv))

        comp, comp_idx = None, None
        if self.kind is not AttentionKind.SLIDING:
            r = self.compressor.ratio
            epp = geometry.entries_per_page(r)
            ring, comp = self.compressor.step(x_TD, ctx, st.compressor,
                                              geometry.compressor_ring_size(r, self.compressor.overlap),
                                              st.compressed, epp, self.freqs, ops)
            new_st = dataclasses.replace(new_st, compressed=comp, compressor=ring)
            if self.kind is AttentionKind.CSA:
                keys, iring, sel = self.indexer.step(x_TD, qr, ctx, st.index_keys, st.index_compressor, geometry,
                                                     self.freqs, ops)
                new_st = dataclasses.replace(new_st, index_keys=keys, index_compressor=iring)
            else:
                n_entries = epp * ctx.page_table.shape[1]
                j = jnp.arange(n_entries)[None, :]
                sel = jnp.where(j < ((ctx.positions + 1) // r)[:, None], j, -1)
            comp_idx = ctx.entry_rows(sel, epp, comp.drop_row)

        o = ops.sparse_attention_paged(q, (st.window, fresh), window_idx, comp, comp_idx, self.attn_sink[...],
                                       cfg.head_dim ** -0.5)
        o = apply_rope(o, ctx.positions, self.freqs, inverse=True)
        return new_st, self.project_out(o[None], ops)[0]

    def project_out(self, o_BTNH: jax.Array, ops: OpSet) -> jax.Array:
        """Grouped output projection: group g (heads g*N/G ..) -> rank L via its own block of wo_a, then wo_b."""
        cfg = self.cfg
        b, t = o_BTNH.shape[:2]
        g, rank = cfg.o_groups, cfg.o_lora_rank
        og = o_BTNH.reshape(b, t, g, cfg.group_in_dim)
        wo_a = self.wo_a.dense(og.dtype).reshape(g, rank, cfg.group_in_dim)
        z = jnp.einsum("btgi,gli->btgl", og, wo_a, preferred_element_type=jnp.float32).astype(og.dtype)
        return self.wo_b(z.reshape(b, t, g * rank), ops=ops)


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
