"""The official tensor inventory of a config, derived from the model definition.

Every tower parameter's NNX path joined with dots is its official checkpoint name, except
routed experts, which the model stacks along E (`layers.N.ffn.experts.w1.weight` [E, ...])
and the checkpoint stores one per expert (`layers.N.ffn.experts.{e}.w1.weight`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.config import ModelConfig
from dsv4.layers.dspark import DSparkHead
from dsv4.layers.mtp import MTPHead
from dsv4.model import Transformer

# In-memory dtype of a quantized-storage model -> the safetensors dtype on disk.
_DISK_DTYPE = {
    np.dtype(jnp.float8_e4m3fn): "F8_E4M3",
    np.dtype(np.uint8): "F8_E8M0",  # scales are kept as raw E8M0 bytes
    np.dtype(np.int8): "I8",  # two FP4 codes per byte
    np.dtype(jnp.bfloat16): "BF16",
    np.dtype(np.float32): "F32",
    np.dtype(np.int32): "I64",  # tid2eid: int64 on disk, int32 in memory (ids < E)
}

DRAFT_PREFIX = "mtp."


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One official tensor: where it goes in the model and what the file must hold."""

    name: str
    path: tuple[str | int, ...]  # NNX state path of the parameter it fills
    expert: int | None  # index along E for per-expert tensors, else None
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string on disk


def abstract_model(cfg: ModelConfig, param_dtype: jnp.dtype) -> Transformer:
    """The tower with ShapeDtypeStruct leaves; costs no memory."""
    return nnx.eval_shape(lambda: Transformer(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(0)))


def path_name(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path)


def abstract_draft(cfg: ModelConfig, param_dtype: jnp.dtype) -> DSparkHead | MTPHead:
    """The config's draft head (DSpark stages, or the classic MTP layer: `cfg.draft_kind`) with
    ShapeDtypeStruct leaves; its state paths are the `mtp.S.*` names."""
    kind = MTPHead if cfg.draft_kind == "mtp" else DSparkHead
    return nnx.eval_shape(lambda: kind(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(0)))


@functools.lru_cache(maxsize=16)
def tower_inventory(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Official name -> TensorSpec for every tower tensor of `cfg` in its on-disk formats."""
    return module_inventory(abstract_model(cfg, jnp.bfloat16))


@functools.lru_cache(maxsize=16)
def draft_inventory(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Official name -> TensorSpec for every draft tensor (`mtp.S.*`: DSpark spec 7.4, MTP 7.5)."""
    return module_inventory(abstract_draft(cfg, jnp.bfloat16))


def module_inventory(module: nnx.Module) -> dict[str, TensorSpec]:
    """Official name -> TensorSpec for every parameter of an abstract module whose state
    paths are official names (routed experts unstacked into one tensor per expert)."""
    _, state = nnx.split(module)
    out: dict[str, TensorSpec] = {}
    for path, var in nnx.to_flat_state(state):
        leaf = var.get_value()
        dtype = _DISK_DTYPE[np.dtype(leaf.dtype)]
        names = [str(p) for p in path]
        if "experts" in names and names[names.index("experts") - 1] == "ffn":
            head, tail = path_name(path[: names.index("experts") + 1]), path_name(path[names.index("experts") + 1:])
            for e in range(leaf.shape[0]):
                name = f"{head}.{e}.{tail}"
                out[name] = TensorSpec(name, tuple(path), e, tuple(leaf.shape[1:]), dtype)
        else:
            name = path_name(path)
            out[name] = TensorSpec(name, tuple(path), None, tuple(leaf.shape), dtype)
    return out
