"""`ServingConfig`: every serving knob in one typed object, parsed once at the entry point.

Sources, later ones winning: the defaults here, a TOML or YAML file (`--config FILE`, keys
named like the fields), then command-line flags. Library code receives the object; nothing
reads environment variables.

`make_engine(model, config)` sizes the decode state and the static buckets for a loaded
`dsv4.Model` and returns a ready (warmed-up) `serving.engine.Engine`; with speculation on
(a model loaded with its draft head) the engine verifies drafts with a
`dsv4.spec_decode.SpecRunner`, and with capacity_verification the verify step's speed is
measured on the device at warm-up for `serving.capacity.CapacityVerifier`. On a device whose
allocator reports its size (GPUs), `memory_fraction` of it holds the parameters, the slots,
the prefix-cache snapshots and as many KV pages as fit (`dsv4.memory.plan_memory`; capped at
what max_num_seqs full-length requests can use); the rest is left for each step's
temporaries, which is checked after warm-up. Without a reported size (CPU) the state holds
exactly max_num_seqs requests of max_model_len.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tomllib
from typing import Any, Callable, Mapping

log = logging.getLogger(__name__)

DEMO_MODEL = "tiny"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "dsv4-jax")


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    model: str = DEMO_MODEL  # a checkpoint directory, or "tiny" for the embedded demo model
    demo_dir: str = os.path.join(DEFAULT_CACHE, "tiny-demo")  # where the demo checkpoint is written
    dtype: str = "auto"  # float32 | bfloat16 | auto (float32 on CPU, bfloat16 on accelerators)
    backend: str = "reference"  # kernel backend (dsv4.ops.registry.Backend)
    # Keep FP8/FP4 weights as the checkpoint stores them, dequantised inside the matmuls (on), or
    # decode them to dtype at load (off: FLASH's 156 GB become ~569 GB in bf16). A converted
    # directory holds what its conversion chose; off does not apply to a quantized one.
    quantized: bool = True
    allow_nonfinite: bool = False  # load weights holding NaN / Inf (refused by default: they generate garbage)
    deployment: str | None = None  # tp | tp_ep | dp_tp (dsv4.sharding.Deployment); None: one device
    mesh: tuple[int, ...] = ()  # axis sizes in the deployment's MESH_AXES order
    # The same, spelled as vLLM does: N-way tensor parallel (deployment tp, mesh N), with M-way
    # expert parallel routed experts (tp_ep, mesh N x M). Either these or deployment and mesh.
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    max_num_seqs: int = 8  # requests decoded concurrently (state slots)
    max_num_batched_tokens: int = 256  # tokens per step
    memory_fraction: float = 0.9  # share of device memory for parameters, state and snapshots (accelerators)
    max_model_len: int = 4096  # prompt + max_tokens per request
    max_req_tokens: int | None = None  # an operator's tighter cap on prompt + max_tokens
    max_waiting: int = 1024  # queued requests before RESOURCE_EXHAUSTED
    max_logprobs: int = 20  # the widest top-n logprobs a request may ask for
    speculation: str = "none"  # none | dspark | mtp: a draft head proposes, the model verifies
    num_speculative_tokens: int = 0  # drafts verified per request and step (K); 0 = the head's block size
    capacity_verification: bool = False  # per-request lengths from draft confidence and measured step speed
    draft_fp8_head: bool = False  # the draft's LM-head matmul in row-wise FP8
    bucket_tokens: tuple[int, ...] = ()  # step token sizes; () = powers of two up to max_num_seqs, and the budget
    enable_prefix_caching: bool = True  # share block-aligned prompt prefixes (off under data parallelism)
    prefix_cache_snapshots: int = 0  # ring snapshots kept for the prefix cache; 0 = 4 x max_num_seqs
    compilation_cache: str | None = os.path.join(DEFAULT_CACHE, "xla")

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("bad serving config: " + "; ".join(problems))

    def problems(self) -> list[str]:
        bad = type_problems(self)
        if bad:  # the value checks below assume the types
            return bad
        if self.dtype not in ("auto", "float32", "bfloat16"):
            bad.append(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            bad.append(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            bad.append(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                       f"({self.max_num_seqs}): every running request decodes one token per step")
        if not 0 < self.memory_fraction <= 1:
            bad.append(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.max_model_len < 2:
            bad.append(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_req_tokens is not None and not 2 <= self.max_req_tokens <= self.max_model_len:
            bad.append(f"max_req_tokens must be in [2, max_model_len={self.max_model_len}], got {self.max_req_tokens}")
        if self.max_waiting < 1:
            bad.append(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.prefix_cache_snapshots < 0:
            bad.append(f"prefix_cache_snapshots must be >= 0 (0 = automatic), got {self.prefix_cache_snapshots}")
        if self.max_logprobs < 0:
            bad.append(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.speculation not in ("none", "dspark", "mtp"):
            bad.append(f"speculation must be none, dspark or mtp, got {self.speculation!r}")
        if self.speculation == "mtp" and self.capacity_verification:
            bad.append("capacity_verification needs the DSpark head's confidences (speculation dspark)")
        if self.num_speculative_tokens < 0:
            bad.append(f"num_speculative_tokens must be >= 0 (0 = the head's block size), got "
                       f"{self.num_speculative_tokens}")
        if self.speculation == "none" and (self.capacity_verification or self.draft_fp8_head):
            bad.append("capacity_verification and draft_fp8_head need speculation dspark or mtp")
        if self.tensor_parallel_size < 1 or self.expert_parallel_size < 1:
            bad.append(f"tensor_parallel_size and expert_parallel_size must be >= 1, got "
                       f"{self.tensor_parallel_size} and {self.expert_parallel_size}")
        if self.deployment is not None and (self.tensor_parallel_size > 1 or self.expert_parallel_size > 1):
            bad.append("give either deployment and mesh or tensor_parallel_size / expert_parallel_size, not both")
        if (self.deployment is None) != (not self.mesh):
            bad.append("deployment and mesh go together (e.g. deployment tp with mesh 2)")
        if any(t < 1 for t in self.bucket_tokens) or (self.bucket_tokens and
                                                      max(self.bucket_tokens) != self.max_num_batched_tokens):
            bad.append(f"bucket_tokens must be positive and end at max_num_batched_tokens, got {self.bucket_tokens}")
        return bad

    def parallelism(self) -> tuple[str | None, tuple[int, ...]]:
        """(deployment, mesh sizes) from either spelling; (None, ()) for one device."""
        if self.deployment is not None:
            return self.deployment, self.mesh
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if ep > 1:
            return "tp_ep", (tp, ep)
        return ("tp", (tp,)) if tp > 1 else (None, ())

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "config") -> ServingConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
            raise ValueError(f"{source}: expected a mapping of config keys (strings) to values")
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"{source}: unknown keys {unknown}; known: {sorted(names)}")
        fixed = {k: tuple(v) if k in ("mesh", "bucket_tokens") and isinstance(v, list) else v
                 for k, v in values.items()}
        try:
            return cls(**fixed)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str) -> ServingConfig:
        """A TOML (.toml) or YAML (.yaml / .yml) file of field values."""
        return cls.from_mapping(read_config_file(path), path)


# A field's annotation -> (whether a value has that type, its name in messages).
_TYPE_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "int | None": (lambda v: v is None or isinstance(v, int) and not isinstance(v, bool), "an integer or null"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "str | None": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "tuple[int, ...]": (lambda v: isinstance(v, tuple) and all(isinstance(x, int) and not isinstance(x, bool)
                                                                for x in v), "a list of integers"),
}


def type_problems(config: ServingConfig) -> list[str]:
    """One message per field whose value is not of the field's type (key, value, expected)."""
    bad = []
    for f in dataclasses.fields(config):
        check, expected = _TYPE_CHECKS[f.type]
        value = getattr(config, f.name)
        if not check(value):
            bad.append(f"{f.name} must be {expected}, got {value!r} ({type(value).__name__})")
    return bad


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping a TOML or YAML config file holds; ValueError naming the file when it is not
    one (OSError when it cannot be read)."""
    if not path.endswith((".toml", ".yaml", ".yml")):
        raise ValueError(f"{path}: config files are .toml, .yaml or .yml")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    if path.endswith(".toml"):
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of config keys")
    return data


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace("x", ",").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _bool(text: str) -> bool:
    value = {"true": True, "on": True, "1": True, "yes": True, "false": False, "off": False, "0": False,
             "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
    return value


_FLAG_TYPES: dict[str, Callable[[str], Any]] = {"mesh": _sizes, "bucket_tokens": _sizes}


def add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ServingConfig field (--max-num-seqs, ...), plus --config FILE."""
    parser.add_argument("--config", dest="config_file", default=None, help="a TOML or YAML ServingConfig file")
    defaults = ServingConfig()
    for f in dataclasses.fields(ServingConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kind = _FLAG_TYPES.get(f.name) or (_bool if isinstance(default, bool) else
                                           type(default) if default is not None and not isinstance(default, str)
                                           else (int if f.name == "max_req_tokens" else str))
        # A yes/no field's flag alone means yes (--allow-nonfinite); "--quantized off" says no.
        on_alone = {"nargs": "?", "const": True} if kind is _bool else {}
        parser.add_argument(flag, dest=f.name, type=kind, default=None, help=f"(default: {default})", **on_alone)


def config_from_args(args: argparse.Namespace) -> ServingConfig:
    """Defaults, then --config FILE, then the flags given."""
    values: dict[str, Any] = {}
    if getattr(args, "config_file", None):
        values.update(read_config_file(args.config_file))
    for f in dataclasses.fields(ServingConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    if values.get("compilation_cache") == "":
        values["compilation_cache"] = None
    return ServingConfig.from_mapping(values, args.config_file or "flags")


def make_engine(model, config: ServingConfig, *, eos_token_ids: tuple[int, ...] = (),
                progress: Callable[[int, int, Any], None] | None = None):
    """A warmed-up Engine for a loaded `dsv4.Model` (state sized by max_num_seqs and
    max_model_len); generation stops at the model's EOS and at `eos_token_ids` (the
    tokenizer's); `progress(i, n, bucket)` is called before each program compiles. Speculative
    decoding runs when the model carries its draft head (`load_model` loads it for
    speculation dspark or mtp)."""
    from dsv4.memory import device_memory_bytes
    from dsv4.ops.registry import ops_for
    from dsv4.step import CompilePolicy, StepRunner
    from serving.engine import Engine, EngineLimits
    from serving.engine_plan import engine_plan

    cfg = model.config
    head = getattr(model, "draft_head", None)
    shards = model.placement.mesh_shape.get("data", 1) if model.placement is not None else 1
    dtype = model.params["embed"]["weight"][...].dtype
    planned = engine_plan(cfg, config, draft_block_size=head.block_size if head is not None else None,
                          data_shards=shards, dtype=dtype)
    template, buckets, k, snapshots = planned.template, planned.buckets, planned.spec_tokens, planned.snapshots
    device = _first_device(model)
    plan = plan_pages(cfg, config, template, shards=shards, snapshots=snapshots,
                      device_bytes=device_memory_bytes(device), bytes_in_use=_bytes_in_use(device))
    geometry = template if plan is None else dataclasses.replace(template, num_pages=plan.num_pages * shards)
    if plan is not None:
        log.info("%s", plan.summary())
    runner = StepRunner(model.graphdef, model.params, cfg, geometry, buckets, ops_for(model.backend),
                        policy=CompilePolicy.WARN, placement=model.placement, max_logprobs=config.max_logprobs,
                        snapshot_slots=snapshots)
    speculator = capacity = None
    if head is None:
        runner.warmup(progress)
        compiled = runner
    else:
        speculator, capacity = _speculation(runner, head, k, config, ops_for(model.backend), progress)
        compiled = speculator
    if plan is not None:
        check_workspace(compiled.workspace_bytes(), device_bytes=plan.device_bytes,
                        bytes_in_use=_bytes_in_use(device))
    eos = tuple(dict.fromkeys((cfg.eos_token_id, *eos_token_ids)))
    limits = EngineLimits(vocab_size=cfg.vocab_size, eos_token_ids=eos,
                          max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
                          max_req_tokens=config.max_req_tokens, max_waiting=config.max_waiting,
                          max_logprobs=config.max_logprobs)
    return Engine(runner, limits, data_shards=shards, prefix_cache=planned.prefix_caching, speculator=speculator,
                  capacity=capacity)


def _speculation(runner, head, k: int, config: ServingConfig, ops, progress):
    """(a warmed-up SpecRunner, its CapacityVerifier or None). Capacity-aware verification
    compiles shallower blocks too (1 and about K/2 drafts) and times the verify step."""
    from dsv4 import quant
    from dsv4.spec_decode import SpecRunner
    from serving.capacity import CapacityVerifier, measure_step_speed

    depths = sorted({1, (k + 1) // 2, k}) if config.capacity_verification else [k]
    lm_head = runner.params["head"]["weight"][...]
    speculator = SpecRunner(runner, head, ops, k=k, depths=depths,
                            draft_lm_head=quant.quant_fp8_rows(lm_head) if config.draft_fp8_head else None)
    speculator.warmup(progress)
    if not config.capacity_verification:
        return speculator, None
    table = measure_step_speed(speculator)
    capacity = CapacityVerifier(k, table, depths=depths, max_requests=runner.geometry.num_slots)
    log.info("capacity-aware verification: fixed width up to %d decoding requests; verify step %s", capacity.knee,
             ", ".join(f"{t} rows {1e3 * s:.2f} ms" for t, s in zip(table.tokens, table.seconds)))
    return speculator, capacity


def plan_pages(cfg, config: ServingConfig, template, *, shards: int, snapshots: int, device_bytes: int | None,
               bytes_in_use: int):
    """The memory plan of one device (`dsv4.memory.MemoryPlan`, its pages per data shard), or
    None when the device reports no size (CPU: the template's pages are used).

    bytes_in_use: what the device already holds (the loaded parameters). The snapshot pool is
    reserved next to it. ValueError (from plan_memory) when one max_model_len request does not fit.
    """
    from dsv4.memory import plan_memory, state_costs

    if device_bytes is None:
        return None
    snapshot_bytes = 0
    if snapshots:
        costs = state_costs(cfg, template)
        snapshot_bytes = snapshots * costs.bytes_per_slot + costs.bytes_per_page
    return plan_memory(cfg, device_bytes=device_bytes, memory_fraction=config.memory_fraction,
                       param_bytes=bytes_in_use, max_num_seqs=template.num_slots // shards,
                       max_model_len=config.max_model_len, page_tokens=template.page_tokens,
                       max_spec_tokens=template.max_spec_tokens, dtype=template.dtype, reserve_bytes=snapshot_bytes)


def check_workspace(workspace_bytes: int | None, *, device_bytes: int, bytes_in_use: int) -> None:
    """ValueError when the largest compiled step needs more temporaries than the device has left
    after the parameters and the state (a step would fail with out-of-memory under load)."""
    left = device_bytes - bytes_in_use
    if workspace_bytes is not None and workspace_bytes > left:
        raise ValueError(f"the largest step needs {workspace_bytes:,} B of temporaries but only {left:,} B of "
                         f"device memory are left after the parameters and the state: lower memory_fraction "
                         f"or max_num_batched_tokens")


def _first_device(model):
    import jax

    return model.placement.mesh.devices.flat[0] if model.placement is not None else jax.devices()[0]


def _bytes_in_use(device) -> int:
    stats = device.memory_stats() or {}
    return int(stats.get("bytes_in_use", 0))


def model_path(config: ServingConfig) -> str:
    """The checkpoint directory config.model names: the demo model's (written into demo_dir on
    first use) for "tiny"."""
    from serving.demo_model import ensure_demo_checkpoint

    return ensure_demo_checkpoint(config.demo_dir) if config.model == DEMO_MODEL else config.model


def draft_to_load(config: ServingConfig, path: str) -> str:
    """The `draft` argument of `dsv4.load_pretrained`: config.speculation when the checkpoint
    has that head, else "none" with a warning (the server runs without speculation)."""
    from checkpoints.loader import draft_kind

    if config.speculation == "none":
        return "none"
    held = draft_kind(path)
    if held == config.speculation:
        return held
    what = "no draft head (no mtp.* tensors, or a config without one)" if held == "none" else f"a {held} head"
    log.warning("%s has %s, not the %s head asked for: running with speculation none", path, what,
                config.speculation)
    return "none"


def load_model(config: ServingConfig):
    """(dsv4.Model, tokenizer) for `config`: the embedded demo model when config.model is
    "tiny" (written into demo_dir on first use), else the checkpoint directory; sharded over
    the configured mesh; with speculation dspark or mtp, that draft head too
    (`Model.draft_head`; a checkpoint without it runs with speculation none, with a
    warning); the persistent compilation cache turned on when configured."""
    import jax

    import dsv4
    from checkpoints.orbax_io import is_converted
    from dsv4 import sharding as sh
    from dsv4.step import enable_compilation_cache
    from serving.tokenizer import load_tokenizer

    if config.compilation_cache:
        enable_compilation_cache(config.compilation_cache)
    path = model_path(config)
    dtype = config.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    placement = None
    deployment_name, mesh = config.parallelism()
    if deployment_name is not None:
        deployment = sh.Deployment(deployment_name)
        placement = sh.Placement(sh.make_mesh(deployment, mesh), deployment)
    # A converted directory's storage was fixed at conversion: "on" (keep what is stored) accepts it.
    quantized = None if config.quantized and is_converted(path) else config.quantized
    model = dsv4.load_pretrained(path, dtype=dtype, backend=config.backend, placement=placement,
                                 draft=draft_to_load(config, path), quantized=quantized,
                                 allow_nonfinite=config.allow_nonfinite)
    cfg = model.config
    tokenizer = load_tokenizer(path, vocab_size=cfg.vocab_size, bos_token_id=cfg.bos_token_id,
                               eos_token_id=cfg.eos_token_id)
    return model, tokenizer
