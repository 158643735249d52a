"""The decode step: ms per step, tokens/s, and the HBM-roofline ratio (XLA reference or FFI kernels).

    python -m bench.step_bench [--config flash|tiny] [--layers 4] [--decode 1,8,32,64] [--backend reference|ffi]
        [--prefill 8192,65536] [--context 4096] [--steps 20] [--warmup 3]
        [--kv-format dense|fp8] [--index-format dense|fp4|fp8] [--quantized | --dense]
        [--dtype bfloat16|float32] [--hbm-tbps 4.8] [--json PATH] [--seed 0]
        [--compilation-cache DIR] [--no-check-finite] [--deployment tp|tp_ep|dp_tp --mesh SIZES]

`--decode none` or `--prefill none` skips that kind of case.

Sharded (`--deployment` with `--mesh`, sizes in the deployment's `MESH_AXES` order: tp
`tensor`; tp_ep `tensor x expert`; dp_tp `data x tensor`; e.g. `2`, `4`, `2x2`): the step
runs on a mesh of the first prod(sizes) devices with `dsv4.sharding`'s rules table. The
jitted random init writes every parameter straight onto its shards (`out_shardings` =
the placement's parameter shardings), so no device ever holds the whole model, and
`StepRunner(..., placement=)` allocates the state sharded and keeps batch and outputs
replicated. Without `--deployment` the step runs on one device. Every JSON case, the
meta block and the BENCHMARKS.md row record the deployment and mesh; the row's command
repeats it. On the 2- and 4-GPU machines (each command fits a 10-minute limit: FLASH-width
compiles take 30-95 s each, so two decode cases a command):

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 -m bench.step_bench --decode 1,8 \
        --prefill none --steps 10 --no-check-finite --deployment tp --mesh 2   # then --decode 32,64
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 -m bench.step_bench --decode 1,8 \
        --prefill none --steps 10 --no-check-finite --deployment tp --mesh 4   # then --decode 32,64
    ... --deployment tp_ep --mesh 2x2 (4 GPUs)                                # TP x EP

and the same without `--deployment` for the one-GPU figure on the same machine. On CPU,
`JAX_NUM_CPU_DEVICES=2` gives the process two devices (smoke runs with `--config tiny`).

Collective share (sharded cases only; 0 on one device): an ESTIMATE, not a profile. After
timing a case, the compiled step's text (`runner.program_text(bucket)`) is read for
every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute (sync and
async `-start` forms; a tuple all-reduce is one op over several arrays), with its result
arrays' dtypes and shapes and its replica-group size (list, iota or mesh form of
`replica_groups`; all devices when absent) or a permute's source -> target pairs. A
collective in a while body counts its loop's `known_trip_count` times (once when XLA did
not record it; the JSON note says how many). Each distinct collective is then timed alone:
a jitted `shard_map` over the same devices laid out as [n / group, group] that runs the
matching `psum` / `all_gather` / `psum_scatter` / `all_to_all` (or `ppermute` with the
step's own pairs) on arrays of the same dtype and shape 10 times in a `fori_loop` (the
median of 5 calls / 10). Groups of consecutive devices stand in for the step's groups (on
one NVSwitch host the bandwidth is the same), an all-to-all or a gather on an undividable
dim is timed on the same bytes as one flat axis. collective_ms_estimate = sum of time x
count; collective_share = estimate / median step ms. Overlap with compute is not counted
(XLA may hide part of it) and the standalone loop has no launch gaps, so read the share as
what the step would save were its collectives free, roughly.

What runs: the one step function (`dsv4.step.StepRunner`, `--backend`'s ops: the XLA
reference, or the FFI kernels of ffi_kernels/ for attention, indexer and state writes) of a model
with the config's real widths but only `--layers` tower layers and random weights, built
directly on the device by one jitted init (no checkpoint, no host copy of the weights).
By default the weights are held as the checkpoint stores them (FP8 attention/shared
weights with E8M0 block scales, FP4 routed experts), dequantised inside the matmuls as
`quantized=True` loading does; `--dense` holds them in `--dtype` instead. The model runs
with the official KV/indexer fake quantisation on, as FLASH does. Each case gets its own
`StepRunner` whose state is sized for that case and whose only bucket is that case's,
compiled in `warmup()`; then `--warmup` untimed and `--steps` timed calls of
`runner.run(chunks)`, each a real step: host packing, the device program and the
`device_get` of the sampled tokens (no logits are fetched).

Cases:
- decode C: C requests of one token each, bucket (tokens C, requests C, outputs C). Each
  request already has `--context` committed tokens: the state is NOT filled by prefill
  (slow on the reference for 64 x 4096 tokens); the step runs on a zero state with
  `start = context + i` at step i, so it reads the same rows, as many of them, as a real
  decode at that length would. Only the state's contents are synthetic.
- prefill L: one request, a chunk of L tokens from position 0, bucket (L, 1, 1); every
  step rewrites the same positions. The reference attention, indexer and MoE work in
  tiles of queries / tokens (`dsv4/ops/*/reference.py`), so their temporaries stay
  bounded: 8192- and 65536-token chunks of 4 FLASH layers ran on one H200 (2026-11-29).
  On a GPU, let XLA use most of the memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.95; the
  default is 0.75).

Layers: the first N layers of the config's pattern. FLASH's first four (the default) are
sliding, sliding, CSA, HCA, with hash routing in layers 0-2 and score routing in layer 3,
so every attention and routing kind is timed. When a shorter prefix lacks a CSA or an HCA
layer, its last two layers become CSA, HCA; when it lacks a hash- or a score-routed MoE,
its first layer becomes hash-routed / its last score-routed. The draft stages are not
built. Hash layers get random tid2eid rows (K distinct experts per token) so their
routing spreads like a real table's.

Roofline bytes (what one ideal step must read from HBM; roofline_ms = bytes / --hbm-tbps):
- weights: every parameter except the routed experts, the embedding and tid2eid once
  (attention, indexer, compressors, shared expert, gate, mHC, norms, and the head as
  stored, not its f32 upcast); routed experts: min(E, T*K) whole experts per MoE layer
  for T tokens in the step (a decode step's C*K routed pairs spread over distinct
  experts; a long prefill touches all E); embedding and tid2eid rows of at most T
  distinct tokens.
- state (decode only): per request and layer at position p, the window ring's W-1 earlier
  rows; for CSA min(topk, n) selected compressed entries plus all n visible indexer keys;
  for HCA all n visible entries (n = (p+1) // ratio); at the bytes per row of the state's
  storage format. Compressor rings (a few f32 rows per closed entry) and all writes are
  not counted. A prefill starts from an empty state and reads none of it.
ratio = roofline_ms / measured median ms. The reference reads far more than this (it
dequantises every expert each step and gathers every candidate row of the indexer): the
ratio is the headroom the kernels are measured against.

FLOPs (reported as achieved TFLOP/s; an approximation): 2 x matmul parameters per token
(dense projections incl. gate, compressors, indexer and mHC mixes, plus K routed
experts; an FP4 byte is two parameters), 2 x (hc_head + head) per output row, attention
4*N*H*keys per token and layer (keys = min(W, p+1) window keys plus the CSA top-k or all
visible HCA entries), and indexer scoring 2*I*J*n per token of a CSA layer. Norms, RoPE,
softmaxes, Sinkhorn and compressor pooling are left out.

Output: progress lines while building and compiling (FLASH-width compiles take minutes),
one BENCHMARKS.md row per case, and with `--json` every figure. A case that runs out of
device memory is reported as OOM and the next case runs; any other failure is reported,
the remaining cases run, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import enum
import gc
import json
import math
import re
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv4.batch import Bucket, Chunk, pack_batch
from dsv4.config import FLASH, TINY, AttentionKind, ModelConfig, RoutingKind, WeightFormat
from dsv4.model import Transformer, storage_config
from dsv4.ops.registry import Backend, ops_for
from dsv4.sharding import MESH_AXES, Deployment, Placement, make_mesh, shard_map
from dsv4.state import DecodeState, EntryTable, IndexKeyFormat, KVFormat, StateGeometry, default_page_tokens, \
    init_state, tree_bytes
from dsv4.step import StepRunner, enable_compilation_cache, make_step

CONFIGS = {"flash": FLASH, "tiny": TINY}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
MAX_SPEC_TOKENS = 5  # the state is sized as a serving state with speculation would be
_KIND_NAMES = {AttentionKind.SLIDING: "S", AttentionKind.CSA: "CSA", AttentionKind.HCA: "HCA"}


class CaseKind(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmarked step shape: C decode requests of one token, or one prefill chunk of L."""

    kind: CaseKind
    size: int  # C for decode, L for prefill

    @property
    def requests(self) -> int:
        return self.size if self.kind is CaseKind.DECODE else 1

    @property
    def bucket(self) -> Bucket:
        return Bucket(tokens=self.size, requests=self.requests, outputs=self.requests)

    @property
    def name(self) -> str:
        return f"decode C{self.size}" if self.kind is CaseKind.DECODE else f"prefill {self.size}"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The command line, typed."""

    config_name: str
    layers: int
    decode: tuple[int, ...]
    prefill: tuple[int, ...]
    context: int
    steps: int
    warmup: int
    kv_format: KVFormat
    index_format: IndexKeyFormat
    quantized: bool
    dtype_name: str
    hbm_tbps: float
    json_path: str | None
    seed: int
    compilation_cache: str | None
    check_finite: bool
    deployment: Deployment | None = None  # None: one device
    mesh: tuple[int, ...] = ()  # axis sizes in MESH_AXES[deployment] order
    backend: Backend = Backend.REFERENCE

    @property
    def mesh_text(self) -> str:
        return "x".join(map(str, self.mesh))

    @property
    def mesh_axes(self) -> dict[str, int]:
        if self.deployment is None:
            return {}
        return {a.value: n for a, n in zip(MESH_AXES[self.deployment], self.mesh)}

    @property
    def cases(self) -> list[Case]:
        return ([Case(CaseKind.DECODE, c) for c in self.decode] +
                [Case(CaseKind.PREFILL, n) for n in self.prefill])


# ---- model -------------------------------------------------------------------------------------


def bench_config(base: ModelConfig, layers: int) -> ModelConfig:
    """`base` cut to its first `layers` layers (see the module docstring), FP8/FP4 weight formats
    and fake quantisation on, no draft stages."""
    if not 2 <= layers <= base.num_hidden_layers:
        raise ValueError(f"--layers must lie in [2, {base.num_hidden_layers}] (one CSA and one HCA layer), "
                         f"got {layers}")
    kinds = list(base.layer_types[:layers])
    if AttentionKind.CSA not in kinds or AttentionKind.HCA not in kinds:
        kinds[-2:] = [AttentionKind.CSA, AttentionKind.HCA]
    routing = list(base.mlp_layer_types[:layers])
    if RoutingKind.HASH not in routing:
        routing[0] = RoutingKind.HASH
    if RoutingKind.SCORE not in routing:
        routing[-1] = RoutingKind.SCORE
    return base.replace(num_hidden_layers=layers, layer_types=tuple(kinds), mlp_layer_types=tuple(routing),
                        weight_format=WeightFormat.FP8, expert_format=WeightFormat.FP4, fake_quant=True,
                        num_draft_stages=0, dspark_block_size=0, dspark_target_layer_ids=())


def build_params(cfg: ModelConfig, dtype, seed: int,
                 placement: Placement | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """Random parameters made on the device by one jitted init: the weights never visit the host.
    With a placement the init's outputs are the parameters' shards: no device holds the whole model."""

    def make() -> Transformer:
        return Transformer(cfg, param_dtype=dtype, rngs=nnx.Rngs(seed))

    def init() -> nnx.State:
        _, state = nnx.split(make())
        key = jax.random.key(seed + 1)
        flat = []
        for i, (path, var) in enumerate(nnx.to_flat_state(state)):
            if path[-1] == "tid2eid":  # zeros would send every token to expert 0
                noise = jax.random.uniform(jax.random.fold_in(key, i), (cfg.vocab_size, cfg.n_routed_experts))
                var = var.replace(jax.lax.top_k(noise, cfg.num_experts_per_tok)[1].astype(jnp.int32))
            flat.append((path, var))
        return nnx.from_flat_state(flat)

    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    if placement is None:
        return graphdef, jax.jit(init)()
    return graphdef, jax.jit(init, out_shardings=placement.param_shardings(abstract))()


@dataclasses.dataclass(frozen=True)
class WeightSummary:
    """The model's bytes and matmul parameters, split by how a step touches them."""

    total_bytes: int
    fixed_bytes: int  # read whole by every step
    expert_bytes: int  # one routed expert of one MoE layer (w1, w3, w2 with scales)
    moe_layers: int
    row_bytes: int  # one token's embedding row and tid2eid rows
    token_params: int  # matmul parameters every token goes through (routed experts and head excluded)
    expert_params: int  # matmul parameters of one routed expert
    output_params: int  # matmul parameters per output row (hc_head mix and head)

    def step_bytes(self, cfg: ModelConfig, tokens: int) -> int:
        """Weight bytes one ideal step of `tokens` tokens reads (module docstring)."""
        experts = min(cfg.n_routed_experts, tokens * cfg.num_experts_per_tok)
        return (self.fixed_bytes + self.moe_layers * experts * self.expert_bytes
                + min(cfg.vocab_size, tokens) * self.row_bytes)


def weight_summary(params: nnx.State, cfg: ModelConfig) -> WeightSummary:
    acc: collections.Counter = collections.Counter()
    for path, var in nnx.to_flat_state(params):
        x = var.get_value()
        names = [str(p) for p in path]
        nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        n_params = math.prod(x.shape) * (2 if np.dtype(x.dtype) == np.int8 else 1)  # FP4: two per byte
        routed = "experts" in names and names[names.index("experts") - 1] == "ffn"
        matmul = ((names[-1] == "weight" and len(x.shape) >= 2 and names[0] != "embed")
                  or (names[-1].startswith("hc_") and names[-1].endswith("_fn")))
        acc["total"] += nbytes
        if routed:
            acc["experts"] += nbytes
            acc["expert_params"] += n_params if matmul else 0
        elif names[0] == "embed" or names[-1] == "tid2eid":
            acc["rows"] += nbytes
        else:
            acc["fixed"] += nbytes
        if matmul and not routed:
            acc["output_params" if names[0] in ("head", "hc_head_fn") else "token_params"] += n_params
    per_expert = cfg.n_routed_experts * cfg.num_hidden_layers
    return WeightSummary(total_bytes=acc["total"], fixed_bytes=acc["fixed"], expert_bytes=acc["experts"] // per_expert,
                         moe_layers=cfg.num_hidden_layers, row_bytes=acc["rows"] // cfg.vocab_size,
                         token_params=acc["token_params"], expert_params=acc["expert_params"] // per_expert,
                         output_params=acc["output_params"])


# ---- roofline ----------------------------------------------------------------------------------


def _row_bytes(table: EntryTable) -> int:
    return sum(math.prod(a.shape[1:]) * np.dtype(a.dtype).itemsize for a in table.arrays)


def state_read_bytes(cfg: ModelConfig, state: DecodeState, positions: np.ndarray) -> int:
    """State bytes the decode tokens at `positions` must read (module docstring); `state` may be abstract."""
    p = positions.astype(np.int64)
    total = 0
    for layer, st in enumerate(state):
        total += int(np.minimum(cfg.sliding_window - 1, p).sum()) * _row_bytes(st.window)
        kind = cfg.layer_types[layer]
        if kind is AttentionKind.SLIDING:
            continue
        n = (p + 1) // cfg.compress_ratio(layer)
        if kind is AttentionKind.CSA:
            total += int(np.minimum(cfg.index_topk, n).sum()) * _row_bytes(st.compressed)
            total += int(n.sum()) * _row_bytes(st.index_keys)
        else:
            total += int(n.sum()) * _row_bytes(st.compressed)
    return total


def step_flops(cfg: ModelConfig, weights: WeightSummary, positions: np.ndarray, outputs: int) -> float:
    """Approximate FLOPs of a step over tokens at `positions` with `outputs` sampled rows (module docstring)."""
    p = positions.astype(np.int64)
    t = len(p)
    flops = 2.0 * t * (weights.token_params + cfg.num_experts_per_tok * weights.expert_params)
    flops += 2.0 * outputs * weights.output_params
    for layer, kind in enumerate(cfg.layer_types):
        keys = np.minimum(cfg.sliding_window, p + 1)
        if kind is not AttentionKind.SLIDING:
            n = (p + 1) // cfg.compress_ratio(layer)
            keys = keys + (np.minimum(cfg.index_topk, n) if kind is AttentionKind.CSA else n)
            if kind is AttentionKind.CSA:
                flops += 2.0 * cfg.index_n_heads * cfg.index_head_dim * float(n.sum())
        flops += 4.0 * cfg.num_attention_heads * cfg.head_dim * float(keys.sum())
    return flops


# ---- collectives -------------------------------------------------------------------------------

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
COLLECTIVE_NOTE = ("estimate: each collective of the compiled step timed alone on the same devices, times how "
                   "often the step runs it; no overlap with compute counted (XLA may hide part of it)")
_HLO_DTYPES = {"pred": np.uint8, "s8": np.int8, "u8": np.uint8, "s16": np.int16, "u16": np.uint16,
               "s32": np.int32, "u32": np.uint32, "s64": np.int64, "u64": np.uint64, "f16": np.float16,
               "bf16": jnp.bfloat16, "f32": np.float32, "f64": np.float64, "f8e4m3fn": jnp.float8_e4m3fn,
               "f8e5m2": jnp.float8_e5m2}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVE_OPS)
                    + r")(-start)?\((.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One distinct collective of a compiled program: op, result arrays, devices per group."""

    op: str  # all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    arrays: tuple[tuple[str, tuple[int, ...]], ...]  # (HLO dtype, dims) of each result
    group: int  # devices in each replica group
    dimension: int | None = None  # gathered / scattered / exchanged dim
    pairs: tuple[tuple[int, int], ...] = ()  # collective-permute source -> target

    @property
    def bytes(self) -> int:
        return sum(math.prod(d) * np.dtype(_HLO_DTYPES.get(t, np.uint8)).itemsize for t, d in self.arrays)

    def describe(self) -> str:
        arrays = ", ".join(f"{t}[{','.join(map(str, d))}]" for t, d in self.arrays)
        where = f"pairs {list(self.pairs)}" if self.op == "collective-permute" else f"groups of {self.group}"
        return f"{self.op} {arrays} ({where})"


def _group_size(attrs: str, n_devices: int) -> int:
    """Devices per replica group from an HLO attribute string (list, iota or mesh form); all if absent."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        names = re.findall(r"'([^']+)'", m.group(2))
        if names and all(n in sizes for n in names):
            return math.prod(sizes[n] for n in names)
        return n_devices
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    return n_devices


def _computation_multipliers(hlo: str) -> tuple[dict[str, int], set[str]]:
    """How many times one run of the program runs each computation (while bodies times their
    known trip count), and the computations under a loop whose trip count XLA did not record."""
    calls: dict[str, list[tuple[str, int, bool]]] = collections.defaultdict(list)
    entry, comp = None, None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)", line)
            comp = m.group(2) if m else None
            if m and m.group(1):
                entry = comp
            continue
        if comp is None or "=" not in line:
            continue
        body = re.search(r"\bbody=%?([\w.\-]+)", line)
        if body:
            trips = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', line)
            calls[comp].append((body.group(1), int(trips.group(1)) if trips else 1, trips is None))
        for attr in re.finditer(r"\b(?:calls|to_apply|condition|true_computation|false_computation)=%?([\w.\-]+)",
                                line):
            calls[comp].append((attr.group(1), 1, False))
        for group in re.finditer(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}", line):
            for name in re.findall(r"%?([\w.\-]+)", group.group(1)):
                calls[comp].append((name, 1, False))
    mult: dict[str, int] = collections.Counter()
    unknown: set[str] = set()
    if entry is None:
        return mult, unknown

    def visit(name: str, times: int, in_unknown_loop: bool, depth: int) -> None:
        if depth > 64:
            return
        mult[name] += times
        if in_unknown_loop:
            unknown.add(name)
        for callee, k, unknown_trips in calls.get(name, ()):
            visit(callee, times * k, in_unknown_loop or unknown_trips, depth + 1)

    visit(entry, 1, False, 0)
    return mult, unknown


def parse_collectives(hlo: str, n_devices: int) -> tuple[collections.Counter, int]:
    """Distinct collectives of a compiled program's text -> times one run performs each, and how
    many of those sit in a loop of unknown trip count (counted once per iteration-less pass).

    Handles `-start` async forms (all-gather-start / collective-permute-start list operands, then
    results, then u32 contexts: the results are kept) and tuple all-reduces (one op, several arrays).
    """
    mult, unknown_comps = _computation_multipliers(hlo)
    found: collections.Counter = collections.Counter()
    in_unknown = 0
    comp = None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)", line)
            comp = m.group(2) if m else None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        shape_text, op, start, attrs = m.groups()
        arrays = [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape_text)]
        if start and op in ("all-gather", "collective-permute"):
            arrays = [a for a in arrays if not (a[0] in ("u32", "s32") and a[1] == ())]
            arrays = arrays[len(arrays) // 2:]
        if not arrays:
            continue
        dim = re.search(r"\bdimensions=\{(\d+)", attrs)
        pairs = ()
        if op == "collective-permute":
            seg = re.search(r"source_target_pairs=\{(.*?\})\}", attrs)
            pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", seg.group(1) if seg else ""))
        c = Collective(op=op, arrays=tuple(arrays), group=n_devices if pairs else _group_size(attrs, n_devices),
                       dimension=int(dim.group(1)) if dim else None, pairs=pairs)
        times = max(1, mult.get(comp, 1)) if comp is not None else 1
        found[c] += times
        if comp in unknown_comps:
            in_unknown += times
    return found, in_unknown


def _standalone_collective(c: Collective, devices: Sequence, reps: int):
    """A jitted program running collective `c` `reps` times in a loop on `devices`, and its input.

    The devices are laid out as [n / group, group] and the collective runs over the second axis
    (groups of consecutive devices, which on one NVSwitch host costs as the step's groups do);
    a collective-permute runs the step's own source -> target pairs over all devices. Each
    iteration feeds the last result back (a slice / in-place update where the shape changes)."""
    n = len(devices)
    if c.op == "collective-permute":
        mesh = Mesh(np.asarray(devices).reshape(n), ("c",))
        spec = PartitionSpec("c")
    else:
        g = c.group if c.group >= 1 and n % c.group == 0 else n
        mesh = Mesh(np.asarray(devices).reshape(n // g, g), ("rest", "c"))
        spec = PartitionSpec(("rest", "c"))
    g = mesh.shape["c"]
    dtypes = [_HLO_DTYPES[t] for t, _ in c.arrays]
    flat = c.op == "all-to-all" or (c.op in ("all-gather", "reduce-scatter") and (
        c.dimension is None or any(c.dimension >= len(d) or (c.op == "all-gather" and d[c.dimension] % g)
                                   for _, d in c.arrays)))
    if flat:  # same bytes, exchanged along one flat axis
        local = [(-(-max(1, math.prod(d)) // g) * g,) for _, d in c.arrays]
        dim = 0
    else:
        local = [d for _, d in c.arrays]
        dim = c.dimension
    if c.op == "all-gather":
        inputs = [tuple(s // g if i == dim else s for i, s in enumerate(d)) for d in local]
    elif c.op == "reduce-scatter":
        inputs = [tuple(s * g if i == dim else s for i, s in enumerate(d)) for d in local]
    else:
        inputs = local

    def once(xs):
        if c.op == "all-reduce":
            return tuple(jax.lax.psum(xs, "c"))
        if c.op == "all-gather":
            ys = [jax.lax.all_gather(x, "c", axis=dim + 1, tiled=True) for x in xs]
            return tuple(jax.lax.slice_in_dim(y, 0, x.shape[dim + 1], axis=dim + 1) for x, y in zip(xs, ys))
        if c.op == "reduce-scatter":
            ys = [jax.lax.psum_scatter(x, "c", scatter_dimension=dim + 1, tiled=True) for x in xs]
            return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis=dim + 1) for x, y in zip(xs, ys))
        if c.op == "all-to-all":
            return tuple(jax.lax.all_to_all(x, "c", 1, 1, tiled=True) for x in xs)
        return tuple(jax.lax.ppermute(x, "c", perm=list(c.pairs)) for x in xs)

    def loop(*xs):
        return jax.lax.fori_loop(0, reps, lambda i, carry: once(carry), tuple(xs))

    specs = tuple(spec for _ in inputs)
    program = jax.jit(shard_map(loop, mesh, specs, specs))
    sharding = NamedSharding(mesh, spec)
    make = jax.jit(lambda: tuple(
        jax.random.uniform(jax.random.key(i), (n,) + s, jnp.float32).astype(t) if jnp.issubdtype(t, jnp.floating)
        else (jnp.arange(n * max(1, math.prod(s))) % 7).astype(t).reshape((n,) + s)
        for i, (s, t) in enumerate(zip(inputs, dtypes))), out_shardings=tuple(sharding for _ in inputs))
    return program, make()


def time_collective(c: Collective, devices: Sequence, reps: int = 10, trials: int = 5) -> float:
    """Median ms of one run of collective `c` alone (a loop of `reps`, timed `trials` times)."""
    program, args = _standalone_collective(c, devices, reps)
    jax.block_until_ready(program(*args))
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) / reps * 1e3


def collective_figures(hlo: str | None, devices: Sequence, step_ms: float, cache: dict, log, name: str) -> dict:
    """The collective estimate of one case (module docstring); zero on one device."""
    if hlo is None or len(devices) < 2:
        return dict(collective_count=0, collective_ms_estimate=0.0, collective_share=0.0, collectives=[],
                    collective_note="one device: no collectives")
    found, in_unknown = parse_collectives(hlo, len(devices))
    log(f"{name}: {sum(found.values())} collectives ({len(found)} distinct) in the compiled step; "
        f"timing each alone ...")
    rows, total, untimed = [], 0.0, 0
    for c, count in sorted(found.items(), key=lambda kv: -kv[0].bytes * kv[1]):
        if c not in cache:
            try:
                cache[c] = time_collective(c, devices)
            except Exception as e:  # noqa: BLE001 - one untimed collective does not sink the case
                log(f"{name}: could not time {c.describe()}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                cache[c] = None
        ms = cache[c]
        if ms is None:
            untimed += count
        else:
            total += ms * count
        rows.append(dict(collective=c.describe(), op=c.op, arrays=[f"{t}[{','.join(map(str, d))}]" for t, d in c.arrays],
                         group=c.group, bytes=c.bytes, count=count, ms_each=ms,
                         ms_total=None if ms is None else ms * count))
    note = COLLECTIVE_NOTE
    if in_unknown:
        note += f"; {in_unknown} sit in loops of unknown trip count (counted once per pass)"
    if untimed:
        note += f"; {untimed} could not be timed (left out)"
    return dict(collective_count=int(sum(found.values())), collective_ms_estimate=total,
                collective_share=total / step_ms if step_ms > 0 else float("nan"), collectives=rows,
                collective_note=note)


# ---- one case ----------------------------------------------------------------------------------


def geometry_for(cfg: ModelConfig, case: Case, s: Settings) -> StateGeometry:
    """State for exactly this case: C slots (or 1), pages for every position it will write."""
    page = default_page_tokens(cfg)
    # Decode: warm-up, timed and finiteness-check steps each advance one position.
    max_len = s.context + s.warmup + s.steps + 1 if case.kind is CaseKind.DECODE else case.size
    per_seq = math.ceil(max_len / page)
    return StateGeometry(num_slots=case.requests, num_pages=case.requests * per_seq, page_tokens=page,
                         max_pages_per_seq=per_seq, max_spec_tokens=MAX_SPEC_TOKENS, kv_format=s.kv_format,
                         index_format=s.index_format, dtype=DTYPES[s.dtype_name])


def chunks_for(case: Case, step: int, s: Settings, geometry: StateGeometry, tokens: np.ndarray) -> list[Chunk]:
    """Step `step`'s chunks: decode request r at position context + step; the prefill chunk at 0.

    `tokens` is [steps, C] for decode, [L] for prefill.
    """
    n = geometry.max_pages_per_seq
    if case.kind is CaseKind.PREFILL:
        return [Chunk(slot=0, start=0, tokens=tokens.tolist(), pages=list(range(n)), outputs=[case.size - 1])]
    row = tokens[step].tolist()
    return [Chunk(slot=r, start=s.context + step, tokens=[row[r]], pages=list(range(r * n, (r + 1) * n)),
                  outputs=[0]) for r in range(case.requests)]


def _timed_positions(case: Case, s: Settings, step: int) -> np.ndarray:
    if case.kind is CaseKind.PREFILL:
        return np.arange(case.size)
    return np.full(case.requests, s.context + step)


def logits_finite(runner: StepRunner, graphdef: nnx.GraphDef, batch) -> bool:
    """Whether one step's logits are all finite (a separate, non-donating program)."""
    step = make_step(graphdef, runner.geometry, runner.ops, return_logits=True)
    check = jax.jit(lambda params, state, b: jnp.all(jnp.isfinite(step(params, state, b)[1].logits)))
    return bool(check(runner.params, runner.state, batch))


def time_case(case: Case, cfg: ModelConfig, graphdef: nnx.GraphDef, params: nnx.State, s: Settings,
              check_finite: bool, log, placement: Placement | None = None) -> dict:
    """Compile, warm up and time one case; returns the raw timings, state size and (sharded) the
    compiled program's text."""
    geometry = geometry_for(cfg, case, s)
    state_shapes = jax.eval_shape(lambda: init_state(cfg, geometry))
    rng = np.random.default_rng(s.seed)
    n_steps = s.warmup + s.steps + 1
    tokens = (rng.integers(0, cfg.vocab_size, (n_steps, case.requests)) if case.kind is CaseKind.DECODE
              else rng.integers(0, cfg.vocab_size, case.size))
    log(f"{case.name}: state {tree_bytes(state_shapes) / 2**20:.1f} MiB ({geometry.num_pages} pages of "
        f"{geometry.page_tokens}); compiling bucket {case.bucket} ...")
    runner = StepRunner(graphdef, params, cfg, geometry, [case.bucket], ops_for(s.backend), placement=placement)
    t0 = time.perf_counter()
    runner.warmup()
    compile_s = time.perf_counter() - t0
    log(f"{case.name}: compiled in {compile_s:.1f} s; {s.warmup} warm-up + {s.steps} timed steps")
    times = []
    for i in range(s.warmup + s.steps):
        chunks = chunks_for(case, i, s, geometry, tokens)
        t = time.perf_counter()
        runner.run(chunks)
        if i >= s.warmup:
            times.append(time.perf_counter() - t)
    finite = None
    if check_finite:
        log(f"{case.name}: compiling a logits program once to check the logits are finite ...")
        last = chunks_for(case, s.warmup + s.steps, s, geometry, tokens)
        finite = logits_finite(runner, graphdef, pack_batch(last, case.bucket, geometry))
        log(f"{case.name}: logits finite: {finite}")
    hlo = runner.program_text(case.bucket) if placement is not None else None
    return dict(state_shapes=state_shapes, compile_s=compile_s, times=np.array(times), logits_finite=finite,
                hlo=hlo)


def case_figures(case: Case, cfg: ModelConfig, weights: WeightSummary, s: Settings, timing: dict) -> dict:
    """Median/p90 ms, tokens/s, roofline bytes and ratio, TFLOP/s of a timed case."""
    ms = timing["times"] * 1e3
    median = float(np.median(ms))
    steps = range(s.warmup, s.warmup + s.steps)
    w_bytes = weights.step_bytes(cfg, case.size)
    st_bytes = 0.0 if case.kind is CaseKind.PREFILL else float(np.mean(
        [state_read_bytes(cfg, timing["state_shapes"], _timed_positions(case, s, i)) for i in steps]))
    flops = float(np.mean([step_flops(cfg, weights, _timed_positions(case, s, i), case.requests) for i in steps]))
    roofline_ms = (w_bytes + st_bytes) / (s.hbm_tbps * 1e12) * 1e3
    return dict(
        case=case.name, kind=case.kind.value, tokens_per_step=case.size, requests=case.requests,
        context=s.context if case.kind is CaseKind.DECODE else 0, status="ok",
        deployment=s.deployment.value if s.deployment else None, mesh=s.mesh_axes, devices=max(1, math.prod(s.mesh)),
        compile_s=round(timing["compile_s"], 2), ms_median=median, ms_p90=float(np.percentile(ms, 90)),
        ms_min=float(np.min(ms)), tokens_per_s=case.size / (median * 1e-3),
        weight_bytes=w_bytes, weight_bytes_all_experts=weights.total_bytes, state_bytes=st_bytes,
        roofline_ms=roofline_ms, roofline_ratio=roofline_ms / median,
        flops=flops, tflops=flops / (median * 1e-3) / 1e12, logits_finite=timing["logits_finite"])


def _is_oom(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def run_case(case: Case, cfg: ModelConfig, graphdef, params, weights: WeightSummary, s: Settings,
             check_finite: bool, log, placement: Placement | None = None,
             collective_cache: dict | None = None) -> dict:
    """One case's figures, or its OOM / error status (the next case still runs)."""
    try:
        timing = time_case(case, cfg, graphdef, params, s, check_finite, log, placement)
        result = case_figures(case, cfg, weights, s, timing)
        devices = list(placement.mesh.devices.flat) if placement is not None else jax.devices()[:1]
        result.update(collective_figures(timing["hlo"], devices, result["ms_median"],
                                         {} if collective_cache is None else collective_cache, log, case.name))
        if placement is not None:
            log(f"{case.name}: collectives ~{result['collective_ms_estimate']:.4g} ms of "
                f"{result['ms_median']:.4g} ms ({result['collective_share']:.1%}; an estimate: each timed alone, "
                f"no overlap counted)")
        return result
    except Exception as e:  # noqa: BLE001 - reported per case, the run goes on
        status = "OOM" if _is_oom(e) else f"error: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log(f"{case.name}: {status}")
        return dict(case=case.name, kind=case.kind.value, tokens_per_step=case.size, requests=case.requests,
                    deployment=s.deployment.value if s.deployment else None, mesh=s.mesh_axes, status=status)
    finally:
        gc.collect()  # drop the case's runner and state before the next one allocates


# ---- report ------------------------------------------------------------------------------------


def case_command(case: Case, s: Settings) -> str:
    """The command that repeats one case (defaults left out)."""
    parts = ["python -m bench.step_bench", f"--config {s.config_name}", f"--layers {s.layers}"]
    if case.kind is CaseKind.DECODE:
        parts += [f"--decode {case.size}", "--prefill none", f"--context {s.context}"]
    else:
        parts += ["--decode none", f"--prefill {case.size}"]
    for flag, value, default in (("--steps", s.steps, 20), ("--warmup", s.warmup, 3),
                                 ("--kv-format", s.kv_format.value, "dense"),
                                 ("--index-format", s.index_format.value, "dense"),
                                 ("--dtype", s.dtype_name, "bfloat16"), ("--hbm-tbps", s.hbm_tbps, 4.8)):
        if value != default:
            parts.append(f"{flag} {value}")
    if not s.quantized:
        parts.append("--dense")
    if s.backend is not Backend.REFERENCE:
        parts.append(f"--backend {s.backend.value}")
    if s.deployment is not None:
        parts += [f"--deployment {s.deployment.value}", f"--mesh {s.mesh_text}"]
    return " ".join(parts)


def markdown_row(result: dict, meta: dict, case: Case, s: Settings) -> str:
    """A BENCHMARKS.md row: | date | device | command | what | figure | ratio |."""
    weights = "FP8/FP4 weights" if s.quantized else f"{s.dtype_name} weights"
    kind = "XLA reference step" if s.backend is Backend.REFERENCE else f"{s.backend.value.upper()} step"
    what = (f"{kind}, {s.config_name.upper()} width, {s.layers} layers ({meta['layer_types']}), "
            f"{weights}, KV {s.kv_format.value}, index {s.index_format.value}: ")
    what += (f"decode C{case.size} at context {s.context} (synthetic state)" if case.kind is CaseKind.DECODE
             else f"prefill chunk {case.size}")
    if s.deployment is not None:
        what += f", sharded {s.deployment.value.upper()} on mesh " + " x ".join(f"{a}={n}" for a, n in s.mesh_axes.items())
    if result["status"] != "ok":
        figure, ratio = result["status"], "-"
    else:
        figure = (f"{result['ms_median']:.4g} ms/step (p90 {result['ms_p90']:.4g}), "
                  f"{result['tokens_per_s']:.4g} tok/s, {result['tflops']:.3g} TFLOP/s")
        ratio = (f"{result['roofline_ratio']:.3g} of HBM roofline ({result['roofline_ms']:.4g} ms = "
                 f"{(result['weight_bytes'] + result['state_bytes']) / 1e9:.4g} GB / {s.hbm_tbps} TB/s)")
        if s.deployment is not None:
            figure += (f"; collectives ~{result['collective_ms_estimate']:.3g} ms = "
                       f"{result['collective_share']:.1%} of the step ({result['collective_count']} per step, "
                       f"timed alone, no overlap counted)")
    device = f"{meta['device']} (jax {meta['jax_version']})"
    if meta["devices"] > 1:
        device = f"{meta['devices']}x {device}"
    return f"| {meta['date']} | {device} | `{case_command(case, s)}` | {what} | {figure} | {ratio} |"


# ---- command line ------------------------------------------------------------------------------


def _sizes(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    sizes = tuple(int(x) for x in text.split(","))
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return sizes


def _mesh(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes sizes like 2, 4 or 2x2, got {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"mesh sizes must be >= 1, got {text!r}")
    return sizes


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m bench.step_bench", description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="flash", help="model widths (tiny: CPU smoke runs)")
    p.add_argument("--layers", type=int, default=4, help="tower layers (the first N of the pattern)")
    p.add_argument("--decode", type=_sizes, default=(1, 8, 32, 64), help="decode concurrencies, or 'none'")
    p.add_argument("--prefill", type=_sizes, default=(8192, 65536), help="prefill chunk lengths, or 'none'")
    p.add_argument("--context", type=int, default=4096, help="committed length of each decode request")
    p.add_argument("--steps", type=int, default=20, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per case after compiling")
    p.add_argument("--kv-format", choices=[f.value for f in KVFormat], default="dense")
    p.add_argument("--index-format", choices=[f.value for f in IndexKeyFormat], default="dense")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quantized", dest="quantized", action="store_true", default=True,
                   help="FP8 attention/shared and FP4 routed-expert weights kept packed (default)")
    g.add_argument("--dense", dest="quantized", action="store_false", help="all weights dense in --dtype")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="activations and dense weights")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth of the roofline, TB/s (H200: 4.8)")
    p.add_argument("--json", dest="json_path", default=None, help="write every figure to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=[b.value for b in Backend], default=Backend.REFERENCE.value,
                   help="the step's ops: the XLA reference or the FFI kernels")
    p.add_argument("--compilation-cache", default=None, help="persistent JAX compilation cache directory")
    p.add_argument("--check-finite", action=argparse.BooleanOptionalAction, default=True,
                   help="compile one extra logits program for the first case and check its logits are finite")
    p.add_argument("--deployment", choices=[d.value for d in Deployment], default=None,
                   help="run the step sharded with this rules table (default: one device)")
    p.add_argument("--mesh", type=_mesh, default=None,
                   help="mesh axis sizes in the deployment's axis order, e.g. 2, 4 or 2x2 "
                        "(tp: tensor; tp_ep: tensor x expert; dp_tp: data x tensor)")
    a = p.parse_args(argv)
    deployment = Deployment(a.deployment) if a.deployment else None
    if (deployment is None) != (a.mesh is None):
        p.error("--deployment and --mesh go together")
    if deployment is not None and len(a.mesh) != len(MESH_AXES[deployment]):
        p.error(f"--deployment {deployment.value} needs {len(MESH_AXES[deployment])} mesh sizes "
                f"({'x'.join(x.value for x in MESH_AXES[deployment])}), got {a.mesh}")
    if a.steps < 1 or a.warmup < 0 or a.context < 0:
        p.error("--steps must be >= 1, --warmup and --context >= 0")
    if not a.decode and not a.prefill:
        p.error("nothing to run: --decode and --prefill are both empty")
    return Settings(config_name=a.config, layers=a.layers, decode=a.decode, prefill=a.prefill, context=a.context,
                    steps=a.steps, warmup=a.warmup, kv_format=KVFormat(a.kv_format),
                    index_format=IndexKeyFormat(a.index_format), quantized=a.quantized, dtype_name=a.dtype,
                    hbm_tbps=a.hbm_tbps, json_path=a.json_path, seed=a.seed,
                    compilation_cache=a.compilation_cache, check_finite=a.check_finite, deployment=deployment,
                    mesh=a.mesh or (), backend=Backend(a.backend))


def _log(msg: str) -> None:
    print(f"[step_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run every case; print progress and BENCHMARKS.md rows; return (and optionally write) the results."""
    s = parse_args(argv)
    if s.compilation_cache:
        enable_compilation_cache(s.compilation_cache)
    cfg = storage_config(bench_config(CONFIGS[s.config_name], s.layers), s.quantized)
    _log(f"jax.devices(): {jax.devices()}")
    placement = None
    if s.deployment is not None:
        placement = Placement(make_mesh(s.deployment, s.mesh), s.deployment)
    meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind,
                platform=jax.devices()[0].platform, jax_version=jax.__version__, config=s.config_name,
                layers=s.layers, layer_types=",".join(_KIND_NAMES[k] for k in cfg.layer_types),
                mlp_layer_types=",".join(k.name.lower() for k in cfg.mlp_layer_types), quantized=s.quantized,
                dtype=s.dtype_name, kv_format=s.kv_format.value, index_format=s.index_format.value,
                backend=s.backend.value,
                context=s.context, steps=s.steps, warmup=s.warmup, hbm_tbps=s.hbm_tbps,
                page_tokens=default_page_tokens(cfg), max_spec_tokens=MAX_SPEC_TOKENS,
                state="decode state contents synthetic (zero state, start = context + step)",
                deployment=s.deployment.value if s.deployment else None, mesh=s.mesh_axes,
                devices=max(1, math.prod(s.mesh)), collective_note=COLLECTIVE_NOTE if s.deployment else None)
    _log(f"device {meta['device']}, jax {meta['jax_version']}; {s.config_name} width, layers {meta['layer_types']} "
         f"(routing {meta['mlp_layer_types']}), {'FP8/FP4' if s.quantized else s.dtype_name} weights; "
         + (f"sharded {s.deployment.value} on mesh {s.mesh_axes}" if placement else "one device"))
    t0 = time.perf_counter()
    graphdef, params = build_params(cfg, DTYPES[s.dtype_name], s.seed, placement)
    jax.block_until_ready(params)
    weights = weight_summary(params, cfg)
    meta["param_bytes"] = weights.total_bytes
    per_device: collections.Counter = collections.Counter()
    for x in jax.tree_util.tree_leaves(params):
        for shard in x.addressable_shards:
            per_device[str(shard.device)] += shard.data.nbytes
    meta["param_bytes_per_device_max"] = max(per_device.values())
    if placement is not None:
        _log(f"parameters on their shards: at most {meta['param_bytes_per_device_max'] / 1e9:.4g} GB on one device "
             f"of {weights.total_bytes / 1e9:.4g} GB")
    _log(f"built random parameters on the device in {time.perf_counter() - t0:.1f} s: "
         f"{weights.total_bytes / 1e9:.4g} GB ({weights.fixed_bytes / 1e9:.4g} GB read whole per step, "
         f"{weights.expert_bytes / 1e6:.4g} MB per routed expert)")
    results, rows, check, collective_cache = [], [], s.check_finite, {}
    for case in s.cases:
        result = run_case(case, cfg, graphdef, params, weights, s, check, _log, placement, collective_cache)
        check = check and result["status"] != "ok"  # checked once, on the first case that ran
        results.append(result)
        rows.append(markdown_row(result, meta, case, s))
        _log(rows[-1])
        if s.json_path:  # after every case, so a run cut short by a time limit keeps what it measured
            with open(s.json_path, "w") as f:
                json.dump(dict(meta=meta, cases=results), f, indent=2)
    print("\n| date | device | command | what | figure | ratio |\n|---|---|---|---|---|---|", flush=True)
    print("\n".join(rows), flush=True)
    if s.json_path:
        _log(f"wrote {s.json_path}")
    return dict(meta=meta, cases=results)


if __name__ == "__main__":
    results = main()
    sys.exit(0 if all(r["status"] in ("ok", "OOM") for r in results["cases"]) else 1)
