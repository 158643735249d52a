"""Backend selection for the hot ops: an explicit enum, never an environment variable."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Callable

import jax

from dsv4.ops.fp8_linear import reference as fp8_linear_ref
from dsv4.ops.indexer_topk import reference as indexer_ref
from dsv4.ops.kv_write import reference as kv_write_ref
from dsv4.ops.moe_experts import reference as moe_ref
from dsv4.ops.sparse_attention import reference as attn_ref


class Backend(enum.Enum):
    """Which implementation runs the hot ops."""

    REFERENCE = "reference"  # pure JAX / XLA
    FFI = "ffi"  # the C++/CUDA kernels of ffi_kernels (XLA FFI) where the platform has them


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
    moe_experts: Callable  # (x [T, D], sel [T, K], w [T, K], w1, w3, w2: ExpertStack, limit, act_quant) -> f32 [T, D]
    table_write: Callable = kv_write_ref.table_write  # (EntryTable, rows [n], values [n, W]) -> EntryTable
    # REF's FP8 linear: (x [..., K], weight e4m3 [N, K], scale E8M0 [N/128, K/128], out_dtype) -> [..., N]
    fp8_linear: Callable = fp8_linear_ref.fp8_linear
    embedding: Callable = embedding_rows  # (table [V, D], ids) -> [*ids.shape, D]
    # The attention, indexer and write ops are custom calls that XLA's partitioner cannot split:
    # on a mesh `Placement.shard_ops` runs them in shard_map (heads per device, the rest replicated).
    custom_calls: bool = False


_REGISTRY: dict[Backend, OpSet] = {
    Backend.REFERENCE: OpSet(
        sparse_attention=attn_ref.sparse_attention,
        sparse_attention_paged=attn_ref.sparse_attention_paged,
        indexer_topk=indexer_ref.indexer_topk,
        indexer_topk_paged=indexer_ref.indexer_topk_paged,
        moe_experts=moe_ref.moe_experts,
    ),
}


@functools.cache
def _ffi_ops() -> OpSet:
    # Imported on first use: importing ffi_kernels loads the built libraries and registers them.
    from dsv4.ops.fp8_linear import ffi as fp8_linear_ffi
    from dsv4.ops.indexer_topk import ffi as indexer_ffi
    from dsv4.ops.kv_write import ffi as kv_write_ffi
    from dsv4.ops.moe_experts import ffi as moe_ffi
    from dsv4.ops.sparse_attention import ffi as attn_ffi

    return OpSet(
        sparse_attention=attn_ffi.sparse_attention,
        sparse_attention_paged=attn_ffi.sparse_attention_paged,
        indexer_topk=indexer_ffi.indexer_topk,
        indexer_topk_paged=indexer_ffi.indexer_topk_paged,
        moe_experts=moe_ffi.moe_experts,
        table_write=kv_write_ffi.table_write,
        fp8_linear=fp8_linear_ffi.fp8_linear,
        custom_calls=True,
    )


def parse_backend(backend: Backend | str) -> Backend:
    """An enum member from a member or its value; a clear error otherwise."""
    try:
        return Backend(backend)
    except ValueError:
        raise ValueError(f"unknown backend {backend!r}; choose one of {[b.value for b in Backend]}") from None


def ops_for(backend: Backend | str) -> OpSet:
    """The op implementations of `backend` (an enum member or its value).

    FFI: the kernels run on whichever platform the program is compiled for; a platform whose
    library was not built fails at trace time with `ffi_kernels.FfiNotBuiltError`.
    """
    backend = parse_backend(backend)
    if backend is Backend.FFI:
        return _ffi_ops()
    return _REGISTRY[backend]
