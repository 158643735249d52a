"""The serving engine with DSpark speculation (`Engine(speculator=SpecRunner)`) on a tiny
checkpoint with a 16-token vocabulary: greedy output equals plain greedy decoding, usage
counts drafts, max_tokens and stop tokens cut exactly, seeded sampling is batch-invariant."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4
from checkpoints.loader import load_draft
from checkpoints.testing import write_tiny_checkpoint
from dsv4.ops.registry import ops_for
from dsv4.spec_decode import SpecRunner
from dsv4.state import StateGeometry, default_page_tokens
from dsv4.step import StepRunner, make_buckets
from serving.engine import Engine, EngineLimits, EngineRequest, FinishReason, SamplingParams
from tests.devices import require_devices
from tests.test_spec_decode import PROMPTS, SPEC

K = SPEC.dspark_block_size
MAX_LEN = 96
LOGPROBS = 2  # the top-n width of the shared runner's steps


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_spec")
    write_tiny_checkpoint(SPEC, path, seed=21)
    model = dsv4.load_pretrained(path, dtype="float32")
    runner, spec = spec_runner(model, load_draft(path, dtype=jnp.float32), slots=4, budget=32, token_sizes=[32],
                               max_logprobs=LOGPROBS)
    return model, runner, spec, path


def spec_runner(model, head, *, slots: int, budget: int, token_sizes, k: int = K, pages_per_slot: int = 1,
                snapshot_slots: int = 0, requests: int | None = None,
                backend: str = "reference", max_logprobs: int = 0) -> tuple[StepRunner, SpecRunner]:
    """A float32 StepRunner for MAX_LEN-token requests (buckets with K + 1 outputs per request
    and taps) and the SpecRunner over it, both on `backend`'s ops, on the model's placement."""
    page = default_page_tokens(model.config)
    per_seq = math.ceil(MAX_LEN / page)
    geometry = StateGeometry(num_slots=slots, num_pages=slots * pages_per_slot * per_seq, page_tokens=page,
                             max_pages_per_seq=per_seq, max_spec_tokens=k, dtype=jnp.float32)
    buckets = make_buckets(budget, requests or slots, max_spec_tokens=k, taps=True, token_sizes=token_sizes)
    runner = StepRunner(model.graphdef, model.params, model.config, geometry, buckets, ops_for(backend),
                        snapshot_slots=snapshot_slots, placement=model.placement, max_logprobs=max_logprobs)
    return runner, SpecRunner(runner, head, ops_for(backend), k=k)


def engine(parts, **kw):
    _, runner, spec, _ = parts
    spec.reset()
    limits = EngineLimits(vocab_size=SPEC.vocab_size, eos_token_ids=(), max_num_batched_tokens=32,
                          max_model_len=MAX_LEN, max_waiting=64, max_logprobs=runner.max_logprobs)
    return Engine(runner, limits, speculator=spec, **kw)


def run_all(eng, requests):
    for r in requests:
        eng.submit(r)
    out, finals = {}, {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = o
    return out, finals


def test_greedy_output_is_plain_greedy_and_usage_counts_drafts(parts):
    model = parts[0]
    want = model.generate(PROMPTS, 25, max_num_seqs=3, max_num_batched_tokens=32)
    reqs = [EngineRequest(str(i), tuple(p), SamplingParams(max_tokens=25, ignore_eos=True)) for i, p in
            enumerate(PROMPTS)]
    out, finals = run_all(engine(parts), reqs)
    assert [out[str(i)] for i in range(3)] == want
    usage = [finals[str(i)].usage for i in range(3)]
    assert all(u.completion_tokens == 25 and u.draft_tokens > 0 for u in usage)
    assert sum(u.accepted_draft_tokens for u in usage) > 0
    assert all(f.finish_reason is FinishReason.LENGTH for f in finals.values())


def test_the_quantised_model_on_the_ffi_kernels_speculates_losslessly(tmp_path):
    """FP8/FP4 weights with the official activation quantisation on Backend.FFI: the target's
    and the draft stages' FP8 linears and routed experts run as kernels (fp8_linear,
    moe_experts), and speculative greedy output is still that model's plain greedy output."""
    write_tiny_checkpoint(SPEC.replace(fake_quant=True), tmp_path, seed=21, quantized=True, float_dtype="F32")
    model = dsv4.load_pretrained(tmp_path, dtype="float32", quantized=True, backend="ffi")
    assert model.config.fake_quant
    head = load_draft(tmp_path, dtype=jnp.float32, quantized=True)
    runner, spec = spec_runner(model, head, slots=3, budget=32, token_sizes=[32], backend="ffi")
    want = model.generate(PROMPTS, 12, max_num_seqs=3, max_num_batched_tokens=32)
    reqs = [EngineRequest(str(i), tuple(p), SamplingParams(max_tokens=12, ignore_eos=True)) for i, p in
            enumerate(PROMPTS)]
    out, finals = run_all(engine((model, runner, spec, tmp_path)), reqs)
    assert [out[str(i)] for i in range(3)] == want
    assert all(f.usage.draft_tokens > 0 for f in finals.values())


# tp_ep splits heads and vocabulary over `tensor` and experts over `expert`; dp_tp splits the
# requests' state over `data` (pure tp is tp_ep without its expert axis).
@pytest.mark.parametrize("deployment, sizes", [("tp_ep", (2, 2)), ("dp_tp", (2, 2))])
def test_speculation_on_a_mesh_is_plain_greedy_and_samples_as_one_device(parts, deployment, sizes):
    """The draft head sharded by the target's rules, drafting and verifying on a CPU mesh: greedy
    tokens are the unsharded plain greedy ones; a seeded sampled request gives the tokens it
    gives on one device."""
    from dsv4 import sharding as sh

    require_devices(math.prod(sizes))
    model, _, _, path = parts
    dep = sh.Deployment(deployment)
    placement = sh.Placement(sh.make_mesh(dep, sizes), dep)
    sharded = dsv4.load_pretrained(path, dtype="float32", placement=placement, draft="dspark")
    runner, spec = spec_runner(sharded, sharded.draft_head, slots=4, budget=32, token_sizes=[32])
    shards = placement.mesh_shape.get("data", 1)
    want = model.generate(PROMPTS, 14, max_num_seqs=3, max_num_batched_tokens=32)
    greedy = [EngineRequest(str(i), tuple(p), SamplingParams(max_tokens=14, ignore_eos=True))
              for i, p in enumerate(PROMPTS)]
    sampled = EngineRequest("s", tuple(PROMPTS[1]), SamplingParams(max_tokens=12, temperature=0.9, seed=7,
                                                                   ignore_eos=True))
    out, finals = run_all(engine((sharded, runner, spec, path), data_shards=shards), greedy + [sampled])
    assert [out[str(i)] for i in range(3)] == want
    assert all(finals[str(i)].usage.draft_tokens > 0 for i in range(3))
    alone, _ = run_all(engine(parts), [sampled])
    assert out["s"] == alone["s"]


def test_a_stop_token_ends_the_request_there_even_inside_a_verified_block(parts):
    model = parts[0]
    full = model.generate([PROMPTS[1]], 30, max_num_seqs=1, max_num_batched_tokens=32)[0]
    stop = full[12]
    cut = full[:full.index(stop) + 1]
    out, finals = run_all(engine(parts), [EngineRequest("s", tuple(PROMPTS[1]),
                                                        SamplingParams(max_tokens=30, stop_token_ids=(stop,), ignore_eos=True))])
    assert out["s"] == cut and finals["s"].finish_reason is FinishReason.STOP


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(parts):
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True)
    alone, _ = run_all(engine(parts), [EngineRequest("x", tuple(PROMPTS[1]), params)])
    others = [EngineRequest(f"o{i}", tuple(p), SamplingParams(max_tokens=15, temperature=1.1, seed=i,
                                                              ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    busy, _ = run_all(engine(parts), [others[0], EngineRequest("x", tuple(PROMPTS[1]), params), *others[1:]])
    assert busy["x"] == alone["x"]


def test_logprobs_under_speculation_are_the_models_log_softmax_at_each_token(parts):
    """Greedy requests asking for logprobs, with drafts accepted: every token, drafted or not,
    comes with the model's teacher-forced log_softmax there and its top 2."""
    model = parts[0]
    eng = engine(parts)
    for i, p in enumerate(PROMPTS):
        eng.submit(EngineRequest(str(i), tuple(p), SamplingParams(max_tokens=12, logprobs=LOGPROBS, ignore_eos=True)))
    tokens, lps, finals = {}, {}, {}
    while eng.has_work():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs)
            if o.finished:
                finals[o.request_id] = o
    assert sum(f.usage.accepted_draft_tokens for f in finals.values()) > 0
    for i, p in enumerate(PROMPTS):
        got = tokens[str(i)]
        assert [lp.token_id for lp in lps[str(i)]] == got
        full = np.asarray(jax.nn.log_softmax(model.logits([list(p) + got[:-1]])[0], axis=-1))[len(p) - 1:]
        np.testing.assert_allclose([lp.logprob for lp in lps[str(i)]], full[np.arange(len(got)), got], atol=2e-4)
        for lp, row in zip(lps[str(i)], full):
            assert [t for t, _ in lp.top] == np.argsort(-row, kind="stable")[:LOGPROBS].tolist()
            np.testing.assert_allclose([v for _, v in lp.top], np.sort(row)[::-1][:LOGPROBS], atol=2e-4)


def test_capacity_aware_verification_keeps_greedy_output_and_reports_telemetry(parts):
    """Compact verification from the first request on (knee 0) with a steep step-time table,
    so that lengths and the drafted depth vary: the tokens are still plain greedy's; a
    request that opts out verifies nothing; the counters add up."""
    from serving.capacity import CapacityVerifier, StepSpeedTable

    model, runner, _, path = parts
    head = load_draft(path, dtype=jnp.float32)
    spec = SpecRunner(runner, head, ops_for("reference"), k=K, depths=(2,))
    steep = StepSpeedTable.from_measurements({n: 0.01 + 0.003 * n for n in range(1, 33)})
    capacity = CapacityVerifier(K, steep, depths=(2,), knee_requests=0)
    limits = EngineLimits(vocab_size=SPEC.vocab_size, eos_token_ids=(), max_num_batched_tokens=32,
                          max_model_len=MAX_LEN, max_waiting=64)
    eng = Engine(runner, limits, speculator=spec, capacity=capacity)
    want = model.generate(PROMPTS, 25, max_num_seqs=3, max_num_batched_tokens=32)
    reqs = [EngineRequest(str(i), tuple(p), SamplingParams(max_tokens=25, ignore_eos=True), speculate=i != 1)
            for i, p in enumerate(PROMPTS)]
    out, finals = run_all(eng, reqs)
    assert [out[str(i)] for i in range(3)] == want
    usage = [finals[str(i)].usage for i in range(3)]
    assert usage[1].draft_tokens == 0 and usage[0].draft_tokens > 0
    stats = eng.stats().speculation
    assert stats.draft_tokens == sum(u.draft_tokens for u in usage)
    assert stats.accepted_draft_tokens == sum(u.accepted_draft_tokens for u in usage)
    assert stats.position_accepted[0] + stats.position_accepted[1] <= stats.accepted_draft_tokens
    assert sum(stats.position_accepted) == stats.accepted_draft_tokens
    assert stats.verifications == sum(u.completion_tokens - 1 - u.accepted_draft_tokens for u in usage)
    t = stats.capacity
    assert t.compact_steps > 0 and t.fixed_steps == 0 and 0 < t.mean_length < K
    assert usage[0].draft_tokens < 24 * K  # fewer drafts than fixed-width verification would score
    assert 2 in {depth for _, depth in spec._compiled}  # some blocks were drafted 2 deep (load-aware depth)


def test_a_prefix_cache_hit_is_kept_out_of_the_draft_context_and_tokens_stay_greedy(parts):
    """Two requests sharing a 32-token prefix, one after the other, with the prefix cache on:
    the second restores the prefix (its target rings and pages), its slot's draft rings
    forget the first request's positions, and both give plain greedy decoding's tokens."""
    model, _, _, path = parts
    runner, spec = spec_runner(model, load_draft(path, dtype=jnp.float32), slots=2, budget=16, token_sizes=[16],
                               pages_per_slot=2, snapshot_slots=4, requests=1)
    limits = EngineLimits(vocab_size=SPEC.vocab_size, eos_token_ids=(), max_num_batched_tokens=16,
                          max_model_len=MAX_LEN, max_waiting=8)
    eng = Engine(runner, limits, speculator=spec, prefix_cache=True)
    shared = PROMPTS[2][:32]
    prompts = [shared + [3, 1, 4], shared + [2, 7, 1, 8]]
    want = model.generate(prompts, 14, max_num_seqs=1, max_num_batched_tokens=16)
    got, usage = [], []
    for i, prompt in enumerate(prompts):
        out, finals = run_all(eng, [EngineRequest(f"r{i}", tuple(prompt), SamplingParams(max_tokens=14,
                                                                                           ignore_eos=True))])
        got.append(out[f"r{i}"])
        usage.append(finals[f"r{i}"].usage)
    assert got == want
    assert usage[0].cached_prompt_tokens == 0 and usage[1].cached_prompt_tokens == 32
    assert usage[1].draft_tokens > 0
    held = np.asarray(spec.draft.ring_pos[0])  # both ran in slot 0
    assert held[held >= 0].min() == 32  # the restored prefix's positions are not draft context
