"""What an engine for a `ServingConfig` will hold, worked out without weights or devices.

`engine_plan` gives the decode state's shape (slots, pages, speculation depth, prefix-cache
snapshots) and the static buckets that `serving.config.make_engine` compiles; `dry_run`
reports it for a checkpoint directory together with the parameter bytes each device of the
configured mesh receives and, given a device size, the memory plan (`dsv4.memory`): the
servers' and the CLI's `--dry-run`, which reads the checkpoint's config.json only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dsv4.config import ModelConfig
    from dsv4.state import StateGeometry
    from dsv4.step import Bucket
    from serving.config import ServingConfig

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """The decode state and buckets of an engine (before the memory plan sets num_pages).

    template: the state for max_num_seqs full-length requests; slots: max_num_seqs rounded up
    to whole data shards; spec_tokens: drafts verified per request and step (K, 0 without
    speculation); snapshots: ring snapshots of the prefix cache (0 when it is off).
    """

    template: StateGeometry
    buckets: tuple[Bucket, ...]
    data_shards: int
    spec_tokens: int
    prefix_caching: bool
    snapshots: int

    @property
    def slots(self) -> int:
        return self.template.num_slots


def engine_plan(cfg: ModelConfig, config: ServingConfig, *, draft_block_size: int | None, data_shards: int,
                dtype: np.dtype) -> EnginePlan:
    """The plan for `cfg` served with `config`. draft_block_size: the loaded draft head's block
    (None without speculation). ValueError for a config the model cannot serve."""
    from dsv4.state import StateGeometry, default_page_tokens
    from dsv4.step import make_buckets

    k = (config.num_speculative_tokens or draft_block_size) if draft_block_size is not None else 0
    if draft_block_size is not None and k > draft_block_size:
        raise ValueError(f"num_speculative_tokens {k} exceeds the draft head's block size {draft_block_size}")
    if config.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    page = default_page_tokens(cfg)
    per_seq = math.ceil(config.max_model_len / page)
    slots = math.ceil(config.max_num_seqs / data_shards) * data_shards
    caching = config.enable_prefix_caching and data_shards == 1
    snapshots = (config.prefix_cache_snapshots or 4 * slots) if caching else 0
    template = StateGeometry(num_slots=slots, num_pages=slots * per_seq, page_tokens=page, max_pages_per_seq=per_seq,
                             max_spec_tokens=k, dtype=dtype)
    # Decode-only steps need at most `slots` x (K + 1) tokens; any step with a prefill chunk
    # takes the whole budget: few programs to compile, little padding where it matters.
    decode = slots * (k + 1)
    sizes = list(config.bucket_tokens) or sorted(
        {1 << i for i in range(decode.bit_length()) if 1 << i < config.max_num_batched_tokens}
        | {min(decode, config.max_num_batched_tokens), config.max_num_batched_tokens})
    buckets = make_buckets(config.max_num_batched_tokens, slots, token_sizes=sizes, max_spec_tokens=k,
                           taps=draft_block_size is not None)
    return EnginePlan(template, buckets, data_shards, k, caching, snapshots)


@dataclasses.dataclass(frozen=True)
class ParamBytes:
    """Parameter bytes of a model on a mesh: in all, on the fullest device, and held whole on
    every device (replicated)."""

    total: int
    per_device: int
    replicated: int


def sharded_param_bytes(params, deployment: str | None, mesh: tuple[int, ...]) -> ParamBytes:
    """Bytes of a parameter pytree (arrays or ShapeDtypeStructs) placed by the deployment's
    rules on a mesh of `mesh` sizes (every device holds the same share: dims split evenly)."""
    import jax
    from jax.sharding import PartitionSpec

    from dsv4 import sharding as sh

    leaves = jax.tree_util.tree_leaves(params)
    if deployment is None:
        total = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
        return ParamBytes(total, total, total)
    dep = sh.Deployment(deployment)
    mesh_shape = dict(zip((a.value for a in sh.MESH_AXES[dep]), mesh))
    specs = jax.tree_util.tree_leaves(sh.param_specs(params, sh.RULES[dep], mesh_shape),
                                      is_leaf=lambda s: isinstance(s, PartitionSpec))
    total = per_device = replicated = 0
    for x, spec in zip(leaves, specs):
        n = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        split = math.prod(mesh_shape[a] for a in spec if a is not None)
        total += n
        per_device += n // split
        replicated += n if split == 1 else 0
    return ParamBytes(total, per_device, replicated)


def dry_run(config: ServingConfig, *, device_bytes: int | None) -> tuple[str, bool]:
    """(the report of `--dry-run`, whether it fits): the resolved config, the model, the
    parameter bytes per device of the mesh, the buckets and (with device_bytes, one device's
    memory) the memory plan, or why one max_model_len request does not fit. Reads the
    checkpoint's config.json only (the demo model is written first if missing). ValueError
    for a config the model cannot serve; OSError for an unreadable checkpoint."""
    import jax.numpy as jnp
    from flax import nnx

    from checkpoints.orbax_io import is_converted, read_manifest
    from dsv4.config import ModelConfig
    from serving.config import draft_to_load, model_path, plan_pages

    path = model_path(config)
    cfg = ModelConfig.from_hf_json(path)
    quantized = config.quantized
    if is_converted(path):
        quantized = bool(read_manifest(path)["quantized"])
    dtype = np.dtype(jnp.bfloat16 if config.dtype in ("auto", "bfloat16") else jnp.float32)
    deployment, mesh = config.parallelism()
    weights = sharded_param_bytes(nnx.state(_abstract_module(cfg, quantized, dtype, draft=False)), deployment, mesh)
    head = draft_to_load(config, path)  # "none" when the checkpoint lacks the head asked for
    draft = block = None
    if head != "none":
        module = _abstract_module(cfg, quantized, dtype, draft=True)
        draft, block = sharded_param_bytes(nnx.state(module), deployment, mesh), module.block_size
    data_shards = dict(zip(_axis_names(deployment), mesh)).get("data", 1)
    plan = engine_plan(cfg, config, draft_block_size=block, data_shards=data_shards, dtype=dtype)
    devices = math.prod(mesh) if mesh else 1
    lines = ["resolved config:"]
    lines += [f"  {f.name} = {getattr(config, f.name)!r}" for f in dataclasses.fields(config)]
    lines += [
        f"model: {path}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.n_routed_experts} routed "
        f"experts (top {cfg.num_experts_per_tok}), vocabulary {cfg.vocab_size:,}; weights "
        f"{'as stored (FP8/FP4)' if quantized else f'decoded to {dtype.name}'}",
        f"devices: {devices}" + (f" ({deployment}, mesh {'x'.join(map(str, mesh))})" if deployment else ""),
        f"parameters: {weights.total / GIB:.2f} GiB in all, {weights.per_device / GIB:.2f} GiB per device "
        f"({weights.replicated / GIB:.2f} GiB of it replicated on every device)",
    ]
    per_device = weights.per_device
    if draft is not None:
        lines.append(f"draft head ({head}): {draft.total / GIB:.2f} GiB, {draft.per_device / GIB:.2f} GiB per device")
        per_device += draft.per_device
    elif config.speculation != "none":
        lines.append(f"draft head: {path} has no {config.speculation} head; the server would run without speculation")
    lines.append(f"state: {plan.slots} slots, {plan.template.page_tokens}-token pages, up to "
                 f"{plan.template.max_pages_per_seq} pages a request, {plan.spec_tokens} speculative tokens, "
                 f"prefix cache {'on, ' + str(plan.snapshots) + ' snapshots' if plan.prefix_caching else 'off'}")
    lines.append(f"buckets ({len(plan.buckets)} programs to compile, tokens x requests -> outputs): " +
                 ", ".join(f"{b.tokens}x{b.requests}->{b.outputs}" for b in plan.buckets))
    if device_bytes is None:
        lines.append("memory plan: no device size (a CPU, or pass --device-memory-gib): the state holds "
                     f"{plan.template.num_pages:,} pages, max_num_seqs full-length requests")
        return "\n".join(lines), True
    try:
        memory = plan_pages(cfg, config, plan.template, shards=plan.data_shards, snapshots=plan.snapshots,
                            device_bytes=device_bytes, bytes_in_use=per_device)
    except ValueError as e:
        lines.append(f"fits: NO, on a {device_bytes / GIB:.2f} GiB device: {e}")
        return "\n".join(lines), False
    lines.append(memory.summary())
    lines.append(f"fits: yes, {memory.full_length_requests} requests of {config.max_model_len:,} tokens at once "
                 f"on each data shard")
    return "\n".join(lines), True


def add_dry_run_flags(parser) -> None:
    """--dry-run and --device-memory-gib (the servers' and the CLI's)."""
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config, parameter bytes per device, memory plan and buckets "
                             "without loading weights, and exit (1 if it does not fit)")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="--dry-run's device size in GiB (default: the local accelerator's; none on a CPU)")


def run_dry_run(config: ServingConfig, device_memory_gib: float | None) -> int:
    """`--dry-run`: print the report; the exit code (0 fits, 1 does not, 2 bad config or model)."""
    import sys

    import jax

    from dsv4.memory import device_memory_bytes

    if device_memory_gib is not None and device_memory_gib <= 0:
        print(f"error: --device-memory-gib must be positive, got {device_memory_gib:g}", file=sys.stderr)
        return 2
    device_bytes = (int(device_memory_gib * GIB) if device_memory_gib is not None
                    else device_memory_bytes(jax.devices()[0]))
    try:
        report, fits = dry_run(config, device_bytes=device_bytes)
    except (OSError, ValueError) as e:
        print(f"error: cannot plan {config.model}: {e}", file=sys.stderr)
        return 2
    print(report, flush=True)
    return 0 if fits else 1


@functools.lru_cache(maxsize=4)
def _abstract_module(cfg: ModelConfig, quantized: bool, dtype: np.dtype, *, draft: bool):
    """The tower or its draft head as loaded, with ShapeDtypeStruct leaves: tracing FLASH's 43
    layers takes tens of seconds, so repeated plans of one model reuse it."""
    from checkpoints.inventory import abstract_draft, abstract_model
    from dsv4.model import storage_config

    build = abstract_draft if draft else abstract_model
    return build(storage_config(cfg, quantized), dtype)


def _axis_names(deployment: str | None) -> tuple[str, ...]:
    from dsv4 import sharding as sh

    return () if deployment is None else tuple(a.value for a in sh.MESH_AXES[sh.Deployment(deployment)])
