"""What DSpark speculation costs at FLASH width: a draft pass and a fused verify step vs a plain decode step.

    python -m bench.spec_bench [--config flash|tiny] [--layers 4] [--decode 1,8,32,64] [--k 5]
        [--context 4096] [--steps 10] [--warmup 2] [--dense] [--dtype bfloat16] [--json PATH]
        [--seed 0] [--compilation-cache DIR]

The model is `bench.step_bench`'s (the config's real widths, the first `--layers` tower
layers, random weights built on the device, FP8/FP4 weights unless `--dense`) plus the 3
DSpark stages at the same widths, tapping the last three tower layers. Per concurrency C,
on one device, three programs are compiled and timed (median of `--steps` calls after
`--warmup`; every call includes its host packing and the fetch of its outputs):

- plain: the decode step of C requests of one token at `--context` (`StepRunner.run`), as
  `bench.step_bench` times it.
- draft: one block pass of the draft head alone for C requests (`speculative.propose`:
  3 stages over full 128-entry rings and the K-row block, the LM head, the Markov head
  and the confidence head, the K drafts sampled).
- spec: the fused speculative step (`SpecRunner.run`): the target over C x (K+1) rows with
  an output and a tap on every row, verification, the accepted positions into the rings,
  and the next block drafted: what a speculating engine runs each step instead of plain.

Projection: a request commits tau tokens per spec step (tau = accepted drafts + 1, in
1..K+1), so speculation gives C * tau / spec_s tokens/s against C / plain_s. Random
weights accept almost nothing: tau is an assumption here, not a measurement; the
acceptance of the real checkpoint decides which column applies. speedup(tau) = tau x
plain_ms / spec_ms; break-even tau = spec_ms / plain_ms.

The state contents are synthetic, as in `bench.step_bench` (a zero decode state with
start = context + step; each spec step writes K+1 rows from there).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import step_bench as sb
from dsv4.batch import Bucket, Chunk
from dsv4.layers.dspark import RING, DSparkHead
from dsv4.model import storage_config
from dsv4.ops.registry import Backend, ops_for
from dsv4.spec_decode import SpecRunner
from dsv4.speculative import propose
from dsv4.state import StateGeometry, default_page_tokens
from dsv4.step import StepRunner, enable_compilation_cache

STAGES = 3


@dataclasses.dataclass(frozen=True)
class Settings:
    config_name: str
    layers: int
    decode: tuple[int, ...]
    k: int
    context: int
    steps: int
    warmup: int
    quantized: bool
    dtype_name: str
    json_path: str | None
    seed: int
    compilation_cache: str | None

    def step_settings(self) -> sb.Settings:
        """The same case as `bench.step_bench` would time it (its plain decode step)."""
        return sb.Settings(config_name=self.config_name, layers=self.layers, decode=self.decode, prefill=(),
                           context=self.context, steps=self.steps, warmup=self.warmup, kv_format=sb.KVFormat.DENSE,
                           index_format=sb.IndexKeyFormat.DENSE, quantized=self.quantized, dtype_name=self.dtype_name,
                           hbm_tbps=4.8, json_path=None, seed=self.seed, compilation_cache=None, check_finite=False)


def spec_config(s: Settings):
    """The benchmark tower with a 3-stage DSpark head of block size K tapping its last three layers."""
    base = sb.CONFIGS[s.config_name]
    cfg = storage_config(sb.bench_config(base, s.layers), s.quantized)
    return cfg.replace(num_draft_stages=STAGES, dspark_block_size=s.k, dspark_noise_token_id=cfg.vocab_size - 1,
                       dspark_target_layer_ids=tuple(range(s.layers - 3, s.layers)),
                       dspark_markov_rank=base.dspark_markov_rank or 16)


def build_head(cfg, dtype, seed: int) -> DSparkHead:
    """Random draft-head parameters made on the device by one jitted init."""
    def make() -> DSparkHead:
        return DSparkHead(cfg, param_dtype=dtype, rngs=nnx.Rngs(seed))

    graphdef, _ = nnx.split(nnx.eval_shape(make))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.split(make())[1])())


def _median_ms(run, s: Settings) -> tuple[float, float]:
    """(median, p90) ms of `run()` over --steps calls after --warmup (run blocks until done)."""
    times = []
    for i in range(s.warmup + s.steps):
        t = time.perf_counter()
        run(i)
        if i >= s.warmup:
            times.append(1e3 * (time.perf_counter() - t))
    return float(np.median(times)), float(np.percentile(times, 90))


def time_draft(head: DSparkHead, params, c: int, s: Settings, log) -> tuple[float, float, float]:
    """(compile s, median ms, p90 ms) of one draft block pass for c requests with full rings."""
    cfg = head.cfg
    graphdef, head_params = nnx.split(head)
    dtype = params["embed"]["weight"][...].dtype
    ops = ops_for(Backend.REFERENCE)
    rng = np.random.default_rng(s.seed)
    rings = jnp.asarray(rng.standard_normal((STAGES, c, RING, cfg.head_dim)) * 0.1, dtype)
    ring_pos = jnp.asarray(s.context - RING + 1 + np.arange(RING)[None, :].repeat(c, 0), jnp.int32)
    f32 = lambda x: jnp.full((c,), x, jnp.float32)  # noqa: E731

    def draft(head_params, embed, lm_head, anchor, anchor_pos):
        prop = propose(nnx.merge(graphdef, head_params), anchor, anchor_pos, rings, ring_pos, embed, lm_head,
                       f32(1.0), jnp.zeros((c,), jnp.int32), f32(1.0), f32(0.0), jnp.arange(c, dtype=jnp.uint32), ops)
        return prop.tokens, prop.confidence_logits

    embed, lm_head = params["embed"]["weight"][...], params["head"]["weight"][...]
    anchors = jnp.asarray(rng.integers(0, cfg.vocab_size, c), jnp.int32)
    t0 = time.perf_counter()
    program = jax.jit(draft).lower(head_params, embed, lm_head, anchors, jnp.full((c,), s.context, jnp.int32)).compile()
    compile_s = time.perf_counter() - t0
    log(f"C{c} draft: compiled in {compile_s:.1f} s")

    def run(i):
        jax.device_get(program(head_params, embed, lm_head, anchors, jnp.full((c,), s.context + i, jnp.int32)))

    return (compile_s, *_median_ms(run, s))


def time_spec(cfg, graphdef, params, head: DSparkHead, c: int, s: Settings, log) -> tuple[float, float, float]:
    """(compile s, median ms, p90 ms) of the fused speculative step for c requests verifying K drafts."""
    k = s.k
    page = default_page_tokens(cfg)
    per_seq = math.ceil((s.context + s.warmup + s.steps + k + 2) / page)
    geometry = StateGeometry(num_slots=c, num_pages=c * per_seq, page_tokens=page, max_pages_per_seq=per_seq,
                             max_spec_tokens=k, dtype=sb.DTYPES[s.dtype_name])
    rows = c * (k + 1)
    bucket = Bucket(tokens=rows, requests=c, outputs=rows, taps=rows)
    runner = StepRunner(graphdef, params, cfg, geometry, [bucket], ops_for(Backend.REFERENCE))
    spec = SpecRunner(runner, head, ops_for(Backend.REFERENCE), k=k)
    t0 = time.perf_counter()
    spec.warmup()
    compile_s = time.perf_counter() - t0
    log(f"C{c} spec: compiled in {compile_s:.1f} s")
    rng = np.random.default_rng(s.seed)
    anchors = rng.integers(0, cfg.vocab_size, (s.warmup + s.steps, c))

    def run(i):
        chunks = [Chunk(slot=r, start=s.context + i, tokens=[int(anchors[i, r])] + [0] * k,
                        pages=list(range(r * per_seq, (r + 1) * per_seq)), outputs=list(range(k + 1)),
                        taps=list(range(k + 1))) for r in range(c)]
        spec.run(chunks, [k] * c, [i == 0] * c)

    return (compile_s, *_median_ms(run, s))


def case(c: int, cfg, graphdef, params, head, s: Settings, log) -> dict:
    out = dict(case=f"C{c}", requests=c, k=s.k, status="ok")
    try:
        timing = sb.time_case(sb.Case(sb.CaseKind.DECODE, c), cfg, graphdef, params, s.step_settings(), False, log)
        out.update(plain_compile_s=timing["compile_s"], plain_ms=float(np.median(timing["times"]) * 1e3),
                   plain_p90_ms=float(np.percentile(timing["times"], 90) * 1e3))
        gc.collect()
        out["draft_compile_s"], out["draft_ms"], out["draft_p90_ms"] = time_draft(head, params, c, s, log)
        out["spec_compile_s"], out["spec_ms"], out["spec_p90_ms"] = time_spec(cfg, graphdef, params, head, c, s, log)
    except Exception as e:  # noqa: BLE001 - reported per case, the next one runs
        out["status"] = "OOM" if sb._is_oom(e) else f"error: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log(f"C{c}: {out['status']}")
        return out
    finally:
        gc.collect()
    plain, spec = out["plain_ms"], out["spec_ms"]
    out["draft_over_plain"] = out["draft_ms"] / plain
    out["spec_over_plain"] = spec / plain
    out["break_even_tau"] = spec / plain
    out["projected"] = [dict(tau=tau, tokens_per_s=c * tau / (spec / 1e3), speedup=tau * plain / spec)
                        for tau in range(1, s.k + 2)]
    out["plain_tokens_per_s"] = c / (plain / 1e3)
    return out


def command(c: int, s: Settings) -> str:
    parts = ["python -m bench.spec_bench", f"--config {s.config_name}", f"--layers {s.layers}", f"--decode {c}",
             f"--k {s.k}", f"--context {s.context}", f"--steps {s.steps}", f"--warmup {s.warmup}"]
    if not s.quantized:
        parts.append("--dense")
    if s.dtype_name != "bfloat16":
        parts.append(f"--dtype {s.dtype_name}")
    return " ".join(parts)


def markdown_row(r: dict, meta: dict, s: Settings) -> str:
    c = r["requests"]
    what = (f"DSpark cost, {s.config_name.upper()} width, {s.layers} target layers + {STAGES} draft stages, "
            f"{'FP8/FP4' if s.quantized else s.dtype_name} weights, K={s.k}, decode C{c} at context {s.context}")
    if r["status"] != "ok":
        figure, ratio = r["status"], "-"
    else:
        figure = (f"plain {r['plain_ms']:.4g} ms, draft pass {r['draft_ms']:.4g} ms, fused verify+draft step "
                  f"{r['spec_ms']:.4g} ms; projected tok/s at tau=1..{s.k + 1}: "
                  + " / ".join(f"{p['tokens_per_s']:.4g}" for p in r["projected"])
                  + f" (plain {r['plain_tokens_per_s']:.4g})")
        ratio = (f"draft {r['draft_over_plain']:.2f}x plain, spec step {r['spec_over_plain']:.2f}x plain "
                 f"(break-even tau {r['break_even_tau']:.2f}); speedup at tau=1..{s.k + 1}: "
                 + " / ".join(f"{p['speedup']:.2f}" for p in r["projected"]))
    device = f"{meta['device']} (jax {meta['jax_version']})"
    return f"| {meta['date']} | {device} | `{command(c, s)}` | {what} | {figure} | {ratio} |"


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(prog="python -m bench.spec_bench", description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(sb.CONFIGS), default="flash")
    p.add_argument("--layers", type=int, default=4, help="tower layers (>= 3: the draft taps the last three)")
    p.add_argument("--decode", type=sb._sizes, default=(1, 8, 32, 64), help="concurrencies")
    p.add_argument("--k", type=int, default=5, help="drafts per block (DSpark: 5)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dense", dest="quantized", action="store_false", default=True,
                   help="all weights dense in --dtype (default: FP8/FP4 as the checkpoint stores them)")
    p.add_argument("--dtype", choices=sorted(sb.DTYPES), default="bfloat16")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compilation-cache", default=None)
    a = p.parse_args(argv)
    if a.layers < 3 or not 1 <= a.k or a.steps < 1 or a.warmup < 0 or a.context < RING or not a.decode:
        p.error(f"need --layers >= 3, --k >= 1, --steps >= 1, --warmup >= 0, --context >= {RING}, some --decode")
    return Settings(config_name=a.config, layers=a.layers, decode=a.decode, k=a.k, context=a.context, steps=a.steps,
                    warmup=a.warmup, quantized=a.quantized, dtype_name=a.dtype, json_path=a.json_path, seed=a.seed,
                    compilation_cache=a.compilation_cache)


def _log(msg: str) -> None:
    print(f"[spec_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: Sequence[str] | None = None) -> dict:
    s = parse_args(argv)
    if s.compilation_cache:
        enable_compilation_cache(s.compilation_cache)
    cfg = spec_config(s)
    dtype = sb.DTYPES[s.dtype_name]
    meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind,
                jax_version=jax.__version__, config=s.config_name, layers=s.layers, stages=STAGES, k=s.k,
                context=s.context, steps=s.steps, warmup=s.warmup, quantized=s.quantized, dtype=s.dtype_name,
                note="random weights: acceptance is not measured; tau is assumed")
    _log(f"jax.devices(): {jax.devices()}; building {s.config_name} width, {s.layers} layers + {STAGES} stages")
    t0 = time.perf_counter()
    graphdef, params = sb.build_params(cfg, dtype, s.seed)
    head = build_head(cfg, dtype, s.seed + 7)
    jax.block_until_ready((params, nnx.state(head)))
    _log(f"built random target and draft parameters on the device in {time.perf_counter() - t0:.1f} s")
    results, rows = [], []
    for c in s.decode:
        results.append(case(c, cfg, graphdef, params, head, s, _log))
        rows.append(markdown_row(results[-1], meta, s))
        _log(rows[-1])
        if s.json_path:  # after every case: a run cut short keeps what it measured
            with open(s.json_path, "w") as f:
                json.dump(dict(meta=meta, cases=results), f, indent=2)
    print("\n| date | device | command | what | figure | ratio |\n|---|---|---|---|---|---|", flush=True)
    print("\n".join(rows), flush=True)
    return dict(meta=meta, cases=results)


if __name__ == "__main__":
    results = main()
    sys.exit(0 if all(r["status"] in ("ok", "OOM") for r in results["cases"]) else 1)
