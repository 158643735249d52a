"""Per-request, batch-invariant sampling and logprobs inside the step.

Every random draw is keyed by (request seed, position of the token being drawn, stream), so
a request's tokens depend on its own seed, prompt and parameters only, never on its batch
neighbours or on padding (DESIGN invariant 4). Separate streams keep target sampling,
draft sampling, acceptance uniforms and recovery sampling independent.

`sample` applies each row's own filters (temperature, top-k, top-p, min-p) and draws by
Gumbel-max over the tokens the filters keep. Filtering only masks tokens out of the argmax,
so the noise a row sees, and hence its token, is the same whatever the other rows ask for;
with every filter off the result is bit-identical to plain Gumbel-max on logits / T.

`logprobs` reports log-probabilities of the RAW model distribution (before temperature and
filters), like vLLM's default `logprobs_mode="raw_logprobs"`.

A row whose logits cannot be sampled (a NaN, a +Inf, or nothing above -Inf: NaN weights or an
overflow) samples NONFINITE_TOKEN instead of a silent argmax of garbage; the serving engine
ends such a request with finish reason "error", and `Model.generate` raises.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp


NONFINITE_TOKEN = -2  # what a row with unusable logits samples (never a vocabulary id; -1 pads)


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits for a request (`NONFINITE_TOKEN`)."""

    @classmethod
    def at(cls, prompt: int, generated: int) -> NonFiniteLogitsError:
        """The error for prompt `prompt`'s generated token number `generated`."""
        return cls(f"prompt {prompt}: the model's logits are NaN or infinite at generated token {generated}")


def usable_rows(logits_OV: jax.Array) -> jax.Array:
    """[O] bool: rows that can be sampled: no NaN, no +Inf, and some entry above -Inf (entries
    masked to -Inf are fine)."""
    bad = jnp.isnan(logits_OV) | (logits_OV == jnp.inf)
    return ~jnp.any(bad, axis=-1) & jnp.any(logits_OV > -jnp.inf, axis=-1)


class Stream(enum.IntEnum):
    """Which random stream a draw belongs to."""

    TARGET = 0  # the target model's next token
    DRAFT = 1  # draft proposals
    ACCEPT = 2  # acceptance uniforms of speculative verification
    RECOVERY = 3  # the resample after a rejection


def row_key(seed: jax.Array, position: jax.Array, stream: Stream) -> jax.Array:
    """The key of one draw: seed, then the token position, then the stream."""
    key = jax.random.key(seed.astype(jnp.uint32))
    return jax.random.fold_in(jax.random.fold_in(key, position.astype(jnp.uint32)), int(stream))


def sample(logits_OV: jax.Array, temperature_O: jax.Array, top_k_O: jax.Array, top_p_O: jax.Array,
           min_p_O: jax.Array, seed_O: jax.Array, position_O: jax.Array,
           stream: Stream = Stream.TARGET) -> jax.Array:
    """Next tokens [O] (int32), each row with its own sampling parameters.

    temperature 0: argmax of the raw logits (the filters are ignored). Otherwise, on
    s = logits / temperature in f32, the filters run in this order, each on what the previous
    one kept:
      top-k (0 = off, >= V = off): keep every token with s >= the k-th largest s, so ties at
        the boundary are all kept (more than k tokens may survive);
      top-p (1 = off): on softmax(s) renormalised over the top-k survivors, keep the smallest
        set of most probable tokens whose mass reaches top_p (a token is needed while the mass
        strictly before it, in descending order, is < top_p; the top token always is). The set
        is then widened to every token with s >= the last needed token's s, so ties at the
        boundary are all kept and the result never depends on how the sort orders equal values;
      min-p (0 = off): keep tokens with prob >= min_p * max prob, i.e. exp(s - max s) >= min_p
        (renormalising does not change that ratio, and the max token survives every filter).
    The draw is Gumbel-max over the kept tokens with the row's own key on `stream` (TARGET for
    the model's tokens, DRAFT for proposals); `position` is the position the sampled token
    will take.

    Cost: min-p is elementwise. Top-k and top-p need one descending sort of [O, V] and a cumsum,
    O(O V log V), which every step pays: measured on one H200 at V = 129280 (jax 0.11.2), 64
    rows take 0.29 ms without the sort and 1.5 ms with it; 256 rows 0.50 and 3.2 ms. It is not
    under `lax.cond`: on GPUs XLA runs a conditional by copying its predicate to the host and
    waiting for the device, so the step's launch would block until the whole forward had run
    and the host could no longer prepare the next step meanwhile.
    """
    scaled, keep = filtered(logits_OV, temperature_O, top_k_O, top_p_O, min_p_O)
    return _draw(logits_OV, scaled, keep, temperature_O, seed_O, position_O, stream)


def sample_and_probabilities(logits_OV: jax.Array, temperature_O: jax.Array, top_k_O: jax.Array,
                             top_p_O: jax.Array, min_p_O: jax.Array, seed_O: jax.Array, position_O: jax.Array,
                             stream: Stream = Stream.TARGET) -> tuple[jax.Array, jax.Array]:
    """(`sample`, `probabilities`) of the same rows, the filters (their sort) run once."""
    scaled, keep = filtered(logits_OV, temperature_O, top_k_O, top_p_O, min_p_O)
    return (_draw(logits_OV, scaled, keep, temperature_O, seed_O, position_O, stream),
            _distribution(logits_OV, scaled, keep, temperature_O))


def _draw(logits_OV, scaled_OV, keep_OV, temperature_O, seed_O, position_O, stream: Stream) -> jax.Array:
    greedy = jnp.argmax(logits_OV, axis=-1)
    keys = jax.vmap(row_key, in_axes=(0, 0, None))(seed_O, position_O, stream)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits_OV.shape[-1:], jnp.float32))(keys)
    drawn = jnp.argmax(jnp.where(keep_OV, scaled_OV + gumbel, -jnp.inf), axis=-1)
    token = jnp.where(temperature_O > 0, drawn, greedy)
    return jnp.where(usable_rows(logits_OV), token, NONFINITE_TOKEN).astype(jnp.int32)


def _distribution(logits_OV, scaled_OV, keep_OV, temperature_O) -> jax.Array:
    probs = jax.nn.softmax(jnp.where(keep_OV, scaled_OV, -jnp.inf), axis=-1)
    one_hot = jax.nn.one_hot(jnp.argmax(logits_OV, axis=-1), logits_OV.shape[-1], dtype=jnp.float32)
    return jnp.where((temperature_O > 0)[:, None], probs, one_hot)


def filtered(logits_OV: jax.Array, temperature_O: jax.Array, top_k_O: jax.Array, top_p_O: jax.Array,
             min_p_O: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(scaled logits [O, V] f32, kept tokens [O, V] bool) of `sample`'s filters (its docstring);
    rows with temperature 0 are scaled by 1 and keep everything."""
    v = logits_OV.shape[-1]
    hot = temperature_O > 0
    scaled = logits_OV.astype(jnp.float32) / jnp.where(hot, temperature_O, 1.0)[:, None]
    top_k_on = (top_k_O > 0) & (top_k_O < v)
    top_p_on = top_p_O < 1.0
    floor = _sorted_floor(scaled, jnp.where(top_k_on, top_k_O, v), jnp.where(top_p_on, top_p_O, 1.0), top_p_on)
    floor = jnp.where(hot & (top_k_on | top_p_on), floor, -jnp.inf)
    max_s = jnp.max(scaled, axis=-1, keepdims=True)
    min_p = jnp.where(hot, min_p_O, 0.0)
    keep = (scaled >= floor[:, None]) & (jnp.exp(scaled - max_s) >= min_p[:, None])
    return scaled, keep


def probabilities(logits_OV: jax.Array, temperature_O: jax.Array, top_k_O: jax.Array, top_p_O: jax.Array,
                  min_p_O: jax.Array) -> jax.Array:
    """The distribution [O, V] (f32) that `sample` draws from with these parameters: softmax of
    the scaled logits over the kept tokens, or one-hot on the argmax at temperature 0. These
    are the p and q of speculative verification (`dsv4.speculative`)."""
    scaled, keep = filtered(logits_OV, temperature_O, top_k_O, top_p_O, min_p_O)
    return _distribution(logits_OV, scaled, keep, temperature_O)


def _sorted_floor(scaled_OV: jax.Array, k_O: jax.Array, top_p_O: jax.Array, top_p_on_O: jax.Array) -> jax.Array:
    """The smallest scaled logit [O] that top-k (k in [1, V]) and then top-p keep."""
    desc = -jnp.sort(-scaled_OV, axis=-1)
    kth = jnp.take_along_axis(desc, (k_O - 1)[:, None], axis=-1)
    in_k = desc >= kth
    e = jnp.where(in_k, jnp.exp(desc - desc[:, :1]), 0.0)
    cum = jnp.cumsum(e, axis=-1)  # unnormalised; cum[:, -1] is the top-k survivors' total
    before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)  # mass strictly before each
    needed = in_k & (before < top_p_O[:, None] * cum[:, -1:])
    # top_p = 1 is off outright: in f32 the running sum can reach the total before the tail,
    # which would drop tokens that "reaching mass 1" must keep.
    needed = jnp.where(top_p_on_O[:, None], needed, in_k)
    last = jnp.sum(needed, axis=-1, keepdims=True) - 1  # needed is a prefix of desc
    return jnp.take_along_axis(desc, last, axis=-1)[:, 0]


def logprobs(logits_OV: jax.Array, tokens_O: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logprob of `tokens_O` [O] f32, top-n ids [O, n] int32, top-n logprobs [O, n] f32).

    log_softmax of the RAW model logits in f32: before temperature and the sampling filters
    (vLLM's default raw logprobs), so they describe the model, not the sampler. The top n are
    in descending order; equal values come lowest id first (`lax.top_k`). Cost on one H200 at
    V = 129280, n = 20: 1.4 ms for 64 rows, 2.7 ms for 256 (the top-n dominates).
    """
    if not 0 <= n <= logits_OV.shape[-1]:
        raise ValueError(f"n must lie in [0, {logits_OV.shape[-1]}], got {n}")
    lp = jax.nn.log_softmax(logits_OV.astype(jnp.float32), axis=-1)
    token_lp = jnp.take_along_axis(lp, tokens_O[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, n)
    return token_lp, top_ids.astype(jnp.int32), top_lp
