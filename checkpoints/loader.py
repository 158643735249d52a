"""Load an official-format DeepSeek-V4 checkpoint directory into the model.

Streaming: tensors are read one at a time from memory-mapped shards and placed on their
devices immediately (routed experts are stacked per layer and weight). Every expected
tensor is checked before anything is placed: missing, unexpected and mis-shaped tensors
are all reported in one error naming each tensor with what was expected and found.
Draft-module tensors (`mtp.*`) are recognised and indexed for the speculative-decoding
head, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.inventory import (DRAFT_PREFIX, TensorSpec, abstract_draft, abstract_model, draft_inventory,
                                   path_name, tower_inventory)
from checkpoints.safetensors_io import FLOAT_DTYPES, CheckpointError, CheckpointReader, TensorRef
from dsv4 import quant
from dsv4.config import ModelConfig, WeightFormat
from dsv4.layers.dspark import DSparkHead
from dsv4.layers.mtp import MTPHead
from dsv4.model import Transformer, storage_config

# Maps a parameter's official (stacked) name and shape to where it should live; None = default device.
ShardingFn = Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None]
# Called after each parameter is placed: (parameters done, parameters in all, bytes placed so far).
ProgressFn = Callable[[int, int, int], None]


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What a load did: counts, and the draft tensors kept aside (by name, not loaded)."""

    directory: str
    n_tensors: int
    n_bytes: int
    draft_tensors: dict[str, TensorRef]

    @property
    def draft_stages(self) -> tuple[int, ...]:
        return tuple(sorted({int(n.split(".")[1]) for n in self.draft_tensors}))

    def summary(self) -> str:
        draft = (f"{len(self.draft_tensors)} draft tensors for stages {list(self.draft_stages)} kept aside"
                 if self.draft_tensors else "no draft-module (mtp.*) tensors: speculation mode 'none'")
        return f"loaded {self.n_tensors} tower tensors ({self.n_bytes / 2**20:.1f} MiB) from {self.directory}; {draft}"


def check_tensors(reader: CheckpointReader, inventory: dict[str, TensorSpec],
                  others: Callable[[str], bool] = lambda name: name.startswith(DRAFT_PREFIX)) -> None:
    """Raise one CheckpointError listing every missing, unexpected or mis-shaped tensor
    (`others`: names that belong to another module and are not checked here)."""
    problems = []
    for name, spec in inventory.items():
        ref = reader.refs.get(name)
        if ref is None:
            problems.append(f"missing tensor {name}: expected {spec.dtype}{list(spec.shape)}")
            continue
        dtype_ok = ref.dtype == spec.dtype or (spec.dtype in FLOAT_DTYPES and ref.dtype in FLOAT_DTYPES) or (
            spec.dtype == "I64" and ref.dtype in ("I64", "I32"))
        if ref.shape != spec.shape or not dtype_ok:
            problems.append(f"tensor {name}: expected {spec.dtype}{list(spec.shape)}, found {ref.dtype}{list(ref.shape)}")
    for name in reader.names():
        if name not in inventory and not others(name):
            ref = reader.refs[name]
            problems.append(f"unexpected tensor {name}: {ref.dtype}{list(ref.shape)} has no place in this config")
    if problems:
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise CheckpointError(f"{reader.directory}: {len(problems)} problem(s) with the checkpoint:\n  {shown}{more}")


def _host_value(reader: CheckpointReader, spec: TensorSpec, target_dtype: np.dtype) -> np.ndarray:
    arr = reader.read(spec.name)
    if spec.dtype == "I64":
        if arr.size and (arr.min() < 0 or arr.max() >= np.iinfo(np.int32).max):
            raise CheckpointError(f"tensor {spec.name}: expert ids outside int32 range")
        return arr.astype(np.int32)
    if spec.dtype in FLOAT_DTYPES:
        return arr.astype(target_dtype)
    return arr


def load_checkpoint(directory: str | os.PathLike, *, dtype: jnp.dtype = jnp.bfloat16, quantized: bool = False,
                    config_overrides: dict | None = None, sharding: ShardingFn | None = None,
                    progress: ProgressFn | None = None) -> tuple[Transformer, LoadReport]:
    """Build the tower from an official checkpoint directory.

    dtype: dtype of dense weights and activations. quantized: keep FP8/FP4 tensors as on
    disk and dequantise inside the matmuls (else decode them to `dtype` at load).
    config_overrides: ModelConfig fields to replace (e.g. `fake_quant=False`).
    sharding: where each parameter goes (by official stacked name); default device if None.
    progress: called after each parameter is placed (a full checkpoint has ~1,300 stacked
    parameters and takes minutes to stream).
    """
    directory = os.fspath(directory)
    cfg = ModelConfig.from_hf_json(directory, **(config_overrides or {}))
    reader = CheckpointReader(directory)
    try:
        inventory = tower_inventory(cfg)
        check_tensors(reader, inventory)
        model, n_bytes = _fill(reader, abstract_model(storage_config(cfg, quantized), dtype), inventory, cfg,
                               sharding, progress)
        draft = {n: r for n, r in reader.refs.items() if n.startswith(DRAFT_PREFIX)}
        report = LoadReport(directory, len(inventory), n_bytes, draft)
        return model, report
    finally:
        reader.close()


def draft_kind(directory: str | os.PathLike) -> str:
    """The draft head a checkpoint holds: "dspark", "mtp" (`ModelConfig.draft_kind`) when its
    config describes one and it has `mtp.*` tensors (`load_draft` then checks them all), else
    "none". A converted directory holds what its manifest says."""
    from checkpoints.orbax_io import is_converted, read_manifest  # it imports this module

    directory = os.fspath(directory)
    if is_converted(directory):
        return read_manifest(directory)["draft"]
    cfg = ModelConfig.from_hf_json(directory)
    kind = cfg.draft_kind
    if kind == "none" or (kind == "dspark" and not cfg.dspark_target_layer_ids):
        return "none"
    reader = CheckpointReader(directory)
    try:
        return kind if any(name.startswith(DRAFT_PREFIX) for name in reader.names()) else "none"
    finally:
        reader.close()


def load_draft(directory: str | os.PathLike, *, dtype: jnp.dtype = jnp.bfloat16, quantized: bool = False,
               config_overrides: dict | None = None, sharding: ShardingFn | None = None,
               progress: ProgressFn | None = None) -> DSparkHead | MTPHead:
    """The draft head (`mtp.S.*` tensors) of an official checkpoint directory: the DSpark
    stages, or the preview's classic MTP layer (`ModelConfig.draft_kind`); arguments as
    `load_checkpoint`. CheckpointError when the config has no draft head or its tensors are
    missing, mis-shaped or unexpected (all named in one error)."""
    directory = os.fspath(directory)
    cfg = ModelConfig.from_hf_json(directory, **(config_overrides or {}))
    if cfg.draft_kind == "none" or (cfg.draft_kind == "dspark" and not cfg.dspark_target_layer_ids):
        raise CheckpointError(f"{directory}: the config describes no DSpark head or MTP layer (num_draft_stages "
                              f"{cfg.num_draft_stages}, dspark_block_size {cfg.dspark_block_size})")
    reader = CheckpointReader(directory)
    try:
        inventory = draft_inventory(cfg)
        check_tensors(reader, inventory, others=lambda n: not n.startswith(DRAFT_PREFIX))
        head, _ = _fill(reader, abstract_draft(storage_config(cfg, quantized), dtype), inventory, cfg, sharding,
                        progress)
        return head
    finally:
        reader.close()


def _fill(reader: CheckpointReader, abstract: nnx.Module, inventory: dict[str, TensorSpec], cfg: ModelConfig,
          sharding: ShardingFn | None, progress: ProgressFn | None) -> tuple[nnx.Module, int]:
    """The module with every parameter read from the checkpoint and placed; (module, bytes)."""
    graphdef, state = nnx.split(abstract)
    by_path: dict[tuple, list[TensorSpec]] = {}
    for spec in inventory.values():
        by_path.setdefault(spec.path, []).append(spec)
    n_bytes = 0
    flat = []
    entries = list(nnx.to_flat_state(state))
    for i, (path, var) in enumerate(entries):
        target = var.get_value()
        value = _load_param(reader, by_path[tuple(path)], target, cfg)
        n_bytes += value.size * value.dtype.itemsize
        dest = sharding(path_name(path), tuple(target.shape)) if sharding is not None else None
        flat.append((path, var.replace(_place(value, dest))))
        if progress is not None:
            progress(i + 1, len(entries), n_bytes)
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), n_bytes


def _load_param(reader: CheckpointReader, specs: list[TensorSpec], target: jax.ShapeDtypeStruct,
                cfg: ModelConfig) -> np.ndarray:
    """Read the tensors that fill one parameter, on the host: one tensor, or one per routed
    expert stacked along E in id order; decoded to the dense target when it is not stored as
    on disk (on the CPU backend, so no accelerator ever holds a whole tensor)."""
    stacked = specs[0].expert is not None
    specs = sorted(specs, key=lambda s: s.expert) if stacked else specs
    values = [_host_value(reader, s, np.dtype(target.dtype)) for s in specs]
    host = np.stack(values) if stacked else values[0]
    if host.shape == tuple(target.shape) and host.dtype == target.dtype:
        return host
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(_decode(reader, specs, host, target, cfg))


def _place(host: np.ndarray, dest: jax.sharding.Sharding | None) -> jax.Array:
    """A device array from a host one: on the default device, or each device receiving only
    the slices its shard holds (never a full copy on one device first)."""
    if dest is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, dest, lambda index: host[index])


def _decode(reader: CheckpointReader, specs: list[TensorSpec], data: np.ndarray, target: jax.ShapeDtypeStruct,
            cfg: ModelConfig) -> jax.Array:
    """Dequantise an FP8 / FP4 weight (one tensor or a stack of experts) to a dense target."""
    scale_names = [s.name.rsplit(".", 1)[0] + ".scale" for s in specs]
    if not specs[0].name.endswith(".weight") or any(n not in reader for n in scale_names):
        raise CheckpointError(f"tensor {specs[0].name}: {data.dtype}{list(data.shape)} cannot fill "
                              f"{np.dtype(target.dtype)}{list(target.shape)}")
    is_expert = specs[0].expert is not None
    scales = [reader.read(n) for n in scale_names]
    scale = np.stack(scales) if is_expert else scales[0]
    fmt = cfg.expert_format if is_expert else cfg.weight_format
    if fmt is WeightFormat.FP4:
        return quant.dequant_fp4(data, scale, target.dtype)
    return quant.dequant_fp8_block(data, scale, target.dtype)
