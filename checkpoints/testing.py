"""Random official-format checkpoints for tests and the embedded demo model.

`write_tiny_checkpoint(config, path, seed, quantized=...)` writes `config.json`,
`model.safetensors.index.json` and shards laid out like the official release (embedding
first, one shard per layer, head last, one shard per draft stage). Values are random but
well conditioned (activations stay O(1) through the tower).

The quantized and dense checkpoints of one (config, seed) are exact twins: the dense one
holds the FP8/FP4 weights already decoded, so both must give the same logits.
"""

from __future__ import annotations

import json
import os

import numpy as np

from checkpoints.inventory import TensorSpec, draft_inventory, tower_inventory
from checkpoints.safetensors_io import DTYPES, write_file, write_index
from dsv4 import quant
from dsv4.config import ModelConfig, WeightFormat


def write_tiny_checkpoint(config: ModelConfig, path: str | os.PathLike, seed: int = 0, *, quantized: bool = False,
                          float_dtype: str = "BF16", draft_stages: int | None = None, mtp: bool = False) -> ModelConfig:
    """Write a random checkpoint of `config`; returns the config as written.

    quantized: FP8 (128x128 E8M0 blocks) for the attention/shared-expert/indexer linears and
    FP4 (1x32 E8M0) for routed experts, as the official release; otherwise every tensor in
    `float_dtype` ("BF16" or "F32") holding the decoded values of the quantized twin.
    draft_stages: number of DSpark stages (`mtp.S.*`) to add (default: config.num_draft_stages).
    mtp: add the preview's classic MTP layer (`mtp.0.*`, spec 7.5) instead of DSpark stages.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    stages = 1 if mtp else config.num_draft_stages if draft_stages is None else draft_stages
    written = config.replace(
        weight_format=WeightFormat.FP8 if quantized else WeightFormat.BF16,
        expert_format=WeightFormat.FP4 if quantized else WeightFormat.BF16,
        fake_quant=quantized, num_draft_stages=stages)
    if mtp:
        written = written.replace(dspark_block_size=0, dspark_noise_token_id=0, dspark_target_layer_ids=(),
                                  dspark_markov_rank=0)
    elif stages:  # a DSpark head needs its settings; configs without them get small defaults
        n = config.num_hidden_layers
        written = written.replace(
            dspark_block_size=config.dspark_block_size or 5,
            dspark_noise_token_id=config.dspark_noise_token_id or config.vocab_size - 1,
            dspark_target_layer_ids=config.dspark_target_layer_ids or tuple(range(max(0, n - 3), n)),
            dspark_markov_rank=config.dspark_markov_rank or 16)
    # Random values are drawn at the logical (dense) shapes; the quantized inventory says
    # which tensors are FP8 / FP4 on disk.
    dense_cfg = written.replace(weight_format=WeightFormat.BF16, expert_format=WeightFormat.BF16)
    on_disk = written.replace(weight_format=WeightFormat.FP8, expert_format=WeightFormat.FP4)
    disk_format = {n: s.dtype for n, s in tower_inventory(on_disk).items()}
    if stages:
        disk_format.update((n, s.dtype) for n, s in draft_inventory(on_disk).items())
    rng = np.random.default_rng(seed)
    shards: dict[str, dict[str, np.ndarray]] = {}
    e8m0: set[str] = set()

    def emit(shard: str, name: str, value: np.ndarray, fmt: str) -> None:
        out = shards.setdefault(shard, {})
        if fmt in ("F8_E4M3", "I8"):
            codes, scale = (quant.quant_fp8_block if fmt == "F8_E4M3" else quant.quant_fp4)(value)
            codes, scale = np.asarray(codes), np.asarray(scale)
            if quantized:
                out[name] = codes
                out[name.rsplit(".", 1)[0] + ".scale"] = scale
                e8m0.add(name.rsplit(".", 1)[0] + ".scale")
                return
            decode = quant.dequant_fp8_block if fmt == "F8_E4M3" else quant.dequant_fp4
            value = np.asarray(decode(codes, scale, np.float32))
        if fmt == "I64":
            out[name] = value.astype(np.int64)
        else:
            out[name] = value.astype(DTYPES[float_dtype] if fmt in ("BF16", "F32") and not _keeps_f32(name)
                                     else np.float32)

    for spec in tower_inventory(dense_cfg).values():
        emit(_shard_of(spec.name), spec.name, _random_value(spec, config, rng), disk_format[spec.name])
    for spec in (draft_inventory(dense_cfg).values() if stages else ()):
        emit(f"mtp{spec.name.split('.')[1]}", spec.name, _random_value(spec, config, rng), disk_format[spec.name])

    order = ["embed"] + [f"layer{i}" for i in range(config.num_hidden_layers)] + ["final"] + [
        f"mtp{s}" for s in range(stages)]
    names = [s for s in order if s in shards]
    weight_map, total = {}, 0
    for i, shard in enumerate(names):
        file = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        tensors = shards[shard]
        write_file(os.path.join(path, file), tensors, frozenset(n for n in tensors if n in e8m0))
        for n, a in tensors.items():
            weight_map[n] = file
            total += a.nbytes
    write_index(path, weight_map, total)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(written.to_hf_json(), f, indent=1)
    return written


def _keeps_f32(name: str) -> bool:
    """Tensors the official checkpoint stores as F32 whatever the float dtype."""
    last = name.rsplit(".", 1)[-1]
    return last in ("attn_sink", "ape", "bias") or last.startswith("hc_")


def _shard_of(name: str) -> str:
    if name.startswith("embed."):
        return "embed"
    if name.startswith("layers."):
        return f"layer{name.split('.')[1]}"
    return "final"


def _random_value(spec: TensorSpec, cfg: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    """Well-conditioned random values chosen by the tensor's role."""
    name, shape = spec.name, spec.shape
    parts = name.split(".")
    # The module a `.weight` belongs to, or the parameter's own name (attn_sink, ape, hc_*...).
    role = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]
    if role == "tid2eid":
        # Distinct experts per token, as a real routing table.
        return np.argsort(rng.random((shape[0], cfg.n_routed_experts)), axis=1)[:, :shape[1]].astype(np.int64)
    if role in ("attn_sink", "ape"):
        return rng.normal(0.0, 0.5, shape).astype(np.float32)
    if role == "bias":
        return rng.normal(0.0, 0.1, shape).astype(np.float32)
    if role.startswith("hc_"):
        if role.endswith("fn"):
            return rng.normal(0.0, shape[-1] ** -0.5, shape).astype(np.float32)
        if role.endswith("base"):
            return rng.normal(0.0, 0.5, shape).astype(np.float32)
        return (1.0 + 0.2 * rng.normal(size=shape)).astype(np.float32)  # scale
    if role.endswith("norm"):
        return (1.0 + 0.1 * rng.normal(size=shape)).astype(np.float32)
    if role in ("embed", "markov_w1"):  # lookup tables: O(1) rows
        return rng.normal(0.0, 1.0, shape).astype(np.float32)
    return rng.normal(0.0, shape[-1] ** -0.5, shape).astype(np.float32)  # linear [out, in]
