"""Two real processes on loopback with jax.distributed on CPU: one plan, broadcast from process 0."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np

import dsv4
from checkpoints.testing import write_tiny_checkpoint
from dsv4.batch import Chunk
from dsv4.config import TINY
from dsv4.ops.registry import ops_for
from dsv4.state import StateGeometry
from dsv4.step import StepRunner, make_buckets
from tests import multihost_worker as worker
from tests.subprocesses import child_env
from tests.tolerances import REL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_processes_run_process_zeros_plan_even_when_one_diverges(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_tiny_checkpoint(TINY.replace(num_attention_heads=8, o_groups=4, index_n_heads=8), ckpt, seed=2)
    port = _free_port()
    # Two processes on the CPU backend whatever the machine has: on a one-GPU machine both
    # would take the same GPU, which NCCL refuses.
    env = child_env(JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.multihost_worker", str(i), str(port), str(ckpt),
                               str(tmp_path / f"out{i}.json")] + (["--diverge"] if i == 1 else []),
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        logs.append(out)
    assert all(p.returncode == 0 for p in procs), "\n\n".join(log[-3000:] for log in logs)
    r0, r1 = (json.load(open(tmp_path / f"out{i}.json")) for i in range(2))
    assert r0["plans"] == r1["plans"]  # process 1's own (divergent) plan never ran
    assert len(r0["logits"]) == 4
    for a, b in zip(r0["logits"], r1["logits"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [len(x) for x in r0["logits"]] == [1, 2, 2, 2]  # process 0's plan: 1, 2, 2, 2 outputs
    # And the sharded two-process result is process 0's plan run on one device.
    model = dsv4.load_pretrained(ckpt, dtype="float32")
    geometry = StateGeometry(num_slots=3, num_pages=6, page_tokens=16, max_pages_per_seq=2, max_spec_tokens=0,
                             dtype=np.float32)
    runner = StepRunner(model.graphdef, model.params, model.config, geometry, make_buckets(16, 4),
                        ops_for("reference"), return_logits=True)
    seq = np.random.default_rng(0).integers(0, model.config.vocab_size, 20)
    for step, got in zip(worker.STEPS, r0["logits"]):
        chunks = [Chunk(slot=s, start=b, tokens=seq[b:b + n].tolist(), pages=[2 * s, 2 * s + 1], outputs=[n - 1])
                  for s, b, n in step]
        want = runner.run(chunks).logits[:len(chunks)]
        assert np.max(np.abs(np.asarray(got) - want)) <= REL[np.dtype(np.float32)] * np.max(np.abs(want))
