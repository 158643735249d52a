"""Official-format loader: tensor checks, draft tensors kept aside, quantized == dequantised twin."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4
from checkpoints.loader import load_checkpoint
from checkpoints.safetensors_io import CheckpointError, CheckpointReader, read_header, write_file
from checkpoints.testing import write_tiny_checkpoint
from dsv4.config import TINY
from dsv4.sampling import NonFiniteLogitsError
from tests.devices import require_devices


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("q")
    write_tiny_checkpoint(TINY, d, seed=5, quantized=True, float_dtype="F32", draft_stages=3)
    return d


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    write_tiny_checkpoint(TINY, d, seed=5, quantized=False, float_dtype="F32")
    return d


def _ids(seed=0, shape=(2, 37)):
    return np.asarray(jax.random.randint(jax.random.key(seed), shape, 0, TINY.vocab_size), np.int32)


def test_quantized_checkpoint_matches_its_dequantised_twin(quantized_dir, dense_dir):
    ids = _ids()
    twin = dsv4.load_pretrained(dense_dir, dtype="float32").logits(ids)
    in_memory = dsv4.load_pretrained(quantized_dir, dtype="float32", quantized=True, fake_quant=False).logits(ids)
    at_load = dsv4.load_pretrained(quantized_dir, dtype="float32", quantized=False, fake_quant=False).logits(ids)
    scale = float(jnp.max(jnp.abs(twin)))
    assert scale > 0.1
    np.testing.assert_allclose(in_memory, twin, atol=1e-5 * scale, rtol=0)
    np.testing.assert_allclose(at_load, twin, atol=1e-5 * scale, rtol=0)


def test_quantized_checkpoint_really_is_quantized(quantized_dir):
    reader = CheckpointReader(quantized_dir)
    assert reader.refs["layers.1.attn.wq_a.weight"].dtype == "F8_E4M3"
    assert reader.refs["layers.1.attn.wq_a.scale"].dtype == "F8_E8M0"
    assert reader.refs["layers.1.ffn.experts.0.w1.weight"].dtype == "I8"
    assert reader.refs["layers.1.ffn.experts.0.w1.weight"].shape == (TINY.moe_intermediate_size,
                                                                      TINY.hidden_size // 2)
    assert reader.refs["layers.0.ffn.gate.tid2eid"].dtype == "I64"
    model, _ = load_checkpoint(quantized_dir, dtype=jnp.float32, quantized=True)
    assert model.layers[1].attn.wq_a.weight[...].dtype == jnp.float8_e4m3fn
    assert model.layers[1].ffn.experts.w1.weight[...].dtype == jnp.int8
    assert model.cfg.fake_quant  # FP8 checkpoints run the official QAT simulation by default


def test_fake_quant_changes_logits_slightly(quantized_dir):
    ids = _ids(1)
    on = dsv4.load_pretrained(quantized_dir, dtype="float32", fake_quant=True).logits(ids)
    off = dsv4.load_pretrained(quantized_dir, dtype="float32", fake_quant=False).logits(ids)
    diff = float(jnp.max(jnp.abs(on - off)))
    assert 0 < diff < 0.5 * float(jnp.max(jnp.abs(off)))


def test_draft_tensors_are_kept_aside(quantized_dir, dense_dir):
    _, report = load_checkpoint(quantized_dir, dtype=jnp.float32)
    assert report.draft_stages == (0, 1, 2)
    assert "mtp.0.main_proj.weight" in report.draft_tensors
    assert "mtp.2.markov_head.markov_w1.weight" in report.draft_tensors
    assert "kept aside" in report.summary()
    _, report = load_checkpoint(dense_dir, dtype=jnp.float32)
    assert report.draft_tensors == {} and "'none'" in report.summary()


def _rewrite_shard(directory, mutate):
    """Apply `mutate(dict)` to the tensors of the shard holding layer 1 and rewrite it in place."""
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        index = json.load(f)
    file = index["weight_map"]["layers.1.attn.wq_a.weight"]
    path = os.path.join(directory, file)
    reader = CheckpointReader(directory)
    names = [n for n, r in read_header(path).items()]
    tensors = {n: reader.read(n) for n in names}
    e8m0 = frozenset(n for n in names if reader.refs[n].dtype == "F8_E8M0")
    reader.close()
    mutate(tensors)
    write_file(path, tensors, e8m0)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n in tensors or f != file}
    index["weight_map"].update({n: file for n in tensors})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def test_missing_unexpected_and_misshaped_tensors_are_all_named(tmp_path):
    write_tiny_checkpoint(TINY, tmp_path, seed=1, quantized=True)

    def mutate(t):
        del t["layers.1.attn.wkv.weight"]
        t["layers.1.attn.not_a_weight"] = np.zeros((3,), np.float32)
        t["layers.1.attn.attn_sink"] = np.zeros((TINY.num_attention_heads + 1,), np.float32)

    _rewrite_shard(tmp_path, mutate)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    msg = str(err.value)
    assert "missing tensor layers.1.attn.wkv.weight: expected F8_E4M3[40, 64]" in msg
    assert "unexpected tensor layers.1.attn.not_a_weight" in msg
    assert f"tensor layers.1.attn.attn_sink: expected F32[{TINY.num_attention_heads}], found F32[7]" in msg


def test_wrong_quantized_dtype_is_named(tmp_path):
    write_tiny_checkpoint(TINY, tmp_path, seed=1, quantized=True)
    _rewrite_shard(tmp_path, lambda t: t.update({"layers.1.attn.wq_a.weight":
                                                  t["layers.1.attn.wq_a.weight"].astype(np.float32)}))
    with pytest.raises(CheckpointError, match=r"layers.1.attn.wq_a.weight: expected F8_E4M3\[48, 64\], found F32"):
        load_checkpoint(tmp_path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_json()))
    with pytest.raises(CheckpointError, match="neither"):
        load_checkpoint(tmp_path)


def test_reader_reads_one_tensor_at_a_time(dense_dir):
    reader = CheckpointReader(dense_dir)
    ref = reader.refs["layers.2.attn.compressor.ape"]
    arr = reader.read(ref.name)
    assert arr.shape == (TINY.hca_ratio, TINY.head_dim) and arr.dtype == np.float32
    # A memory map of the shard, not a read of the whole file.
    assert isinstance(reader._maps[ref.file], np.memmap)


def test_logits_validation(dense_dir):
    model = dsv4.load_pretrained(dense_dir, dtype="float32")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.logits([[1, TINY.vocab_size]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.logits([[-1, 2]])
    with pytest.raises(ValueError, match="empty"):
        model.logits(np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="shape"):
        model.logits([1, 2, 3])
    with pytest.raises(ValueError, match="integers"):
        model.logits([[1.5, 2.0]])
    out = model.logits([[0, 5, 9]])
    assert out.shape == (1, 3, TINY.vocab_size) and out.dtype == jnp.float32


def test_bad_load_options(dense_dir):
    with pytest.raises(ValueError, match="dtype"):
        dsv4.load_pretrained(dense_dir, dtype="int8")
    with pytest.raises(ValueError, match="backend"):
        dsv4.load_pretrained(dense_dir, backend="cuda-magic")


def test_model_is_causal_and_batch_independent(dense_dir):
    model = dsv4.load_pretrained(dense_dir, dtype="float32")
    ids = _ids(3, (2, 41))
    full = np.asarray(model.logits(ids))
    prefix = np.asarray(model.logits(ids[:, :23]))
    one = np.asarray(model.logits(ids[1:]))
    scale = np.abs(full).max()
    np.testing.assert_allclose(prefix, full[:, :23], atol=1e-5 * scale, rtol=0)
    np.testing.assert_allclose(one[0], full[1], atol=1e-5 * scale, rtol=0)


def test_bfloat16_model_tracks_float32(dense_dir):
    from tests.tolerances import REL

    ids = _ids(4)
    f32 = np.asarray(dsv4.load_pretrained(dense_dir, dtype="float32").logits(ids))
    bf16 = np.asarray(dsv4.load_pretrained(dense_dir, dtype="bfloat16").logits(ids))
    assert bf16.dtype == np.float32  # logits are always f32
    per_position = np.abs(bf16 - f32).max(-1) / np.abs(f32).max()
    assert per_position.max() > 0  # really ran in bf16
    # Expert and indexer selections are discrete: a near tie that flips under bf16 moves a
    # position's logits a lot (spec 10.1 #4-6), so most positions, not all, must be close.
    assert np.mean(per_position <= REL[np.dtype("bfloat16")]) >= 0.8
    assert np.mean(bf16.argmax(-1) == f32.argmax(-1)) >= 0.85


def test_loader_places_each_tensor_with_its_sharding(dense_dir):
    device = jax.devices()[-1]
    seen = []

    def sharding(name, shape):
        seen.append(name)
        return jax.sharding.SingleDeviceSharding(device)

    model, _ = load_checkpoint(dense_dir, dtype=jnp.float32, sharding=sharding)
    assert "layers.1.ffn.experts.w1.weight" in seen and "embed.weight" in seen
    assert model.layers[1].ffn.experts.w1.weight[...].devices() == {device}


def test_loader_reports_progress(dense_dir):
    calls = []
    _, report = load_checkpoint(dense_dir, dtype=jnp.float32, progress=lambda *a: calls.append(a))
    done, total, n_bytes = zip(*calls)
    assert list(done) == list(range(1, total[0] + 1)) and set(total) == {total[0]}
    assert n_bytes[-1] == report.n_bytes and list(n_bytes) == sorted(n_bytes)


def test_loader_places_each_tensor_onto_its_mesh_shards(dense_dir):
    require_devices(2)
    from dsv4 import sharding as sh

    placement = sh.Placement(sh.make_mesh(sh.Deployment.TP, (2,)), sh.Deployment.TP)
    model, _ = load_checkpoint(dense_dir, dtype=jnp.float32, sharding=placement.param_sharding)
    plain, _ = load_checkpoint(dense_dir, dtype=jnp.float32)
    w = model.layers[1].ffn.experts.w1.weight[...]
    assert w.sharding.spec == jax.sharding.PartitionSpec("tensor", None, None)
    assert w.addressable_shards[0].data.shape[0] == w.shape[0] // 2
    for (_, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(plain))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))


def _overwrite(directory, name: str, offset: int, data: bytes) -> None:
    """Replace bytes of one stored tensor, `offset` bytes into it."""
    ref = CheckpointReader(directory).refs[name]
    assert ref.begin + offset + len(data) <= ref.end
    with open(ref.file, "r+b") as f:
        f.seek(ref.begin + offset)
        f.write(data)


def test_weights_holding_nan_or_inf_are_refused_naming_them_unless_allowed(tmp_path):
    """A NaN in a bf16 norm, an e4m3 NaN code in an FP8 weight, an E8M0 NaN scale and an Inf in
    the draft head: loading names each (quantized as stored, and decoded), and goes on only
    when allowed."""
    spec = TINY.replace(num_draft_stages=1, dspark_block_size=3, dspark_noise_token_id=1,
                        dspark_target_layer_ids=(4,), dspark_markov_rank=4)
    write_tiny_checkpoint(spec, tmp_path, seed=5, quantized=True)
    reader = CheckpointReader(tmp_path)
    draft_name = next(n for n, r in reader.refs.items() if n.startswith("mtp.") and r.dtype == "BF16")
    reader.close()
    _overwrite(tmp_path, "layers.0.attn_norm.weight", 2, b"\xc0\x7f")  # bf16 NaN
    _overwrite(tmp_path, "layers.1.attn.wq_a.weight", 5, b"\x7f")  # e4m3 NaN
    _overwrite(tmp_path, "layers.2.attn.wq_b.scale", 0, b"\xff")  # E8M0 NaN
    _overwrite(tmp_path, draft_name, 0, b"\x80\x7f")  # bf16 +Inf
    stored = ["layers.0.attn_norm.weight", "layers.1.attn.wq_a.weight", "layers.2.attn.wq_b.scale",
              "draft " + draft_name]
    decoded = stored[:2] + ["layers.2.attn.wq_b.weight", stored[3]]  # the NaN scale spoils its weight
    for quantized, names in ((True, stored), (False, decoded)):
        with pytest.raises(CheckpointError, match="4 parameter\\(s\\) hold NaN or infinite values") as err:
            dsv4.load_pretrained(tmp_path, dtype="float32", quantized=quantized, draft="dspark")
        assert all(n in str(err.value) for n in names), (names, str(err.value))
        model = dsv4.load_pretrained(tmp_path, dtype="float32", quantized=quantized, draft="dspark",
                                     allow_nonfinite=True)
        assert model.draft_head is not None
    with pytest.raises(NonFiniteLogitsError, match="NaN or infinite"):  # the NaN norm spoils every logit
        model.generate([1, 2, 3], 2, max_num_seqs=1, max_num_batched_tokens=8)
