"""gRPC server: `python -m serving.grpc_server [--model DIR] [--port 50051] [--host 127.0.0.1] [--metrics-port 9090]`.

Every `ServingConfig` field is a flag too (`serving.config.add_serving_flags`: --max-num-seqs,
--max-model-len, --config FILE, ...); without --model it serves the embedded demo model
(random TINY weights, byte tokenizer). The API is `serving/proto/dsv4_serving.proto`
(package dsv4.serving.v1, service Generation), beside the standard health service
(grpc.health.v1) and server reflection; Prometheus metrics are served over HTTP on
--metrics-port (0 = off; `serving.metrics`).

Lifecycle: the gRPC server starts first and answers health NOT_SERVING (Generate:
UNAVAILABLE) while the model loads and every step bucket compiles (progress is printed,
bucket i/n); then health turns SERVING. SIGTERM (or SIGINT) drains: health NOT_SERVING, new
requests UNAVAILABLE, in-flight requests run to their end (at most --drain-timeout seconds,
then they are aborted), and the process exits 0. A signal during loading or warm-up stops
the process at once (`serving.startup`).

Security: the server listens on 127.0.0.1 unless --host says otherwise. --tls-cert FILE
--tls-key FILE (PEM) serve gRPC over TLS; --api-key-file FILE makes the Generation service
require `authorization: Bearer KEY` metadata (UNAUTHENTICATED otherwise), the key being the
file's first line; health and reflection stay open, for orchestrators' probes.

Bad bytes: a request message that does not parse answers INVALID_ARGUMENT, logged as one
WARNING line; a Generate request larger than `request_size_limit(max_model_len)` answers
INVALID_ARGUMENT naming the limit (gRPC itself refuses, RESOURCE_EXHAUSTED, messages over
four times that limit before they reach the server's code).

Threads: grpc.aio, so the gRPC side is one asyncio event loop on the main thread, and the
engine is driven by `serving.engine_loop.EngineLoop`'s one thread. Why aio rather than the
synchronous server's thread pool: a stream costs a coroutine, not a thread, so the waiting
queue (max_waiting, 1024 by default) needs no pool of that size and no pool size caps it;
a client's cancel or disconnect arrives as a CancelledError in its handler, whose `finally`
cancels the request in the engine at once; and under the GIL the engine thread competes
with one event-loop thread rather than dozens of handler threads. The only hop between the
two is the engine loop calling a request's sink, which is
`loop.call_soon_threadsafe(queue.put_nowait, event)` into that request's asyncio.Queue; a
handler that finds several events queued (a slow reader) sends them as one message.

Request mapping (proto3 zeros): top_p 0 -> 1.0, max_tokens 0 -> DEFAULT_MAX_TOKENS (16),
temperature 0 = greedy, top_k / min_p / logprobs 0 = off, seed unset = drawn by the engine
(reported in Usage.seed), speculation.disable ignored while the speculation mode is none.
Everything else out of range is INVALID_ARGUMENT with every problem in the message
(`Engine.validate`, `SamplingParams.problems`, `serving.text.stop_string_problems`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import logging
import math
import sys
import threading
import uuid
from typing import Any, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from serving.config import ServingConfig, add_serving_flags, config_from_args
from serving.engine_plan import add_dry_run_flags, run_dry_run
from serving.startup import STOP_SIGNALS, stop_now
from serving.engine import Engine, EngineRequest, SamplingParams, TokenLogprob, Usage
from serving.engine_loop import EngineLoop, ErrorKind, StreamEvent
from serving.metrics import ServingMetrics
from serving.proto import dsv4_serving_pb2 as pb
from serving.proto import dsv4_serving_pb2_grpc as pb_grpc
from serving.text import stop_string_problems
from serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # dsv4.serving.v1.Generation
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9090
DEFAULT_MAX_TOKENS = 16  # what SamplingParams.max_tokens 0 means
MAX_REQUEST_ID = 256
TOKENIZE_OFF_LOOP_CHARS = 4096  # longer text prompts are tokenized on a worker thread, not the event loop

_STATUS = {ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
           ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
           ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
           ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
           ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL}


class BadRequest(ValueError):
    """A request the server refuses with INVALID_ARGUMENT; the message lists every problem."""


def request_size_limit(max_model_len: int) -> int:
    """The bytes a Generate request may have: a prompt of max_model_len tokens as text at 64
    bytes a token (many times a real tokenizer's average) or as ids, plus 1 MiB for every other
    field; never under gRPC's own default of 4 MiB."""
    return max(4 << 20, 64 * max_model_len + (1 << 20))


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """What a method receives in place of a request message that could not be read."""

    problem: str


def _lenient_parser(message_type, max_bytes: int | None):
    """A request deserializer that returns `Undecodable` instead of raising (gRPC would answer
    UNKNOWN and log a traceback per request) or, over max_bytes, before parsing."""

    def parse(data: bytes):
        if max_bytes is not None and len(data) > max_bytes:
            return Undecodable(f"the request is {len(data):,} bytes, over this server's limit of {max_bytes:,} "
                               "(set by --max-model-len)")
        try:
            return message_type.FromString(data)
        except Exception as e:  # protobuf's DecodeError, or whatever its C++ parser raises
            return Undecodable(f"the request bytes are not a {message_type.DESCRIPTOR.name} message ({e})")
    return parse


def add_generation_service(servicer: GenerationService, server, *, max_request_bytes: int | None) -> None:
    """Register the Generation service as the generated `add_GenerationServicer_to_server`
    does, but with lenient request parsers (`_lenient_parser`)."""
    methods = {"Generate": (grpc.unary_stream_rpc_method_handler, pb.GenerateRequest, pb.GenerateResponse),
               "GetModelInfo": (grpc.unary_unary_rpc_method_handler, pb.GetModelInfoRequest, pb.ModelInfo),
               "GetStats": (grpc.unary_unary_rpc_method_handler, pb.GetStatsRequest, pb.ServerStats)}
    handlers = {name: kind(getattr(servicer, name),
                           request_deserializer=_lenient_parser(request, max_request_bytes if name == "Generate" else None),
                           response_serializer=reply.SerializeToString)
                for name, (kind, request, reply) in methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


# ---- proto <-> engine -------------------------------------------------------------------


def sampling_params(s: pb.SamplingParams) -> SamplingParams:
    """The engine's parameters for the proto's, zeros mapped to their documented defaults."""
    return SamplingParams(temperature=float(s.temperature), top_p=float(s.top_p) if s.top_p != 0 else 1.0,
                          top_k=s.top_k, min_p=float(s.min_p), seed=s.seed if s.HasField("seed") else None,
                          max_tokens=s.max_tokens or DEFAULT_MAX_TOKENS, stop_token_ids=tuple(s.stop_token_ids),
                          ignore_eos=s.ignore_eos, logprobs=s.logprobs)


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: Tokenizer) -> tuple[tuple[int, ...], list[str]]:
    """(token ids, problems) of the request's prompt."""
    which = request.WhichOneof("prompt")
    if which is None:
        return (), ["no prompt: set one of text, token_ids or chat"]
    if which == "token_ids":
        return tuple(request.token_ids.ids), []
    try:
        if which == "text":
            if not request.text:
                return (), ["the prompt is empty"]
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            return tuple(tokenizer.encode(request.text, add_special_tokens=add)), []
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            return (), ["the chat prompt has no messages"]
        if any(not m["role"] for m in messages):
            return (), ["every chat message needs a role"]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tuple(tokenizer.encode(text, add_special_tokens=False)), []
    except ValueError as e:
        return (), [f"the {which} prompt cannot be encoded: {e}"]


def engine_request(request: pb.GenerateRequest, request_id: str, tokenizer: Tokenizer,
                   loop: EngineLoop) -> tuple[EngineRequest, tuple[str, ...]]:
    """(engine request, stop strings), or BadRequest naming everything that is wrong."""
    ids, bad = prompt_token_ids(request, tokenizer)
    if len(request_id) > MAX_REQUEST_ID:
        bad.append(f"request_id must be at most {MAX_REQUEST_ID} characters, got {len(request_id)}")
    stop = tuple(request.sampling.stop)
    bad += stop_string_problems(stop)
    req = EngineRequest(request_id, ids, sampling_params(request.sampling), priority=request.priority,
                        speculate=not request.speculation.disable)
    # An unusable prompt was reported above; the engine would only add "the prompt is empty".
    bad += [p for p in loop.validate(req) if not (p == "the prompt is empty" and bad)]
    if bad:
        raise BadRequest("; ".join(dict.fromkeys(bad)))
    return req, stop


def _logprob(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in lp.top])


def _usage(u: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    cached_prompt_tokens=u.cached_prompt_tokens, draft_tokens=u.draft_tokens,
                    accepted_draft_tokens=u.accepted_draft_tokens, queue_time=u.queue_s,
                    time_to_first_token=u.first_token_s, total_time=u.total_s, seed=u.seed,
                    preemptions=u.preemptions)


def response(request_id: str, events: Sequence[StreamEvent]) -> pb.GenerateResponse:
    """One message for consecutive events of a request (the last may be final)."""
    out = pb.GenerateResponse(request_id=request_id, text="".join(e.text for e in events))
    for e in events:
        out.token_ids.extend(e.token_ids)
        out.logprobs.extend(_logprob(lp) for lp in e.logprobs)
    last = events[-1]
    if last.finish_reason is not None:
        out.finish_reason = last.finish_reason.value
        out.usage.CopyFrom(_usage(last.usage))
    return out


def model_info(config: ServingConfig, model: Any, tokenizer: Tokenizer, engine: Engine) -> pb.ModelInfo:
    """What GetModelInfo answers, for a loaded `dsv4.Model` and its engine."""
    import jax

    cfg = model.config
    dtype = str(model.params["embed"]["weight"][...].dtype)
    placement = getattr(model, "placement", None)
    n_devices = math.prod(placement.mesh_shape.values()) if placement is not None else 1
    deployment, mesh = config.parallelism()
    summary = (f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads x "
               f"{cfg.head_dim}, {cfg.n_routed_experts} routed experts (top-{cfg.num_experts_per_tok}) + "
               f"{cfg.n_shared_experts} shared, vocab {cfg.vocab_size}, {dtype}, backend {config.backend}"
               + (f", {deployment} over mesh {mesh}" if deployment else ""))
    lim = engine.limits
    return pb.ModelInfo(
        model=config.model, summary=summary, vocab_size=lim.vocab_size, max_model_len=lim.max_model_len,
        max_req_tokens=lim.max_req_tokens or 0, speculation=config.speculation if engine.speculative else "none",
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=lim.max_num_batched_tokens, max_logprobs=lim.max_logprobs,
        default_max_tokens=DEFAULT_MAX_TOKENS, eos_token_ids=list(lim.eos_token_ids),
        has_chat_template=tokenizer.has_chat_template, dtype=dtype,
        device=f"{n_devices} x {jax.devices()[0].device_kind}",
        serving_config={f.name: str(getattr(config, f.name)) for f in dataclasses.fields(ServingConfig)})


# ---- the service --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Backend:
    loop: EngineLoop
    tokenizer: Tokenizer
    info: pb.ModelInfo


@dataclasses.dataclass(frozen=True)
class Security:
    """TLS (PEM bytes of the certificate chain and its private key) and the API key, each
    optional."""

    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    api_key: str | None = None

    def describe(self) -> str:
        return ", ".join(filter(None, ["TLS" if self.tls_cert else "plaintext",
                                       "API key required" if self.api_key else "no API key"]))


def read_security(tls_cert: str | None, tls_key: str | None, api_key_file: str | None) -> Security:
    """The --tls-cert / --tls-key / --api-key-file flags read; ValueError saying what is wrong."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    cert = key = api_key = None
    try:
        if tls_cert is not None:
            with open(tls_cert, "rb") as f:
                cert = f.read()
            with open(tls_key, "rb") as f:
                key = f.read()
            if b"-----BEGIN" not in cert or b"-----BEGIN" not in key:
                raise ValueError(f"--tls-cert {tls_cert} and --tls-key {tls_key} must be PEM files")
        if api_key_file is not None:
            with open(api_key_file, encoding="utf-8") as f:
                api_key = f.readline().strip()
            if not api_key:
                raise ValueError(f"--api-key-file {api_key_file}: its first line is empty")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read a TLS or API key file: {e}") from None
    return Security(cert, key, api_key)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Generation calls need `authorization: Bearer KEY` metadata, or are UNAUTHENTICATED
    before their handler runs; other services pass."""

    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}".encode()

    def _authorized(self, metadata) -> bool:
        given = [value for key, value in (metadata or ()) if key == "authorization"]
        return len(given) == 1 and hmac.compare_digest(str(given[0]).encode(), self._expected)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE}/") or \
                self._authorized(details.invocation_metadata):
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong API key (send metadata authorization: Bearer KEY)")

        if handler.response_streaming:
            async def refuse_stream(request, context):
                await refuse(request, context)
                yield  # never reached; makes this the streaming kind of handler
            return grpc.unary_stream_rpc_method_handler(refuse_stream)
        return grpc.unary_unary_rpc_method_handler(refuse)


class GenerationService(pb_grpc.GenerationServicer):
    """The Generation service; UNAVAILABLE until `attach` gives it an engine loop, and while draining."""

    def __init__(self, metrics: ServingMetrics | None = None):
        self._metrics = metrics
        self._backend: _Backend | None = None
        self.draining = False

    def attach(self, backend: _Backend) -> None:
        self._backend = backend

    async def _refuse(self, context, kind: ErrorKind, message: str):
        if self._metrics:
            self._metrics.refused(kind)
        await context.abort(_STATUS[kind], message)

    async def _decoded(self, request, context, method: str) -> None:
        """Refuse an `Undecodable` request: INVALID_ARGUMENT, one WARNING line, no traceback."""
        if isinstance(request, Undecodable):
            log.warning("%s from %s refused: %s", method, context.peer(), request.problem)
            await self._refuse(context, ErrorKind.INVALID_ARGUMENT, request.problem)

    async def _ready(self, context) -> _Backend:
        if self._backend is None:
            await self._refuse(context, ErrorKind.UNAVAILABLE, "the server is warming up")
        if self.draining:
            await self._refuse(context, ErrorKind.UNAVAILABLE, "the server is draining (shutting down)")
        return self._backend

    async def Generate(self, request: pb.GenerateRequest, context):
        await self._decoded(request, context, "Generate")
        backend = await self._ready(context)
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if len(request.text) + sum(len(m.content) for m in request.chat.messages) > TOKENIZE_OFF_LOOP_CHARS:
                req, stop = await asyncio.to_thread(engine_request, request, request_id, backend.tokenizer,
                                                    backend.loop)
            else:
                req, stop = engine_request(request, request_id, backend.tokenizer, backend.loop)
        except BadRequest as e:
            await self._refuse(context, ErrorKind.INVALID_ARGUMENT, str(e))
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        handle = backend.loop.submit(req, stop, lambda event: aloop.call_soon_threadsafe(events.put_nowait, event))
        finished = False
        try:
            while not finished:
                batch = [await events.get()]
                while not batch[-1].final and not events.empty():
                    batch.append(events.get_nowait())
                finished = batch[-1].final
                error = batch[-1].error
                if error is not None:
                    batch.pop()
                if batch:
                    yield response(request_id, batch)
                if error is not None:  # counted in the metrics by the engine loop
                    await context.abort(_STATUS[error.kind], error.message)
        finally:
            if not finished:  # the client cancelled or went away: free its slot and pages now
                backend.loop.cancel(handle)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        await self._decoded(request, context, "GetModelInfo")
        if self._backend is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is warming up")
        return self._backend.info

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.ServerStats:
        await self._decoded(request, context, "GetStats")
        if self._backend is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is warming up")
        try:
            s = await asyncio.wrap_future(self._backend.loop.stats())
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        e = s.engine
        spec = e.speculation
        drafting = {} if spec is None else dict(
            draft_tokens=spec.draft_tokens, accepted_draft_tokens=spec.accepted_draft_tokens,
            mean_acceptance_length=spec.mean_acceptance_length,
            acceptance_by_position=[a or 0.0 for a in spec.acceptance_by_position])
        return pb.ServerStats(waiting=e.waiting, running=e.running, free_slots=e.free_slots,
                              total_slots=self._backend.loop.engine.geometry.num_slots, free_pages=e.free_pages,
                              total_pages=e.total_pages, open_streams=s.open_streams, steps=e.steps,
                              tokens_scheduled=e.tokens_scheduled, tokens_generated=e.tokens_generated,
                              preemptions=e.preemptions, step_failures=s.step_failures,
                              host_ms_per_step=e.host_ms_per_step, run_ms_per_step=e.run_ms_per_step,
                              cached_pages=e.cached_pages, prefix_hits=e.prefix_hits,
                              prefix_hit_tokens=e.prefix_hit_tokens, **drafting)


class GrpcServer:
    """The aio gRPC server (Generation, health, reflection) and the metrics endpoint; the methods
    run on its event loop. start() -> attach(engine, ...) -> serve -> drain() -> stop()."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT, metrics_port: int | None = None,
                 max_request_bytes: int = request_size_limit(ServingConfig.max_model_len),
                 security: Security = Security()):
        """metrics_port: None = no metrics endpoint; 0 = any free port. max_request_bytes: the
        largest Generate request served (`request_size_limit`)."""
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.max_request_bytes, self.security = max_request_bytes, security
        self.metrics = ServingMetrics()
        self.service = GenerationService(self.metrics)
        self.health = HealthServicer()
        self.loop: EngineLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._httpd = None
        self._aloop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> int:
        """Listen (health NOT_SERVING until attach); returns the bound port."""
        self._aloop = asyncio.get_running_loop()
        # so_reuseport off: a second server on a taken port must fail, not share it. gRPC's own
        # size cap sits well above ours, so that an oversized request gets our message.
        interceptors = [ApiKeyInterceptor(self.security.api_key)] if self.security.api_key else []
        self._server = grpc.aio.server(interceptors=interceptors,
                                       options=[("grpc.so_reuseport", 0),
                                                ("grpc.max_receive_message_length", 4 * self.max_request_bytes)])
        add_generation_service(self.service, self._server, max_request_bytes=self.max_request_bytes)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._server)
        await self._set_health(False)
        address = f"{self.host}:{self.port}"
        if self.security.tls_cert:
            credentials = grpc.ssl_server_credentials([(self.security.tls_key, self.security.tls_cert)])
            self.port = self._server.add_secure_port(address, credentials)
        else:
            self.port = self._server.add_insecure_port(address)
        await self._server.start()
        if self.metrics_port is not None:
            self._httpd = self.metrics.serve_http(self.host, self.metrics_port)
            self.metrics_port = self._httpd.server_address[1]
        return self.port

    async def attach(self, engine: Engine, tokenizer: Tokenizer, info: pb.ModelInfo) -> None:
        """Serve `engine` (warmed up): start its loop thread, health SERVING."""
        self.loop = EngineLoop(engine, tokenizer, observer=self.metrics, on_health=self._health_from_loop).start()
        self.metrics.set_engine_gauges(engine.stats(), 0)
        self.service.attach(_Backend(self.loop, tokenizer, info))
        await self._set_health(True)

    async def drain(self, timeout: float | None) -> bool:
        """Health NOT_SERVING, new requests UNAVAILABLE, wait for the open ones; False on timeout."""
        self.service.draining = True
        await self.health.enter_graceful_shutdown()
        if self.loop is None:
            return True
        return await asyncio.to_thread(self.loop.drain, timeout)

    async def stop(self, grace: float = 2.0) -> None:
        """Abort what is still open, then stop listening (after `grace` seconds for the last messages)."""
        self.service.draining = True
        if self.loop is not None:
            await asyncio.to_thread(self.loop.stop)
        if self._server is not None:
            await self._server.stop(grace)
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    def _health_from_loop(self, healthy: bool) -> None:
        """The engine loop's health callback (its thread)."""
        if self._aloop is not None and not self._aloop.is_closed():
            asyncio.run_coroutine_threadsafe(self._set_health(healthy), self._aloop)


class ServerThread:
    """A GrpcServer on an event loop of its own thread, over an engine that is already warmed up
    (tests, notebooks). `start()` returns once it serves; `call(coro)` runs a coroutine on its loop."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, info: pb.ModelInfo, *, host: str = "127.0.0.1",
                 port: int = 0, metrics_port: int | None = 0, security: Security = Security()):
        self.server = GrpcServer(host=host, port=port, metrics_port=metrics_port,
                                 max_request_bytes=request_size_limit(engine.limits.max_model_len), security=security)
        self._engine, self._tokenizer, self._info = engine, tokenizer, info
        self._aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aloop.run_forever, name="grpc-server", daemon=True)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int | None:
        return self.server.metrics_port

    @property
    def loop(self) -> EngineLoop:
        return self.server.loop

    def call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._aloop).result(timeout)

    def start(self) -> ServerThread:
        self._thread.start()
        self.call(self.server.start())
        self.call(self.server.attach(self._engine, self._tokenizer, self._info))
        return self

    def stop(self, drain_timeout: float | None = 0.0) -> None:
        self.call(self.server.drain(drain_timeout))
        self.call(self.server.stop())
        self._aloop.call_soon_threadsafe(self._aloop.stop)
        self._thread.join()
        self._aloop.close()


# ---- the command line ---------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serving.grpc_server", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on, gRPC and metrics (default: %(default)s, this machine only; "
                        "0.0.0.0 listens on every interface: add --tls-cert / --tls-key and --api-key-file)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port; 0 = any free one (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help="Prometheus HTTP port; 0 = off (default: %(default)s)")
    p.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve gRPC over TLS (with --tls-key)")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="a file whose first line is the API key Generation calls must send as metadata "
                        "'authorization: Bearer KEY' (health and reflection stay open)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before aborting them (default: %(default)s)")
    add_serving_flags(p)
    add_dry_run_flags(p)
    return p.parse_args(argv)


def _load(config: ServingConfig):
    """(model, tokenizer, warmed-up engine); prints progress (runs on a worker thread)."""
    from serving.config import load_model, make_engine

    print(f"loading {config.model} ...", flush=True)
    model, tokenizer = load_model(config)
    print(model.load_summary or f"loaded {config.model}", flush=True)

    def progress(i: int, n: int, bucket) -> None:
        print(f"warming up: bucket {i + 1}/{n} ({bucket.tokens} tokens, {bucket.requests} requests)", flush=True)

    engine = make_engine(model, config, eos_token_ids=tokenizer.eos_token_ids, progress=progress)
    return model, tokenizer, engine


async def serve(config: ServingConfig, *, host: str, port: int, metrics_port: int | None,
                drain_timeout: float, security: Security = Security()) -> int:
    """Run the server until SIGTERM / SIGINT; the process's exit code."""

    server = GrpcServer(host=host, port=port, metrics_port=metrics_port,
                        max_request_bytes=request_size_limit(config.max_model_len), security=security)
    bound = await server.start()
    metrics = f", metrics on http://{host}:{server.metrics_port}/metrics" if server.metrics_port else ""
    print(f"listening on {host}:{bound} ({security.describe()}){metrics} (NOT_SERVING until warmed up)", flush=True)
    shutdown = asyncio.Event()
    received: list[int] = []
    aloop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        aloop.add_signal_handler(sig, lambda s=sig: (received.append(s), shutdown.set()))
    loading = asyncio.ensure_future(asyncio.to_thread(_load, config))
    stopping = asyncio.ensure_future(shutdown.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():  # a signal during loading or warm-up: the worker thread cannot be stopped
        await server.stop(0)
        stop_now(received[0], "loading and warm-up")
    stopping.cancel()
    try:
        model, tokenizer, engine = loading.result()
    except (OSError, ValueError) as e:
        print(f"error: cannot serve {config.model}: {e}", file=sys.stderr, flush=True)
        await server.stop(0)
        return 2
    if not shutdown.is_set():
        await server.attach(engine, tokenizer, model_info(config, model, tokenizer, engine))
        print(f"serving {config.model} on {host}:{bound}", flush=True)
        await shutdown.wait()
        print(f"draining {server.loop.open_streams} open requests (at most {drain_timeout:g}s) ...", flush=True)
        if not await server.drain(drain_timeout):
            print(f"drain timed out: aborting {server.loop.open_streams} requests", flush=True)
    await server.stop()
    print("stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = config_from_args(args)
        security = read_security(args.tls_cert, args.tls_key, args.api_key_file)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return run_dry_run(config, args.device_memory_gib)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("serving").setLevel(logging.INFO)
    return asyncio.run(serve(config, host=args.host, port=args.port, metrics_port=args.metrics_port or None,
                             drain_timeout=args.drain_timeout, security=security))


if __name__ == "__main__":
    raise SystemExit(main())
