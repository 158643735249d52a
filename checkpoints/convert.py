"""Convert an official DeepSeek-V4 checkpoint directory to a converted (Orbax) directory.

    python -m checkpoints.convert SRC DST [--dtype bfloat16|float32] [--quantized | --dequantize]
                                  [--fake-quant on|off|auto] [--overwrite]

Loads SRC with `checkpoints.loader.load_checkpoint` (every tensor checked) and its draft head
where it has one (`load_draft`: the DSpark stages or the MTP layer), then writes DST with
`checkpoints.orbax_io.save_converted`, the tokenizer files and chat encoding copied along: DST
serves like SRC, speculation included. DST is checked before the (long) load, so a bad
destination fails at once. Exit codes: 0 converted, 2 bad arguments, source or destination.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from checkpoints.orbax_io import DTYPES, check_destination, is_converted, save_converted

_FAKE_QUANT = {"on": True, "off": False, "auto": None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m checkpoints.convert",
        description="Convert an official DeepSeek-V4 safetensors checkpoint to an Orbax checkpoint that "
                    "dsv4.load_pretrained restores directly into each parameter's sharding.")
    p.add_argument("src", metavar="SRC", help="official checkpoint directory (config.json + *.safetensors)")
    p.add_argument("dst", metavar="DST", help="output directory (must be new or empty unless --overwrite)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="dtype of dense weights and activations (default: bfloat16)")
    q = p.add_mutually_exclusive_group()
    q.add_argument("--quantized", dest="quantized", action="store_true", default=True,
                   help="keep FP8/FP4 weights and their E8M0 scales as on disk (default; smallest, bit-exact)")
    q.add_argument("--dequantize", dest="quantized", action="store_false",
                   help="decode FP8/FP4 weights to --dtype before saving")
    p.add_argument("--fake-quant", choices=sorted(_FAKE_QUANT), default="auto",
                   help="the official KV/indexer QAT simulation: on, off, or auto (on for FP8 checkpoints)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DST if it already holds a converted checkpoint")
    return p


class _ProgressPrinter:
    """Prints a line at every tenth of the parameters placed (and the last one)."""

    def __init__(self, t0: float):
        self.t0, self.next_tenth = t0, 1

    def __call__(self, done: int, total: int, n_bytes: int) -> None:
        if done * 10 >= self.next_tenth * total or done == total:
            print(f"  {done}/{total} parameters, {n_bytes / 2**20:.1f} MiB, {time.perf_counter() - self.t0:.1f} s",
                  flush=True)
            self.next_tenth = done * 10 // total + 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported here so `--help` and argument errors stay instant.
    from checkpoints.loader import CheckpointError, draft_kind, load_checkpoint, load_draft

    src, dst = os.fspath(args.src), os.fspath(args.dst)
    mode = "quantized" if args.quantized else "dequantized"
    overrides = {} if _FAKE_QUANT[args.fake_quant] is None else {"fake_quant": _FAKE_QUANT[args.fake_quant]}
    t0 = time.perf_counter()
    try:
        if not os.path.isdir(src):
            raise FileNotFoundError(f"{src}: no such directory")
        if is_converted(src):
            raise ValueError(f"{src}: already a converted checkpoint; nothing to convert")
        if os.path.realpath(src) == os.path.realpath(dst):
            raise ValueError(f"{dst}: destination is the source directory")
        check_destination(dst, overwrite=args.overwrite)
        print(f"loading {src} ({mode}, dtype {args.dtype}, fake_quant {args.fake_quant})", flush=True)
        model, report = load_checkpoint(src, dtype=DTYPES[args.dtype], quantized=args.quantized,
                                        config_overrides=overrides, progress=_ProgressPrinter(t0))
        head = None
        if draft_kind(src) != "none":
            print(f"loading its {model.cfg.draft_kind} draft head", flush=True)
            try:
                head = load_draft(src, dtype=DTYPES[args.dtype], quantized=args.quantized, config_overrides=overrides)
            except CheckpointError as e:  # the tower is whole: convert it, and say what is left behind
                print(f"warning: the draft head is not converted (speculation will be off): {_one_line(e)}",
                      file=sys.stderr, flush=True)
        t1 = time.perf_counter()
        print(f"{report.summary()} in {t1 - t0:.1f} s", flush=True)
        print(f"writing {dst} (fake_quant {model.cfg.fake_quant})", flush=True)
        manifest = save_converted(model, dst, quantized=args.quantized, dtype_name=args.dtype,
                                  draft_tensors=report.draft_tensors, overwrite=args.overwrite, source=src,
                                  draft=head)
    except (ValueError, OSError) as e:
        # CheckpointError and ConfigError are ValueErrors; their messages name the problem.
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    t2 = time.perf_counter()
    print(f"wrote {report.n_tensors} tower tensors ({report.n_bytes / 2**20:.1f} MiB) to {dst} in {t2 - t1:.1f} s",
          flush=True)
    draft = f", its {manifest['draft']} draft head too" if manifest["draft"] != "none" else ""
    print(f"done: {src} -> {dst} ({mode}, {args.dtype}, fake_quant {manifest['fake_quant']}{draft}) "
          f"in {t2 - t0:.1f} s", flush=True)
    return 0


def _one_line(e: BaseException) -> str:
    """The message on one line: the loader lists one problem per line, so keep the first few."""
    lines = [ln.strip() for ln in (str(e) or type(e).__name__).splitlines() if ln.strip()]
    more = f" ... (+{len(lines) - 3} more)" if len(lines) > 3 else ""
    return " ".join(lines[:3]) + more

if __name__ == "__main__":
    sys.exit(main())
