"""Notebook-facing API: `dsv4.load_pretrained(path, dtype=..., backend=...)` -> `Model`.

`Model.logits(token_ids)` runs the whole sequence (no cache) and returns f32 logits.
Programs are compiled per input shape and cached by `jax.jit`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.config import ModelConfig
from dsv4.model import Transformer
from dsv4.ops.registry import Backend, ops_for, parse_backend

_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "f32": jnp.float32}


class Model:
    """A loaded target tower with its op backend. Holds the parameters on device."""

    def __init__(self, module: Transformer, backend: Backend, load_summary: str = ""):
        self.config: ModelConfig = module.cfg
        self.backend = backend
        self.load_summary = load_summary  # one line: what was loaded from where
        self._graphdef, self._state = nnx.split(module)
        ops = ops_for(backend)
        graphdef = self._graphdef

        def logits_fn(state, ids):
            return nnx.merge(graphdef, state).forward(ids, ops)

        self._logits = jax.jit(logits_fn)

    @property
    def module(self) -> Transformer:
        """The NNX module (a fresh view over the same parameter arrays)."""
        return nnx.merge(self._graphdef, self._state)

    def logits(self, token_ids: Any) -> jax.Array:
        """float32 logits [B, S, V] for int token ids [B, S] at positions 0..S-1.

        Raises ValueError for a wrong rank, an empty batch or sequence, non-integer ids,
        ids outside [0, vocab_size), or a sequence longer than max_position_embeddings.
        """
        ids = self.validate_ids(token_ids)
        return self._logits(self._state, jnp.asarray(ids, jnp.int32))

    def validate_ids(self, token_ids: Any) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 2:
            raise ValueError(f"token_ids must have shape [batch, seq], got {ids.ndim} dimension(s) {ids.shape}")
        if ids.size == 0:
            raise ValueError(f"token_ids is empty (shape {ids.shape}): need at least one token per sequence")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
        v = self.config.vocab_size
        bad = np.argwhere((ids < 0) | (ids >= v))
        if bad.size:
            b, s = bad[0]
            raise ValueError(f"token id {int(ids[b, s])} at [{b}, {s}] is outside the vocabulary [0, {v})"
                             f" ({len(bad)} out-of-vocabulary id(s) in total)")
        if ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        return ids.astype(np.int32)


def load_pretrained(path: str | os.PathLike, *, dtype: str | Any | None = None, backend: str | Backend = "reference",
                    quantized: bool | None = None, fake_quant: bool | None = None) -> Model:
    """Load a DeepSeek-V4 checkpoint directory for inference: the official safetensors format
    (streamed tensor by tensor), or a directory written by `python -m checkpoints.convert`
    (Orbax, restored directly; its dtype and quantization were fixed at conversion).

    dtype: "bfloat16" or "float32": activations and dense weights. None: bfloat16 for an
        official directory, as stored for a converted one.
    backend: hot-op implementation ("reference" = pure JAX).
    quantized: keep FP8/FP4 weights as on disk and dequantise inside the matmuls (saves memory);
        False decodes them to `dtype` at load. None: False for an official directory, as stored
        for a converted one.
    fake_quant: the official KV/indexer QAT simulation; default on for FP8 checkpoints (as the
        official release) and off otherwise. Turn it off to compare with the HF port.
    """
    # Imported here: `checkpoints` depends on `dsv4`, not the other way round; this facade is
    # the one place the model package reaches the loader.
    from checkpoints.loader import load_checkpoint
    from checkpoints.orbax_io import is_converted, restore_converted

    converted = is_converted(path)
    if dtype is None:
        dtype = None if converted else jnp.bfloat16
    elif isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    backend = parse_backend(backend)
    if converted:
        # Storage (dtype, quantized) was fixed at conversion: None accepts it, a different request raises.
        module, manifest = restore_converted(path, dtype=dtype, quantized=quantized, fake_quant=fake_quant)
        summary = (f"restored {path} (converted: dtype {manifest['dtype']}, quantized={manifest['quantized']}, "
                   f"{len(manifest.get('draft_tensors', []))} draft tensors listed)")
        return Model(module, backend, summary)
    overrides = {} if fake_quant is None else {"fake_quant": fake_quant}
    module, report = load_checkpoint(path, dtype=dtype, quantized=bool(quantized), config_overrides=overrides)
    return Model(module, backend, report.summary())
