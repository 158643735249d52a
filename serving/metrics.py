"""Prometheus metrics of the server, fed by the engine loop (`serving.engine_loop.LoopObserver`).

`ServingMetrics()` owns its own `CollectorRegistry` (no process-global collectors, so two
servers in one process, e.g. in tests, do not collide); `serve_http(host, port)` exposes it
in the text format on a daemon thread. Every update comes from the engine loop's thread
(prometheus_client's metrics are thread-safe, so the scrape thread reads them safely), plus
`refused` from the gRPC handlers for requests that never reach the loop.

Names (counters get `_total` appended by the exposition format):

    dsv4_requests_total{finish_reason}   finished requests: stop | length | abort
    dsv4_request_errors_total{code}      requests ended by an error status (gRPC code, lower case)
    dsv4_prompt_tokens_total             prompt tokens of accepted requests
    dsv4_cached_prompt_tokens_total      of which restored from the prefix cache (counted at the end)
    dsv4_generation_tokens_total         tokens generated
    dsv4_preemptions_total               requests preempted (recomputed later)
    dsv4_steps_total / dsv4_step_failures_total
    dsv4_requests_waiting / dsv4_requests_running / dsv4_open_streams   (gauges)
    dsv4_free_slots / dsv4_free_pages / dsv4_total_pages / dsv4_prefix_cache_pages   (gauges)
    dsv4_step_host_seconds / dsv4_step_run_seconds   per step: scheduling + output handling, runner
    dsv4_request_queue_seconds / dsv4_time_to_first_token_seconds / dsv4_request_latency_seconds

Speculative decoding (present only when the engine speculates):

    dsv4_spec_draft_tokens_total / dsv4_spec_accepted_draft_tokens_total   drafts verified / accepted
    dsv4_spec_verifications_total        request-steps that verified (0 drafts included)
    dsv4_spec_mean_acceptance_length     tokens committed per verification (gauge, since start)
    dsv4_spec_acceptance_rate{position}  draft j accepted / verifications reaching it (since start)
    dsv4_spec_draft_depth                drafts in the newest blocks (capacity-aware verification)
    dsv4_spec_calibration_error{position}  the confidence calibration error (capacity-aware)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from serving.engine import EngineStats, FinishReason, SpeculationStats, Usage
from serving.engine_loop import ErrorKind

_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def _total_s(ms_per_step: float, steps: int) -> float:
    """EngineStats keeps means over steps (and over one when there were none); back to a total."""
    return ms_per_step * max(steps, 1) / 1e3


class ServingMetrics:
    """The server's Prometheus collectors in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("dsv4_requests", "Finished requests, by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("dsv4_request_errors", "Requests ended by an error status, by gRPC code", ["code"],
                              registry=r)
        self.prompt_tokens = Counter("dsv4_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("dsv4_generation_tokens", "Tokens generated", registry=r)
        self.cached_prompt_tokens = Counter("dsv4_cached_prompt_tokens", "Prompt tokens restored from the prefix "
                                            "cache (of finished requests)", registry=r)
        self.preemptions = Counter("dsv4_preemptions", "Requests preempted by recompute", registry=r)
        self.steps = Counter("dsv4_steps", "Engine steps run", registry=r)
        self.step_failures = Counter("dsv4_step_failures", "Engine steps that raised", registry=r)
        self.waiting = Gauge("dsv4_requests_waiting", "Requests in the engine's waiting queue", registry=r)
        self.running = Gauge("dsv4_requests_running", "Requests holding a state slot", registry=r)
        self.open_streams = Gauge("dsv4_open_streams", "Accepted requests not finished yet", registry=r)
        self.free_slots = Gauge("dsv4_free_slots", "Free decode-state slots", registry=r)
        self.free_pages = Gauge("dsv4_free_pages", "Free KV pages", registry=r)
        self.total_pages = Gauge("dsv4_total_pages", "KV pages in the decode state", registry=r)
        self.cached_pages = Gauge("dsv4_prefix_cache_pages", "Pages held by the prefix cache", registry=r)
        self.step_host = Histogram("dsv4_step_host_seconds", "Per step: scheduling and output handling",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.step_run = Histogram("dsv4_step_run_seconds", "Per step: the runner (packing, device, fetch)",
                                  buckets=_STEP_BUCKETS, registry=r)
        self.queue_time = Histogram("dsv4_request_queue_seconds", "Received -> first scheduled",
                                    buckets=_REQUEST_BUCKETS, registry=r)
        self.ttft = Histogram("dsv4_time_to_first_token_seconds", "Received -> first token",
                              buckets=_REQUEST_BUCKETS, registry=r)
        self.latency = Histogram("dsv4_request_latency_seconds", "Received -> finished",
                                 buckets=_REQUEST_BUCKETS, registry=r)
        self._spec: dict | None = None  # made on the first step that reports speculation
        for reason in FinishReason:
            self.requests.labels(reason.value)
        for kind in ErrorKind:
            self.errors.labels(kind.value)

    # ---- LoopObserver (the engine loop's thread) ----------------------------------------

    def accepted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def refused(self, kind: ErrorKind) -> None:
        self.errors.labels(kind.value).inc()

    def tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def finished(self, reason: FinishReason, usage: Usage) -> None:
        self.requests.labels(reason.value).inc()
        self.cached_prompt_tokens.inc(usage.cached_prompt_tokens)
        self.latency.observe(usage.total_s)
        if usage.completion_tokens:
            self.queue_time.observe(usage.queue_s)
            self.ttft.observe(usage.first_token_s)

    def failed(self, kind: ErrorKind) -> None:
        self.errors.labels(kind.value).inc()

    def step(self, before: EngineStats, after: EngineStats, open_streams: int) -> None:
        ran = after.steps - before.steps
        if ran > 0:
            self.steps.inc(ran)
            self.step_host.observe((_total_s(after.host_ms_per_step, after.steps)
                                    - _total_s(before.host_ms_per_step, before.steps)) / ran)
            self.step_run.observe((_total_s(after.run_ms_per_step, after.steps)
                                   - _total_s(before.run_ms_per_step, before.steps)) / ran)
        if after.preemptions > before.preemptions:
            self.preemptions.inc(after.preemptions - before.preemptions)
        if after.speculation is not None:
            self._speculation(before.speculation, after.speculation)
        self.set_engine_gauges(after, open_streams)

    def _speculation(self, before: SpeculationStats | None, after: SpeculationStats) -> None:
        if self._spec is None:
            r = self.registry
            self._spec = dict(
                drafted=Counter("dsv4_spec_draft_tokens", "Drafts verified", registry=r),
                accepted=Counter("dsv4_spec_accepted_draft_tokens", "Drafts accepted", registry=r),
                verifications=Counter("dsv4_spec_verifications", "Request-steps that verified drafts", registry=r),
                length=Gauge("dsv4_spec_mean_acceptance_length", "Tokens committed per verification", registry=r),
                rate=Gauge("dsv4_spec_acceptance_rate", "Draft j accepted / verifications reaching it", ["position"],
                           registry=r),
                depth=Gauge("dsv4_spec_draft_depth", "Drafts in the newest blocks", registry=r),
                calibration=Gauge("dsv4_spec_calibration_error", "Confidence calibration error by position",
                                  ["position"], registry=r))
        m = self._spec
        for name, field in (("drafted", "draft_tokens"), ("accepted", "accepted_draft_tokens"),
                            ("verifications", "verifications")):
            grown = getattr(after, field) - (getattr(before, field) if before is not None else 0)
            if grown > 0:
                m[name].inc(grown)
        m["length"].set(after.mean_acceptance_length)
        for j, rate in enumerate(after.acceptance_by_position):
            if rate is not None:
                m["rate"].labels(str(j)).set(rate)
        if after.capacity is not None:
            m["depth"].set(after.capacity.depth)
            for j, err in enumerate(after.capacity.calibration_error):
                if err is not None:
                    m["calibration"].labels(str(j)).set(err)

    def step_failed(self) -> None:
        self.step_failures.inc()

    # ---- the rest ----------------------------------------------------------------------

    def set_engine_gauges(self, stats: EngineStats, open_streams: int) -> None:
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        self.open_streams.set(open_streams)
        self.free_slots.set(stats.free_slots)
        self.free_pages.set(stats.free_pages)
        self.total_pages.set(stats.total_pages)
        self.cached_pages.set(stats.cached_pages)

    def serve_http(self, host: str, port: int):
        """Expose the registry on http://host:port/metrics (a daemon thread); returns the HTTP
        server (`.server_address` has the bound port; `.shutdown()` stops it)."""
        httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        return httpd
