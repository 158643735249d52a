"""kv_write through the FFI kernel (`dsv4_kv_write`, ffi_kernels/csrc): the table's parts are
updated in place (input/output aliases), so the step does not round-trip through XLA scatters."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4 import quant
from dsv4.ops.ffi_tables import check_platform, codec, i32, table_parts, with_parts
from dsv4.state import EntryTable


def table_write(table: EntryTable, rows: jax.Array, values: jax.Array) -> EntryTable:
    """As `reference.table_write`."""
    check_platform()
    c = codec(table.fmt)
    values = values.astype(table.dtype)
    if c.rotate:  # the rotation stays in XLA: the kernel then rounds exactly what the reference rounds
        values = quant.hadamard_rotate(values)
    parts = table_parts(table)
    out = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts)
    new = jax.ffi.ffi_call("dsv4_kv_write", out, vmap_method="sequential", input_output_aliases={0: 0, 1: 1, 2: 2})(
        *parts, rows.astype(jnp.int32), values, grid=i32(c.grid), quant_width=i32(c.quant_width(table)),
        block=i32(c.block))
    return with_parts(table, tuple(new))
