"""Offline generation: `python -m serving.generate [--model DIR] --prompt TEXT ...`.

Without --model it runs the embedded demo model (random TINY weights, byte tokenizer).
All prompts are decoded together by `dsv4.Model.generate`: continuous batching on the one
step function (chunked prefill, one decode token per running request per step) over the
paged decode state; greedy or seeded temperature sampling, stopping at EOS.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from serving.demo_model import ensure_demo_checkpoint
from serving.tokenizer import ByteTokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serving.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (official format); default: the demo model")
    p.add_argument("--demo-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "dsv4-jax", "tiny-demo"),
                   help="where the demo checkpoint is written (default: %(default)s)")
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per prompt (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded concurrently (default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens per step (default 256)")
    p.add_argument("--compilation-cache", default=os.path.join(os.path.expanduser("~"), ".cache", "dsv4-jax", "xla"),
                   help="persistent XLA compilation cache directory ('' disables; default: %(default)s)")
    args = p.parse_args(argv)
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < args.max_num_seqs:
        p.error("need --max-num-seqs >= 1 and --max-num-batched-tokens >= --max-num-seqs")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import dsv4
    from dsv4.step import enable_compilation_cache

    if args.compilation_cache:
        enable_compilation_cache(args.compilation_cache)
    model_dir = args.model or ensure_demo_checkpoint(args.demo_dir)
    t0 = time.perf_counter()
    try:
        model = dsv4.load_pretrained(model_dir, dtype=args.dtype)
    except (OSError, ValueError) as e:
        print(f"error: cannot load {model_dir}: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    print(f"loaded {model_dir} in {time.perf_counter() - t0:.1f}s: {cfg.num_hidden_layers} layers, "
          f"vocab {cfg.vocab_size}{' (demo model: random weights, output is noise)' if not args.model else ''}")
    print(model.load_summary)
    tok = ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    prompts = args.prompt or ["Hello, DeepSeek-V4!"]
    t1 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"  finished {done}/{total} requests ({time.perf_counter() - t1:.1f}s)", flush=True)

    outputs = model.generate([tok.encode(p) for p in prompts], args.max_new_tokens, temperature=args.temperature,
                             seed=args.seed, stop_token_ids=[cfg.eos_token_id], max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens, progress=progress)
    dt = time.perf_counter() - t1
    for prompt, new in zip(prompts, outputs):
        print(f"prompt: {prompt!r}\n  tokens: {new}\n  text: {tok.decode(new)!r}")
    n = sum(len(o) for o in outputs)
    print(f"{len(prompts)} requests, {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s, including compilation)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
