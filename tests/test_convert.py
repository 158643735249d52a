"""Tests for checkpoints/convert.py and checkpoints/orbax_io.py.

The oracle is the safetensors loader: a converted-then-restored model must hold exactly the
arrays `load_checkpoint` builds from the same directory (every leaf, bit for bit, dtype
included) and so give identical logits. Both storage modes are covered (quantized keeps
float8 / uint8 / int8 leaves, dequantized holds dense ones).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints import orbax_io
from checkpoints.convert import main
from checkpoints.inventory import path_name
from checkpoints.loader import load_checkpoint
from checkpoints.safetensors_io import CheckpointError
from checkpoints.testing import write_tiny_checkpoint
from dsv4.config import TINY, ModelConfig
from dsv4.ops.registry import ops_for

SEED = 7
DRAFT_STAGES = 3  # TINY's DSpark head, whole


# Text files of a model directory, as DeepSeek-V4 ships them (contents only need to survive).
TOKENIZER_FILES = {"tokenizer.json": '{"model": "stand-in"}', "tokenizer_config.json": '{"bos_token": "<s>"}',
                   "encoding/encoding_dsv4.py": "# the chat format\n"}


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    path = tmp_path_factory.mktemp("official")
    write_tiny_checkpoint(TINY, path, SEED, quantized=True, float_dtype="F32", draft_stages=DRAFT_STAGES)
    for name, text in TOKENIZER_FILES.items():
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_text(text)
    return path


@pytest.fixture(scope="module")
def converted(official, tmp_path_factory):
    """mode -> (converted directory, CLI exit code)."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for mode, flag in (("quantized", "--quantized"), ("dequantized", "--dequantize")):
        dst = root / mode
        out[mode] = (dst, main([str(official), str(dst), flag, "--dtype", "bfloat16"]))
    return out


def _leaves(model) -> dict[str, jax.Array]:
    _, state = nnx.split(model)
    return {path_name(p): v.get_value() for p, v in nnx.to_flat_state(state)}


def _differences(a: dict, b: dict) -> list[str]:
    """Names whose presence, dtype, shape or bytes differ between two leaf dicts."""
    bad = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        x, y = np.asarray(a[name]), np.asarray(b[name])
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            bad.append(name)
    return bad


@jax.jit(static_argnums=0)
def _forward(graphdef, state, ids):
    return nnx.merge(graphdef, state).forward(ids, ops_for("reference"))


def _logits(model) -> np.ndarray:
    # Equal graphdefs share one compilation once both states are committed alike (the loader
    # leaves arrays uncommitted, Orbax commits them; placement does not change values).
    ids = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 40)), jnp.int32)
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    return np.asarray(_forward(graphdef, state, ids))


@pytest.mark.parametrize("mode", ["quantized", "dequantized"])
def test_restore_is_bit_identical_to_direct_load(official, converted, mode):
    dst, rc = converted[mode]
    assert rc == 0
    direct, _ = load_checkpoint(official, dtype=jnp.bfloat16, quantized=mode == "quantized")
    restored, manifest = orbax_io.restore_converted(dst)
    assert restored.cfg == direct.cfg
    a, b = _leaves(direct), _leaves(restored)
    assert len(a) > 50
    assert _differences(a, b) == []
    dtypes = {np.dtype(v.dtype).name for v in b.values()}
    if mode == "quantized":
        assert {"float8_e4m3fn", "uint8", "int8", "int32"} <= dtypes
    else:
        assert "float8_e4m3fn" not in dtypes and "bfloat16" in dtypes
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert all(v.sharding == default for v in b.values())
    np.testing.assert_array_equal(_logits(restored), _logits(direct))


def test_the_tokenizer_files_come_along(converted):
    for dst, code in converted.values():
        assert code == 0
        for name, text in TOKENIZER_FILES.items():
            assert (dst / name).read_text() == text, name


@pytest.mark.parametrize("mode", ["quantized", "dequantized"])
def test_the_draft_head_is_converted_bit_for_bit(official, converted, mode):
    from checkpoints.loader import draft_kind, load_draft

    dst = converted[mode][0]
    kind = draft_kind(official)
    assert kind != "none" and draft_kind(dst) == kind
    direct = load_draft(official, dtype=jnp.bfloat16, quantized=mode == "quantized")
    restored = orbax_io.restore_converted_draft(dst)
    a, b = _leaves(direct), _leaves(restored)
    assert a and _differences(a, b) == []


def test_a_converted_demo_model_serves_like_its_source_with_speculation(tmp_path, capsys):
    # Same text tokenizer, same greedy tokens with the draft head drafting.
    from serving import generate
    from serving.demo_model import ensure_demo_checkpoint
    from serving.tokenizer import ByteTokenizer, load_tokenizer

    demo = ensure_demo_checkpoint(str(tmp_path / "demo"))
    converted = str(tmp_path / "converted")
    assert main([demo, converted, "--dequantize", "--dtype", "float32"]) == 0
    tok = load_tokenizer(converted, vocab_size=TINY.vocab_size, bos_token_id=TINY.bos_token_id,
                         eos_token_id=TINY.eos_token_id)
    assert isinstance(tok, ByteTokenizer)
    outputs = {}
    for name, model in (("source", demo), ("converted", converted)):
        out = tmp_path / f"{name}.jsonl"
        assert generate.main(["--model", model, "--quantized", "off", "--dtype", "float32", "--prompt", "hello",
                              "--prompt", "abc", "--max-tokens", "6", "--ignore-eos", "--speculation", "dspark",
                              "--num-speculative-tokens", "2", "--max-num-seqs", "2", "--max-num-batched-tokens",
                              "16", "--bucket-tokens", "16", "--max-model-len", "32", "--compilation-cache", "",
                              "--no-progress", "--output", str(out)]) == 0
        records = [json.loads(line) for line in out.read_text().splitlines()]
        outputs[name] = {r["id"]: r["token_ids"] for r in records}
        assert all(r["usage"]["draft_tokens"] > 0 for r in records)
    assert outputs["converted"] == outputs["source"]


def test_difference_check_sees_one_flipped_bit(official, converted):
    # The comparison above must be able to fail: flip one bit of one FP8 code.
    restored, _ = orbax_io.restore_converted(converted["quantized"][0])
    a = _leaves(restored)
    name = next(n for n, v in a.items() if v.dtype == jnp.float8_e4m3fn)
    b = dict(a)
    flipped = np.asarray(a[name]).copy()
    flipped.view(np.uint8).reshape(-1)[0] ^= 1
    b[name] = flipped
    assert _differences(a, b) == [name]
    b[name] = np.asarray(a[name]).astype(np.float32)
    assert _differences(a, b) == [name]


def test_manifest_and_config(official, converted):
    for mode, quantized in (("quantized", True), ("dequantized", False)):
        dst = converted[mode][0]
        assert orbax_io.is_converted(dst)
        with open(dst / "dsv4_checkpoint.json") as f:
            manifest = json.load(f)
        with open(official / "model.safetensors.index.json") as f:
            drafts = sorted(n for n in json.load(f)["weight_map"] if n.startswith("mtp."))
        assert drafts
        assert manifest == {"format": "dsv4-orbax", "version": 1, "quantized": quantized, "dtype": "bfloat16",
                            "fake_quant": True, "draft": ModelConfig.from_hf_json(official).draft_kind,
                            "draft_tensors": drafts}
    # fake_quant survives although the dequantized config.json has no FP8 weights to imply it.
    restored, _ = orbax_io.restore_converted(converted["dequantized"][0])
    assert restored.cfg.fake_quant
    assert not orbax_io.is_converted(official)


def test_fake_quant_flag_and_dtype_float32(official, tmp_path):
    dst = tmp_path / "f32"
    assert main([str(official), str(dst), "--dequantize", "--dtype", "float32", "--fake-quant", "off"]) == 0
    restored, manifest = orbax_io.restore_converted(dst)
    assert manifest["dtype"] == "float32" and manifest["fake_quant"] is False
    assert not restored.cfg.fake_quant
    direct, _ = load_checkpoint(official, dtype=jnp.float32, config_overrides={"fake_quant": False})
    assert _differences(_leaves(direct), _leaves(restored)) == []


def test_restore_sharding_callable_gets_official_names(converted):
    dst = converted["quantized"][0]
    device = jax.devices()[-1]
    asked = []

    def sharding(name, shape):
        asked.append(name)
        return jax.sharding.SingleDeviceSharding(device) if name.startswith("layers.") else None

    restored, _ = orbax_io.restore_converted(dst, sharding=sharding)
    leaves = _leaves(restored)
    assert sorted(asked) == sorted(leaves)
    assert "layers.1.ffn.experts.w1.weight" in asked and "embed.weight" in asked
    for name, v in leaves.items():  # None means the default device
        assert v.sharding.device_set == {device if name.startswith("layers.") else jax.devices()[0]}, name


def test_restore_checks_expectations(converted):
    dst = converted["quantized"][0]
    with pytest.raises(ValueError, match="quantized=True"):
        orbax_io.restore_converted(dst, quantized=False)
    with pytest.raises(ValueError, match="dtype bfloat16"):
        orbax_io.restore_converted(dst, dtype=jnp.float32)
    model, _ = orbax_io.restore_converted(dst, quantized=True, dtype="bfloat16", fake_quant=False)
    assert not model.cfg.fake_quant


def test_overwrite_refused_then_allowed(official, converted, tmp_path, capsys):
    dst = converted["quantized"][0]
    before = (dst / "dsv4_checkpoint.json").read_text()
    assert main([str(official), str(dst)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (dst / "dsv4_checkpoint.json").read_text() == before

    copy = tmp_path / "again"
    assert main([str(official), str(copy)]) == 0
    assert main([str(official), str(copy), "--dequantize", "--overwrite"]) == 0
    _, manifest = orbax_io.restore_converted(copy)
    assert manifest["quantized"] is False

    # Never deletes a directory it did not write, even with --overwrite.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main([str(official), str(foreign), "--overwrite"]) == 2
    assert "not a converted checkpoint" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me"
    # Nor a tokenizer-only directory (tokenizer files are a conversion's only beside its own files).
    tokenizer_only = tmp_path / "tokenizer_only"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer.json").write_text("{}")
    assert main([str(official), str(tokenizer_only), "--overwrite"]) == 2
    assert (tokenizer_only / "tokenizer.json").read_text() == "{}"
    # The copied files are replaced on overwrite, not duplicated or refused.
    assert (copy / "encoding" / "encoding_dsv4.py").is_file()


def test_bad_source_exits_2_naming_the_problem(official, tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main([str(missing), str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and "no such directory" in err
    assert err.count("\n") == 1

    # A directory without safetensors shards.
    empty = tmp_path / "no_shards"
    empty.mkdir()
    (empty / "config.json").write_text((official / "config.json").read_text())
    assert main([str(empty), str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model.safetensors" in err and err.count("\n") == 1

    # A config.json that does not fit the shards: the loader's error names the tensors.
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(official):
        if f != "config.json":
            os.symlink(official / f, broken / f)
    cfg = json.loads((official / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 64}))
    assert main([str(broken), str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "problem(s)" in err and "layers.0.ffn.experts." in err
    assert not os.path.exists(tmp_path / "o1") and not os.path.exists(tmp_path / "o3")


def test_progress_lines(official, tmp_path, capsys):
    dst = tmp_path / "out"
    assert main([str(official), str(dst)]) == 0
    out = capsys.readouterr().out
    assert f"loading {official}" in out
    assert "tower tensors" in out and "MiB" in out
    assert f"writing {dst}" in out
    assert out.strip().splitlines()[-1].startswith(f"done: {official} -> {dst}")


def test_restore_errors(converted, official, tmp_path):
    with pytest.raises(CheckpointError, match="not a converted checkpoint"):
        orbax_io.restore_converted(official)

    def tampered(name, edit):
        dst = tmp_path / name
        src = converted["quantized"][0]
        dst.mkdir()
        for f in os.listdir(src):
            os.symlink(src / f, dst / f)
        for f in ("dsv4_checkpoint.json", "config.json"):
            os.remove(dst / f)
            (dst / f).write_text((src / f).read_text())
        edit(dst)
        return dst

    def edit_json(file, **changes):
        def edit(dst):
            obj = json.loads((dst / file).read_text())
            obj.update(changes)
            (dst / file).write_text(json.dumps(obj))
        return edit

    with pytest.raises(CheckpointError, match="format is 'other'"):
        orbax_io.restore_converted(tampered("fmt", edit_json("dsv4_checkpoint.json", format="other")))
    with pytest.raises(CheckpointError, match="version 9"):
        orbax_io.restore_converted(tampered("ver", edit_json("dsv4_checkpoint.json", version=9)))
    with pytest.raises(CheckpointError, match="dtype must be one of"):
        orbax_io.restore_converted(tampered("dt", edit_json("dsv4_checkpoint.json", dtype="int4")))
    # Claiming dense storage for quantized arrays: the stored parameters no longer fit.
    with pytest.raises(CheckpointError, match=r"stored parameters do not match.*float8_e4m3fn"):
        orbax_io.restore_converted(tampered("q", edit_json("dsv4_checkpoint.json", quantized=False)))
    # A config.json that describes a different model.
    with pytest.raises(CheckpointError, match="stored parameters do not match"):
        orbax_io.restore_converted(tampered("cfg", edit_json("config.json", moe_intermediate_size=64)))
    with pytest.raises(CheckpointError, match="config.json not found"):
        orbax_io.restore_converted(tampered("nocfg", lambda d: os.remove(d / "config.json")))


def test_save_refuses_mismatched_description(official, tmp_path):
    model, _ = load_checkpoint(official, dtype=jnp.bfloat16, quantized=True)
    with pytest.raises(ValueError, match="quantized=False"):
        orbax_io.save_converted(model, tmp_path / "x", quantized=False, dtype_name="bfloat16")
    with pytest.raises(ValueError, match="dtype_name"):
        orbax_io.save_converted(model, tmp_path / "y", quantized=True, dtype_name="fp8")
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


def test_a_broken_draft_head_is_left_behind_with_a_warning(tmp_path, capsys):
    partial = tmp_path / "partial"
    # The config names three target layers (three stages); the files hold one stage.
    write_tiny_checkpoint(TINY, partial, SEED, quantized=True, float_dtype="F32", draft_stages=1)
    assert main([str(partial), str(tmp_path / "dst")]) == 0
    assert "the draft head is not converted (speculation will be off)" in capsys.readouterr().err
    assert orbax_io.read_manifest(tmp_path / "dst")["draft"] == "none"
    with pytest.raises(CheckpointError, match="kept no draft head"):
        orbax_io.restore_converted_draft(tmp_path / "dst")
