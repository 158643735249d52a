"""Tests for the pure-JAX hot-op references (spec sections 5.4, 5.6, 5.8).

Every oracle here is independent of the code under test:
- sparse attention: a DENSE NumPy float64 softmax over a mask built from the index lists, the
  sink appended as an extra logit whose value row is zero (the same maths as "sink in the
  denominator only", written differently);
- indexer: NumPy float64 scores and an argsort top-k, compared as sets per query;
- MoE: the grouped (sort + ragged_dot) and gathered (per-assignment) paths against the naive
  loop oracle, and all against a NumPy float64 per-assignment loop of the formula; stored
  FP4/FP8 expert stacks; assignments to experts held elsewhere (expert parallelism).
Routing and top-k inputs carry distinct bumps so that no selection depends on tie-breaking
(MaxText `moe_test.py`).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dsv4.ops.indexer_topk import indexer_scores, indexer_topk
from dsv4 import quant
from dsv4.config import WeightFormat
from dsv4.ops.moe_experts import (ExpertStack, moe_experts, moe_experts_gathered, moe_experts_grouped,
                                  moe_experts_loop, swiglu)
from dsv4.ops.sparse_attention import sparse_attention
from tests.test_quant import _np_fake_fp8

# One tolerance table per dtype (STYLE.md).
TOL = {
    jnp.float32: {"rtol": 1e-5, "atol": 1e-5},
    jnp.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}

FEW = settings(max_examples=12, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow])

attn = jax.jit(sparse_attention, static_argnames=("scale",))
topk_fn = jax.jit(indexer_topk, static_argnames=("topk",))


def _on_matrices(fn):
    """The MoE op called with plain [E, out, in] matrices (wrapped as dense ExpertStacks)."""

    def call(x, sel, w, w1, w3, w2, limit):
        return fn(x, sel, w, *(ExpertStack.dense_stack(m) for m in (w1, w3, w2)), limit)

    return jax.jit(call, static_argnames=("limit",))


grouped = _on_matrices(moe_experts_grouped)
gathered = _on_matrices(moe_experts_gathered)
loop = _on_matrices(moe_experts_loop)


def _np(x):
    return np.asarray(jax.device_get(x)).astype(np.float64)


# ================================================================ sparse attention (5.4)


def _random_idx(rng, b, t, x, s, *, n_valid=None, min_valid=0):
    """Duplicate-free index lists [B,T,X]: per query a random count (>= min_valid) of distinct
    rows of range(S), scattered over random slots; the other slots are -1."""
    idx = np.full((b, t, x), -1, np.int32)
    for bi in range(b):
        for ti in range(t):
            m = rng.integers(min_valid, min(x, s) + 1) if n_valid is None else n_valid
            rows = rng.choice(s, size=m, replace=False)
            slots = rng.choice(x, size=m, replace=False)
            idx[bi, ti, slots] = rows
    return idx


def _dense_attention_oracle(q, kv, idx, sink, scale):
    """Dense float64 softmax over all S rows with a mask from idx, the sink an extra logit
    attending to a zero value row."""
    q, kv, sink = (np.asarray(a, np.float64) for a in (q, kv, sink))
    b, t, n, _ = q.shape
    s = kv.shape[1]
    mask = np.zeros((b, t, s), bool)
    for bi in range(b):
        for ti in range(t):
            ids = idx[bi, ti][idx[bi, ti] >= 0]
            assert len(np.unique(ids)) == len(ids), "oracle needs duplicate-free index lists"
            mask[bi, ti, ids] = True
    logits = scale * np.einsum("btnh,bsh->btns", q, kv)
    logits = np.where(mask[:, :, None, :], logits, -np.inf)
    logits = np.concatenate([logits, np.broadcast_to(sink[None, None, :, None], (b, t, n, 1))], -1)
    logits = logits - logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p = p / p.sum(-1, keepdims=True)
    values = np.concatenate([kv, np.zeros_like(kv[:, :1])], axis=1)  # the sink's value is zero
    return np.einsum("btns,bsh->btnh", p, values)


def _attn_inputs(rng, b, t, n, h, s, x, *, sink_scale=1.0, dtype=np.float32, min_valid=0):
    q = rng.normal(size=(b, t, n, h)).astype(dtype)
    kv = rng.normal(size=(b, s, h)).astype(dtype)
    idx = _random_idx(rng, b, t, x, s, min_valid=min_valid)
    sink = (sink_scale * rng.normal(size=(n,))).astype(np.float32)
    return q, kv, idx, sink


@FEW
@given(b=st.integers(1, 2), t=st.integers(1, 4), n=st.sampled_from([1, 3, 5]),
       h=st.sampled_from([8, 24]), s=st.integers(1, 13), extra=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1))
def test_sparse_attention_matches_dense_oracle(b, t, n, h, s, extra, seed):
    rng = np.random.default_rng(seed)
    x = max(1, rng.integers(1, s + 1) + extra)  # X may exceed S (trailing -1 padding)
    q, kv, idx, sink = _attn_inputs(rng, b, t, n, h, s, x, sink_scale=2.0)
    scale = h ** -0.5
    got = attn(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), jnp.asarray(sink), scale)
    assert got.shape == (b, t, n, h) and got.dtype == jnp.float32
    np.testing.assert_allclose(_np(got), _dense_attention_oracle(q, kv, idx, sink, scale),
                               **TOL[jnp.float32])


def test_sparse_attention_awkward_fixed_case_has_nonempty_rows():
    """A fixed case with every query non-empty, so the dense comparison is never vacuous."""
    rng = np.random.default_rng(0)
    b, t, n, h, s, x = 2, 3, 5, 24, 11, 7
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    kv = rng.normal(size=(b, s, h)).astype(np.float32)
    idx = _random_idx(rng, b, t, x, s, n_valid=5)
    sink = rng.normal(size=(n,)).astype(np.float32)
    got = _np(attn(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), jnp.asarray(sink), 0.3))
    want = _dense_attention_oracle(q, kv, idx, sink, 0.3)
    assert np.abs(want).min(axis=-1).max() > 1e-3  # non-trivial outputs
    np.testing.assert_allclose(got, want, **TOL[jnp.float32])
    # Heads differ (sink per head, q per head): catches a sink broadcast along the wrong axis.
    assert not np.allclose(got[:, :, 0], got[:, :, 1])


def test_sparse_attention_empty_row_is_zero_and_finite():
    rng = np.random.default_rng(1)
    q, kv, idx, sink = _attn_inputs(rng, 1, 3, 3, 8, 6, 4)
    idx[0, 1, :] = -1  # middle query sees nothing
    idx[0, 0] = [2, -1, 0, 5]
    idx[0, 2] = [-1, 3, -1, -1]
    for sk in (sink, np.full_like(sink, 80.0), np.full_like(sink, -80.0)):
        got = _np(attn(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), jnp.asarray(sk), 0.5))
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got[0, 1], 0.0)
        np.testing.assert_allclose(got, _dense_attention_oracle(q, kv, idx, sk, 0.5),
                                   **TOL[jnp.float32])


def test_sparse_attention_single_key_is_sigmoid_gate():
    """K = 1: o = kv_j * exp(s)/(exp(s)+exp(sink)) = kv_j * sigmoid(s - sink), closed form."""
    rng = np.random.default_rng(2)
    b, t, n, h, s = 2, 3, 3, 24, 5
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    kv = rng.normal(size=(b, s, h)).astype(np.float32)
    idx = rng.integers(0, s, size=(b, t, 1)).astype(np.int32)
    sink = np.array([-1.0, 0.0, 2.0], np.float32)
    scale = 0.2
    got = _np(attn(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), jnp.asarray(sink), scale))
    kv_sel = np.take_along_axis(kv.astype(np.float64), idx.astype(np.int64), axis=1)  # [B,T,H]
    logit = scale * np.einsum("btnh,bth->btn", q.astype(np.float64), kv_sel)
    gate = 1.0 / (1.0 + np.exp(-(logit - sink[None, None, :])))
    want = gate[..., None] * kv_sel[:, :, None, :]
    np.testing.assert_allclose(got, want, **TOL[jnp.float32])


def test_sparse_attention_index_order_does_not_matter():
    rng = np.random.default_rng(3)
    b, t, n, h, s, x = 2, 4, 3, 8, 9, 6
    q, kv, idx, sink = _attn_inputs(rng, b, t, n, h, s, x)
    perm = np.stack([np.stack([rng.permutation(x) for _ in range(t)]) for _ in range(b)])
    idx_p = np.take_along_axis(idx, perm, axis=-1)
    assert not np.array_equal(idx, idx_p)
    args = (jnp.asarray(q), jnp.asarray(kv))
    a = _np(attn(*args, jnp.asarray(idx), jnp.asarray(sink), 0.4))
    c = _np(attn(*args, jnp.asarray(idx_p), jnp.asarray(sink), 0.4))
    np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sink_value", [80.0, 200.0])
def test_sparse_attention_huge_sink_is_finite_and_suppresses(sink_value):
    """A sink far above every logit: weights ~exp(s - sink), output ~0, never inf/NaN."""
    rng = np.random.default_rng(4)
    q, kv, idx, _ = _attn_inputs(rng, 1, 3, 3, 8, 7, 5, min_valid=1)
    sink = np.full((3,), sink_value, np.float32)
    got = _np(attn(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), jnp.asarray(sink), 0.3))
    assert np.isfinite(got).all()
    want = _dense_attention_oracle(q, kv, idx, sink, 0.3)
    np.testing.assert_allclose(got, want, **TOL[jnp.float32])
    if sink_value == 80.0:
        # exp(s - 80) is still a normal f32: rescaled, the tiny output must match to f32 accuracy.
        np.testing.assert_allclose(got * np.exp(80.0), want * np.exp(80.0), rtol=1e-4, atol=1e-4)


def test_sparse_attention_huge_logits_are_stable():
    """Logits in the thousands overflow a softmax without max subtraction."""
    rng = np.random.default_rng(5)
    q, kv, idx, sink = _attn_inputs(rng, 1, 2, 3, 8, 6, 4, min_valid=1)
    q = q * 300.0
    got = _np(attn(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), jnp.asarray(sink), 1.0))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _dense_attention_oracle(q, kv, idx, sink, 1.0),
                               rtol=1e-4, atol=1e-4)


def test_sparse_attention_very_negative_sink_is_plain_softmax():
    rng = np.random.default_rng(6)
    b, t, n, h, s, x = 1, 3, 5, 24, 8, 6
    q, kv, idx, _ = _attn_inputs(rng, b, t, n, h, s, x, min_valid=1)
    sink = np.full((n,), -1e4, np.float32)
    got = _np(attn(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), jnp.asarray(sink), 0.25))
    # Plain softmax over the listed rows (no sink at all), written per query.
    want = np.zeros((b, t, n, h))
    for ti in range(t):
        ids = idx[0, ti][idx[0, ti] >= 0]
        k = kv[0, ids].astype(np.float64)
        lg = 0.25 * q[0, ti].astype(np.float64) @ k.T  # [N, m]
        p = np.exp(lg - lg.max(-1, keepdims=True))
        want[0, ti] = (p / p.sum(-1, keepdims=True)) @ k
    np.testing.assert_allclose(got, want, **TOL[jnp.float32])
    # And a moderate sink measurably shrinks the output (the sink is really in the denominator).
    got0 = _np(attn(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), jnp.zeros((n,)), 0.25))
    assert np.abs(got0 - want).max() > 1e-2


def test_sparse_attention_bfloat16():
    rng = np.random.default_rng(7)
    b, t, n, h, s, x = 2, 3, 5, 24, 10, 8
    q, kv, idx, sink = _attn_inputs(rng, b, t, n, h, s, x)
    q16 = jnp.asarray(q, jnp.bfloat16)
    kv16 = jnp.asarray(kv, jnp.bfloat16)
    got = attn(q16, kv16, jnp.asarray(idx), jnp.asarray(sink), h ** -0.5)
    assert got.dtype == jnp.bfloat16 and got.shape == (b, t, n, h)
    # Against f32 on the same (bf16-rounded) inputs: only the final cast differs.
    ref32 = attn(q16.astype(jnp.float32), kv16.astype(jnp.float32), jnp.asarray(idx),
                 jnp.asarray(sink), h ** -0.5)
    np.testing.assert_allclose(_np(got), _np(ref32), rtol=2 ** -8, atol=1e-6)
    # Against the float64 oracle on the unrounded inputs: bf16 tolerance.
    np.testing.assert_allclose(_np(got), _dense_attention_oracle(q, kv, idx, sink, h ** -0.5),
                               **TOL[jnp.bfloat16])


# ================================================================ indexer (5.6)


def _indexer_inputs(rng, b, t, i, j, s):
    """Tie-free inputs: head 0 is a bump head whose dot with key s is a distinct positive value
    (a permutation of 0.5, 1.0, ...), so every score carries a distinct bump and no score is an
    exact relu zero; the other heads add O(1) noise that reorders the bumps."""
    q = rng.normal(size=(b, t, i, j)).astype(np.float32)
    k = rng.normal(size=(b, s, j)).astype(np.float32)
    w = rng.normal(size=(b, t, i)).astype(np.float32)
    q[:, :, 1:, -1] = 0.0  # only the bump head reads the bump coordinate
    q[:, :, 0, :] = 0.0
    q[:, :, 0, -1] = 1.0
    w[:, :, 0] = 1.0
    for bi in range(b):
        k[bi, :, -1] = 0.5 * (1 + rng.permutation(s))
    return q, k, w


def _indexer_scores_oracle(q, k, w):
    q, k, w = (np.asarray(a, np.float64) for a in (q, k, w))
    dots = np.einsum("btij,bsj->btis", q, k)
    return np.einsum("btis,bti->bts", np.maximum(dots, 0.0), w)


@FEW
@given(b=st.integers(1, 2), t=st.integers(1, 4), i=st.sampled_from([1, 3, 5]),
       j=st.sampled_from([4, 7]), s=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_indexer_scores_match_numpy(b, t, i, j, s, seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, i, j)).astype(np.float32)
    k = rng.normal(size=(b, s, j)).astype(np.float32)
    w = rng.normal(size=(b, t, i)).astype(np.float32)
    got = indexer_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w))
    assert got.shape == (b, t, s) and got.dtype == jnp.float32
    np.testing.assert_allclose(_np(got), _indexer_scores_oracle(q, k, w), **TOL[jnp.float32])


def test_indexer_scores_relu_is_per_head_before_weighting():
    """One key, two heads with dots +2 and -3: relu per head gives 2*w0, not relu(2*w0 - 3*w1)."""
    q = np.zeros((1, 1, 2, 2), np.float32)
    q[0, 0, 0] = [2.0, 0.0]
    q[0, 0, 1] = [-3.0, 0.0]
    k = np.array([[[1.0, 0.0]]], np.float32)
    w = np.array([[[0.5, -4.0]]], np.float32)
    got = _np(indexer_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)))
    np.testing.assert_array_equal(got, [[[1.0]]])


def _boundary_margin(vis_scores, n_sel):
    """Score gap between the last selected and the first rejected entry (inf if none rejected)."""
    if n_sel == 0 or n_sel >= len(vis_scores):
        return np.inf
    srt = np.sort(vis_scores)[::-1]
    return srt[n_sel - 1] - srt[n_sel]


def _min_margin(q, k, w, limit, topk):
    scores = _indexer_scores_oracle(q, k, w)
    kk = min(topk, k.shape[1])
    return min(_boundary_margin(scores[bi, ti, :min(int(limit[bi, ti]), k.shape[1])],
                                min(kk, int(limit[bi, ti])))
               for bi in range(q.shape[0]) for ti in range(q.shape[1]))


def _check_topk(q, k, w, limit, topk):
    b, t = q.shape[:2]
    s = k.shape[1]
    kk = min(topk, s)
    ids = np.asarray(topk_fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w),
                             jnp.asarray(limit, jnp.int32), topk))
    assert ids.shape == (b, t, kk) and ids.dtype == np.int32
    scores = _indexer_scores_oracle(q, k, w)
    for bi in range(b):
        for ti in range(t):
            lim = int(limit[bi, ti])
            n_vis = min(lim, s)
            row = ids[bi, ti]
            n_sel = min(kk, n_vis)
            # -1 exactly in the trailing slots where fewer visible entries than slots.
            assert (row[:n_sel] >= 0).all(), (row, lim)
            np.testing.assert_array_equal(row[n_sel:], -1)
            sel = row[:n_sel]
            assert (sel < lim).all() and len(set(sel.tolist())) == n_sel
            vis_scores = scores[bi, ti, :n_vis]
            order = np.argsort(-vis_scores, kind="stable")
            want = order[:n_sel]
            assert _boundary_margin(vis_scores, n_sel) > 1e-3  # inputs must not be near a tie
            assert set(sel.tolist()) == set(want.tolist()), (bi, ti, sel, want)
            # Best first.
            assert np.all(np.diff(scores[bi, ti, sel]) <= 1e-5)
    return ids


@FEW
@given(b=st.integers(1, 2), t=st.integers(1, 5), i=st.sampled_from([2, 3]),
       j=st.sampled_from([4, 6]), s=st.integers(1, 12), topk=st.integers(1, 15),
       seed=st.integers(0, 2**31 - 1))
def test_indexer_topk_is_top_visible_set(b, t, i, j, s, topk, seed):
    rng = np.random.default_rng(seed)
    q, k, w = _indexer_inputs(rng, b, t, i, j, s)
    limit = rng.integers(0, s + 1, size=(b, t)).astype(np.int32)
    limit[0, 0] = s  # at least one fully visible query
    assume(_min_margin(q, k, w, limit, topk) > 1e-3)  # f32 vs f64 must agree on the cut
    _check_topk(q, k, w, limit, topk)


def test_indexer_topk_edge_rows():
    rng = np.random.default_rng(8)
    b, t, i, j, s = 1, 5, 3, 6, 9
    q, k, w = _indexer_inputs(rng, b, t, i, j, s)
    limit = np.array([[0, 1, 3, 8, 9]], np.int32)  # none, one, fewer than k, more, all
    ids = _check_topk(q, k, w, limit, topk=4)
    np.testing.assert_array_equal(ids[0, 0], -1)          # limit = 0: all -1
    assert ids[0, 1, 0] == 0 and (ids[0, 1, 1:] == -1).all()
    assert (ids[0, 2, :3] >= 0).all() and ids[0, 2, 3] == -1
    assert (ids[0, 3:] >= 0).all()


def test_indexer_topk_clamps_k_to_s():
    rng = np.random.default_rng(9)
    b, t, i, j, s = 2, 3, 2, 5, 4
    q, k, w = _indexer_inputs(rng, b, t, i, j, s)
    limit = np.full((b, t), s, np.int32)
    limit[1, 2] = 2
    ids = _check_topk(q, k, w, limit, topk=10)
    assert ids.shape == (b, t, s)
    # Fully visible rows select every entry exactly once, in descending score order.
    np.testing.assert_array_equal(np.sort(ids[0], axis=-1), np.broadcast_to(np.arange(s), (t, s)))
    np.testing.assert_array_equal(ids[1, 2, 2:], -1)


def test_indexer_topk_ignores_invisible_high_scores():
    """The highest-scoring entries are invisible: they must never be picked."""
    rng = np.random.default_rng(10)
    b, t, i, j, s = 1, 2, 2, 4, 8
    q, k, w = _indexer_inputs(rng, b, t, i, j, s)
    k[0, :, -1] = 0.5 * (1 + np.arange(s)) * 10.0  # scores increase with the entry id
    limit = np.array([[3, 5]], np.int32)
    ids = _check_topk(q, k, w, limit, topk=3)
    assert set(ids[0, 0].tolist()) == {0, 1, 2}
    assert set(ids[0, 1].tolist()) == {2, 3, 4}


# ================================================================ MoE experts (5.8)


def _routing(rng, t, e, k, mode):
    """Tie-free top-k routing: random logits plus distinct per-token bumps (MaxText moe_test).

    mode "random": bumps on a random K-subset per token;
    mode "hot": expert 0 gets a large bump on every token (one expert gets all tokens);
    mode "narrow": every token picks from the same K experts (the others get no tokens)."""
    logits = rng.normal(size=(t, e))
    for ti in range(t):
        logits[ti, rng.permutation(e)[:k]] += 10.0 * (1 + np.arange(k))  # distinct bumps
    if mode == "hot":
        logits[:, 0] += 1000.0
    elif mode == "narrow":
        logits[:, e - k:] += 500.0 + 10.0 * np.arange(k)
    order = np.argsort(-logits, axis=-1)
    sel = order[:, :k].astype(np.int32)
    # Positive weights, normalised and scaled like the spec's routing (sum = 1.5).
    w = np.sqrt(np.log1p(np.exp(np.take_along_axis(logits, sel, -1) / 100.0)))
    w = (1.5 * w / w.sum(-1, keepdims=True)).astype(np.float32)
    gaps = -np.diff(np.take_along_axis(logits, order, -1), axis=-1)[:, k - 1] if k < e else None
    assert gaps is None or gaps.min() > 1.0  # no tie anywhere near the k-th choice
    return sel, w


def _moe_inputs(rng, t, e, d, f, dtype=np.float32):
    x = rng.normal(size=(t, d)).astype(dtype)
    w1 = (rng.normal(size=(e, f, d)) * d ** -0.5 * 2.0).astype(dtype)
    w3 = (rng.normal(size=(e, f, d)) * d ** -0.5 * 2.0).astype(dtype)
    w2 = (rng.normal(size=(e, d, f)) * f ** -0.5).astype(dtype)
    return x, w1, w3, w2


def _moe_oracle(x, sel, w, w1, w3, w2, limit, act_dtype=None, gemm_input=None):
    """Per-assignment NumPy float64 loop of y[t] = sum_k bf(silu(min(g,L))*clip(u,-L,L)*w) W2^T.
    act_dtype=None: the cast is the identity (f32 inputs); else round the activation to it.
    gemm_input: applied to each GEMM's input row (x, then the activation), e.g. act quant."""
    q = gemm_input or (lambda v: v)
    x, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, w1, w3, w2))
    y = np.zeros(x.shape)
    for ti in range(x.shape[0]):
        xt = q(x[ti])
        for ki in range(sel.shape[1]):
            ex = sel[ti, ki]
            g = w1[ex] @ xt
            u = w3[ex] @ xt
            gc = np.minimum(g, limit)
            a = gc / (1.0 + np.exp(-gc)) * np.clip(u, -limit, limit) * float(w[ti, ki])
            if act_dtype is not None:
                a = a.astype(act_dtype).astype(np.float64)
            y[ti] += w2[ex] @ q(a)
    return y


MOE_CASES = [
    # (T, E, K, D, F, mode)
    (1, 4, 1, 5, 3, "random"),     # one token: three of four experts empty
    (7, 5, 2, 6, 11, "random"),
    (13, 9, 3, 10, 7, "random"),
    (6, 8, 2, 12, 5, "hot"),       # expert 0 gets every token
    (9, 7, 3, 3, 13, "narrow"),    # experts 0..3 get nothing
    (5, 6, 1, 24, 9, "narrow"),    # one expert gets all, the rest none
]


@pytest.mark.parametrize("t,e,k,d,f,mode", MOE_CASES)
def test_moe_grouped_matches_loop_and_numpy_f32(t, e, k, d, f, mode):
    rng = np.random.default_rng([t, e, k, d, f, len(mode)])
    x, w1, w3, w2 = _moe_inputs(rng, t, e, d, f)
    sel, w = _routing(rng, t, e, k, mode)
    counts = np.bincount(sel.ravel(), minlength=e)
    if mode == "hot":
        assert counts[0] == t
    if mode == "narrow":
        assert (counts[: e - k] == 0).all() and (counts[e - k:] == t).all()
    limit = 1.5  # low enough that the random g and u hit both clamps
    args = [jnp.asarray(a) for a in (x, sel, w, w1, w3, w2)]
    yg = grouped(*args, limit=limit)
    yl = loop(*args, limit=limit)
    ya = gathered(*args, limit=limit)
    assert yg.dtype == yl.dtype == ya.dtype == jnp.float32 and yg.shape == ya.shape == (t, d)
    want = _moe_oracle(x, sel, w, w1, w3, w2, limit)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(_np(yg), _np(yl), **TOL[jnp.float32])
    for y in (yg, yl, ya):
        np.testing.assert_allclose(_np(y), want, **TOL[jnp.float32])


@settings(max_examples=10, deadline=None, database=None)
@given(t=st.integers(1, 10), e=st.integers(4, 9), k=st.integers(1, 3),
       d=st.sampled_from([3, 7, 16]), f=st.sampled_from([5, 12]),
       mode=st.sampled_from(["random", "hot", "narrow"]), seed=st.integers(0, 2**31 - 1))
def test_moe_grouped_matches_numpy_random(t, e, k, d, f, mode, seed):
    rng = np.random.default_rng(seed)
    x, w1, w3, w2 = _moe_inputs(rng, t, e, d, f)
    sel, w = _routing(rng, t, e, k, mode)
    args = [jnp.asarray(a) for a in (x, sel, w, w1, w3, w2)]
    want = _moe_oracle(x, sel, w, w1, w3, w2, 2.0)
    np.testing.assert_allclose(_np(grouped(*args, limit=2.0)), want, **TOL[jnp.float32])
    np.testing.assert_allclose(_np(gathered(*args, limit=2.0)), want, **TOL[jnp.float32])


@pytest.mark.parametrize("t,e,k,d,f,mode", [(7, 5, 2, 16, 24, "random"), (6, 8, 3, 10, 7, "hot")])
def test_moe_bfloat16(t, e, k, d, f, mode):
    rng = np.random.default_rng(11)
    x, w1, w3, w2 = (jnp.asarray(a, jnp.bfloat16) for a in _moe_inputs(rng, t, e, d, f))
    sel, w = _routing(rng, t, e, k, mode)
    yg = grouped(x, jnp.asarray(sel), jnp.asarray(w), w1, w3, w2, limit=1.5)
    yl = loop(x, jnp.asarray(sel), jnp.asarray(w), w1, w3, w2, limit=1.5)
    ya = gathered(x, jnp.asarray(sel), jnp.asarray(w), w1, w3, w2, limit=1.5)
    assert yg.dtype == yl.dtype == ya.dtype == jnp.float32
    np.testing.assert_allclose(_np(yg), _np(yl), **TOL[jnp.bfloat16])
    want = _moe_oracle(_np(x), sel, w, _np(w1), _np(w3), _np(w2), 1.5,
                       act_dtype=ml_dtypes.bfloat16)
    np.testing.assert_allclose(_np(yg), want, **TOL[jnp.bfloat16])
    np.testing.assert_allclose(_np(ya), want, **TOL[jnp.bfloat16])


def test_swiglu_clamps_up_both_sides_gate_from_above_only():
    limit = 10.0
    g = np.array([-50.0, -20.0, -11.0, -10.0, 0.0, 3.0, 10.0, 11.0, 1e4], np.float32)
    u = np.array([-1e4, -11.0, 11.0, 3.0, 50.0, -50.0, 10.0, -2.0, 7.0], np.float32)
    got = _np(swiglu(jnp.asarray(g), jnp.asarray(u), limit))
    gd = np.minimum(g.astype(np.float64), limit)
    want = gd / (1.0 + np.exp(-gd)) * np.clip(u.astype(np.float64), -limit, limit)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    silu10 = 10.0 / (1.0 + np.exp(-10.0))
    np.testing.assert_allclose(got[-1], silu10 * 7.0, rtol=1e-6)     # gate saturates above
    np.testing.assert_allclose(got[7], silu10 * -2.0, rtol=1e-6)
    np.testing.assert_allclose(got[4], 0.0, atol=0)                    # silu(0) = 0
    np.testing.assert_allclose(got[5], 3.0 / (1 + np.exp(-3.0)) * -10.0, rtol=1e-6)  # up from below
    np.testing.assert_allclose(got[0], -50.0 / (1 + np.exp(50.0)) * -10.0, rtol=1e-5)  # gate NOT clamped below
    # silu(-20) ~ -4e-8 while a lower gate clamp would give silu(-10) ~ -4.5e-4.
    assert abs(got[1]) < 1e-6 and abs(got[2]) > 1e-5  # (g=-11 is below -10: unclamped too)
    np.testing.assert_allclose(got[2], -11.0 / (1 + np.exp(11.0)) * 10.0, rtol=1e-5)


def test_moe_paths_count_a_repeated_expert_once_per_slot():
    """A token whose slots name one expert twice gets it twice, each with its own weight."""
    rng = np.random.default_rng(14)
    x, w1, w3, w2 = _moe_inputs(rng, 4, 5, 12, 9)
    sel = np.array([[1, 1, 3], [0, 2, 2], [4, 4, 4], [2, 0, 1]], np.int32)
    w = rng.uniform(0.2, 1.0, (4, 3)).astype(np.float32)
    want = _moe_oracle(x, sel, w, w1, w3, w2, 1.5)
    for fn in (grouped, gathered, loop):
        np.testing.assert_allclose(_np(fn(*(jnp.asarray(a) for a in (x, sel, w, w1, w3, w2)), limit=1.5)), want,
                                   **TOL[jnp.float32])


def test_moe_saturates_through_both_paths():
    """One token, one expert, g and u far beyond the limit: hand-computed output."""
    limit = 10.0
    x = np.array([[1.0, 0.0]], np.float32)
    e, f, d = 3, 4, 2
    w1 = np.zeros((e, f, d), np.float32)
    w3 = np.zeros((e, f, d), np.float32)
    w1[1, :, 0] = [100.0, -100.0, 5.0, -20.0]   # gate: clamped, unclamped-below, inside, unclamped
    w3[1, :, 0] = [100.0, -100.0, 3.0, 40.0]    # up: clamped above, clamped below, inside, clamped
    w2 = np.zeros((e, d, f), np.float32)
    w2[1, 0] = [1.0, 1.0, 1.0, 1.0]
    w2[1, 1] = [1.0, 0.0, 0.0, 1000.0]
    sel = np.array([[1]], np.int32)
    wt = np.array([[0.5]], np.float32)

    def silu(v):
        return v / (1.0 + np.exp(-v))

    a = 0.5 * np.array([silu(10.0) * 10.0, silu(-100.0) * -10.0, silu(5.0) * 3.0, silu(-20.0) * 10.0])
    want = np.array([[a.sum(), a[0] + 1000.0 * a[3]]])
    # A lower gate clamp would change column 1 by ~1000 * 0.5 * 10 * 4.5e-4 = 2.3.
    for fn in (grouped, gathered, loop):
        got = _np(fn(*(jnp.asarray(v) for v in (x, sel, wt, w1, w3, w2)), limit=limit))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [grouped, gathered, loop], ids=["grouped", "gathered", "loop"])
def test_moe_skips_assignments_to_experts_held_elsewhere(fn):
    """Expert parallelism shifts ids by the device's first expert: ids outside [0, E) (other
    devices' experts) add nothing, exactly as if their routing weight were zero."""
    rng = np.random.default_rng(5)
    t, e, k, d, f = 9, 6, 3, 8, 5
    x, w1, w3, w2 = _moe_inputs(rng, t, e, d, f)
    sel, w = _routing(rng, t, 3 * e, k, "random")
    sel = sel - e  # ids in [-e, 2e): a third local, the rest elsewhere on either side
    here = (sel >= 0) & (sel < e)
    assert here.any() and (~here).any()
    want = _moe_oracle(x, np.where(here, sel, 0), np.where(here, w, 0.0), w1, w3, w2, 1.5)
    got = fn(*(jnp.asarray(a) for a in (x, sel, w, w1, w3, w2)), limit=1.5)
    np.testing.assert_allclose(_np(got), want, **TOL[jnp.float32])


@pytest.mark.parametrize("fmt", [WeightFormat.FP4, WeightFormat.FP8])
def test_moe_paths_agree_on_stored_expert_formats(fmt):
    """FP4 / FP8 stacks: the gathered path dequantises only the routed experts' bytes and must
    give what dequantising every expert gives (the loop oracle), and so must `moe_experts`
    on either side of its T*K < E switch."""
    rng = np.random.default_rng(9)
    e, k, d, f = 8, 2, 64, 32
    stored = []
    for shape in ((e, f, d), (e, f, d), (e, d, f)):
        m = rng.normal(size=shape).astype(np.float32) * 0.2
        stored.append(ExpertStack(*(quant.quant_fp4(m) if fmt is WeightFormat.FP4 else quant.quant_fp8_block(m)),
                                  fmt))
    run = {name: jax.jit(op, static_argnames=("limit",)) for name, op in
           (("loop", moe_experts_loop), ("gathered", moe_experts_gathered), ("grouped", moe_experts_grouped),
            ("auto", moe_experts))}
    for t in (3, 4, 7):  # t*k = 6 < 8 (gathered), 8 and 14 (grouped)
        x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
        sel, w = (jnp.asarray(a) for a in _routing(rng, t, e, k, "random"))
        want = _np(run["loop"](x, sel, w, *stored, limit=2.0))
        assert np.abs(want).max() > 0.1
        for name in ("gathered", "grouped", "auto"):
            np.testing.assert_allclose(_np(run[name](x, sel, w, *stored, limit=2.0)), want, **TOL[jnp.float32],
                                       err_msg=f"{name}, t={t}")


def _np_act_quant(v):
    """REF's act_quant round trip of one row, in NumPy (f32 rounding as the model's f32 path)."""
    return _np_fake_fp8(np.asarray(v, np.float32)[None], 128)[0].astype(np.float64)


@pytest.mark.parametrize("fmt", [WeightFormat.FP4, WeightFormat.FP8])
def test_moe_paths_quantise_both_gemm_inputs_with_act_quant(fmt):
    """act_quant: x before w1/w3 and the weighted activation before w2 are REF's FP8 activations,
    on every path and either side of the T*K < E switch; it really moves the result."""
    rng = np.random.default_rng(12)
    e, k, d, f = 8, 2, 256, 160  # two 128-blocks of D; F ends in a ragged block
    mats = [rng.normal(size=shape).astype(np.float32) * 0.1 for shape in ((e, f, d), (e, f, d), (e, d, f))]
    stored = [ExpertStack(*(quant.quant_fp4(m) if fmt is WeightFormat.FP4 else quant.quant_fp8_block(m)), fmt)
              for m in mats]
    dense = [_np(s.dense(jnp.float32)) for s in stored]
    ops = {name: jax.jit(op, static_argnames=("limit", "act_quant")) for name, op in
           (("loop", moe_experts_loop), ("gathered", moe_experts_gathered), ("grouped", moe_experts_grouped),
            ("auto", moe_experts))}
    for t in (3, 5):  # t*k = 6 < 8 (gathered), 10 (grouped)
        x = rng.normal(size=(t, d)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (t, 1))).astype(np.float32)
        sel, w = _routing(rng, t, e, k, "random")
        want = _moe_oracle(x, sel, w, *dense, 2.0, gemm_input=_np_act_quant)
        plain = _moe_oracle(x, sel, w, *dense, 2.0)
        assert np.abs(want - plain).max() > 1e-3 * np.abs(plain).max()
        args = [jnp.asarray(a) for a in (x, sel, w)]
        for name, op in ops.items():
            np.testing.assert_allclose(_np(op(*args, *stored, limit=2.0, act_quant=True)), want, rtol=1e-5,
                                       atol=1e-5 * np.abs(want).max(), err_msg=f"{name}, t={t}")


def test_linear_act_quant_multiplies_refs_fp8_activations():
    from dsv4.config import WeightFormat as WF
    from dsv4.layers.linear import Linear
    from flax import nnx

    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.normal(size=(3, 4, 200)) * 7, jnp.bfloat16)
    for act_quant in (False, True):
        lin = Linear(200, 48, fmt=WF.FP8, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), act_quant=act_quant)
        xin = quant.fake_act_quant(x) if act_quant else x
        want = jnp.einsum("...i,oi->...o", xin, lin.dense(jnp.bfloat16), preferred_element_type=jnp.float32)
        np.testing.assert_array_equal(_np(lin(x, jnp.float32)), _np(want))
    assert not np.array_equal(_np(quant.fake_act_quant(x)), _np(x))


def test_map_in_tiles_equals_one_pass_including_a_ragged_last_tile():
    from dsv4.ops.tiling import map_in_tiles

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(11, 4)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 5, size=(11, 3)), jnp.int32)

    def fn(args):
        a, i = args
        return jnp.cumsum(a, axis=1) * jnp.sum(i, axis=1, keepdims=True), i[:, :1] + 1

    want = fn((x, idx))
    for tile in (1, 3, 4, 11, 64):
        got = map_in_tiles(fn, (x, idx), tile)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
