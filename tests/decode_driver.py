"""Test driver: runs requests through the pure step function with chosen chunk splits.

Unlike `StepRunner`, it does not donate the state, so a test can run two different batches
from one state and compare the results bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dsv4.api import Model
from dsv4.batch import Bucket, Chunk, StepBatch, pack_batch
from dsv4.ops.registry import ops_for
from dsv4.state import StateGeometry, init_state
from dsv4.step import make_step


@dataclasses.dataclass
class Driver:
    model: Model
    geometry: StateGeometry
    bucket: Bucket

    def __post_init__(self):
        self.step = jax.jit(make_step(self.model.graphdef, self.geometry, ops_for(self.model.backend),
                                      return_logits=True))
        self.state = jax.jit(lambda: init_state(self.model.config, self.geometry))()

    def pack(self, chunks: list[Chunk]) -> StepBatch:
        return pack_batch(chunks, self.bucket, self.geometry)

    def run_batch(self, batch: StepBatch, state=None):
        """(state', host outputs) from `state` (default: the driver's), without updating the driver."""
        new_state, out = self.step(self.model.params, self.state if state is None else state, batch)
        return new_state, jax.device_get(out)

    def run(self, chunks: list[Chunk]) -> list[np.ndarray]:
        """Run one step, keep its state; per chunk, the logits [len(outputs), V] of its output rows."""
        self.state, out = self.run_batch(self.pack(chunks))
        result, o = [], 0
        for c in chunks:
            result.append(out.logits[o:o + len(c.outputs)])
            o += len(c.outputs)
        return result


def pages_for(slot: int, geometry: StateGeometry) -> list[int]:
    """A disjoint page range per slot (all of a request's pages allocated up front)."""
    n = geometry.max_pages_per_seq
    return list(range(slot * n, (slot + 1) * n))


# Prefill chunks, single decode steps and a chunk that crosses CSA and HCA windows, for two requests.
MIXED_SCHEDULE = [(0, 20), (20, 1), (21, 9), (30, 30), (60, 1), (61, 14)]


def run_schedule(driver: Driver, seqs: list[np.ndarray], schedule: list[tuple[int, int]]) -> list[np.ndarray]:
    """Feed request i (slot i) its tokens [start, start + n) per step of `schedule`, all requests
    in one step; per request, the logits [len, V] of every position it was fed."""
    got: list[list[np.ndarray]] = [[] for _ in seqs]
    for start, n in schedule:
        chunks = [Chunk(slot=i, start=start, tokens=s[start:start + n].tolist(), pages=pages_for(i, driver.geometry),
                        outputs=list(range(len(s[start:start + n])))) for i, s in enumerate(seqs) if start < len(s)]
        for c, logits in zip(chunks, driver.run(chunks)):
            got[c.slot].append(logits)
    return [np.concatenate(g) for g in got]
