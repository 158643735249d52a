"""Notebook-facing API: `dsv4.load_pretrained(path, dtype=..., backend=...)` -> `Model`.

`Model.logits(token_ids)` runs the whole sequence (no cache) and returns f32 logits;
programs are compiled per input shape and cached by `jax.jit`.
`Model.generate(prompts, max_new_tokens, ...)` decodes on the step function with a decode
state sized for the call (kept and reused while the sizes stay the same).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.config import ModelConfig
from dsv4.generation import Generator, derive_seed
from dsv4.layers.dspark import DSparkHead
from dsv4.layers.mtp import MTPHead
from dsv4.model import Transformer
from dsv4.ops.registry import Backend, ops_for, parse_backend
from dsv4.sharding import Placement
from dsv4.state import StateGeometry, default_page_tokens
from dsv4.step import StepRunner, make_buckets

_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "f32": jnp.float32}


class Model:
    """A loaded target tower with its op backend. Holds the parameters on device."""

    def __init__(self, module: Transformer, backend: Backend, load_summary: str = "",
                 placement: Placement | None = None, draft_head: DSparkHead | MTPHead | None = None):
        self.config: ModelConfig = module.cfg
        self.draft_head = draft_head  # the draft head when loaded with draft="dspark" / "mtp" (else None)
        self.backend = backend
        self.placement = placement  # the mesh and rules the parameters are sharded by (None: one device)
        self.load_summary = load_summary  # one line: what was loaded from where
        self._graphdef, self._state = nnx.split(module)
        ops = ops_for(backend) if placement is None else placement.shard_ops(ops_for(backend))
        graphdef = self._graphdef

        def logits_fn(state, ids):
            return nnx.merge(graphdef, state).forward(ids, ops)

        self._logits = jax.jit(logits_fn)
        self._generators: dict[tuple[int, int, int], Generator] = {}

    @property
    def graphdef(self) -> nnx.GraphDef:
        """The model's structure; with `params`, what step functions take (`dsv4.step.make_step`)."""
        return self._graphdef

    @property
    def params(self) -> nnx.State:
        """The parameter arrays on device."""
        return self._state

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

    def generate(self, token_ids: Sequence[Sequence[int]] | Sequence[int] | np.ndarray, max_new_tokens: int, *,
                 temperature: float = 0.0, seed: int | None = None, stop_token_ids: Sequence[int] = (),
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                 progress: Callable[[int, int], None] | None = None) -> list[list[int]] | list[int]:
        """Continue each prompt by up to `max_new_tokens` tokens on the step function.

        token_ids: one prompt (a list of ints) or several (a list of lists or a 2-D array).
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
        seed: makes sampling reproducible; request i draws from its own stream derived from
            (seed, i), so its tokens never depend on the other prompts. None draws a seed.
        stop_token_ids: a request ends after emitting one of these (it is included).
        max_num_seqs / max_num_batched_tokens: concurrent requests and tokens per step.
        Returns the new tokens: a list for one prompt, a list of lists for several.
        """
        single = len(token_ids) > 0 and np.ndim(token_ids[0]) == 0
        prompts = [list(map(int, token_ids))] if single else [list(map(int, p)) for p in token_ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, and every prompt at least one token")
        for p in prompts:
            self.validate_ids(np.asarray([p]))
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
        needed = max(len(p) for p in prompts) + max_new_tokens
        if needed > self.config.max_position_embeddings:
            raise ValueError(f"prompt + max_new_tokens = {needed} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        # Round the state's length up to a power of two so nearby calls reuse one compiled runner.
        max_len = min(max(256, 1 << (needed - 1).bit_length()), self.config.max_position_embeddings)
        gen = self._generator(max_num_seqs, max_num_batched_tokens, max_len)
        base = int(np.random.SeedSequence().generate_state(1)[0]) if seed is None else int(seed)
        seeds = [derive_seed(base, i) for i in range(len(prompts))]
        out = gen.generate(prompts, max_new_tokens, temperature=temperature, seeds=seeds,
                           stop_token_ids=stop_token_ids, progress=progress)
        return out[0] if single else out

    def _generator(self, max_num_seqs: int, max_num_batched_tokens: int, max_len: int) -> Generator:
        key = (max_num_seqs, max_num_batched_tokens, max_len)
        if key not in self._generators:
            cfg = self.config
            page = default_page_tokens(cfg)
            per_seq = math.ceil(max_len / page)
            dtype = self._state["embed"]["weight"][...].dtype
            geometry = StateGeometry(num_slots=max_num_seqs, num_pages=max_num_seqs * per_seq, page_tokens=page,
                                     max_pages_per_seq=per_seq, max_spec_tokens=0, dtype=dtype)
            # Decode-only steps fit the small buckets; any step with a prefill chunk takes the
            # full token budget, so few programs are compiled (each on first use).
            sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_batched_tokens]
            buckets = make_buckets(max_num_batched_tokens, max_num_seqs,
                                   token_sizes=sizes + [max_num_seqs, max_num_batched_tokens])
            runner = StepRunner(self._graphdef, self._state, cfg, geometry, buckets, ops_for(self.backend),
                                placement=self.placement)
            shards = self.placement.mesh_shape.get("data", 1) if self.placement is not None else 1
            self._generators = {key: Generator(runner, max_num_batched_tokens, shards)}  # one state at a time
        return self._generators[key]

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
                    quantized: bool | None = None, fake_quant: bool | None = None,
                    placement: Placement | None = None, draft: str = "none", allow_nonfinite: bool = False) -> Model:
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
    placement: shard over a device mesh (`dsv4.sharding.Placement(make_mesh(...), deployment)`):
        every tensor goes straight onto its shards while loading, and `generate` runs the
        sharded step. None: the default device.
    draft: "dspark" or "mtp" also loads that draft head (the `mtp.*` tensors: the DSpark
        stages, or the preview's classic MTP layer) as `Model.draft_head`, for speculative
        decoding (`dsv4.spec_decode`); CheckpointError when the checkpoint holds another or
        none (`checkpoints.loader.draft_kind` tells beforehand). "none": the target only.
    allow_nonfinite: load weights that hold NaN or infinities; by default such a checkpoint is
        refused (CheckpointError naming the tensors): it would generate garbage silently.
    """
    if draft not in ("none", "dspark", "mtp"):
        raise ValueError(f"draft must be 'none', 'dspark' or 'mtp', got {draft!r}")
    # Imported here: `checkpoints` depends on `dsv4`, not the other way round; this facade is
    # the one place the model package reaches the loader.
    from checkpoints.loader import CheckpointError, load_checkpoint, load_draft
    from checkpoints.orbax_io import is_converted, restore_converted, restore_converted_draft

    converted = is_converted(path)
    sharding = placement.param_sharding if placement is not None else None
    if dtype is None:
        dtype = None if converted else jnp.bfloat16
    elif isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    backend = parse_backend(backend)
    if converted:
        # Storage (dtype, quantized) was fixed at conversion: None accepts it, a different request raises.
        module, manifest = restore_converted(path, dtype=dtype, quantized=quantized, fake_quant=fake_quant,
                                             sharding=sharding)
        head = None
        if draft != "none":
            if manifest["draft"] != draft:
                raise CheckpointError(f"{path}: asked for a {draft} draft head, the conversion kept "
                                      f"{manifest['draft']!r}")
            head = restore_converted_draft(path, dtype=dtype, quantized=quantized, fake_quant=fake_quant,
                                           sharding=sharding)
        summary = (f"restored {path} (converted: dtype {manifest['dtype']}, quantized={manifest['quantized']}, "
                   f"draft head {manifest['draft']})")
    else:
        overrides = {} if fake_quant is None else {"fake_quant": fake_quant}
        module, report = load_checkpoint(path, dtype=dtype, quantized=bool(quantized), config_overrides=overrides,
                                         sharding=sharding)
        head = None
        if draft != "none":
            if module.cfg.draft_kind != draft:
                raise CheckpointError(f"{path}: asked for a {draft} draft head, the config describes "
                                      f"{module.cfg.draft_kind!r}")
            head = load_draft(path, dtype=dtype, quantized=bool(quantized), config_overrides=overrides,
                              sharding=sharding)
        summary = report.summary()
    if not allow_nonfinite:
        _refuse_nonfinite(path, module, head)
    return Model(module, backend, summary, placement, draft_head=head)


def _refuse_nonfinite(path: str | os.PathLike, module: nnx.Module, head: nnx.Module | None) -> None:
    """CheckpointError naming every parameter (tower, then draft head) with a NaN or an Inf."""
    from checkpoints.finite import nonfinite_parameters
    from checkpoints.loader import CheckpointError

    bad = nonfinite_parameters(module) + (["draft " + n for n in nonfinite_parameters(head)] if head else [])
    if bad:
        shown = ", ".join(bad[:20]) + (f" and {len(bad) - 20} more" if len(bad) > 20 else "")
        raise CheckpointError(f"{path}: {len(bad)} parameter(s) hold NaN or infinite values: {shown}. Loading "
                              "them anyway (allow_nonfinite=True, --allow-nonfinite) generates garbage.")
