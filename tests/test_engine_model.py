"""The engine on a real tiny checkpoint: greedy output == `Model.generate` == teacher-forced
argmax; seeded sampling does not depend on the batch; preemption by recompute changes no
token; logprobs are the model's."""

from __future__ import annotations

import numpy as np
import pytest

import dsv4
from checkpoints.testing import write_tiny_checkpoint
from dsv4.config import TINY
from dsv4.ops.registry import ops_for
from dsv4.state import StateGeometry, default_page_tokens
from dsv4.step import StepRunner, make_buckets
from serving.config import ServingConfig, make_engine
from serving.engine import Engine, EngineLimits, EngineRequest, SamplingParams
from tests.tolerances import REL

MAX_LEN = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_model")
    write_tiny_checkpoint(TINY, path, seed=11)
    return dsv4.load_pretrained(path, dtype="float32")


@pytest.fixture(scope="module")
def engine(model):
    config = ServingConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=MAX_LEN, bucket_tokens=(4, 32),
                           max_logprobs=3, compilation_cache=None)
    return make_engine(model, config)


def run_all(engine: Engine, requests) -> dict[str, list[int]]:
    for r in requests:
        engine.submit(r)
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_greedy_engine_equals_generate_and_teacher_forced_argmax(model, engine):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, TINY.vocab_size, int(n)).tolist() for n in rng.integers(3, 40, 6)]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    got = run_all(engine, [EngineRequest(f"r{i}", tuple(p), greedy) for i, p in enumerate(prompts)])
    assert engine.runner.recompilations == 0
    want = model.generate(prompts, 8, max_num_seqs=4, max_num_batched_tokens=32)
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    for p, new in list(zip(prompts, want))[:2]:  # (each length compiles a forward program)
        logits = np.asarray(model.logits([p + new[:-1]]))[0]
        assert logits[len(p) - 1:].argmax(-1).tolist() == new


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(engine):
    rng = np.random.default_rng(1)
    probe = EngineRequest("probe", (5, 17, 33, 9), SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=42,
                                                                   max_tokens=10, ignore_eos=True))
    alone = run_all(engine, [probe])["probe"]
    crowd = [EngineRequest(f"n{i}", tuple(rng.integers(2, TINY.vocab_size, int(rng.integers(2, 30))).tolist()),
                           SamplingParams(temperature=1.3, seed=i, max_tokens=int(rng.integers(1, 12))))
             for i in range(7)]
    busy = run_all(engine, crowd[:3] + [probe] + crowd[3:])["probe"]
    assert busy == alone
    other_seed = run_all(engine, [EngineRequest("probe", probe.prompt_token_ids,
                                                SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=43,
                                                               max_tokens=10, ignore_eos=True))])["probe"]
    assert other_seed != alone


def test_preemption_by_recompute_changes_no_token(model):
    page = default_page_tokens(model.config)
    per_seq = MAX_LEN // page
    geometry = StateGeometry(num_slots=4, num_pages=per_seq + 2, page_tokens=page, max_pages_per_seq=per_seq,
                             max_spec_tokens=0, dtype=np.float32)
    runner = StepRunner(model.graphdef, model.params, model.config, geometry,
                        make_buckets(32, 4, token_sizes=[4, 32]), ops_for("reference"))
    limits = EngineLimits(vocab_size=TINY.vocab_size, eos_token_ids=(TINY.eos_token_id,), max_num_batched_tokens=32,
                          max_model_len=MAX_LEN)
    engine = Engine(runner, limits)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, TINY.vocab_size, int(n)).tolist() for n in rng.integers(10, 30, 4)]
    params = [SamplingParams(max_tokens=MAX_LEN - len(p), ignore_eos=True, temperature=t, seed=7)
              for p, t in zip(prompts, (0.0, 0.8, 0.0, 1.1))]
    got = run_all(engine, [EngineRequest(f"r{i}", tuple(p), s) for i, (p, s) in enumerate(zip(prompts, params))])
    assert engine.stats().preemptions > 0
    for i, (p, s) in enumerate(zip(prompts, params)):
        alone = run_all(engine, [EngineRequest("alone", tuple(p), s)])["alone"]
        assert got[f"r{i}"] == alone, i


def test_logprobs_are_the_models_log_softmax(model, engine):
    prompt = [3, 40, 41, 42, 7]
    engine.submit(EngineRequest("lp", tuple(prompt), SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True)))
    tokens, lps = [], []
    while engine.has_work():
        for o in engine.step():
            tokens += o.new_token_ids
            lps += o.logprobs
    logits = np.asarray(model.logits([prompt + tokens[:-1]]), np.float64)[0, len(prompt) - 1:]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    for row, (tok, lp) in enumerate(zip(tokens, lps)):
        assert lp.token_id == tok
        np.testing.assert_allclose(lp.logprob, logp[row, tok], rtol=REL[np.dtype(np.float32)], atol=1e-5)
        best = np.argsort(-logp[row])[:3]
        assert [i for i, _ in lp.top] == best.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], logp[row, best], rtol=1e-4, atol=1e-5)


def _run_with_logprobs(engine: Engine, request: EngineRequest):
    engine.submit(request)
    tokens, lps, final = [], [], None
    while engine.has_work():
        for o in engine.step():
            tokens += o.new_token_ids
            lps += [(lp.logprob, lp.top) for lp in o.logprobs]
            final = o if o.finished else final
    return tokens, lps, final.usage


def test_a_restored_prefix_gives_exactly_the_cold_prefill_logits(engine):
    page = engine.geometry.page_tokens  # 16 for TINY; chunks of <= 32 tokens end on block boundaries
    rng = np.random.default_rng(4)
    shared = rng.integers(2, TINY.vocab_size, 40).tolist()
    params = SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True, temperature=0.7, seed=5)
    cold = _run_with_logprobs(engine, EngineRequest("cold", tuple(shared + [7, 8, 9]), params))
    assert cold[2].cached_prompt_tokens == 0
    hits = engine.stats().prefix_hits
    warm = _run_with_logprobs(engine, EngineRequest("warm", tuple(shared + [7, 8, 9]), params))
    # Blocks [0, 32) ended a prefill chunk (snapshot at 32); block [32, 48) was never a chunk end.
    assert warm[2].cached_prompt_tokens == 2 * page and engine.stats().prefix_hits == hits + 1
    assert warm[0] == cold[0] and warm[1] == cold[1]  # tokens and logprobs, bit for bit
    # A prompt that differs inside the first snapshotted span fails closed (recomputes).
    other = _run_with_logprobs(engine, EngineRequest("other", tuple(shared[:20] + [3] * 23), params))
    assert other[2].cached_prompt_tokens == 0
