"""Where a CUDA kernel's warps wait: a summary of Nsight Compute's per-instruction stall samples.

    python -m bench.sass_stalls SASS.csv [--top 20] [--min-share 0.5]

The input is the source page of an `ncu --set full` report exported as SASS with its metrics:

    ncu --clock-control none --kernel-name regex:TensorCoreAttentionKernel --launch-count 1 \\
        --set full -o attn python3 -m bench.ffi_bench --decode none --prefill 8192 \\
        --ops sparse_attention --backends ffi --timing loop --steps 1 --warmup 0 --inner 1
    ncu -i attn.ncu-rep --page source --csv --print-source sass > attn_sass.csv

(the device's ncu reads the hardware counters on its Firecracker runtime; see the tool
library's device notes). Printed: the stall reasons over all samples; the kernel cut into
segments that end at a synchronising instruction (block and named barriers, wgmma waits,
cp.async waits, memory barriers), each with its share of the samples, its instructions
executed and its top reasons, which is how a tile loop's phases show up; the instructions
with the most samples; the instructions with the most long-scoreboard samples, each with the
global and local loads that write a register it names (the load it waits for is among them:
how an early use of a prefetched value shows up); and the shared-memory accesses whose
wavefronts exceed the ideal (bank conflicts). Nothing is measured here: it reads the counters
a profile recorded.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
WAVEFRONTS = "L1 Wavefronts Shared"
WAVEFRONTS_IDEAL = "L1 Wavefronts Shared Ideal"
# SASS opcodes after which a segment ends: the points where warps wait for one another or for
# asynchronous work, which separate a tile loop's phases.
SEGMENT_ENDS = ("BAR.SYNC", "BAR.ARV", "BAR.RED", "WARPGROUP.DEPBAR", "DEPBAR", "MEMBAR", "WARPSYNC")
# Opcodes whose results come through the long scoreboard (L1TEX: global, local and generic
# loads, atomics with a result, texture and surface loads).
LONG_LOADS = ("LDG", "LDL", "LD", "ATOMG", "ATOM", "TLD", "TEX", "SULD")
_REGISTER = re.compile(r"\bR(\d+)(\.64|\.128)?\b")


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: str
    source: str  # the SASS text, predicate included
    samples: int
    executed: int
    stalls: dict[str, int]  # reason (without the "stall_" prefix) -> samples
    wavefronts: int
    wavefronts_ideal: int

    @property
    def opcode(self) -> str:
        words = self.source.split()
        if not words:
            return ""
        return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]

    @property
    def operands(self) -> list[str]:
        """The operands after the opcode, split at top-level commas."""
        text = self.source.split(self.opcode, 1)[1] if self.opcode else ""
        return [o.strip() for o in text.split(",") if o.strip()]

    @property
    def access_registers(self) -> int:
        """Registers a memory instruction's data operand spans (its .64 / .128 size), else 1."""
        if not self.opcode.startswith(("LD", "ST", "ATOM", "RED")):
            return 1
        return next((int(w) // 32 for w in ("128", "64") if w in self.opcode.split(".")), 1)

    def written(self) -> set[int]:
        """The registers a load writes: its first operand, widened by the access size."""
        ops = self.operands
        if not ops or not re.fullmatch(r"R\d+", ops[0]):
            return set()
        first = int(ops[0][1:])
        return set(range(first, first + self.access_registers))

    def named(self) -> set[int]:
        """Every register an instruction names, read or written (an address such as [R8.64] names
        R8 and R9, a memory instruction's data operand its access size; RZ is none): a load in
        flight to any of them holds the instruction on the long scoreboard."""
        out = set()
        for op in self.operands:
            for number, wide in _REGISTER.findall(op):
                width = {".64": 2, ".128": 4}.get(wide, 1 if "[" in op else self.access_registers)
                out.update(range(int(number), int(number) + width))
        return out


@dataclasses.dataclass(frozen=True)
class Segment:
    first: str  # address of its first and last instruction
    last: str
    ends_with: str  # the last instruction's SASS
    instructions: int
    samples: int
    executed: int
    stalls: dict[str, int]


def _int(text: str) -> int:
    text = text.strip().replace(",", "")
    return int(float(text)) if text not in ("", "-") else 0


def read_sass_csv(path: str) -> tuple[str, list[Instruction]]:
    """The kernel's name and its instructions, in address order, from an exported source page."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    kernel, header_at = "", None
    for i, row in enumerate(rows):
        if row and row[0] == "Kernel Name" and len(row) > 1:
            kernel = row[1]
        if SAMPLES in row and "Source" in row:
            header_at = i
            break
    if header_at is None:
        raise ValueError(f"{path}: no '{SAMPLES}' column; export with "
                         "`ncu -i REPORT --page source --csv --print-source sass` from a --set full report")
    header = rows[header_at]
    col = {name: header.index(name) for name in header}
    stall_cols = {name[len("stall_"):]: i for name, i in col.items()
                  if name.startswith("stall_") and "Not Issued" not in name}
    out = []
    for row in rows[header_at + 1:]:
        if len(row) != len(header):
            continue
        out.append(Instruction(
            address=row[col["Address"]], source=row[col["Source"]].strip(), samples=_int(row[col[SAMPLES]]),
            executed=_int(row[col[EXECUTED]]) if EXECUTED in col else 0,
            stalls={reason: _int(row[i]) for reason, i in stall_cols.items()},
            wavefronts=_int(row[col[WAVEFRONTS]]) if WAVEFRONTS in col else 0,
            wavefronts_ideal=_int(row[col[WAVEFRONTS_IDEAL]]) if WAVEFRONTS_IDEAL in col else 0))
    return kernel, out


def _stall_totals(instructions: list[Instruction]) -> dict[str, int]:
    totals = collections.Counter()
    for ins in instructions:
        totals.update(ins.stalls)
    return dict(totals)


def _segment(run: list[Instruction]) -> Segment:
    return Segment(run[0].address, run[-1].address, run[-1].source, len(run), sum(i.samples for i in run),
                   sum(i.executed for i in run), _stall_totals(run))


def segments(instructions: list[Instruction]) -> list[Segment]:
    """The instructions cut after each synchronising one (SEGMENT_ENDS)."""
    out, run = [], []
    for ins in instructions:
        run.append(ins)
        if ins.opcode.startswith(SEGMENT_ENDS):
            out.append(_segment(run))
            run = []
    if run:
        out.append(_segment(run))
    return out


def bank_conflicts(instructions: list[Instruction], excess: float = 1.3) -> list[Instruction]:
    """Shared-memory accesses with more than `excess` times their ideal wavefronts."""
    return [i for i in instructions if i.wavefronts_ideal > 0 and i.wavefronts > excess * i.wavefronts_ideal]


def long_load_feeders(instructions: list[Instruction], n: int = 8) -> list[tuple[Instruction, list[Instruction]]]:
    """The n instructions with the most long-scoreboard samples, each with the loads (LONG_LOADS)
    anywhere in the kernel that write a register it names (by register name, not by control
    flow: a candidate list, among which is the load it waits for)."""
    loads = [i for i in instructions if i.opcode.split(".")[0] in LONG_LOADS]
    waiting = sorted((i for i in instructions if i.stalls.get("long_sb", 0) > 0), key=lambda i: -i.stalls["long_sb"])
    return [(ins, [ld for ld in loads if ld.written() & ins.named()]) for ins in waiting[:n]]


def _top(stalls: dict[str, int], total: int, n: int) -> str:
    best = sorted(stalls.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {100 * v / max(total, 1):.0f}%" for k, v in best if v)


def report(path: str, top: int = 20, min_share: float = 0.5, out=None) -> None:
    out = out or sys.stdout
    kernel, instructions = read_sass_csv(path)
    total = sum(i.samples for i in instructions)
    print(f"{kernel or path}\n{len(instructions)} instructions, {total} stall samples, "
          f"{sum(i.executed for i in instructions)} warp instructions executed\n", file=out)
    reasons = _stall_totals(instructions)
    print("stall reasons (share of all samples):", file=out)
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {reason:20s} {100 * n / max(total, 1):5.1f}%", file=out)
    print(f"\nsegments with at least {min_share}% of the samples (cut after each wait):", file=out)
    print(f"  {'first':>8s} {'last':>8s} {'share':>6s} {'instr':>6s} {'executed':>12s}  ends with / top reasons",
          file=out)
    for seg in segments(instructions):
        share = 100 * seg.samples / max(total, 1)
        if share < min_share:
            continue
        print(f"  {seg.first[-8:]:>8s} {seg.last[-8:]:>8s} {share:5.1f}% {seg.instructions:6d} {seg.executed:12d}  "
              f"{seg.ends_with[:48]} / {_top(seg.stalls, seg.samples, 3)}", file=out)
    print(f"\nthe {top} instructions with the most samples:", file=out)
    for ins in sorted(instructions, key=lambda i: -i.samples)[:top]:
        print(f"  {ins.address[-8:]:>8s} {100 * ins.samples / max(total, 1):5.1f}%  {ins.source[:60]:60s} "
              f"{_top(ins.stalls, ins.samples, 2)}", file=out)
    print("\nthe most long-scoreboard samples, and the loads writing a register each names:", file=out)
    for ins, feeders in long_load_feeders(instructions):
        where = ", ".join(f"{ld.address[-8:]} {ld.opcode}" for ld in feeders[:6]) or "no load found"
        where += f" and {len(feeders) - 6} more" if len(feeders) > 6 else ""
        print(f"  {ins.address[-8:]:>8s} {100 * ins.stalls['long_sb'] / max(total, 1):5.1f}%  {ins.source[:48]:48s} "
              f"<- {where}", file=out)
    conflicted = bank_conflicts(instructions)
    print(f"\nshared-memory accesses over 1.3x their ideal wavefronts: {len(conflicted)}", file=out)
    for ins in sorted(conflicted, key=lambda i: -(i.wavefronts - i.wavefronts_ideal))[:top]:
        print(f"  {ins.address[-8:]:>8s} {ins.wavefronts / ins.wavefronts_ideal:4.1f}x  {ins.source[:60]:60s} "
              f"{ins.wavefronts - ins.wavefronts_ideal} excess", file=out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="`ncu -i REPORT --page source --csv --print-source sass` output")
    p.add_argument("--top", type=int, default=20, help="instructions listed")
    p.add_argument("--min-share", type=float, default=0.5, help="smallest segment listed, percent of samples")
    a = p.parse_args(argv)
    try:
        report(a.csv, a.top, a.min_share)
    except (OSError, ValueError) as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
