"""The serving engine: requests in, token events out, over the one step function.

`Engine` is a typed interface (`submit`, `step`, `cancel`, `stats`) around a `StepRunner`
(or anything with its `dispatch` / `collect` / `geometry` / `buckets`), with a
continuous-batching scheduler:

- Every step has a token budget (`max_num_batched_tokens`). Running requests that are
  decoding get one token each first; then running prefills continue in chunks; then waiting
  requests are admitted (priority, then arrival: FIFO by default) while a state slot is
  free and the budget lasts.
- Pages are allocated only for the tokens a step actually writes (no lookahead for running
  prefill chunks, no reservation for max_tokens). When a request needs a page and none is
  free, the running request of lowest priority (latest arrival among equals) is preempted
  by recompute: its slot and pages are freed and it waits again; when readmitted it
  re-prefills its prompt plus the tokens it had generated. Sampling is keyed by (seed,
  position, stream), so a recomputed request continues with exactly the tokens it would
  have produced.
- One request = `tokens` (prompt, then generated) and `committed` (how many are in the
  state). A step feeds tokens[committed : committed + n]; when that reaches the end of
  `tokens` the last row's next token is sampled. Prefill, decode and recompute are the same
  case.
- Host and device overlap: `step()` plans and launches step n+1, then collects step n,
  so the host's planning, packing and output handling run while the device computes. A
  token still on the device is fed to the next step by reference (`Chunk.token_from_last`).
- Under data parallelism (`data_shards` > 1) slot s and page p live on data shard
  s * n // slots and p * n // pages, and a request takes pages from its slot's shard only.
- Prefix cache (`prefix_cache=True`, one data shard): full blocks of committed tokens are
  registered with `serving.prefix_cache.BlockManager`, and the rings are snapshotted after a
  step that ends exactly on a block boundary (prefill chunks are cut to end on one when they
  can). An admitted request takes the longest cached prefix that ends at a snapshot: its
  pages are shared (reference-counted, never written: the request writes only positions
  after the prefix), its rings are restored, and it computes from there. Finished requests'
  blocks stay cached until a page is needed (LRU).

Stop strings are a text-level matter (they need the tokenizer): the caller that detokenises
calls `cancel(request_id, FinishReason.STOP)` when one appears. The engine is
single-threaded; a server drives it from one loop thread.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from dsv4.batch import Bucket, Chunk
from dsv4.sampling import NONFINITE_TOKEN
from dsv4.state import StateGeometry
from serving.capacity import CapacityTelemetry, CapacityVerifier
from serving.prefix_cache import BlockManager


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token, EOS or (set by the text layer) a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # the model's logits were NaN or infinite (dsv4.sampling.NONFINITE_TOKEN)


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit (a server answers RESOURCE_EXHAUSTED)."""


class StepError(RuntimeError):
    """A step failed. `request_ids` were in it and have ended (no final output comes for
    them); every other request was kept and will recompute. The engine is consistent and
    can go on stepping."""

    def __init__(self, request_ids: list[str], cause: Exception):
        super().__init__(f"step failed for {len(request_ids)} request(s) {request_ids[:8]}: {cause!r}")
        self.request_ids, self.cause = request_ids, cause


MAX_SEED = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (token level)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None: one is drawn and reported in Usage.seed
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # top-n logprobs per generated token (0 = none)

    def problems(self, vocab_size: int, max_logprobs: int) -> list[str]:
        """What is wrong with these parameters (empty when they are valid)."""
        bad = []
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            bad.append(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            bad.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            bad.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            bad.append(f"seed must be in [0, {MAX_SEED}], got {self.seed}")
        if self.max_tokens < 1:
            bad.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        out_of_vocab = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if out_of_vocab:
            bad.append(f"stop_token_ids {out_of_vocab} are outside the vocabulary [0, {vocab_size})")
        if not (0 <= self.logprobs <= max_logprobs):
            bad.append(f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}")
        return bad


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    priority: int = 0  # lower runs first; ties by arrival
    speculate: bool = True  # False: never verify drafts for it (plain decoding), even under speculation


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    seed: int = 0  # the seed the request sampled with (drawn when it gave none)
    preemptions: int = 0
    queue_s: float = 0.0  # arrival -> first admitted
    first_token_s: float = 0.0  # arrival -> first generated token
    total_s: float = 0.0  # arrival -> finished


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclasses.dataclass
class RequestOutput:
    """What a step produced for one request: its new tokens, and the end when it finished."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # on the finishing output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    free_pages: int
    total_pages: int
    free_slots: int
    steps: int
    tokens_scheduled: int  # tokens fed to the model since start
    tokens_generated: int
    preemptions: int
    cached_pages: int  # pages held by the prefix cache (in use or evictable)
    prefix_hits: int  # admissions that restored a cached prefix
    prefix_hit_tokens: int  # prompt tokens those hits did not recompute
    host_ms_per_step: float  # mean time planning a step and handling its outputs
    run_ms_per_step: float  # mean time in the runner (packing, device, fetching outputs)
    speculation: SpeculationStats | None = None  # None: speculation off


@dataclasses.dataclass(frozen=True)
class SpeculationStats:
    """Drafting since start. A verification is one request's [anchor, drafts] in one step
    (0 drafts included); position j counts the verifications that reached draft j (every
    draft before it accepted) and those that accepted it."""

    draft_tokens: int
    accepted_draft_tokens: int
    verifications: int
    position_reached: tuple[int, ...]
    position_accepted: tuple[int, ...]
    capacity: CapacityTelemetry | None = None  # capacity-aware verification on

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verification (accepted drafts + the target's own token)."""
        return (self.accepted_draft_tokens + self.verifications) / max(1, self.verifications)

    @property
    def acceptance_by_position(self) -> tuple[float | None, ...]:
        return tuple(a / n if n else None for a, n in zip(self.position_accepted, self.position_reached))


class StepRunnerLike(Protocol):
    geometry: StateGeometry
    buckets: tuple[Bucket, ...]

    def dispatch(self, chunks: Sequence[Chunk]): ...  # launch a step; outputs stay on the device

    def collect(self, outputs): ...  # wait for them; host arrays with .tokens (and logprobs)


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """Admission limits (a request over them is rejected at submit, never truncated)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_num_batched_tokens: int
    max_model_len: int  # prompt + max_tokens per request
    max_req_tokens: int | None = None  # an operator's tighter cap on prompt + max_tokens
    max_waiting: int = 1024
    max_logprobs: int = 0  # the runner's top-n logprobs width (0: logprobs unsupported)


@dataclasses.dataclass(eq=False)  # identity: queues are searched by `in`, and two requests are never equal
class _Live:
    """A request inside the engine."""

    req: EngineRequest
    seed: int
    arrival: float
    tokens: list[int]  # prompt, then generated
    prompt_len: int
    committed: int = 0  # tokens in the decode state
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    admitted_at: float | None = None
    first_token_at: float | None = None
    preemptions: int = 0
    pending: int = 0  # tokens launched steps are sampling for it (not yet in `tokens`): 0, 1 or 2
    block_keys: list[bytes] = dataclasses.field(default_factory=list)  # keys of its full committed blocks
    cached_prompt_tokens: int = 0  # prompt tokens restored from the prefix cache at first admission
    drafted: int = 0  # speculation: drafts verified for it
    accepted: int = 0  # speculation: drafts accepted
    fresh: bool = True  # speculation: its next chunk is its first in its slot since admission
    depth: int = 0  # speculation: drafts in its pending block on the device (0: none of its own yet)
    confidence: np.ndarray | None = None  # speculation: the pending block's confidence logits [depth]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def length(self) -> int:
        """Tokens including the one being sampled on the device."""
        return len(self.tokens) + self.pending

    @property
    def order(self) -> tuple[int, float]:
        return (self.req.priority, self.arrival)


class Engine:
    """Continuous batching over a step runner. Single-threaded: call from one thread."""

    def __init__(self, runner: StepRunnerLike, limits: EngineLimits, *, data_shards: int = 1,
                 prefix_cache: bool = False, clock: Callable[[], float] = time.monotonic,
                 seed_source: Callable[[], int] | None = None, speculator=None,
                 capacity: CapacityVerifier | None = None):
        """prefix_cache: share the pages (and restore the rings) of block-aligned prompt
        prefixes (`serving.prefix_cache`); needs a runner with snapshot slots and one data shard.
        speculator: a `dsv4.spec_decode.SpecRunner` on `runner`: every decoding request then
        verifies up to K drafts per step (synchronous steps: no host/device overlap).
        capacity: capacity-aware verification (`serving.capacity.CapacityVerifier`) choosing
        how many drafts each request verifies and how deep the next blocks are; default:
        every request verifies K."""
        if capacity is not None and speculator is None:
            raise ValueError("capacity-aware verification needs a speculator")
        if capacity is not None and (capacity.k != speculator.k or not set(capacity.depths) <= set(speculator.depths)):
            raise ValueError(f"the capacity verifier (K {capacity.k}, depths {list(capacity.depths)}) does not match "
                             f"the speculator (K {speculator.k}, depths {list(speculator.depths)})")
        geo = runner.geometry
        if limits.max_num_batched_tokens > runner.buckets[-1].tokens:
            raise ValueError(f"max_num_batched_tokens {limits.max_num_batched_tokens} exceeds the largest bucket "
                             f"{runner.buckets[-1]}")
        if limits.max_model_len > geo.max_seq_len:
            raise ValueError(f"max_model_len {limits.max_model_len} exceeds the state's {geo.max_seq_len} positions")
        if geo.num_slots % data_shards:
            raise ValueError(f"{geo.num_slots} slots do not split evenly over {data_shards} data shards")
        per_shard = geo.num_pages // data_shards
        if -(-limits.max_model_len // geo.page_tokens) > per_shard:
            raise ValueError(f"max_model_len {limits.max_model_len} needs more pages than a data shard has "
                             f"({per_shard} of {geo.page_tokens} tokens)")
        self.runner, self.limits, self.geometry = runner, limits, geo
        self.data_shards = data_shards
        self._clock = clock
        self._seed_source = seed_source or (lambda: int(np.random.SeedSequence().generate_state(1)[0]))
        snapshots = getattr(runner, "snapshot_slots", 0)
        if prefix_cache and not snapshots:
            raise ValueError("the prefix cache needs a runner with snapshot slots (StepRunner(snapshot_slots=N))")
        self._pages = BlockManager(geo.num_pages, geo.page_tokens, shards=data_shards,
                                   num_snapshots=snapshots if prefix_cache else 0)
        self._free_slots = list(range(geo.num_slots))
        self._waiting: list[_Live] = []  # kept sorted by (priority, arrival)
        self._running: list[_Live] = []
        self._ids: set[str] = set()
        self._aborted: list[RequestOutput] = []
        self._inflight = None  # (device outputs, [(request, slot, has output row)]) of the launched step
        self._max_requests = min(geo.num_slots, runner.buckets[-1].requests)
        self._steps = self._tokens = self._generated = self._preemptions = 0
        self._host_s = self._run_s = 0.0
        self._spec = speculator
        self._capacity = capacity
        self._verify_lengths: dict[int, int] = {}  # id(live) -> drafts it verifies this step
        self._depth = speculator.k if speculator is not None else 0  # of the blocks the next step drafts
        k = speculator.k if speculator is not None else 0
        self._reached, self._accepted_at = [0] * k, [0] * k
        self._verifications = self._drafted = self._accepted = 0

    # ---- interface ---------------------------------------------------------------------

    def validate(self, req: EngineRequest) -> list[str]:
        """What is wrong with a request (empty when it can be submitted). Pure: it reads only
        the limits, so another thread may call it while the engine steps."""
        lim = self.limits
        bad = list(req.sampling.problems(lim.vocab_size, lim.max_logprobs))
        if not req.request_id:
            bad.append("request_id must not be empty")
        if not req.prompt_token_ids:
            bad.append("the prompt is empty")
        out_of_vocab = [t for t in req.prompt_token_ids if not 0 <= t < lim.vocab_size]
        if out_of_vocab:
            bad.append(f"prompt token ids {out_of_vocab[:5]} are outside the vocabulary [0, {lim.vocab_size})")
        total = len(req.prompt_token_ids) + req.sampling.max_tokens
        if total > lim.max_model_len:
            bad.append(f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) = "
                       f"{total} exceeds max_model_len {lim.max_model_len}")
        if lim.max_req_tokens is not None and total > lim.max_req_tokens:
            bad.append(f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) = "
                       f"{total} exceeds max_req_tokens {lim.max_req_tokens}")
        return bad

    def submit(self, req: EngineRequest) -> int:
        """Queue a request; returns the seed it will sample with. ValueError (every problem,
        "; "-separated) for a bad request or a duplicate id; QueueFullError when the queue is full."""
        bad = self.validate(req)
        if req.request_id in self._ids:
            bad.append(f"request_id {req.request_id!r} is already in flight")
        if bad:
            raise ValueError("; ".join(bad))
        if len(self._waiting) >= self.limits.max_waiting:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting (limit {self.limits.max_waiting})")
        seed = self._seed_source() if req.sampling.seed is None else req.sampling.seed
        live = _Live(req=req, seed=seed, arrival=self._clock(), tokens=list(req.prompt_token_ids),
                     prompt_len=len(req.prompt_token_ids))
        self._ids.add(req.request_id)
        self._enqueue(live)
        return seed

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Finish a request now, freeing its slot and pages; its final output (with `reason`)
        comes from the next `step()`. False when the id is not in flight."""
        for queue in (self._waiting, self._running):
            for live in queue:
                if live.req.request_id == request_id:
                    queue.remove(live)
                    self._release(live)
                    self._aborted.append(self._final(live, [], None, reason))
                    return True
        return False

    @property
    def speculative(self) -> bool:
        """Whether decoding requests verify drafts (a speculator was given)."""
        return self._spec is not None

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._aborted or self._inflight)

    def stats(self) -> EngineStats:
        n = max(self._steps, 1)
        return EngineStats(waiting=len(self._waiting), running=len(self._running),
                           free_pages=self._pages.free_count(), total_pages=self.geometry.num_pages,
                           free_slots=len(self._free_slots), steps=self._steps, tokens_scheduled=self._tokens,
                           tokens_generated=self._generated, preemptions=self._preemptions,
                           cached_pages=self._pages.cached_pages(), prefix_hits=self._pages.hits,
                           prefix_hit_tokens=self._pages.hit_tokens,
                           host_ms_per_step=1e3 * self._host_s / n, run_ms_per_step=1e3 * self._run_s / n,
                           speculation=self._speculation_stats())

    def step(self) -> list[RequestOutput]:
        """Launch the next step and return the outputs of the one before (every request that
        advanced or ended). The host plans and packs step n+1 while the device runs step n:
        a request whose step-n token is still on the device decodes it in step n+1 all the
        same (`Chunk.token_from_last`). A request that step n stops (a stop token) has one
        wasted token computed in step n+1, which is dropped; stopping by length is known in
        advance and wastes nothing."""
        if self._spec is not None:
            return self._speculative_step()
        outputs, self._aborted = self._aborted, []
        t0 = time.perf_counter()
        plan = self._schedule()
        launched = None
        try:
            if plan:
                chunks = [self._chunk(live, n) for live, n in plan]
                launched = (self.runner.dispatch(chunks), [(live, live.slot, bool(c.outputs)) for (live, _), c
                                                           in zip(plan, chunks)])
                for (live, n), c in zip(plan, chunks):
                    live.committed += n
                    live.pending += bool(c.outputs)
                self._steps += 1
                self._tokens += sum(n for _, n in plan)
            t1 = time.perf_counter()
            result = self.runner.collect(self._inflight[0]) if self._inflight is not None else None
        except Exception as e:
            self._aborted = outputs + self._aborted  # not lost: the next step hands them out
            raise self._recover([live for live, _ in plan], e) from e
        t2 = time.perf_counter()
        if result is not None:
            outputs += self._finish_step(result, self._inflight[1])
        self._inflight = launched
        for live, n in plan:  # after step n was launched and before step n+1 is
            if live in self._running:
                self._cache_blocks(live)
        self._host_s += (t1 - t0) + (time.perf_counter() - t2)
        self._run_s += t2 - t1
        return outputs

    def _recover(self, planned: list[_Live], cause: Exception) -> StepError:
        """After a failed launch or collect: end the requests of the failed steps, reset the
        device state (a failed step may have consumed it: it is donated) and send every other
        running request back to wait and recompute, which reproduces its tokens exactly."""
        failed = {id(live): live for live in planned}
        if self._inflight is not None:
            failed.update((id(live), live) for live, _, _ in self._inflight[1])
        self._inflight = None
        for live in failed.values():
            for queue in (self._running, self._waiting):
                if live in queue:
                    queue.remove(live)
                    self._release(live)
        reset = self._spec.reset if self._spec is not None else getattr(self.runner, "reset_state", None)
        if reset is not None:
            reset()
        for live in list(self._running):
            self._preempt(live)
        if reset is not None:
            self._pages.drop_cache()  # the pages' contents went with the old state
        for live in self._waiting:
            live.pending = 0  # tokens of the lost steps are sampled again, identically
        return StepError([live.req.request_id for live in failed.values()], cause)

    def _finish_step(self, result, rows: list[tuple[_Live, int, bool]]) -> list[RequestOutput]:
        """Hand out a collected step's tokens; requests cancelled since it was launched, and
        rows of requests that had already stopped, are skipped."""
        outputs, now, row = [], self._clock(), 0
        for live, slot, has_output in rows:
            if not has_output:
                continue
            token = int(result.tokens[row])
            lp = self._logprob(result, row, token, live.req.sampling.logprobs)
            row += 1
            if not live.pending or not (live in self._running or live in self._waiting):
                continue  # cancelled, or its wasted token after a stop
            live.pending -= 1
            if token == NONFINITE_TOKEN:
                (self._running if live in self._running else self._waiting).remove(live)
                self._release(live)
                outputs.append(self._final(live, [], None, FinishReason.ERROR))
                continue
            live.tokens.append(token)
            self._generated += 1
            if live.first_token_at is None:
                live.first_token_at = now
            reason = self._stop_reason(live, token)
            if reason is None:
                outputs.append(RequestOutput(live.req.request_id, [token], None if lp is None else [lp]))
                continue
            (self._running if live in self._running else self._waiting).remove(live)
            self._release(live)
            outputs.append(self._final(live, [token], None if lp is None else [lp], reason))
        return outputs

    # ---- scheduling --------------------------------------------------------------------

    def _schedule(self) -> list[tuple[_Live, int]]:
        """(request, tokens to feed) for this step, pages allocated."""
        budget = self.limits.max_num_batched_tokens
        plan: list[tuple[_Live, int]] = []
        # Decoding requests first (one token each), oldest first; then running prefills.
        for live in sorted(self._running, key=lambda r: (r.length - r.committed > 1, r.order)):
            if live not in self._running:  # preempted while making room for an earlier one
                continue
            if live.pending and self._ends_by_length(live):
                continue  # its token on the device is its last: nothing more to run
            if budget <= 0 or len(plan) >= self._max_requests:
                break
            n = self._grow(live, self._chunk_size(live, budget), plan)
            if n > 0:
                plan.append((live, n))
                budget -= n
        # Then admit waiting requests while a slot, pages and budget last.
        while self._waiting and budget > 0 and len(plan) < self._max_requests and self._free_slots:
            live = self._waiting[0]
            if live.pending:
                break  # preempted with a token still on the device: readmit once it has arrived
            slot = self._slot_with_pages()
            if slot is None:
                break
            self._waiting.pop(0)
            self._free_slots.remove(slot)
            live.slot, live.committed, live.fresh, live.depth, live.confidence = slot, 0, True, 0, None
            self._restore_prefix(live)
            if live.admitted_at is None:
                live.admitted_at = self._clock()
            self._running.append(live)
            n = self._grow(live, self._chunk_size(live, budget), plan, admitting=True)
            if n > 0:
                plan.append((live, n))
                budget -= n
        return plan

    def _chunk_size(self, live: _Live, budget: int) -> int:
        """Tokens to feed now: what is left, within the budget; with the prefix cache on, a
        chunk that does not finish the tokens ends on a block boundary when it can, so that
        its rings are snapshotted exactly there (cold and warm prefills share chunk ends)."""
        n = min(live.length - live.committed + self._draft_room(live), budget)
        end = live.committed + n
        if self._pages.caching and end < live.length:
            aligned = end // self.geometry.page_tokens * self.geometry.page_tokens
            if aligned > live.committed:
                n = aligned - live.committed
        return n

    def _restore_prefix(self, live: _Live) -> None:
        """On admission: take the longest cached prefix (pages shared, rings restored)."""
        pages, snapshot, n = self._pages.match(live.tokens)
        if not n:
            return
        self.runner.restore_slot(snapshot, live.slot)
        live.pages, live.committed = pages, n
        live.block_keys = self._pages.keys(live.tokens, n // self.geometry.page_tokens)
        if live.admitted_at is None:
            live.cached_prompt_tokens = min(n, live.prompt_len)

    def _cache_blocks(self, live: _Live) -> None:
        """After a step: register the request's newly full blocks, and snapshot its rings when
        the step ended exactly on a block boundary."""
        if not self._pages.caching:
            return
        full = live.committed // self.geometry.page_tokens
        if full > len(live.block_keys):
            keys = self._pages.keys(live.tokens, full, live.block_keys)
            self._pages.register(keys, live.tokens, live.pages, first=len(live.block_keys))
            live.block_keys = keys
        if full and live.committed % self.geometry.page_tokens == 0:
            snapshot = self._pages.snapshot_for(live.block_keys[-1], live.pages[full - 1])
            if snapshot is not None:
                self.runner.save_slot(live.slot, snapshot)

    def _shard(self, slot: int) -> int:
        return slot * self.data_shards // self.geometry.num_slots

    def _pages_for(self, positions: int) -> int:
        return -(-positions // self.geometry.page_tokens)

    def _slot_with_pages(self) -> int | None:
        """A free slot whose shard has a page for the request's first token."""
        return next((s for s in self._free_slots if self._pages.free_count(self._shard(s)) >= 1), None)

    def _grow(self, live: _Live, n: int, plan: list[tuple[_Live, int]], admitting: bool = False) -> int:
        """Allocate pages for n more tokens of `live`, preempting lower-priority running
        requests (not yet in this step's plan) when pages run out; returns how many tokens
        got pages (fewer than n, down to 0, when nothing more can be freed). A request being
        admitted that gets no page keeps its slot and waits for one (never preempts itself)."""
        planned = {id(p) for p, _ in plan}
        while True:
            need = self._pages_for(live.committed + n) - len(live.pages)
            shard = self._shard(live.slot)
            free = self._pages.free_count(shard)
            if need <= free:
                live.pages += self._pages.take(shard, max(need, 0)) or []
                return n
            victims = [r for r in self._running if r is not live and id(r) not in planned
                       and self._shard(r.slot) == shard and r.order > live.order]
            if victims:
                self._preempt(max(victims, key=lambda r: r.order))
                continue
            # Use what is free; a request that cannot place even one token waits its turn.
            fit = (len(live.pages) + free) * self.geometry.page_tokens - live.committed
            if fit > 0:
                live.pages += self._pages.take(shard, free) or []
                return min(n, fit)
            if admitting:
                return 0  # just admitted and nothing free: it waits in its slot for a page
            if sum(self._shard(r.slot) == shard for r in self._running) == 1:
                # Alone on its shard yet out of pages: excluded by the check in __init__.
                raise RuntimeError(f"request {live.req.request_id!r} alone cannot get a page")
            self._preempt(live)  # everyone else here outranks it or is already in this step
            return 0

    def _preempt(self, live: _Live) -> None:
        """Free a running request's slot and pages; it waits again and will recompute."""
        self._running.remove(live)
        self._release(live, keep_id=True)
        live.committed, live.slot, live.block_keys = 0, -1, []
        live.preemptions += 1
        self._preemptions += 1
        self._enqueue(live)

    def _release(self, live: _Live, keep_id: bool = False) -> None:
        if live.slot >= 0:
            self._free_slots.append(live.slot)
            self._free_slots.sort()
        self._pages.give_back(live.pages)
        live.pages = []
        if not keep_id:
            self._ids.discard(live.req.request_id)

    def _enqueue(self, live: _Live) -> None:
        i = 0
        while i < len(self._waiting) and self._waiting[i].order <= live.order:
            i += 1
        self._waiting.insert(i, live)

    def _chunk(self, live: _Live, n: int) -> Chunk:
        s = live.req.sampling
        end = live.committed + n
        # A pending token is the only one left (everything before it is committed): it goes
        # in as a placeholder that the device replaces with the slot's last sampled token.
        from_last = live.committed == len(live.tokens)
        tokens = [0] if from_last else live.tokens[live.committed:end]
        return Chunk(slot=live.slot, start=live.committed, tokens=tokens, pages=live.pages,
                     outputs=[n - 1] if end == live.length else [], temperature=s.temperature, seed=live.seed,
                     top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, token_from_last=from_last)

    # ---- speculative decoding ----------------------------------------------------------

    def _decoding(self, live: _Live) -> bool:
        """Everything but its newest token is in the state (the newest is the next anchor)."""
        return live.committed == len(live.tokens) - 1 and len(live.tokens) > live.prompt_len

    def _draft_cap(self, live: _Live) -> int:
        """The most drafts a decoding request can verify this step: those of its pending block
        (K, or fewer under load-aware depth), never past its last token."""
        if self._spec is None or not self._decoding(live) or not live.req.speculate:
            return 0
        left = min(live.req.sampling.max_tokens - len(live.generated), self.limits.max_model_len - len(live.tokens))
        return max(0, min(live.depth, left - 1))

    def _draft_room(self, live: _Live) -> int:
        """Drafts a request verifies this step (planned in `_plan_verification`)."""
        return self._verify_lengths.get(id(live), 0) if self._spec is not None else 0

    def _plan_verification(self) -> None:
        """Before scheduling: how many drafts each decoding request verifies, and how deep the
        blocks this step drafts are (K; with capacity-aware verification, its plan)."""
        decoding = [live for live in self._running if self._decoding(live)]
        caps = [self._draft_cap(live) for live in decoding]
        if self._capacity is None:
            lengths, self._depth = caps, self._spec.k
        else:
            budget = self.limits.max_num_batched_tokens - sum(1 + c for c in caps)
            prefill = sum(live.length - live.committed for live in self._running if not self._decoding(live))
            plan = self._capacity.plan([live.confidence for live in decoding], caps,
                                       other_tokens=max(0, min(budget, prefill)))
            lengths, self._depth = plan.lengths, plan.depth
        self._verify_lengths = {id(live): n for live, n in zip(decoding, lengths)}

    def _speculative_chunk(self, live: _Live, n: int) -> tuple[Chunk, int]:
        """(chunk, drafts it verifies: >= 0 with an output, -1 for a prefill chunk without one)."""
        from dsv4.layers.dspark import RING  # noqa: PLC0415

        s = live.req.sampling
        common = dict(slot=live.slot, start=live.committed, pages=live.pages, temperature=s.temperature,
                      seed=live.seed, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
        if self._decoding(live):  # [anchor, n - 1 drafts]: the drafts stay on the device
            return Chunk(tokens=[live.tokens[-1]] + [0] * (n - 1), outputs=list(range(n)), taps=list(range(n)),
                         **common), n - 1
        end = live.committed + n
        last = end == len(live.tokens)
        taps = [i for i in range(n) if live.committed + i >= len(live.tokens) - RING]
        return Chunk(tokens=live.tokens[live.committed:end], outputs=[n - 1] if last else [], taps=taps,
                     **common), 0 if last else -1

    def _speculative_step(self) -> list[RequestOutput]:
        """One synchronous step with speculation: schedule, run the fused verify-and-draft
        program, then hand out each request's accepted drafts and its next token."""
        outputs, self._aborted = self._aborted, []
        t0 = time.perf_counter()
        self._plan_verification()
        plan = self._schedule()
        if not plan:
            return outputs
        made = [self._speculative_chunk(live, n) for live, n in plan]
        decoding = [self._decoding(live) for live, _ in plan]
        t1 = time.perf_counter()
        depth = self._depth
        try:
            result = self._spec.run([c for c, _ in made], [length for _, length in made],
                                    [live.fresh for live, _ in plan], depth=depth)
        except Exception as e:
            self._aborted = outputs + self._aborted
            raise self._recover([live for live, _ in plan], e) from e
        t2 = time.perf_counter()
        self._steps += 1
        self._tokens += sum(n for _, n in plan)
        now = self._clock()
        for i, ((live, n), (_, length)) in enumerate(zip(plan, made)):
            live.fresh = False
            if length < 0:
                live.committed += n
                continue
            a = int(result.accepted[i])
            live.committed += n - (length - a)  # the anchor and the accepted drafts (a prefill: all n)
            if decoding[i]:
                self._count_verification(live, length, a)
            live.depth, live.confidence = depth, np.asarray(result.confidence_logits[i][:depth], np.float64)
            new: list[int] = []
            want = live.req.sampling.logprobs
            lps: list[TokenLogprob] | None = [] if want else None
            reason = None
            for j, token in enumerate(result.tokens[i, :a + 1].tolist()):
                if token == NONFINITE_TOKEN:
                    reason = FinishReason.ERROR
                    break
                live.tokens.append(token)
                new.append(token)
                if want:
                    lps.append(self._logprob(result, (i, j), token, want))
                self._generated += 1
                reason = self._stop_reason(live, token)
                if reason is not None:
                    break
            if live.first_token_at is None:
                live.first_token_at = now
            if reason is None:
                outputs.append(RequestOutput(live.req.request_id, new, lps))
                continue
            self._running.remove(live)
            self._release(live)
            outputs.append(self._final(live, new, lps, reason))
        for live, _ in plan:
            if live in self._running:
                self._cache_blocks(live)
        self._host_s += (t1 - t0) + (time.perf_counter() - t2)
        self._run_s += t2 - t1
        return outputs

    def _count_verification(self, live: _Live, length: int, accepted: int) -> None:
        live.drafted += length
        live.accepted += accepted
        self._drafted += length
        self._accepted += accepted
        self._verifications += 1
        for j in range(min(length, accepted + 1)):  # drafts reached: the accepted ones and the rejection
            self._reached[j] += 1
            self._accepted_at[j] += j < accepted
        if self._capacity is not None and length and live.confidence is not None:
            self._capacity.observe(live.confidence, length, accepted)

    def _speculation_stats(self) -> SpeculationStats | None:
        if self._spec is None:
            return None
        return SpeculationStats(draft_tokens=self._drafted, accepted_draft_tokens=self._accepted,
                                verifications=self._verifications, position_reached=tuple(self._reached),
                                position_accepted=tuple(self._accepted_at),
                                capacity=self._capacity.telemetry() if self._capacity is not None else None)

    # ---- outputs -----------------------------------------------------------------------

    def _ends_by_length(self, live: _Live) -> bool:
        """Whether the pending token will end the request whatever its value."""
        return (len(live.generated) + live.pending >= live.req.sampling.max_tokens
                or live.length >= self.limits.max_model_len)

    def _stop_reason(self, live: _Live, token: int) -> FinishReason | None:
        s = live.req.sampling
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.limits.eos_token_ids):
            return FinishReason.STOP
        if len(live.generated) >= s.max_tokens or len(live.tokens) >= self.limits.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _logprob(result, row: int | tuple[int, int], token: int, n: int) -> TokenLogprob | None:
        """The token's logprob and top n of a step's output row (a plain step's row, or a
        speculative step's (request, committed index))."""
        if n == 0 or getattr(result, "logprobs", None) is None:
            return None
        top = tuple((int(i), float(v)) for i, v in zip(result.top_ids[row][:n], result.top_logprobs[row][:n]))
        return TokenLogprob(token, float(result.logprobs[row]), top)

    def _final(self, live: _Live, new: list[int], logprobs: list[TokenLogprob] | None,
               reason: FinishReason) -> RequestOutput:
        now = self._clock()
        usage = Usage(prompt_tokens=live.prompt_len, completion_tokens=len(live.generated), seed=live.seed,
                      cached_prompt_tokens=live.cached_prompt_tokens, draft_tokens=live.drafted,
                      accepted_draft_tokens=live.accepted, preemptions=live.preemptions,
                      queue_s=(live.admitted_at if live.admitted_at is not None else now) - live.arrival,
                      first_token_s=(live.first_token_at - live.arrival) if live.first_token_at is not None else 0.0,
                      total_s=now - live.arrival)
        return RequestOutput(live.req.request_id, new, logprobs, reason, usage)
