"""Backend selection for the hot ops: an explicit enum, never an environment variable."""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

import jax

from dsv4.ops.indexer_topk import reference as indexer_ref
from dsv4.ops.moe_experts import reference as moe_ref
from dsv4.ops.sparse_attention import reference as attn_ref


class Backend(enum.Enum):
    """Which implementation runs the hot ops."""

    REFERENCE = "reference"  # pure JAX / XLA


def embedding_rows(table_VD: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of the embedding table for token ids (any shape): [*ids.shape, D]."""
    return table_VD[ids]


@dataclasses.dataclass(frozen=True)
class OpSet:
    """The hot ops, plus the ops whose data a mesh splits (`dsv4.sharding.Placement.shard_ops`
    replaces `moe_experts` and `embedding` with shard-local versions)."""

    sparse_attention: Callable  # whole-sequence form
    sparse_attention_paged: Callable  # decode-step form over stored tables
    indexer_topk: Callable
    indexer_topk_paged: Callable
    moe_experts: Callable  # (x [T, D], sel [T, K], w [T, K], w1, w3, w2: ExpertStack, limit) -> f32 [T, D]
    embedding: Callable = embedding_rows  # (table [V, D], ids) -> [*ids.shape, D]


_REGISTRY: dict[Backend, OpSet] = {
    Backend.REFERENCE: OpSet(
        sparse_attention=attn_ref.sparse_attention,
        sparse_attention_paged=attn_ref.sparse_attention_paged,
        indexer_topk=indexer_ref.indexer_topk,
        indexer_topk_paged=indexer_ref.indexer_topk_paged,
        moe_experts=moe_ref.moe_experts,
    ),
}


def parse_backend(backend: Backend | str) -> Backend:
    """An enum member from a member or its value; a clear error otherwise."""
    try:
        return Backend(backend)
    except ValueError:
        raise ValueError(f"unknown backend {backend!r}; choose one of {[b.value for b in Backend]}") from None


def ops_for(backend: Backend | str) -> OpSet:
    """The op implementations of `backend` (an enum member or its value)."""
    return _REGISTRY[parse_backend(backend)]
