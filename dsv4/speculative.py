"""Lossless verification of drafted tokens (speculative sampling), inside the step.

A verified request scores [anchor, d_0, ..., d_{L-1}] in one target pass and gets L + 1
target distributions P_0..P_L (P_j: the token after input j), after its own temperature and
filters (`dsv4.sampling.probabilities`, exactly what `sample` draws from). Its drafts came
from distributions q_0..q_{L-1} (the draft's, under the same parameters). Then, per request:

  for j = 0..L-1: accept d_j iff u_j * q_j(d_j) < P_j(d_j), u_j ~ U[0, 1); stop at the first
  rejection and emit a token drawn from normalise(max(P_j - q_j, 0)) (P_j itself when that
  is all zero, which only an impossible draft can cause); when all L are accepted, emit a
  bonus token drawn from P_L with `sample` itself, so a request with L = 0 gets exactly the
  token that plain decoding would give it.

Greedy rows (temperature 0) accept while the draft equals the target's argmax and emit the
argmax at the first mismatch (or as the bonus). Every token emitted this way is distributed
exactly as the target's own sampling (Leviathan et al. 2023, Chen et al. 2023), whatever q is.

Random streams (`dsv4.sampling.Stream`), each keyed by the request's seed and the position
of the token concerned: ACCEPT for u_j (position of d_j), RECOVERY for the resample after a
rejection (position of the rejected draft), TARGET for the bonus (its position), DRAFT for the
proposer. They are independent, as losslessness needs: a draft and the residual it may be
replaced by must not share noise. Nothing depends on batch neighbours or padding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv4.layers.mtp import MTPHead
from dsv4.sampling import NONFINITE_TOKEN, Stream, row_key, sample_and_probabilities, usable_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verdict:
    """Per request r: `accepted[r]` drafts were accepted; `tokens[r, :accepted[r] + 1]` are the
    tokens it commits (the accepted drafts, then the emitted one); the rest of the row is -1."""

    accepted: jax.Array  # [R] int32, in [0, num_drafts[r]]
    tokens: jax.Array  # [R, K + 1] int32


def _draw(probs_V: jax.Array, key: jax.Array) -> jax.Array:
    """One token drawn from a probability vector (Gumbel-max over log p; p = 0 never wins)."""
    g = jax.random.gumbel(key, probs_V.shape, jnp.float32)
    return jnp.argmax(jnp.where(probs_V > 0, jnp.log(probs_V) + g, -jnp.inf))


def verify(target_logits_RJV: jax.Array, draft_tokens_RK: jax.Array, draft_probs_RKV: jax.Array,
           num_drafts_R: jax.Array, temperature_R: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array,
           min_p_R: jax.Array, seed_R: jax.Array, position_R: jax.Array) -> Verdict:
    """Accept or reject each request's drafts; see the module docstring.

    target_logits_RJV [R, K+1, V]: the target's raw logits after the anchor and each draft.
    draft_tokens_RK [R, K], draft_probs_RKV [R, K, V]: the drafts and the distributions they
    were drawn from (already under the request's temperature and filters). num_drafts_R [R]:
    how many drafts each request verifies (0..K; entries past it are ignored, so uneven
    lengths and padding rows are fine). position_R [R]: the position of d_0 (the anchor's
    successor); token j of the row sits at position_R + j.
    Target rows with NaN / Inf logits accept no draft and emit `NONFINITE_TOKEN` (dsv4.sampling).
    """
    r, j1, v = target_logits_RJV.shape
    k = j1 - 1
    if draft_tokens_RK.shape != (r, k) or draft_probs_RKV.shape != (r, k, v):
        raise ValueError(f"drafts {draft_tokens_RK.shape} / {draft_probs_RKV.shape} do not match target logits "
                         f"{target_logits_RJV.shape} (expected [{r}, {k}] and [{r}, {k}, {v}])")
    rep = lambda x: jnp.repeat(x, j1, axis=0)  # noqa: E731  per request -> per (request, j) row
    flat_logits = target_logits_RJV.reshape(r * j1, v)
    params = (rep(temperature_R), rep(top_k_R), rep(top_p_R), rep(min_p_R))
    positions = position_R[:, None].astype(jnp.int32) + jnp.arange(j1, dtype=jnp.int32)[None, :]  # [R, K+1]
    # P, and what plain sampling would emit at every j (used for the bonus, and for greedy rows).
    plain, p = sample_and_probabilities(flat_logits, *params, rep(seed_R), positions.reshape(-1))
    plain, p = plain.reshape(r, j1), p.reshape(r, j1, v)

    drafts = draft_tokens_RK.astype(jnp.int32)
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [R, K]
    q_d = jnp.take_along_axis(draft_probs_RKV.astype(jnp.float32), drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.vmap(lambda s, pos: jax.random.uniform(row_key(s, pos, Stream.ACCEPT), (), jnp.float32),
                          in_axes=(None, 0)))(seed_R, positions[:, :k])
    hot = (temperature_R > 0)[:, None]
    usable = usable_rows(flat_logits).reshape(r, j1)  # no draft is accepted against NaN / Inf logits
    ok = jnp.where(hot, u * q_d < p_d, drafts == plain[:, :k]) & usable[:, :k]
    ok &= jnp.arange(k)[None, :] < num_drafts_R[:, None]
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)  # [R]

    # The emitted token at index `accepted`: the bonus (all verified drafts accepted), else a
    # draw from the residual of the rejected position.
    at = accepted[:, None]
    rejected = accepted < num_drafts_R
    p_at = jnp.take_along_axis(p, at[..., None], axis=1)[:, 0]  # [R, V]
    q_at = jnp.take_along_axis(draft_probs_RKV.astype(jnp.float32), jnp.minimum(at, k - 1)[..., None],
                               axis=1)[:, 0] if k else jnp.zeros_like(p_at)
    residual = jnp.maximum(p_at - q_at, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_at)
    pos_at = jnp.take_along_axis(positions, at, axis=1)[:, 0]
    recovered = jax.vmap(lambda pr, s, pos: _draw(pr, row_key(s, pos, Stream.RECOVERY)))(residual, seed_R, pos_at)
    plain_at = jnp.take_along_axis(plain, at, axis=1)[:, 0]
    emitted = jnp.where(rejected & (temperature_R > 0), recovered, plain_at)
    # Unusable target logits at `at`: no token, the marker.
    usable_at = jnp.take_along_axis(usable, at, axis=1)[:, 0]
    emitted = jnp.where(usable_at, emitted, NONFINITE_TOKEN).astype(jnp.int32)

    idx = jnp.arange(j1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((r, 1), jnp.int32)], axis=1)
    tokens = jnp.where(idx < at, padded, jnp.where(idx == at, emitted[:, None], -1)).astype(jnp.int32)
    return Verdict(accepted=accepted, tokens=tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """One drafted block per request: tokens d_0..d_{K-1} (d_k for position anchor_pos + 2 + k),
    the distributions q they were drawn from (Markov-corrected, under the request's own
    temperature and filters: exactly what `verify` must receive), and the confidence logits."""

    tokens: jax.Array  # [R, K] int32
    probs: jax.Array  # [R, K, V] f32
    confidence_logits: jax.Array  # [R, K] f32


def propose(head, anchor_R: jax.Array, anchor_pos_R: jax.Array, rings_ZRSH: jax.Array, ring_pos_RS: jax.Array,
            embed_VD: jax.Array, head_VD: jax.Array, temperature_R: jax.Array, top_k_R: jax.Array,
            top_p_R: jax.Array, min_p_R: jax.Array, seed_R: jax.Array, ops, depth: int | None = None,
            anchor_taps_RXD: jax.Array | None = None) -> Proposal:
    """Draft one block per request with a `dsv4.layers.dspark.DSparkHead` (spec 9.4, 9.5): one
    pass of the stages for the base logits, then the Markov head left to right, each draft
    drawn by Gumbel-max on the DRAFT stream (argmax at temperature 0). depth: the block's
    length (default: the head's block size; `DSparkHead.base_logits`).

    With a `dsv4.layers.mtp.MTPHead` (mode mtp) the drafts come from `depth` passes of the
    MTP layer instead, starting from anchor_taps_RXD: the tower's final C-stream state at
    anchor_pos (the step's taps in that mode); confidence logits are 0."""
    if isinstance(head, MTPHead):
        if anchor_taps_RXD is None:
            raise ValueError("the MTP drafter needs the tower's final state at the anchor's predecessor")
        return _propose_mtp(head, anchor_R, anchor_pos_R, anchor_taps_RXD, rings_ZRSH[0], ring_pos_RS, embed_VD,
                            head_VD, (temperature_R, top_k_R, top_p_R, min_p_R, seed_R), ops, depth)
    base, xh = head.base_logits(anchor_R, anchor_pos_R, rings_ZRSH, ring_pos_RS, embed_VD, head_VD, ops, depth)
    prev = anchor_R.astype(jnp.int32)
    tokens, probs, conf = [], [], []
    for k in range(base.shape[1]):
        bias, e = head.markov_bias(prev)
        logits = base[:, k] + bias
        position = anchor_pos_R + 2 + k
        token, q = sample_and_probabilities(logits, temperature_R, top_k_R, top_p_R, min_p_R, seed_R, position,
                                            Stream.DRAFT)
        tokens.append(token)
        probs.append(q)
        conf.append(head.confidence_logit(xh[:, k], e))
        prev = token
    return Proposal(tokens=jnp.stack(tokens, axis=1), probs=jnp.stack(probs, axis=1),
                    confidence_logits=jnp.stack(conf, axis=1))


def _propose_mtp(head: MTPHead, anchor_R, anchor_pos_R, h_RCD, ring_RSH, ring_pos_RS, embed_VD, head_VD, sampling,
                 ops, depth: int | None) -> Proposal:
    """The MTP layer applied `depth` times (`dsv4.layers.mtp`): pass j at position anchor_pos + j
    reads the token drawn by pass j-1 (the anchor for j = 0) and its output state."""
    temperature_R, top_k_R, top_p_R, min_p_R, seed_R = sampling
    k = head.block_size if depth is None else depth
    token, h = anchor_R.astype(jnp.int32), h_RCD
    own = jnp.zeros((anchor_R.shape[0], 0, ring_RSH.shape[-1]), ring_RSH.dtype)
    tokens, probs = [], []
    for j in range(k):
        pos = anchor_pos_R + j
        logits, h, kv = head.draft_logits(h, token, pos, ring_RSH, head.window_ok(ring_pos_RS, anchor_pos_R, pos),
                                          own, embed_VD, head_VD, ops)
        own = jnp.concatenate([own, kv[:, None].astype(own.dtype)], axis=1)
        token, q = sample_and_probabilities(logits, temperature_R, top_k_R, top_p_R, min_p_R, seed_R, pos + 2,
                                            Stream.DRAFT)
        tokens.append(token)
        probs.append(q)
    tok = jnp.stack(tokens, axis=1)
    return Proposal(tokens=tok, probs=jnp.stack(probs, axis=1), confidence_logits=jnp.zeros(tok.shape, jnp.float32))
