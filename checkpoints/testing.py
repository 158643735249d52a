"""Random official-format checkpoints for tests and the embedded demo model.

`write_tiny_checkpoint(config, path, seed, quantized=...)` writes `config.json`,
`model.safetensors.index.json` and shards laid out like the official release (embedding
first, one shard per layer, head last, one shard per draft stage). Values are random but
well conditioned (activations stay O(1) through the tower).

The quantized and dense checkpoints of one (config, seed) are exact twins: the dense one
holds the FP8/FP4 weights already decoded, so both must give the same logits.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from checkpoints.inventory import TensorSpec, tower_inventory
from checkpoints.safetensors_io import DTYPES, write_file, write_index
from dsv4 import quant
from dsv4.config import AttentionKind, ModelConfig, RoutingKind, WeightFormat


def write_tiny_checkpoint(config: ModelConfig, path: str | os.PathLike, seed: int = 0, *, quantized: bool = False,
                          float_dtype: str = "BF16", draft_stages: int | None = None) -> ModelConfig:
    """Write a random checkpoint of `config`; returns the config as written.

    quantized: FP8 (128x128 E8M0 blocks) for the attention/shared-expert/indexer linears and
    FP4 (1x32 E8M0) for routed experts, as the official release; otherwise every tensor in
    `float_dtype` ("BF16" or "F32") holding the decoded values of the quantized twin.
    draft_stages: number of DSpark stages (`mtp.S.*`) to add (default: config.num_draft_stages).
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    stages = config.num_draft_stages if draft_stages is None else draft_stages
    written = config.replace(
        weight_format=WeightFormat.FP8 if quantized else WeightFormat.BF16,
        expert_format=WeightFormat.FP4 if quantized else WeightFormat.BF16,
        fake_quant=quantized, num_draft_stages=stages)
    # Random values are drawn at the logical (dense) shapes; the quantized inventory says
    # which tensors are FP8 / FP4 on disk.
    dense_cfg = written.replace(weight_format=WeightFormat.BF16, expert_format=WeightFormat.BF16)
    disk_format = {n: s.dtype for n, s in tower_inventory(
        written.replace(weight_format=WeightFormat.FP8, expert_format=WeightFormat.FP4)).items()}
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
    for spec, fmt in _draft_weights(written, stages):
        emit(f"mtp{spec.name.split('.')[1]}", spec.name, _random_value(spec, config, rng), fmt)

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


def _draft_weights(cfg: ModelConfig, stages: int) -> list[tuple[TensorSpec, str]]:
    """DSpark stage tensors (spec 7.4) at logical shapes, each with its on-disk format: a
    sliding-window, score-routed block per stage, plus main_proj/main_norm on stage 0 and the
    exit (hc_head, norm, Markov and confidence heads) on the last stage. Written so loaders
    can be tested on complete checkpoints."""
    if not stages:
        return []
    block_cfg = cfg.replace(num_hidden_layers=1, layer_types=(AttentionKind.SLIDING,),
                            mlp_layer_types=(RoutingKind.SCORE,), dspark_target_layer_ids=())
    dense = tower_inventory(block_cfg.replace(weight_format=WeightFormat.BF16, expert_format=WeightFormat.BF16))
    disk = tower_inventory(block_cfg.replace(weight_format=WeightFormat.FP8, expert_format=WeightFormat.FP4))
    d, v = cfg.hidden_size, cfg.vocab_size
    rank = cfg.dspark_markov_rank or 16
    taps = len(cfg.dspark_target_layer_ids) or 3
    out = []
    for s in range(stages):
        prefix = f"mtp.{s}."
        out += [(dataclasses.replace(spec, name=prefix + name[len("layers.0."):]), disk[name].dtype)
                for name, spec in dense.items() if name.startswith("layers.0.")]
        extra = []
        if s == 0:
            extra += [("main_proj.weight", (d, taps * d), "F8_E4M3"), ("main_norm.weight", (d,), "BF16")]
        if s == stages - 1:
            extra += [("norm.weight", (d,), "BF16"), ("hc_head_fn", (cfg.hc_mult, cfg.hc_mult * d), "F32"),
                      ("hc_head_base", (cfg.hc_mult,), "F32"), ("hc_head_scale", (1,), "F32"),
                      ("markov_head.markov_w1.weight", (v, rank), "BF16"),
                      ("markov_head.markov_w2.weight", (v, rank), "BF16"),
                      ("confidence_head.proj.weight", (1, d + rank), "BF16")]
        out += [(TensorSpec(prefix + n, (), None, shape, "BF16"), dt) for n, shape, dt in extra]
    return out


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
