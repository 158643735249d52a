"""The serving engine's scheduler against a mock runner whose outputs are computable by hand.

The mock's next token depends only on the last fed token and its position, so a request's
whole output is a pure function of its prompt (`expected`), whatever the batching, chunking,
preemption or priority did. The mock also checks what a real state would need: a chunk
continues exactly where its slot's committed length is (or restarts at 0 on a fresh or
reused slot), it has pages for every position it writes, no page is in two requests of one
step, and a slot whose page was given to another never continues without restarting.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from dsv4.batch import Bucket
from dsv4.sampling import NONFINITE_TOKEN
from dsv4.state import StateGeometry
from serving.engine import (Engine, EngineLimits, EngineRequest, FinishReason, QueueFullError, SamplingParams)

V = 50
EOS = 1


def next_token(prev: int, position: int) -> int:
    """The mock model: the token after `prev` at `position`. Never EOS (ids 2..V-1)."""
    return 2 + (prev * 3 + position) % (V - 2)


def expected(prompt, max_tokens: int) -> list[int]:
    out, prev = [], prompt[-1]
    for i in range(max_tokens):
        prev = next_token(prev, len(prompt) - 1 + i)
        out.append(prev)
    return out


class MockRunner:
    def __init__(self, *, slots=4, pages=16, page_tokens=4, max_pages=8, tokens=16, requests=4, logprobs=False):
        self.geometry = StateGeometry(num_slots=slots, num_pages=pages, page_tokens=page_tokens,
                                      max_pages_per_seq=max_pages, max_spec_tokens=0)
        self.buckets = (Bucket(tokens, requests, requests),)
        self.length: dict[int, int] = {}  # slot -> committed positions
        self.owner: dict[int, int] = {}  # page -> slot
        self.steps: list[list] = []
        self.last: dict[int, int] = {}  # slot -> its last sampled token (what token_from_last reads)
        self.logprobs = logprobs

    def collect(self, outputs):
        return outputs

    def dispatch(self, chunks):
        chunks = [dataclasses.replace(c, tokens=[self.last[c.slot]] + list(c.tokens[1:])) if c.token_from_last else c
                  for c in chunks]
        self.steps.append(list(chunks))
        assert len(chunks) <= self.buckets[0].requests and sum(len(c.tokens) for c in chunks) <= self.buckets[0].tokens
        out = []
        for c in chunks:
            if c.start == 0:  # a fresh (or reused) slot: drop what it held
                self.owner = {p: s for p, s in self.owner.items() if s != c.slot}
            else:
                assert self.length.get(c.slot) == c.start, (c.slot, c.start, self.length.get(c.slot))
            end = c.start + len(c.tokens)
            assert len(c.pages) >= -(-end // self.geometry.page_tokens)
            step_pages = [p for other in chunks if other is not c for p in other.pages]
            for p in c.pages[: -(-end // self.geometry.page_tokens)]:
                assert p not in step_pages, f"page {p} is in two requests of one step"
                previous = self.owner.get(p, c.slot)
                if previous != c.slot:  # the page moved: its old slot may only restart from 0
                    self.length[previous] = None
                self.owner[p] = c.slot
            self.length[c.slot] = end
            for k in c.outputs:
                out.append(next_token(c.tokens[k], c.start + k))
                self.last[c.slot] = out[-1]
        tokens = np.asarray(out, np.int32)
        if not self.logprobs:
            return types.SimpleNamespace(tokens=tokens, logprobs=None)
        top_ids = np.stack([tokens, tokens + 1], axis=1) if len(out) else np.zeros((0, 2), np.int32)
        return types.SimpleNamespace(tokens=tokens, logprobs=-0.5 * np.ones(len(out), np.float32), top_ids=top_ids,
                                     top_logprobs=np.tile(np.float32([-0.5, -2.0]), (len(out), 1)))


def limits(runner, **kw):
    base = dict(vocab_size=V, eos_token_ids=(EOS,), max_num_batched_tokens=runner.buckets[0].tokens,
                max_model_len=runner.geometry.max_seq_len, max_logprobs=2 if runner.logprobs else 0)
    base.update(kw)
    return EngineLimits(**base)


def drain(engine, max_steps=10_000):
    """Run to completion; {request_id: (tokens, final output)}."""
    got: dict[str, list[int]] = {}
    final = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return got, final
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.request_id not in final
                final[o.request_id] = o
    raise AssertionError("engine did not finish")


def prompts(n, rng, lo=1, hi=12):
    return [tuple(int(t) for t in rng.integers(2, V, rng.integers(lo, hi + 1))) for _ in range(n)]


def test_many_requests_come_out_as_if_alone():
    rng = np.random.default_rng(0)
    runner = MockRunner()
    engine = Engine(runner, limits(runner))
    ps = prompts(12, rng)
    for i, p in enumerate(ps):
        engine.submit(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=int(rng.integers(1, 10)))))
    want = {f"r{i}": expected(p, engine._waiting[i].req.sampling.max_tokens) for i, p in enumerate(ps)}
    got, final = drain(engine)
    assert got == want
    for i, p in enumerate(ps):
        u = final[f"r{i}"].usage
        assert final[f"r{i}"].finish_reason is FinishReason.LENGTH
        assert (u.prompt_tokens, u.completion_tokens) == (len(p), len(want[f"r{i}"]))
    for step in runner.steps:
        assert sum(len(c.tokens) for c in step) <= 16
    s = engine.stats()
    assert s.running == s.waiting == 0 and s.free_pages == 16 and s.free_slots == 4
    assert s.tokens_generated == sum(len(w) for w in want.values())


def test_a_request_whose_logits_are_not_finite_ends_with_error_and_others_go_on():
    """The step samples NONFINITE_TOKEN for a row with NaN / Inf logits: that request ends with
    finish reason error, keeping the tokens before; the marker is never handed out; its
    neighbour runs to its end; the slot and pages come back."""

    class PoisonedRunner(MockRunner):  # unusable logits at position 4 (only "bad" samples there)
        def dispatch(self, chunks):
            out = super().dispatch(chunks)
            rows = [c.start + k for c in chunks for k in c.outputs]
            out.tokens[np.asarray(rows) == 4] = NONFINITE_TOKEN
            return out

    runner = PoisonedRunner()
    engine = Engine(runner, limits(runner))
    engine.submit(EngineRequest("bad", (5, 6), SamplingParams(max_tokens=10)))
    engine.submit(EngineRequest("ok", tuple(range(2, 9)), SamplingParams(max_tokens=3)))
    got, final = drain(engine)
    assert got["bad"] == expected((5, 6), 3) and final["bad"].finish_reason is FinishReason.ERROR
    assert final["bad"].usage.completion_tokens == 3
    assert got["ok"] == expected(tuple(range(2, 9)), 3) and final["ok"].finish_reason is FinishReason.LENGTH
    s = engine.stats()
    assert s.free_slots == 4 and s.free_pages == 16


def test_decoding_requests_get_a_token_every_step_and_prefill_is_chunked():
    runner = MockRunner(tokens=8, requests=4, pages=32, max_pages=16)
    engine = Engine(runner, limits(runner))
    engine.submit(EngineRequest("short", (5, 6), SamplingParams(max_tokens=20)))
    engine.step()  # prefills "short" and samples its first token
    engine.submit(EngineRequest("long", tuple(range(2, 32)), SamplingParams(max_tokens=2)))
    sizes, long_tokens = [], []
    while not long_tokens:
        long_tokens += [t for o in engine.step() if o.request_id == "long" for t in o.new_token_ids]
        step = runner.steps[-1]
        assert [c for c in step if c.slot == 0 and len(c.tokens) == 1], "the decoding request skipped a step"
        sizes.append(sum(len(c.tokens) for c in step if c.slot != 0))
    # 30 prompt tokens in chunks of what the budget leaves; its first token comes out with the
    # step after (outputs are collected one step late, while the next step runs).
    assert sizes == [7, 7, 7, 7, 2, 1]
    got, _ = drain(engine)
    assert long_tokens + got["long"] == expected(tuple(range(2, 32)), 2)


def test_preemption_by_recompute_when_pages_run_out_keeps_every_output():
    rng = np.random.default_rng(1)
    runner = MockRunner(slots=4, pages=8, page_tokens=4, max_pages=8, tokens=16, requests=4)  # 8 pages for 4 slots
    engine = Engine(runner, limits(runner, max_model_len=24))
    ps = prompts(6, rng, 3, 8)
    for i, p in enumerate(ps):
        engine.submit(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=24 - len(p))))
    got, final = drain(engine)
    assert engine.stats().preemptions > 0
    assert sum(f.usage.preemptions for f in final.values()) == engine.stats().preemptions
    assert got == {f"r{i}": expected(p, 24 - len(p)) for i, p in enumerate(ps)}
    assert engine.stats().free_pages == 8


def test_priority_runs_first_and_is_preempted_last():
    runner = MockRunner(slots=1, pages=8, requests=1)
    engine = Engine(runner, limits(runner))
    engine.submit(EngineRequest("first", (3, 4), SamplingParams(max_tokens=2)))
    engine.submit(EngineRequest("low", (3, 4), SamplingParams(max_tokens=2), priority=5))
    engine.submit(EngineRequest("urgent", (3, 4), SamplingParams(max_tokens=2), priority=-1))
    order = []
    while engine.has_work():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "first", "low"]


def test_cancel_frees_slot_and_pages_at_once_and_ends_the_stream():
    runner = MockRunner(slots=2, pages=16)
    engine = Engine(runner, limits(runner))
    engine.submit(EngineRequest("a", tuple(range(2, 12)), SamplingParams(max_tokens=30 - 10)))
    engine.submit(EngineRequest("b", (7,), SamplingParams(max_tokens=3)))
    engine.step()
    engine.step()
    before = engine.stats()
    assert before.free_slots == 0
    assert engine.cancel("a") and not engine.cancel("a") and not engine.cancel("nope")
    after = engine.stats()
    assert after.free_slots == 1 and after.free_pages > before.free_pages and after.running == 1
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finish_reason is FinishReason.ABORT and aborted[0].new_token_ids == []
    assert aborted[0].usage.completion_tokens == 1  # the second step's token was still on the device
    engine.submit(EngineRequest("a", (9,), SamplingParams(max_tokens=1)))  # the id is free again
    got, _ = drain(engine)
    assert got["a"] == expected((9,), 1)


def test_a_waiting_request_can_be_cancelled():
    runner = MockRunner(slots=1)
    engine = Engine(runner, limits(runner))
    engine.submit(EngineRequest("run", (3,), SamplingParams(max_tokens=5)))
    engine.submit(EngineRequest("wait", (3,), SamplingParams(max_tokens=5)))
    first = engine.step()
    assert engine.cancel("wait")
    got, final = drain(engine)
    assert final["wait"].finish_reason is FinishReason.ABORT and final["wait"].usage.completion_tokens == 0
    assert [t for o in first for t in o.new_token_ids] + got["run"] == expected((3,), 5)


def test_stop_tokens_eos_and_ignore_eos():
    runner = MockRunner()
    engine = Engine(runner, limits(runner, eos_token_ids=(expected((3,), 3)[1],)))
    want = expected((3,), 6)
    engine.submit(EngineRequest("eos", (3,), SamplingParams(max_tokens=6)))
    engine.submit(EngineRequest("ignore", (3,), SamplingParams(max_tokens=6, ignore_eos=True)))
    engine.submit(EngineRequest("stop", (3,), SamplingParams(max_tokens=6, stop_token_ids=(want[0],), ignore_eos=True)))
    got, final = drain(engine)
    assert got["eos"] == want[:2] and final["eos"].finish_reason is FinishReason.STOP
    assert got["ignore"] == want and final["ignore"].finish_reason is FinishReason.LENGTH
    assert got["stop"] == want[:1] and final["stop"].finish_reason is FinishReason.STOP


@pytest.mark.parametrize("request_, message", [
    (EngineRequest("x", ()), "prompt is empty"),
    (EngineRequest("", (3,)), "request_id must not be empty"),
    (EngineRequest("x", (3, V)), "outside the vocabulary"),
    (EngineRequest("x", (3, -1)), "outside the vocabulary"),
    (EngineRequest("x", (3,), SamplingParams(max_tokens=0)), "max_tokens must be >= 1"),
    (EngineRequest("x", (3,), SamplingParams(max_tokens=32)), "exceeds max_model_len 32"),
    (EngineRequest("x", (3,), SamplingParams(temperature=-1.0)), "temperature"),
    (EngineRequest("x", (3,), SamplingParams(temperature=float("nan"))), "temperature"),
    (EngineRequest("x", (3,), SamplingParams(top_p=0.0)), "top_p"),
    (EngineRequest("x", (3,), SamplingParams(top_k=-2)), "top_k"),
    (EngineRequest("x", (3,), SamplingParams(min_p=1.5)), "min_p"),
    (EngineRequest("x", (3,), SamplingParams(seed=-1)), "seed"),
    (EngineRequest("x", (3,), SamplingParams(seed=2**32)), "seed"),
    (EngineRequest("x", (3,), SamplingParams(stop_token_ids=(V + 3,))), "stop_token_ids"),
    (EngineRequest("x", (3,), SamplingParams(logprobs=3)), "logprobs must be in [0, 0]"),
])
def test_bad_requests_are_rejected_with_what_is_wrong(request_, message):
    runner = MockRunner()
    engine = Engine(runner, limits(runner))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.submit(request_)
    assert not engine.has_work()


def test_max_req_tokens_duplicate_ids_and_a_full_queue():
    runner = MockRunner()
    engine = Engine(runner, limits(runner, max_req_tokens=10, max_waiting=2))
    with pytest.raises(ValueError, match="exceeds max_req_tokens 10"):
        engine.submit(EngineRequest("x", (3,) * 5, SamplingParams(max_tokens=6)))
    engine.submit(EngineRequest("a", (3,), SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit(EngineRequest("a", (4,), SamplingParams(max_tokens=4)))
    engine.submit(EngineRequest("b", (3,), SamplingParams(max_tokens=4)))
    with pytest.raises(QueueFullError):
        engine.submit(EngineRequest("c", (3,), SamplingParams(max_tokens=4)))
    engine.step()  # admits both: the queue has room again
    engine.submit(EngineRequest("c", (3,), SamplingParams(max_tokens=4)))


def test_seeds_are_reported_and_drawn_when_absent():
    runner = MockRunner()
    engine = Engine(runner, limits(runner), seed_source=iter([111, 222]).__next__)
    assert engine.submit(EngineRequest("given", (3,), SamplingParams(seed=7))) == 7
    assert engine.submit(EngineRequest("drawn", (3,))) == 111
    _, final = drain(engine)
    assert final["given"].usage.seed == 7 and final["drawn"].usage.seed == 111
    assert all(c.seed in (7, 111) for step in runner.steps for c in step)


def test_data_shards_take_pages_from_the_slots_shard():
    rng = np.random.default_rng(3)
    runner = MockRunner(slots=4, pages=16, page_tokens=4, max_pages=8)
    engine = Engine(runner, limits(runner), data_shards=2)
    ps = prompts(8, rng, 2, 10)
    for i, p in enumerate(ps):
        engine.submit(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=8)))
    got, _ = drain(engine)
    assert got == {f"r{i}": expected(p, 8) for i, p in enumerate(ps)}
    for step in runner.steps:
        for c in step:
            assert all(p * 2 // 16 == c.slot * 2 // 4 for p in c.pages)


def test_logprobs_pass_through_for_the_requested_width():
    runner = MockRunner(logprobs=True)
    engine = Engine(runner, limits(runner))
    engine.submit(EngineRequest("one", (3,), SamplingParams(max_tokens=2, logprobs=1)))
    engine.submit(EngineRequest("none", (3,), SamplingParams(max_tokens=2)))
    lps: dict[str, list] = {}
    while engine.has_work():
        for o in engine.step():
            lps.setdefault(o.request_id, []).append(o.logprobs)
    want = expected((3,), 2)
    assert [lp[0].token_id for lp in lps["one"]] == want
    assert all(lp[0].logprob == -0.5 and lp[0].top == ((lp[0].token_id, -0.5),) for lp in lps["one"])
    assert lps["none"] == [None, None]


def test_engine_refuses_limits_the_state_cannot_hold():
    runner = MockRunner(pages=4, max_pages=8)
    with pytest.raises(ValueError, match="needs more pages than a data shard has"):
        Engine(runner, limits(runner))
    runner = MockRunner()
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        Engine(runner, limits(runner, max_num_batched_tokens=17))
    with pytest.raises(ValueError, match="exceeds the state's 32 positions"):
        Engine(runner, limits(runner, max_model_len=33))


def test_overlap_wastes_one_step_only_on_a_stop_token_and_never_reports_it():
    """Step n+1 is launched before step n's tokens are read: a length limit is foreseen (no
    extra step), a stop token is not (one extra decode row, whose token is dropped)."""
    runner = MockRunner()
    want = expected((3,), 6)
    engine = Engine(runner, limits(runner))
    engine.submit(EngineRequest("length", (3,), SamplingParams(max_tokens=3)))
    engine.submit(EngineRequest("stop", (3,), SamplingParams(max_tokens=6, stop_token_ids=(want[1],))))
    got, final = drain(engine)
    assert got == {"length": want[:3], "stop": want[:2]}
    fed = {name: sum(len(c.tokens) for step in runner.steps for c in step if c.seed == engine_seed)
           for name, engine_seed in (("length", final["length"].usage.seed), ("stop", final["stop"].usage.seed))}
    assert fed == {"length": 1 + 2, "stop": 1 + 2}  # "stop": prompt, its first token, and the wasted one
    assert engine.stats().tokens_generated == 5
    decoded = [c for step in runner.steps for c in step if c.token_from_last]
    assert decoded and all(len(c.tokens) == 1 for c in decoded)


class FlakyRunner(MockRunner):
    """Fails the `fail_dispatch`-th dispatch or the `fail_collect`-th collect (1-based)."""

    def __init__(self, fail_dispatch=0, fail_collect=0, **kw):
        super().__init__(**kw)
        self.fail_dispatch, self.fail_collect, self.dispatches, self.collects, self.resets = (
            fail_dispatch, fail_collect, 0, 0, 0)

    def dispatch(self, chunks):
        self.dispatches += 1
        if self.dispatches == self.fail_dispatch:
            raise RuntimeError("injected launch failure")
        return super().dispatch(chunks)

    def collect(self, outputs):
        self.collects += 1
        if self.collects == self.fail_collect:
            raise RuntimeError("injected device failure")
        return outputs

    def reset_state(self):
        self.resets += 1
        self.length.clear()  # the mock's picture of the state is gone too
        self.owner.clear()


@pytest.mark.parametrize("where", ["dispatch", "collect"])
def test_a_failed_step_ends_only_its_requests_and_the_rest_recompute_exactly(where):
    from serving.engine import StepError

    rng = np.random.default_rng(7)
    runner = FlakyRunner(**{f"fail_{where}": 4}, slots=2, requests=2)
    engine = Engine(runner, limits(runner))
    ps = prompts(4, rng, 2, 6)
    for i, p in enumerate(ps):
        engine.submit(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=6)))
    got: dict[str, list[int]] = {}
    final, failed = {}, []
    while engine.has_work():
        try:
            outs = engine.step()
        except StepError as e:
            failed += e.request_ids
            assert isinstance(e.cause, RuntimeError)
            continue
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o
    assert failed and runner.resets == 1
    assert set(failed).isdisjoint(final) and set(failed) | set(final) == {f"r{i}" for i in range(4)}
    for rid, o in final.items():
        i = int(rid[1:])
        assert got[rid] == expected(ps[i], 6) and o.finish_reason is FinishReason.LENGTH
    s = engine.stats()
    assert s.free_slots == 2 and s.free_pages == 16 and s.running == s.waiting == 0
