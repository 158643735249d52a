"""Converted checkpoints: the tower's parameter state as an Orbax checkpoint.

Converting once (`python -m checkpoints.convert`) replaces the official safetensors' name
remapping, expert stacking and (optionally) FP8/FP4 decoding with a direct Orbax restore in
which every array is read straight into its sharding.

Directory layout (`dst/`):

    params/                 Orbax (StandardCheckpointer) checkpoint of the parameter state, a
                            nested dict keyed by the NNX path (layer indices as strings)
    config.json             `ModelConfig.to_hf_json()` of the stored model
    params_index.json       official name -> {"dtype", "shape"} of every stored parameter
    draft/, draft_index.json  the same for the draft head (DSpark stages or MTP layer), when
                            the source has one
    dsv4_checkpoint.json    the manifest: {"format": "dsv4-orbax", "version": 1, "quantized",
                            "dtype", "fake_quant", "draft": "dspark" | "mtp" | "none",
                            "draft_tensors": [the source's mtp.* names]}

The manifest is written last, so its presence marks a complete directory (`is_converted`).
`fake_quant` lives in the manifest because `config.json` cannot express it (the official
format implies it from the weight format, which a dequantized conversion no longer has).
The draft head is stored like the tower (same dtype and quantization); a manifest without
"draft" (an older conversion) holds none.

Only process 0 writes the JSON files; Orbax coordinates the array writes itself.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from checkpoints.inventory import abstract_draft, abstract_model, path_name
from checkpoints.loader import ShardingFn
from checkpoints.safetensors_io import CheckpointError
from dsv4.config import ModelConfig
from dsv4.layers.dspark import DSparkHead
from dsv4.layers.mtp import MTPHead
from dsv4.model import Transformer, storage_config

FORMAT = "dsv4-orbax"
VERSION = 1
MANIFEST_FILE = "dsv4_checkpoint.json"
CONFIG_FILE = "config.json"
INDEX_FILE = "params_index.json"
PARAMS_DIR = "params"
DRAFT_DIR = "draft"
DRAFT_INDEX_FILE = "draft_index.json"
DRAFT_KINDS = ("none", "dspark", "mtp")
# What a model directory holds for its text, copied as they are: the tokenizer, its chat template
# (DeepSeek-V4 ships its chat format as encoding/), generation defaults, and the embedded demo
# model's marker (which selects its byte tokenizer).
TOKENIZER_ENTRIES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                     "chat_template.jinja", "generation_config.json", "encoding", "demo.json")
# Everything save_converted writes; a directory holding only these may be overwritten. The text
# files count only beside an entry no other tool writes (a tokenizer-only directory is not ours).
_OWN_ENTRIES = frozenset({MANIFEST_FILE, CONFIG_FILE, INDEX_FILE, PARAMS_DIR, DRAFT_DIR, DRAFT_INDEX_FILE})
_CONVERSION_MARKS = frozenset({MANIFEST_FILE, INDEX_FILE, PARAMS_DIR, DRAFT_DIR, DRAFT_INDEX_FILE})

DTYPES: dict[str, jnp.dtype] = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}



def is_converted(path: str | os.PathLike) -> bool:
    """True when `path` is a (complete) converted directory: its manifest exists."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST_FILE))


def check_destination(dst: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Raise FileExistsError unless `save_converted(dst, overwrite=overwrite)` may write there.

    A missing or empty directory is always fine. With `overwrite`, a directory holding only
    what a conversion writes (complete or interrupted) may be replaced; anything else (an
    official checkpoint, a home directory) is never deleted.
    """
    dst = os.fspath(dst)
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise FileExistsError(f"{dst}: exists and is not a directory")
    entries = set(os.listdir(dst)) if os.path.isdir(dst) else set()
    if not entries:
        return
    if not overwrite:
        raise FileExistsError(f"{dst}: directory is not empty; pass overwrite=True (--overwrite) to replace "
                              f"a converted checkpoint, or choose a new directory")
    own = _OWN_ENTRIES | (frozenset(TOKENIZER_ENTRIES) if entries & _CONVERSION_MARKS else frozenset())
    foreign = sorted(entries - own)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise FileExistsError(f"{dst}: refusing to overwrite a directory that is not a converted checkpoint "
                              f"(it holds {shown}); choose a new or empty directory")


def save_converted(model: Transformer, dst: str | os.PathLike, *, quantized: bool, dtype_name: str,
                   draft_tensors: Mapping[str, object] | Iterable[str] | None = None,
                   overwrite: bool = False, source: str | os.PathLike | None = None,
                   draft: DSparkHead | MTPHead | None = None) -> dict:
    """Write `model`'s parameter state and config to `dst`; returns the manifest.

    quantized / dtype_name: how `model` was loaded (`load_checkpoint(quantized=, dtype=)`); the
    state must be exactly what `abstract_model(storage_config(cfg, quantized), dtype)` builds,
    so `restore_converted` can rebuild it. draft_tensors: names (or a name-keyed mapping, such
    as `LoadReport.draft_tensors`) of draft-module tensors the source held, recorded by name.
    source: the model's directory, whose `TOKENIZER_ENTRIES` are copied along (those it has).
    draft: the model's draft head, loaded alike (`load_draft`), stored beside it.
    """
    dst = os.fspath(dst)
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype_name must be one of {sorted(DTYPES)}, got {dtype_name!r}")
    cfg = model.cfg
    hf_json = cfg.to_hf_json()
    _check_config_round_trip(cfg, hf_json)
    dtype = DTYPES[dtype_name]
    flat, index = _checked_state(model, _abstract(cfg, quantized, dtype), "model", quantized, dtype_name)
    draft_flat = draft_index = None
    if draft is not None:
        draft_flat, draft_index = _checked_state(draft, _abstract(cfg, quantized, dtype, draft=True), "draft head",
                                                 quantized, dtype_name)
    check_destination(dst, overwrite=overwrite)

    primary = jax.process_index() == 0
    if primary and os.path.isdir(dst):
        # Manifest first: an interrupted overwrite must not look complete.
        for name in (MANIFEST_FILE, CONFIG_FILE, INDEX_FILE, DRAFT_INDEX_FILE, *TOKENIZER_ENTRIES):
            if os.path.isfile(os.path.join(dst, name)):
                os.remove(os.path.join(dst, name))
        for name in (PARAMS_DIR, DRAFT_DIR, *TOKENIZER_ENTRIES):
            shutil.rmtree(os.path.join(dst, name), ignore_errors=True)
    if primary:
        os.makedirs(dst, exist_ok=True)
    _save_state(flat, os.path.join(dst, PARAMS_DIR))
    if draft_flat is not None:
        _save_state(draft_flat, os.path.join(dst, DRAFT_DIR))

    names = sorted(draft_tensors) if draft_tensors is not None else []
    manifest = {"format": FORMAT, "version": VERSION, "quantized": bool(quantized), "dtype": dtype_name,
                "fake_quant": bool(cfg.fake_quant), "draft": cfg.draft_kind if draft is not None else "none",
                "draft_tensors": names}
    if primary:
        _copy_tokenizer(source, dst)
        _write_json(os.path.join(dst, CONFIG_FILE), hf_json)
        _write_json(os.path.join(dst, INDEX_FILE), index)
        if draft_index is not None:
            _write_json(os.path.join(dst, DRAFT_INDEX_FILE), draft_index)
        _write_json(os.path.join(dst, MANIFEST_FILE), manifest)
    return manifest


def _abstract(cfg: ModelConfig, quantized: bool, dtype: jnp.dtype, *, draft: bool = False) -> nnx.Module:
    """The tower (or its draft head) as stored, with ShapeDtypeStruct leaves."""
    return (abstract_draft if draft else abstract_model)(storage_config(cfg, quantized), dtype)


def _checked_state(module: nnx.Module, abstract: nnx.Module, what: str, quantized: bool, dtype_name: str):
    """(flat state, index) of `module`, which must hold exactly the parameters of `abstract`."""
    flat = list(nnx.to_flat_state(nnx.split(module)[1]))
    index = {path_name(p): _spec_json(v.get_value()) for p, v in flat}
    expected = _index_of(abstract)
    if index != expected:
        raise ValueError(f"{what} parameters do not match quantized={quantized}, dtype={dtype_name!r}: "
                         f"{_index_diff(expected, index, 'expected', f'{what} has')}")
    return flat, index


def _save_state(flat, directory: str) -> None:
    tree = _nested({tuple(p): v.get_value() for p, v in flat})
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(directory), tree)
        ckptr.wait_until_finished()


def _copy_tokenizer(source: str | os.PathLike | None, dst: str) -> None:
    """The source directory's TOKENIZER_ENTRIES (files or directories) into dst, as they are."""
    if source is None:
        return
    for name in TOKENIZER_ENTRIES:
        src = os.path.join(os.fspath(source), name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dst, name))
        elif os.path.isfile(src):
            shutil.copy2(src, os.path.join(dst, name))


def read_manifest(src: str | os.PathLike) -> dict:
    """The validated manifest of a converted directory (CheckpointError if absent or foreign)."""
    src = os.fspath(src)
    path = os.path.join(src, MANIFEST_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{src}: not a converted checkpoint ({MANIFEST_FILE} not found); "
                              f"convert it with `python -m checkpoints.convert`")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{path}: format is {got!r}, expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: version {manifest.get('version')!r} is not supported "
                              f"(this code reads version {VERSION}); re-convert the checkpoint")
    problems = []
    if not isinstance(manifest.get("quantized"), bool):
        problems.append(f"quantized must be true/false, got {manifest.get('quantized')!r}")
    if manifest.get("dtype") not in DTYPES:
        problems.append(f"dtype must be one of {sorted(DTYPES)}, got {manifest.get('dtype')!r}")
    if not isinstance(manifest.get("fake_quant"), bool):
        problems.append(f"fake_quant must be true/false, got {manifest.get('fake_quant')!r}")
    if manifest.setdefault("draft", "none") not in DRAFT_KINDS:
        problems.append(f"draft must be one of {list(DRAFT_KINDS)}, got {manifest.get('draft')!r}")
    if not isinstance(manifest.get("draft_tensors"), list):
        problems.append(f"draft_tensors must be a list of names, got {manifest.get('draft_tensors')!r}")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    return manifest


def restore_converted(src: str | os.PathLike, *, sharding: ShardingFn | None = None,
                      fake_quant: bool | None = None, dtype: str | jnp.dtype | None = None,
                      quantized: bool | None = None) -> tuple[Transformer, dict]:
    """Rebuild the tower from a converted directory; returns (model, manifest).

    sharding: where each parameter goes, by official stacked name (as `load_checkpoint`);
    None, or a None answer, means the first device. Orbax reads each array straight into
    its sharding. fake_quant: override the stored QAT-simulation flag (it changes numerics,
    not parameters). dtype / quantized: what the caller expects; None accepts what was
    stored, anything else must match it (weights are never re-encoded at restore).
    """
    src = os.fspath(src)
    manifest, cfg = _stored_config(src, fake_quant=fake_quant, dtype=dtype, quantized=quantized)
    abstract = _abstract(cfg, manifest["quantized"], DTYPES[manifest["dtype"]])
    return _restore_module(src, abstract, PARAMS_DIR, INDEX_FILE, sharding), manifest


def restore_converted_draft(src: str | os.PathLike, *, sharding: ShardingFn | None = None,
                            fake_quant: bool | None = None, dtype: str | jnp.dtype | None = None,
                            quantized: bool | None = None) -> DSparkHead | MTPHead:
    """The draft head stored beside the tower (arguments as `restore_converted`);
    CheckpointError when the conversion kept none."""
    src = os.fspath(src)
    manifest, cfg = _stored_config(src, fake_quant=fake_quant, dtype=dtype, quantized=quantized)
    if manifest["draft"] == "none":
        raise CheckpointError(f"{src}: the conversion kept no draft head (its source had none, or it predates "
                              f"draft conversion); re-convert the official directory")
    abstract = _abstract(cfg, manifest["quantized"], DTYPES[manifest["dtype"]], draft=True)
    return _restore_module(src, abstract, DRAFT_DIR, DRAFT_INDEX_FILE, sharding)


def _stored_config(src: str, *, fake_quant: bool | None, dtype, quantized: bool | None) -> tuple[dict, ModelConfig]:
    """(manifest, config) of a converted directory, after checking the caller's expectations."""
    manifest = read_manifest(src)
    stored_dtype = DTYPES[manifest["dtype"]]
    if dtype is not None and jnp.dtype(dtype) != jnp.dtype(stored_dtype):
        raise ValueError(f"{src} was converted with dtype {manifest['dtype']}, not {jnp.dtype(dtype).name}; "
                         f"load it with that dtype or re-convert with --dtype {jnp.dtype(dtype).name}")
    if quantized is not None and quantized != manifest["quantized"]:
        flag = "--quantized" if quantized else "--dequantize"
        raise ValueError(f"{src} was converted with quantized={manifest['quantized']}; load it with "
                         f"quantized={manifest['quantized']} or re-convert with {flag}")
    try:
        cfg = ModelConfig.from_hf_json(src, fake_quant=manifest["fake_quant"] if fake_quant is None else fake_quant)
    except FileNotFoundError:
        raise CheckpointError(f"{src}: {CONFIG_FILE} not found next to {MANIFEST_FILE}") from None
    return manifest, cfg


def _restore_module(src: str, abstract: nnx.Module, directory: str, index_file: str,
                    sharding: ShardingFn | None) -> nnx.Module:
    """`abstract` filled from the Orbax checkpoint `src/directory`, each array read into its
    sharding, after checking the stored index (where present) against it."""
    params_dir = os.path.abspath(os.path.join(src, directory))
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{src}: {directory}/ not found next to {MANIFEST_FILE}")
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    index_path = os.path.join(src, index_file)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            stored = json.load(f)
        expected = {path_name(p): _spec_json(v.get_value()) for p, v in flat}
        if stored != expected:
            raise CheckpointError(f"{src}: stored parameters do not match the model this code builds from "
                                  f"{CONFIG_FILE}: {_index_diff(expected, stored, 'model expects', 'stored')}")
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(path, leaf) -> jax.ShapeDtypeStruct:
        dest = sharding(path_name(path), tuple(leaf.shape)) if sharding is not None else None
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=dest if dest is not None else default)

    targets = _nested({tuple(p): target(p, v.get_value()) for p, v in flat})
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(params_dir, targets)
    values = _flatten(restored)
    state = nnx.from_flat_state([(p, v.replace(values[tuple(str(k) for k in p)])) for p, v in flat])
    return nnx.merge(graphdef, state)


# ---- helpers ------------------------------------------------------------------------------
def _check_config_round_trip(cfg: ModelConfig, hf_json: dict) -> None:
    back = ModelConfig.from_hf_json(hf_json, fake_quant=cfg.fake_quant)
    if back != cfg:
        diff = [f"{f}: {getattr(cfg, f)!r} -> {getattr(back, f)!r}" for f in cfg.__dataclass_fields__
                if getattr(cfg, f) != getattr(back, f)]
        raise ValueError("the model config does not survive config.json; fields that change: " + "; ".join(diff))


def _index_of(abstract: nnx.Module) -> dict:
    _, state = nnx.split(abstract)
    return {path_name(p): _spec_json(v.get_value()) for p, v in nnx.to_flat_state(state)}


def _spec_json(leaf) -> dict:
    return {"dtype": np.dtype(leaf.dtype).name, "shape": [int(s) for s in leaf.shape]}


def _index_diff(a: dict, b: dict, a_name: str, b_name: str) -> str:
    lines = [f"{n}: {a_name} {_fmt(a.get(n))}, {b_name} {_fmt(b.get(n))}"
             for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]
    return "; ".join(lines[:10]) + (f"; ... and {len(lines) - 10} more" if len(lines) > 10 else "")


def _fmt(spec: dict | None) -> str:
    return "nothing" if spec is None else f"{spec['dtype']}{spec['shape']}"


def _nested(flat: Mapping[tuple, object]) -> dict:
    """{(a, 0, b): x} -> {"a": {"0": {"b": x}}}: string keys, which every Orbax version accepts."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return out


def _flatten(tree: Mapping, prefix: tuple = ()) -> dict[tuple[str, ...], object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
