"""Per-request sampling filters and logprobs: hand-computed edge cases, each filter's
distribution against a float64 NumPy reference (chi-square), batch invariance of the draws,
logprobs against NumPy, and all of it through a real StepRunner on a tiny checkpoint."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4
from checkpoints.testing import write_tiny_checkpoint
from dsv4.batch import Bucket, Chunk, pack_batch
from dsv4.config import TINY
from dsv4.ops.registry import ops_for
from dsv4.sampling import Stream, logprobs, row_key, sample
from dsv4.state import StateGeometry, init_state
from dsv4.step import StepRunner, make_step
from tests.decode_driver import pages_for

# Logprobs: max |ours - NumPy float64| (f32 log_softmax of logits of magnitude <= ~10).
TOL = {np.dtype(np.float32): dict(rtol=0, atol=2e-5)}

# Upper 0.999 quantiles of the chi-square distribution by degrees of freedom
# (scipy.stats.chi2.ppf(0.999, df); scipy is not a dependency of this project). Every draw
# below uses fixed seeds, so each test is deterministic; alpha = 1e-3 only says how unlikely
# a correct sampler is to have produced a failing seed set.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877,
            15: 37.697}

_sample = jax.jit(sample)


def _draw(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0) -> np.ndarray:
    """sample() with per-row arguments broadcast to the rows of `logits` [O, V] (or [V])."""
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    o = logits.shape[0]

    def rows(x, dtype):
        return jnp.asarray(np.broadcast_to(np.asarray(x).astype(dtype), (o,)))

    return np.asarray(_sample(jnp.asarray(logits), rows(temperature, np.float32), rows(top_k, np.int32),
                              rows(top_p, np.float32), rows(min_p, np.float32), rows(seed, np.uint32),
                              rows(position, np.int32)))


@jax.jit
def _unfiltered(logits_OV, temperature_O, seed_O, position_O):
    """The sampler as it was before the filters existed (frozen copy): seeded outputs with every
    filter off must stay bit-identical to it."""
    greedy = jnp.argmax(logits_OV, axis=-1)
    keys = jax.vmap(row_key, in_axes=(0, 0, None))(seed_O, position_O, Stream.TARGET)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits_OV.shape[-1:], jnp.float32))(keys)
    hot = temperature_O > 0
    scaled = logits_OV.astype(jnp.float32) / jnp.where(hot, temperature_O, 1.0)[:, None]
    drawn = jnp.argmax(scaled + gumbel, axis=-1)
    return jnp.where(hot, drawn, greedy).astype(jnp.int32)


def _reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The filtered, renormalised distribution in float64, token by token."""
    s = np.asarray(logits, np.float64) / temperature
    keep = np.ones(s.shape, bool)

    def probs():
        p = np.where(keep, np.exp(s - s.max()), 0.0)
        return p / p.sum()

    if 0 < top_k < len(s):
        keep &= s >= sorted(s, reverse=True)[top_k - 1]
    if top_p < 1:
        p, mass, last = probs(), 0.0, None
        for i in sorted(np.flatnonzero(keep), key=lambda i: -p[i]):
            if mass >= top_p:
                break
            mass, last = mass + p[i], p[i]
        keep &= p >= last  # ties with the last needed token stay
    if min_p > 0:
        p = probs()
        keep &= p >= min_p * p.max()
    return probs()


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the tokens `probs` can draw, and its degrees of freedom."""
    live = probs > 0
    expected = counts.sum() * probs[live]
    return float(((counts[live] - expected) ** 2 / expected).sum()), int(live.sum()) - 1


# ---- hand-computed edge cases -----------------------------------------------------------------

_EDGE_CASES = [
    # (logits, temperature, top_k, top_p, min_p, the exact set of tokens drawn over 400 seeds)
    pytest.param([0.0, 3.0, 2.0, 2.0, 2.0, -1.0], 1.0, 2, 1.0, 0.0, {1, 2, 3, 4}, id="top_k ties at the boundary kept"),
    pytest.param([0.0, 3.0, 1.0, 2.0], 1.0, 2, 1.0, 0.0, {1, 3}, id="top_k=2"),
    pytest.param([1.0, 3.0, 1.5, 2.0], 1.0, 9, 1.0, 0.0, {0, 1, 2, 3}, id="top_k above V is off"),
    pytest.param([0.5, 1.0, 0.9, 0.0], 1.0, 0, 1e-6, 0.0, {1}, id="top_p tiny is the argmax"),
    # p = (.5, .25, .25): mass before the 2nd token is .5, so .49 needs one token, .51 needs two
    # and keeps the third, tied with the second.
    pytest.param(np.log([0.5, 0.25, 0.25]), 1.0, 0, 0.49, 0.0, {0}, id="top_p reached by the top token"),
    pytest.param(np.log([0.25, 0.5, 0.25]), 1.0, 0, 0.51, 0.0, {0, 1, 2}, id="top_p ties at the boundary kept"),
    # p = (.4, .3, .2, .1): mass before each is 0, .4, .7, .9.
    pytest.param(np.log([0.1, 0.3, 0.4, 0.2]), 1.0, 0, 0.65, 0.0, {1, 2}, id="top_p=0.65"),
    pytest.param(np.log([0.1, 0.3, 0.4, 0.2]), 1.0, 0, 0.75, 0.0, {1, 2, 3}, id="top_p=0.75"),
    # top-k 3 leaves (.4, .3, .2)/.9 = (.44, .33, .22): top_p .75 needs two of them (without
    # renormalising it would need three).
    pytest.param(np.log([0.1, 0.3, 0.4, 0.2]), 1.0, 3, 0.75, 0.0, {1, 2}, id="top_p renormalised after top_k"),
    pytest.param([2.0, 5.0, 5.0, 1.0], 1.0, 0, 1.0, 1.0, {1, 2}, id="min_p=1 keeps only the max tokens"),
    pytest.param(np.log([0.4, 0.3, 0.2, 0.1]), 1.0, 0, 1.0, 0.6, {0, 1}, id="min_p=0.6"),
    # At T=2 the ratios are sqrt of those at T=1: .3/.4 -> .87, .2/.4 -> .71, .1/.4 -> .5.
    pytest.param(np.log([0.4, 0.3, 0.2, 0.1]), 2.0, 0, 1.0, 0.6, {0, 1, 2}, id="min_p after temperature"),
    pytest.param([1.0, 4.0, 3.0, 2.0], 0.0, 3, 0.1, 0.9, {1}, id="temperature 0 is the argmax whatever the filters"),
]


@pytest.mark.parametrize("logits, temperature, top_k, top_p, min_p, want", _EDGE_CASES)
def test_filters_keep_exactly_the_hand_computed_tokens(logits, temperature, top_k, top_p, min_p, want):
    n = 400  # every kept token here has probability >= 0.07: P(one is never drawn) < 4 * 0.93^400
    tokens = _draw(np.tile(np.asarray(logits, np.float32), (n, 1)), temperature, top_k, top_p, min_p,
                   seed=np.arange(n), position=5)
    assert set(tokens.tolist()) == want


def test_top_k_1_is_greedy_for_any_seed_and_temperature():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(300, 50)).astype(np.float32) * 4
    for temperature in (0.3, 1.0, 5.0):
        tokens = _draw(logits, temperature, top_k=1, seed=rng.integers(0, 2 ** 32, 300), position=np.arange(300))
        np.testing.assert_array_equal(tokens, logits.argmax(-1), err_msg=f"temperature {temperature}")


def test_filters_off_are_bit_identical_to_the_unfiltered_sampler():
    """Including rows with ties, -inf logits, greedy rows, and a batch where another row filters
    (every row goes through the sort; rows without filters must come out as if it had not)."""
    rng = np.random.default_rng(1)
    o, v = 2000, 40
    logits = (rng.normal(size=(o, v)) * rng.choice([0.1, 1.0, 8.0], (o, 1))).astype(np.float32)
    logits[::7, :5] = logits[::7, :1]  # ties at the top
    logits[::11, 3:9] = -np.inf
    temperature = rng.choice([0.0, 0.25, 0.7, 1.0, 1.5], o).astype(np.float32)
    seed = rng.integers(0, 2 ** 32, o).astype(np.uint32)
    position = rng.integers(0, 100_000, o).astype(np.int32)
    want = np.asarray(_unfiltered(jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(seed),
                                  jnp.asarray(position)))
    np.testing.assert_array_equal(_draw(logits, temperature, 0, 1.0, 0.0, seed, position), want)
    np.testing.assert_array_equal(_draw(logits, temperature, v, 1.0, 0.0, seed, position), want)  # k >= V is off
    top_p = np.ones(o, np.float32)
    top_p[0], temperature[0] = 0.5, 1.0  # row 0 filters: every other row must not notice
    np.testing.assert_array_equal(_draw(logits, temperature, 0, top_p, 0.0, seed, position)[1:], want[1:])


# ---- distributions ----------------------------------------------------------------------------

# p at T=1, by descending rank: cumulative .25 .43 .57 .68 .77 .84 .90 .95 .98 1. Token ids are
# a permutation of the ranks, so id order never lines up with probability order.
_P = np.array([0.25, 0.18, 0.14, 0.11, 0.09, 0.07, 0.06, 0.05, 0.03, 0.02])
_LOGITS = np.log(_P[np.argsort([3, 7, 0, 9, 1, 5, 2, 8, 4, 6])]).astype(np.float32) + 1.5

_DIST_CASES = [
    # (temperature, top_k, top_p, min_p, draws over): each filter, well away from its
    # boundaries so float32 and float64 agree on which tokens survive.
    pytest.param(1.0, 0, 1.0, 0.0, "seed", id="plain"),
    pytest.param(0.6, 0, 1.0, 0.0, "seed", id="temperature"),
    pytest.param(1.0, 4, 1.0, 0.0, "seed", id="top_k"),
    pytest.param(1.0, 0, 0.8, 0.0, "seed", id="top_p"),  # needs 6 tokens: .77 < .8 <= .84
    pytest.param(1.0, 0, 1.0, 0.3, "seed", id="min_p"),  # .09/.25 = .36 kept, .07/.25 = .28 not
    # T 1.4, top-7 mass before each: 0 .24 .42 .58 .71 .82 | .92, so top_p .85 keeps 6; their
    # ratios to the max are 1 .79 .66 .56 .48 .40, so min_p .45 drops one more.
    pytest.param(1.4, 7, 0.85, 0.45, "seed", id="all"),
    pytest.param(1.4, 7, 0.85, 0.45, "position", id="all over positions"),
]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p, over", _DIST_CASES)
def test_draws_follow_the_filtered_renormalised_distribution(temperature, top_k, top_p, min_p, over):
    n = 40_000
    seed, position = (np.arange(n), 123) if over == "seed" else (99, np.arange(n))
    tokens = _draw(np.tile(_LOGITS, (n, 1)), temperature, top_k, top_p, min_p, seed, position)
    counts = np.bincount(tokens, minlength=len(_LOGITS))
    want = _reference_probs(_LOGITS, temperature, top_k, top_p, min_p)
    assert (counts[want == 0] == 0).all(), f"filtered-out tokens drawn: {counts} vs {want.round(3)}"
    stat, df = _chi2(counts, want)
    assert stat < CHI2_999[df], f"chi2 {stat:.1f} (df {df}); counts {counts}, expected {(n * want).round()}"
    # The test has power: the distribution without the last filter (with none, at a 20% lower
    # temperature) is rejected.
    decoy = (_reference_probs(_LOGITS, temperature, top_k, top_p, 0.0) if min_p else
             _reference_probs(_LOGITS, temperature, top_k, 1.0, 0.0) if top_p < 1 else
             _reference_probs(_LOGITS, temperature) if top_k else _reference_probs(_LOGITS, 0.8 * temperature))
    assert not np.allclose(decoy, want)
    assert _chi2(counts, decoy)[0] > CHI2_999[_chi2(counts, decoy)[1]]


def test_draws_at_neighbouring_positions_and_seeds_are_independent():
    """Joint counts of token pairs drawn with keys that differ in one step of position or seed
    match the product of the marginals (16 cells, 15 degrees of freedom)."""
    p = np.array([0.4, 0.3, 0.2, 0.1])
    n = 20_000
    logits = np.tile(np.log(p).astype(np.float32), (2 * n, 1))
    pairs = {
        "position": _draw(logits, seed=np.repeat(np.arange(n), 2), position=np.tile([40, 41], n)),
        "seed": _draw(logits, seed=np.arange(2 * n), position=40),
    }
    for what, tokens in pairs.items():
        a, b = tokens[0::2], tokens[1::2]
        counts = np.bincount(4 * a + b, minlength=16)
        stat, df = _chi2(counts, np.outer(p, p).ravel())
        assert stat < CHI2_999[df], f"neighbouring {what}s: chi2 {stat:.1f}"


# ---- batch invariance -------------------------------------------------------------------------


@pytest.mark.parametrize("filters", [dict(), dict(top_k=5, top_p=0.9, min_p=0.05)], ids=["plain", "filtered"])
def test_a_rows_token_does_not_depend_on_its_neighbours_or_padding(filters):
    rng = np.random.default_rng(2)
    v, n = 32, 64
    mine = rng.normal(size=v).astype(np.float32)
    alone = np.array([_draw(mine, 0.9, seed=s, position=77, **filters)[0] for s in range(n)])
    assert len(set(alone.tolist())) > 3  # a real draw, not a constant
    # The same n rows among 3n random neighbours (greedy, plain, every filter) and padding
    # rows (the packer's defaults), at shuffled places.
    o = 4 * n + 13
    logits = rng.normal(size=(o, v)).astype(np.float32) * 3
    temperature = rng.choice([0.0, 0.5, 1.0, 2.0], o)
    top_k = rng.choice([0, 1, 3, 40], o)
    top_p = rng.choice([1.0, 0.3, 0.95], o)
    min_p = rng.choice([0.0, 0.1, 0.9], o)
    seed, position = rng.integers(0, 2 ** 32, o), rng.integers(0, 1000, o)
    pad = slice(4 * n, o)
    temperature[pad], top_k[pad], top_p[pad], min_p[pad], seed[pad], position[pad] = 0, 0, 1, 0, 0, 0
    at = rng.permutation(4 * n)[:n]
    logits[at], temperature[at], seed[at], position[at] = mine, 0.9, np.arange(n), 77
    top_k[at], top_p[at], min_p[at] = filters.get("top_k", 0), filters.get("top_p", 1.0), filters.get("min_p", 0.0)
    np.testing.assert_array_equal(_draw(logits, temperature, top_k, top_p, min_p, seed, position)[at], alone)


# ---- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_and_its_top_n_descending():
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(6, 50)) * 3).astype(np.float32)
    tokens = rng.integers(0, 50, 6)
    token_lp, top_ids, top_lp = jax.device_get(logprobs(jnp.asarray(logits), jnp.asarray(tokens, jnp.int32), 5))
    x = logits.astype(np.float64)
    want = x - x.max(-1, keepdims=True)
    want -= np.log(np.exp(want).sum(-1, keepdims=True))
    assert token_lp.dtype == np.float32 and top_ids.dtype == np.int32 and top_ids.shape == (6, 5)
    np.testing.assert_allclose(token_lp, want[np.arange(6), tokens], **TOL[np.dtype(np.float32)])
    np.testing.assert_array_equal(top_ids, np.argsort(-want, axis=-1)[:, :5])
    np.testing.assert_allclose(top_lp, np.sort(want, axis=-1)[:, ::-1][:, :5], **TOL[np.dtype(np.float32)])
    assert (np.diff(top_lp, axis=-1) <= 0).all()
    with pytest.raises(ValueError, match="n must lie"):
        logprobs(jnp.asarray(logits), jnp.asarray(tokens, jnp.int32), 51)


# ---- through the step -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    write_tiny_checkpoint(TINY, path, seed=7, float_dtype="F32")
    return dsv4.load_pretrained(path, dtype="float32")


def _geometry(model, slots=4) -> StateGeometry:
    page, max_len = 16, 64
    return StateGeometry(num_slots=slots, num_pages=slots * max_len // page, page_tokens=page,
                         max_pages_per_seq=max_len // page, max_spec_tokens=0,
                         dtype=model.params["embed"]["weight"][...].dtype)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_step_runner_returns_raw_logprobs_and_top_k_1_is_greedy(tiny):
    geometry = _geometry(tiny)
    runner = StepRunner(tiny.graphdef, tiny.params, tiny.config, geometry, [Bucket(32, 4, 8)], ops_for("reference"),
                        return_logits=True, max_logprobs=4)
    runner.warmup()
    prompt = np.random.default_rng(4).integers(0, TINY.vocab_size, 7).tolist()
    # Four requests on the same prompt: greedy; top_k=1 at T=1 (must equal greedy); top_p;
    # min_p at another temperature. Two output rows each on the prompt, then decode steps.
    params = [dict(), dict(temperature=1.0, top_k=1, seed=5), dict(temperature=1.0, top_p=0.9, seed=3),
              dict(temperature=0.7, min_p=0.2, seed=8)]
    history = [list(prompt) for _ in params]
    outputs = [5, 6]
    for step in range(5):
        chunks = [Chunk(slot=i, start=len(h) - (len(prompt) if step == 0 else 1),
                        tokens=prompt if step == 0 else h[-1:], pages=pages_for(i, geometry),
                        outputs=outputs if step == 0 else [0], **p) for i, (h, p) in enumerate(zip(history, params))]
        out = runner.run(chunks)
        rows = sum(len(c.outputs) for c in chunks)
        logits, tokens = out.logits[:rows], out.tokens[:rows]
        want = _log_softmax(logits)
        np.testing.assert_allclose(out.logprobs[:rows], want[np.arange(rows), tokens], **TOL[np.dtype(np.float32)])
        np.testing.assert_array_equal(out.top_ids[:rows], np.argsort(-want, axis=-1, kind="stable")[:, :4])
        np.testing.assert_allclose(out.top_logprobs[:rows], -np.sort(-want, axis=-1)[:, :4],
                                   **TOL[np.dtype(np.float32)])
        per = rows // len(chunks)
        np.testing.assert_array_equal(tokens[:per], logits[:per].argmax(-1), err_msg=f"greedy, step {step}")
        np.testing.assert_array_equal(tokens[per:2 * per], logits[per:2 * per].argmax(-1),
                                      err_msg=f"top_k=1, step {step}")
        for i, h in enumerate(history):
            h.append(int(tokens[(i + 1) * per - 1]))
    assert history[1] == history[0]
    assert history[2] != history[0] and history[3] != history[0]  # the sampled requests really sampled


def test_max_logprobs_sets_the_output_shapes_and_zero_returns_none(tiny):
    geometry = _geometry(tiny)
    batch = pack_batch([], Bucket(8, 2, 3), geometry)
    state = jax.eval_shape(lambda: init_state(tiny.config, geometry))
    shapes = {}
    for n in (0, 4):
        step = make_step(tiny.graphdef, geometry, ops_for("reference"), return_logits=False, max_logprobs=n)
        shapes[n] = jax.eval_shape(step, tiny.params, state, batch)[1]
    assert shapes[0].logprobs is None and shapes[0].top_ids is None and shapes[0].top_logprobs is None
    out = shapes[4]
    assert (out.logprobs.shape, out.top_ids.shape, out.top_logprobs.shape) == ((3,), (3, 4), (3, 4))
    assert (out.logprobs.dtype, out.top_ids.dtype, out.top_logprobs.dtype) == (jnp.float32, jnp.int32, jnp.float32)
    with pytest.raises(ValueError, match="max_logprobs"):
        StepRunner(tiny.graphdef, tiny.params, tiny.config, geometry, [Bucket(8, 2, 3)], ops_for("reference"),
                   max_logprobs=TINY.vocab_size + 1)


def test_pack_batch_fills_the_filters_per_output_row_and_padding_is_off():
    geometry = StateGeometry(num_slots=2, num_pages=8, page_tokens=16, max_pages_per_seq=4, dtype=np.float32)
    chunks = [Chunk(0, 0, [1, 2, 3], [0], outputs=[0, 2], temperature=0.5, seed=9, top_k=7, top_p=0.5, min_p=0.1),
              Chunk(1, 0, [4], [4], outputs=[0], temperature=1.0, top_k=10 ** 12)]
    b = pack_batch(chunks, Bucket(8, 2, 4), geometry)
    np.testing.assert_array_equal(b.out_top_k, [7, 7, np.iinfo(np.int32).max, 0])
    np.testing.assert_array_equal(b.out_top_p, np.float32([0.5, 0.5, 1, 1]))
    np.testing.assert_array_equal(b.out_min_p, np.float32([0.1, 0.1, 0, 0]))
    assert (b.out_top_k.dtype, b.out_top_p.dtype, b.out_min_p.dtype) == (np.int32, np.float32, np.float32)


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-0.5), "slot 1: temperature must be finite and >= 0, got -0.5"),
    (dict(temperature=math.inf), "slot 1: temperature must be finite and >= 0, got inf"),
    (dict(temperature=math.nan), "slot 1: temperature must be finite and >= 0, got nan"),
    (dict(top_k=-1), "slot 1: top_k must be an integer >= 0 \\(0 = off\\), got -1"),
    (dict(top_k=2.5), "slot 1: top_k must be an integer >= 0 \\(0 = off\\), got 2.5"),
    (dict(top_p=0.0), "slot 1: top_p must lie in \\(0, 1\\] \\(1 = off\\), got 0.0"),
    (dict(top_p=1.5), "slot 1: top_p must lie in \\(0, 1\\] \\(1 = off\\), got 1.5"),
    (dict(top_p=math.nan), "slot 1: top_p must lie in \\(0, 1\\] \\(1 = off\\), got nan"),
    (dict(min_p=-0.1), "slot 1: min_p must lie in \\[0, 1\\] \\(0 = off\\), got -0.1"),
    (dict(min_p=1.01), "slot 1: min_p must lie in \\[0, 1\\] \\(0 = off\\), got 1.01"),
    (dict(min_p=math.nan), "slot 1: min_p must lie in \\[0, 1\\] \\(0 = off\\), got nan"),
])
def test_pack_batch_rejects_bad_sampling_parameters(bad, message):
    geometry = StateGeometry(num_slots=2, num_pages=8, page_tokens=16, max_pages_per_seq=4, dtype=np.float32)
    good = Chunk(0, 0, [1], [0], outputs=[0], temperature=1.0, top_k=3, top_p=0.5, min_p=1.0)
    pack_batch([good], Bucket(4, 2, 2), geometry)
    with pytest.raises(ValueError, match=f"^{message}$"):
        pack_batch([good, Chunk(1, 0, [1], [4], outputs=[0], **bad)], Bucket(4, 2, 2), geometry)


def test_sample_and_probabilities_is_sample_and_probabilities_in_one():
    from dsv4.sampling import Stream, probabilities, sample, sample_and_probabilities

    rng = np.random.default_rng(3)
    o, v = 6, 50
    logits = jnp.asarray(rng.standard_normal((o, v)) * 3, jnp.float32)
    params = (jnp.asarray([0.0, 0.7, 1.0, 1.3, 0.9, 2.0], jnp.float32), jnp.asarray([0, 5, 0, 20, 3, 0], jnp.int32),
              jnp.asarray([1.0, 0.9, 0.5, 1.0, 0.8, 1.0], jnp.float32),
              jnp.asarray([0.0, 0.0, 0.1, 0.0, 0.0, 0.3], jnp.float32))
    seeds, positions = jnp.arange(o, dtype=jnp.uint32) * 7, jnp.arange(o, dtype=jnp.int32) + 11
    tokens, probs = sample_and_probabilities(logits, *params, seeds, positions, Stream.DRAFT)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(sample(logits, *params, seeds, positions,
                                                                        Stream.DRAFT)))
    np.testing.assert_array_equal(np.asarray(probs), np.asarray(probabilities(logits, *params)))
