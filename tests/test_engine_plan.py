"""engine_plan and --dry-run: what an engine will hold, from config.json alone."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from dsv4.config import FLASH, TINY
from serving.config import ServingConfig
from serving.engine_plan import GIB, dry_run, engine_plan, run_dry_run, sharded_param_bytes
from tests.devices import require_devices


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory):
    """A FLASH directory with its config.json only: the dry run reads no weights."""
    path = tmp_path_factory.mktemp("flash")
    (path / "config.json").write_text(json.dumps(FLASH.to_hf_json()))
    return str(path)


def test_the_plan_has_decode_buckets_and_the_whole_budget():
    config = ServingConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    plan = engine_plan(TINY, config, draft_block_size=None, data_shards=1, dtype=np.dtype(np.float32))
    assert plan.slots == 4 and plan.spec_tokens == 0 and plan.prefix_caching and plan.snapshots == 16
    assert sorted({b.tokens for b in plan.buckets}) == [1, 2, 4, 64]
    spec = engine_plan(TINY, config, draft_block_size=5, data_shards=2, dtype=np.dtype(np.float32))
    assert spec.spec_tokens == 5 and not spec.prefix_caching and spec.snapshots == 0
    assert {b.tokens for b in spec.buckets} >= {16, 24, 64} and all(b.taps for b in spec.buckets)
    with pytest.raises(ValueError, match="exceeds the draft head's block size"):
        engine_plan(TINY, ServingConfig(num_speculative_tokens=6, speculation="dspark"), draft_block_size=5,
                    data_shards=1, dtype=np.dtype(np.float32))


def test_sharded_bytes_are_what_each_device_of_the_mesh_holds(tmp_path):
    # The report's per-device bytes equal the shards a sharded load puts on the first device.
    require_devices(4)
    from checkpoints.testing import write_tiny_checkpoint
    import dsv4
    from dsv4 import sharding as sh

    write_tiny_checkpoint(TINY, tmp_path, seed=0)
    mesh = (2, 2)
    placement = sh.Placement(sh.make_mesh(sh.Deployment.TP_EP, mesh), sh.Deployment.TP_EP)
    model = dsv4.load_pretrained(tmp_path, dtype="float32", placement=placement)
    first = placement.mesh.devices.flat[0]
    on_first = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(model.params)
                   for s in x.addressable_shards if s.device == first)
    got = sharded_param_bytes(model.params, "tp_ep", mesh)
    assert got.per_device == on_first and got.replicated < got.per_device < got.total
    assert sharded_param_bytes(model.params, None, ()).per_device == got.total


def test_flash_on_two_h200s_fits(flash_dir):
    report, fits = dry_run(ServingConfig(model=flash_dir, tensor_parallel_size=2, max_model_len=65536),
                           device_bytes=139 * GIB)
    assert fits, report
    assert "devices: 2 (tp, mesh 2)" in report and "weights as stored (FP8/FP4)" in report
    per_device = float(report.split("GiB in all, ")[1].split(" GiB per device")[0])
    total = float(report.split("parameters: ")[1].split(" GiB in all")[0])
    assert 140 < total < 150 and total / 2 <= per_device < 0.6 * total  # ~156 GB stored, split two ways
    assert "fits: yes" in report and "memory plan:" in report


def test_flash_on_one_h200_does_not_fit(flash_dir):
    report, fits = dry_run(ServingConfig(model=flash_dir), device_bytes=139 * GIB)
    assert not fits and "fits: NO" in report and "does not fit" in report


def test_the_dry_run_flag_loads_no_weights(flash_dir, monkeypatch, capsys):
    import serving.config
    from serving import generate, grpc_server

    def refuse(*a, **k):
        raise AssertionError("a dry run loads no weights")

    monkeypatch.setattr(serving.config, "load_model", refuse)
    argv = ["--model", flash_dir, "--tensor-parallel-size", "2", "--dry-run", "--device-memory-gib", "139"]
    assert grpc_server.main(argv) == 0
    assert "fits: yes" in capsys.readouterr().out
    assert generate.main(argv + ["--prompt", "hi"]) == 0
    assert "buckets (" in capsys.readouterr().out
    assert grpc_server.main(["--model", flash_dir, "--dry-run", "--device-memory-gib", "139"]) == 1
    assert grpc_server.main(["--model", flash_dir, "--dry-run", "--device-memory-gib", "-1"]) == 2
    assert grpc_server.main(["--model", str(flash_dir) + "-missing", "--dry-run"]) == 2
    assert "cannot plan" in capsys.readouterr().err


def test_run_dry_run_on_the_demo_model_without_a_device_size(tmp_path, capsys):
    assert run_dry_run(ServingConfig(demo_dir=str(tmp_path / "demo"), compilation_cache=None), None) == 0
    out = capsys.readouterr().out
    # A CPU reports no memory size; a GPU does, and its memory is planned.
    assert "resolved config:" in out and ("no device size" if jax.default_backend() == "cpu" else "memory plan:") in out
