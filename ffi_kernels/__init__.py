"""Custom CPU/CUDA kernels called through XLA FFI.

The kernels live in two shared libraries built from `ffi_kernels/csrc` by CMake
(`ffi_kernels/CMakeLists.txt`, driven by scikit-build-core from pyproject.toml):
`libdsv4_ffi_cpu.so` always, `libdsv4_ffi_cuda.so` when nvcc was found at build time. Importing
this package loads whichever libraries were built and registers their handlers with XLA under
the target names in `TARGETS` (same name on every platform; XLA picks the handler of the
platform the program runs on). The model reaches them only through
`dsv4.ops.registry.Backend.FFI`; `require(platform)` raises `FfiNotBuiltError`, saying how to
build, when a platform's library is missing.

Nothing here reads the environment. A library is looked for next to this file (a wheel
install, or `cmake --install BUILD --prefix .` in a source checkout) and then among the files
of the installed `dsv4-jax` distribution (an editable install keeps built files there).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
from pathlib import Path

import jax

# XLA target name -> exported handler symbol without its platform suffix ("Cpu" / "Cuda").
TARGETS = {
    "dsv4_sparse_attention": "Dsv4SparseAttention",
    "dsv4_indexer_topk": "Dsv4IndexerTopk",
    "dsv4_kv_write": "Dsv4KvWrite",
    "dsv4_fp8_linear": "Dsv4Fp8Linear",
    "dsv4_moe_experts": "Dsv4MoeExperts",
    "dsv4_moe_experts_grouped": "Dsv4MoeExpertsGrouped",
}

LIBRARIES = {"cpu": "libdsv4_ffi_cpu.so", "cuda": "libdsv4_ffi_cuda.so"}
_SUFFIX = {"cpu": "Cpu", "cuda": "Cuda"}
# The platform names XLA's registry is keyed by: jax maps "cpu" (and "gpu") to these itself, but a
# lower-case "cuda" would be kept as is and never reach the CUDA plugin's handlers.
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}

BUILD_HINT = (
    "build the kernels with `pip install .` (or `pip install -e .`) from the repository root, which runs "
    "CMake on ffi_kernels/ (the CUDA library needs nvcc on PATH at build time), or in a source checkout: "
    "`cmake -S ffi_kernels -B build/ffi && cmake --build build/ffi && cmake --install build/ffi --prefix .`"
)


class FfiNotBuiltError(RuntimeError):
    """The FFI library for a platform was not built (or not found)."""


def _find_library(file_name: str) -> Path | None:
    here = Path(__file__).resolve().parent / file_name
    if here.is_file():
        return here
    try:
        files = importlib.metadata.files("dsv4-jax") or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == file_name:
            path = Path(f.locate())
            if path.is_file():
                return path
    return None


# platform -> its loaded library (ctypes), for the host-side queries below.
_LOADED: dict[str, ctypes.CDLL] = {}
# platform -> the targets its library serves (a kernel may exist on one platform before another).
_SERVED: dict[str, frozenset[str]] = {}


def _register(platform: str) -> Path | None:
    path = _find_library(LIBRARIES[platform])
    if path is None:
        return None
    lib = _LOADED[platform] = ctypes.cdll.LoadLibrary(str(path))
    served = set()
    for target, symbol in TARGETS.items():
        handler = getattr(lib, symbol + _SUFFIX[platform], None)
        if handler is None:
            continue
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform=_XLA_PLATFORM[platform])
        served.add(target)
    _SERVED[platform] = frozenset(served)
    return path


# platform -> the library registered for it (only platforms whose library was found).
REGISTERED: dict[str, Path] = {p: path for p in LIBRARIES if (path := _register(p)) is not None}


@functools.cache
def indexer_scratch_columns(platform: str, queries: int, candidates: int, heads: int, head_dim: int) -> int:
    """The columns of the [T, S] scores scratch to pass the indexer kernel for T queries of S
    candidates: S where the CUDA kernel scores in a separate pass (decode's few queries spread
    over many blocks), 0 where each query's block scores and selects on chip and writes no
    score to HBM (at any S); always 0 off CUDA (the CPU kernel keeps its own row)."""
    if platform != "cuda":
        return 0
    query = _LOADED[platform].Dsv4IndexerScratchColumns
    query.restype, query.argtypes = ctypes.c_int64, [ctypes.c_int64] * 4
    return int(query(queries, candidates, heads, head_dim))


@functools.cache
def multiprocessors(platform: str) -> int | None:
    """The current CUDA device's multiprocessor count (None off CUDA, or if it cannot be read)."""
    if platform != "cuda":
        return None
    query = _LOADED[platform].Dsv4MultiprocessorCount
    query.restype, query.argtypes = ctypes.c_int64, []
    return int(query()) or None


@functools.cache
def decoded_tables_served(platform: str) -> bool:
    """Whether sparse_attention's CUDA handler uses a decoded-table workspace on the current
    device (an SM90 GPU with the producer kernel built; see sparse_attention_cuda.cu): where it
    does not, the caller asks for none (it would be allocated and ignored). False off CUDA."""
    if platform != "cuda":
        return False
    query = _LOADED[platform].Dsv4DecodedTablesServed
    query.restype, query.argtypes = ctypes.c_int64, []
    return bool(query())


def serves(platform: str, target: str) -> bool:
    """Whether the library registered for `platform` has a kernel for `target`."""
    return target in _SERVED.get(platform, ())


def platform_of(jax_backend: str) -> str:
    """The library platform serving a JAX backend name ("cpu" -> "cpu", "gpu"/"cuda" -> "cuda")."""
    return "cuda" if jax_backend in ("gpu", "cuda") else jax_backend


def require(platform: str) -> Path:
    """The registered library of `platform` ("cpu" or "cuda"); FfiNotBuiltError if it was not built."""
    if platform not in LIBRARIES:
        raise FfiNotBuiltError(f"no FFI kernels exist for platform {platform!r} (only {sorted(LIBRARIES)})")
    if platform not in REGISTERED:
        raise FfiNotBuiltError(f"the {platform} FFI library ({LIBRARIES[platform]}) was not built: {BUILD_HINT}")
    return REGISTERED[platform]
