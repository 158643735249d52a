"""Streaming safetensors reader and writer that know the DeepSeek-V4 dtypes.

The official checkpoint stores E8M0 scales as `F8_E8M0`, which common readers reject; we
parse the header ourselves and memory-map the file, so each tensor is read on its own
(never a whole shard in RAM). E8M0 is returned as raw `uint8` bytes, packed FP4 as `int8`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

# safetensors dtype string -> numpy dtype used in memory.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(np.uint8),  # raw biased exponent bytes
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model asks; the message names the tensor."""


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: file, dtype string, shape and byte range in the data section."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int


def read_header(path: str) -> dict[str, TensorRef]:
    """Parse one safetensors file's header into TensorRefs (no tensor data is read)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise CheckpointError(f"{path}: implausible header length {n}")
        header = json.loads(f.read(n))
    size = os.path.getsize(path)
    refs = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = meta["dtype"]
        if dtype not in DTYPES:
            raise CheckpointError(f"{name}: unsupported safetensors dtype {dtype} in {path}")
        begin, end = (8 + n + int(o) for o in meta["data_offsets"])
        shape = tuple(int(s) for s in meta["shape"])
        expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if end - begin != expected or end > size:
            raise CheckpointError(f"{name}: byte range {end - begin} does not match {dtype}{list(shape)} in {path}")
        refs[name] = TensorRef(name, path, dtype, shape, begin, end)
    return refs


class CheckpointReader:
    """All tensors of a checkpoint directory (index file + shards, or one `model.safetensors`)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        index_path = os.path.join(self.directory, INDEX_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map: Mapping[str, str] = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(self.directory, SINGLE_FILE)):
            weight_map, files = {}, [SINGLE_FILE]
        else:
            raise CheckpointError(f"{self.directory}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        self.refs: dict[str, TensorRef] = {}
        for file in files:
            path = os.path.join(self.directory, file)
            if not os.path.exists(path):
                raise CheckpointError(f"{file}: listed in {INDEX_FILE} but missing from {self.directory}")
            self.refs.update(read_header(path))
        for name, file in weight_map.items():
            ref = self.refs.get(name)
            if ref is None or os.path.basename(ref.file) != file:
                raise CheckpointError(f"{name}: {INDEX_FILE} places it in {file}, but that shard does not hold it")
        self._maps: dict[str, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.refs

    def names(self) -> Iterator[str]:
        return iter(self.refs)

    def read(self, name: str) -> np.ndarray:
        """A copy of one tensor (only its bytes are paged in)."""
        ref = self.refs[name]
        mm = self._maps.get(ref.file)
        if mm is None:
            mm = self._maps[ref.file] = np.memmap(ref.file, dtype=np.uint8, mode="r")
        return np.array(mm[ref.begin:ref.end]).view(DTYPES[ref.dtype]).reshape(ref.shape)

    def close(self) -> None:
        self._maps.clear()


def dtype_string(arr: np.ndarray, *, e8m0: bool = False) -> str:
    """The safetensors dtype string for a numpy array (`e8m0=True` marks uint8 scale bytes)."""
    if e8m0:
        if arr.dtype != np.uint8:
            raise ValueError(f"E8M0 scales must be uint8 bytes, got {arr.dtype}")
        return "F8_E8M0"
    for name, dt in DTYPES.items():
        if name != "F8_E8M0" and arr.dtype == dt:
            return name
    raise ValueError(f"no safetensors dtype for {arr.dtype}")


def write_file(path: str, tensors: Mapping[str, np.ndarray], e8m0_names: frozenset[str] = frozenset()) -> None:
    """Write one safetensors file; names in `e8m0_names` are uint8 arrays tagged F8_E8M0."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        nbytes = arr.size * arr.dtype.itemsize
        header[name] = {"dtype": dtype_string(arr, e8m0=name in e8m0_names), "shape": list(arr.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def write_index(directory: str, weight_map: Mapping[str, str], total_size: int) -> None:
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, f,
                  indent=1)
