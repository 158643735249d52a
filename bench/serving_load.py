"""A bounded load run against the gRPC server: throughput, latency and time to first token.

    python -m bench.serving_load [--requests 200 | --duration SECONDS] [--concurrency 32] [--seed 0]
        [--prompt-tokens 4,48] [--max-tokens 4,32] [--cancel-every N] [--json PATH]
        [--target HOST:PORT | --server-args "--max-num-seqs 32 ..."]

Without --target it starts `python -m serving.grpc_server --host 127.0.0.1 --port 0
--metrics-port 0 <server args>` (the embedded demo model unless the args name --model), waits
for health SERVING, runs the load, sends SIGTERM and checks the server exits 0. With --target
it loads a server that is already running.

The load: `--requests` requests from `--concurrency` concurrent clients (grpc.aio, one channel),
each a random prompt of token ids (length uniform in --prompt-tokens) and max_tokens uniform
in --max-tokens (clipped so prompt + max_tokens fits the server's max_model_len), with
ignore_eos so every request generates exactly max_tokens; even-numbered requests are greedy,
odd ones sample (temperature 0.8, top_p 0.95, a seed per request). Everything derives from
--seed, so two runs send the same requests. Per request it records latency (call to last
message), time to first token (call to first message with tokens) and the status.

Soak mode: --duration S keeps sending (the same kind of requests, numbered on) until S seconds
have passed, instead of --requests. --cancel-every N cancels every N-th request from the
client once its first tokens arrive (counted as cancelled, not as errors). After the load the
server must be idle (no open stream, every slot free: `server_after`); for a server this
started, its resident memory is sampled during the load (`server_rss_mib`: at the start, the
end and the most), which a long run should keep flat.

Reported: errors by status code (expected: none), requests/s and output tokens/s over the
wall time of the load, p50 / p99 latency and TTFT, and the server's own step split
(GetStats before and after: mean host ms and runner ms per step), with the command, the
server's device and the date, as JSON and as a BENCHMARKS.md row. The clients share the
machine with the server, so on a small CPU machine the figures include their cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Iterable, Iterator

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.proto import dsv4_serving_pb2 as pb
from serving.proto import dsv4_serving_pb2_grpc as pb_grpc

DEFAULT_SERVER_ARGS = ("--max-num-seqs 32 --max-num-batched-tokens 128 --bucket-tokens 32,128 --max-model-len 128")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.serving_load", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="HOST:PORT of a running server (default: start one)")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                   help="flags for the server this starts (default: %(default)s)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of load (soak mode): requests go on until then, --requests is ignored")
    p.add_argument("--cancel-every", type=int, default=0,
                   help="cancel every N-th request after its first tokens (0: none)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-tokens", type=_range, default=(4, 48), help="LO,HI (default 4,48)")
    p.add_argument("--max-tokens", type=_range, default=(4, 32), help="LO,HI (default 4,32)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.cancel_every < 0:
        p.error("--requests and --concurrency must be >= 1, --cancel-every >= 0")
    if args.duration is not None and args.duration <= 0:
        p.error("--duration must be > 0")
    return args


def make_requests(n: int, seed: int, vocab: int, max_model_len: int, prompt_tokens, max_tokens):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        plen = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        plen = min(plen, max_model_len - 1)
        new = min(int(rng.integers(max_tokens[0], max_tokens[1] + 1)), max_model_len - plen)
        ids = rng.integers(2, vocab, plen).tolist()
        sampling = pb.SamplingParams(max_tokens=new, ignore_eos=True)
        if i % 2:
            sampling.temperature, sampling.top_p, sampling.seed = 0.8, 0.95, int(rng.integers(0, 2**32))
        out.append(pb.GenerateRequest(request_id=f"load-{i}", token_ids=pb.TokenIds(ids=ids), sampling=sampling))
    return out


def request_stream(seed: int, vocab: int, max_model_len: int, prompt_tokens, max_tokens) -> Iterator:
    """Requests as `make_requests` makes them, without end (soak mode), numbered load-0, 1, ..."""
    for batch in itertools.count():
        for i, req in enumerate(make_requests(256, seed + batch, vocab, max_model_len, prompt_tokens, max_tokens)):
            req.request_id = f"load-{256 * batch + i}"
            yield req


async def run_load(target: str, requests: Iterable, concurrency: int, *, deadline: float | None = None,
                   cancel_every: int = 0) -> tuple[list[dict], float]:
    """Per-request records and the wall time of the whole load: `requests` in order until they
    run out or time.monotonic() passes `deadline`; every cancel_every-th (the first included)
    is cancelled once tokens arrive."""
    records: list[dict] = []
    todo = iter(requests)
    sent = itertools.count()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(req: pb.GenerateRequest, cancel: bool) -> dict:
            t0 = time.perf_counter()
            first = None
            tokens = 0
            call = stub.Generate(req, timeout=600)
            try:
                async for r in call:
                    if r.token_ids and first is None:
                        first = time.perf_counter() - t0
                    tokens += len(r.token_ids)
                    if cancel and tokens:
                        call.cancel()
                        break
                code = "CANCELLED_BY_CLIENT" if cancel else "OK" if tokens == req.sampling.max_tokens else "SHORT"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            except asyncio.CancelledError:  # the cancelled call's iterator may raise instead
                code = "CANCELLED_BY_CLIENT"
            return {"id": req.request_id, "code": code, "prompt_tokens": len(req.token_ids.ids),
                    "tokens": tokens, "latency_s": time.perf_counter() - t0, "ttft_s": first}

        async def worker():
            while deadline is None or time.monotonic() < deadline:
                req = next(todo, None)
                if req is None:
                    return
                k = next(sent)
                records.append(await one(req, cancel_every > 0 and k % cancel_every == 0))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - t0


def _pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(records: list[dict], wall_s: float) -> dict:
    ok = [r for r in records if r["code"] == "OK"]
    cancelled = sum(r["code"] == "CANCELLED_BY_CLIENT" for r in records)
    errors: dict[str, int] = {}
    for r in records:
        if r["code"] not in ("OK", "CANCELLED_BY_CLIENT"):
            errors[r["code"]] = errors.get(r["code"], 0) + 1
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    out_tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "ok": len(ok), "cancelled": cancelled, "errors": errors, "wall_s": wall_s,
            "requests_per_s": len(ok) / wall_s, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall_s,
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99)}


def _start_server(server_args: str, timeout: float):
    """(process, 'host:port') of a server this process started, once it listens."""
    cmd = [sys.executable, "-m", "serving.grpc_server", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
           *shlex.split(server_args)]
    print("starting:", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
    found: list[str] = []
    ready = threading.Event()

    def pump():  # echo the server's stdout (warm-up progress) and find its port
        for line in proc.stdout:
            print("  server:", line.rstrip(), flush=True)
            if line.startswith("listening on") and not found:
                found.append(line.split()[2].rstrip(","))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout) or not found:
        proc.kill()
        raise RuntimeError(f"the server did not start (exit code {proc.poll()})")
    return proc, found[0]


def _wait_serving(target: str, timeout: float, proc=None) -> None:
    end = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} during warm-up")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"{target} was not SERVING after {timeout:g}s")


def _rss_mib(pid: int) -> float | None:
    """A process's resident memory (Linux /proc), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


class RssSampler:
    """Samples a process's resident memory every `every_s` seconds on a thread, while inside."""

    def __init__(self, pid: int, every_s: float = 2.0):
        self.pid, self.every_s, self.samples = pid, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            rss = _rss_mib(self.pid)
            if rss is not None:
                self.samples.append(rss)
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        rss = _rss_mib(self.pid)
        if rss is not None:
            self.samples.append(rss)

    def summary(self) -> dict | None:
        """start, end, max, and the most of each half of the run (a leak grows the second)."""
        s = self.samples
        if not s:
            return None
        half = (len(s) + 1) // 2
        return {"start": s[0], "end": s[-1], "max": max(s), "first_half_max": max(s[:half]),
                "second_half_max": max(s[half:] or s[-1:]), "samples": len(s)}


def _idle_stats(stub, timeout: float = 60.0) -> pb.ServerStats:
    """GetStats once no stream is open (cancellations take a step to land), or at the timeout."""
    end = time.monotonic() + timeout
    while True:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=30)
        if (stats.open_streams == 0 and stats.running == 0) or time.monotonic() > end:
            return stats
        time.sleep(0.2)


def markdown_row(result: dict) -> str:
    s, meta = result["summary"], result["meta"]
    errors = "0" if not s["errors"] else ", ".join(f"{k} {v}" for k, v in sorted(s["errors"].items()))
    return (f"| {meta['date']} | {meta['device']} | {s['requests']} @ C{meta['concurrency']} | {errors} | "
            f"{s['requests_per_s']:.1f} | {s['output_tokens_per_s']:.0f} | {s['latency_p50_s'] * 1e3:.0f} / "
            f"{s['latency_p99_s'] * 1e3:.0f} ms | {s['ttft_p50_s'] * 1e3:.0f} / {s['ttft_p99_s'] * 1e3:.0f} ms | "
            f"{meta['server_step']['host_ms_per_step']:.2f} / {meta['server_step']['run_ms_per_step']:.2f} ms |")


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]  # other work on the machine skews a CPU run
    proc = None
    target = args.target
    if target is None:
        proc, target = _start_server(args.server_args, args.startup_timeout)
    try:
        _wait_serving(target, args.startup_timeout, proc)
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            before = stub.GetStats(pb.GetStatsRequest(), timeout=30)
        shape = (info.vocab_size, info.max_model_len, args.prompt_tokens, args.max_tokens)
        if args.duration is None:
            requests, deadline = make_requests(args.requests, args.seed, *shape), None
        else:
            requests, deadline = request_stream(args.seed, *shape), time.monotonic() + args.duration
        sampler = RssSampler(proc.pid) if proc is not None else contextlib.nullcontext()
        with sampler:
            records, wall = asyncio.run(run_load(target, requests, args.concurrency, deadline=deadline,
                                                 cancel_every=args.cancel_every))
        with grpc.insecure_channel(target) as channel:
            after = _idle_stats(pb_grpc.GenerationStub(channel))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=120)
            print(f"server exited with {code}", flush=True)
    steps = max(after.steps - before.steps, 1)

    def per_step(field: str) -> float:
        return (getattr(after, field) * max(after.steps, 1) - getattr(before, field) * max(before.steps, 1)) / steps

    command = "python -m bench.serving_load " + shlex.join(argv if argv is not None else sys.argv[1:])
    result = {
        "meta": {"date": datetime.date.today().isoformat(), "device": info.device, "model": info.model,
                 "model_summary": info.summary, "command": command.strip(),
                 "server_args": None if args.target else args.server_args, "target": args.target,
                 "concurrency": args.concurrency, "seed": args.seed, "prompt_tokens": args.prompt_tokens,
                 "max_tokens": args.max_tokens, "cpus": os.cpu_count(), "load_average_1m": load_before,
                 "server_step": {"steps": after.steps - before.steps, "host_ms_per_step": per_step("host_ms_per_step"),
                                 "run_ms_per_step": per_step("run_ms_per_step"),
                                 "preemptions": after.preemptions - before.preemptions},
                 "server_after": {"open_streams": after.open_streams, "running": after.running,
                                  "waiting": after.waiting, "free_slots": after.free_slots,
                                  "total_slots": after.total_slots},
                 "server_rss_mib": sampler.summary() if proc is not None else None,
                 "duration": args.duration, "cancel_every": args.cancel_every,
                 "server_exit_code": None if proc is None else proc.returncode},
        "summary": summarize(records, wall),
        "records": records,
    }
    s = result["summary"]
    print(f"{s['requests']} requests at concurrency {args.concurrency}: {s['ok']} ok, {s['cancelled']} cancelled, "
          f"errors {s['errors'] or 'none'}")
    print(f"  {s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tok/s over {wall:.1f}s")
    print(f"  latency p50 {s['latency_p50_s'] * 1e3:.0f} ms, p99 {s['latency_p99_s'] * 1e3:.0f} ms; "
          f"TTFT p50 {s['ttft_p50_s'] * 1e3:.0f} ms, p99 {s['ttft_p99_s'] * 1e3:.0f} ms")
    print(f"  server: {result['meta']['server_step']}; after: {result['meta']['server_after']}; "
          f"resident MiB: {result['meta']['server_rss_mib']}")
    print("| date | device | requests | errors | req/s | out tok/s | latency p50 / p99 | TTFT p50 / p99 | "
          "host / run ms per step |")
    print(markdown_row(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def problems(result: dict) -> list[str]:
    """What went wrong in a load run: errors, a server left busy, a bad exit code."""
    s, meta = result["summary"], result["meta"]
    after = meta["server_after"]
    bad = [f"errors: {s['errors']}"] if s["errors"] else []
    if after["open_streams"] or after["running"] or after["waiting"] or after["free_slots"] != after["total_slots"]:
        bad.append(f"the server is not idle after the load: {after}")
    if meta["server_exit_code"] not in (None, 0):
        bad.append(f"the server exited with {meta['server_exit_code']}")
    return bad


if __name__ == "__main__":
    out = main()
    for problem in problems(out):
        print("problem:", problem, file=sys.stderr)
    sys.exit(1 if problems(out) else 0)
