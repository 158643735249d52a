"""Does launching a step return before the device has run it? The host/device overlap check.

    python -m bench.overlap [--config tiny|flash] [--layers 4] [--requests 32] [--steps 20]
        [--sampling greedy|top_p] [--json PATH]

The engine plans and packs step n+1 while the device runs step n, which only works when
`StepRunner.dispatch` returns at once. Anything in the program that makes the launch wait
for the device (on GPUs, an XLA conditional or a while loop without a known trip count
copies a predicate to the host and waits) turns the overlap off without changing a result,
so this measures it: per step, the seconds `dispatch` takes to return (the host is blocked)
and the seconds until its outputs are on the host (`collect`), for `--requests` decoding
requests (one token each) in one bucket. Reported: median dispatch ms, median step ms
(dispatch + collect) and the overlap share 1 - dispatch / step (near 1: the launch is
asynchronous; near 0: the host waits for the device).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time

import jax
import numpy as np

from bench.step_bench import DTYPES, bench_config, build_params
from dsv4.batch import Bucket, Chunk
from dsv4.config import FLASH, TINY
from dsv4.ops.registry import Backend, ops_for
from dsv4.state import StateGeometry, default_page_tokens
from dsv4.step import StepRunner


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=("tiny", "flash"), default="tiny")
    p.add_argument("--layers", type=int, default=4, help="FLASH layers kept (--config flash)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sampling", choices=("greedy", "top_p"), default="top_p",
                   help="top_p: temperature 0.8, top_p 0.95 on every row; greedy: temperature 0")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype_name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    cfg = TINY if args.config == "tiny" else bench_config(FLASH, args.layers)
    graphdef, params = build_params(cfg, DTYPES[dtype_name], seed=0)
    page = default_page_tokens(cfg)
    n = args.requests
    per_seq = math.ceil((args.steps + 3) / page)
    geometry = StateGeometry(num_slots=n, num_pages=n * per_seq, page_tokens=page, max_pages_per_seq=per_seq,
                             max_spec_tokens=0, dtype=DTYPES[dtype_name])
    runner = StepRunner(graphdef, params, cfg, geometry, [Bucket(n, n, n)], ops_for(Backend.REFERENCE))
    runner.warmup()
    hot = args.sampling == "top_p"
    rng = np.random.default_rng(0)
    dispatch_s, step_s = [], []
    for i in range(args.steps + 2):
        chunks = [Chunk(slot=r, start=i, tokens=[int(rng.integers(0, cfg.vocab_size))],
                        pages=list(range(r * per_seq, (r + 1) * per_seq)), outputs=[0],
                        temperature=0.8 if hot else 0.0, top_p=0.95 if hot else 1.0, seed=r)
                  for r in range(n)]
        t0 = time.perf_counter()
        launched = runner.dispatch(chunks)
        t1 = time.perf_counter()
        runner.collect(launched)
        t2 = time.perf_counter()
        if i >= 2:  # the first steps warm the allocator and caches
            dispatch_s.append(t1 - t0)
            step_s.append(t2 - t0)
    d, s = float(np.median(dispatch_s)) * 1e3, float(np.median(step_s)) * 1e3
    result = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, config=args.config, layers=cfg.num_hidden_layers, requests=n,
                  sampling=args.sampling, dispatch_ms=round(d, 3), step_ms=round(s, 3),
                  overlap_share=round(1 - d / s, 3),
                  command="python -m bench.overlap " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"{result['device']}: {n} requests, {args.sampling}: dispatch {d:.3f} ms of a {s:.3f} ms step "
          f"(overlap share {1 - d / s:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
