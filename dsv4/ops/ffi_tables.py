"""How the FFI kernels receive a stored table (`dsv4.state.EntryTable`): always three parts.

Every kernel takes a table as (values, scales, rope), each [rows, width], so that one handler
signature serves every storage format; a part a format lacks is an empty [rows, 0] array:

| format                          | values                 | scales (E8M0)     | rope     |
|---------------------------------|------------------------|-------------------|----------|
| DENSE, DENSE_KV_QAT, DENSE_INDEX_QAT | [R, W] dtype      | [R, 0]            | [R, 0]   |
| KV_FP8                          | [R, W - rope] e4m3     | [R, ceil(/64)]    | [R, rope] dtype |
| INDEX_FP8                       | [R, J] e4m3            | [R, J/32]         | [R, 0]   |
| INDEX_FP4                       | [R, J/2] int8 (packed) | [R, J/32]         | [R, 0]   |

`FormatCodec` also says what a write stores (kernel attributes `grid`, `quant_width`, `block`):
the leading `quant_width` columns are rounded per `block` to the e4m3 (KV) or e2m1 (indexer)
grid, as `dsv4.quant`'s fake quantisers do; indexer values are Hadamard-rotated first (in XLA).
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

import ffi_kernels
from dsv4 import quant
from dsv4.state import EntryFormat, EntryTable


class Grid(enum.IntEnum):
    """The kernels' `grid` attribute (ffi_kernels/csrc/kv_write.h)."""

    NONE = 0
    E4M3 = 1
    E2M1 = 2


@dataclasses.dataclass(frozen=True)
class FormatCodec:
    grid: Grid
    block: int  # columns per scale byte (1 where unscaled)
    rotate: bool  # Hadamard-rotate before quantising (the indexer formats)

    def quant_width(self, table: EntryTable) -> int:
        if self.grid is Grid.NONE:
            return 0
        return table.width - table.rope_dim if self.grid is Grid.E4M3 else table.width


_CODECS = {
    EntryFormat.DENSE: FormatCodec(Grid.NONE, 1, False),
    EntryFormat.DENSE_KV_QAT: FormatCodec(Grid.E4M3, quant.KV_FP8_BLOCK, False),
    EntryFormat.KV_FP8: FormatCodec(Grid.E4M3, quant.KV_FP8_BLOCK, False),
    EntryFormat.DENSE_INDEX_QAT: FormatCodec(Grid.E2M1, quant.INDEXER_FP4_BLOCK, True),
    EntryFormat.INDEX_FP8: FormatCodec(Grid.E2M1, quant.INDEXER_FP4_BLOCK, True),
    EntryFormat.INDEX_FP4: FormatCodec(Grid.E2M1, quant.INDEXER_FP4_BLOCK, True),
}


def codec(fmt: EntryFormat) -> FormatCodec:
    return _CODECS[fmt]


def table_parts(table: EntryTable) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(values, scales, rope) of `table`, empty [rows, 0] arrays for the parts its format lacks."""
    rows = table.rows
    if table.fmt is EntryFormat.KV_FP8:
        return table.arrays
    if table.fmt in (EntryFormat.INDEX_FP8, EntryFormat.INDEX_FP4):
        values, scales = table.arrays
        return values, scales, jnp.zeros((rows, 0), table.dtype)
    (values,) = table.arrays
    return values, jnp.zeros((rows, 0), jnp.uint8), jnp.zeros((rows, 0), table.dtype)


def with_parts(table: EntryTable, parts: tuple[jax.Array, jax.Array, jax.Array]) -> EntryTable:
    """`table` holding `parts` (the inverse of `table_parts`)."""
    n = len(table.arrays)
    return dataclasses.replace(table, arrays=tuple(parts[:n]))


def dense_table(values_RW: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The parts of a plain dense table of rows [R, W] (the whole-sequence forms' keys)."""
    rows = values_RW.shape[0]
    return values_RW, jnp.zeros((rows, 0), jnp.uint8), jnp.zeros((rows, 0), values_RW.dtype)


def check_platform() -> None:
    """Fail with the build instructions when the default backend's FFI library is missing.

    Called at trace time by every FFI op, so a missing library is a clear Python error rather
    than XLA's "no registered implementation" at compile time.
    """
    ffi_kernels.require(ffi_kernels.platform_of(jax.default_backend()))


def kernel_built(target: str) -> bool:
    """Whether the default backend's FFI library has a kernel for `target` (after check_platform:
    a kernel may exist on one platform before another)."""
    return ffi_kernels.serves(ffi_kernels.platform_of(jax.default_backend()), target)


def i32(x: int) -> np.int32:
    """An int32 kernel attribute (a Python int would be passed as int64)."""
    return np.int32(x)
