"""DSpark speculative decoding on the step function: the reference loop.

`SpeculativeGenerator` decodes a batch of prompts with a `dsv4.layers.dspark.DSparkHead`
proposing blocks and the target verifying them, one synchronous round per step:

1. Prefill: the prompt runs through the target in chunks (taps on the last `RING` positions,
   which fill the draft's context rings); the first new token is sampled as in plain decoding.
2. Each round, per request, with q committed tokens and the newest token (the anchor, at
   position q, not yet in the target state): the head drafts L <= K tokens from the context
   of positions < q (`speculative.propose`), the target scores [anchor, d_0..d_{L-1}] at
   positions q..q+L in one chunk (outputs and taps on every row), and
   `speculative.verify` accepts a of the drafts and emits one more token. Positions q..q+a
   are committed: their taps enter the draft rings. The target's own writes for the
   rejected positions are simply overwritten later: a chunk's `start` is the committed
   length, and the state is built for that (DESIGN invariant 3; `max_spec_tokens`).

With the preview's classic MTP layer (`dsv4.layers.mtp.MTPHead`, mode mtp) the taps are the
tower's final states, a ring row also needs the token after its position (a prefill chunk's
last row waits in `DraftState.held_*` for the slot's next chunk), and the drafts come from
K passes of the layer; only the fused path runs it.

Every random draw is keyed by (seed, position, stream), so a request's tokens do not depend
on its neighbours, and at temperature 0 the tokens equal plain greedy decoding exactly.

Two paths run the rounds. The reference (`SpeculativeGenerator(fused=False)`) fetches the
target's logits to the host and runs the head and the verifier as separate programs. The
fused path (`make_spec_step`, driven by `SpecRunner`) does a round in one program: the
target step, verification, the accepted positions' context into the rings and the next
block drafted, with drafts and their distributions kept on the device between steps. Tests
hold the two to the same tokens and the same acceptance.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4 import quant
from dsv4.batch import Chunk, pack_batch
from dsv4.layers.dspark import RING, DSparkHead
from dsv4.layers.mtp import MTPHead
from dsv4.ops.registry import OpSet
from dsv4.sampling import NONFINITE_TOKEN, NonFiniteLogitsError, logprobs
from dsv4.speculative import propose, verify
from dsv4.step import StepRunner, temp_bytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    """The head's context per slot: every stage's ring [stages, slots, RING, H] and the
    position each ring slot holds [slots, RING] (-1: none, e.g. a prefix-cache position).

    held_taps [slots, X, D] / held_pos [slots] (MTP only): the taps of a prefill chunk's last
    position, whose ring row needs the token after it, which only the slot's next chunk
    brings (-1: none held)."""

    rings: jax.Array
    ring_pos: jax.Array
    held_taps: jax.Array
    held_pos: jax.Array


def init_draft_state(head: DSparkHead | MTPHead, slots: int, dtype) -> DraftState:
    cfg = head.cfg
    taps = cfg.hc_mult if isinstance(head, MTPHead) else len(cfg.dspark_target_layer_ids)
    return DraftState(rings=jnp.zeros((cfg.num_draft_stages, slots, RING, cfg.head_dim), dtype),
                      ring_pos=jnp.full((slots, RING), -1, jnp.int32),
                      held_taps=jnp.zeros((slots, taps, cfg.hidden_size), dtype),
                      held_pos=jnp.full((slots,), -1, jnp.int32))


def commit_context(head: DSparkHead | MTPHead, state: DraftState, taps_TXD: jax.Array, positions_T: jax.Array,
                   slots_T: jax.Array, valid_T: jax.Array, next_ids_T: jax.Array | None = None,
                   embed_VD: jax.Array | None = None, ops: OpSet | None = None) -> DraftState:
    """Write the ring entries of committed positions (rows with valid = False write nowhere).
    The caller keeps (slot, position % RING) distinct among the valid rows. An MTP head's
    rows also need the token after each position and the embedding."""
    if isinstance(head, MTPHead):
        entries = head.ring_entries(taps_TXD, positions_T, next_ids_T, embed_VD, ops)
    else:
        entries = head.ring_entries(taps_TXD, positions_T, ops)
    entries = entries.astype(state.rings.dtype)  # [Z, T, H]
    s = state.ring_pos.shape[0]
    slot = jnp.where(valid_T, slots_T, s)  # out of range: dropped
    col = positions_T % RING
    rings = state.rings.at[:, slot, col].set(entries, mode="drop")
    ring_pos = state.ring_pos.at[slot, col].set(positions_T.astype(jnp.int32), mode="drop")
    return dataclasses.replace(state, rings=rings, ring_pos=ring_pos)


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    max_new: int
    seed: int
    slot: int
    generated: list[int] = dataclasses.field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    def take(self, tokens: list[int]) -> None:
        """Append sampled tokens; NonFiniteLogitsError at the marker of unusable logits."""
        if NONFINITE_TOKEN in tokens:
            raise NonFiniteLogitsError.at(self.index, len(self.generated) + tokens.index(NONFINITE_TOKEN))
        self.generated += tokens

    @property
    def committed(self) -> int:
        """Tokens in the target state: the prompt and every generated token but the newest."""
        return len(self.prompt) + len(self.generated) - 1


@dataclasses.dataclass(frozen=True)
class SpecStats:
    drafted: list[int]  # per prompt
    accepted: list[int]

    @property
    def acceptance_rate(self) -> float:
        return sum(self.accepted) / max(1, sum(self.drafted))


class SpeculativeGenerator:
    """The reference speculative decoding loop (module docstring). Owns the runner's state
    and a draft state while it runs; one request per slot, all admitted at once."""

    def __init__(self, runner: StepRunner, head: DSparkHead | MTPHead, embed_VD: jax.Array, head_VD: jax.Array,
                 ops: OpSet, *, num_speculative_tokens: int | None = None, fused: bool = False, draft_fp8_head: bool = False):
        """runner: the target's StepRunner (logits returned, tap rows in its buckets) whose
        state this generator uses. fused: run each round as one program (`make_spec_step`:
        drafts stay on the device) instead of the reference's separate programs.
        draft_fp8_head: the draft's LM-head matmul in row-wise FP8 (`quant.Fp8Rows`)."""
        if isinstance(head, MTPHead) and not fused:
            raise ValueError("the reference loop drafts with a DSpark head only: run an MTP head with fused=True")
        k = num_speculative_tokens or head.block_size
        if not 1 <= k <= head.block_size:
            raise ValueError(f"num_speculative_tokens must lie in [1, {head.block_size}], got {k}")
        if runner.geometry.max_spec_tokens < k:
            raise ValueError(f"the state holds {runner.geometry.max_spec_tokens} speculative tokens, need {k}")
        self.runner, self.k = runner, k
        self.geometry = runner.geometry
        graphdef, params = nnx.split(head)
        self._head_params = params
        self._embed, self._lm_head = embed_VD, head_VD
        draft_head = quant.quant_fp8_rows(head_VD) if draft_fp8_head else head_VD
        self._draft_lm_head = draft_head

        def _propose(params, embed, lm_head, anchor, pos, rings, ring_pos, t, top_k, top_p, min_p, seed):
            # The tables are arguments, not constants baked into the program.
            return propose(nnx.merge(graphdef, params), anchor, pos, rings, ring_pos, embed, lm_head, t, top_k,
                           top_p, min_p, seed, ops)

        def _commit(params, state, taps, positions, slots, valid):
            return commit_context(nnx.merge(graphdef, params), state, taps, positions, slots, valid)

        self._propose = jax.jit(_propose)
        self._commit = jax.jit(_commit)
        self._verify = jax.jit(verify)
        self._init = lambda: init_draft_state(head, runner.geometry.num_slots, embed_VD.dtype)
        self.fused = fused
        self.spec_runner = SpecRunner(runner, head, ops, k=k, draft_lm_head=draft_head) if fused else None

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 seeds: Sequence[int]) -> tuple[list[list[int]], SpecStats]:
        """New tokens per prompt (exactly max_new_tokens each) and drafting statistics."""
        geo = self.geometry
        if len(prompts) > geo.num_slots:
            raise ValueError(f"{len(prompts)} prompts need as many slots; the state has {geo.num_slots}")
        for i, p in enumerate(prompts):
            if not p or len(p) + max_new_tokens + self.k > geo.max_seq_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} + "
                                 f"{self.k} speculative exceed the state's {geo.max_seq_len} positions")
        reqs = [_Request(i, list(map(int, p)), max_new_tokens, int(seeds[i]), slot=i) for i, p in enumerate(prompts)]
        self.runner.reset_state()
        # The fused path keeps its rings from call to call, as a server would from request to
        # request (a request's first chunk makes its slot forget the last one's positions);
        # the reference starts from empty rings every call.
        draft = None if self.fused else self._init()
        prefill, round_ = (self._prefill_fused, self._round_fused) if self.fused else (self._prefill, self._round)
        for r in reqs:
            draft = prefill(r, draft, temperature)
        while any(len(r.generated) < r.max_new for r in reqs):
            live = [r for r in reqs if len(r.generated) < r.max_new]
            draft = round_(live, draft, temperature)
        return [r.generated for r in reqs], SpecStats([r.drafted for r in reqs], [r.accepted for r in reqs])

    def _lengths(self, live: list[_Request]) -> list[int]:
        """Drafts each request verifies: K, but never past its last token (L <= tokens left - 1)."""
        return [min(self.k, r.max_new - len(r.generated) - 1) for r in live]

    def _verify_chunk(self, r: _Request, length: int, drafts: Sequence[int], temperature: float) -> Chunk:
        return Chunk(slot=r.slot, start=r.committed, tokens=[r.generated[-1], *drafts], pages=self._pages(r),
                     outputs=list(range(length + 1)), temperature=temperature, seed=r.seed,
                     taps=list(range(length + 1)))

    @staticmethod
    def _take(live: list[_Request], lengths: list[int], accepted: np.ndarray, tokens: np.ndarray) -> None:
        for i, r in enumerate(live):
            a = int(accepted[i])
            r.drafted += lengths[i]
            r.accepted += a
            r.take(tokens[i, :a + 1].tolist())

    def _prefill_fused(self, r: _Request, draft: DraftState, temperature: float) -> DraftState:
        for chunk, last in self._prefill_chunks(r, temperature):
            out = self.spec_runner.run([chunk], [0 if last else -1])
            if last:
                r.take([int(out.tokens[0, 0])])
        return draft

    def _prefill_chunks(self, r: _Request, temperature: float):
        """(chunk, is it the prompt's last) in order; taps on the prompt's last RING positions."""
        budget = self.runner.buckets[-1].tokens
        for start in range(0, len(r.prompt), budget):
            n = min(budget, len(r.prompt) - start)
            last = start + n == len(r.prompt)
            taps = [i for i in range(n) if start + i >= len(r.prompt) - RING]
            yield Chunk(slot=r.slot, start=start, tokens=r.prompt[start:start + n], pages=self._pages(r),
                        outputs=[n - 1] if last else [], temperature=temperature, seed=r.seed, taps=taps), last

    def _round_fused(self, live: list[_Request], draft: DraftState, temperature: float) -> DraftState:
        lengths = self._lengths(live)
        chunks = [self._verify_chunk(r, n, [0] * n, temperature) for r, n in zip(live, lengths)]  # drafts on device
        out = self.spec_runner.run(chunks, lengths)
        self._take(live, lengths, out.accepted, out.tokens)
        return draft

    def _pages(self, r: _Request) -> list[int]:
        n = self.geometry.max_pages_per_seq
        return list(range(r.slot * n, (r.slot + 1) * n))

    def _prefill(self, r: _Request, draft: DraftState, temperature: float) -> DraftState:
        for chunk, last in self._prefill_chunks(r, temperature):
            out = self.runner.run([chunk])
            if chunk.taps:
                taps = list(chunk.taps)
                draft = self._commit_rows(draft, out.taps[:len(taps)], [chunk.start + i for i in taps], r.slot)
            if last:
                r.take([int(out.tokens[0])])
        return draft

    def _commit_rows(self, draft: DraftState, taps: np.ndarray, positions: list[int], slot: int) -> DraftState:
        t = len(positions)
        return self._commit(self._head_params, draft, jnp.asarray(taps), jnp.asarray(positions, jnp.int32),
                            jnp.full((t,), slot, jnp.int32), jnp.ones((t,), bool))

    def _round(self, live: list[_Request], draft: DraftState, temperature: float) -> DraftState:
        n = len(live)
        f32 = lambda x: jnp.full((n,), x, jnp.float32)  # noqa: E731
        anchor = jnp.asarray([r.generated[-1] for r in live], jnp.int32)
        anchor_pos = jnp.asarray([r.committed - 1 for r in live], jnp.int32)  # newest position with context
        slots = np.asarray([r.slot for r in live])
        prop = self._propose(self._head_params, self._embed, self._draft_lm_head, anchor, anchor_pos,
                             draft.rings[:, slots], draft.ring_pos[slots], f32(temperature),
                             jnp.zeros((n,), jnp.int32), f32(1.0), f32(0.0), jnp.asarray([r.seed for r in live], jnp.uint32))
        drafts = np.asarray(prop.tokens)
        lengths = self._lengths(live)
        chunks = [self._verify_chunk(r, lengths[i], drafts[i, :lengths[i]].tolist(), temperature)
                  for i, r in enumerate(live)]
        out = self.runner.run(chunks)
        k = self.k
        v = out.logits.shape[-1]
        logits = np.zeros((n, k + 1, v), np.float32)
        row = 0
        for i, length in enumerate(lengths):
            logits[i, :length + 1] = out.logits[row:row + length + 1]
            row += length + 1
        verdict = self._verify(jnp.asarray(logits), jnp.asarray(drafts[:, :k]), prop.probs[:, :k],
                               jnp.asarray(lengths, jnp.int32), f32(temperature), jnp.zeros((n,), jnp.int32),
                               f32(1.0), f32(0.0), jnp.asarray([r.seed for r in live], jnp.uint32),
                               jnp.asarray([r.committed + 1 for r in live], jnp.int32))
        accepted, tokens = np.asarray(verdict.accepted), np.asarray(verdict.tokens)
        tap_rows, positions, tap_slots = [], [], []
        row = 0
        for i, r in enumerate(live):
            a = int(accepted[i])
            tap_rows += list(range(row, row + a + 1))  # the anchor and the accepted drafts are committed
            positions += [r.committed + j for j in range(a + 1)]
            tap_slots += [r.slot] * (a + 1)
            row += lengths[i] + 1
        self._take(live, lengths, accepted, tokens)
        t = len(positions)
        return self._commit(self._head_params, draft, jnp.asarray(out.taps[tap_rows]),
                            jnp.asarray(positions, jnp.int32), jnp.asarray(tap_slots, jnp.int32), jnp.ones((t,), bool))


# ---- the fused step: verify, commit context and draft the next block in one program --------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pending:
    """Each slot's latest proposal, kept on the device for the next step: tokens [S, K] and
    the distributions they were drawn from [S, K, V] (f32)."""

    tokens: jax.Array
    probs: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecBatch:
    """Speculative fields of a step, next to its `StepBatch`.

    spec_len [R]: drafts the request verifies (0..K: its chunk is [anchor, d_0..d_{L-1}] with
        an output on every row, or a prefill chunk whose last row is its only output, L = 0);
        -1 for a prefill chunk that is not the prompt's last (no output, nothing drafted).
    req_out_first [R]: the request's first output row.
    from_draft [T]: j > 0 where the row's token is the slot's pending draft j - 1 (the host
        never reads drafts; the device substitutes them).
    fresh [R]: 1 on a request's first chunk in its slot: the slot's ring positions are
        forgotten first (they belong to the slot's previous request; positions a prefix-cache
        hit skipped are thereby never visible to the draft).
    """

    spec_len: jax.Array
    req_out_first: jax.Array
    from_draft: jax.Array
    fresh: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecOutputs:
    """Per request row: `accepted` [R] drafts accepted and `tokens` [R, K+1] it commits
    (-1 past accepted + 1; see `speculative.Verdict`); `confidence_logits` [R, K] of the block
    drafted for the next step. With max_logprobs N > 0, each of the K+1 rows also has the raw
    model logprob of its token `logprobs` [R, K+1] and the top N (`top_ids` / `top_logprobs`
    [R, K+1, N], as `dsv4.step.StepOutputs`); None otherwise. Rows past a request's committed
    tokens are filler (their token taken as 0); callers read only the committed rows."""

    accepted: jax.Array
    tokens: jax.Array
    confidence_logits: jax.Array
    logprobs: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def pack_spec(chunks: Sequence[Chunk], spec_lens: Sequence[int], tokens: int, requests: int,
              fresh: Sequence[bool] = ()) -> SpecBatch:
    """The SpecBatch of `chunks` (as packed by `pack_batch`): a chunk with spec_len L >= 1 has
    tokens [anchor, L placeholders] and outputs on all L + 1 rows; `fresh` marks requests new
    to their slot (default: those whose chunk starts at position 0)."""
    fresh = list(fresh) or [c.start == 0 for c in chunks]
    spec = dict(spec_len=np.full(requests, -1, np.int32), req_out_first=np.zeros(requests, np.int32),
                from_draft=np.zeros(tokens, np.int32), fresh=np.zeros(requests, np.int32))
    spec["fresh"][:len(fresh)] = fresh
    row = out = 0
    for i, (c, length) in enumerate(zip(chunks, spec_lens)):
        n = len(c.tokens)
        if length >= 1 and (n != length + 1 or list(c.outputs) != list(range(n))):
            raise ValueError(f"slot {c.slot}: verifying {length} drafts needs [anchor, {length} drafts] with an "
                             f"output on every row, got {n} tokens and outputs {list(c.outputs)}")
        if length == 0 and len(c.outputs) != 1:
            raise ValueError(f"slot {c.slot}: a chunk without drafts needs exactly one output, got {list(c.outputs)}")
        spec["spec_len"][i] = length if c.outputs else -1
        spec["req_out_first"][i] = out
        spec["from_draft"][row + 1:row + 1 + max(length, 0)] = np.arange(1, max(length, 0) + 1)
        out += len(c.outputs)
        row += n
    return SpecBatch(**spec)


def make_spec_step(graphdef: nnx.GraphDef, head_graphdef: nnx.GraphDef, geometry, ops: OpSet, k: int,
                   depth: int | None = None, max_logprobs: int = 0):
    """The pure fused step: the target's step over the batch, `verify` of every request's
    drafts, the committed positions' taps into the draft rings, and the next block drafted
    from each request's newest token. (params, head_params, state, draft, pending, batch,
    spec, draft_lm_head) -> (state, draft, pending, SpecOutputs); draft_lm_head is the LM head
    the draft uses (the target's, or its `quant.Fp8Rows`).

    depth: how many drafts the next block has (default K; load-aware depth drafts fewer). The
    pending block is padded to K (token 0, q = 0, confidence logit -inf); the next step must
    verify at most `depth` of them. max_logprobs: N > 0 also returns the committed tokens'
    logprobs and top N (`SpecOutputs`)."""
    depth = k if depth is None else depth
    if not 1 <= depth <= k:
        raise ValueError(f"depth must lie in [1, {k}], got {depth}")
    def step(params, head_params, state, draft: DraftState, pending: Pending, batch, spec: SpecBatch, draft_lm_head):
        model = nnx.merge(graphdef, params)
        head = nnx.merge(head_graphdef, head_params)
        mtp = isinstance(head, MTPHead)
        t = batch.tokens.shape[0]
        r = batch.req_slot.shape[0]
        s = pending.tokens.shape[0]
        req_of_row = jnp.clip(batch.token_req, 0, r - 1)
        slot_of_row = jnp.clip(batch.req_slot[req_of_row], 0, s - 1)
        j = jnp.clip(spec.from_draft - 1, 0, k - 1)
        tokens = jnp.where(spec.from_draft > 0, pending.tokens[slot_of_row, j], batch.tokens)
        batch = dataclasses.replace(batch, tokens=tokens)
        state, logits, taps = model.step(state, batch, geometry, ops)

        # Verification, one row of [K + 1] output rows per request.
        o = logits.shape[0]
        first = spec.req_out_first
        out_idx = jnp.clip(first[:, None] + jnp.arange(k + 1)[None, :], 0, o - 1)
        live = spec.spec_len >= 0
        slot = jnp.clip(batch.req_slot, 0, s - 1)
        out_row_tok = jnp.clip(batch.out_rows[jnp.clip(first, 0, o - 1)], 0, t - 1)
        token_pos = batch.req_start + out_row_tok - batch.req_first_row  # position of the first output's token
        params_r = [a[jnp.clip(first, 0, o - 1)] for a in (batch.out_temperature, batch.out_top_k, batch.out_top_p,
                                                            batch.out_min_p, batch.out_seed)]
        temperature, top_k, top_p, min_p, seed = params_r
        verdict = verify(logits[out_idx], pending.tokens[slot], pending.probs[slot], jnp.maximum(spec.spec_len, 0),
                         temperature, top_k, top_p, min_p, seed, token_pos + 1)

        anchor = jnp.take_along_axis(verdict.tokens, verdict.accepted[:, None], axis=1)[:, 0]  # the newest token
        anchor_pos = token_pos + verdict.accepted  # the newest committed position (the anchor's predecessor)
        embed = params["embed"]["weight"][...]

        # A slot's first request chunk forgets the ring positions of the slot's last request.
        forget = jnp.where((spec.fresh > 0) & (batch.req_slot >= 0), batch.req_slot, s)
        draft = dataclasses.replace(draft, ring_pos=draft.ring_pos.at[forget].set(-1, mode="drop"),
                                    held_pos=draft.held_pos.at[forget].set(-1, mode="drop"))
        if mtp:
            draft = _commit_held(head, draft, batch, embed, ops)
        # Context: a tapped row is committed when it lies at or before the newest accepted token.
        tap_ok = batch.tap_rows >= 0
        tap_row = jnp.clip(batch.tap_rows, 0, t - 1)
        tap_req = jnp.clip(batch.token_req[tap_row], 0, r - 1)
        offset = tap_row - batch.req_first_row[tap_req]
        committed_upto = jnp.where(live, out_row_tok - batch.req_first_row + verdict.accepted, jnp.iinfo(jnp.int32).max)
        tap_ok &= (batch.token_req[tap_row] < r) & (offset <= committed_upto[tap_req])
        tap_pos = batch.req_start[tap_req] + offset
        if mtp:
            # An MTP ring row needs the token after its position: the next row's, the newest
            # token after the newest committed position, or (a prefill chunk's last row) the
            # slot's next chunk's first token: that row is held until then.
            last = batch.req_num_tokens[tap_req] - 1
            next_ids = jnp.where(offset < jnp.minimum(committed_upto[tap_req], last),
                                 batch.tokens[jnp.clip(tap_row + 1, 0, t - 1)], anchor[tap_req])
            hold = tap_ok & ~live[tap_req] & (offset == last)
            draft = commit_context(head, draft, taps, tap_pos, batch.req_slot[tap_req], tap_ok & ~hold, next_ids,
                                   embed, ops)
            held = jnp.where(hold, batch.req_slot[tap_req], s)
            draft = dataclasses.replace(draft, held_taps=draft.held_taps.at[held].set(taps, mode="drop"),
                                        held_pos=draft.held_pos.at[held].set(tap_pos, mode="drop"))
            # The MTP drafter starts from the tower's final state at the newest committed position.
            tap_of_row = jnp.zeros((t,), jnp.int32).at[jnp.where(batch.tap_rows >= 0, batch.tap_rows, t)].set(
                jnp.arange(batch.tap_rows.shape[0], dtype=jnp.int32), mode="drop")
            anchor_taps = taps[tap_of_row[jnp.clip(out_row_tok + verdict.accepted, 0, t - 1)]]
        else:
            draft = commit_context(head, draft, taps, tap_pos, batch.req_slot[tap_req], tap_ok)
            anchor_taps = None

        # The next block, from each request's newest token.
        prop = propose(head, anchor, anchor_pos, draft.rings[:, slot], draft.ring_pos[slot], embed, draft_lm_head,
                       temperature, top_k, top_p, min_p, seed, ops, depth, anchor_taps)
        pad = k - depth
        prop = dataclasses.replace(
            prop, tokens=jnp.pad(prop.tokens, ((0, 0), (0, pad))),
            probs=jnp.pad(prop.probs, ((0, 0), (0, pad), (0, 0))),
            confidence_logits=jnp.pad(prop.confidence_logits, ((0, 0), (0, pad)), constant_values=-jnp.inf))
        write = jnp.where(live & (batch.req_slot >= 0), batch.req_slot, s)  # out of range: dropped
        pending = Pending(tokens=pending.tokens.at[write].set(prop.tokens, mode="drop"),
                          probs=pending.probs.at[write].set(prop.probs, mode="drop"))
        tokens = jnp.where(live[:, None], verdict.tokens, -1)
        lp = {}
        if max_logprobs:
            flat = logits[out_idx].reshape(r * (k + 1), -1)
            token_lp, top_ids, top_lp = logprobs(flat, jnp.maximum(tokens, 0).reshape(-1), max_logprobs)
            lp = dict(logprobs=token_lp.reshape(r, k + 1), top_ids=top_ids.reshape(r, k + 1, max_logprobs),
                      top_logprobs=top_lp.reshape(r, k + 1, max_logprobs))
        return state, draft, pending, SpecOutputs(accepted=jnp.where(live, verdict.accepted, 0), tokens=tokens,
                                                  confidence_logits=prop.confidence_logits, **lp)

    return step


def _commit_held(head: MTPHead, draft: DraftState, batch, embed_VD: jax.Array, ops: OpSet) -> DraftState:
    """The ring rows held for positions just before this step's chunks (MTP): their next token
    is each chunk's first."""
    s = draft.held_pos.shape[0]
    t = batch.tokens.shape[0]
    slot = jnp.clip(batch.req_slot, 0, s - 1)
    pos = draft.held_pos[slot]
    ok = (batch.req_slot >= 0) & (batch.req_num_tokens > 0) & (pos >= 0) & (pos == batch.req_start - 1)
    first = batch.tokens[jnp.clip(batch.req_first_row, 0, t - 1)]
    draft = commit_context(head, draft, draft.held_taps[slot], pos, batch.req_slot, ok, first, embed_VD, ops)
    return dataclasses.replace(draft, held_pos=draft.held_pos.at[jnp.where(ok, batch.req_slot, s)].set(-1, mode="drop"))


class SpecRunner:
    """The fused speculative step (`make_spec_step`) on a `StepRunner`'s parameters and decode
    state, with the draft rings and pending drafts on the device: one program per bucket,
    compiled in `warmup` (or on first use)."""

    def __init__(self, runner: StepRunner, head: DSparkHead | MTPHead, ops: OpSet, *, k: int,
                 draft_lm_head: jax.Array | quant.Fp8Rows | None = None, depths: Sequence[int] = ()):
        """runner: the target's runner (its buckets need K + 1 output rows per request and a tap
        row per token: `make_buckets(..., max_spec_tokens=K, taps=True)`); draft_lm_head: the
        LM head the draft uses (default: the target's); depths: the block depths `run` may ask
        for (default: K only), one program per bucket and depth."""
        cfg = head.cfg
        if runner.geometry.max_spec_tokens < k:
            raise ValueError(f"the state holds {runner.geometry.max_spec_tokens} speculative tokens, need {k}")
        if not 1 <= k <= head.block_size:
            raise ValueError(f"K must lie in [1, {head.block_size}] (the head's block size), got {k}")
        self.depths = tuple(sorted(set(depths) | {k}))
        if not all(1 <= d <= k for d in self.depths):
            raise ValueError(f"depths must lie in [1, {k}], got {list(depths)}")
        self.runner, self.k, self.geometry = runner, k, runner.geometry
        head_graphdef, self._head_params = nnx.split(head)
        self._draft_lm_head = runner.params["head"]["weight"][...] if draft_lm_head is None else draft_lm_head
        n, v = runner.geometry.num_slots, cfg.vocab_size
        dtype = runner.params["embed"]["weight"][...].dtype
        init = lambda: (init_draft_state(head, n, dtype),  # noqa: E731
                        Pending(tokens=jnp.zeros((n, k), jnp.int32), probs=jnp.zeros((n, k, v), jnp.float32)))
        placement = runner.placement
        if placement is None:
            self._init = jax.jit(init)
            jit = lambda f: jax.jit(f, donate_argnums=(2, 3, 4))  # noqa: E731
        else:
            # On a mesh: the head's parameters sharded by the target's rules (its mtp.S.* names
            # match the same patterns), the ops shard-local as the target's, and the draft rings
            # and pending drafts, like the batch, whole on every device (small: one block a slot).
            ops = placement.shard_ops(ops)
            self._head_params = placement.place_params(self._head_params)
            rep = placement.replicated()
            self._init = jax.jit(init, out_shardings=rep)
            lm_head_sh = jax.tree.map(lambda x: x.sharding, self._draft_lm_head)
            shardings = (placement.param_shardings(runner.params), placement.param_shardings(self._head_params),
                         runner.state_shardings, rep, rep, rep, rep, lm_head_sh)
            jit = lambda f: jax.jit(f, donate_argnums=(2, 3, 4), in_shardings=shardings,  # noqa: E731
                                    out_shardings=(runner.state_shardings, rep, rep, rep))
        self.draft, self.pending = self._init()
        self._steps = {d: jit(make_spec_step(runner.graphdef, head_graphdef, runner.geometry, ops, k, d,
                                             runner.max_logprobs))
                       for d in self.depths}
        self._compiled: dict = {}

    @property
    def buckets(self):
        return self.runner.buckets

    def reset(self) -> None:
        """Empty draft rings and pending drafts, and a fresh target state."""
        self.draft, self.pending = self._init()
        self.runner.reset_state()

    def warmup(self, progress: Callable[[int, int, object], None] | None = None) -> None:
        """Compile every (bucket, depth) program; `progress(i, n, bucket)` before each."""
        todo = [(b, d) for b in self.runner.buckets for d in self.depths]
        for i, (bucket, depth) in enumerate(todo):
            if progress is not None:
                progress(i, len(todo), bucket)
            self._program(bucket, depth)

    def _program(self, bucket, depth: int):
        key = (bucket, depth)
        if key not in self._compiled:
            batch = pack_batch([], bucket, self.geometry)
            spec = pack_spec([], [], bucket.tokens, bucket.requests)
            self._compiled[key] = self._steps[depth].lower(self.runner.params, self._head_params, self.runner.state,
                                                           self.draft, self.pending, batch, spec,
                                                           self._draft_lm_head).compile()
        return self._compiled[key]

    def run(self, chunks: Sequence[Chunk], spec_lens: Sequence[int], fresh: Sequence[bool] = (),
            depth: int | None = None) -> SpecOutputs:
        """One fused step (`SpecBatch` says what spec_lens and fresh mean) whose next blocks
        have `depth` drafts (one of `depths`; default K); outputs on the host."""
        depth = self.k if depth is None else depth
        if depth not in self._steps:
            raise ValueError(f"depth {depth} was not compiled (depths {list(self.depths)})")
        bucket = self.runner.bucket_for(sum(len(c.tokens) for c in chunks), len(chunks),
                                        sum(len(c.outputs) for c in chunks), sum(len(c.taps) for c in chunks))
        return self._run(bucket, depth, pack_batch(chunks, bucket, self.geometry),
                         pack_spec(chunks, spec_lens, bucket.tokens, bucket.requests, fresh))

    def run_empty(self, bucket, depth: int | None = None) -> None:
        """Run the (bucket, depth) program over an all-padding batch and wait (for timing it:
        `serving.capacity.measure_step_speed`); nothing is written."""
        self._run(bucket, self.k if depth is None else depth, pack_batch([], bucket, self.geometry),
                  pack_spec([], [], bucket.tokens, bucket.requests))

    def workspace_bytes(self) -> int | None:
        """The most temporary device memory any compiled program needs (`dsv4.step.temp_bytes`)."""
        return temp_bytes(self._compiled.values())

    def _run(self, bucket, depth: int, batch, spec: SpecBatch) -> SpecOutputs:
        runner = self.runner
        runner.state, self.draft, self.pending, out = self._program(bucket, depth)(
            runner.params, self._head_params, runner.state, self.draft, self.pending, batch, spec,
            self._draft_lm_head)
        return jax.device_get(out)
