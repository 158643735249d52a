"""Nsight Compute figures of kernel variants side by side: which of them moved.

    python -m bench.ncu_compare BASE.csv VARIANT.csv [...] [--min-change 0.05]

Each file is what `ncu --csv --page details` printed for one profiled kernel launch (the
launch's sections as rows of section, metric, unit and value; `bench.kernel_variants --ncu`
writes one a variant). Anything else in the file (the program's own output, ncu's `==PROF==`
lines) is skipped. Printed: a markdown table of every numeric metric whose value in some
variant differs from the first file's by at least `--min-change` of it (or appears in one
file only), in the first file's order, and the kernel durations on top. Why a variant is
faster or slower then reads off the memory and stall sections (the wavefronts, sectors and
stall reasons that changed) instead of being guessed from its code.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path
from typing import Sequence

Key = tuple[str, str, str]  # section, metric, unit

DURATION = ("GPU Speed Of Light Throughput", "Duration")


def read_details(text: str) -> dict[Key, float]:
    """The numeric metrics of the first kernel launch in `ncu --csv --page details` output."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu details table (a header row starting with \"ID\") in the file")
    body = [line for line in lines[start:] if line.startswith('"')]
    metrics: dict[Key, float] = {}
    first_id = None
    for row in csv.DictReader(io.StringIO("\n".join(body))):
        if first_id is None:
            first_id = row.get("ID")
        if row.get("ID") != first_id or not row.get("Metric Name"):
            continue
        value = _number(row.get("Metric Value", ""))
        if value is not None:
            key = (row.get("Section Name", ""), row["Metric Name"], row.get("Metric Unit", ""))
            metrics.setdefault(key, value)
    if not metrics:
        raise ValueError("the ncu details table holds no numeric metric")
    return metrics


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def changed(tables: Sequence[dict[Key, float]], min_change: float) -> list[Key]:
    """The metrics missing from some table or whose value in some table differs from the first's
    by more than min_change of it, in the first table's order, then the others' new ones."""
    out = []
    for key in dict.fromkeys(k for t in tables for k in t):
        base, *others = [t.get(key) for t in tables]
        if base is None or any(v is None or abs(v - base) > min_change * abs(base) for v in others):
            out.append(key)
    return out


def markdown(names: Sequence[str], tables: Sequence[dict[Key, float]], keys: Sequence[Key]) -> str:
    def cell(v: float | None, base: float | None) -> str:  # a variant's value, with its ratio to base's
        if v is None:
            return "-"
        return f"{v:.4g}" + (f" ({v / base:.2f}x)" if base else "")

    rows = ["| section | metric | unit | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    durations = [k for k in tables[0] if k[:2] == DURATION]
    for key in [*durations, *(k for k in keys if k not in durations)]:
        base = tables[0].get(key)
        cells = [cell(base, None)] + [cell(t.get(key), base) for t in tables[1:]]
        rows.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def compare(paths: Sequence[Path], min_change: float = 0.05) -> str:
    tables = [read_details(Path(p).read_text(errors="replace")) for p in paths]
    names = [Path(p).stem for p in paths]
    return markdown(names, tables, changed(tables, min_change))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", type=Path, help="ncu --csv --page details output, the base first")
    ap.add_argument("--min-change", type=float, default=0.05, help="relative change that makes a metric listed")
    args = ap.parse_args(argv)
    if len(args.csv) < 2:
        ap.error("give the base and at least one variant")
    try:
        print(compare(args.csv, args.min_change))
    except (OSError, ValueError) as e:
        sys.exit(f"ncu_compare: {e}")


if __name__ == "__main__":
    main()
