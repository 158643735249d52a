"""Multi-host: one process per host on JAX's distributed runtime, one step plan for all.

Every process must run the same compiled step, with the same bucket, on the same step
(DESIGN invariant 6). Host-side decisions (which requests run, how their tokens are laid
out, which bucket, sampling parameters and seeds) are therefore made once, on process 0,
and broadcast; other processes never derive them from their own data. The plan that
travels is the packed `StepBatch` itself: first its bucket (4 integers, a fixed shape),
then the batch in that bucket's shape. Whatever a non-zero process passes in is ignored.

Lifecycle: `initialize(...)` before anything touches a device; then per step, every
process calls `broadcast_batch(...)` and runs the returned batch.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils

from dsv4.batch import Bucket, StepBatch, pack_batch
from dsv4.state import StateGeometry


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               cpu_collectives: bool = False) -> None:
    """Join the distributed runtime (call first, before any device is touched).

    cpu_collectives: use gloo for cross-process collectives of the CPU backend (tests and
    CPU-only hosts); GPUs use NCCL without it.
    """
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def is_leader() -> bool:
    """True on the process that makes the step plan."""
    return jax.process_index() == 0


def broadcast_batch(batch: StepBatch | None, geometry: StateGeometry) -> StepBatch:
    """Process 0's batch on every process. Process 0 must pass its batch; the others may pass
    anything (None, or a locally computed batch, which is discarded)."""
    if is_leader() and batch is None:
        raise ValueError("process 0 makes the plan: it must pass the batch to broadcast")
    local_bucket = batch.bucket if is_leader() else Bucket(1, 1, 1, 0)
    header = np.asarray(dataclasses.astuple(local_bucket), np.int32)
    bucket = Bucket(*(int(v) for v in np.asarray(multihost_utils.broadcast_one_to_all(header))))
    local = batch if is_leader() else pack_batch([], bucket, geometry)
    arrays = {f.name: np.asarray(getattr(local, f.name)) for f in dataclasses.fields(StepBatch)}
    received = multihost_utils.broadcast_one_to_all(arrays)
    return StepBatch(**{k: np.asarray(v).astype(arrays[k].dtype) for k, v in received.items()})
