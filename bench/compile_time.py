"""What compiling the step costs: seconds per bucket, split into tracing + lowering and XLA.

    python -m bench.compile_time [--config tiny|flash] [--layers 4] [--buckets 32x1,128x16]
        [--dtype bfloat16|float32] [--option NAME=VALUE ...] [--max-logprobs 0] [--json PATH]

Serving compiles one program per bucket before it takes requests (`StepRunner.warmup`), so
start-up time is the sum of these figures (the persistent compilation cache skips them on a
restart with the same shapes). Each bucket `TxR` (T tokens, R requests, min(T, R) output
rows) is compiled once for a state of R slots x 128 positions, with `--option` passed to
XLA as compiler options (e.g. `--option xla_gpu_autotune_level=0`), and reported with the
optimised program's instruction count. `--config tiny` is the embedded demo model's
config; `--config flash` FLASH widths cut to `--layers` layers (bench.step_bench's
`bench_config`), with random weights made on the device.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time

import jax

from bench.step_bench import DTYPES, bench_config, build_params
from dsv4.batch import Bucket
from dsv4.config import FLASH, TINY
from dsv4.ops.registry import Backend, ops_for
from dsv4.state import StateGeometry, default_page_tokens
from dsv4.step import StepRunner


def _bucket(text: str) -> Bucket:
    t, _, r = text.lower().partition("x")
    tokens, requests = int(t), int(r or 1)
    if not 1 <= requests <= tokens:
        raise argparse.ArgumentTypeError(f"expected TxR with 1 <= R <= T, got {text!r}")
    return Bucket(tokens=tokens, requests=requests, outputs=min(tokens, requests))


def _option(text: str) -> tuple[str, str | bool | int | float]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, {"true": True, "false": False}.get(value.lower(), value)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.compile_time", description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=("tiny", "flash"), default="tiny")
    p.add_argument("--layers", type=int, default=4, help="FLASH layers kept (--config flash)")
    p.add_argument("--buckets", default="32x1,128x16", help="comma-separated TxR (tokens x requests)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: float32 on CPU, bfloat16 elsewhere")
    p.add_argument("--option", type=_option, action="append", default=[], help="an XLA compiler option NAME=VALUE")
    p.add_argument("--max-logprobs", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.buckets = [_bucket(b) for b in args.buckets.split(",") if b.strip()]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype_name = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg = TINY if args.config == "tiny" else bench_config(FLASH, args.layers)
    t0 = time.perf_counter()
    graphdef, params = build_params(cfg, DTYPES[dtype_name], seed=0)
    jax.block_until_ready(params)
    print(f"built {args.config} params in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    page = default_page_tokens(cfg)
    per_seq = math.ceil(128 / page)
    slots = max(b.requests for b in args.buckets)
    geometry = StateGeometry(num_slots=slots, num_pages=slots * per_seq, page_tokens=page, max_pages_per_seq=per_seq,
                             max_spec_tokens=0, dtype=DTYPES[dtype_name])
    runner = StepRunner(graphdef, params, cfg, geometry, args.buckets, ops_for(Backend.REFERENCE),
                        max_logprobs=args.max_logprobs, compiler_options=dict(args.option))
    runner.warmup(lambda i, n, b: print(f"compiling {i + 1}/{n}: {b}", file=sys.stderr, flush=True))
    rows = []
    for b in runner.buckets:
        lower_s, compile_s = runner.compile_seconds[b]
        instructions = sum(" = " in line for line in runner.program_text(b).splitlines())
        rows.append(dict(bucket=f"{b.tokens}x{b.requests}", lower_s=round(lower_s, 2), compile_s=round(compile_s, 2),
                         instructions=instructions))
        print(f"{b.tokens:>6} tokens x {b.requests:>3} requests: lower {lower_s:6.1f} s, XLA compile "
              f"{compile_s:6.1f} s, {instructions} instructions")
    result = dict(meta=dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                            jax=jax.__version__, config=args.config, layers=cfg.num_hidden_layers, dtype=dtype_name,
                            options=dict(args.option), command="python -m bench.compile_time " + " ".join(
                                sys.argv[1:] if argv is None else argv)),
                  buckets=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
