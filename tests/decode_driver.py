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
