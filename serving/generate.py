"""Offline generation: `python -m serving.generate [--model DIR] --prompt TEXT ...`.

Without --model it runs the embedded demo model (random TINY weights, byte tokenizer).
Decoding here recomputes the full sequence (padded to a power-of-two bucket) for every new token through
`dsv4.Model.logits` (no KV cache yet), greedy or seeded temperature sampling.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from serving.demo_model import ByteTokenizer, ensure_demo_checkpoint


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
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import dsv4

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
    rng = np.random.default_rng(args.seed)
    for prompt in args.prompt or ["Hello, DeepSeek-V4!"]:
        ids = tok.encode(prompt)
        new: list[int] = []
        t1 = time.perf_counter()
        for _ in range(args.max_new_tokens):
            seq = ids + new
            # Pad to a power-of-two bucket so a handful of shapes are compiled, not one per
            # length; the model is causal, so padding after the last token changes nothing before it.
            bucket = max(32, 1 << (len(seq) - 1).bit_length())
            padded = np.asarray([seq + [cfg.eos_token_id] * (bucket - len(seq))], np.int32)
            logits = np.asarray(model.logits(padded)[0, len(seq) - 1])
            nxt = sample(logits, args.temperature, rng)
            new.append(nxt)
            if nxt == cfg.eos_token_id:
                break
        dt = time.perf_counter() - t1
        print(f"prompt: {prompt!r}\n  tokens: {new}\n  text: {tok.decode(new)!r}\n"
              f"  {len(new)} tokens in {dt:.2f}s ({len(new) / dt:.1f} tok/s, full recompute per token)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
