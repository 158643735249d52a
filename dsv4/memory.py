"""Memory planning: how many request slots and state pages fit in a device's memory.

The decode state (`dsv4.state`) has two parts that scale differently:
- per slot (one per concurrent request, whatever its length): the sliding-window K=V rings
  and the compressors' f32 rings, in every layer;
- per page (shared by all requests, `page_tokens` positions each): the compressed K=V pools
  and the indexer keys of the CSA/HCA layers.

So total state bytes = num_slots * bytes_per_slot + num_pages * bytes_per_page, and a plan
fixes the slots (the scheduler's `max_num_seqs`) and spends what is left of the budget, after
the parameters and an activation reserve, on pages.

The costs are never written down by hand: `state_costs` measures them from the shapes that
`init_state` itself allocates, under `jax.eval_shape` (nothing is allocated, so this works for
FLASH on a laptop), and checks that the state really is affine in (slots, pages). Whatever a
later change adds to the state is therefore counted automatically.

Usage at an entry point: `device_memory_bytes(jax.devices()[0])` (None on CPU: pass a number),
`plan_memory(...)`, log `plan.summary()`, then allocate `plan.geometry()`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from dsv4.config import AttentionKind, ModelConfig
from dsv4.state import (DecodeState, IndexKeyFormat, KVFormat, StateGeometry, default_page_tokens, init_state,
                        tree_bytes)

GIB = 1 << 30

# Pool labels for the report, keyed by (attention kind, LayerState field). Every layer has a
# window ring, so it is one pool across kinds.
_POOL_LABELS: dict[tuple[AttentionKind | None, str], str] = {
    (None, "window"): "window ring",
    (AttentionKind.CSA, "compressed"): "CSA compressed KV",
    (AttentionKind.HCA, "compressed"): "HCA compressed KV",
    (AttentionKind.CSA, "index_keys"): "CSA indexer keys",
    (AttentionKind.CSA, "compressor"): "CSA compressor ring",
    (AttentionKind.HCA, "compressor"): "HCA compressor ring",
    (AttentionKind.CSA, "index_compressor"): "CSA indexer compressor ring",
}


@dataclasses.dataclass(frozen=True)
class StateCosts:
    """Exact bytes of decode state per page and per slot, with a per-pool breakdown.

    page_pools / slot_pools: bytes per page / per slot of each pool (labels as in
    `_POOL_LABELS`); they sum to bytes_per_page / bytes_per_slot. Pools of zero cost
    (e.g. window rings per page) are left out.
    """

    bytes_per_page: int
    bytes_per_slot: int
    page_tokens: int
    page_pools: Mapping[str, int] = dataclasses.field(default_factory=dict, hash=False)
    slot_pools: Mapping[str, int] = dataclasses.field(default_factory=dict, hash=False)

    @property
    def bytes_per_token(self) -> float:
        """Paged state per committed token (pages hold whole entries, so this is exact on average)."""
        return self.bytes_per_page / self.page_tokens

    def pool_bytes_per_token(self) -> dict[str, float]:
        return {name: b / self.page_tokens for name, b in self.page_pools.items()}


def _pool_bytes(cfg: ModelConfig, state: DecodeState) -> dict[str, int]:
    """Bytes of each pool of a (possibly abstract) state, summed over layers."""
    out: dict[str, int] = {}
    for layer, layer_state in enumerate(state):
        kind = cfg.layer_types[layer]
        for field in dataclasses.fields(layer_state):
            value = getattr(layer_state, field.name)
            if value is None:
                continue
            label = _POOL_LABELS[(None, field.name) if field.name == "window" else (kind, field.name)]
            out[label] = out.get(label, 0) + tree_bytes(value)
    return out


def _abstract_pools(cfg: ModelConfig, template: StateGeometry, slots: int, pages: int) -> dict[str, int]:
    geometry = dataclasses.replace(template, num_slots=slots, num_pages=pages)
    return _pool_bytes(cfg, jax.eval_shape(lambda: init_state(cfg, geometry)))


def state_costs(cfg: ModelConfig, geometry_template: StateGeometry) -> StateCosts:
    """Per-page and per-slot bytes of `cfg`'s decode state in the template's formats.

    Only the template's page_tokens, max_spec_tokens, formats and dtype matter; its slot and
    page counts are replaced. Costs are differences of abstract states at (slots, pages) =
    (1, 1), (2, 1), (1, 2); a fourth point and a zero intercept check that every pool is
    affine in both (a pool sized by, say, slots * pages would make any plan wrong), else
    ValueError.
    """
    base = _abstract_pools(cfg, geometry_template, 1, 1)
    two_slots = _abstract_pools(cfg, geometry_template, 2, 1)
    two_pages = _abstract_pools(cfg, geometry_template, 1, 2)
    check = _abstract_pools(cfg, geometry_template, 3, 5)
    per_slot = {k: two_slots[k] - base[k] for k in base}
    per_page = {k: two_pages[k] - base[k] for k in base}
    for k in base:
        if base[k] != per_slot[k] + per_page[k] or check[k] != 3 * per_slot[k] + 5 * per_page[k]:
            raise ValueError(f"decode state pool {k!r} is not proportional to slots and pages: bytes at "
                             f"(1,1)={base[k]}, (2,1)={two_slots[k]}, (1,2)={two_pages[k]}, (3,5)={check[k]}")
    return StateCosts(bytes_per_page=sum(per_page.values()), bytes_per_slot=sum(per_slot.values()),
                      page_tokens=geometry_template.page_tokens,
                      page_pools={k: v for k, v in per_page.items() if v},
                      slot_pools={k: v for k, v in per_slot.items() if v})


def _gib(b: int) -> str:
    return f"{b / GIB:9.2f} GiB"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A device's memory split between parameters, activations and decode state.

    budget_bytes = floor(device_bytes * memory_fraction); param_bytes, reserve_bytes,
    slot_bytes_total and page_bytes_total are what it is spent on (the rest is headroom,
    less than one page unless pages were capped by max_num_seqs full-length requests).
    pages_fit: the pages the budget holds before that cap (num_pages <= pages_fit).
    """

    device_bytes: int
    memory_fraction: float
    budget_bytes: int
    param_bytes: int
    reserve_bytes: int
    slot_bytes_total: int
    page_bytes_total: int
    num_slots: int
    num_pages: int
    pages_fit: int
    max_pages_per_seq: int
    tokens_capacity: int
    max_model_len: int
    max_spec_tokens: int
    kv_format: KVFormat
    index_format: IndexKeyFormat
    dtype: np.dtype
    costs: StateCosts

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.param_bytes - self.reserve_bytes - self.slot_bytes_total - self.page_bytes_total

    @property
    def full_length_requests(self) -> int:
        """How many max_model_len requests the pages hold at once (the worst case for the scheduler)."""
        return self.num_pages // self.max_pages_per_seq

    def geometry(self) -> StateGeometry:
        """The StateGeometry to allocate for this plan."""
        return StateGeometry(num_slots=self.num_slots, num_pages=self.num_pages, page_tokens=self.costs.page_tokens,
                             max_pages_per_seq=self.max_pages_per_seq, max_spec_tokens=self.max_spec_tokens,
                             kv_format=self.kv_format, index_format=self.index_format, dtype=self.dtype)

    def summary(self) -> str:
        c, g = self.costs, _gib
        return "\n".join([
            f"memory plan: {self.device_bytes / GIB:.2f} GiB device x {self.memory_fraction:g} = "
            f"{self.budget_bytes / GIB:.2f} GiB budget "
            f"(state {self.kv_format.value} KV, {self.index_format.value} index keys, {self.dtype.name})",
            f"  params      {g(self.param_bytes)}",
            f"  reserve     {g(self.reserve_bytes)}",
            f"  slot state  {g(self.slot_bytes_total)}  ({self.num_slots} slots x {c.bytes_per_slot / 2**20:.2f} MiB)",
            f"  page state  {g(self.page_bytes_total)}  ({self.num_pages:,} pages x {c.bytes_per_page / 1024:.1f} KiB;"
            f" {c.page_tokens} tokens/page, {c.bytes_per_token:,.2f} B/token)",
            f"  headroom    {g(self.headroom_bytes)}"
            + (f"  (pages capped at max_num_seqs x {self.max_pages_per_seq}; the budget holds "
               f"{self.pages_fit:,})" if self.num_pages < self.pages_fit else ""),
            f"  capacity: {self.tokens_capacity:,} tokens = {self.full_length_requests} concurrent requests of "
            f"{self.max_model_len:,} tokens ({self.max_pages_per_seq} pages each; max_num_seqs {self.num_slots})",
        ])


def _check_plan_inputs(device_bytes: int, memory_fraction: float, param_bytes: int, reserve_bytes: int,
                       max_num_seqs: int, max_model_len: int) -> None:
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    for name, value in (("device_bytes", device_bytes), ("param_bytes", param_bytes),
                        ("reserve_bytes", reserve_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def plan_memory(cfg: ModelConfig, *, device_bytes: int, memory_fraction: float, param_bytes: int,
                max_num_seqs: int, max_model_len: int, page_tokens: int | None = None, max_spec_tokens: int = 5,
                kv_format: KVFormat = KVFormat.DENSE, index_format: IndexKeyFormat = IndexKeyFormat.DENSE,
                dtype: DTypeLike = jnp.bfloat16, reserve_bytes: int = 0) -> MemoryPlan:
    """Slots and pages for one device: max_num_seqs slots, then as many pages as the budget holds.

    param_bytes and reserve_bytes are this device's share (divide by the devices that the
    parameters are sharded over). Pages are capped at max_num_seqs * max_pages_per_seq, as
    more could never be in use at once. ValueError when the budget cannot hold the slots plus
    one max_model_len request, or on out-of-range inputs.
    """
    _check_plan_inputs(device_bytes, memory_fraction, param_bytes, reserve_bytes, max_num_seqs, max_model_len)
    page_tokens = default_page_tokens(cfg) if page_tokens is None else page_tokens
    max_pages_per_seq = -(-max_model_len // page_tokens)
    template = StateGeometry(num_slots=1, num_pages=1, page_tokens=page_tokens, max_pages_per_seq=max_pages_per_seq,
                             max_spec_tokens=max_spec_tokens, kv_format=kv_format, index_format=index_format,
                             dtype=dtype)
    costs = state_costs(cfg, template)
    budget = math.floor(device_bytes * memory_fraction)
    slot_total = max_num_seqs * costs.bytes_per_slot
    free = budget - param_bytes - reserve_bytes - slot_total
    fit = free // costs.bytes_per_page if free > 0 else 0
    if fit < max_pages_per_seq:
        raise ValueError(
            f"one {max_model_len}-token request does not fit: budget {budget:,} B - params {param_bytes:,} B - "
            f"reserve {reserve_bytes:,} B - {max_num_seqs} slots x {costs.bytes_per_slot:,} B = {free:,} B "
            f"holds {fit} pages of {costs.bytes_per_page:,} B, need {max_pages_per_seq}")
    num_pages = min(fit, max_num_seqs * max_pages_per_seq)
    return MemoryPlan(device_bytes=device_bytes, memory_fraction=memory_fraction, budget_bytes=budget,
                      param_bytes=param_bytes, reserve_bytes=reserve_bytes, slot_bytes_total=slot_total,
                      page_bytes_total=num_pages * costs.bytes_per_page, num_slots=max_num_seqs,
                      num_pages=num_pages, pages_fit=fit, max_pages_per_seq=max_pages_per_seq,
                      tokens_capacity=num_pages * page_tokens, max_model_len=max_model_len,
                      max_spec_tokens=max_spec_tokens, kv_format=kv_format, index_format=index_format,
                      dtype=template.dtype, costs=costs)


class _HasMemoryStats(Protocol):
    def memory_stats(self) -> Mapping[str, int] | None: ...


def device_memory_bytes(device: _HasMemoryStats) -> int | None:
    """The allocator's byte limit of a device, or None where the backend reports none (CPU).

    For entry points: the planner itself takes a number, so tests and offline reports do not
    need a device.
    """
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"])


def param_bytes(params) -> int:
    """Bytes of a parameter pytree (arrays or ShapeDtypeStructs, e.g. from `nnx.eval_shape`)."""
    return tree_bytes(params)
