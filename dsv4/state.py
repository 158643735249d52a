"""Decode state: every per-request cache of the target tower, as explicit pytrees.

Lifecycle: `init_state(cfg, geometry)` allocates zeros once; the jitted step takes the state,
returns a new one and donates the old. The state holds NO lengths: the host passes each
request's committed length in every batch, so rolling back speculative tokens is just the
host moving that length (DESIGN invariant 3). Everything a later step may read is
addressed by absolute position, and nothing at or beyond the committed length is read
before it is rewritten.

Per tower layer (`LayerState`):
- `window`: the sliding-window K=V ring, `ring_size = W + max_spec_tokens + 1` rows per slot,
  row `slot * ring_size + pos % ring_size`. The extra rows keep uncommitted (speculative)
  writes from clobbering keys a rolled-back request still needs.
- CSA/HCA layers: `compressed`, the paged pool of compressed K=V entries (entry j of a
  request lives in page `page_table[j // entries_per_page]`, row `j % entries_per_page`),
  and `compressor`, the per-slot ring of f32 projections (value and gate, ape added) of
  the latest positions, from which entries are pooled when a window completes. Its
  `compressor_ring_size(ratio)` rows hold the history an entry still needs (the previous
  window for the overlapped CSA form) plus the uncommitted positions.
- CSA layers: `index_keys` (paged like `compressed`) and `index_compressor` for the
  lightning indexer's own overlapped compressor.

One page covers `page_tokens` positions of a request in every pool of every layer, so one
page table per request addresses them all (and a prefix-cache block is one page).

Storage formats (`EntryFormat`): layers write RAW entries through `EntryTable.write`, whose
codec applies the model's fake quantisation when `cfg.fake_quant` is on (dense or packed),
and read through `EntryTable.gather`, which decodes. The packed formats decode to exactly
what the official fake-quant simulation produces (`dsv4.quant`), so they are lossless
relative to a model run with `fake_quant=True`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import quant
from dsv4.config import AttentionKind, ModelConfig


class KVFormat(enum.Enum):
    """How attention K=V entries (window ring and compressed pools) are stored."""

    DENSE = "dense"  # the activation dtype, as computed
    FP8 = "fp8"  # official layout: H-R fp8 e4m3 values + per-64 E8M0 scales + R rope values


class IndexKeyFormat(enum.Enum):
    """How the lightning indexer's compressed keys are stored."""

    DENSE = "dense"
    FP8 = "fp8"  # the fp4 grid values held as e4m3 + per-32 E8M0 scales
    FP4 = "fp4"  # packed e2m1, two per byte + per-32 E8M0 scales


class EntryFormat(enum.Enum):
    """The codec of one table: what a write of raw model values stores, what a read returns.

    The QAT formats return exactly what the model's fake-quant simulation computes
    (`dsv4.quant.fake_quant_kv` / `fake_quant_indexer`), stored dense or packed.
    """

    DENSE = "dense"  # raw values in the activation dtype
    DENSE_KV_QAT = "dense_kv_qat"  # fake_quant_kv(values), dense
    KV_FP8 = "kv_fp8"  # fake_quant_kv(values), packed: fp8 + E8M0 scales + rope values
    DENSE_INDEX_QAT = "dense_index_qat"  # fake_quant_indexer(values) (Hadamard-rotated), dense
    INDEX_FP8 = "index_fp8"  # the same, fp4 grid values held as e4m3 + E8M0 scales
    INDEX_FP4 = "index_fp4"  # the same, packed e2m1 + E8M0 scales


_Codec = tuple[Callable[..., tuple[jax.Array, ...]], Callable[..., jax.Array]]


def _identity_decode(v: jax.Array, out_dtype) -> jax.Array:
    return v.astype(out_dtype)


def _codec(fmt: EntryFormat, rope_dim: int) -> _Codec:
    """(encode(values) -> arrays, decode(*arrays, out_dtype) -> values) of a format."""
    if fmt is EntryFormat.DENSE:
        return (lambda v: (v,)), _identity_decode
    if fmt is EntryFormat.DENSE_KV_QAT:
        return (lambda v: (quant.fake_quant_kv(v, rope_dim),)), _identity_decode
    if fmt is EntryFormat.KV_FP8:
        return (lambda v: quant.encode_kv_fp8(v, rope_dim)), quant.decode_kv_fp8
    if fmt is EntryFormat.DENSE_INDEX_QAT:
        return (lambda v: (quant.fake_quant_indexer(v),)), _identity_decode
    if fmt is EntryFormat.INDEX_FP8:
        return quant.encode_indexer_fp8, quant.decode_indexer_fp8
    if fmt is EntryFormat.INDEX_FP4:
        return quant.encode_indexer_fp4, quant.decode_indexer_fp4
    raise ValueError(f"unknown entry format {fmt}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EntryTable:
    """A flat table of `width`-wide entries in one storage format.

    `arrays` are the encoded parts, each [rows, ...]; `dtype` is what `gather` decodes to.
    Writes to a row index >= rows are dropped: callers route padding there (`drop_row`).
    """

    arrays: tuple[jax.Array, ...]
    fmt: EntryFormat = dataclasses.field(metadata=dict(static=True))
    width: int = dataclasses.field(metadata=dict(static=True))
    rope_dim: int = dataclasses.field(metadata=dict(static=True))
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))

    @property
    def rows(self) -> int:
        return self.arrays[0].shape[0]

    @property
    def drop_row(self) -> int:
        """An index past the end: a write there is discarded, a gather there must be masked."""
        return self.rows

    def encode(self, values: jax.Array) -> tuple[jax.Array, ...]:
        return _codec(self.fmt, self.rope_dim)[0](values.astype(self.dtype))

    def gather(self, rows: jax.Array) -> jax.Array:
        """Decoded entries [*rows.shape, width]; out-of-range rows give unspecified values (mask them)."""
        safe = jnp.clip(rows, 0, self.rows - 1)
        parts = tuple(a[safe] for a in self.arrays)
        return _codec(self.fmt, self.rope_dim)[1](*parts, self.dtype)

    def write(self, rows: jax.Array, values: jax.Array) -> "EntryTable":
        """Encode `values` [n, width] into `rows` [n]; rows outside [0, rows) are dropped.

        Rows must be distinct among the kept writes (scatter order is unspecified).
        """
        rows = jnp.where((rows >= 0) & (rows < self.rows), rows, self.rows)
        parts = self.encode(values)
        new = tuple(a.at[rows].set(p.astype(a.dtype), mode="drop") for a, p in zip(self.arrays, parts))
        return dataclasses.replace(self, arrays=new)

    @classmethod
    def zeros(cls, rows: int, width: int, fmt: EntryFormat, rope_dim: int, dtype) -> "EntryTable":
        """An all-zero table (shapes and dtypes taken from encoding one zero entry)."""
        dtype = np.dtype(dtype)
        probe = _codec(fmt, rope_dim)[0](jnp.zeros((1, width), dtype))
        arrays = tuple(jnp.zeros((rows, *p.shape[1:]), p.dtype) for p in probe)
        return cls(arrays=arrays, fmt=fmt, width=width, rope_dim=rope_dim, dtype=dtype)

    @classmethod
    def from_values(cls, values: jax.Array, like: "EntryTable") -> "EntryTable":
        """A table holding `values` [n, width] in `like`'s format (the step's fresh entries)."""
        return dataclasses.replace(like, arrays=like.encode(values))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressorRing:
    """Per-slot f32 rows of the compressor's projections at the latest positions.

    kv, gate: [slots * ring_size, coff * dim]; row `slot * ring_size + pos % ring_size`.
    `gate` already includes the learned positional bias `ape[pos % ratio]`.
    """

    kv: jax.Array
    gate: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerState:
    window: EntryTable
    compressed: EntryTable | None = None
    compressor: CompressorRing | None = None
    index_keys: EntryTable | None = None
    index_compressor: CompressorRing | None = None


DecodeState = tuple[LayerState, ...]


@dataclasses.dataclass(frozen=True)
class StateGeometry:
    """How much decode state to allocate, and in which formats.

    num_slots: concurrent requests (one ring set each).
    num_pages: pages shared by all requests (each covers `page_tokens` positions).
    max_pages_per_seq: page-table width; a request holds at most this many pages, so
        its length is at most `max_pages_per_seq * page_tokens`.
    max_spec_tokens: the most tokens of one step that may later be rolled back
        (speculative verification writes `max_spec_tokens + 1` tokens per request).
    dtype: activation dtype (dense entries are stored in it; the FP8 layout keeps its
        rope values in it).
    """

    num_slots: int
    num_pages: int
    page_tokens: int
    max_pages_per_seq: int
    max_spec_tokens: int = 5
    kv_format: KVFormat = KVFormat.DENSE
    index_format: IndexKeyFormat = IndexKeyFormat.DENSE
    dtype: np.dtype = np.dtype(jnp.bfloat16)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        for name in ("num_slots", "num_pages", "page_tokens", "max_pages_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"StateGeometry.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_spec_tokens < 0:
            raise ValueError(f"StateGeometry.max_spec_tokens must be >= 0, got {self.max_spec_tokens}")

    @property
    def max_seq_len(self) -> int:
        return self.max_pages_per_seq * self.page_tokens

    def validate_for(self, cfg: ModelConfig) -> None:
        """Raise ValueError when this geometry cannot hold `cfg`'s state exactly."""
        for ratio in {cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)} - {0}:
            if self.page_tokens % ratio:
                raise ValueError(f"page_tokens {self.page_tokens} must be a multiple of every compress ratio "
                                 f"(got ratio {ratio}) so pages hold whole entries")
        packed = self.kv_format is not KVFormat.DENSE or self.index_format is not IndexKeyFormat.DENSE
        if packed and not cfg.fake_quant:
            raise ValueError("FP8/FP4 state formats reproduce the model only with fake_quant=True "
                             "(they store exactly the fake-quantised values); use the dense formats")
        if self.index_format is not IndexKeyFormat.DENSE and cfg.index_head_dim % 32:
            raise ValueError(f"packed indexer keys need index_head_dim % 32 == 0, got {cfg.index_head_dim}")

    def ring_size(self, cfg: ModelConfig) -> int:
        return cfg.sliding_window + self.max_spec_tokens + 1

    def compressor_ring_size(self, ratio: int, overlap: bool) -> int:
        # History the next entry needs (the open window, plus the previous one when
        # overlapped) and up to max_spec_tokens + 1 uncommitted positions on top.
        return (2 if overlap else 1) * ratio + self.max_spec_tokens + 1

    def entries_per_page(self, ratio: int) -> int:
        return self.page_tokens // ratio


def default_page_tokens(cfg: ModelConfig, minimum: int = 16) -> int:
    """The smallest page holding whole entries of every pool (the lcm of the compress ratios),
    at least `minimum` positions: 128 for FLASH."""
    ratios = [cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)]
    lcm = math.lcm(*[r for r in ratios if r] or [1])
    return lcm * math.ceil(minimum / lcm)


def _kv_entry_format(cfg: ModelConfig, geometry: StateGeometry) -> EntryFormat:
    if geometry.kv_format is KVFormat.FP8:
        return EntryFormat.KV_FP8
    return EntryFormat.DENSE_KV_QAT if cfg.fake_quant else EntryFormat.DENSE


def _index_entry_format(cfg: ModelConfig, geometry: StateGeometry) -> EntryFormat:
    if geometry.index_format is IndexKeyFormat.FP8:
        return EntryFormat.INDEX_FP8
    if geometry.index_format is IndexKeyFormat.FP4:
        return EntryFormat.INDEX_FP4
    return EntryFormat.DENSE_INDEX_QAT if cfg.fake_quant else EntryFormat.DENSE


def _compressor_ring(geometry: StateGeometry, ratio: int, dim: int, overlap: bool) -> CompressorRing:
    rows = geometry.num_slots * geometry.compressor_ring_size(ratio, overlap)
    width = (2 if overlap else 1) * dim
    return CompressorRing(kv=jnp.zeros((rows, width), jnp.float32), gate=jnp.zeros((rows, width), jnp.float32))


def init_layer_state(cfg: ModelConfig, geometry: StateGeometry, layer: int) -> LayerState:
    h, r, dt = cfg.head_dim, cfg.qk_rope_head_dim, geometry.dtype
    kv_fmt = _kv_entry_format(cfg, geometry)
    window = EntryTable.zeros(geometry.num_slots * geometry.ring_size(cfg), h, kv_fmt, r, dt)
    kind = cfg.layer_types[layer]
    if kind is AttentionKind.SLIDING:
        return LayerState(window=window)
    ratio = cfg.compress_ratio(layer)
    overlap = kind is AttentionKind.CSA
    rows = geometry.num_pages * geometry.entries_per_page(ratio)
    state = LayerState(window=window, compressed=EntryTable.zeros(rows, h, kv_fmt, r, dt),
                       compressor=_compressor_ring(geometry, ratio, h, overlap))
    if kind is AttentionKind.CSA:
        j = cfg.index_head_dim
        state = dataclasses.replace(
            state, index_keys=EntryTable.zeros(rows, j, _index_entry_format(cfg, geometry), 0, dt),
            index_compressor=_compressor_ring(geometry, cfg.csa_ratio, j, True))
    return state


def init_state(cfg: ModelConfig, geometry: StateGeometry) -> DecodeState:
    """All-zero decode state for `cfg` (use under `jax.eval_shape` to size it without allocating)."""
    geometry.validate_for(cfg)
    return tuple(init_layer_state(cfg, geometry, i) for i in range(cfg.num_hidden_layers))


SLOT_MAJOR_FIELDS = ("window", "compressor", "index_compressor")  # rows grouped by slot
PAGE_MAJOR_FIELDS = ("compressed", "index_keys")  # rows grouped by page


def copy_slot(dst: DecodeState, dst_slot: jax.Array, dst_slots: int, src: DecodeState, src_slot: jax.Array,
              src_slots: int) -> DecodeState:
    """`dst` with slot `dst_slot`'s rows of every slot-major table (window ring, compressor
    rings) replaced by slot `src_slot`'s rows of `src`; page-major pools untouched.

    The two states may have different slot counts (a slot and a snapshot pool); rows per slot
    are the same, and a slot's rows keep their ring order, so a copied ring is read exactly as
    the original was. Slot indices may be traced (one compiled copy serves every slot)."""
    layers = []
    for d, s in zip(dst, src):
        fresh = {}
        for name in SLOT_MAJOR_FIELDS:
            dv, sv = getattr(d, name), getattr(s, name)
            if dv is None:
                continue

            def one(a: jax.Array, b: jax.Array) -> jax.Array:
                rows = a.shape[0] // dst_slots
                block = jax.lax.dynamic_slice_in_dim(b, src_slot * rows, rows, axis=0)
                return jax.lax.dynamic_update_slice_in_dim(a, block, dst_slot * rows, axis=0)

            if jax.tree_util.tree_map(lambda a: a.shape[0] // dst_slots, dv) != \
                    jax.tree_util.tree_map(lambda b: b.shape[0] // src_slots, sv):
                raise ValueError(f"{name}: rows per slot differ between the two states")
            fresh[name] = jax.tree_util.tree_map(one, dv, sv)
        layers.append(dataclasses.replace(d, **fresh))
    return tuple(layers)


def tree_bytes(tree) -> int:
    """Total bytes of the arrays (or ShapeDtypeStructs) in a pytree."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))
