"""The ragged token batch of one step, and the per-token view the layers read.

A step runs the new tokens of many requests at once: prefill chunks, single decode
tokens and multi-token verification blocks. Tokens of one request are contiguous rows of
the flat token axis T; the batch is padded to a static bucket (T tokens, R request rows,
O output rows, Ot tap rows). Padding tokens belong to no request (`token_req == R`) and
every write they would make is dropped, so they cannot touch any request's state.

Host side: `Chunk` describes one request's part of a step; `pack_batch` lays chunks out
into numpy arrays of a bucket's shape, checking everything a bad caller could get wrong.
Device side: `StepContext.build` expands the request-level fields to per-token arrays once
per step; every layer reads the same context.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.state import StateGeometry


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """A static step shape: token rows, request rows, output rows, hidden-tap rows."""

    tokens: int
    requests: int
    outputs: int
    taps: int = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's inputs (all int32 unless noted), padded to a bucket.

    tokens [T]: token ids (0 in padding rows).
    token_req [T]: request row of each token; R for padding.
    req_slot [R]: state slot of each request row; -1 for an empty row.
    req_start [R]: the request's committed length = position of its first token here.
    req_first_row [R]: token row of that first token.
    req_num_tokens [R]: how many tokens the request has in this step.
    page_table [R, P]: the request's pages in position order; -1 where unallocated.
    out_rows [O]: token rows whose next-token distribution is returned; -1 for none.
    out_temperature [O] (f32): sampling temperature per output row; 0 = greedy.
    out_seed [O] (uint32): the request's sampling seed.
    out_top_k [O]: top-k filter per output row; 0 = off (and in padding).
    out_top_p [O] (f32): top-p filter per output row; 1 = off (and in padding).
    out_min_p [O] (f32): min-p filter per output row; 0 = off (and in padding).
    tap_rows [Ot]: token rows whose per-layer hidden taps are returned; -1 for none.
    from_last [T]: 1 where the row's token is its slot's last sampled token, read on the
        device from `last_tokens` (the host has not seen it yet: `Chunk.token_from_last`).
    last_tokens [S]: every slot's last sampled token (`StepOutputs.last_tokens` of the step
        before, left on the device; zeros from `pack_batch`).
    """

    tokens: jax.Array
    token_req: jax.Array
    req_slot: jax.Array
    req_start: jax.Array
    req_first_row: jax.Array
    req_num_tokens: jax.Array
    page_table: jax.Array
    out_rows: jax.Array
    out_temperature: jax.Array
    out_seed: jax.Array
    out_top_k: jax.Array
    out_top_p: jax.Array
    out_min_p: jax.Array
    tap_rows: jax.Array
    from_last: jax.Array
    last_tokens: jax.Array

    @property
    def bucket(self) -> Bucket:
        return Bucket(self.tokens.shape[0], self.req_slot.shape[0], self.out_rows.shape[0], self.tap_rows.shape[0])


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One request's tokens in a step.

    slot: its state slot; start: its committed length (position of tokens[0]);
    pages: its page table (at least enough pages for start + len(tokens) positions);
    outputs: offsets into `tokens` whose next-token distributions are wanted;
    temperature / seed: how those are sampled (temperature 0 = greedy, which ignores the filters);
    taps: offsets into `tokens` whose hidden taps are wanted;
    top_k / top_p / min_p: sampling filters (0 / 1.0 / 0.0 = off; `dsv4.sampling.sample`);
    token_from_last: tokens[0] stands for the token the slot's previous step sampled, which the
        device substitutes (so the host can pack step n+1 before it has read step n's tokens).
    The later fields come last so positional construction of the older ones keeps working.
    """

    slot: int
    start: int
    tokens: Sequence[int]
    pages: Sequence[int]
    outputs: Sequence[int] = ()
    temperature: float = 0.0
    seed: int = 0
    taps: Sequence[int] = ()
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    token_from_last: bool = False  # tokens[0] is a placeholder for the slot's last sampled token


def pack_batch(chunks: Sequence[Chunk], bucket: Bucket, geometry: StateGeometry) -> StepBatch:
    """Lay `chunks` out in `bucket`'s shape (numpy arrays). ValueError on anything inconsistent."""
    t_cap, r_cap, o_cap, tap_cap, p_cap = (bucket.tokens, bucket.requests, bucket.outputs, bucket.taps,
                                           geometry.max_pages_per_seq)
    n_tokens = sum(len(c.tokens) for c in chunks)
    n_out = sum(len(c.outputs) for c in chunks)
    n_taps = sum(len(c.taps) for c in chunks)
    if len(chunks) > r_cap or n_tokens > t_cap or n_out > o_cap or n_taps > tap_cap:
        raise ValueError(f"{len(chunks)} requests / {n_tokens} tokens / {n_out} outputs / {n_taps} taps do not "
                         f"fit bucket {bucket}")
    slots = [c.slot for c in chunks]
    if len(set(slots)) != len(slots):
        raise ValueError(f"a slot appears twice in one step: {slots}")
    b = dict(
        tokens=np.zeros(t_cap, np.int32), token_req=np.full(t_cap, r_cap, np.int32),
        req_slot=np.full(r_cap, -1, np.int32), req_start=np.zeros(r_cap, np.int32),
        req_first_row=np.zeros(r_cap, np.int32), req_num_tokens=np.zeros(r_cap, np.int32),
        page_table=np.full((r_cap, p_cap), -1, np.int32), out_rows=np.full(o_cap, -1, np.int32),
        out_temperature=np.zeros(o_cap, np.float32), out_seed=np.zeros(o_cap, np.uint32),
        out_top_k=np.zeros(o_cap, np.int32), out_top_p=np.ones(o_cap, np.float32),
        out_min_p=np.zeros(o_cap, np.float32), tap_rows=np.full(tap_cap, -1, np.int32),
        from_last=np.zeros(t_cap, np.int32), last_tokens=np.zeros(geometry.num_slots, np.int32))
    row = out = tap = 0
    for i, c in enumerate(chunks):
        _check_chunk(c, geometry)
        n = len(c.tokens)
        b["tokens"][row:row + n] = c.tokens
        b["token_req"][row:row + n] = i
        b["req_slot"][i], b["req_start"][i], b["req_first_row"][i], b["req_num_tokens"][i] = c.slot, c.start, row, n
        b["page_table"][i, :len(c.pages)] = c.pages
        b["from_last"][row] = int(c.token_from_last)
        for k in c.outputs:
            b["out_rows"][out], b["out_temperature"][out], b["out_seed"][out] = row + k, c.temperature, c.seed
            # top_k >= V is off anyway; clipping keeps a huge k from overflowing int32.
            b["out_top_k"][out] = min(int(c.top_k), np.iinfo(np.int32).max)
            b["out_top_p"][out], b["out_min_p"][out] = c.top_p, c.min_p
            out += 1
        for k in c.taps:
            b["tap_rows"][tap] = row + k
            tap += 1
        row += n
    return StepBatch(**b)


def _check_chunk(c: Chunk, geometry: StateGeometry) -> None:
    n = len(c.tokens)
    if n == 0:
        raise ValueError(f"slot {c.slot}: a chunk needs at least one token")
    if not 0 <= c.slot < geometry.num_slots:
        raise ValueError(f"slot {c.slot} outside [0, {geometry.num_slots})")
    if c.start < 0 or c.start + n > geometry.max_seq_len:
        raise ValueError(f"slot {c.slot}: positions {c.start}..{c.start + n - 1} outside [0, {geometry.max_seq_len})")
    needed = -(-(c.start + n) // geometry.page_tokens)
    if len(c.pages) < needed or len(c.pages) > geometry.max_pages_per_seq:
        raise ValueError(f"slot {c.slot}: {len(c.pages)} pages given, positions up to {c.start + n - 1} need "
                         f"{needed} (at most {geometry.max_pages_per_seq})")
    if any(not 0 <= p < geometry.num_pages for p in c.pages):
        raise ValueError(f"slot {c.slot}: page ids must lie in [0, {geometry.num_pages}), got {list(c.pages)}")
    for what, offsets in (("output", c.outputs), ("tap", c.taps)):
        if any(not 0 <= k < n for k in offsets):
            raise ValueError(f"slot {c.slot}: {what} offsets must lie in [0, {n}), got {list(offsets)}")
    if not (np.isfinite(c.temperature) and c.temperature >= 0):
        raise ValueError(f"slot {c.slot}: temperature must be finite and >= 0, got {c.temperature}")
    if not (isinstance(c.top_k, (int, np.integer)) and not isinstance(c.top_k, bool) and c.top_k >= 0):
        raise ValueError(f"slot {c.slot}: top_k must be an integer >= 0 (0 = off), got {c.top_k!r}")
    # Written as `not (in range)` so that NaN fails too.
    if not 0 < c.top_p <= 1:
        raise ValueError(f"slot {c.slot}: top_p must lie in (0, 1] (1 = off), got {c.top_p}")
    if not 0 <= c.min_p <= 1:
        raise ValueError(f"slot {c.slot}: min_p must lie in [0, 1] (0 = off), got {c.min_p}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepContext:
    """Per-token view of a batch (device arrays, [T] unless noted).

    valid: the row is a real token. slot/start/first_row/end/page_table are its request's
    (0 / -1 filled for padding). positions: absolute position of the token.
    """

    valid: jax.Array
    positions: jax.Array
    slot: jax.Array
    start: jax.Array
    first_row: jax.Array
    end: jax.Array
    page_table: jax.Array  # [T, P]
    num_requests: int = dataclasses.field(metadata=dict(static=True))  # R of the bucket

    @classmethod
    def build(cls, batch: StepBatch) -> "StepContext":
        r = batch.req_slot.shape[0]
        req = batch.token_req
        rows = jnp.arange(batch.tokens.shape[0], dtype=jnp.int32)
        clipped = jnp.clip(req, 0, r - 1)
        # A row is a real token only if its request row is live AND the row lies inside that
        # request's range, so stale request rows or stale token rows can never write state.
        first, count = batch.req_first_row[clipped], batch.req_num_tokens[clipped]
        valid = (req >= 0) & (req < r) & (batch.req_slot[clipped] >= 0) & (rows >= first) & (rows < first + count)
        safe = jnp.where(valid, req, 0)

        def per_token(a: jax.Array, fill: int) -> jax.Array:
            v = a[safe]
            return jnp.where(valid.reshape(-1, *([1] * (v.ndim - 1))), v, fill)

        start, first_row = per_token(batch.req_start, 0), per_token(batch.req_first_row, 0)
        return cls(valid=valid, positions=jnp.where(valid, start + rows - first_row, 0),
                   slot=per_token(batch.req_slot, 0), start=start, first_row=first_row,
                   end=start + per_token(batch.req_num_tokens, 0), page_table=per_token(batch.page_table, -1),
                   num_requests=r)

    def entry_rows(self, entry: jax.Array, entries_per_page: int, drop_row: int,
                   tokens: jax.Array | None = None) -> jax.Array:
        """Pool rows of logical entry ids `entry` [X, S] of token rows `tokens` [X] (default: x).

        Ids < 0, unallocated pages and padding tokens map to `drop_row`.
        """
        tokens = jnp.arange(entry.shape[0]) if tokens is None else tokens
        page_slot = jnp.clip(entry // entries_per_page, 0, self.page_table.shape[1] - 1)
        page = jnp.take_along_axis(self.page_table[tokens], page_slot, axis=1)
        ok = (entry >= 0) & (page >= 0) & self.valid[tokens][:, None]
        return jnp.where(ok, page * entries_per_page + entry % entries_per_page, drop_row)

    def history_rows(self, key_pos: jax.Array, ring_size: int, ring_rows: int,
                     tokens: jax.Array | None = None) -> jax.Array:
        """Rows of key positions `key_pos` [X, S] in the virtual table [ring ; this step's rows].

        Row x of `key_pos` belongs to token row `tokens[x]` (default: x). Positions the step
        itself computes (>= the request's start) come from the step's rows, offset by
        `ring_rows`; earlier ones from the slot's ring; negative positions and padding give -1.
        """
        tokens = jnp.arange(key_pos.shape[0]) if tokens is None else tokens
        start, slot = self.start[tokens][:, None], self.slot[tokens][:, None]
        new_row = ring_rows + self.first_row[tokens][:, None] + (key_pos - start)
        ring_row = slot * ring_size + key_pos % ring_size
        rows = jnp.where(key_pos >= start, new_row, ring_row)
        return jnp.where((key_pos >= 0) & self.valid[tokens][:, None], rows, -1)

    def ring_write_rows(self, ring_size: int, drop_row: int) -> jax.Array:
        """Ring row for each token's write, [T]; only a request's last `ring_size` tokens write
        (earlier ones would collide with them), padding never does."""
        keep = self.valid & (self.positions >= self.end - ring_size)
        return jnp.where(keep, self.slot * ring_size + self.positions % ring_size, drop_row)
