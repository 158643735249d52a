"""Hugging Face transformers 5.23.0 oracle for DeepSeek-V4-Flash parity tests (float32, CPU).

This module only *imports and calls* ``transformers.DeepseekV4ForCausalLM``; no HF code is copied.
It builds a randomised tiny HF model from an official-format ``config.json`` dict, exports its
weights under the official checkpoint names, and returns full-sequence logits.

Public API
----------
* ``build_hf_model(config_json, seed) -> DeepseekV4ForCausalLM`` (float32, eval, eager attention,
  eager experts), every parameter and persistent buffer randomised (see ``randomise_``).
* ``export_official_state_dict(model, config_json) -> dict[str, np.ndarray]`` (official names,
  official [out, in] layouts, float32 except ``ffn.gate.tid2eid`` int64).
* ``expected_official_shapes(config_json) -> dict[str, tuple]`` (what the export must contain).
* ``write_official_checkpoint(directory, state, config_json, n_shards=2)``: safetensors shards +
  ``model.safetensors.index.json`` + an HF-loadable ``config.json``.
* ``hf_logits(model, ids[int32 B,S]) -> float32 [B,S,V]`` (one full-sequence forward, no cache).
* ``hf_trace(model, ids, attentions=False)``: logits plus per-layer stream / attention / MoE
  outputs, the CSA selections, expert choices and selection margins (for localising a divergence).
* ``hf_config_from_official(config_json)``, ``hf_loadable_config_json(config_json)``,
  ``layer_compress_ratios(config_json)`` (effective ratio per layer: 0, 4 or the HCA rate).
* ``TINY_CONFIGS`` (official-format dicts) and ``TINY_SEQ_LENS`` (a good sequence length for each).

Official-format configs and the HCA ratio
------------------------------------------
HF's legacy folding maps ``compress_ratios`` entries through the fixed table {0: sliding, 4: CSA,
128: HCA} (``DeepseekV4Config.__post_init__``); any other value raises ``KeyError``. The actual HCA
rate comes from ``compress_rates["heavily_compressed_attention"]`` (legacy key
``compress_rate_hca``). ``TINY_CONFIGS`` therefore write the *literal* ratio into
``compress_ratios`` (e.g. ``[0, 0, 4, 8, 4, 8, 4]``), exactly as REF's ``inference/config.json``
semantics read it, and ``hf_config_from_official`` translates: 0 -> sliding, 4 -> CSA, any other
r > 0 -> HCA with rate r (one HCA rate per model). A config that already uses the 128 label plus
``compress_rate_hca``/``compress_rates`` is also accepted. ``hf_loadable_config_json`` produces
the equivalent dict in the form HF can parse from disk (128 labels + ``compress_rate_hca``).
``compress_ratios`` longer than ``num_hidden_layers`` is truncated (the tail belongs to MTP).

=====================================================================================
HF 5.23.0 FULL-SEQUENCE SEMANTICS (``modeling_deepseek_v4.py``), float32, no cache
=====================================================================================
Notation: B batch, S tokens at positions t = 0..S-1 (``position_ids`` defaults to arange; the
oracle never passes anything else), D hidden, C = hc_mult, N heads, H head_dim,
R = qk_rope_head_dim, G = o_groups, W = sliding_window, E experts, K = num_experts_per_tok,
F = moe_intermediate_size, nI/dI = index_n_heads/index_head_dim, r = a layer's compress rate.
All of this is for ``model(input_ids=..., use_cache=False)`` (``hf_logits``); with
``use_cache=True`` a single first call gives the same numbers (checked by the self-test).
Everything below is CHECKED by ``tests/test_hf_oracle_selfcheck.py``: an independent float64
numpy forward written from this text (``_np_forward``), fed with the exported official-name
weights, matches HF's logits to ~5e-6 on all TINY_CONFIGS, and mutating any one of the rules
(RoPE position of compressed entries, overlap halves, comb transpose, visibility bounds, relu,
bias-free weights, sink, query norm, clamps, window size, top-k, Sinkhorn count, YaRN) breaks it.

1. Entry (``DeepseekV4Model.forward``): ``x = embed_tokens[ids]`` ([B,S,D]); streams
   ``h = x`` broadcast to [B,S,C,D] (plain copy). Two RoPE tables are evaluated once per call:
   ``"main"`` and ``"compress"`` (see 9). The attention mask is
   ``create_sliding_window_causal_mask`` -> eager mask: additive 0 / ``finfo(f32).min``
   (not -inf) over [B,1,S,S].

2. Block (``DeepseekV4DecoderLayer.forward``)::

       post, comb, x = attn_hc(h)                 # DeepseekV4HyperConnection
       a = self_attn(input_layernorm(x))
       h = post[...,None] * a[:,:,None,:] + comb^T @ h   # out_k = post_k*a + sum_j comb[j,k]*h_j
       post, comb, x = ffn_hc(h)
       m = mlp(post_attention_layernorm(x), input_ids)
       h = post[...,None] * m[:,:,None,:] + comb^T @ h

3. mHC (``DeepseekV4HyperConnection.forward``), all f32, per token:
   ``xf = flatten(h) [B,S,C*D]``; ``xn = xf * rsqrt(mean(xf^2) + rms_norm_eps)`` (the eps is
   ``rms_norm_eps``, NOT hc_eps; HF normalises *before* the projection, REF scales after: equal
   up to rounding); ``mix = xn @ fn^T`` ([.., (2+C)*C]); split [C | C | C*C];
   ``pre = sigmoid(mix[:C]*scale[0] + base[:C]) + hc_eps``;
   ``post = 2*sigmoid(mix[C:2C]*scale[1] + base[C:2C])`` (no eps);
   ``comb[j,k] = mix[2C + C*j + k]*scale[2] + base[2C + C*j + k]`` (row-major C x C);
   ``comb = softmax_k(comb) + hc_eps``; ``comb = comb / (sum_j comb + hc_eps)`` (column
   normalisation first); then ``hc_sinkhorn_iters - 1`` times: row-normalise
   (``/ (sum_k + hc_eps)``) then column-normalise (``/ (sum_j + hc_eps)``). So 1 + 2*(iters-1)
   normalisations in total, ending on a column normalisation.
   ``x = sum_j pre_j * h_j`` (not normalised). comb is consumed transposed (contract its FIRST
   index), see 2.
   ``hc_head`` (``DeepseekV4HyperHead``): same input normalisation (rms_norm_eps),
   ``pre = sigmoid((xn @ hc_fn^T) * hc_scale + hc_base) + hc_eps`` (C values),
   ``y = sum_j pre_j h_j``; then ``norm`` (RMSNorm), then ``lm_head`` on ALL positions
   (``logits_to_keep=0``), no bias, no softcap.

4. RMSNorm (``DeepseekV4RMSNorm``): ``w * (x * rsqrt(mean(x^2) + rms_norm_eps))`` in f32.
   Query per-head norm (``DeepseekV4UnweightedRMSNorm``): ``x * rsqrt(mean_H(x^2) + eps)``, no
   weight, over all H dims of each head, applied BEFORE RoPE. The indexer query has NO such norm.

5. Attention (``DeepseekV4Attention.forward``), every layer kind::

       qr = q_a_norm(x @ q_a_proj^T)            # [B,S,q_lora_rank]; also the indexer's input
       q  = (qr @ q_b_proj^T).view(B,S,N,H); q = rmsnorm_noweight(q); q = rope(q, t)
       kv = kv_norm(x @ kv_proj^T)              # [B,S,H], ONE head, used as K and as V
       kv = rope(kv, t)                         # V therefore carries rotated rope dims
       KV = concat([kv (S rows), compressed (T rows)])   # compressed only for CSA/HCA
       logits[n,t,s] = (q[n,t] . KV[s]) * H^-0.5 + mask[t,s]
       sink: per head n a logit ``sinks[n]`` is appended as an extra column; softmax over
             [logits..., sink] after subtracting the row max (the max INCLUDES the sink);
             the sink column is dropped; it contributes no value (denominator only):
             p_s = exp(l_s) / (sum_s' exp(l_s') + exp(sinks[n]))
       o[n,t] = sum_s p_s KV[s]
       o = rope(o, t) with -sin                 # inverse RoPE at the QUERY position, rope dims only
       og = o.view(B,S,G,N*H/G)                 # group g = heads g*N/G .. (g+1)*N/G-1 (head-major)
       z[g] = og[g] @ Wa[g]^T, Wa = o_a_proj.weight.view(G, o_lora_rank, N*H/G)   # block-diagonal
       out = flatten(z) [B,S,G*o_lora_rank] @ o_b_proj^T
   Window mask (``sliding_window_overlay`` + causal): query t sees window keys s with
   ``t - W < s <= t``, i.e. W keys including itself (max(0,t-W+1)..t). Same W for every layer
   kind, and the window is over raw token KV only; compressed entries get their own mask
   (``block_bias``, additive 0 / -inf) concatenated after the window mask.

6. Compressor pooling (``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` /
   ``DeepseekV4Indexer``, stateless branch ``past_key_values is None``). Input is the same
   ``x`` (post input_layernorm) as the attention. ``kvp = x @ kv_proj^T``,
   ``g = x @ gate_proj^T``; only the first ``U = (S // r) * r`` tokens are used: the trailing
   ``S mod r`` tokens are DISCARDED (no partial entry; T = S // r entries).
   ``g`` is reshaped to [B, T, r, .] and ``position_bias`` ([r, .], = official ``ape``) is added
   by slot within the block (slot = t mod r).
   * HCA (rate r, width H, no overlap): ``entry_j = sum_{i<r} kvp[rj+i] * softmax_i(g[rj+i])``,
     softmax per channel over the r slots.
   * CSA (rate 4, kv_proj/gate_proj/ape width 2d; d = H for attention, d = dI for the indexer's
     own compressor): pool j has 2r = 8 slots: slots 0..3 = block j-1's FIRST half channels
     ``[:d]`` (value and gate, the gate including ape[slot, :d]), slots 4..7 = block j's SECOND
     half ``[d:]`` (gate including ape[slot, d:]). For j = 0 slots 0..3 are value 0, gate -inf
     (weight 0). Softmax per channel over the 8 slots; ``entry_j = sum slot value * weight``.
   * then ``entry = kv_norm(entry)`` (RMSNorm with the compressor's own ``norm`` weight, width d);
     then RoPE on the last R dims at position ``j * r`` (the first token of block j; for CSA
     that is the first token of the CURRENT block, not of block j-1), using the ``"compress"``
     table.
   * The indexer's compressor is identical with d = dI (rope on its last R dims, R from the
     main ``qk_rope_head_dim``; requires dI >= R).
   * Entry positions are ``j * r`` from the entry count alone; ``position_ids`` are not used by
     the stateless compressor (only by the window mask, the token RoPE and the visibility
     thresholds), so an offset ``position_ids`` would desynchronise them (never done here).

7. Compressed-entry visibility.
   * HCA (``DeepseekV4HCACompressor.forward``): query t sees every entry j with
     ``j < (t + 1) // r`` (all completed pools, no selection).
   * CSA (``DeepseekV4Indexer.forward`` + ``DeepseekV4CSACompressor.forward``): indexer score
     (``DeepseekV4IndexerScorer``)::

         qI = (qr @ indexer.q_b_proj^T).view(B,S,nI,dI); qI = rope(qI, t, "compress")  # no norm
         kI = indexer compressed entries [B,T,dI] (6.)
         w  = (x @ weights_proj^T) * nI^-0.5                       # [B,S,nI], may be negative
         score[t,j] = sum_h w[t,h] * relu(qI[t,h] . kI[j]) * dI^-0.5

     Then ``score[t,j] = -inf`` for ``j >= (t+1)//4`` (future); ``k = min(index_topk, T)``
     with T = S // 4 the number of entries in the WHOLE sequence (not per query);
     ``torch.topk(score, k)``; picks with ``j >= (t+1)//4`` become -1 and are dropped.
     Net effect: query t attends to the top ``min(index_topk, (t+1)//4)`` visible entries by
     score (plus its window). Selected entries are unordered (a 0/-inf mask), so order does not
     matter. Ties: exact ties are broken by CPU ``torch.topk`` (unspecified). Exact ties are
     realistic here: a score is exactly 0.0 whenever every head's ``qI.kI <= 0``
     (probability 2^-nI per pair), and since ``w`` can be negative, 0 can sit at the top-k
     boundary. Use ``hf_trace(...)["margins"]`` to check the boundary gap for a test input.

8. MoE (``DeepseekV4SparseMoeBlock``): ``out = routed(x) + shared(x)``, x = post-norm input.
   Router (``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter``):
   ``logits = x @ gate.weight^T``; ``s = sqrt(softplus(logits))`` (torch softplus, beta 1,
   threshold 20 -> identity above 20); selection: scored layers ``topk(s + e_score_correction_bias, K)``
   (bias for SELECTION only, flat top-K, no groups); hash layers ``tid2eid[input_ids]``
   (``mlp_layer_types`` = first ``num_hash_layers`` layers, whatever their attention kind);
   ``w = s[sel] / (sum(s[sel]) + 1e-20) * routed_scaling_factor`` (always normalised: HF
   IGNORES ``norm_topk_prob``; ``scoring_func`` is looked up in ACT2FN; ``topk_method`` and
   ``n_shared_experts`` are ignored: exactly one shared expert).
   Expert e (``DeepseekV4Experts``, eager): ``gu = x @ gate_up_proj[e]^T`` (rows 0..F-1 = w1 =
   gate, rows F..2F-1 = w3 = up); ``gate = min(gu[:F], swiglu_limit)``,
   ``up = clamp(gu[F:], -limit, limit)``; ``y_e = (silu(gate) * up) @ down_proj[e]^T``
   (= w2); ``routed = sum_k w_k * y_{e_k}`` (weight applied AFTER down_proj; experts
   accumulated in expert-id order). Shared expert (``DeepseekV4MLP``): same clamps, weight 1.

9. RoPE (``DeepseekV4RotaryEmbedding``, ``apply_rotary_pos_emb``): interleaved pairs
   (2i, 2i+1) on the LAST R dims of each vector; angle ``t * inv_freq[i]`` in f32;
   ``(a, b) -> (a cos - b sin, a sin + b cos)``; inverse uses -sin. Table per layer:
   ``sliding_attention`` layers use ``"main"``: ``inv_freq = 1/rope_theta^(2i/R)``, no YaRN.
   CSA and HCA layers (q, window kv, inverse rope, compressed entries, indexer q and keys) use
   ``"compress"``: base ``compress_rope_theta`` with YaRN (``_compute_yarn_parameters``):
   ``pf = base^(arange(0,R,2)/R)``; ``extra = 1/pf``, ``inter = 1/(factor*pf)``;
   ``low = max(floor(R*ln(orig/(beta_fast*2pi)) / (2 ln base)), 0)``,
   ``high = min(ceil(R*ln(orig/(beta_slow*2pi)) / (2 ln base)), R-1)``
   (orig = original_max_position_embeddings; if low == high then high += 0.001);
   ``ramp_i = clamp((i - low)/(high - low), 0, 1)`` for i = 0..R/2-1;
   ``inv_freq = inter*ramp + extra*(1-ramp)``. attention_factor is forced to 1.0 (cos/sin not
   scaled; softmax scale stays H^-0.5). The YaRN table does not depend on the sequence length.
   HF computes inv_freq in f32 torch (``base ** (f32 exponent)``); an implementation computing
   it in f64 may differ by ~1 ulp of inv_freq (negligible at test lengths).

Surprises / differences from the spec worth knowing
  * ``compress_ratios`` entries other than 0/4/128 crash HF's config; 128 is a label there and
    the HCA rate comes from ``compress_rate_hca`` (handled here, see above).
  * The trailing incomplete block (S mod r tokens) produces NO compressed entry in a
    full-sequence forward (REF keeps it in decode state; equivalent for full-sequence logits
    because no query could see that entry anyway).
  * Indexer: k is fixed from the TOTAL entry count, not per query; future picks are dropped
    (-1), equivalent to per-query top-min(k, visible). Exact ties at score 0 are possible.
  * Window masking uses ``finfo.min`` (additive) while compressed masking uses -inf; the sink
    is part of the softmax max (REF's kernel excludes it; same value in exact arithmetic).
  * HF ignores ``norm_topk_prob``, ``topk_method``, ``n_shared_experts`` and adds 1e-20 to the
    routing normaliser; the routing weight multiplies AFTER the expert's down projection.
  * HF's experts default to the ``grouped_mm`` implementation; this oracle forces ``"eager"``
    (same math, simpler accumulation order).
  * Official ``wo_a`` [G*o_lora_rank, N*H/G] is stored unchanged as ``o_a_proj.weight``.
  * The config's ``torch_dtype: bfloat16`` is ignored here (everything float32); a
    ``quantization_config`` is dropped (the oracle is unquantised).
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

import numpy as np

__all__ = [
    "TINY_CONFIGS",
    "TINY_SEQ_LENS",
    "build_hf_model",
    "randomise_",
    "export_official_state_dict",
    "expected_official_shapes",
    "write_official_checkpoint",
    "hf_config_from_official",
    "hf_loadable_config_json",
    "hf_logits",
    "hf_trace",
    "layer_compress_ratios",
]


# --------------------------------------------------------------------------------------------
# Tiny official-format configs
# --------------------------------------------------------------------------------------------

def _tiny(**kw: Any) -> dict:
    base = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_key_value_heads": 1,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16",
    }
    base.update(kw)
    return base


TINY_CONFIGS: list[dict] = [
    # A: 7 layers, all three kinds, 3 hash layers (0,1 SWA; 2 CSA), HCA rate 8, extra trailing
    # compress_ratios entry (MTP slot) to exercise truncation. rope 8 of 28 (nope 20).
    # YaRN: low 0, high 1, so pair 0 keeps its frequency and pairs 1..3 are divided by 4.
    _tiny(
        vocab_size=257, hidden_size=48, num_hidden_layers=7,
        num_attention_heads=6, head_dim=28, qk_rope_head_dim=8,
        q_lora_rank=20, o_groups=3, o_lora_rank=14, sliding_window=8,
        compress_ratios=[0, 0, 4, 8, 4, 8, 4, 0], num_hash_layers=3,
        index_n_heads=7, index_head_dim=12, index_topk=3,
        n_routed_experts=9, num_experts_per_tok=3, moe_intermediate_size=22,
        swiglu_limit=1.5,  # small so the SwiGLU clamps actually bite at O(1) activations
        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=128,
    ),
    # B: 5 layers, CSA at layer 1 is a hash layer, HCA rate 16, rope 16 of 36 (nope 20),
    # YaRN with a larger original length so two pairs are blended (ramp 1/3, 2/3).
    # swiglu_limit small (1.25) so the clamps bite; config C keeps the real 10.0.
    _tiny(
        vocab_size=311, hidden_size=40, num_hidden_layers=5,
        num_attention_heads=4, head_dim=36, qk_rope_head_dim=16,
        q_lora_rank=18, o_groups=2, o_lora_rank=10, sliding_window=6,
        compress_ratios=[0, 4, 16, 4, 16], num_hash_layers=2,
        index_n_heads=9, index_head_dim=20, index_topk=2,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=18,
        swiglu_limit=1.25,
        rope_scaling={"type": "yarn", "factor": 8, "original_max_position_embeddings": 512,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=4096,
    ),
    # C: 6 layers, 9 heads in 3 groups, rope 8 of 22 (nope 14), dI 10 > R 8, HCA rate 8 on two
    # consecutive layers, SWA first and last, W = 12; YaRN blends pair 1 at ramp 1/2.
    _tiny(
        vocab_size=263, hidden_size=56, num_hidden_layers=6,
        num_attention_heads=9, head_dim=22, qk_rope_head_dim=8,
        q_lora_rank=26, o_groups=3, o_lora_rank=11, sliding_window=12,
        compress_ratios=[0, 4, 8, 8, 4, 0], num_hash_layers=2,
        index_n_heads=11, index_head_dim=10, index_topk=4,
        n_routed_experts=11, num_experts_per_tok=2, moe_intermediate_size=26,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=16384,
    ),
]

# Sequence lengths for TINY_CONFIGS: > window, not a multiple of 4 or of the HCA rate (so a
# trailing incomplete block exists), and more CSA entries (S//4) than index_topk.
TINY_SEQ_LENS: list[int] = [43, 53, 47]


# --------------------------------------------------------------------------------------------
# Config translation
# --------------------------------------------------------------------------------------------

_DROP_KEYS = ("quantization_config", "expert_dtype", "torch_dtype", "dtype", "transformers_version")


def _layer_kinds(config_json: dict) -> tuple[list[str], int | None]:
    """Per-layer HF layer types and the HCA rate from an official config dict."""
    n = config_json["num_hidden_layers"]
    ratios = list(config_json["compress_ratios"])[:n]
    if len(ratios) != n:
        raise ValueError(f"compress_ratios has {len(ratios)} entries for {n} layers")
    rates = config_json.get("compress_rates") or {}
    hca_rate = config_json.get("compress_rate_hca", rates.get("heavily_compressed_attention"))
    csa_rate = config_json.get("compress_rate_csa", rates.get("compressed_sparse_attention", 4))
    if csa_rate != 4:
        raise ValueError("HF's CSA is always overlapped; REF overlaps only ratio 4: keep CSA at 4")
    literal = sorted({r for r in ratios if r not in (0, 4, 128)})
    if len(literal) > 1:
        raise ValueError(f"one HCA rate per model is supported by HF, got {literal}")
    if literal:
        if hca_rate is not None and hca_rate != literal[0]:
            raise ValueError(f"compress_ratios says HCA rate {literal[0]}, compress_rate_hca {hca_rate}")
        if 128 in ratios:
            raise ValueError("mixing the 128 label with a literal HCA rate is ambiguous")
        hca_rate = literal[0]
    if hca_rate is None:
        hca_rate = 128
    kinds = []
    for r in ratios:
        if r == 0:
            kinds.append("sliding_attention")
        elif r == 4:
            kinds.append("compressed_sparse_attention")
        else:
            kinds.append("heavily_compressed_attention")
    return kinds, hca_rate


def layer_compress_ratios(config_json: dict) -> list[int]:
    """The effective compress ratio of each layer (0, 4 or the HCA rate)."""
    kinds, hca = _layer_kinds(config_json)
    return [{"sliding_attention": 0, "compressed_sparse_attention": 4}.get(k, hca) for k in kinds]


def hf_loadable_config_json(config_json: dict) -> dict:
    """The official-format dict in the form HF parses from disk: ``compress_ratios`` with the
    128 label for HCA layers plus ``compress_rate_hca`` for the real rate; no quantization."""
    d = copy.deepcopy(config_json)
    for k in _DROP_KEYS:
        d.pop(k, None)
    kinds, hca = _layer_kinds(config_json)
    full = list(config_json["compress_ratios"])
    label = [0 if k == "sliding_attention" else 4 if k == "compressed_sparse_attention" else 128
             for k in kinds]
    tail = [0 if r == 0 else 4 if r == 4 else 128 for r in full[len(kinds):]]
    d["compress_ratios"] = label + tail
    d.pop("compress_rates", None)
    d.pop("compress_rate_csa", None)
    d["compress_rate_hca"] = hca
    d["torch_dtype"] = "float32"
    return d


def hf_config_from_official(config_json: dict):
    """``DeepseekV4Config`` (eager attention, eager experts) from an official config dict."""
    from transformers import DeepseekV4Config

    d = hf_loadable_config_json(config_json)
    d.pop("torch_dtype", None)
    cfg = DeepseekV4Config(**d)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    R = config_json["qk_rope_head_dim"]
    if cfg.qk_rope_head_dim != R:
        raise ValueError(f"HF derived rope dim {cfg.qk_rope_head_dim} != {R} (float rounding of R/H)")
    kinds, hca = _layer_kinds(config_json)
    assert cfg.layer_types == kinds, (cfg.layer_types, kinds)
    assert cfg.compress_rates["heavily_compressed_attention"] == hca
    assert cfg.compress_rates["compressed_sparse_attention"] == 4
    return cfg


# --------------------------------------------------------------------------------------------
# Building and randomising
# --------------------------------------------------------------------------------------------

def randomise_(model, seed: int) -> dict[str, str]:
    """Overwrite every parameter and persistent buffer of an HF DeepseekV4ForCausalLM in place,
    from ``torch.Generator().manual_seed(seed)``, in ``named_parameters`` order then buffers.
    Returns {hf_name: rule} for documentation/inspection.

    Rules (``n`` = standard normal):
      * RMSNorm gains (``*layernorm.weight``, ``*_norm.weight``, ``model.norm.weight``,
        compressor/indexer ``kv_norm.weight``): ``1 + 0.1 n``.
      * 2-D linear weights [out, in] (q_a/q_b/kv/o_a/o_b projections, compressor and indexer
        kv/gate projections, indexer q_b_proj and weights_proj, router ``gate.weight``, shared
        expert, ``lm_head``): ``n / sqrt(in)``.
      * experts: ``gate_up_proj`` [E,2F,D] ``n/sqrt(D)``; ``down_proj`` [E,D,F] ``n/sqrt(F)``.
      * ``embed_tokens.weight``: ``n`` (unit-scale activations).
      * ``sinks`` (official attn_sink): ``0.5 n`` (HF init: zeros).
      * ``position_bias`` (official ape; compressor and indexer): ``0.5 n`` (HF init: zeros).
      * mHC ``fn`` / ``hc_fn`` [*, C*D]: ``n / sqrt(C*D)`` (input is RMS-normalised);
        ``base`` / ``hc_base``: ``1.0 n`` (HF init: zeros; large enough that the Sinkhorn
        iteration count visibly matters);
        ``scale`` / ``hc_scale``: ``1 + 0.25 n`` (HF init: ones).
      * buffer ``e_score_correction_bias`` (official gate.bias): ``0.5 n`` (HF init: zeros).
      * buffer ``tid2eid`` [V,K] int64: per row K distinct expert ids, a uniformly random
        K-subset of [0,E) in random order (HF init: zeros).
    NOT randomised: the non-persistent RoPE buffers ``*rotary_emb.{main,compress}_inv_freq``
    and ``*_original_inv_freq`` (derived from the config).
    """
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    rules: dict[str, str] = {}

    def normal(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                val, rule = 1.0 + 0.1 * normal(p.shape), "1+0.1n"
            elif name.endswith("embed_tokens.weight"):
                val, rule = normal(p.shape), "n"
            elif leaf == "sinks":
                val, rule = 0.5 * normal(p.shape), "0.5n"
            elif leaf == "position_bias":
                val, rule = 0.5 * normal(p.shape), "0.5n"
            elif leaf in ("fn", "hc_fn"):
                val, rule = normal(p.shape) / math.sqrt(p.shape[1]), "n/sqrt(in)"
            elif leaf in ("base", "hc_base"):
                val, rule = 1.0 * normal(p.shape), "1.0n"
            elif leaf in ("scale", "hc_scale"):
                val, rule = 1.0 + 0.25 * normal(p.shape), "1+0.25n"
            elif leaf == "gate_up_proj":
                val, rule = normal(p.shape) / math.sqrt(p.shape[2]), "n/sqrt(D)"
            elif leaf == "down_proj" and p.dim() == 3:
                val, rule = normal(p.shape) / math.sqrt(p.shape[2]), "n/sqrt(F)"
            elif leaf == "weight" and p.dim() == 2:
                val, rule = normal(p.shape) / math.sqrt(p.shape[1]), "n/sqrt(in)"
            else:
                raise RuntimeError(f"randomise_: no rule for parameter {name} {tuple(p.shape)}")
            p.copy_(val)
            rules[name] = rule
        for name, b in model.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith("inv_freq"):
                continue
            if leaf == "e_score_correction_bias":
                b.copy_(0.5 * normal(b.shape))
                rules[name] = "0.5n"
            elif leaf == "tid2eid":
                V, K = b.shape
                E = model.config.n_routed_experts
                perm = torch.argsort(torch.rand((V, E), generator=gen), dim=-1)[:, :K]
                b.copy_(perm.to(b.dtype))
                rules[name] = "distinct random ids"
            else:
                raise RuntimeError(f"randomise_: no rule for buffer {name} {tuple(b.shape)}")
    return rules


def build_hf_model(config_json: dict, seed: int):
    """Float32, eval-mode, eager ``DeepseekV4ForCausalLM`` with every parameter and persistent
    buffer randomised by ``randomise_(model, seed)``."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    cfg = hf_config_from_official(config_json)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))  # HF's own init (overwritten anyway) stays reproducible
        model = DeepseekV4ForCausalLM(cfg)
    model = model.to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    randomise_(model, seed)
    return model


# --------------------------------------------------------------------------------------------
# Export under official names
# --------------------------------------------------------------------------------------------

_GLOBAL = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}


def expected_official_shapes(config_json: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape an official-format checkpoint of this config holds
    (tower only, no ``.scale`` tensors since the oracle is unquantised)."""
    c = config_json
    V, D, L = c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]
    N, H, C = c["num_attention_heads"], c["head_dim"], c["hc_mult"]
    G, OR, QR = c["o_groups"], c["o_lora_rank"], c["q_lora_rank"]
    E, K, F = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    nI, dI = c["index_n_heads"], c["index_head_dim"]
    M = (2 + C) * C
    n_hash = c.get("num_hash_layers", 3)
    s: dict[str, tuple[int, ...]] = {
        "embed.weight": (V, D), "head.weight": (V, D), "norm.weight": (D,),
        "hc_head_fn": (C, C * D), "hc_head_base": (C,), "hc_head_scale": (1,),
    }
    for i, r in enumerate(layer_compress_ratios(c)):
        p = f"layers.{i}."
        s.update({
            p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,),
            p + "hc_attn_fn": (M, C * D), p + "hc_attn_base": (M,), p + "hc_attn_scale": (3,),
            p + "hc_ffn_fn": (M, C * D), p + "hc_ffn_base": (M,), p + "hc_ffn_scale": (3,),
            p + "attn.wq_a.weight": (QR, D), p + "attn.q_norm.weight": (QR,),
            p + "attn.wq_b.weight": (N * H, QR), p + "attn.wkv.weight": (H, D),
            p + "attn.kv_norm.weight": (H,), p + "attn.attn_sink": (N,),
            p + "attn.wo_a.weight": (G * OR, N * H // G), p + "attn.wo_b.weight": (D, G * OR),
            p + "ffn.gate.weight": (E, D),
            p + "ffn.shared_experts.w1.weight": (F, D), p + "ffn.shared_experts.w3.weight": (F, D),
            p + "ffn.shared_experts.w2.weight": (D, F),
        })
        if i < n_hash:
            s[p + "ffn.gate.tid2eid"] = (V, K)
        else:
            s[p + "ffn.gate.bias"] = (E,)
        for e in range(E):
            s[p + f"ffn.experts.{e}.w1.weight"] = (F, D)
            s[p + f"ffn.experts.{e}.w3.weight"] = (F, D)
            s[p + f"ffn.experts.{e}.w2.weight"] = (D, F)
        if r:
            co = 2 if r == 4 else 1
            s.update({
                p + "attn.compressor.wkv.weight": (co * H, D),
                p + "attn.compressor.wgate.weight": (co * H, D),
                p + "attn.compressor.ape": (r, co * H),
                p + "attn.compressor.norm.weight": (H,),
            })
        if r == 4:
            s.update({
                p + "attn.indexer.wq_b.weight": (nI * dI, QR),
                p + "attn.indexer.weights_proj.weight": (nI, D),
                p + "attn.indexer.compressor.wkv.weight": (2 * dI, D),
                p + "attn.indexer.compressor.wgate.weight": (2 * dI, D),
                p + "attn.indexer.compressor.ape": (4, 2 * dI),
                p + "attn.indexer.compressor.norm.weight": (dI,),
            })
    return s


def export_official_state_dict(model, config_json: dict) -> dict[str, np.ndarray]:
    """The model's weights under official DeepSeek-V4 checkpoint names, as numpy arrays
    (float32; ``ffn.gate.tid2eid`` int64). Routed experts are unstacked from HF's
    ``gate_up_proj`` [E, 2F, D] (rows [0,F) = w1, [F,2F) = w3) and ``down_proj`` [E, D, F]
    (= w2). Shapes are checked against ``expected_official_shapes``."""
    import torch

    out: dict[str, np.ndarray] = {}
    sd = model.state_dict()
    F = config_json["moe_intermediate_size"]
    for name, t in sd.items():
        if name.endswith("inv_freq"):
            continue
        arr = t.detach().cpu()
        arr = arr.numpy().astype(np.int64) if arr.dtype == torch.int64 else arr.float().numpy()
        if name in _GLOBAL:
            out[_GLOBAL[name]] = np.ascontiguousarray(arr)
            continue
        if not name.startswith("model.layers."):
            raise KeyError(f"unmapped HF tensor {name}")
        idx, rest = name[len("model.layers."):].split(".", 1)
        p = f"layers.{idx}."
        if rest == "mlp.experts.gate_up_proj":
            assert arr.shape[1] == 2 * F, arr.shape
            for e in range(arr.shape[0]):
                out[p + f"ffn.experts.{e}.w1.weight"] = np.ascontiguousarray(arr[e, :F])
                out[p + f"ffn.experts.{e}.w3.weight"] = np.ascontiguousarray(arr[e, F:])
        elif rest == "mlp.experts.down_proj":
            for e in range(arr.shape[0]):
                out[p + f"ffn.experts.{e}.w2.weight"] = np.ascontiguousarray(arr[e])
        elif rest in _LAYER:
            out[p + _LAYER[rest]] = np.ascontiguousarray(arr)
        else:
            raise KeyError(f"unmapped HF tensor {name}")
    expected = expected_official_shapes(config_json)
    missing = sorted(set(expected) - set(out))
    extra = sorted(set(out) - set(expected))
    bad = {k: (out[k].shape, expected[k]) for k in expected if k in out and out[k].shape != expected[k]}
    if missing or extra or bad:
        raise AssertionError(f"export mismatch: missing={missing[:5]} extra={extra[:5]} shapes={bad}")
    for k, v in out.items():
        want = np.int64 if k.endswith("tid2eid") else np.float32
        assert v.dtype == want, (k, v.dtype)
    return out


def write_official_checkpoint(directory: str, state: dict[str, np.ndarray], config_json: dict,
                              n_shards: int = 2) -> None:
    """Write ``state`` as ``model-0000k-of-0000n.safetensors`` shards (split by layer),
    ``model.safetensors.index.json`` and ``config.json`` (``hf_loadable_config_json``)."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    L = config_json["num_hidden_layers"]

    def shard_of(name: str) -> int:
        if n_shards == 1 or not name.startswith("layers."):
            return 0
        return 1 + (int(name.split(".")[1]) * (n_shards - 1)) // L

    shards: list[dict[str, np.ndarray]] = [dict() for _ in range(n_shards)]
    for k, v in state.items():
        shards[min(shard_of(k), n_shards - 1)][k] = np.ascontiguousarray(v)
    weight_map = {}
    total = 0
    for i, sh in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(sh, os.path.join(directory, fname), metadata={"format": "pt"})
        for k, v in sh.items():
            weight_map[k] = fname
            total += v.nbytes
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                  indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_loadable_config_json(config_json), f, indent=2)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------

def _ids_tensor(ids: np.ndarray):
    import torch

    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be [B, S], got {ids.shape}")
    return torch.from_numpy(ids.astype(np.int64))


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    """Full-sequence logits [B, S, V] float32 (positions 0..S-1, no cache, input_ids passed)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=_ids_tensor(ids), use_cache=False)
    return out.logits.float().cpu().numpy()


def hf_trace(model, ids: np.ndarray, attentions: bool = False) -> dict[str, Any]:
    """Forward with hooks, for localising a divergence. Returns:
      * ``logits`` [B,S,V];
      * ``layer_out``: list over layers of the [B,S,C,D] stream state after each block;
      * ``attn_out``: list of each attention module's output [B,S,D] (after o_b_proj);
      * ``moe_out``: list of each MoE block's output [B,S,D];
      * ``final_hidden``: [B,S,D] after hc_head and norm;
      * ``csa_selected``: {layer: bool [B,S,T]} compressed entries each query attends to;
      * ``moe_selected``: {layer: int [B*S,K]} expert ids (sorted per token);
      * ``margins``: {("indexer"|"router", layer): min over queries/tokens of the score gap
        between the last selected and the best unselected candidate (inf if nothing was
        dropped)}. A tiny margin means a float32 reimplementation may legitimately pick a
        different set; exact ties (gap 0) are broken by torch.topk.
      * ``attentions`` (only if ``attentions=True``): per layer the softmax probabilities
        [B,N,S,S+T] over [window keys (all S positions, masked ones 0) | T compressed entries],
        sink column already dropped (rows sum to < 1).
    """
    import torch

    layers = model.model.layers
    rec: dict[str, Any] = {"layer_out": [None] * len(layers), "attn_out": [None] * len(layers),
                           "moe_out": [None] * len(layers), "csa_selected": {}, "moe_selected": {},
                           "margins": {}}
    ids_t = _ids_tensor(ids)
    B, S = ids_t.shape
    hooks = []

    def np_(t):
        return t.detach().float().cpu().numpy()

    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, i=i: rec["layer_out"].__setitem__(i, np_(o))))
        hooks.append(layer.self_attn.register_forward_hook(
            lambda m, a, o, i=i: rec["attn_out"].__setitem__(i, np_(o[0]))))
        hooks.append(layer.mlp.register_forward_hook(
            lambda m, a, o, i=i: rec["moe_out"].__setitem__(i, np_(o))))
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            def comp_hook(m, a, o, i=i):
                bias = o[1]
                rec["csa_selected"][i] = np_(bias[:, 0] == 0) > 0

            def scorer_hook(m, a, o, i=i):
                sc = np_(o)  # [B,S,T]
                T = sc.shape[-1]
                k = model.config.index_topk
                t = np.arange(S)[:, None]
                vis = np.arange(T)[None, :] < (t + 1) // 4  # [S,T]
                gap = math.inf
                for b in range(sc.shape[0]):
                    for q in range(S):
                        v = np.sort(sc[b, q][vis[q]])[::-1]
                        if len(v) > k:
                            gap = min(gap, float(v[k - 1] - v[k]))
                rec["margins"][("indexer", i)] = gap
            hooks.append(comp.register_forward_hook(comp_hook))
            hooks.append(comp.indexer.scorer.register_forward_hook(scorer_hook))

        def gate_hook(m, a, o, i=i):
            logits, _, idx = o
            rec["moe_selected"][i] = np.sort(idx.detach().cpu().numpy(), axis=-1)
            if hasattr(m, "e_score_correction_bias"):
                s = np_(m.score_fn(logits) + m.e_score_correction_bias)
                s = np.sort(s, axis=-1)[:, ::-1]
                k = m.top_k
                rec["margins"][("router", i)] = float(np.min(s[:, k - 1] - s[:, k])) if s.shape[1] > k else math.inf
        hooks.append(layer.mlp.gate.register_forward_hook(gate_hook))
    hooks.append(model.model.norm.register_forward_hook(
        lambda m, a, o: rec.__setitem__("final_hidden", np_(o))))
    try:
        with torch.no_grad():
            out = model(input_ids=ids_t, use_cache=False, output_attentions=attentions)
    finally:
        for h in hooks:
            h.remove()
    rec["logits"] = np_(out.logits)
    if attentions:
        rec["attentions"] = [np_(a) for a in out.attentions]
    return rec
