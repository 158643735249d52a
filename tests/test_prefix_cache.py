"""BlockManager: block keys, matches cut back to snapshots, reference counts, LRU eviction of
pages and of snapshots, and collision safety."""

from __future__ import annotations

import pytest

from serving import prefix_cache
from serving.prefix_cache import BlockManager

P = 4


def cache_request(bm: BlockManager, tokens, snapshot_at=()):
    """A request that wrote `tokens` into fresh pages, cached its full blocks and snapshotted
    its rings at the block ends in `snapshot_at` (positions). Returns its pages."""
    pages = bm.take(0, -(-len(tokens) // P))
    keys = bm.keys(tokens, len(tokens) // P)
    bm.register(keys, tokens, pages, first=0)
    snaps = {end: bm.snapshot_for(keys[end // P - 1], pages[end // P - 1]) for end in snapshot_at}
    assert all(s is not None for s in snaps.values())
    return pages, snaps


def test_a_match_ends_at_the_last_snapshot_and_leaves_a_token():
    bm = BlockManager(16, P, num_snapshots=4)
    tokens = list(range(10, 22))  # three full blocks
    pages, snaps = cache_request(bm, tokens, snapshot_at=(4, 12))
    assert bm.match(tokens + [99]) == (pages[:3], snaps[12], 12)
    assert bm.match(tokens) == (pages[:1], snaps[4], 4)  # 12 would leave nothing to compute
    assert bm.match(tokens[:8] + [0, 0, 0, 0, 5]) == (pages[:1], snaps[4], 4)  # block 2 differs, no snapshot at 8
    assert bm.match(tokens[:3]) == ([], None, 0)  # no full block
    assert bm.match([0] + tokens) == ([], None, 0)  # unaligned: nothing in common at the start
    assert (bm.hits, bm.hit_tokens) == (3, 20)


def test_reference_counts_and_lru_eviction():
    bm = BlockManager(4, P, num_snapshots=2)
    a = list(range(8))
    pages_a, _ = cache_request(bm, a, snapshot_at=(8,))
    assert bm.free_count(0) == 2 and bm.cached_pages() == 2
    hit_pages, _, n = bm.match(a + [1])
    assert hit_pages == pages_a and n == 8
    bm.give_back(pages_a)  # the writer finishes; the matcher still holds them
    assert bm.free_count(0) == 2
    bm.give_back(hit_pages)  # now evictable, still cached
    assert bm.free_count(0) == 4 and bm.cached_pages() == 2
    taken = bm.take(0, 3)  # two free pages first, then the least recently used cached one
    assert set(taken[:2]).isdisjoint(pages_a) and taken[2] == pages_a[0] and bm.evictions == 1
    assert bm.match(a + [1]) == ([], None, 0)  # its first block is gone: the chain breaks
    assert bm.take(0, 2) is None and bm.free_count(0) == 1  # nothing taken when too few


def test_snapshots_are_evicted_lru_and_a_block_cached_elsewhere_gets_none():
    bm = BlockManager(16, P, num_snapshots=1)
    a, b = [1] * 8, [2] * 8
    pages_a, snaps_a = cache_request(bm, a, snapshot_at=(8,))
    pages_b, snaps_b = cache_request(bm, b, snapshot_at=(8,))  # takes the only snapshot slot
    assert snaps_a[8] == snaps_b[8] == 0
    assert bm.match(a + [0]) == ([], None, 0) and bm.match(b + [0])[2] == 8
    other = bm.take(0, 2)  # a second copy of `b` in other pages stays private
    keys = bm.keys(b, 2)
    bm.register(keys, b, other, first=0)
    assert bm.snapshot_for(keys[1], other[1]) is None


def test_a_key_collision_costs_a_miss_not_a_wrong_page(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens: b"same")
    bm = BlockManager(16, P, num_snapshots=2)
    cache_request(bm, [1, 2, 3, 4], snapshot_at=(4,))
    assert bm.match([9, 9, 9, 9, 9]) == ([], None, 0)
    assert bm.match([1, 2, 3, 4, 9])[2] == 4


def test_without_snapshots_nothing_is_cached_and_shards_split_pages():
    bm = BlockManager(8, P)
    pages, _ = bm.take(0, 2), None
    bm.register(bm.keys([1] * 8, 2), [1] * 8, pages, first=0)
    assert bm.cached_pages() == 0 and bm.match([1] * 9) == ([], None, 0)
    sharded = BlockManager(8, P, shards=2)
    assert sharded.take(1, 4) == [4, 5, 6, 7] and sharded.take(1, 1) is None and sharded.free_count(0) == 4
    with pytest.raises(ValueError, match="data-parallel"):
        BlockManager(8, P, shards=2, num_snapshots=1)


def test_copy_slot_moves_one_slots_rings_and_nothing_else():
    import dataclasses

    import jax
    import numpy as np

    from dsv4.config import TINY
    from dsv4.state import PAGE_MAJOR_FIELDS, SLOT_MAJOR_FIELDS, StateGeometry, copy_slot, init_state

    geo = StateGeometry(num_slots=3, num_pages=4, page_tokens=16, max_pages_per_seq=4, max_spec_tokens=2,
                        dtype=np.float32)
    zeros = init_state(TINY, geo)
    leaves, tree = jax.tree_util.tree_flatten(zeros)
    rng = np.random.default_rng(0)
    state = jax.tree_util.tree_unflatten(tree, [rng.normal(size=x.shape).astype(x.dtype) for x in leaves])
    snaps = init_state(TINY, dataclasses.replace(geo, num_slots=2, num_pages=1))
    snaps = copy_slot(snaps, 1, 2, state, 2, 3)  # slot 2 -> snapshot 1
    moved = copy_slot(state, 0, 3, snaps, 1, 2)  # snapshot 1 -> slot 0
    for before, after in zip(state, moved):
        for name in SLOT_MAJOR_FIELDS + PAGE_MAJOR_FIELDS:
            for b, a in zip(jax.tree_util.tree_leaves(getattr(before, name)),
                            jax.tree_util.tree_leaves(getattr(after, name))):
                b, a = np.asarray(b), np.asarray(a)
                if name in PAGE_MAJOR_FIELDS:
                    np.testing.assert_array_equal(a, b)
                    continue
                rows = b.shape[0] // 3
                np.testing.assert_array_equal(a[:rows], b[2 * rows:])  # slot 0 now holds slot 2's rows
                np.testing.assert_array_equal(a[rows:], b[rows:])  # slots 1 and 2 untouched
