"""Per-call time of the FFI kernels vs the XLA reference path, at FLASH dims, against the roofline.

    python -m bench.ffi_bench [--config flash|tiny] [--decode 1,8,32,64] [--prefill 0] [--context 4096]
        [--kv-format fp8|dense] [--index-format fp4|fp8|dense] [--backends ffi,reference]
        [--ops sparse_attention,indexer_topk,kv_write]
        [--steps 10] [--warmup 2] [--inner 20] [--timing loop|profile] [--dtype bfloat16]
        [--hbm-tbps 4.3] [--tflops 790] [--json PATH]

Ops and cases (one CSA layer's worth; synthetic tables of random entries in the stored format):
- sparse_attention: C queries (decode C) or P queries (a prefill chunk of P tokens), each over
  a full window of `sliding_window` rows (ring rows, the query's own fresh row last) and
  `index_topk` compressed entries of a pool of context / csa_ratio entries per request.
- indexer_topk: the same queries scoring every visible compressed indexer key of their request
  (context / csa_ratio candidates) and keeping index_topk.
- kv_write: the queries' new K=V rows stored into the window ring.

Roofline: max(bytes / HBM bandwidth, FLOPs / peak), with the bytes every kernel must move at
least once (each selected entry read once per query for all heads, q and out, the scores not
written) and the defaults the issue measured on the H200 (4.3 TB/s, 790 TFLOP/s dense bf16).
Timing: one jitted program runs the op `--inner` times in a device loop (each call's inputs
pass an optimization barrier with the loop counter, so XLA can neither hoist nor merge the
calls; kv_write carries its table through the loop, in place); the program is timed after
`--warmup` runs, median of `--steps`, divided by `--inner`. This is device time per call with
the launch gaps of back-to-back kernels but without the host's dispatch of a lone program
(~0.1 ms on the H200, which dominated every decode figure when each call was its own program).
The loop itself still costs something per iteration (on the H200 ~35-45 us: XLA's while loop
reads its predicate back to the host each turn); the same loop around no op is timed first
and reported as `loop_floor_ms`: read decode figures near it as "at most this fast".

`--timing profile` (GPU only) measures device time instead: the one-call program runs
`--steps` times under `jax.profiler.trace`, and the figure is the time during which any
event of the trace's GPU tracks ran (the union of their intervals: kernels, copies, the
program span) per call, so neither host dispatch nor the loop enters it. The same harness
around an identity op on one float (a program of one tiny kernel) is profiled first and
reported as `profile_floor_ms`: no call can measure less, and where twice an op's roofline is
under it the row says so (a 2x-roofline target that no kernel can meet by this measure).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import math
import pathlib
import sys
import tempfile
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.step_bench import CONFIGS, DTYPES, _is_oom, _sizes
from dsv4.config import ModelConfig
from dsv4.ops.registry import Backend, ops_for
from dsv4.state import EntryFormat, EntryTable, default_page_tokens

KV_FORMATS = {"fp8": EntryFormat.KV_FP8, "dense": EntryFormat.DENSE_KV_QAT}
INDEX_FORMATS = {"fp4": EntryFormat.INDEX_FP4, "fp8": EntryFormat.INDEX_FP8, "dense": EntryFormat.DENSE_INDEX_QAT}


@dataclasses.dataclass(frozen=True)
class Settings:
    config_name: str
    decode: tuple[int, ...]
    prefill: int
    context: int
    kv_format: str
    index_format: str
    backends: tuple[str, ...]
    ops: tuple[str, ...]
    steps: int
    warmup: int
    inner: int
    timing: str  # "loop" | "profile"
    dtype_name: str
    hbm_tbps: float
    tflops: float
    json_path: str | None


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # "decode C8" / "prefill 65536"
    queries: int  # T
    requests: int
    context: int  # positions before the queries' last one, per request


def _random_table(key, fmt: EntryFormat, rows: int, width: int, rope: int, dtype) -> EntryTable:
    values = jax.random.normal(key, (rows, width), jnp.float32).astype(dtype)
    return EntryTable.zeros(rows, width, fmt, rope, dtype).write(jnp.arange(rows), values)


def _row_bytes(table: EntryTable) -> int:
    return sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize for a in table.arrays)


def attention_inputs(cfg: ModelConfig, case: Case, s: Settings, key):
    """(args of sparse_attention_paged, bytes, flops)."""
    dtype = DTYPES[s.dtype_name]
    t, w, h, n = case.queries, cfg.sliding_window, cfg.head_dim, cfg.num_attention_heads
    per_req = t // case.requests
    entries = case.context // cfg.csa_ratio
    ring_rows = case.requests * (w + 6)
    k = jax.random.split(key, 4)
    ring = _random_table(k[0], KV_FORMATS[s.kv_format], ring_rows, h, cfg.qk_rope_head_dim, dtype)
    fresh = EntryTable.from_values(jax.random.normal(k[1], (t, h)).astype(dtype), like=ring)
    pool = _random_table(k[2], KV_FORMATS[s.kv_format], case.requests * entries, h, cfg.qk_rope_head_dim, dtype)
    q = jax.random.normal(k[3], (t, n, h)).astype(dtype)
    rng = np.random.default_rng(0)
    req = np.arange(t) // per_req
    window = req[:, None] * (w + 6) + np.arange(w)[None, :]
    window[:, -1] = ring_rows + np.arange(t)  # the query's own fresh row
    comp = req[:, None] * entries + rng.integers(0, entries, size=(t, cfg.index_topk))
    sink = jnp.zeros((n,), jnp.float32)
    args = (q, (ring, fresh), jnp.asarray(window, jnp.int32), pool, jnp.asarray(comp, jnp.int32), sink, h ** -0.5)
    selected = w + cfg.index_topk
    nbytes = t * selected * _row_bytes(ring) + 2 * t * n * h * q.dtype.itemsize
    flops = 4.0 * t * n * h * selected
    return args, nbytes, flops


def indexer_inputs(cfg: ModelConfig, case: Case, s: Settings, key):
    """(args of indexer_topk_paged, bytes, flops)."""
    t, i, j = case.queries, cfg.index_n_heads, cfg.index_head_dim
    epp = default_page_tokens(cfg) // cfg.csa_ratio
    entries = -(-case.context // cfg.csa_ratio // epp) * epp  # whole pages
    dtype = DTYPES[s.dtype_name]
    k = jax.random.split(key, 3)
    keys = _random_table(k[0], INDEX_FORMATS[s.index_format], case.requests * entries, j, 0, dtype)
    q = jax.random.normal(k[1], (t, i, j)).astype(dtype)
    w = jax.random.normal(k[2], (t, i), jnp.float32)
    req = np.arange(t) // (t // case.requests)
    pages = jnp.asarray(req[:, None] * (entries // epp) + np.arange(entries // epp)[None, :], jnp.int32)
    limit = jnp.full((t,), case.context // cfg.csa_ratio, jnp.int32)
    args = (q, w, keys, pages, epp, limit, cfg.index_topk)
    # Every request's keys are read once per query here (no reuse across a request's queries).
    nbytes = t * entries * _row_bytes(keys) + t * i * j * q.dtype.itemsize + t * cfg.index_topk * 4
    flops = 2.0 * t * i * j * entries
    return args, nbytes, flops


def kv_write_inputs(cfg: ModelConfig, case: Case, s: Settings, key):
    dtype = DTYPES[s.dtype_name]
    h, ring_size = cfg.head_dim, cfg.sliding_window + 6
    k = jax.random.split(key, 2)
    table = _random_table(k[0], KV_FORMATS[s.kv_format], case.requests * ring_size, h, cfg.qk_rope_head_dim, dtype)
    t = min(case.queries, case.requests * ring_size)  # a long chunk's rows wrap: only the last ring's worth land
    rows = jnp.asarray(np.arange(t) % (case.requests * ring_size), jnp.int32)
    values = jax.random.normal(k[1], (t, h)).astype(dtype)
    nbytes = t * (h * values.dtype.itemsize + _row_bytes(table))
    return (table, rows, values), nbytes, 0.0


OPS: dict[str, tuple[Callable, str]] = {
    "sparse_attention": (attention_inputs, "sparse_attention_paged"),
    "indexer_topk": (indexer_inputs, "indexer_topk_paged"),
    "kv_write": (kv_write_inputs, "table_write"),
}
_STATIC = {"sparse_attention": (6,), "indexer_topk": (4, 6), "kv_write": ()}


def repeated(fn: Callable, args: tuple, static: tuple[int, ...], reps: int, carry_first: bool):
    """(jitted program, its arguments): `reps` calls of fn(*args) in one device loop.

    carry_first: the first argument is threaded through the loop as fn's result (an in-place
    update such as table_write); otherwise each call's first output leaf feeds a running sum.
    """
    dynamic = [k for k in range(len(args)) if k not in static]

    def call(live):
        full = list(args)
        for k, a in zip(dynamic, live):
            full[k] = a
        return fn(*full)

    def program(*live):
        if carry_first:
            def body(i, carried):
                rest = lax.optimization_barrier((live[1:], i))[0]
                return call((carried, *rest))
            return lax.fori_loop(0, reps, body, live[0])

        def body(i, total):
            out = call(lax.optimization_barrier((live, i))[0])
            return total + jax.tree.leaves(out)[0].reshape(-1)[0].astype(jnp.float32)
        return lax.fori_loop(0, reps, body, jnp.float32(0))

    return jax.jit(program), tuple(args[k] for k in dynamic)


def first_call_seconds(program, args) -> float:
    """Seconds of program(*args)'s first call (compile and run)."""
    t0 = time.perf_counter()
    jax.block_until_ready(program(*args))
    return time.perf_counter() - t0


def time_call(program, args, s: Settings) -> tuple[float, float]:
    """(compile s, median ms per call) of a program of s.inner calls."""
    compile_s = first_call_seconds(program, args)
    times = []
    for i in range(s.warmup + s.steps):
        t0 = time.perf_counter()
        jax.block_until_ready(program(*args))
        if i >= s.warmup:
            times.append(1e3 * (time.perf_counter() - t0) / s.inner)
    return compile_s, float(np.median(times))


def calls_per_program(s: Settings) -> int:
    """Op calls in a timed program: --inner in a device loop, or one where a profile times it."""
    return s.inner if s.timing == "loop" else 1


def timed(program, args, s: Settings) -> tuple[float, float]:
    """(compile s, ms per call) of program(*args) by --timing: time_call or profile_call."""
    return (time_call if s.timing == "loop" else profile_call)(program, args, s)


def timing_floor_ms(s: Settings) -> float:
    """Milliseconds per call that --timing measures around an identity op on one float: loop, the
    device loop's cost per iteration; profile, the device time of a one-call program of one tiny
    kernel (what every profiled figure includes at least)."""
    program, args = repeated(lambda x: x, (jnp.zeros((1,), jnp.float32),), (), calls_per_program(s), False)
    return timed(program, args, s)[1]


def _device_events(events: Sequence[dict], device_prefix: str) -> list[dict]:
    """The complete ("X") events of a Chrome / Perfetto trace's device tracks."""
    devices = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and str(e.get("args", {}).get("name", "")).startswith(device_prefix)}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in devices]


def device_busy_ms(events: Sequence[dict], device_prefix: str = "/device:GPU") -> float:
    """Milliseconds during which any complete event of a device track ran, from a Chrome /
    Perfetto trace's events (the union of their [ts, ts + dur) intervals, in microseconds)."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in _device_events(events, device_prefix))
    busy, end = 0.0, -math.inf
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e3


def device_events_ms(events: Sequence[dict], per: int, top: int = 8,
                     device_prefix: str = "/device:GPU") -> dict[str, float]:
    """The `top` device-track event names by total duration, in ms per `per` calls: which
    kernels (and XLA ops / modules, on their own tracks) the time went to."""
    totals: dict[str, float] = {}
    for e in _device_events(events, device_prefix):
        totals[e["name"]] = totals.get(e["name"], 0.0) + e.get("dur", 0.0)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {name: us / 1e3 / per for name, us in ranked}


def profile_call(program, args, s: Settings) -> tuple[float, float]:
    """(compile s, device ms per call) of program(*args), from a profiler trace of s.steps calls;
    the trace's busiest device events per call are logged."""
    compile_s = first_call_seconds(program, args)
    for _ in range(s.warmup):
        jax.block_until_ready(program(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(s.steps):
                jax.block_until_ready(program(*args))
        (trace,) = pathlib.Path(log_dir).rglob("perfetto_trace.json.gz")
        with gzip.open(trace) as f:
            data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    for name, ms in device_events_ms(events, s.steps).items():
        _log(f"    {ms:9.4f} ms per call  {name[:150]}")
    return compile_s, device_busy_ms(events) / s.steps


def run_op(op: str, cfg: ModelConfig, case: Case, s: Settings, log) -> dict:
    make, attr = OPS[op]
    args, nbytes, flops = make(cfg, case, s, jax.random.key(0))
    roofline_ms = 1e3 * max(nbytes / (s.hbm_tbps * 1e12), flops / (s.tflops * 1e12))
    result = {"op": op, "case": case.name, "queries": case.queries, "bytes": nbytes, "flops": flops,
              "roofline_ms": roofline_ms, "status": "ok"}
    for backend in s.backends:
        program, live = repeated(getattr(ops_for(backend), attr), args, _STATIC[op], calls_per_program(s),
                                 op == "kv_write")
        try:
            compile_s, ms = timed(program, live, s)
        except Exception as e:  # noqa: BLE001 - one backend out of memory must not hide the others' figures
            if not _is_oom(e):
                raise
            result[backend] = {"status": "OOM"}
            log(f"{op} {case.name} {backend}: OOM")
            continue
        result[backend] = {"compile_s": compile_s, "ms": ms, "over_roofline": ms / roofline_ms,
                           "gbps": nbytes / ms / 1e6, "tflops": flops / ms / 1e9}
        log(f"{op} {case.name} {backend}: {ms:.4g} ms ({ms / roofline_ms:.3g}x the roofline "
            f"{roofline_ms:.3g} ms; {nbytes / ms / 1e6:.4g} GB/s), compiled in {compile_s:.1f} s")
    if all(isinstance(result.get(b), dict) and "ms" in result[b] for b in ("ffi", "reference")):
        result["ffi_speedup"] = result["reference"]["ms"] / result["ffi"]["ms"]
    return result


def command(s: Settings) -> str:
    return (f"python -m bench.ffi_bench --config {s.config_name} --decode {','.join(map(str, s.decode)) or repr('')} "
            f"--prefill {s.prefill} --context {s.context} --kv-format {s.kv_format} --index-format {s.index_format} "
            f"--backends {','.join(s.backends)} --ops {','.join(s.ops)} "
            f"--steps {s.steps}" + (f" --inner {s.inner}" if s.timing == "loop" else "") + f" --timing {s.timing}")


def markdown_row(r: dict, meta: dict, s: Settings) -> str:
    if r["status"] != "ok":
        figure, ratio = r["status"], "-"
    else:
        parts = [f"{b} {r[b]['ms']:.4g} ms ({r[b]['gbps']:.4g} GB/s, {r[b]['tflops']:.3g} TFLOP/s)"
                 if "ms" in r[b] else f"{b} {r[b]['status']}" for b in s.backends]
        figure = "; ".join(parts) + f"; roofline {r['roofline_ms']:.3g} ms"
        floor = meta[f"{s.timing}_floor_ms"]
        if s.timing == "loop":
            figure += f"; loop floor {floor:.3g} ms"
        else:
            figure += f" (device time from a profile; profile floor {floor:.3g} ms)"
        ratio = "; ".join(f"{b} {r[b]['over_roofline']:.3g}x roofline" for b in s.backends if "ms" in r[b])
        if s.timing == "profile" and 2 * r["roofline_ms"] < floor:
            ratio += "; 2x the roofline is under the profile floor"
        if "ffi_speedup" in r:
            x = r["ffi_speedup"]
            ratio += f"; ffi {x:.3g}x faster than reference" if x >= 1 else f"; ffi {1 / x:.3g}x SLOWER than reference"
    what = (f"{r['op']}, {s.config_name} dims, {r['case']} at context {s.context}, KV {s.kv_format}, "
            f"index keys {s.index_format}")
    device = f"{meta['device']} (jax {meta['jax_version']})"
    return f"| {meta['date']} | {device} | `{command(s)}` | {what} | {figure} | {ratio} |"


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m bench.ffi_bench", description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="flash")
    p.add_argument("--decode", type=_sizes, default=(1, 8, 32, 64), help="decode concurrencies")
    p.add_argument("--prefill", type=int, default=0, help="tokens of one prefill chunk (0: none)")
    p.add_argument("--context", type=int, default=4096, help="context per decoding request")
    p.add_argument("--kv-format", choices=sorted(KV_FORMATS), default="fp8")
    p.add_argument("--index-format", choices=sorted(INDEX_FORMATS), default="fp4")
    p.add_argument("--backends", default="ffi,reference")
    p.add_argument("--ops", default=",".join(OPS), help="which ops to time")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--inner", type=int, default=20, help="calls per timed program (a device loop)")
    p.add_argument("--timing", choices=("loop", "profile"), default="loop",
                   help="loop: wall time of a device loop / --inner; profile: GPU device time from a trace")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--hbm-tbps", type=float, default=4.3)
    p.add_argument("--tflops", type=float, default=790.0)
    p.add_argument("--json", dest="json_path", default=None)
    a = p.parse_args(argv)
    backends = tuple(b.strip() for b in a.backends.split(","))
    for b in backends:
        Backend(b)  # a clear error for an unknown backend
    ops = tuple(o.strip() for o in a.ops.split(","))
    if not set(ops) <= set(OPS):
        p.error(f"--ops: unknown {sorted(set(ops) - set(OPS))}; choose from {list(OPS)}")
    if a.context % CONFIGS[a.config].csa_ratio or a.prefill < 0 or a.inner < 1:
        p.error("--context must be a multiple of the CSA ratio, --prefill >= 0 and --inner >= 1")
    if a.timing == "profile" and jax.default_backend() != "gpu":
        p.error("--timing profile reads the trace's GPU tracks: it needs a GPU (use --timing loop)")
    return Settings(a.config, a.decode, a.prefill, a.context, a.kv_format, a.index_format, backends, ops, a.steps,
                    a.warmup, a.inner, a.timing, a.dtype, a.hbm_tbps, a.tflops, a.json_path)


def _log(msg: str) -> None:
    print(f"[ffi_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> dict:
    s = parse_args(argv)
    cfg = CONFIGS[s.config_name]
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
            "jax_version": jax.__version__, "command": command(s), "hbm_tbps": s.hbm_tbps, "tflops": s.tflops,
            "timing": s.timing}
    floor_key = f"{s.timing}_floor_ms"
    meta[floor_key] = timing_floor_ms(s)
    _log(f"{s.timing} floor: {meta[floor_key]:.4g} ms per call")
    cases = [Case(f"decode C{c}", c, c, s.context) for c in s.decode]
    if s.prefill:
        cases.append(Case(f"prefill {s.prefill}", s.prefill, 1, s.prefill))
    results = []
    for case in cases:
        for op in s.ops:
            results.append(run_op(op, cfg, case, s, _log))
            if s.json_path:
                with open(s.json_path, "w") as f:
                    json.dump({"meta": meta, "results": results}, f, indent=1)
    rows = [markdown_row(r, meta, s) for r in results]
    print("\n| date | device | command | what | figure | ratio |\n|---|---|---|---|---|---|")
    print("\n".join(rows))
    return {"meta": meta, "results": results}


if __name__ == "__main__":
    main()
