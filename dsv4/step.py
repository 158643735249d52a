"""The one step function, its static buckets, and the runner that owns the decode state.

`step(params, state, batch) -> (state', StepOutputs)` is the only program the engine runs on
the device (DESIGN "The one step function"): a ragged batch of prefill chunks, decode
tokens and verification blocks of many requests, padded to a static `Bucket`, against the
decode state, which it donates. Each output row's next token is sampled inside the step
with the row's own temperature / top-k / top-p / min-p and seed (`dsv4.sampling`); with
`max_logprobs` = N > 0 the step also returns the raw-model logprob of every sampled token
and the top N. Outputs are one small pytree fetched with one `jax.device_get` per step.

`StepRunner` lifecycle: construct (allocates the state), `warmup()` compiles every bucket
ahead of time (with the persistent compilation cache when the entry point enabled it),
then `run(chunks)` picks the smallest bucket that fits, packs the batch and runs the
compiled program. A batch that needs a program not compiled in warm-up is a recompilation:
an error under `CompilePolicy.ERROR` (tests), a warning and a counted metric under
`CompilePolicy.WARN` (serving). The runner is single-threaded; the host that builds
chunks owns it.
"""

from __future__ import annotations

import dataclasses
import enum
import time
import warnings
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.batch import Bucket, Chunk, StepBatch, pack_batch
from dsv4.config import ModelConfig
from dsv4.ops.registry import OpSet
from dsv4.sampling import logprobs as token_logprobs, sample
from dsv4.sharding import Placement
from dsv4.state import DecodeState, StateGeometry, copy_slot, init_state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutputs:
    """What one step returns (rows follow the batch's out_rows / tap_rows).

    tokens [O] int32: the sampled next token of each output row.
    logits [O, V] f32, or None when the runner does not return logits.
    taps [Ot, n_taps, D]: hidden taps for the draft head.
    logprobs [O] f32: log_softmax of the raw logits (before temperature and filters) at `tokens`;
    top_ids [O, N] int32 / top_logprobs [O, N] f32: the N most probable tokens of the raw
    distribution, descending. All three are None when the step was made with max_logprobs=0;
    otherwise they cover every output row (padding rows too) and callers slice per request.
    """

    tokens: jax.Array
    logits: jax.Array | None
    taps: jax.Array
    last_tokens: jax.Array | None = None  # [S]: batch.last_tokens with each request's last output row's token
    logprobs: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def make_step(graphdef: nnx.GraphDef, geometry: StateGeometry, ops: OpSet, *, return_logits: bool,
              max_logprobs: int = 0) -> Callable[[nnx.State, DecodeState, StepBatch], tuple[DecodeState, StepOutputs]]:
    """The pure step function of a model (graphdef) for a state geometry and op set.

    max_logprobs: N > 0 also returns every output row's sampled-token logprob and top-N
    logprobs (`StepOutputs`); 0 returns None for them and computes nothing. N > 0 costs every
    step a top-N over [O, V] whether or not a request wants logprobs (`dsv4.sampling.logprobs`).
    """
    if max_logprobs < 0:
        raise ValueError(f"max_logprobs must be >= 0, got {max_logprobs}")

    def step(params: nnx.State, state: DecodeState, batch: StepBatch) -> tuple[DecodeState, StepOutputs]:
        model = nnx.merge(graphdef, params)
        r = batch.req_slot.shape[0]
        row_slot = batch.req_slot[jnp.clip(batch.token_req, 0, r - 1)]
        batch = dataclasses.replace(batch, tokens=jnp.where(
            batch.from_last > 0, batch.last_tokens[jnp.clip(row_slot, 0, batch.last_tokens.shape[0] - 1)],
            batch.tokens))
        state, logits, taps = model.step(state, batch, geometry, ops)
        rows = jnp.clip(batch.out_rows, 0, batch.tokens.shape[0] - 1)
        req = jnp.clip(batch.token_req[rows], 0, r - 1)
        next_pos = batch.req_start[req] + rows - batch.req_first_row[req] + 1
        tokens = sample(logits, batch.out_temperature, batch.out_top_k, batch.out_top_p, batch.out_min_p,
                        batch.out_seed, next_pos)
        # Each request's last output row sets its slot's last token; other rows write nowhere.
        valid = (batch.out_rows >= 0) & (batch.token_req[rows] < r)
        last_of_req = valid & ~(jnp.roll(valid, -1) & (jnp.roll(req, -1) == req)).at[-1].set(False)
        slot = jnp.where(last_of_req, batch.req_slot[req], batch.last_tokens.shape[0])
        last_tokens = batch.last_tokens.at[slot].set(tokens, mode="drop")
        token_lp = top_ids = top_lp = None
        if max_logprobs:
            token_lp, top_ids, top_lp = token_logprobs(logits, tokens, max_logprobs)
        return state, StepOutputs(tokens=tokens, logits=logits if return_logits else None, taps=taps,
                                  last_tokens=last_tokens, logprobs=token_lp, top_ids=top_ids, top_logprobs=top_lp)

    return step


def _pow2_upto(limit: int) -> list[int]:
    sizes = [1]
    while sizes[-1] * 2 < limit:
        sizes.append(sizes[-1] * 2)
    return sorted(set(sizes + [limit]))


def make_buckets(max_num_batched_tokens: int, max_num_seqs: int, *, max_spec_tokens: int = 0,
                 taps: bool = False, token_sizes: Sequence[int] | None = None) -> tuple[Bucket, ...]:
    """The bucket set: token counts (powers of two up to max_num_batched_tokens, or `token_sizes`)
    times request counts (powers of two up to max_num_seqs), keeping requests <= tokens.

    Each bucket returns up to min(tokens, requests * (max_spec_tokens + 1)) output rows (one
    per decode request, K+1 per verified request) and, when `taps`, a tap row per token.
    """
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise ValueError(f"max_num_batched_tokens and max_num_seqs must be >= 1, got "
                         f"{max_num_batched_tokens} and {max_num_seqs}")
    t_sizes = sorted(set(token_sizes)) if token_sizes else _pow2_upto(max_num_batched_tokens)
    if t_sizes[0] < 1 or t_sizes[-1] > max_num_batched_tokens:
        raise ValueError(f"token sizes {t_sizes} must lie in [1, {max_num_batched_tokens}]")
    out = []
    for t in t_sizes:
        for r in _pow2_upto(max_num_seqs):
            if r <= t:
                out.append(Bucket(tokens=t, requests=r, outputs=min(t, r * (max_spec_tokens + 1)),
                                  taps=t if taps else 0))
    return tuple(out)


def temp_bytes(programs) -> int | None:
    """The most temporary device memory any of these compiled programs needs (XLA's memory
    analysis), or None where the backend does not report it."""
    sizes = []
    for program in programs:
        size = getattr(program.memory_analysis(), "temp_size_in_bytes", None)
        if size is None:
            return None
        sizes.append(int(size))
    return max(sizes, default=None)


class CompilePolicy(enum.Enum):
    """What happens when a step needs a program that warm-up did not compile."""

    ERROR = "error"  # raise RecompilationError (tests)
    WARN = "warn"  # warn, count it in `StepRunner.recompilations`, compile and go on (serving)


class RecompilationError(RuntimeError):
    """A step needed a program outside the warmed-up bucket set."""


def enable_compilation_cache(directory: str) -> None:
    """Turn on JAX's persistent compilation cache in `directory` (for every program, at any size).

    Called by entry points with the directory from their configuration; library code never
    decides this on its own.
    """
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class StepRunner:
    """Owns the decode state on the device and one compiled step program per bucket."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, config: ModelConfig, geometry: StateGeometry,
                 buckets: Sequence[Bucket], ops: OpSet, *, return_logits: bool = False,
                 policy: CompilePolicy = CompilePolicy.ERROR, placement: Placement | None = None,
                 max_logprobs: int = 0, snapshot_slots: int = 0,
                 compiler_options: Mapping[str, str | bool | int | float] | None = None):
        """placement: run sharded on a mesh (params are placed onto their shards here, the
        state is allocated sharded, and `ops` run shard-locally where the mesh splits their
        weights: `Placement.shard_ops`); None runs on the default device.
        max_logprobs: N > 0 returns logprobs and the top N per output row (`StepOutputs`).
        snapshot_slots: N > 0 keeps a pool of N slot snapshots (each a copy of one slot's
        window and compressor rings: `save_slot` / `restore_slot`, for the prefix cache).
        compiler_options: XLA options for every step program (`Lowered.compile`), e.g.
        {"xla_gpu_autotune_level": 0}; `compile_seconds` records what each bucket cost."""
        if not buckets:
            raise ValueError("StepRunner needs at least one bucket")
        if not 0 <= max_logprobs <= config.vocab_size:
            raise ValueError(f"max_logprobs must lie in [0, {config.vocab_size}] (the vocabulary), got {max_logprobs}")
        self.config, self.geometry, self.policy = config, geometry, policy
        self.max_logprobs = max_logprobs
        self.graphdef = graphdef
        self.placement = placement
        self.buckets = tuple(sorted(set(buckets)))
        if placement is not None:
            ops = placement.shard_ops(ops)
        self.ops = ops  # what the step runs (shard-local wrappers on a mesh)
        step = make_step(graphdef, geometry, ops, return_logits=return_logits, max_logprobs=max_logprobs)
        init = lambda: init_state(config, geometry)  # noqa: E731
        self._init_state = jax.jit(init) if placement is None else None
        self.state_shardings = None  # on a mesh, the decode state's (the speculative step's too)
        if placement is None:
            self.params = params
            self.state: DecodeState = self._init_state()
            self._step = jax.jit(step, donate_argnums=(1,))
        else:
            self.params = placement.place_params(params)
            state_sh = self.state_shardings = placement.state_shardings(jax.eval_shape(init))
            self._init_state = jax.jit(init, out_shardings=state_sh)
            self.state = self._init_state()
            rep = placement.replicated()
            self._step = jax.jit(step, donate_argnums=(1,),
                                 in_shardings=(placement.param_shardings(params), state_sh, rep),
                                 out_shardings=(state_sh, rep))
        self._replicated = None if placement is None else placement.replicated()
        self._last_tokens = jax.device_put(np.zeros(geometry.num_slots, np.int32), self._replicated)
        self._compiled: dict[Bucket, Callable] = {}
        self.compiler_options = dict(compiler_options or {})
        self.compile_seconds: dict[Bucket, tuple[float, float]] = {}  # bucket -> (trace + lower, XLA compile)
        self.recompilations = 0  # programs compiled after warm-up (a serving metric)
        self._warm = False
        self.snapshot_slots = snapshot_slots
        self.snapshots: DecodeState | None = None
        if snapshot_slots:
            if placement is not None and placement.mesh_shape.get("data", 1) > 1:
                raise ValueError("slot snapshots are not supported with a data-parallel mesh")
            snap_geometry = dataclasses.replace(geometry, num_slots=snapshot_slots, num_pages=1)
            init_snaps = lambda: init_state(config, snap_geometry)  # noqa: E731
            snap_sh = None if placement is None else placement.state_shardings(jax.eval_shape(init_snaps))
            self.snapshots = jax.jit(init_snaps, out_shardings=snap_sh)()
            n, m = geometry.num_slots, snapshot_slots
            self._save = jax.jit(lambda snaps, state, slot, snap: copy_slot(snaps, snap, m, state, slot, n),
                                 donate_argnums=(0,))
            self._restore = jax.jit(lambda state, snaps, snap, slot: copy_slot(state, slot, n, snaps, snap, m),
                                    donate_argnums=(0,))

    def reset_state(self) -> None:
        """A fresh all-zero decode state (after a failed step, which may have consumed the old
        one: it is donated). Snapshots are kept: they were copies."""
        self.state = self._init_state()
        self._last_tokens = jax.device_put(np.zeros(self.geometry.num_slots, np.int32), self._replicated)

    def save_slot(self, slot: int, snapshot: int) -> None:
        """Copy slot `slot`'s rings into snapshot `snapshot` (between steps)."""
        self._check_snapshot(slot, snapshot)
        self.snapshots = self._save(self.snapshots, self.state, np.int32(slot), np.int32(snapshot))

    def restore_slot(self, snapshot: int, slot: int) -> None:
        """Copy snapshot `snapshot` into slot `slot`'s rings (between steps)."""
        self._check_snapshot(slot, snapshot)
        self.state = self._restore(self.state, self.snapshots, np.int32(snapshot), np.int32(slot))

    def _check_snapshot(self, slot: int, snapshot: int) -> None:
        if not 0 <= snapshot < self.snapshot_slots:
            raise ValueError(f"snapshot {snapshot} outside [0, {self.snapshot_slots})")
        if not 0 <= slot < self.geometry.num_slots:
            raise ValueError(f"slot {slot} outside [0, {self.geometry.num_slots})")

    def warmup(self, progress: Callable[[int, int, Bucket], None] | None = None) -> None:
        """Compile every bucket now; `progress(i, n, bucket)` is called before each compile.
        Call it before any request runs: it also compiles the slot-snapshot copies by running
        them once on slot 0 and snapshot 0 (harmless while the state is empty)."""
        for i, bucket in enumerate(self.buckets):
            if progress is not None:
                progress(i, len(self.buckets), bucket)
            self._compile(bucket)
        if self.snapshot_slots:
            self.save_slot(0, 0)
            self.restore_slot(0, 0)
        self._warm = True

    def _compile(self, bucket: Bucket) -> Callable:
        if bucket not in self._compiled:
            example = pack_batch([], bucket, self.geometry)
            with warnings.catch_warnings():
                # CPU backends cannot donate every buffer; that costs a copy, not correctness.
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                t0 = time.perf_counter()
                lowered = self._step.lower(self.params, self.state, example)
                t1 = time.perf_counter()
                self._compiled[bucket] = lowered.compile(compiler_options=self.compiler_options or None)
                self.compile_seconds[bucket] = (t1 - t0, time.perf_counter() - t1)
        return self._compiled[bucket]

    def workspace_bytes(self) -> int | None:
        """The most temporary device memory any compiled step needs (XLA's memory analysis), or
        None where the backend does not report it."""
        return temp_bytes(self._compiled.values())

    def program_text(self, bucket: Bucket) -> str:
        """The compiled step of a warmed-up bucket as HLO text (to inspect its collectives)."""
        if bucket not in self._compiled:
            raise KeyError(f"bucket {bucket} has not been compiled")
        return self._compiled[bucket].as_text()

    def bucket_for(self, n_tokens: int, n_requests: int, n_outputs: int, n_taps: int = 0) -> Bucket:
        """The smallest warmed-up bucket (fewest tokens, then requests) that fits."""
        for b in self.buckets:
            if b.tokens >= n_tokens and b.requests >= n_requests and b.outputs >= n_outputs and b.taps >= n_taps:
                return b
        raise ValueError(f"no bucket fits {n_tokens} tokens / {n_requests} requests / {n_outputs} outputs / "
                         f"{n_taps} taps; the largest is {self.buckets[-1]}")

    def run(self, chunks: Sequence[Chunk]) -> StepOutputs:
        """Run one step over `chunks` (one per request) in the smallest fitting bucket; host outputs.

        ValueError for token ids outside the vocabulary or chunks that do not fit (before
        anything runs, so the state is untouched)."""
        return self.collect(self.dispatch(chunks))

    def dispatch(self, chunks: Sequence[Chunk]) -> StepOutputs:
        """Launch one step and return at once: its outputs stay on the device (`collect` fetches
        them) while the host prepares the next step, whose chunks may refer to this step's
        sampled tokens (`Chunk.token_from_last`). Same checks as `run`."""
        v = self.config.vocab_size
        for c in chunks:
            ids = np.asarray(c.tokens)
            bad = ids[(ids < 0) | (ids >= v)]
            if bad.size:
                raise ValueError(f"slot {c.slot}: token id {int(bad[0])} is outside the vocabulary [0, {v})")
        bucket = self.bucket_for(sum(len(c.tokens) for c in chunks), len(chunks),
                                 sum(len(c.outputs) for c in chunks), sum(len(c.taps) for c in chunks))
        return self._launch(pack_batch(chunks, bucket, self.geometry))

    @staticmethod
    def collect(outputs: StepOutputs) -> StepOutputs:
        """A dispatched step's outputs on the host (numpy); waits for the device."""
        return jax.device_get(outputs)

    def run_empty(self, bucket: Bucket) -> None:
        """Run `bucket`'s program over an all-padding batch and wait: the same program over the
        same shapes as a full step (for timing it); nothing is written to the state."""
        self.run_batch(pack_batch([], bucket, self.geometry))

    def run_batch(self, batch: StepBatch) -> StepOutputs:
        """Run one step over an already packed batch; returns the outputs on the host (numpy)."""
        return self.collect(self._launch(batch))

    def _launch(self, batch: StepBatch) -> StepOutputs:
        bucket = batch.bucket
        program = self._compiled.get(bucket)
        if program is None:
            if self._warm and self.policy is CompilePolicy.ERROR:
                raise RecompilationError(f"bucket {bucket} was not compiled in warm-up "
                                         f"(warmed: {len(self._compiled)} buckets)")
            if self._warm:
                self.recompilations += 1
                warnings.warn(f"compiling step bucket {bucket} after warm-up (recompilation "
                              f"#{self.recompilations})", RuntimeWarning, stacklevel=2)
            program = self._compile(bucket)
        # Every slot's last sampled token stays on the device from step to step.
        batch = dataclasses.replace(batch, last_tokens=self._last_tokens)
        self.state, outputs = program(self.params, self.state, batch)
        self._last_tokens = outputs.last_tokens
        return outputs
