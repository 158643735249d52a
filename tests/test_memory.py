"""Memory planning: measured state costs against real allocations and against hand arithmetic.

TINY costs are checked against a state that is actually allocated; FLASH costs (abstract
only) against the spec's per-token figures and a formula written from the entry layouts
(`dsv4.quant`), not from `init_state`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4.config import FLASH, TINY
from dsv4.memory import (MemoryPlan, StateCosts, device_memory_bytes, param_bytes, plan_memory, state_costs)
from dsv4.state import IndexKeyFormat, KVFormat, StateGeometry, init_state, tree_bytes

TINY_FQ = TINY.replace(fake_quant=True)  # packed formats need fake quant
FORMATS = [(KVFormat.DENSE, IndexKeyFormat.DENSE), (KVFormat.FP8, IndexKeyFormat.FP4),
           (KVFormat.FP8, IndexKeyFormat.FP8)]


def _template(kv=KVFormat.DENSE, index=IndexKeyFormat.DENSE, page_tokens=128, spec=5, dtype=jnp.bfloat16):
    return StateGeometry(num_slots=1, num_pages=1, page_tokens=page_tokens, max_pages_per_seq=1,
                         max_spec_tokens=spec, kv_format=kv, index_format=index, dtype=dtype)


# --- TINY: costs equal real allocations -------------------------------------------------

@pytest.mark.parametrize("kv,index", FORMATS)
@pytest.mark.parametrize("slots,pages,spec,dtype", [(3, 7, 5, jnp.bfloat16), (2, 5, 0, jnp.float32)])
def test_tiny_costs_equal_an_allocated_state(kv, index, slots, pages, spec, dtype):
    template = _template(kv, index, page_tokens=32, spec=spec, dtype=dtype)
    costs = state_costs(TINY_FQ, template)
    real = init_state(TINY_FQ, dataclasses.replace(template, num_slots=slots, num_pages=pages))
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(real))
    assert tree_bytes(real) == slots * costs.bytes_per_slot + pages * costs.bytes_per_page
    assert sum(costs.page_pools.values()) == costs.bytes_per_page
    assert sum(costs.slot_pools.values()) == costs.bytes_per_slot
    assert costs.bytes_per_token == costs.bytes_per_page / 32


def test_tiny_dense_costs_by_hand():
    # TINY: H=40, J=32, W=16, layers SWA, CSA(4), HCA(16), CSA, HCA; bf16; page 16 tokens.
    costs = state_costs(TINY, _template(page_tokens=16, spec=5))
    assert costs.page_pools == {"CSA compressed KV": 2 * (16 // 4) * 40 * 2,
                                "CSA indexer keys": 2 * (16 // 4) * 32 * 2,
                                "HCA compressed KV": 2 * (16 // 16) * 40 * 2}
    ring = 16 + 5 + 1
    assert costs.slot_pools == {"window ring": 5 * ring * 40 * 2,
                                "CSA compressor ring": 2 * (2 * 4 + 6) * 2 * 40 * 4 * 2,
                                "CSA indexer compressor ring": 2 * (2 * 4 + 6) * 2 * 32 * 4 * 2,
                                "HCA compressor ring": 2 * (16 + 6) * 40 * 4 * 2}


# --- FLASH: spec figures, abstractly ----------------------------------------------------

N_CSA, N_HCA, N_LAYERS = 21, 20, 43
H, R, J, W = 512, 64, 128, 128
KV_FP8_ENTRY = (H - R) + (H - R) // 64 + R * 2  # 448 e4m3 + 7 E8M0 + 64 bf16 rope = 583 B
INDEX_FP4_ENTRY = J // 2 + J // 32  # 64 B packed e2m1 + 4 E8M0 = 68 B
INDEX_FP8_ENTRY = J + J // 32  # 132 B


def _flash_per_page(kv_entry: int, index_entry: int, page_tokens: int = 128) -> int:
    return N_CSA * (page_tokens // 4) * (kv_entry + index_entry) + N_HCA * (page_tokens // 128) * kv_entry


def _f32_ring(ratio: int, dim: int, overlap: bool, spec: int) -> int:
    # rows: the open window (and the previous one when overlapped) + spec + 1 uncommitted;
    # width doubles when overlapped; f32; two arrays (kv and gate).
    width = 2 if overlap else 1
    return (width * ratio + spec + 1) * width * dim * 4 * 2


def _flash_per_slot(kv_entry: int, spec: int) -> int:
    f32_ring = lambda ratio, dim, overlap: _f32_ring(ratio, dim, overlap, spec)  # noqa: E731
    return (N_LAYERS * (W + spec + 1) * kv_entry
            + N_CSA * (f32_ring(4, H, True) + f32_ring(4, J, True)) + N_HCA * f32_ring(128, H, False))


def test_flash_layer_counts():
    kinds = [k.name for k in FLASH.layer_types]
    assert (kinds.count("CSA"), kinds.count("HCA"), len(kinds)) == (N_CSA, N_HCA, N_LAYERS)
    assert (FLASH.head_dim, FLASH.qk_rope_head_dim, FLASH.index_head_dim, FLASH.sliding_window) == (H, R, J, W)


def test_flash_dense_bf16_is_6880_bytes_per_token():
    costs = state_costs(FLASH, _template())
    assert costs.bytes_per_token == 6880  # spec: (256 + 64) x 21 CSA + 8 x 20 HCA
    assert costs.pool_bytes_per_token() == {"CSA compressed KV": 256 * 21, "CSA indexer keys": 64 * 21,
                                            "HCA compressed KV": 8 * 20}
    assert costs.bytes_per_page == _flash_per_page(H * 2, J * 2)


def test_flash_fp8_kv_fp4_index_is_about_3509_bytes_per_token():
    assert KV_FP8_ENTRY == 583 and INDEX_FP4_ENTRY == 68
    costs = state_costs(FLASH, _template(KVFormat.FP8, IndexKeyFormat.FP4))
    # 21 x (583 / 4 + 68 / 4) + 20 x 583 / 128 = 3417.75 + 91.09375
    assert costs.bytes_per_token == 3508.84375
    assert costs.bytes_per_page == _flash_per_page(KV_FP8_ENTRY, INDEX_FP4_ENTRY) == 449_132


def test_flash_fp8_kv_fp8_index_per_token():
    costs = state_costs(FLASH, _template(KVFormat.FP8, IndexKeyFormat.FP8))
    assert costs.bytes_per_page == _flash_per_page(KV_FP8_ENTRY, INDEX_FP8_ENTRY)
    assert costs.bytes_per_token == 3844.84375


@pytest.mark.parametrize("kv,kv_entry", [(KVFormat.DENSE, H * 2), (KVFormat.FP8, KV_FP8_ENTRY)])
@pytest.mark.parametrize("spec", [0, 5])
def test_flash_per_slot_bytes(kv, kv_entry, spec):
    costs = state_costs(FLASH, _template(kv, IndexKeyFormat.DENSE, spec=spec))
    assert costs.bytes_per_slot == _flash_per_slot(kv_entry, spec)
    if kv is KVFormat.DENSE and spec == 5:
        assert costs.bytes_per_slot == 19_888_128  # for the record: ~19 MiB per request


# --- plans ------------------------------------------------------------------------------

def _plan(**kw):
    args = dict(device_bytes=10_000_000, memory_fraction=0.5, param_bytes=1_000_000, max_num_seqs=4,
                max_model_len=100, page_tokens=16, reserve_bytes=200_000)
    args.update(kw)
    return plan_memory(TINY, **args)


def test_plan_numbers_by_hand():
    costs = state_costs(TINY, _template(page_tokens=16))
    # A device with room for 20 pages and a bit (fraction 0.5 halves it exactly).
    device = 2 * (1_000_000 + 200_000 + 4 * costs.bytes_per_slot + 20 * costs.bytes_per_page + 123)
    plan = _plan(device_bytes=device)
    expected_pages = (device // 2 - 1_000_000 - 200_000 - 4 * costs.bytes_per_slot) // costs.bytes_per_page
    assert expected_pages == 20 < 4 * 7  # memory-limited, not capped
    assert (plan.num_slots, plan.num_pages, plan.max_pages_per_seq) == (4, 20, 7)  # ceil(100/16)
    assert plan.budget_bytes == device // 2
    assert plan.headroom_bytes == 123 and plan.pages_fit == 20 and "capped" not in plan.summary()
    assert plan.slot_bytes_total == 4 * costs.bytes_per_slot
    assert plan.page_bytes_total == expected_pages * costs.bytes_per_page
    assert plan.tokens_capacity == expected_pages * 16
    assert 0 <= plan.headroom_bytes < costs.bytes_per_page
    assert plan.costs == costs


def test_plan_pages_capped_by_full_length_requests():
    plan = _plan(device_bytes=10**12)
    assert plan.num_pages == 4 * 7 and plan.full_length_requests == 4
    assert plan.pages_fit > 4 * 7 and "capped" in plan.summary()


def test_plan_geometry_allocates_what_was_planned():
    plan = _plan()
    geometry = plan.geometry()
    assert (geometry.num_slots, geometry.num_pages, geometry.page_tokens, geometry.max_pages_per_seq) == (
        4, plan.num_pages, 16, 7)
    assert geometry.max_seq_len >= 100
    state = init_state(TINY, geometry)
    assert tree_bytes(state) == plan.slot_bytes_total + plan.page_bytes_total


def test_plan_default_page_tokens_and_formats():
    plan = plan_memory(TINY_FQ, device_bytes=10**9, memory_fraction=1.0, param_bytes=0, max_num_seqs=2,
                       max_model_len=64, kv_format=KVFormat.FP8, index_format=IndexKeyFormat.FP4)
    g = plan.geometry()
    assert g.page_tokens == 16 and g.kv_format is KVFormat.FP8 and g.index_format is IndexKeyFormat.FP4
    assert g.dtype == np.dtype(jnp.bfloat16)


def test_plan_summary_mentions_the_numbers():
    plan = _plan()
    text = plan.summary()
    assert len(text.splitlines()) >= 6
    assert f"{plan.num_pages:,} pages" in text and "GiB" in text and "4 slots" in text


def test_plan_exactly_one_request_fits():
    costs = state_costs(TINY, _template(page_tokens=16))
    need = 1_000_000 + 4 * costs.bytes_per_slot + 7 * costs.bytes_per_page
    assert _plan(device_bytes=need, memory_fraction=1.0, reserve_bytes=0).num_pages == 7
    with pytest.raises(ValueError, match="does not fit.*need 7"):
        _plan(device_bytes=need - 1, memory_fraction=1.0, reserve_bytes=0)


@pytest.mark.parametrize("kw,match", [
    (dict(memory_fraction=0.0), "memory_fraction"),
    (dict(memory_fraction=1.5), "memory_fraction"),
    (dict(param_bytes=-1), "param_bytes"),
    (dict(reserve_bytes=-1), "reserve_bytes"),
    (dict(device_bytes=-1), "device_bytes"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(param_bytes=6_000_000), "does not fit"),  # params alone exceed the budget
    (dict(page_tokens=6), "multiple of every compress ratio"),
])
def test_plan_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _plan(**kw)


def test_packed_formats_need_fake_quant():
    with pytest.raises(ValueError, match="fake_quant"):
        state_costs(TINY, _template(KVFormat.FP8, IndexKeyFormat.FP4, page_tokens=16))


def test_non_affine_state_is_rejected(monkeypatch):
    import dsv4.memory as memory
    real = memory._pool_bytes

    def quadratic(cfg, state):  # a pool sized by slots * pages
        pools = real(cfg, state)
        slots = state[0].window.rows // (TINY.sliding_window + 6)
        pools["window ring"] *= slots
        return pools

    monkeypatch.setattr(memory, "_pool_bytes", quadratic)
    with pytest.raises(ValueError, match="not proportional"):
        state_costs(TINY, _template(page_tokens=16))


# --- helpers ----------------------------------------------------------------------------

class _FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_memory_bytes():
    assert device_memory_bytes(_FakeDevice({"bytes_limit": 123, "bytes_in_use": 4})) == 123
    assert device_memory_bytes(_FakeDevice(None)) is None
    assert device_memory_bytes(_FakeDevice({"bytes_in_use": 4})) is None
    if jax.devices()[0].platform == "cpu":
        assert device_memory_bytes(jax.devices()[0]) is None


def test_param_bytes_of_abstract_tree():
    tree = {"a": jax.ShapeDtypeStruct((3, 4), jnp.bfloat16), "b": [jnp.zeros((5,), jnp.float32)]}
    assert param_bytes(tree) == 3 * 4 * 2 + 5 * 4


def test_costs_are_frozen():
    costs = StateCosts(bytes_per_page=10, bytes_per_slot=3, page_tokens=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        costs.bytes_per_page = 1  # type: ignore[misc]
    assert costs.bytes_per_token == 2.5
    assert MemoryPlan.__dataclass_params__.frozen
