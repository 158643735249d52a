"""Compare FFI kernel variants in one run: the working tree's kernels and each patch applied to a
copy of them, built side by side, then tested and benchmarked in turn.

    python -m bench.kernel_variants [PATCH ...] [--ops sparse_attention] [--decode 32,64]
        [--prefill 65536] [--tests "attention or split"] [--out DIR]

Each variant is `ffi_kernels/` copied to `var/<name>/` (`base` unchanged, else the patch's file
name) with its patch applied (`git apply --directory`; `A.patch+B.patch` applies both in turn,
a variant named `A_plus_B`, so that independent patches combine without a patch of both),
configured and built by CMake for `--arch` in parallel with the others, and installed next to
its copy. Then, for base, each patch, and base again: its libraries are copied into
`ffi_kernels/` (`PYTHONPATH` cannot select them: `python -m` puts the working directory first
on `sys.path`), the `--tests`
subset of `tests/test_ffi_kernels.py` runs once per variant (`--untested-base`: the patched
ones only; `--untested-diagnostics`: none whose name contains "diag"; a variant that fails is
not benchmarked), and `bench.ffi_bench --timing profile`
measures `--ops`. Printed: each case's time per variant and its ratio to base (the mean of
base's two runs, which bracket the others so that drift shows). With `--ncu REGEX`, each
variant's first launch of a kernel matching REGEX in an `--ncu-prefill` chunk is then
profiled (`ncu --set full`, or `--ncu-sections` only: `--set full` has ended in a segmentation
fault of the profiled process on some kernels, where `WarpStateStats,SourceCounters` ran) and
the metrics that moved against base are printed (`bench.ncu_compare`); each variant's details
page and SASS source page (with per-instruction stall samples: `python -m bench.sass_stalls
FILE`) are written to `--out` as `<name>_ncu.csv` and `<name>_sass.csv`. The working tree's own
libraries are put back at the end. With `--archive FILE.tar.gz`, everything written to `--out`
is also packed into that one file (the device tool returns at most 8 files a call: with `--out`
in /tmp and the archive in $OUT, no result is left behind).

On the H200 machine (see README's developer notes; carry `third_party` for the CuTe headers):

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 -m bench.kernel_variants \\
        bench/experiments/2026-12-02_attention_alternating_tiles.patch --ops sparse_attention \\
        --tests "attention or split or tensor_core or octaves or unsplit" --test-workers 14 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench import ncu_compare

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "ffi_kernels"
VARIANTS = ROOT / "var"


def log(msg: str) -> None:
    print(f"[kernel_variants {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def libraries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.so"))


def variant_patches(spec: str) -> tuple[str, list[Path]]:
    """A variant's name and patches from its command-line spec: one patch file, or several joined
    by '+' (applied in that order)."""
    patches = [Path(part) for part in spec.split("+")]
    # ('+' is not in the name: the device tool returns files named in letters, digits, '.', '_', '-')
    return "_plus_".join(p.name.removesuffix(".patch") for p in patches), patches


def prepare(name: str, patches: list[Path]) -> Path:
    """var/<name>/ffi_kernels: a copy of the kernels' sources, with `patches` applied in turn."""
    home = VARIANTS / name
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(KERNELS, home / "ffi_kernels", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for patch in patches:
        rel = home.relative_to(ROOT)
        done = subprocess.run(["git", "apply", f"--directory={rel}", str(patch.resolve())], cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{patch} does not apply to the working tree's kernels (after the variant's earlier "
                     f"patches):\n{done.stderr}")
    return home


def start_build(home: Path, args: argparse.Namespace, jobs: int) -> subprocess.Popen:
    build = Path(args.build_root) / home.name
    shutil.rmtree(build, ignore_errors=True)
    defines = [f"-DPython3_EXECUTABLE={sys.executable}", f"-DDSV4_CUDA_ARCHITECTURES={args.arch}",
               f"-DDSV4_CUTLASS_INCLUDE_DIR={Path(args.cutlass).resolve()}"]
    if args.cpu_only:
        defines.append("-DDSV4_BUILD_CUDA=OFF")
    script = " && ".join([
        " ".join(["cmake", "-S", str(home / "ffi_kernels"), "-B", str(build), "-G", "Ninja", *defines]),
        f"cmake --build {build} -j {jobs}",
        f"cmake --install {build} --prefix {home}",
    ])
    with open(home / "build.log", "w") as log_file:  # (the child keeps its own descriptor)
        return subprocess.Popen(["bash", "-c", script], stdout=log_file, stderr=subprocess.STDOUT)


def use(source: Path) -> None:
    """Puts the libraries in `source` where the loader looks first, in place of those there."""
    for lib in libraries(KERNELS):
        lib.unlink()
    for lib in libraries(source):
        shutil.copy2(lib, KERNELS / lib.name)


def run_tests(expr: str, workers: int, timeout: int) -> bool:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ffi_kernels.py", "-k", expr]
    if workers:
        cmd += ["-n", str(workers)]  # pytest-xdist
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"tests did not finish in {timeout} s (a hang?)")
        return False
    tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    log(f"tests: {tail[0]}")
    if done.returncode != 0:
        print(done.stdout[-4000:], flush=True)
    return done.returncode == 0


def run_bench(args: argparse.Namespace, json_path: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bench.ffi_bench", "--decode", args.decode, "--prefill", args.prefill, "--ops",
           args.ops, "--backends", "ffi", "--timing", args.timing, "--steps", str(args.steps), "--warmup", "2",
           "--json", str(json_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.bench_timeout)
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-4000:], flush=True)
        return {}
    results = json.loads(json_path.read_text())["results"]
    return {f"{r['op']} {r['case']}": r["ffi"]["ms"] for r in results if r.get("ffi", {}).get("ms") is not None}


def ncu_sections(spec: str) -> list[str]:
    """ncu's metric-selection arguments for --ncu-sections: `full` is `--set full`, else one
    `--section` per comma-separated name."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise ValueError("--ncu-sections: give `full` or section names, e.g. WarpStateStats,SourceCounters")
    if names == ["full"]:
        return ["--set", "full"]
    return [arg for name in names for arg in ("--section", name)]


def ncu_capture_command(args: argparse.Namespace, report: Path) -> list[str]:
    """The profile of the first launch matching --ncu in an --ncu-prefill chunk, into `report`."""
    return [args.ncu_path, *ncu_sections(args.ncu_sections), "--clock-control", "none", "-f", "-o", str(report),
            "-k", f"regex:{args.ncu}", "-c", "1", sys.executable, "-m", "bench.ffi_bench", "--decode", "none",
            "--prefill", str(args.ncu_prefill), "--ops", args.ops, "--backends", "ffi", "--steps", "1", "--warmup",
            "0", "--inner", "1"]


def run_ncu(args: argparse.Namespace, name: str) -> Path | None:
    """Profiles the variant in place (ncu_capture_command), exports its details page to
    `<name>_ncu.csv` and its SASS source page to `<name>_sass.csv` in --out, and drops the report
    (hundreds of MB). Returns the details CSV, or None when there is none."""
    report = args.out / f"{name}.ncu-rep"  # (ncu adds the suffix to the -o path)
    try:
        done = subprocess.run(ncu_capture_command(args, args.out / name), cwd=ROOT, capture_output=True, text=True,
                              timeout=args.bench_timeout)
        if done.returncode != 0:  # (ncu has ended in a segmentation fault on some builds)
            log(f"{name}: ncu exited with {done.returncode}: {done.stderr[-1000:]}")
        if not report.is_file():
            return None
        pages = {"ncu": ["--page", "details"], "sass": ["--page", "source", "--print-source", "sass"]}
        for suffix, page in pages.items():
            exported = subprocess.run([args.ncu_path, "-i", str(report), "--csv", *page], capture_output=True,
                                      text=True, timeout=args.bench_timeout)
            (args.out / f"{name}_{suffix}.csv").write_text(exported.stdout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"{name}: ncu did not run: {e}")
        return None
    finally:
        report.unlink(missing_ok=True)
    details = args.out / f"{name}_ncu.csv"
    return details if '"ID"' in details.read_text() else None


def archive_outputs(out: Path, archive: Path) -> list[str]:
    """Every file under `out` packed into the gzip tar `archive` (paths relative to `out`, sorted);
    returns the member names."""
    itself = archive.resolve()
    names = sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.is_file() and f.resolve() != itself)
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for name in names:
            tar.add(out / name, arcname=name)
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("patches", nargs="*", help="patches to the working tree (git diff format); A.patch+B.patch "
                                               "is one variant of both")
    ap.add_argument("--ops", default="sparse_attention,indexer_topk")
    ap.add_argument("--decode", default="1,8,32,64")
    ap.add_argument("--prefill", default="65536")
    ap.add_argument("--timing", default="profile", help="bench.ffi_bench --timing (profile needs a GPU)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tests", default="", help="pytest -k expression run on each variant before its benchmark")
    ap.add_argument("--untested-base", action="store_true",
                    help="run --tests on the patched variants only (the working tree's kernels passed them already)")
    ap.add_argument("--untested-diagnostics", action="store_true",
                    help="run --tests on no patch whose file name contains 'diag' (diagnostic builds, wrong on "
                         "purpose), so that they are benchmarked beside tested variants in one run")
    ap.add_argument("--test-workers", type=int, default=0, help="pytest-xdist workers (0: none)")
    ap.add_argument("--test-timeout", type=int, default=300)
    ap.add_argument("--bench-timeout", type=int, default=300)
    ap.add_argument("--arch", default="90a")
    ap.add_argument("--cutlass", default=str(ROOT / "third_party/cutlass_library/source/include"))
    ap.add_argument("--build-root", default="/tmp/kernel_variants")
    ap.add_argument("--ncu", default="", metavar="REGEX",
                    help="also profile each variant's first launch of the kernels matching REGEX with Nsight Compute "
                         "on an --ncu-prefill chunk, and print the metrics that moved (bench.ncu_compare)")
    ap.add_argument("--ncu-sections", default="full",
                    help="`full` (--set full) or comma-separated ncu sections, e.g. WarpStateStats,SourceCounters")
    ap.add_argument("--ncu-prefill", type=int, default=8192)
    ap.add_argument("--ncu-path", default="/usr/local/cuda/bin/ncu")
    ap.add_argument("--cpu-only", action="store_true", help="build without CUDA (checks this script off the GPU)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "kernel_variants")
    ap.add_argument("--archive", type=Path, default=None, metavar="FILE.tar.gz",
                    help="also pack everything written to --out into this one file")
    args = ap.parse_args()
    try:
        ncu_sections(args.ncu_sections)
    except ValueError as e:
        ap.error(str(e))
    variants = dict([("base", [])] + [variant_patches(spec) for spec in args.patches])
    for patch in (p for patches in variants.values() for p in patches):
        if not patch.is_file():
            sys.exit(f"no such patch: {patch}")
    names = list(variants)
    if len(names) != 1 + len(args.patches):
        sys.exit("two variants would share a name: give the patches different file names")
    args.out.mkdir(parents=True, exist_ok=True)

    homes = {name: prepare(name, patches) for name, patches in variants.items()}
    jobs = max(1, (os.cpu_count() or 2) // len(homes))
    log(f"building {', '.join(names)} ({jobs} jobs each)")
    builds = {name: start_build(home, args, jobs) for name, home in homes.items()}
    failed = [name for name, proc in builds.items() if proc.wait() != 0]
    for name in failed:
        log(f"{name} did not build; the end of var/{name}/build.log:")
        print("\n".join((homes[name] / "build.log").read_text().splitlines()[-30:]), flush=True)
    if failed:
        sys.exit(1)

    saved = VARIANTS / "working_tree_libraries"
    shutil.rmtree(saved, ignore_errors=True)
    saved.mkdir(parents=True)
    for lib in libraries(KERNELS):
        shutil.copy2(lib, saved / lib.name)
    times: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    failing: set[str] = set()
    try:
        for k, name in enumerate([*names, "base"]):
            if name in failing:
                continue
            use(homes[name] / "ffi_kernels")
            first_run = k < len(names)
            tested = args.tests and not (name == "base" and args.untested_base) and not (
                args.untested_diagnostics and "diag" in name)
            if first_run and tested and not run_tests(args.tests, args.test_workers, args.test_timeout):
                log(f"{name}: tests failed, not benchmarked")
                failing.add(name)
                continue
            measured = run_bench(args, args.out / f"{name}_{k}.json")
            log(f"{name}: " + ", ".join(f"{case} {ms:.4g} ms" for case, ms in measured.items()))
            times[name].append(measured)
        profiled: list[Path] = []
        for name in names if args.ncu else []:
            if name not in failing:
                use(homes[name] / "ffi_kernels")
                if details := run_ncu(args, name):
                    profiled.append(details)
    finally:
        use(saved)

    cases = sorted({case for runs in times.values() for run in runs for case in run})
    base = {case: [run[case] for run in times["base"] if case in run] for case in cases}
    print("\n| case | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for case in cases:
        ref = sum(base[case]) / len(base[case]) if base[case] else None
        cells = []
        for name in names:
            runs = [run[case] for run in times[name] if case in run]
            if not runs:
                cells.append("-")
            elif name == "base":
                cells.append(" / ".join(f"{ms:.4g}" for ms in runs) + " ms")
            else:
                cells.append(f"{runs[0]:.4g} ms" + (f" ({runs[0] / ref:.3f}x)" if ref else ""))
        print(f"| {case} | " + " | ".join(cells) + " |")
    (args.out / "summary.json").write_text(json.dumps({"variants": names, "times": times}, indent=1))
    if len(profiled) > 1:
        print("\nNsight Compute, the metrics that moved by 5% or more (`python -m bench.ncu_compare` on the CSVs):\n")
        print(ncu_compare.compare(profiled))
    if args.archive:
        log(f"{len(archive_outputs(args.out, args.archive))} files packed into {args.archive}")


if __name__ == "__main__":
    main()
