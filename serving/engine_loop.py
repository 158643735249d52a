"""The serving engine on its own thread, for callers on other threads (the gRPC server).

Lifecycle: `EngineLoop(engine, tokenizer)` wraps a warmed-up `serving.engine.Engine`;
`start()` spawns the one thread that owns it. That thread runs `engine.step()` while the
engine has work and sleeps on a condition variable when it has none. `submit`, `cancel` and
`stats` may be called from any thread: each puts a command on the inbox (a deque guarded by
the same condition), which the loop thread runs between two steps, so nothing but the loop
thread ever touches the engine. `drain(timeout)` refuses new submissions and waits for the
open ones to finish; `stop()` aborts whatever is still open and joins the thread.

One request: `submit(request, stop, sink)` returns a `RequestHandle` at once; `sink(event)`
then receives `StreamEvent`s on the loop thread: zero or more with new tokens and text, then
exactly one final event (a finish reason, or an error), after which it is never called
again. A submission refused on the spot (the loop is draining) gets its one error event on
the caller's thread. Sinks must be quick and must not raise: a server's sink hands the event
to its own event loop. Each request's text goes through a `serving.text.TextStream`
(incremental detokenisation, stop strings); when a stop string appears the loop cancels the
request with `FinishReason.STOP` before the next step, so no token after it is generated.

Request ids: an id is in flight from its submission until its final event; a second
submission of it meanwhile is refused (ALREADY_EXISTS). The loop keeps its own table rather
than relying on the engine's, because a cancelled request's final output only comes out of
the next `engine.step()`, and a new request of the same id submitted in between would
otherwise receive it.

Failures: a request the engine refuses gets one error event (INVALID_ARGUMENT with
`Engine.submit`'s message, RESOURCE_EXHAUSTED for `QueueFullError`). An exception while
turning one request's output into text fails that request alone (INTERNAL) and cancels it.
A `StepError` from `engine.step()` (the runner failed) fails the requests of the failed
step with INTERNAL; the engine has already ended them, reset its device state and sent the
other requests back to recompute, so they go on unchanged. Any other exception from
`engine.step()` (a bug) fails every open request with INTERNAL and cancels them all,
leaving the engine empty and the loop serving; requests whose stop string had already
appeared end normally then (finish reason stop). After `max_consecutive_failures` failed
steps in a row the loop reports itself unhealthy (`on_health(False)`, health NOT_SERVING)
so an orchestrator can replace the process; a step that succeeds reports healthy again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import logging
import queue
import threading
import time
from typing import Callable, Iterator, Protocol, Sequence

from serving.engine import (Engine, EngineRequest, EngineStats, FinishReason, QueueFullError, RequestOutput, StepError,
                            TokenLogprob, Usage)
from serving.text import TextStream
from serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class ErrorKind(str, enum.Enum):
    """Why a request ended without a finish reason (named after the gRPC status it maps to)."""

    INVALID_ARGUMENT = "invalid_argument"
    ALREADY_EXISTS = "already_exists"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


@dataclasses.dataclass(frozen=True)
class RequestError:
    kind: ErrorKind
    message: str


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """New tokens and text of one request; the final event has finish_reason and usage, or an error."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: RequestError | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


Sink = Callable[[StreamEvent], None]


class RequestHandle:
    """One submission (identity matters: `cancel` ends this submission, never a later one of the same id)."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str):
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r})"


@dataclasses.dataclass(frozen=True)
class LoopStats:
    engine: EngineStats
    open_streams: int  # accepted requests whose final event is not sent yet
    step_failures: int  # engine steps that raised, since start


class LoopObserver(Protocol):
    """What the loop reports as it goes (`serving.metrics.ServingMetrics`); called on the loop
    thread, except `refused` for a submission refused on the spot (the caller's thread)."""

    def accepted(self, prompt_tokens: int) -> None: ...

    def refused(self, kind: ErrorKind) -> None: ...

    def tokens(self, n: int) -> None: ...

    def finished(self, reason: FinishReason, usage: Usage) -> None: ...

    def failed(self, kind: ErrorKind) -> None: ...

    def step(self, before: EngineStats, after: EngineStats, open_streams: int) -> None: ...

    def step_failed(self) -> None: ...


@dataclasses.dataclass
class _Stream:
    """A request the loop has handed to the engine."""

    handle: RequestHandle
    sink: Sink
    text: TextStream
    received_at: float  # when submit() was called (the loop's clock)
    lag: float = 0.0  # received -> handed to the engine (waiting in the inbox)
    seed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    closed: bool = False  # the final event was sent; waiting for the engine's final output


class EngineLoop:
    """Runs an Engine on one background thread; submissions, cancellations and stats from any thread."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, observer: LoopObserver | None = None,
                 on_health: Callable[[bool], None] | None = None, max_consecutive_failures: int = 3,
                 clock: Callable[[], float] = time.monotonic):
        self.engine, self.tokenizer = engine, tokenizer
        self._observer = observer
        self._on_health = on_health
        self._max_failures = max_consecutive_failures
        self._clock = clock
        self._cond = threading.Condition()
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._accepting = True
        self._stopping = False
        self._open = 0  # submissions without their final event (guarded by _cond)
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._failures_in_row = 0
        self._retry_at = 0.0  # no step before this time (backing off after failed steps)
        self._step_failures = 0
        self._healthy = True
        self._thread: threading.Thread | None = None
        self._ended = False

    # ---- any thread --------------------------------------------------------------------

    def start(self) -> EngineLoop:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        return self

    def validate(self, request: EngineRequest) -> list[str]:
        """What is wrong with a request (`Engine.validate`, which reads only the engine's fixed
        limits, so any thread may call it)."""
        return self.engine.validate(request)

    def submit(self, request: EngineRequest, stop: Sequence[str], sink: Sink) -> RequestHandle:
        """Hand a request to the loop; its events go to `sink` (see the module docstring)."""
        handle = RequestHandle(request.request_id)
        received = self._clock()
        with self._cond:
            self._open += 1  # until its final event, which _send counts back
            if self._accepting:
                self._inbox.append(lambda: self._submit(handle, request, tuple(stop), sink, received))
                self._cond.notify()
                return handle
        self._refuse(sink, request.request_id, ErrorKind.UNAVAILABLE, "the server is shutting down")
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """End a submission now (finish reason abort), freeing its slot and pages; a no-op once it is over."""
        self._post(lambda: self._cancel(handle))

    def stats(self) -> concurrent.futures.Future[LoopStats]:
        """The engine's stats, taken on the loop thread between two steps."""
        future: concurrent.futures.Future[LoopStats] = concurrent.futures.Future()
        if not self._post(lambda: future.set_result(LoopStats(self.engine.stats(), len(self._streams),
                                                              self._step_failures))):
            future.set_exception(RuntimeError("the engine loop has stopped"))
        return future

    @property
    def open_streams(self) -> int:
        with self._cond:
            return self._open

    @property
    def healthy(self) -> bool:
        return self._healthy

    def drain(self, timeout: float | None = None) -> bool:
        """Refuse new submissions (UNAVAILABLE) and wait for the open ones; False on timeout."""
        with self._cond:
            self._accepting = False
            return self._cond.wait_for(lambda: self._open == 0, timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new submissions, abort the open ones and end the thread."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def generate(self, request: EngineRequest, stop: Sequence[str] = ()) -> Iterator[StreamEvent]:
        """The events of one request, for a plain Python caller (cancelled if the iterator is closed early)."""
        events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()
        handle = self.submit(request, stop, events.put)
        done = False
        try:
            while not done:
                event = events.get()
                done = event.final
                yield event
        finally:
            if not done:
                self.cancel(handle)

    # ---- loop thread -------------------------------------------------------------------

    def _post(self, command: Callable[[], None]) -> bool:
        """Queue a command for the loop thread; False (not queued) once the thread has ended."""
        with self._cond:
            if self._ended:
                return False
            self._inbox.append(command)
            self._cond.notify()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or self._may_step()):
                    wait = self._retry_at - self._clock() if self.engine.has_work() else None
                    self._cond.wait(wait)
                commands = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            for command in commands:
                try:
                    command()
                except Exception:  # a bug in a command must not end the loop
                    log.exception("engine loop command failed")
            if stopping:
                self._abort_all()
                with self._cond:
                    self._ended = True
                return
            if self._may_step():
                try:
                    self._step()
                except Exception as e:  # a bug outside engine.step(): fail what is open, keep the thread
                    log.exception("engine loop iteration failed")
                    self._abort_all(RequestError(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}"))

    def _may_step(self) -> bool:
        return self.engine.has_work() and self._clock() >= self._retry_at

    def _submit(self, handle: RequestHandle, request: EngineRequest, stop: tuple[str, ...], sink: Sink,
                received: float) -> None:
        rid = request.request_id
        if rid in self._streams:
            return self._refuse(sink, rid, ErrorKind.ALREADY_EXISTS, f"request_id {rid!r} is already in flight")
        try:
            text = TextStream(self.tokenizer, request.prompt_token_ids, stop)
            seed = self.engine.submit(request)
        except QueueFullError as e:
            return self._refuse(sink, rid, ErrorKind.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            return self._refuse(sink, rid, ErrorKind.INVALID_ARGUMENT, str(e))
        except Exception as e:  # not the request's fault; it still gets its final event
            log.exception("submitting request %r failed", rid)
            return self._refuse(sink, rid, ErrorKind.INTERNAL, f"{type(e).__name__}: {e}")
        self._streams[rid] = _Stream(handle, sink, text, received, lag=self._clock() - received, seed=seed,
                                     prompt_tokens=len(request.prompt_token_ids))
        if self._observer:
            self._observer.accepted(len(request.prompt_token_ids))

    def _refuse(self, sink: Sink, request_id: str, kind: ErrorKind, message: str) -> None:
        if self._observer:
            self._observer.refused(kind)
        self._send(sink, StreamEvent(request_id, error=RequestError(kind, message)))

    def _cancel(self, handle: RequestHandle) -> None:
        st = self._streams.get(handle.request_id)
        if st is not None and st.handle is handle and not st.closed:
            self.engine.cancel(handle.request_id, FinishReason.ABORT)

    def _send(self, sink: Sink, event: StreamEvent) -> None:
        try:
            sink(event)
        except Exception:  # e.g. the receiving event loop is closed; the request goes on regardless
            log.exception("a request's sink raised")
        if event.final:
            with self._cond:
                self._open -= 1
                self._cond.notify_all()

    def _step(self) -> None:
        before = self.engine.stats() if self._observer else None
        try:
            outputs = self.engine.step()
        except StepError as e:
            # The engine ended the failed step's requests and kept the rest (they recompute).
            log.error("engine step failed for %s: %r", e.request_ids, e.cause)
            self._step_failures += 1
            self._failures_in_row += 1
            if self._observer:
                self._observer.step_failed()
            error = RequestError(ErrorKind.INTERNAL, f"the engine step failed: {type(e.cause).__name__}: {e.cause}")
            for rid in e.request_ids:
                st = self._streams.pop(rid, None)
                if st is not None and not st.closed:
                    if self._observer:
                        self._observer.failed(error.kind)
                    self._send(st.sink, StreamEvent(rid, error=error))
            if self._failures_in_row >= self._max_failures:
                self._set_healthy(False)
            if self._observer:
                self._observer.step(before, self.engine.stats(), len(self._streams))
            return
        except Exception as e:
            log.exception("engine step failed; failing every open request")
            self._step_failures += 1
            self._failures_in_row += 1
            # Back off while steps keep failing: an engine left with work it cannot run (its
            # launched step's outputs never collected) would otherwise spin this thread.
            self._retry_at = self._clock() + min(0.05 * 2 ** (self._failures_in_row - 1), 2.0)
            if self._observer:
                self._observer.step_failed()
            self._abort_all(RequestError(ErrorKind.INTERNAL, f"the engine step failed: {type(e).__name__}: {e}"))
            if self._failures_in_row >= self._max_failures:
                self._set_healthy(False)
            if self._observer:
                self._observer.step(before, self.engine.stats(), len(self._streams))
            return
        self._failures_in_row = 0
        self._retry_at = 0.0
        self._set_healthy(True)
        for out in outputs:
            try:
                self._handle(out)
            except Exception as e:
                log.exception("handling the output of request %r failed", out.request_id)
                self._fail(out, RequestError(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}"))
        if self._observer:
            self._observer.step(before, self.engine.stats(), len(self._streams))

    def _handle(self, out: RequestOutput) -> None:
        st = self._streams.get(out.request_id)
        if st is None:
            return
        if st.closed:  # already failed; this is the engine's final output of it
            if out.finished:
                del self._streams[out.request_id]
            return
        now = self._clock()
        tokens = tuple(out.new_token_ids)
        update = st.text.update(out)
        if tokens:
            st.completion_tokens += len(tokens)
            if st.first_token_at is None:
                st.first_token_at = now
            if self._observer:
                self._observer.tokens(len(tokens))
        if update.cancel:
            self.engine.cancel(out.request_id, FinishReason.STOP)
        logprobs = tuple(out.logprobs or ())
        if update.finish_reason is None:
            if tokens or update.text:
                self._send(st.sink, StreamEvent(out.request_id, tokens, update.text, logprobs))
            return
        reason, text = update.finish_reason, update.text
        usage = self._usage(st, out.usage)
        del self._streams[out.request_id]
        if self._observer:
            self._observer.finished(reason, usage)
        self._send(st.sink, StreamEvent(out.request_id, tokens, text, logprobs, reason, usage))

    def _usage(self, st: _Stream, usage: Usage | None) -> Usage:
        """The engine's usage with times counted from when the loop received the request; made up
        from the loop's own counts when the engine's final output was lost (a failed step)."""
        if usage is None:
            return Usage(prompt_tokens=st.prompt_tokens, completion_tokens=st.completion_tokens, seed=st.seed,
                         first_token_s=st.first_token_at - st.received_at if st.first_token_at else 0.0,
                         total_s=self._clock() - st.received_at)
        return dataclasses.replace(usage, queue_s=usage.queue_s + st.lag, total_s=usage.total_s + st.lag,
                                   first_token_s=usage.first_token_s + st.lag if usage.first_token_s else 0.0)

    def _fail(self, out: RequestOutput, error: RequestError) -> None:
        """End one request with an error; the engine's final output of it, still to come, is dropped."""
        st = self._streams.get(out.request_id)
        if st is None or st.closed:
            return
        st.closed = True
        if out.finished or not self.engine.cancel(out.request_id, FinishReason.ABORT):
            del self._streams[out.request_id]
        if self._observer:
            self._observer.failed(error.kind)
        self._send(st.sink, StreamEvent(out.request_id, error=error))

    def _abort_all(self, error: RequestError | None = None) -> None:
        """Cancel every open request, empty the engine, and send each its final event: `error`, or
        (error None: shutting down) finish reason abort; a request past its stop string ends with stop."""
        for rid in self._streams:
            self.engine.cancel(rid, FinishReason.ABORT)
        try:
            finals = {o.request_id: o for o in self.engine.step() if o.finished}  # nothing left to run
        except Exception:
            log.exception("emptying the engine failed")
            finals = {}
        streams, self._streams = self._streams, {}
        for rid, st in streams.items():
            if st.closed:
                continue
            out = finals.get(rid)
            if st.text.stopped or (error is None and out is not None):
                reason = FinishReason.STOP if st.text.stopped else FinishReason.ABORT
                usage = self._usage(st, out.usage if out is not None else None)
                if self._observer:
                    self._observer.finished(reason, usage)
                self._send(st.sink, StreamEvent(rid, finish_reason=reason, usage=usage))
            else:
                failure = error or RequestError(ErrorKind.UNAVAILABLE, "the server stopped")
                if self._observer:
                    self._observer.failed(failure.kind)
                self._send(st.sink, StreamEvent(rid, error=failure))

    def _set_healthy(self, healthy: bool) -> None:
        if healthy != self._healthy:
            self._healthy = healthy
            if not healthy:
                log.error("%d engine steps failed in a row: reporting unhealthy", self._failures_in_row)
            if self._on_health is not None:
                self._on_health(healthy)
