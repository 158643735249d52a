"""Speculative verification (`dsv4.speculative.verify`): table-driven edge cases, agreement
with plain sampling, and chi-square tests that the emitted tokens follow the target's
distribution whatever the draft distribution is."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dsv4.sampling import NONFINITE_TOKEN, Stream, probabilities, row_key, sample
from dsv4.speculative import verify

V = 6


def one_hot_logits(tokens, v=V, high=10.0):
    """Logits whose argmax (and, at temperature 0, whose only choice) is each token."""
    out = np.zeros((len(tokens), v), np.float32)
    out[np.arange(len(tokens)), tokens] = high
    return out


def run(target_logits, drafts, draft_probs, num_drafts, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
        seed=None, position=None):
    r = target_logits.shape[0]
    full = lambda x, dtype: jnp.full((r,), x, dtype)  # noqa: E731
    seed = jnp.arange(r, dtype=jnp.uint32) if seed is None else jnp.asarray(seed, jnp.uint32)
    position = full(7, jnp.int32) if position is None else jnp.asarray(position, jnp.int32)
    out = jax.jit(verify)(jnp.asarray(target_logits), jnp.asarray(drafts, jnp.int32), jnp.asarray(draft_probs),
                          jnp.asarray(num_drafts, jnp.int32), full(temperature, jnp.float32), full(top_k, jnp.int32),
                          full(top_p, jnp.float32), full(min_p, jnp.float32), seed, position)
    return np.asarray(out.accepted), np.asarray(out.tokens)


# Greedy rows: the target's argmax after the anchor and each draft is `target`.
@pytest.mark.parametrize("target, drafts, n, accepted, tokens", [
    ([1, 2, 3, 4], [1, 2, 3], 3, 3, [1, 2, 3, 4]),          # all accepted: bonus from P_L
    ([1, 2, 3, 4], [5, 2, 3], 3, 0, [1, -1, -1, -1]),       # first rejected: the target's token
    ([1, 2, 3, 4], [1, 2, 5], 3, 2, [1, 2, 3, -1]),         # last rejected
    ([1, 2, 3, 4], [1, 5, 3], 3, 1, [1, 2, -1, -1]),        # a later match does not count
    ([1, 2, 3, 4], [1, 2, 3], 1, 1, [1, 2, -1, -1]),        # uneven length: drafts past n ignored
    ([1, 2, 3, 4], [0, 0, 0], 0, 0, [1, -1, -1, -1]),       # no drafts (a padding row): plain decode
])
def test_greedy_table(target, drafts, n, accepted, tokens):
    logits = one_hot_logits(target)[None]
    q = np.full((1, 3, V), 1.0 / V, np.float32)
    got_a, got_t = run(logits, [drafts], q, [n])
    assert got_a.tolist() == [accepted] and got_t.tolist() == [tokens]


def test_sampled_table_certain_accepts_and_rejects():
    """Temperature > 0 with near-one-hot targets: a draft the target gives ~all mass to is
    accepted; one it gives ~0 mass to (q = 1 on it) is rejected and replaced by the residual's
    only token; draft slots past num_drafts (here with q = 0 everywhere) are never read."""
    logits = one_hot_logits([1, 2, 3, 4], high=60.0)[None].repeat(3, 0)
    drafts = [[1, 2, 3], [1, 5, 3], [1, 2, 3]]
    q = np.zeros((3, 3, V), np.float32)
    q[np.arange(3)[:, None], np.arange(3)[None, :], np.asarray(drafts)] = 1.0
    q[2] = 0.0  # zero draft probabilities past num_drafts: never read
    acc, tok = run(logits, drafts, q, [3, 3, 0], temperature=1.0)
    assert acc.tolist() == [3, 1, 0]
    assert tok.tolist() == [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_unusable_target_logits_emit_the_marker_after_the_drafts_before_them(temperature):
    """A NaN row after two matching drafts: they are accepted, and the token at the NaN row is
    NONFINITE_TOKEN, whatever the temperature; a +Inf row at the anchor gives the marker at once;
    rows masked to -Inf in places are sampled as usual."""
    logits = one_hot_logits([1, 2, 3, 4], high=60.0)[None].repeat(3, 0)
    logits[0, 2, 4] = np.nan
    logits[1, 0, 0] = np.inf
    logits[2, :, 5] = -np.inf
    drafts = [[1, 2, 3]] * 3
    q = np.zeros((3, 3, V), np.float32)
    q[np.arange(3)[:, None], np.arange(3)[None, :], np.asarray(drafts)] = 1.0
    acc, tok = run(logits, drafts, q, [3, 3, 3], temperature=temperature)
    assert acc.tolist() == [2, 0, 3]
    assert tok.tolist() == [[1, 2, NONFINITE_TOKEN, -1], [NONFINITE_TOKEN, -1, -1, -1], [1, 2, 3, 4]]
    plain = np.asarray(jax.jit(sample)(jnp.asarray(logits[:, 0]), *(jnp.full((3,), x, dt) for x, dt in (
        (temperature, jnp.float32), (0, jnp.int32), (1.0, jnp.float32), (0.0, jnp.float32))),
        jnp.arange(3, dtype=jnp.uint32), jnp.full((3,), 7, jnp.int32)))
    assert plain.tolist() == [1, NONFINITE_TOKEN, 1]


def test_no_drafts_gives_exactly_plain_sampling():
    rng = np.random.default_rng(0)
    r = 64
    logits = rng.normal(size=(r, 4, V)).astype(np.float32) * 2
    seeds = rng.integers(0, 2 ** 32, r).astype(np.uint32)
    pos = rng.integers(0, 1000, r).astype(np.int32)
    for kw in (dict(temperature=0.0), dict(temperature=0.8, top_k=3), dict(temperature=1.3, top_p=0.7, min_p=0.05)):
        _, tok = run(logits, np.zeros((r, 3)), np.full((r, 3, V), 1 / V, np.float32), np.zeros(r), seed=seeds,
                     position=pos, **kw)
        full = lambda x, dt: jnp.full((r,), x, dt)  # noqa: E731
        want = sample(jnp.asarray(logits[:, 0]), full(kw.get("temperature"), jnp.float32), full(kw.get("top_k", 0),
                      jnp.int32), full(kw.get("top_p", 1.0), jnp.float32), full(kw.get("min_p", 0.0), jnp.float32),
                      jnp.asarray(seeds), jnp.asarray(pos))
        np.testing.assert_array_equal(tok[:, 0], np.asarray(want), err_msg=str(kw))
        assert (tok[:, 1:] == -1).all()


def test_a_row_does_not_depend_on_its_neighbours():
    rng = np.random.default_rng(1)
    r, k = 16, 3
    logits = rng.normal(size=(r, k + 1, V)).astype(np.float32)
    q = rng.dirichlet(np.ones(V), size=(r, k)).astype(np.float32)
    drafts = rng.integers(0, V, (r, k))
    n = rng.integers(0, k + 1, r)
    acc, tok = run(logits, drafts, q, n, temperature=1.0)
    for i in (0, 5, 15):
        a1, t1 = run(logits[i:i + 1], drafts[i:i + 1], q[i:i + 1], n[i:i + 1], temperature=1.0, seed=[i])
        assert a1[0] == acc[i] and (t1[0] == tok[i]).all()


def _draft(q_kv: np.ndarray, seeds: np.ndarray, position: int) -> np.ndarray:
    """Drafts drawn from q (each position its own DRAFT-stream key), as a proposer would."""
    def one(seed):
        keys = [row_key(seed, jnp.int32(position + j), Stream.DRAFT) for j in range(q_kv.shape[0])]
        return jnp.stack([jax.random.categorical(key, jnp.log(jnp.asarray(q))) for key, q in zip(keys, q_kv)])
    return np.asarray(jax.jit(jax.vmap(one))(jnp.asarray(seeds)))


Q_FULL = np.array([[0.05, 0.10, 0.40, 0.30, 0.10, 0.05],
                   [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]], np.float32)
# q = 0 where the target has most of its mass: those tokens can only come from the residual.
Q_GAPS = np.array([[0.0, 0.0, 0.50, 0.30, 0.15, 0.05],
                   [0.40, 0.40, 0.0, 0.10, 0.10, 0.0]], np.float32)


@pytest.mark.parametrize("filters, q", [(dict(temperature=1.0), Q_FULL),
                                        (dict(temperature=0.7, top_k=4, top_p=0.9), Q_FULL),
                                        (dict(temperature=1.0), Q_GAPS)])
def test_emitted_tokens_follow_the_target_distribution(filters, q):
    """Fixed target logits per position and a deliberately different draft distribution: the
    first emitted token must follow P_0, and the second (given that d_0 was accepted) P_1.
    Chi-square at a fixed seed over 40,000 requests."""
    n = 40_000
    target = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                       [-1.0, 0.0, 2.5, 0.3, 0.3, -0.5],
                       [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    seeds = (np.arange(n, dtype=np.uint64) * 2654435761 % (2 ** 32)).astype(np.uint32)
    drafts = _draft(q, seeds.astype(np.uint32), position=100)
    logits = np.broadcast_to(target, (n, 3, V))
    acc, tok = run(logits, drafts, np.broadcast_to(q, (n, 2, V)), np.full(n, 2), seed=seeds, position=np.full(n, 100),
                   **filters)
    r = 3
    p = np.asarray(probabilities(jnp.asarray(target), jnp.full((r,), filters["temperature"], jnp.float32),
                                 jnp.full((r,), filters.get("top_k", 0), jnp.int32),
                                 jnp.full((r,), filters.get("top_p", 1.0), jnp.float32), jnp.zeros((r,), jnp.float32)))
    assert 0.05 < acc.mean() < 1.95  # both accepts and rejects happen

    def check(tokens, probs):
        counts = np.bincount(tokens, minlength=V)
        support = probs > 0
        assert counts[~support].sum() == 0  # nothing outside the filtered support
        expected = probs[support].astype(np.float64)
        result = stats.chisquare(counts[support], expected / expected.sum() * len(tokens))
        assert result.pvalue > 1e-3, (counts, probs * len(tokens))

    check(tok[:, 0], p[0])
    second = tok[acc >= 1, 1]
    assert len(second) > 5000
    check(second, p[1])


def test_probabilities_is_the_distribution_sample_draws_from():
    """`probabilities` (the p and q of verification) against 40,000 seeded draws of `sample`."""
    n = 40_000
    logits = jnp.asarray(np.broadcast_to(np.array([1.5, 1.0, 0.2, 0.0, -0.5, -2.0], np.float32), (n, V)))
    full = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
    for t, k, top_p, min_p in ((1.0, 0, 1.0, 0.0), (0.6, 5, 0.8, 0.0), (1.4, 0, 1.0, 0.1)):
        params = (full(t, jnp.float32), full(k, jnp.int32), full(top_p, jnp.float32), full(min_p, jnp.float32))
        draws = np.asarray(jax.jit(sample)(logits, *params, jnp.arange(n, dtype=jnp.uint32), full(3, jnp.int32)))
        p = np.asarray(probabilities(logits[:1], *(x[:1] for x in params)))[0].astype(np.float64)
        counts = np.bincount(draws, minlength=V)
        assert counts[p == 0].sum() == 0
        assert stats.chisquare(counts[p > 0], p[p > 0] / p.sum() * n).pvalue > 1e-3, (t, k, top_p, min_p, counts)
