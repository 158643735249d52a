"""One process of the two-process test (`tests/test_multihost.py`): joins the distributed
runtime on loopback, loads the tiny checkpoint sharded TP=2 over both processes' devices,
and runs decode steps whose plan comes from process 0. With --diverge, this process plans
different steps locally; the broadcast plan must win.

    python -m tests.multihost_worker PROCESS_ID PORT CHECKPOINT OUT_JSON [--diverge]
"""

from __future__ import annotations

import argparse
import hashlib
import json

import numpy as np

STEPS = [[(0, 0, 9)], [(0, 9, 1), (1, 0, 5)], [(0, 10, 1), (1, 5, 1)], [(0, 11, 1), (1, 6, 1)]]


def plan(diverge: bool):
    """Per step: (slot, start, n) chunks; the divergent plan shifts lengths and adds a request."""
    if not diverge:
        return STEPS
    return [[(0, 0, 7), (2, 0, 3)], [(0, 7, 1)], [(1, 0, 2)], [(0, 8, 1), (1, 2, 1)]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("process_id", type=int)
    p.add_argument("port", type=int)
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--diverge", action="store_true")
    a = p.parse_args()

    from dsv4 import multihost
    multihost.initialize(f"localhost:{a.port}", 2, a.process_id, cpu_collectives=True)

    import jax
    import dsv4
    from dsv4 import sharding as sh
    from dsv4.batch import Chunk, pack_batch
    from dsv4.ops.registry import ops_for
    from dsv4.state import StateGeometry
    from dsv4.step import StepRunner, make_buckets

    jax.config.update("jax_default_matmul_precision", "highest")
    placement = sh.Placement(sh.make_mesh(sh.Deployment.TP, (2,)), sh.Deployment.TP)
    model = dsv4.load_pretrained(a.checkpoint, dtype="float32", placement=placement)
    geometry = StateGeometry(num_slots=3, num_pages=6, page_tokens=16, max_pages_per_seq=2, max_spec_tokens=0,
                             dtype=np.float32)
    runner = StepRunner(model.graphdef, model.params, model.config, geometry, make_buckets(16, 4),
                        ops_for("reference"), return_logits=True, placement=placement)
    seq = np.random.default_rng(a.process_id if a.diverge else 0).integers(0, model.config.vocab_size, 20)
    record = {"plans": [], "logits": []}
    for step in plan(a.diverge):
        chunks = [Chunk(slot=s, start=b, tokens=seq[b:b + n].tolist(), pages=[2 * s, 2 * s + 1],
                        outputs=[n - 1]) for s, b, n in step]
        local = pack_batch(chunks, runner.bucket_for(sum(n for *_, n in step), len(step), len(step)), geometry)
        batch = multihost.broadcast_batch(local, geometry)
        digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(batch)))
        record["plans"].append(digest.hexdigest())
        out = runner.run_batch(batch)
        n_out = int((np.asarray(batch.out_rows) >= 0).sum())
        record["logits"].append(np.asarray(out.logits[:n_out]).tolist())
    with open(a.out, "w") as f:
        json.dump(record, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
