"""Pure-JAX semantics of kv_write (the oracle for kernels): `EntryTable.write`.

Row i of `values` [n, width] is encoded in the table's format (the model's fake quantisation
for the QAT formats, `dsv4.state`) and stored at row rows[i]; rows outside [0, table.rows) are
dropped (padding), and the kept rows must be distinct.
"""

from __future__ import annotations

import jax

from dsv4.state import EntryTable


def table_write(table: EntryTable, rows: jax.Array, values: jax.Array) -> EntryTable:
    """`table` with `values` [n, width] encoded into `rows` [n]."""
    return table.write(rows, values)
