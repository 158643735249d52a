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

Every random draw is keyed by (seed, position, stream), so a request's tokens do not depend
on its neighbours, and at temperature 0 the tokens equal plain greedy decoding exactly.
This loop fetches the target's logits to the host and runs the head and the verifier as
separate programs: it is the reference twin for a fused verify-and-draft step, not the fast
path.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.batch import Chunk
from dsv4.layers.dspark import RING, DSparkHead
from dsv4.ops.registry import OpSet
from dsv4.speculative import propose, verify
from dsv4.step import StepRunner


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    """The head's context per slot: every stage's ring [stages, slots, RING, H] and the
    position each ring slot holds [slots, RING] (-1: none, e.g. a prefix-cache position)."""

    rings: jax.Array
    ring_pos: jax.Array


def init_draft_state(head: DSparkHead, slots: int, dtype) -> DraftState:
    cfg = head.cfg
    return DraftState(rings=jnp.zeros((cfg.num_draft_stages, slots, RING, cfg.head_dim), dtype),
                      ring_pos=jnp.full((slots, RING), -1, jnp.int32))


def commit_context(head: DSparkHead, state: DraftState, taps_TXD: jax.Array, positions_T: jax.Array,
                   slots_T: jax.Array, valid_T: jax.Array) -> DraftState:
    """Write the ring entries of committed positions (rows with valid = False write nowhere).
    The caller keeps (slot, position % RING) distinct among the valid rows."""
    entries = head.ring_entries(taps_TXD, positions_T).astype(state.rings.dtype)  # [Z, T, H]
    s = state.ring_pos.shape[0]
    slot = jnp.where(valid_T, slots_T, s)  # out of range: dropped
    col = positions_T % RING
    rings = state.rings.at[:, slot, col].set(entries, mode="drop")
    ring_pos = state.ring_pos.at[slot, col].set(positions_T.astype(jnp.int32), mode="drop")
    return DraftState(rings=rings, ring_pos=ring_pos)


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

    def __init__(self, runner: StepRunner, head: DSparkHead, embed_VD: jax.Array, head_VD: jax.Array, ops: OpSet,
                 *, num_speculative_tokens: int | None = None):
        cfg = head.cfg
        k = num_speculative_tokens or cfg.dspark_block_size
        if not 1 <= k <= cfg.dspark_block_size:
            raise ValueError(f"num_speculative_tokens must lie in [1, {cfg.dspark_block_size}], got {k}")
        if runner.geometry.max_spec_tokens < k:
            raise ValueError(f"the state holds {runner.geometry.max_spec_tokens} speculative tokens, need {k}")
        self.runner, self.k = runner, k
        self.geometry = runner.geometry
        graphdef, params = nnx.split(head)
        self._head_params = params
        self._embed, self._lm_head = embed_VD, head_VD

        def _propose(params, anchor, pos, rings, ring_pos, t, top_k, top_p, min_p, seed):
            return propose(nnx.merge(graphdef, params), anchor, pos, rings, ring_pos, embed_VD, head_VD, t, top_k,
                           top_p, min_p, seed, ops)

        def _commit(params, state, taps, positions, slots, valid):
            return commit_context(nnx.merge(graphdef, params), state, taps, positions, slots, valid)

        self._propose = jax.jit(_propose)
        self._commit = jax.jit(_commit)
        self._verify = jax.jit(verify)
        self._init = lambda: init_draft_state(head, runner.geometry.num_slots, embed_VD.dtype)

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
        draft = self._init()
        for r in reqs:
            draft = self._prefill(r, draft, temperature)
        while any(len(r.generated) < r.max_new for r in reqs):
            live = [r for r in reqs if len(r.generated) < r.max_new]
            draft = self._round(live, draft, temperature)
        return [r.generated for r in reqs], SpecStats([r.drafted for r in reqs], [r.accepted for r in reqs])

    def _pages(self, r: _Request) -> list[int]:
        n = self.geometry.max_pages_per_seq
        return list(range(r.slot * n, (r.slot + 1) * n))

    def _prefill(self, r: _Request, draft: DraftState, temperature: float) -> DraftState:
        budget = self.runner.buckets[-1].tokens
        start = 0
        while start < len(r.prompt):
            n = min(budget, len(r.prompt) - start)
            last = start + n == len(r.prompt)
            taps = [i for i in range(n) if start + i >= len(r.prompt) - RING]
            out = self.runner.run([Chunk(slot=r.slot, start=start, tokens=r.prompt[start:start + n],
                                         pages=self._pages(r), outputs=[n - 1] if last else [],
                                         temperature=temperature, seed=r.seed, taps=taps)])
            if taps:
                draft = self._commit_rows(draft, out.taps[:len(taps)], [start + i for i in taps], r.slot)
            if last:
                r.generated.append(int(out.tokens[0]))
            start += n
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
        prop = self._propose(self._head_params, anchor, anchor_pos, draft.rings[:, slots], draft.ring_pos[slots],
                             f32(temperature), jnp.zeros((n,), jnp.int32), f32(1.0), f32(0.0),
                             jnp.asarray([r.seed for r in live], jnp.uint32))
        drafts = np.asarray(prop.tokens)
        # The last token a request may still take is never drafted past: L = min(K, tokens left - 1).
        lengths = [min(self.k, r.max_new - len(r.generated) - 1) for r in live]
        chunks = [Chunk(slot=r.slot, start=r.committed, tokens=[r.generated[-1], *drafts[i, :lengths[i]].tolist()],
                        pages=self._pages(r), outputs=list(range(lengths[i] + 1)), temperature=temperature,
                        seed=r.seed, taps=list(range(lengths[i] + 1))) for i, r in enumerate(live)]
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
            r.drafted += lengths[i]
            r.accepted += a
            r.generated += tokens[i, :a + 1].tolist()
        t = len(positions)
        return self._commit(self._head_params, draft, jnp.asarray(out.taps[tap_rows]),
                            jnp.asarray(positions, jnp.int32), jnp.asarray(tap_slots, jnp.int32), jnp.ones((t,), bool))
