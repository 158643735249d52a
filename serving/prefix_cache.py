"""Pages, reference counts and the prefix cache: `BlockManager`.

A block is one page: `page_tokens` consecutive positions. A full block of a request's tokens
is registered under a key chained from its parent's key and its own tokens, so equal keys
mean equal prefixes (the tokens are stored too and compared on every match: a hash collision
can only cost a miss, never a wrong page). A registered page stays cached after its
requests finish (reference count 0) and is evicted least-recently-used when a page is needed
and none is free.

The decode state is not only pages: the sliding-window ring and the compressor rings are per
slot, and a restored prefix needs them as they were at its last position. So a block can
also carry a slot *snapshot* (a copy of its request's rings taken right after a step that
ended exactly at the block's end, `StepRunner.save_slot`), and a match ends only at a block
with a snapshot; a matched prefix longer than the last snapshot is cut back to it. Hence:
- a hit restores pages for [0, n) and the rings at n: exactly the state a cold prefill that
  stopped at n would have (the chunks of a prefill end at block boundaries when caching is
  on, so cold and warm runs go through the same chunk ends);
- an unaligned or incomplete prefix (no full block, a differing token, no snapshot) simply
  matches less: it fails closed to recomputation;
- at least one prompt token is always left to compute, since the last one's logits are needed.
Snapshots are a fixed pool (`num_snapshots`), evicted LRU on their own.

Data parallelism is not supported here (a page and its snapshot would have to live on the
request's data shard): the engine refuses to cache with more than one data shard.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Iterable, Sequence

import numpy as np


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained key of a block: a digest of the parent key and the block's token ids."""
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


ROOT = b""


@dataclasses.dataclass
class _Block:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    page: int
    refs: int
    snapshot: int | None = None


class BlockManager:
    """Free pages, cached pages (by block key) and snapshot slots. Single-threaded."""

    def __init__(self, num_pages: int, page_tokens: int, *, shards: int = 1, num_snapshots: int = 0):
        """shards: data shards (page p belongs to shard p * shards // num_pages); the prefix
        cache is on when num_snapshots > 0, which needs shards == 1."""
        if num_pages % shards:
            raise ValueError(f"{num_pages} pages do not split evenly over {shards} data shards")
        if num_snapshots and shards > 1:
            raise ValueError("the prefix cache does not support data-parallel shards")
        self.num_pages, self.page_tokens, self.shards = num_pages, page_tokens, shards
        self.caching = num_snapshots > 0
        per = num_pages // shards
        self._free = [collections.deque(range(s * per, (s + 1) * per)) for s in range(shards)]
        self._blocks: dict[bytes, _Block] = {}
        self._by_page: dict[int, _Block] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU: oldest first
        self._free_snapshots = collections.deque(range(num_snapshots))
        self._snapshot_lru: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # snapshot -> key
        self.hits = self.hit_tokens = self.evictions = 0

    # ---- pages -------------------------------------------------------------------------

    def free_count(self, shard: int | None = None) -> int:
        """Pages that can be handed out now (free, or cached and unreferenced), of one shard
        or of all."""
        free = sum(map(len, self._free)) if shard is None else len(self._free[shard])
        return free + len(self._evictable)

    def cached_pages(self) -> int:
        return len(self._by_page)

    def take(self, shard: int, n: int) -> list[int] | None:
        """n pages of `shard` (free ones first, then the least recently used cached ones), or
        None and nothing taken when fewer can be had."""
        if n > self.free_count(shard):
            return None
        pages = []
        free = self._free[shard]
        for _ in range(n):
            if free:
                pages.append(free.popleft())
            else:
                page, _ = self._evictable.popitem(last=False)
                self._forget(self._by_page[page])
                self.evictions += 1
                pages.append(page)
        return pages

    def give_back(self, pages: Iterable[int]) -> None:
        """A request lets go of its pages: cached ones lose a reference, the rest are free."""
        for p in pages:
            block = self._by_page.get(p)
            if block is None:
                self._free[p * self.shards // self.num_pages].append(p)
                continue
            block.refs -= 1
            if block.refs == 0:
                self._evictable[p] = None  # most recently used end

    def drop_cache(self) -> None:
        """Forget every cached block (their pages' contents are gone, e.g. after a state
        reset); unreferenced ones become free. Blocks still referenced stay allocated to their
        holders but are no longer matched."""
        for block in list(self._blocks.values()):
            referenced = block.refs > 0
            self._forget(block)
            if not referenced:
                self._free[block.page * self.shards // self.num_pages].append(block.page)

    def _forget(self, block: _Block) -> None:
        del self._blocks[block.key]
        del self._by_page[block.page]
        self._evictable.pop(block.page, None)
        if block.snapshot is not None:
            self._snapshot_lru.pop(block.snapshot, None)
            self._free_snapshots.append(block.snapshot)

    # ---- the prefix cache --------------------------------------------------------------

    def keys(self, tokens: Sequence[int], n_blocks: int, known: Sequence[bytes] = ()) -> list[bytes]:
        """The chained keys of the first n_blocks full blocks of `tokens` (extending `known`)."""
        keys = list(known[:n_blocks])
        P = self.page_tokens
        for i in range(len(keys), n_blocks):
            keys.append(block_key(keys[-1] if keys else ROOT, tokens[i * P:(i + 1) * P]))
        return keys

    def match(self, tokens: Sequence[int]) -> tuple[list[int], int | None, int]:
        """The longest cached prefix of `tokens` that ends at a snapshot and leaves at least one
        token to compute: (its pages, now referenced by the caller; the snapshot; its length)."""
        if not self.caching:
            return [], None, 0
        P = self.page_tokens
        chain: list[_Block] = []
        parent = ROOT
        for i in range((len(tokens) - 1) // P):
            block_tokens = tuple(tokens[i * P:(i + 1) * P])
            block = self._blocks.get(block_key(parent, block_tokens))
            if block is None or block.tokens != block_tokens or block.parent != parent:
                break
            chain.append(block)
            parent = block.key
        while chain and chain[-1].snapshot is None:
            chain.pop()
        if not chain:
            return [], None, 0
        for block in chain:
            block.refs += 1
            self._evictable.pop(block.page, None)
        snapshot = chain[-1].snapshot
        self._snapshot_lru.move_to_end(snapshot)
        self.hits += 1
        self.hit_tokens += len(chain) * P
        return [b.page for b in chain], snapshot, len(chain) * P

    def register(self, keys: Sequence[bytes], tokens: Sequence[int], pages: Sequence[int], first: int) -> None:
        """Cache blocks first..len(keys)-1 of a request (full, written, in `pages`); a block
        already cached under another page is left alone (the request keeps its copy private)."""
        if not self.caching:
            return
        P = self.page_tokens
        for i in range(first, len(keys)):
            if keys[i] in self._blocks or pages[i] in self._by_page:
                continue
            block = _Block(key=keys[i], parent=keys[i - 1] if i else ROOT, tokens=tuple(tokens[i * P:(i + 1) * P]),
                           page=pages[i], refs=1)
            self._blocks[block.key] = block
            self._by_page[block.page] = block

    def snapshot_for(self, key: bytes, page: int) -> int | None:
        """A snapshot slot for the cached block `key` held in `page` (the caller fills it now),
        evicting the least recently used snapshot when none is free; None when the block is not
        this page's (not cached, or cached from another request) or already has one."""
        block = self._blocks.get(key)
        if not self.caching or block is None or block.page != page or block.snapshot is not None:
            return None
        if self._free_snapshots:
            snapshot = self._free_snapshots.popleft()
        else:
            snapshot, old_key = self._snapshot_lru.popitem(last=False)
            self._blocks[old_key].snapshot = None
        block.snapshot = snapshot
        self._snapshot_lru[snapshot] = key
        return snapshot
