"""Test-wide settings: strict f32 matmuls (GPUs otherwise use TF32 for f32 dots), 8 CPU devices
for the sharding tests (set before any backend starts), LLVM -O0 on CPU-only machines and no
GEMM autotuning on GPU ones, a persistent XLA compilation cache shared by the whole run, the GPU
marker, --update-golden.

The compilation cache: many tests build a runner for the same tiny model, geometry and
buckets, and each new runner traces a new `jax.jit`, so without a persistent cache every
one of them compiles the same programs again. The run's first process makes a fresh
directory (nothing from an earlier run or another checkout can be served), names it in
the environment, so pytest-xdist workers and the servers and scripts that tests start as
subprocesses use the same one, and removes it at the end. `--compilation-cache-dir DIR`
(or JAX_COMPILATION_CACHE_DIR already set) keeps one across runs, a developer's loop; the
cache is keyed by the whole program, so an entry can only serve the program it was compiled
from. `--no-compilation-cache` turns it off.
"""

import importlib.util
import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_num_cpu_devices", 8)


def _cuda_plugin_installed() -> bool:
    return any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None for v in (12, 13))


# Compile for the tests' programs, which run for milliseconds and compile for seconds. Read
# when the backend starts, so set before any test touches a device; subprocesses inherit them.
if not _cuda_plugin_installed():
    # CPU-only machines (CI): XLA's LLVM back end at -O0 cuts the suite's CPU time by about a
    # third. Results may move by an ulp (no FMA contraction), and every comparison in the suite
    # is between programs compiled alike or within a tolerance.
    _COMPILE_FLAGS = "--xla_backend_optimization_level=0"
else:
    # GPU machines: no GEMM autotuning. XLA otherwise compiles and times several GEMM
    # configurations for every matmul, most of a tiny program's compile time, and on a GPU
    # shared by all the test workers the timings it picks by are noise. -O2 stays (PTX).
    _COMPILE_FLAGS = "--xla_gpu_autotune_level=0"
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), _COMPILE_FLAGS]))

_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"  # also read by jax in every subprocess a test starts
_OWNED_CACHE = None  # the directory this process made (removed at exit)


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the current code")
    parser.addoption("--compilation-cache-dir", default=None,
                     help="persistent XLA compilation cache for this run (default: a fresh temporary directory)")
    parser.addoption("--no-compilation-cache", action="store_true", help="compile every program from scratch")
    parser.addoption("--soak-seconds", type=float, default=0.0,
                     help="run the serving soak test (tests/test_soak.py) for this long; 0 (default): skip it")


def pytest_configure(config):
    global _OWNED_CACHE
    if config.getoption("no_compilation_cache"):
        return
    directory = config.getoption("compilation_cache_dir") or os.environ.get(_CACHE_ENV)
    if not directory:  # the controller (or a plain run): xdist workers inherit the variable
        directory = _OWNED_CACHE = tempfile.mkdtemp(prefix="dsv4-test-xla-cache-")
    os.environ[_CACHE_ENV] = directory
    # Cache every program, however small or quick: the tiny models' programs are both.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if _OWNED_CACHE is not None:
        shutil.rmtree(_OWNED_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
