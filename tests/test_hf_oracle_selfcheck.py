"""Self-checks of tests/hf_oracle.py.

1. Naming round trip: export under official names -> safetensors shards + index + config.json ->
   ``DeepseekV4ForCausalLM.from_pretrained`` -> logits equal bit for bit. This proves the export is
   the inverse of HF's own load-time renaming/stacking.
2. Nothing trivial: every randomised tensor is non-degenerate, tid2eid rows are distinct ids.
3. The oracle module docstring's semantics: an independent numpy float64 forward written from
   that docstring, fed with the EXPORTED official-name weights, reproduces HF's logits; and the
   visibility pattern read from HF's attention probabilities matches the stated rules.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4 port (needs 5.23.0)",
                allow_module_level=True)

try:  # tests/ is a package when run from the repo root
    from tests import hf_oracle as ho
except ImportError:  # pragma: no cover - run from elsewhere
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hf_oracle as ho  # noqa: E402

CASES = list(zip(range(len(ho.TINY_CONFIGS)), ho.TINY_CONFIGS, ho.TINY_SEQ_LENS))
IDS = [f"cfg{i}" for i in range(len(CASES))]


def _ids(cfg, S, B=2, seed=123):
    return np.random.default_rng(seed).integers(0, cfg["vocab_size"], size=(B, S)).astype(np.int32)


@pytest.fixture(scope="module")
def built():
    out = {}
    for i, cfg, S in CASES:
        model = ho.build_hf_model(cfg, seed=1000 + i)
        out[i] = (model, ho.export_official_state_dict(model, cfg))
    return out


# ------------------------------------------------------------------------------------------
# 1. round trip through HF's loader
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("i,cfg,S", CASES, ids=IDS)
def test_official_names_roundtrip(built, tmp_path, i, cfg, S):
    from transformers import DeepseekV4ForCausalLM

    model, state = built[i]
    ckpt = tmp_path / "ckpt"
    ho.write_official_checkpoint(str(ckpt), state, cfg, n_shards=3)
    assert (ckpt / "model.safetensors.index.json").exists()
    reloaded, info = DeepseekV4ForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager", output_loading_info=True)
    reloaded.eval()
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), (key, info.get(key))
    assert reloaded.config.layer_types == model.config.layer_types
    assert reloaded.config.compress_rates == model.config.compress_rates
    ids = _ids(cfg, S)
    a = ho.hf_logits(model, ids)
    b = ho.hf_logits(reloaded, ids)
    assert a.dtype == np.float32 and a.shape == (2, S, cfg["vocab_size"])
    assert np.array_equal(a, b), float(np.abs(a - b).max())
    # and the reloaded model exports to the very same official tensors
    state2 = ho.export_official_state_dict(reloaded, cfg)
    assert state2.keys() == state.keys()
    for k in state:
        assert np.array_equal(state[k], state2[k]), k


# ------------------------------------------------------------------------------------------
# 2. randomisation is non-trivial
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("i,cfg,S", CASES, ids=IDS)
def test_randomisation_nontrivial(built, i, cfg, S):
    _, st = built[i]
    E, K = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    for k, v in st.items():
        if k.endswith("tid2eid"):
            assert v.dtype == np.int64 and v.min() >= 0 and v.max() < E
            assert all(len(set(row)) == K for row in v.tolist()), k
            assert len({tuple(r) for r in v.tolist()}) > 1
            continue
        assert v.dtype == np.float32 and np.all(np.isfinite(v)), k
        assert np.std(v) > 0.01 if v.size > 1 else v.item() != 1.0, k
        if k.endswith(("attn_sink", ".ape", "gate.bias", "_base")):
            assert np.all(v != 0), k
        if k.endswith("norm.weight"):
            assert 0.5 < v.mean() < 1.5 and not np.all(v == 1.0), k
    # same seed -> same model, different seed -> different model
    m2 = ho.build_hf_model(cfg, seed=1000 + i)
    st2 = ho.export_official_state_dict(m2, cfg)
    assert all(np.array_equal(st[k], st2[k]) for k in st)
    m3 = ho.build_hf_model(cfg, seed=7)
    assert not np.array_equal(st["layers.0.attn.attn_sink"],
                              ho.export_official_state_dict(m3, cfg)["layers.0.attn.attn_sink"])


# ------------------------------------------------------------------------------------------
# 3a. visibility rules read off HF's attention probabilities
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("i,cfg,S", CASES, ids=IDS)
def test_visibility_rules(built, i, cfg, S):
    model, _ = built[i]
    ids = _ids(cfg, S)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids.astype(np.int64)), use_cache=False,
                    output_attentions=True)
    W, k = cfg["sliding_window"], cfg["index_topk"]
    t = np.arange(S)[:, None]
    win = (np.arange(S)[None, :] <= t) & (np.arange(S)[None, :] > t - W)
    for layer, r in enumerate(ho.layer_compress_ratios(cfg)):
        p = out.attentions[layer].numpy()  # [B, N, S, S + T], sink column already dropped
        T = p.shape[-1] - S
        assert T == (S // r if r else 0)  # trailing incomplete block gives no entry
        nz = p > 0
        assert np.array_equal(nz[..., :S], np.broadcast_to(win, nz[..., :S].shape)), layer
        rows = p.sum(-1)
        assert np.all(rows < 1.0) and np.all(rows > 0.0)  # the sink takes some mass
        if r:
            vis = np.arange(T)[None, :] < (t + 1) // r
            comp = nz[..., S:]
            assert np.all(comp <= vis)
            if r == 4:
                count = comp.sum(-1)  # [B, N, S]
                assert np.array_equal(count, np.broadcast_to(np.minimum(k, vis.sum(-1)), count.shape))
                assert np.all(comp == comp[:, :1])  # same selection for every head
            else:
                assert np.array_equal(comp, np.broadcast_to(vis, comp.shape))


# ------------------------------------------------------------------------------------------
# 3b. independent numpy forward from the docstring, on the exported official weights
# ------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 if w is None else w)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def _inv_freq(cfg, kind):
    R = cfg["qk_rope_head_dim"]
    i2 = np.arange(0, R, 2, dtype=np.float64)
    if kind == "main":
        return 1.0 / cfg["rope_theta"] ** (i2 / R)
    base = cfg["compress_rope_theta"]
    y = cfg["rope_scaling"]
    pf = base ** (i2 / R)
    extra, inter = 1.0 / pf, 1.0 / (y["factor"] * pf)

    def corr(rot):
        return R * math.log(y["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(y["beta_fast"])), 0)
    high = min(math.ceil(corr(y["beta_slow"])), R - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(R // 2) - low) / (high - low), 0, 1)
    return inter * ramp + extra * (1 - ramp)


def _rope(x, pos, inv, inverse=False):
    """Interleaved RoPE on the last R dims; x is [B, S, ..., dim] with positions along axis 1
    (or pos given per row of axis 1)."""
    R = 2 * inv.shape[0]
    ang = pos[:, None].astype(np.float64) * inv[None, :]  # [S, R/2]
    shape = (1, ang.shape[0]) + (1,) * (x.ndim - 3) + (R // 2,)
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    if inverse:
        sin = -sin
    a, b = x[..., -R::2], x[..., -R + 1::2]
    out = x.copy()
    out[..., -R::2] = a * cos - b * sin
    out[..., -R + 1::2] = a * sin + b * cos
    return out


def _np_forward(st, cfg, ids):
    f = lambda k: st[k].astype(np.float64)  # noqa: E731
    eps, hc_eps, C = cfg["rms_norm_eps"], cfg["hc_eps"], cfg["hc_mult"]
    N, H, G, OR = cfg["num_attention_heads"], cfg["head_dim"], cfg["o_groups"], cfg["o_lora_rank"]
    W, K, E = cfg["sliding_window"], cfg["num_experts_per_tok"], cfg["n_routed_experts"]
    nI, dI, topk = cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]
    lim = cfg["swiglu_limit"]
    B, S = ids.shape
    pos = np.arange(S)
    tables = {"main": _inv_freq(cfg, "main"), "compress": _inv_freq(cfg, "compress")}

    def hc_pre(h, p):
        fn, base, scale = f(p + "_fn"), f(p + "_base"), f(p + "_scale")
        xf = h.reshape(B, S, -1)
        mix = _rms(xf, None, eps) @ fn.T
        pre = _sigmoid(mix[..., :C] * scale[0] + base[:C]) + hc_eps
        post = 2 * _sigmoid(mix[..., C:2 * C] * scale[1] + base[C:2 * C])
        comb = (mix[..., 2 * C:] * scale[2] + base[2 * C:]).reshape(B, S, C, C)
        comb = _softmax(comb, -1) + hc_eps
        comb = comb / (comb.sum(-2, keepdims=True) + hc_eps)
        for _ in range(cfg["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(-1, keepdims=True) + hc_eps)
            comb = comb / (comb.sum(-2, keepdims=True) + hc_eps)
        return (pre[..., None] * h).sum(2), post, comb

    def hc_post(x, h, post, comb):
        return post[..., None] * x[:, :, None, :] + np.einsum("bsjk,bsjd->bskd", comb, h)

    def compress(x, p, r, d, inv):
        T = S // r
        kvp = (x @ f(p + "wkv.weight").T)[:, :T * r].reshape(B, T, r, -1)
        g = (x @ f(p + "wgate.weight").T)[:, :T * r].reshape(B, T, r, -1) + f(p + "ape")
        if r == 4:
            vals = np.zeros((B, T, 2 * r, d))
            gates = np.full((B, T, 2 * r, d), -np.inf)
            vals[:, :, r:], gates[:, :, r:] = kvp[..., d:], g[..., d:]
            vals[:, 1:, :r], gates[:, 1:, :r] = kvp[:, :-1, :, :d], g[:, :-1, :, :d]
        else:
            vals, gates = kvp, g
        e = (vals * _softmax(gates, 2)).sum(2)
        e = _rms(e, f(p + "norm.weight"), eps)
        return _rope(e, pos[:T] * r, inv)  # [B, T, d]

    def attention(x, p, r):
        inv = tables["compress" if r else "main"]
        qr = _rms(x @ f(p + "wq_a.weight").T, f(p + "q_norm.weight"), eps)
        q = (qr @ f(p + "wq_b.weight").T).reshape(B, S, N, H)
        q = _rope(_rms(q, None, eps), pos, inv)
        kv = _rope(_rms(x @ f(p + "wkv.weight").T, f(p + "kv_norm.weight"), eps), pos, inv)
        keys = kv
        t = pos[:, None]
        allowed = (pos[None, :] <= t) & (pos[None, :] > t - W)
        allowed = np.broadcast_to(allowed, (B, S, S))
        if r:
            comp = compress(x, p + "compressor.", r, H, inv)
            T = comp.shape[1]
            vis = np.broadcast_to(np.arange(T)[None, :] < (t + 1) // r, (B, S, T))
            if r == 4:
                qI = _rope((qr @ f(p + "indexer.wq_b.weight").T).reshape(B, S, nI, dI), pos, inv)
                kI = compress(x, p + "indexer.compressor.", 4, dI, inv)
                w = (x @ f(p + "indexer.weights_proj.weight").T) * nI ** -0.5
                sc = np.maximum(np.einsum("bshd,btd->bsht", qI, kI), 0) * dI ** -0.5
                score = np.einsum("bsht,bsh->bst", sc, w)
                score = np.where(vis, score, -np.inf)
                order = np.argsort(-score, axis=-1, kind="stable")
                rank = np.argsort(order, axis=-1)
                vis = vis & (rank < topk)
            keys = np.concatenate([kv, comp], axis=1)
            allowed = np.concatenate([allowed, vis], axis=-1)
        logits = np.einsum("bsnh,bth->bnst", q, keys) * H ** -0.5
        logits = np.where(allowed[:, None], logits, -np.inf)
        sink = f(p + "attn_sink")[None, :, None, None]
        m = np.maximum(logits.max(-1, keepdims=True), sink)
        e = np.exp(logits - m)
        prob = e / (e.sum(-1, keepdims=True) + np.exp(sink - m))
        o = np.einsum("bnst,bth->bsnh", prob, keys)
        o = _rope(o, pos, inv, inverse=True)
        og = o.reshape(B, S, G, N * H // G)
        z = np.einsum("bsgk,grk->bsgr", og, f(p + "wo_a.weight").reshape(G, OR, N * H // G))
        return z.reshape(B, S, G * OR) @ f(p + "wo_b.weight").T

    def ffn(x, p, tok):
        xs = x.reshape(B * S, -1)
        s = np.sqrt(np.logaddexp(0.0, xs @ f(p + "gate.weight").T))
        if p + "gate.tid2eid" in st:
            sel = st[p + "gate.tid2eid"][tok.reshape(-1)]
        else:
            sel = np.argsort(-(s + f(p + "gate.bias")), axis=-1, kind="stable")[:, :K]
        w = np.take_along_axis(s, sel, -1)
        w = w / (w.sum(-1, keepdims=True) + 1e-20) * cfg["routed_scaling_factor"]

        def mlp(q):
            g = np.minimum(xs @ f(q + "w1.weight").T, lim)
            u = np.clip(xs @ f(q + "w3.weight").T, -lim, lim)
            return (g * _sigmoid(g) * u) @ f(q + "w2.weight").T

        y = mlp(p + "shared_experts.")
        for e in range(E):
            we = (w * (sel == e)).sum(-1)
            if np.any(we):
                y = y + we[:, None] * mlp(p + f"experts.{e}.")
        return y.reshape(B, S, -1)

    h = np.repeat(f("embed.weight")[ids][:, :, None, :], C, axis=2)
    for i, r in enumerate(ho.layer_compress_ratios(cfg)):
        p = f"layers.{i}."
        x, post, comb = hc_pre(h, p + "hc_attn")
        h = hc_post(attention(_rms(x, f(p + "attn_norm.weight"), eps), p + "attn.", r), h, post, comb)
        x, post, comb = hc_pre(h, p + "hc_ffn")
        h = hc_post(ffn(_rms(x, f(p + "ffn_norm.weight"), eps), p + "ffn.", ids), h, post, comb)
    mix = _rms(h.reshape(B, S, -1), None, eps) @ f("hc_head_fn").T
    pre = _sigmoid(mix * f("hc_head_scale")[0] + f("hc_head_base")) + hc_eps
    y = _rms((pre[..., None] * h).sum(2), f("norm.weight"), eps)
    return y @ f("head.weight").T


@pytest.mark.parametrize("i,cfg,S", CASES, ids=IDS)
def test_docstring_semantics_numpy_forward(built, i, cfg, S):
    model, st = built[i]
    ids = _ids(cfg, S, seed=7 + i)
    tr = ho.hf_trace(model, ids)
    # the selection margins must leave room for float64-vs-float32 differences
    assert min(tr["margins"].values()) > 1e-5, tr["margins"]
    ref = _np_forward(st, cfg, ids)
    hf = tr["logits"]
    assert np.array_equal(hf, ho.hf_logits(model, ids))
    err = np.abs(ref - hf).max()
    # f32-vs-f64 error is ~5e-6 here; one Sinkhorn iteration less moves logits by >1e-4
    assert err < 1e-5 * max(1.0, np.abs(ref).max()), err


@pytest.mark.parametrize("i,cfg,S", CASES, ids=IDS)
def test_rope_tables_match_docstring(built, i, cfg, S):
    model, _ = built[i]
    re = model.model.rotary_emb
    assert re.compress_attention_scaling == 1.0 and re.main_attention_scaling == 1.0
    for kind in ("main", "compress"):
        hf = getattr(re, f"{kind}_inv_freq").numpy()
        np.testing.assert_allclose(hf, _inv_freq(cfg, kind), rtol=2e-6, atol=0)


@pytest.mark.parametrize("i,cfg,S", CASES, ids=IDS)
def test_cache_first_call_and_trace_consistent(built, i, cfg, S):
    model, _ = built[i]
    ids = _ids(cfg, S, seed=99)
    ref = ho.hf_logits(model, ids)
    with torch.no_grad():
        cached = model(input_ids=torch.from_numpy(ids.astype(np.int64)), use_cache=True).logits.numpy()
    assert np.array_equal(ref, cached)
    tr = ho.hf_trace(model, ids, attentions=True)
    assert np.array_equal(tr["logits"], ref)
    for layer, sel in tr["csa_selected"].items():
        assert np.array_equal(sel, tr["attentions"][layer][:, 0, :, S:] > 0)
