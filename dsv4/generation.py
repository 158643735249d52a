"""Batch generation for notebooks and scripts, on the one step function.

`Generator` is a small continuous-batching loop over a `StepRunner`: every step carries one
decode token for each running request, then prefill chunks of waiting prompts up to the
token budget. A request holds a state slot and enough pages for prompt + max_new_tokens
from admission until it finishes, then frees them for the next prompt. The serving engine
(`serving/`) has the full scheduler; this one exists so `Model.generate` runs exactly the
program the server runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from dsv4.batch import Chunk
from dsv4.config import ModelConfig
from dsv4.sampling import NONFINITE_TOKEN, NonFiniteLogitsError
from dsv4.step import StepRunner


def derive_seed(seed: int, index: int) -> int:
    """Request `index`'s 32-bit seed from a batch seed (distinct per request, reproducible)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    max_new: int
    seed: int
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    done_prompt: int = 0  # prompt tokens already in the state
    generated: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False

    @property
    def length(self) -> int:
        """Tokens committed to the state."""
        return self.done_prompt + max(0, len(self.generated) - 1)


class Generator:
    """Generates for many prompts at once over a runner whose state it owns while it runs."""

    def __init__(self, runner: StepRunner, max_num_batched_tokens: int, data_shards: int = 1):
        """data_shards: size of the mesh's `data` axis (slots and pages are split evenly over it)."""
        self.runner = runner
        self.data_shards = data_shards
        if runner.geometry.num_slots % data_shards or runner.geometry.num_pages % data_shards:
            raise ValueError(f"{runner.geometry.num_slots} slots and {runner.geometry.num_pages} pages must split "
                             f"evenly over {data_shards} data shards")
        self.config: ModelConfig = runner.config
        self.geometry = runner.geometry
        self.budget = max_num_batched_tokens
        if max_num_batched_tokens < runner.geometry.num_slots:
            raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} must be >= the number of slots "
                             f"{runner.geometry.num_slots} (every running request decodes one token per step)")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 seeds: Sequence[int], stop_token_ids: Sequence[int] = (),
                 progress: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """New tokens per prompt (stopping after a stop token, which is included, or max_new_tokens)."""
        geo = self.geometry
        pages_per_req = [math.ceil((len(p) + max_new_tokens) / geo.page_tokens) for p in prompts]
        for i, p in enumerate(prompts):
            if len(p) + max_new_tokens > geo.max_seq_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} exceed the "
                                 f"maximum sequence length {geo.max_seq_len}")
        if max(pages_per_req) > geo.num_pages // self.data_shards:
            raise ValueError(f"a request needs {max(pages_per_req)} pages, a data shard has "
                             f"{geo.num_pages // self.data_shards}")
        requests = [_Request(i, list(p), max_new_tokens, seeds[i]) for i, p in enumerate(prompts)]
        waiting = list(requests)
        running: list[_Request] = []
        # Under data parallelism a slot's rings and its pages live on one data shard: slot s
        # and page p belong to shard s * n // slots and p * n // pages, so a request takes
        # pages from its own slot's shard and never reads across devices.
        n = self.data_shards
        free_slots = list(range(geo.num_slots))
        free_pages = [[p for p in range(geo.num_pages) if p * n // geo.num_pages == d] for d in range(n)]

        def pages_of(slot: int) -> list[int]:
            return free_pages[slot * n // geo.num_slots]

        stops = set(int(t) for t in stop_token_ids)
        finished = 0
        while waiting or running:
            # Admit while a slot and the pages are free (FIFO).
            while waiting:
                need = pages_per_req[waiting[0].index]
                slot = next((s for s in free_slots if len(pages_of(s)) >= need), None)
                if slot is None:
                    break
                req = waiting.pop(0)
                req.slot = slot
                free_slots.remove(slot)
                pool = pages_of(slot)
                req.pages = [pool.pop(0) for _ in range(need)]
                running.append(req)
            chunks, owners = self._plan(running, temperature)
            out = self.runner.run(chunks)
            o = 0
            for req, chunk in zip(owners, chunks):
                if chunk.outputs:
                    tok = int(out.tokens[o])
                    o += 1
                    if tok == NONFINITE_TOKEN:
                        raise NonFiniteLogitsError.at(req.index, len(req.generated))
                    req.generated.append(tok)
                    if len(req.generated) >= req.max_new or tok in stops:
                        req.finished = True
                if req.done_prompt < len(req.prompt):
                    req.done_prompt += len(chunk.tokens)
            for req in [r for r in running if r.finished]:
                running.remove(req)
                free_slots.append(req.slot)
                pages_of(req.slot).extend(req.pages)
                finished += 1
                if progress is not None:
                    progress(finished, len(prompts))
        return [r.generated for r in requests]

    def _plan(self, running: list[_Request], temperature: float) -> tuple[list[Chunk], list[_Request]]:
        """This step's chunks: decode tokens first, then prefill chunks within the token budget."""
        chunks, owners = [], []
        budget = self.budget
        for req in running:
            if req.done_prompt == len(req.prompt) and req.generated:
                chunks.append(Chunk(slot=req.slot, start=req.length, tokens=[req.generated[-1]], pages=req.pages,
                                    outputs=[0], temperature=temperature, seed=req.seed))
                owners.append(req)
                budget -= 1
        for req in running:
            left = len(req.prompt) - req.done_prompt
            if left == 0 or budget <= 0 or len(chunks) >= self.runner.buckets[-1].requests:
                continue
            n = min(left, budget)
            last = n == left
            chunks.append(Chunk(slot=req.slot, start=req.done_prompt,
                                tokens=req.prompt[req.done_prompt:req.done_prompt + n], pages=req.pages,
                                outputs=[n - 1] if last else [], temperature=temperature, seed=req.seed))
            owners.append(req)
            budget -= n
        return chunks, owners
