"""ServingConfig: defaults < file (TOML / YAML) < flags; every bad value named."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from serving.config import ServingConfig, add_serving_flags, config_from_args


def parse(argv):
    p = argparse.ArgumentParser()
    add_serving_flags(p)
    return config_from_args(p.parse_args(argv))


def test_defaults_are_valid_and_flags_override():
    assert parse([]) == ServingConfig()
    c = parse(["--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--mesh", "2x2", "--deployment", "tp_ep",
               "--bucket-tokens", "16,512", "--max-req-tokens", "100", "--compilation-cache", "",
               "--enable-prefix-caching", "off"])
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.mesh, c.deployment) == (16, 512, (2, 2), "tp_ep")
    assert c.bucket_tokens == (16, 512) and c.max_req_tokens == 100 and c.compilation_cache is None
    assert c.enable_prefix_caching is False and parse(["--enable-prefix-caching", "true"]).enable_prefix_caching
    # A yes/no flag alone means yes, also before another flag.
    c = parse(["--allow-nonfinite", "--quantized", "off", "--enable-prefix-caching"])
    assert c.allow_nonfinite and not c.quantized and c.enable_prefix_caching


@pytest.mark.parametrize("argv, want", [
    ([], (None, ())),
    (["--tensor-parallel-size", "4"], ("tp", (4,))),
    (["--tensor-parallel-size", "2", "--expert-parallel-size", "2"], ("tp_ep", (2, 2))),
    (["--expert-parallel-size", "4"], ("tp_ep", (1, 4))),
    (["--deployment", "dp_tp", "--mesh", "2x4"], ("dp_tp", (2, 4))),
])
def test_parallel_sizes_spell_a_deployment_and_mesh(argv, want):
    assert parse(argv).parallelism() == want


@pytest.mark.parametrize("suffix, text", [
    (".toml", 'model = "/m"\nmax_num_seqs = 4\nmax_num_batched_tokens = 64\nmesh = [2]\ndeployment = "tp"\n'),
    (".yaml", "model: /m\nmax_num_seqs: 4\nmax_num_batched_tokens: 64\nmesh: [2]\ndeployment: tp\n"),
])
def test_files_and_flags_over_them(tmp_path, suffix, text):
    path = tmp_path / f"serving{suffix}"
    path.write_text(text)
    c = ServingConfig.from_file(str(path))
    assert (c.model, c.max_num_seqs, c.max_num_batched_tokens, c.mesh) == ("/m", 4, 64, (2,))
    c = parse(["--config", str(path), "--max-num-seqs", "2"])
    assert (c.model, c.max_num_seqs, c.max_num_batched_tokens) == ("/m", 2, 64)


def test_file_errors_name_the_problem(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text("max_num_seq = 4\n")
    with pytest.raises(ValueError, match=r"unknown keys \['max_num_seq'\]"):
        ServingConfig.from_file(str(bad))
    broken = tmp_path / "c.yaml"
    broken.write_text("a: [1,\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        ServingConfig.from_file(str(broken))
    bad.write_text("max_num_seqs = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        ServingConfig.from_file(str(bad))
    with pytest.raises(ValueError, match=r"\.toml, \.yaml or \.yml"):
        ServingConfig.from_file(str(tmp_path / "c.json"))


@pytest.mark.parametrize("kw, message", [
    (dict(max_num_seqs="eight"), r"max_num_seqs must be an integer, got 'eight' \(str\)"),
    (dict(max_num_seqs=4.5), r"max_num_seqs must be an integer, got 4.5 \(float\)"),
    (dict(mesh=5, deployment="tp"), r"mesh must be a list of integers, got 5 \(int\)"),
    (dict(memory_fraction="high"), "memory_fraction must be a number"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be true or false"),
    (dict(max_req_tokens=True), "max_req_tokens must be an integer or null"),
    (dict(deployment=2), "deployment must be a string or null"),
])
def test_values_of_the_wrong_type_are_named_with_the_type_expected(kw, message):
    with pytest.raises(ValueError, match=message):
        ServingConfig(**kw)


def test_a_config_file_with_wrong_types_names_the_file_key_and_type(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('max_num_seqs = "eight"\nmesh = 5\nmemory_fraction = 1\n')
    with pytest.raises(ValueError) as e:
        ServingConfig.from_file(str(path))
    assert str(path) in str(e.value) and "max_num_seqs must be an integer" in str(e.value)
    assert "mesh must be a list of integers, got 5" in str(e.value) and "memory_fraction" not in str(e.value)


@pytest.mark.parametrize("kw, message", [
    (dict(dtype="fp16"), "dtype must be"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "must be >= max_num_seqs"),
    (dict(memory_fraction=0.0), "memory_fraction"),
    (dict(max_model_len=1), "max_model_len must be >= 2"),
    (dict(max_req_tokens=10_000), "max_req_tokens must be in"),
    (dict(max_waiting=0), "max_waiting"),
    (dict(max_logprobs=-1), "max_logprobs"),
    (dict(prefix_cache_snapshots=-1), "prefix_cache_snapshots"),
    (dict(speculation="eagle"), "speculation must be none, dspark or mtp"),
    (dict(speculation="mtp", capacity_verification=True), "needs the DSpark head's confidences"),
    (dict(speculation="dspark", num_speculative_tokens=-1), "num_speculative_tokens must be >= 0"),
    (dict(capacity_verification=True), "need speculation dspark"),
    (dict(draft_fp8_head=True), "need speculation dspark"),
    (dict(deployment="tp"), "deployment and mesh go together"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size and expert_parallel_size must be >= 1"),
    (dict(deployment="tp", mesh=(2,), tensor_parallel_size=2), "either deployment and mesh or"),
    (dict(bucket_tokens=(16, 128)), "bucket_tokens must"),
])
def test_bad_values_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        ServingConfig(**kw)


def _template(cfg, slots=4, per_seq=8):
    from dsv4.state import StateGeometry, default_page_tokens

    return StateGeometry(num_slots=slots, num_pages=slots * per_seq, page_tokens=default_page_tokens(cfg),
                         max_pages_per_seq=per_seq, max_spec_tokens=0)


def test_memory_fraction_sizes_the_pages_on_a_device_that_reports_its_size():
    from dsv4.config import TINY
    from dsv4.memory import state_costs
    from serving.config import plan_pages

    cfg = TINY
    t = _template(cfg)
    config = ServingConfig(max_num_seqs=4, max_model_len=8 * t.page_tokens, memory_fraction=0.5)
    assert plan_pages(cfg, config, t, shards=1, snapshots=0, device_bytes=None, bytes_in_use=0) is None
    costs = state_costs(cfg, t)
    used = 1 << 20
    # Room for the parameters, the slots and exactly 10 pages: the plan takes 10, more
    # room is capped at what 4 full-length requests can use (4 x 8 pages).
    room = used + 4 * costs.bytes_per_slot + 10 * costs.bytes_per_page
    plan = plan_pages(cfg, config, t, shards=1, snapshots=0, device_bytes=2 * room, bytes_in_use=used)
    assert plan.num_pages == 10 and plan.num_slots == 4
    assert plan_pages(cfg, config, t, shards=1, snapshots=0, device_bytes=10 * room, bytes_in_use=used).num_pages == 32
    # Snapshots are reserved next to the parameters; two data shards plan half the slots per device.
    snaps = plan_pages(cfg, config, t, shards=1, snapshots=3, device_bytes=2 * room + 2 * 3 * costs.bytes_per_slot
                       + 2 * costs.bytes_per_page, bytes_in_use=used)
    assert snaps.num_pages == 10 and snaps.reserve_bytes == 3 * costs.bytes_per_slot + costs.bytes_per_page
    assert plan_pages(cfg, config, t, shards=2, snapshots=0, device_bytes=2 * room, bytes_in_use=used).num_slots == 2
    with pytest.raises(ValueError, match="does not fit"):
        plan_pages(cfg, config, t, shards=1, snapshots=0, device_bytes=2 * (used + 4 * costs.bytes_per_slot),
                   bytes_in_use=used)


def test_a_step_needing_more_temporaries_than_are_left_is_refused_at_start():
    from serving.config import check_workspace

    check_workspace(None, device_bytes=100, bytes_in_use=90)
    check_workspace(10, device_bytes=100, bytes_in_use=90)
    with pytest.raises(ValueError, match="11 B of temporaries but only 10 B.*lower memory_fraction"):
        check_workspace(11, device_bytes=100, bytes_in_use=90)


def test_a_checkpoint_without_a_draft_head_runs_speculation_none_and_says_so(tmp_path, caplog):
    import dsv4
    from checkpoints.loader import CheckpointError
    from checkpoints.testing import write_tiny_checkpoint
    from dsv4.config import TINY
    from serving.config import draft_to_load

    write_tiny_checkpoint(TINY, tmp_path / "plain", seed=3, quantized=False)
    write_tiny_checkpoint(TINY, tmp_path / "draft", seed=3, quantized=False, draft_stages=3)
    spec = ServingConfig(speculation="dspark")
    with caplog.at_level("WARNING", logger="serving.config"):
        assert draft_to_load(spec, str(tmp_path / "plain")) == "none"
    assert "has no draft head" in caplog.text and "speculation none" in caplog.text
    assert draft_to_load(spec, str(tmp_path / "draft")) == "dspark"
    assert draft_to_load(ServingConfig(), str(tmp_path / "draft")) == "none"
    with pytest.raises(CheckpointError, match="asked for a dspark draft head"):
        dsv4.load_pretrained(tmp_path / "plain", dtype="float32", draft="dspark")
    with caplog.at_level("WARNING", logger="serving.config"):
        assert draft_to_load(ServingConfig(speculation="mtp"), str(tmp_path / "draft")) == "none"
    assert "has a dspark head, not the mtp head asked for" in caplog.text
    model = dsv4.load_pretrained(tmp_path / "draft", dtype="float32", draft="dspark")
    assert model.draft_head is not None and model.draft_head.block_size == 5


def test_an_official_checkpoint_is_served_quantized_unless_asked_otherwise(tmp_path, monkeypatch):
    """--quantized on (the default) keeps the stored FP8/FP4 weights; off decodes them at load.
    A converted directory is served as its conversion stored it."""
    monkeypatch.setattr("serving.tokenizer.load_tokenizer", lambda *a, **k: None)  # the weights are the point
    import jax
    import jax.numpy as jnp

    from checkpoints.orbax_io import save_converted
    from checkpoints.testing import write_tiny_checkpoint
    from dsv4.config import TINY
    from serving.config import load_model

    write_tiny_checkpoint(TINY, tmp_path / "ckpt", seed=3, quantized=True)

    def dtypes(model) -> set:
        return {leaf.dtype for leaf in jax.tree.leaves(model.params)}

    fp8 = jnp.dtype(jnp.float8_e4m3fn)

    served = {}
    for flags in ([], ["--quantized", "off"]):
        served[bool(flags)] = load_model(parse(["--model", str(tmp_path / "ckpt"), "--dtype", "float32",
                                               "--compilation-cache", ""] + flags))[0]
    assert fp8 in dtypes(served[False]) and fp8 not in dtypes(served[True])
    ids = [[3, 1, 4, 1, 5]]
    np.testing.assert_allclose(np.asarray(served[False].logits(ids)), np.asarray(served[True].logits(ids)),
                               rtol=2e-5, atol=2e-5)
    save_converted(served[True].module, tmp_path / "dense", quantized=False, dtype_name="float32")
    model, _ = load_model(ServingConfig(model=str(tmp_path / "dense"), compilation_cache=None))
    assert fp8 not in dtypes(model)
