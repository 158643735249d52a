"""The gRPC server over real loopback gRPC.

Two servers, each built once per module: `served`, the embedded demo model (random TINY
weights, byte tokenizer) on the real step, for numerics (greedy == `Model.generate` ==
teacher-forced argmax, 32 concurrent streams, seeded sampling, cancellation, a bad-input
fuzz, health / reflection / metrics); and `mock`, the engine over the hand-computable mock
runner of tests/test_engine.py, with a gate that holds a step and a switch that makes steps
raise, for what needs exact timing (a full queue, duplicate ids, stop strings, a failing
step). The SIGTERM drain runs the real command line as a subprocess, started when the module
begins so its warm-up overlaps the in-process one (the machine has 2 cores).
"""

from __future__ import annotations

import filecmp
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

for _module in ("grpc", "grpc_health", "grpc_reflection", "prometheus_client"):
    pytest.importorskip(_module)

# One worker runs the whole file under `--dist loadgroup` (the GPU tier): its tests are quick and
# share servers that take long to compile, which workers would otherwise each build again.
pytestmark = pytest.mark.xdist_group("grpc_server")

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dsv4.config import TINY  # noqa: E402
from serving import grpc_server  # noqa: E402
from serving.config import ServingConfig, load_model, make_engine  # noqa: E402
from serving.demo_model import ensure_demo_checkpoint  # noqa: E402
from serving.engine import Engine, EngineLimits, EngineRequest, SamplingParams  # noqa: E402
from serving.proto import dsv4_serving_pb2 as pb  # noqa: E402
from serving.proto import dsv4_serving_pb2_grpc as pb_grpc  # noqa: E402
from tests.subprocesses import child_env  # noqa: E402
from tests.test_engine import MockRunner, expected  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = TINY.vocab_size
MAX_LEN = 64
TIMEOUT = 120  # seconds for any one call


# ---- helpers ----------------------------------------------------------------------------------


def collect(stub, request: pb.GenerateRequest, **kw):
    """(token ids, text, last response) of one streamed request."""
    tokens, text, last = [], [], None
    for r in stub.Generate(request, timeout=TIMEOUT, **kw):
        tokens += r.token_ids
        text.append(r.text)
        last = r
    return tokens, "".join(text), last


def ids_request(ids, request_id="", **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=list(ids)),
                              sampling=pb.SamplingParams(**sampling))


def health_status(channel, service=""):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def wait_for(condition, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def stats(stub) -> pb.ServerStats:
    return stub.GetStats(pb.GetStatsRequest(), timeout=10)


def one_device() -> str:
    """The served model's devices as ModelInfo names them (the fixtures serve on one device)."""
    return f"1 x {jax.devices()[0].device_kind}"


def idle(stub) -> bool:
    s = stats(stub)
    return s.open_streams == 0 and s.free_slots == s.total_slots and s.free_pages == s.total_pages


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_checkpoint(str(tmp_path_factory.mktemp("grpc") / "demo"))


@pytest.fixture(scope="module")
def drain_process(demo_dir, tmp_path_factory):
    """`python -m serving.grpc_server` on any free port, one small bucket, ready for the SIGTERM test."""
    out = tmp_path_factory.mktemp("drain")
    stdout, stderr = open(out / "stdout", "w+"), open(out / "stderr", "w+")
    cmd = [sys.executable, "-m", "serving.grpc_server", "--model", "tiny", "--demo-dir", demo_dir, "--host",
           "127.0.0.1", "--port", "0", "--metrics-port", "0", "--max-num-seqs", "1", "--max-num-batched-tokens",
           "4", "--bucket-tokens", "4", "--max-model-len", "512", "--compilation-cache", "", "--drain-timeout", "60"]
    env = child_env(JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=stdout, stderr=stderr, env=env)
    proc.stdout_path, proc.stderr_path = out / "stdout", out / "stderr"
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    stdout.close()
    stderr.close()


@pytest.fixture(scope="module")
def served(demo_dir, drain_process):
    config = ServingConfig(model="tiny", demo_dir=demo_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                           max_model_len=MAX_LEN, bucket_tokens=(4, 32), max_logprobs=3, compilation_cache=None)
    yield from real_server(config)


def real_server(config):
    """The demo model served by a ServerThread for `config`, with .model, .tokenizer, .channel
    and .stub; stopped after the module (a generator for a fixture)."""
    model, tokenizer = load_model(config)
    engine = make_engine(model, config, eos_token_ids=tokenizer.eos_token_ids)
    server = grpc_server.ServerThread(engine, tokenizer, grpc_server.model_info(config, model, tokenizer, engine))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    server.model, server.tokenizer, server.channel = model, tokenizer, channel
    server.stub = pb_grpc.GenerationStub(channel)
    yield server
    channel.close()
    server.stop()


class LetterTokenizer:
    """For the mock vocabulary (50 ids): id i >= 2 is the letter chr(ord('A') + i - 2); 0 / 1 have no text."""

    vocab_size, bos_token_id, eos_token_ids, has_chat_template = 50, 0, (1,), False

    def encode(self, text, *, add_special_tokens=True):
        return [0] * add_special_tokens + [ord(c) - ord("A") + 2 for c in text]

    def decode(self, ids, *, skip_special_tokens=True):
        return "".join(chr(ord("A") + i - 2) for i in ids if i >= 2)

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        raise ValueError("no chat template")


class GatedRunner(MockRunner):
    """MockRunner whose steps wait for `gate` and raise while `fail` > 0 (at launch: `dispatch`, or
    `run` for an engine that runs a step in one call)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = 0
        self.calls = 0
        self.pause_at = -1  # the call that closes the gate on itself

    def _hold(self):
        self.calls += 1
        if self.calls == self.pause_at:
            self.gate.clear()
        self.entered.set()
        self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise RuntimeError("injected step failure")

    def dispatch(self, chunks):
        self._hold()
        return super().dispatch(chunks)

    def run(self, chunks):
        self._hold()
        return super().run(chunks)


@pytest.fixture(scope="module")
def mock():
    runner = GatedRunner(slots=2, pages=16, page_tokens=4, max_pages=8, tokens=16, requests=2)
    limits = EngineLimits(vocab_size=50, eos_token_ids=(1,), max_num_batched_tokens=16, max_model_len=32,
                          max_waiting=2)
    server = grpc_server.ServerThread(Engine(runner, limits), LetterTokenizer(), pb.ModelInfo(model="mock"),
                                      metrics_port=None).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    server.runner, server.channel, server.stub = runner, channel, pb_grpc.GenerationStub(channel)
    yield server
    # A test that failed midway may have left the runner gated or failing: the engine loop
    # would then wait on the gate forever and the server's stop with it (a hang, not a failure).
    runner.fail, runner.pause_at = 0, -1
    runner.gate.set()
    channel.close()
    server.stop()


# ---- the protocol files ---------------------------------------------------------------------------


def test_generated_code_is_what_the_proto_regenerates(tmp_path):
    pytest.importorskip("grpc_tools")
    from serving.proto.regenerate import GENERATED, regenerate

    regenerate(str(tmp_path))
    for name in GENERATED:
        committed = os.path.join(REPO, "serving", "proto", name)
        assert filecmp.cmp(tmp_path / "serving" / "proto" / name, committed, shallow=False), (
            f"{committed} is stale: run python -m serving.proto.regenerate")


# ---- the real model -------------------------------------------------------------------------------


def test_greedy_through_the_server_equals_generate_and_teacher_forced_argmax(served):
    prompt = [5, 300, 17, 99, 42, 260, 7]
    tokens, text, last = collect(served.stub, ids_request(prompt, max_tokens=10, ignore_eos=True, logprobs=2))
    want = served.model.generate(prompt, 10, max_num_seqs=1, max_num_batched_tokens=1)  # one program to compile
    assert tokens == want
    logits = np.asarray(served.model.logits([prompt + tokens[:-1]]))[0]
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == tokens
    assert text == served.tokenizer.decode(tokens)
    assert last.finish_reason == "length"
    u = last.usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens, u.draft_tokens) == (7, 10, 0, 0)
    assert 0 <= u.queue_time <= u.time_to_first_token <= u.total_time


def test_logprobs_come_with_each_token(served):
    got = list(served.stub.Generate(ids_request([3, 40, 41], max_tokens=4, logprobs=3, ignore_eos=True),
                                    timeout=TIMEOUT))
    tokens = [t for r in got for t in r.token_ids]
    lps = [lp for r in got for lp in r.logprobs]
    assert [lp.token_id for lp in lps] == tokens and all(len(lp.top) == 3 for lp in lps)
    for lp in lps:  # greedy: the sampled token is the best one
        assert lp.top[0].token_id == lp.token_id and math.isclose(lp.top[0].logprob, lp.logprob, rel_tol=1e-5)
        assert lp.logprob <= 0 and [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)


def test_text_and_chat_prompts_are_encoded_with_the_tokenizer(served):
    tok = served.tokenizer
    by_text = collect(served.stub, pb.GenerateRequest(text="Hi there", sampling=pb.SamplingParams(max_tokens=5)))
    by_ids = collect(served.stub, ids_request(tok.encode("Hi there"), max_tokens=5))
    assert by_text[:2] == by_ids[:2]
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hello")])
    by_chat = collect(served.stub, pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=5)))
    rendered = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello"}]), add_special_tokens=False)
    assert by_chat[:2] == collect(served.stub, ids_request(rendered, max_tokens=5))[:2]
    assert by_chat[2].usage.prompt_tokens == len(rendered)


def test_a_repeated_prompt_reports_its_cached_prefix(served):
    prompt = list(range(100, 140))
    first = collect(served.stub, ids_request(prompt, max_tokens=4, ignore_eos=True))
    again = collect(served.stub, ids_request(prompt, max_tokens=4, ignore_eos=True))
    assert again[0] == first[0] and first[2].usage.cached_prompt_tokens == 0
    assert 0 < again[2].usage.cached_prompt_tokens < len(prompt)
    assert stats(served.stub).prefix_hits >= 1


def random_prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [(rng.integers(2, V, int(rng.integers(1, 24))).tolist(), int(rng.integers(1, 14))) for _ in range(n)]


def test_32_concurrent_streams_each_equal_its_result_alone(served):
    cases = random_prompts(32, seed=0)
    alone = [collect(served.stub, ids_request(p, max_tokens=m, ignore_eos=True))[:2] for p, m in cases]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda c: collect(served.stub, ids_request(c[0], max_tokens=c[1],
                                                                            ignore_eos=True))[:2], cases))
    assert together == alone
    assert [len(t) for t, _ in alone] == [m for _, m in cases]
    wait_for(lambda: idle(served.stub), what="the server to be idle")


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(served):
    probe = ids_request([9, 33, 120, 7], request_id="probe", temperature=0.9, top_k=50, top_p=0.95, seed=1234,
                        max_tokens=12, ignore_eos=True)
    alone, _, last = collect(served.stub, probe)
    assert last.usage.seed == 1234
    crowd = [ids_request(p, temperature=1.2, max_tokens=m) for p, m in random_prompts(10, seed=1)]
    with ThreadPoolExecutor(11) as pool:
        futures = [pool.submit(collect, served.stub, r) for r in crowd[:5]]
        busy = pool.submit(collect, served.stub, probe)
        futures += [pool.submit(collect, served.stub, r) for r in crowd[5:]]
        assert busy.result()[0] == alone
        drawn = {f.result()[2].usage.seed for f in futures}
    assert len(drawn) == len(crowd)  # unseeded requests get distinct drawn seeds, reported in usage
    other = collect(served.stub, ids_request([9, 33, 120, 7], temperature=0.9, top_k=50, top_p=0.95, seed=1235,
                                             max_tokens=12, ignore_eos=True))[0]
    assert other != alone


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_a_cancelled_stream_frees_its_slot_and_pages_at_once(served, how):
    channel = grpc.insecure_channel(f"127.0.0.1:{served.port}")
    stub = pb_grpc.GenerationStub(channel)
    registry = served.server.metrics.registry
    aborted_before = registry.get_sample_value("dsv4_requests_total", {"finish_reason": "abort"})
    call = stub.Generate(ids_request(list(range(2, 30)), max_tokens=MAX_LEN - 28, ignore_eos=True), timeout=TIMEOUT)
    first = next(call)
    assert first.token_ids and not first.finish_reason
    busy = stats(served.stub)
    assert busy.open_streams == 1 and busy.free_slots == busy.total_slots - 1 and busy.free_pages < busy.total_pages
    if how == "cancel":
        call.cancel()
    else:
        channel.close()
    wait_for(lambda: idle(served.stub), timeout=10, what="the slot and pages to come back")
    assert stats(served.stub).tokens_generated < busy.tokens_generated + MAX_LEN - 28  # it did not run to the end
    assert registry.get_sample_value("dsv4_requests_total", {"finish_reason": "abort"}) == aborted_before + 1
    channel.close()


BAD_REQUESTS = [
    (pb.GenerateRequest(), "no prompt"),
    (pb.GenerateRequest(text=""), "the prompt is empty"),
    (ids_request([]), "the prompt is empty"),
    (ids_request([3, V]), "outside the vocabulary"),
    (ids_request([3, -1]), "outside the vocabulary"),
    (ids_request([3], max_tokens=-1), "max_tokens must be >= 1"),
    (ids_request([3], max_tokens=2**31 - 1), f"exceeds max_model_len {MAX_LEN}"),
    (ids_request([3] * 60, max_tokens=10), f"exceeds max_model_len {MAX_LEN}"),
    (ids_request([3], temperature=-0.5), "temperature"),
    (ids_request([3], temperature=float("nan")), "temperature"),
    (ids_request([3], temperature=float("inf")), "temperature"),
    (ids_request([3], top_p=1.5), "top_p"),
    (ids_request([3], top_p=-0.1), "top_p"),
    (ids_request([3], top_k=-1), "top_k"),
    (ids_request([3], min_p=2.0), "min_p"),
    (ids_request([3], seed=2**32), "seed"),
    (ids_request([3], stop=[""]), "stop strings must be non-empty"),
    (ids_request([3], stop=["x" * 300]), "at most 256 characters"),
    (ids_request([3], stop=["a"] * 17), "at most 16 stop strings"),
    (ids_request([3], stop_token_ids=[V]), "stop_token_ids"),
    (ids_request([3], logprobs=4), "logprobs must be in [0, 3]"),
    (ids_request([3], logprobs=-1), "logprobs must be in [0, 3]"),
    (ids_request([3], request_id="r" * 257), "request_id must be at most 256"),
    (pb.GenerateRequest(chat=pb.ChatPrompt()), "no messages"),
    (pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(content="x")])), "needs a role"),
]


@pytest.mark.parametrize("request_, message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_requests_get_invalid_argument_saying_what_is_wrong(served, request_, message):
    with pytest.raises(grpc.RpcError) as err:
        collect(served.stub, request_)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_every_problem_is_named_and_speculation_disable_is_not_an_error(served):
    with pytest.raises(grpc.RpcError) as err:
        collect(served.stub, ids_request([3, 999], top_p=3.0, max_tokens=-2, stop=[""]))
    for part in ("outside the vocabulary", "top_p", "max_tokens", "stop strings"):
        assert part in err.value.details()
    request = ids_request([3, 4], max_tokens=3)
    request.speculation.disable = True
    assert len(collect(served.stub, request)[0]) == 3


def test_unset_fields_take_their_documented_defaults(served):
    info = served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    tokens, _, last = collect(served.stub, ids_request([3, 4, 5], ignore_eos=True))  # max_tokens 0, top_p 0
    assert len(tokens) == info.default_max_tokens == grpc_server.DEFAULT_MAX_TOKENS
    assert last.request_id and last.request_id != collect(served.stub, ids_request([3]))[2].request_id


_BAD_FIELDS = {
    "empty prompt": lambda r: r.token_ids.ClearField("ids"),
    "token out of vocabulary": lambda r: r.token_ids.ids.append(V),
    "negative token": lambda r: r.token_ids.ids.append(-7),
    "negative max_tokens": lambda r: setattr(r.sampling, "max_tokens", -5),
    "max_tokens over max_model_len": lambda r: setattr(r.sampling, "max_tokens", MAX_LEN),
    "negative temperature": lambda r: setattr(r.sampling, "temperature", -1.0),
    "top_p over 1": lambda r: setattr(r.sampling, "top_p", 1.01),
    "negative top_k": lambda r: setattr(r.sampling, "top_k", -3),
    "min_p over 1": lambda r: setattr(r.sampling, "min_p", 1.5),
    "seed over 32 bits": lambda r: setattr(r.sampling, "seed", 2**40),
    "empty stop string": lambda r: r.sampling.stop.append(""),
    "stop token out of vocabulary": lambda r: r.sampling.stop_token_ids.append(10**6),
    "logprobs too many": lambda r: setattr(r.sampling, "logprobs", 50),
    "negative logprobs": lambda r: setattr(r.sampling, "logprobs", -1),
    "no prompt": lambda r: r.ClearField("token_ids"),
}

_good_fields = st.fixed_dictionaries({
    "ids": st.lists(st.integers(2, V - 1), min_size=1, max_size=12),
    "max_tokens": st.integers(0, 20),
    "temperature": st.floats(0, 2, width=32),
    "top_p": st.floats(0, 1, width=32),
    "top_k": st.integers(0, 100),
    "seed": st.integers(0, 2**32 - 1),
    "priority": st.integers(-5, 5),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=3),
})


def test_fuzzed_bad_requests_are_invalid_while_good_ones_run_unchanged(served):
    cases = random_prompts(6, seed=3)
    alone = [collect(served.stub, ids_request(p, max_tokens=m, ignore_eos=True))[0] for p, m in cases]
    done = threading.Event()
    rounds = []

    def good_traffic():
        while not done.is_set():
            rounds.append([collect(served.stub, ids_request(p, max_tokens=m, ignore_eos=True))[0] for p, m in cases])

    @settings(max_examples=60, deadline=None, database=None)
    @given(fields=_good_fields, faults=st.lists(st.sampled_from(sorted(_BAD_FIELDS)), min_size=1, max_size=3,
                                                unique=True))
    def fuzz(fields, faults):
        request = ids_request(fields["ids"], max_tokens=fields["max_tokens"], temperature=fields["temperature"],
                              top_p=fields["top_p"], top_k=fields["top_k"], seed=fields["seed"], stop=fields["stop"])
        request.priority = fields["priority"]
        for fault in faults:
            _BAD_FIELDS[fault](request)
        with pytest.raises(grpc.RpcError) as err:
            collect(served.stub, request)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (faults, err.value.details())
        assert err.value.details()

    thread = threading.Thread(target=good_traffic)
    thread.start()
    try:
        fuzz()
    finally:
        done.set()
        thread.join()
    assert rounds and all(r == alone for r in rounds)
    assert health_status(served.channel) == health_pb2.HealthCheckResponse.SERVING
    wait_for(lambda: idle(served.stub), what="the server to be idle")


def test_health_reflection_model_info_and_metrics(served):
    assert health_status(served.channel) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(served.channel, grpc_server.SERVICE) == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    (answer,) = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10)
    names = {s.name for s in answer.list_services_response.service}
    assert {"dsv4.serving.v1.Generation", "grpc.health.v1.Health"} <= names
    info = served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.model, info.vocab_size, info.max_model_len, info.speculation) == ("tiny", V, MAX_LEN, "none")
    assert info.max_logprobs == 3 and list(info.eos_token_ids) == [TINY.eos_token_id] and info.has_chat_template
    assert info.serving_config["max_num_seqs"] == "4" and "5 layers" in info.summary
    assert info.device == one_device()
    collect(served.stub, ids_request([3, 4], max_tokens=2, ignore_eos=True))
    text = urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}/metrics", timeout=10).read().decode()
    for name in ('dsv4_requests_total{finish_reason="length"}', "dsv4_generation_tokens_total",
                 "dsv4_prompt_tokens_total", "dsv4_requests_waiting", "dsv4_requests_running",
                 "dsv4_step_host_seconds_bucket", "dsv4_step_run_seconds_count", "dsv4_preemptions_total",
                 "dsv4_time_to_first_token_seconds_bucket", "dsv4_request_latency_seconds_count",
                 'dsv4_request_errors_total{code="invalid_argument"}'):
        assert name in text, name
    sample = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert sample['dsv4_requests_total{finish_reason="length"}'] >= 1
    assert sample["dsv4_generation_tokens_total"] >= 2 and sample["dsv4_steps_total"] >= 2


def test_load_bench_runs_against_the_server(served, tmp_path):
    from bench.serving_load import main
    from bench.serving_load import problems as serving_load_problems

    out = main(["--target", f"127.0.0.1:{served.port}", "--requests", "12", "--concurrency", "4",
                "--prompt-tokens", "2,20", "--max-tokens", "1,8", "--json", str(tmp_path / "load.json")])
    s = out["summary"]
    assert s["requests"] == s["ok"] == 12 and not s["errors"]
    assert s["requests_per_s"] > 0 and s["output_tokens_per_s"] > 0
    assert 0 < s["ttft_p50_s"] <= s["latency_p99_s"] and s["latency_p50_s"] <= s["latency_p99_s"]
    assert out["meta"]["server_step"]["steps"] > 0 and out["meta"]["device"] == one_device()
    assert out["summary"]["output_tokens"] == sum(r.sampling.max_tokens for r in make_load_requests())
    # Soak mode, briefly: requests go on for the duration, every third is cancelled by its client,
    # and the server is idle afterwards.
    soak = main(["--target", f"127.0.0.1:{served.port}", "--duration", "3", "--concurrency", "6",
                 "--cancel-every", "3", "--prompt-tokens", "2,20", "--max-tokens", "4,8"])
    s = soak["summary"]
    assert s["requests"] >= 6 and s["cancelled"] == len(range(0, s["requests"], 3)) and not s["errors"]
    assert s["ok"] == s["requests"] - s["cancelled"] and serving_load_problems(soak) == []


def make_load_requests():
    from bench.serving_load import make_requests

    return make_requests(12, 0, V, MAX_LEN, (2, 20), (1, 8))


# ---- the mock engine: exact timing ----------------------------------------------------------------


def test_mock_outputs_and_stop_strings(mock):
    tokens, text, last = collect(mock.stub, ids_request([3], max_tokens=10))
    want = expected((3,), 10)
    assert tokens == want and text == LetterTokenizer().decode(want) and last.finish_reason == "length"
    stop = text[4:6]  # ends the text before position 4; the token that completed it is returned
    cut = text.find(stop)
    tokens, got_text, last = collect(mock.stub, ids_request([3], max_tokens=10, stop=[stop, "never"]))
    assert got_text == text[:cut] and tokens == want[:cut + len(stop)]
    assert last.finish_reason == "stop" and last.usage.completion_tokens == cut + len(stop)
    tokens, _, last = collect(mock.stub, ids_request([3], max_tokens=10, stop_token_ids=[want[2]]))
    assert tokens == want[:want.index(want[2]) + 1] and last.finish_reason == "stop"
    events = list(mock.loop.generate(EngineRequest("py", (3,), SamplingParams(max_tokens=10)), stop=[stop]))
    assert [t for e in events for t in e.token_ids] == want[:cut + len(stop)]
    assert "".join(e.text for e in events) == text[:cut] and events[-1].final and events[-1].usage.seed
    wait_for(lambda: idle(mock.stub), what="the mock to be idle")


def test_full_queue_is_resource_exhausted_and_duplicate_ids_already_exist(mock):
    mock.runner.gate.clear()
    mock.runner.entered.clear()
    with ThreadPoolExecutor(5) as pool:
        try:
            first = pool.submit(collect, mock.stub, ids_request([3], "A", max_tokens=3))
            assert mock.runner.entered.wait(10)  # A is inside a held step; what follows waits in the inbox
            # One at a time, each in the loop's inbox before the next is sent (the count and the
            # inbox move under one lock), so that B and C are first: sent together, the pool's
            # threads could deliver D before C (seen once in CI on two loaded cores).
            calls = {}
            for open_streams, rid in enumerate(("B", "C", "D", "A"), start=2):
                calls[rid] = pool.submit(collect, mock.stub, ids_request([4], rid, max_tokens=3))
                wait_for(lambda: mock.loop.open_streams == open_streams, what=f"{rid} to reach the loop")
        finally:
            mock.runner.gate.set()
        assert first.result()[0] == expected((3,), 3)
        for rid in ("B", "C"):  # max_waiting = 2
            assert calls[rid].result()[0] == expected((4,), 3)
        err = calls["D"].exception()
        assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "limit 2" in err.details()
        err = calls["A"].exception()
        assert err.code() is grpc.StatusCode.ALREADY_EXISTS and "'A'" in err.details()
    assert collect(mock.stub, ids_request([3], "A", max_tokens=2))[0] == expected((3,), 2)  # free again
    wait_for(lambda: idle(mock.stub), what="the mock to be idle")


def test_undecodable_and_oversized_requests_are_invalid_with_one_warning_line(mock, caplog):
    """Bytes that are no protobuf message, on every method, and a Generate request over the
    size limit: INVALID_ARGUMENT saying so, one WARNING log line each and no traceback; the
    server goes on serving."""
    limit = grpc_server.request_size_limit(32)  # the mock's max_model_len
    garbage = b"\xff\xff\xff\xff"
    oversized = ids_request([3], max_tokens=2)
    oversized.text = "A" * (limit + 1)
    cases = [("Generate", garbage, "not a GenerateRequest message"),
             ("GetStats", garbage, "not a GetStatsRequest message"),
             ("GetModelInfo", garbage, "not a GetModelInfoRequest message"),
             ("Generate", oversized.SerializeToString(), f"over this server's limit of {limit:,}")]
    caplog.set_level(logging.WARNING)
    for name, data, message in cases:
        if name == "Generate":  # no serializers: the bytes go as they are
            call = lambda: list(mock.channel.unary_stream(f"/{grpc_server.SERVICE}/Generate")(data, timeout=30))  # noqa: E731
        else:
            call = lambda: mock.channel.unary_unary(f"/{grpc_server.SERVICE}/{name}")(data, timeout=30)  # noqa: E731
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details(), name
    records = [r for r in caplog.records if r.name.startswith(("serving", "grpc"))]
    assert [r.levelno for r in records] == [logging.WARNING] * 4 and not any(r.exc_info for r in records)
    assert collect(mock.stub, ids_request([3], max_tokens=2))[0] == expected((3,), 2)
    wait_for(lambda: idle(mock.stub), what="the mock to be idle")


TLS_DIR = os.path.join(os.path.dirname(__file__), "data", "tls")  # a self-signed localhost pair, for tests only


def test_tls_and_the_api_key_guard_generation_but_not_health(tmp_path):
    """Over TLS with an API key: Generate and GetStats without the key, or with a wrong one, are
    UNAUTHENTICATED; with it they run; health answers anyone; a plaintext client gets nowhere."""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    security = grpc_server.read_security(os.path.join(TLS_DIR, "server.crt"), os.path.join(TLS_DIR, "server.key"),
                                         str(key_file))
    assert security.describe() == "TLS, API key required"
    runner = MockRunner(slots=2, pages=16, page_tokens=4, max_pages=8, tokens=16, requests=2)
    limits = EngineLimits(vocab_size=50, eos_token_ids=(1,), max_num_batched_tokens=16, max_model_len=32)
    server = grpc_server.ServerThread(Engine(runner, limits), LetterTokenizer(), pb.ModelInfo(model="mock"),
                                      metrics_port=None, security=security).start()
    credentials = grpc.ssl_channel_credentials(root_certificates=security.tls_cert)
    try:
        with grpc.secure_channel(f"localhost:{server.port}", credentials) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
                for call in (lambda: collect(stub, ids_request([3], max_tokens=2), metadata=metadata),
                             lambda: stub.GetStats(pb.GetStatsRequest(), metadata=metadata, timeout=30)):
                    with pytest.raises(grpc.RpcError) as err:
                        call()
                    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED and "API key" in err.value.details()
            good = [("authorization", "Bearer s3cret")]
            assert collect(stub, ids_request([3], max_tokens=2), metadata=good)[0] == expected((3,), 2)
            assert stub.GetStats(pb.GetStatsRequest(), metadata=good, timeout=30).tokens_generated >= 2
            assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as plain:
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_tls_and_api_key_flags_are_checked_before_anything_loads(tmp_path, capsys):
    crt, key = os.path.join(TLS_DIR, "server.crt"), os.path.join(TLS_DIR, "server.key")
    (tmp_path / "empty").write_text("\n")
    bad = [(["--tls-cert", crt], "go together"), (["--tls-cert", crt, "--tls-key", str(tmp_path / "none")], "cannot read"),
           (["--tls-cert", str(tmp_path / "empty"), "--tls-key", key], "PEM"),
           (["--api-key-file", str(tmp_path / "empty")], "first line is empty")]
    for flags, problem in bad:
        assert grpc_server.main(["--model", str(tmp_path / "no-model")] + flags) == 2, flags
        assert problem in capsys.readouterr().err, flags


def test_a_failing_step_fails_its_requests_with_internal_and_the_server_keeps_serving(mock):
    channel = mock.channel
    mock.runner.fail = 1
    with pytest.raises(grpc.RpcError) as err:
        collect(mock.stub, ids_request([3], max_tokens=4))
    assert err.value.code() is grpc.StatusCode.INTERNAL and "injected step failure" in err.value.details()
    assert idle(mock.stub) and stats(mock.stub).step_failures == 1
    assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    assert collect(mock.stub, ids_request([3], max_tokens=4))[0] == expected((3,), 4)
    mock.runner.pause_at = mock.runner.calls + 3  # fail mid-stream: after a token has gone out
    call = mock.stub.Generate(ids_request([6], max_tokens=12), timeout=TIMEOUT)
    assert list(next(call).token_ids) == expected((6,), 12)[:1]
    # The first token can come out before the runner reaches the call that closes the gate:
    # release it only once it waits there, or the release comes first and the stream hangs.
    wait_for(lambda: mock.runner.calls == mock.runner.pause_at and not mock.runner.gate.is_set(),
             what="the runner to pause")
    mock.runner.fail = 1
    mock.runner.gate.set()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() is grpc.StatusCode.INTERNAL
    wait_for(lambda: idle(mock.stub), what="the mock to be idle")
    assert collect(mock.stub, ids_request([6], max_tokens=3))[0] == expected((6,), 3)
    mock.runner.fail = 3  # three in a row: the runner is broken, health says so
    for _ in range(3):
        with pytest.raises(grpc.RpcError):
            collect(mock.stub, ids_request([5], max_tokens=2))
    wait_for(lambda: health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING")
    assert collect(mock.stub, ids_request([5], max_tokens=2))[0] == expected((5,), 2)
    wait_for(lambda: health_status(channel) == health_pb2.HealthCheckResponse.SERVING, what="SERVING again")


def test_engine_loop_drains_refuses_and_stops():
    from serving.engine_loop import EngineLoop, ErrorKind

    runner = GatedRunner(slots=2, pages=16, page_tokens=4, max_pages=8, tokens=16, requests=2)
    limits = EngineLimits(vocab_size=50, eos_token_ids=(1,), max_num_batched_tokens=16, max_model_len=32)
    loop = EngineLoop(Engine(runner, limits), LetterTokenizer()).start()
    runner.gate.clear()
    events = []
    loop.submit(EngineRequest("long", (3,), SamplingParams(max_tokens=20)), (), events.append)
    loop.submit(EngineRequest("cut", (4,), SamplingParams(max_tokens=20)), (), events.append)
    assert runner.entered.wait(10) and loop.open_streams == 2
    assert not loop.drain(timeout=0.05)  # held: nothing can finish
    late = []
    loop.submit(EngineRequest("late", (5,), SamplingParams(max_tokens=2)), (), late.append)
    assert late[0].error.kind is ErrorKind.UNAVAILABLE and loop.open_streams == 2
    runner.gate.set()
    assert loop.drain(timeout=10) and loop.open_streams == 0
    finals = {e.request_id: e for e in events if e.final}
    assert {r: f.finish_reason.value for r, f in finals.items()} == {"long": "length", "cut": "length"}
    loop.stop(timeout=10)
    with pytest.raises(RuntimeError, match="stopped"):
        loop.stats().result(1)
    # stop() with a request still open ends it with finish reason abort
    runner = GatedRunner(slots=2, pages=16, page_tokens=4, max_pages=8, tokens=16, requests=2)
    loop = EngineLoop(Engine(runner, limits), LetterTokenizer()).start()
    events.clear()
    runner.gate.clear()
    loop.submit(EngineRequest("open", (3,), SamplingParams(max_tokens=20)), (), events.append)
    assert runner.entered.wait(10)
    stopper = threading.Thread(target=loop.stop, kwargs={"timeout": 10})
    stopper.start()
    wait_for(lambda: loop._stopping, what="stop() to be called")
    runner.gate.set()
    stopper.join()
    assert events[-1].finish_reason.value == "abort" and events[-1].usage.completion_tokens < 20
    assert loop.open_streams == 0


# ---- the command line: SIGTERM drains --------------------------------------------------------------


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(drain_process):
    proc = drain_process

    def listening():
        assert proc.poll() is None, proc.stderr_path.read_text()[-3000:]
        return "listening on" in proc.stdout_path.read_text()

    wait_for(listening, timeout=60, what="the server to listen")
    line = next(x for x in proc.stdout_path.read_text().splitlines() if x.startswith("listening on"))
    port = int(line.split()[2].split(",")[0].rsplit(":", 1)[1])
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.GenerationStub(channel)

    def serving():
        assert proc.poll() is None, proc.stderr_path.read_text()[-3000:]
        return health_status(channel) == health_pb2.HealthCheckResponse.SERVING

    wait_for(serving, timeout=240, what="the subprocess to warm up")
    assert "warming up: bucket 1/1" in proc.stdout_path.read_text()
    n = 300
    call = stub.Generate(ids_request([3, 4, 5], max_tokens=n, ignore_eos=True), timeout=TIMEOUT)
    tokens = list(next(call).token_ids)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=10,
             what="NOT_SERVING")
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, ids_request([3], max_tokens=2))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    last = None
    for last in call:
        tokens += last.token_ids
    assert len(tokens) == n and last.finish_reason == "length"
    assert proc.wait(timeout=60) == 0
    out = proc.stdout_path.read_text()
    assert "draining 1 open requests" in out and "stopped" in out
    channel.close()


# ---- speculative decoding -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_served(demo_dir):
    """The demo model (it has a 3-stage DSpark head) served with speculation dspark, K = 3."""
    config = ServingConfig(model="tiny", demo_dir=demo_dir, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16,
                           max_model_len=MAX_LEN, bucket_tokens=(16,), compilation_cache=None, speculation="dspark",
                           num_speculative_tokens=3)
    yield from real_server(config)


def test_speculation_is_served_reported_and_can_be_disabled_per_request(spec_served):
    """Greedy tokens equal plain greedy decoding; usage, GetStats and the metrics count the
    drafts; a request with speculation.disable verifies none and still gets the same tokens."""
    stub = spec_served.stub
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.speculation == "dspark" and info.serving_config["num_speculative_tokens"] == "3"
    prompt = [5, 300, 17, 99, 42, 260, 7]
    want = spec_served.model.generate(prompt, 12, max_num_seqs=1, max_num_batched_tokens=1)
    tokens, _, last = collect(stub, ids_request(prompt, max_tokens=12, ignore_eos=True))
    assert tokens == want and last.usage.draft_tokens > 0
    plain = ids_request(prompt, max_tokens=12, ignore_eos=True)
    plain.speculation.disable = True
    tokens, _, last_plain = collect(stub, plain)
    assert tokens == want and last_plain.usage.draft_tokens == 0
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert stats.draft_tokens == last.usage.draft_tokens
    assert stats.accepted_draft_tokens == last.usage.accepted_draft_tokens
    assert len(stats.acceptance_by_position) == 3 and stats.mean_acceptance_length >= 1.0
    text = urllib.request.urlopen(f"http://127.0.0.1:{spec_served.metrics_port}/metrics", timeout=10).read().decode()
    sample = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert sample["dsv4_spec_draft_tokens_total"] == stats.draft_tokens
    assert sample["dsv4_spec_mean_acceptance_length"] == pytest.approx(stats.mean_acceptance_length)
    assert 'dsv4_spec_acceptance_rate{position="0"}' in sample
