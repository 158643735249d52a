"""Decode attention's device time per call at forced split counts (an experiment, GPU only).

`dsv4.ops.sparse_attention.ffi.split_parts` picks the parts a query's selected rows are split
into (one wave of blocks). This replaces it by a fixed count and times each count with
`bench.ffi_bench --timing profile`, to see whether the one-wave rule still picks the fastest
count for the current kernels (the last sweep, 2026-11-30, ran the older 32-row mma.sync code).

    PYTHONPATH=. python3 bench/experiments/2026-12-07_split_parts_sweep.py 32:2,3,4 64:1,2 --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import dsv4.ops.sparse_attention.ffi as attn_ffi
from bench import ffi_bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sweeps", nargs="+", help="C:P1,P2,... decode concurrency and the split counts to force")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", dest="json_path", default=None)
    a = p.parse_args()
    default = attn_ffi.split_parts
    figures = []
    try:
        for sweep in a.sweeps:
            c, counts = sweep.split(":")
            for parts in [None] + [int(x) for x in counts.split(",")]:
                attn_ffi.split_parts = default if parts is None else (lambda q, slots, parts=parts: parts)
                out = ffi_bench.main(["--decode", c, "--prefill", "0", "--ops", "sparse_attention", "--backends",
                                      "ffi", "--timing", "profile", "--steps", str(a.steps), "--warmup", "2"])
                ms = out["results"][0]["ffi"]["ms"]
                figures.append({"C": int(c), "parts": parts or "default", "ms": ms})
                print(f"SWEEP C{c} parts {parts or 'default'}: {1e3 * ms:.2f} us", flush=True)
    finally:
        attn_ffi.split_parts = default
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
