"""The real FLASH config, abstractly (jax.eval_shape): parameter count and bytes per dtype.

Expected values are hand arithmetic from the spec's tensor map (sections 7.2-7.6), not
from our inventory code; the spec's 0731 totals include the 3 DSpark stages, whose share is
computed here separately.
"""

import collections

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints.inventory import abstract_model, tower_inventory
from dsv4.config import FLASH

GB = 1e9
D, V, E, F, C = 4096, 129280, 256, 2048, 4
EXPERT_I8 = 2048 * 2048 + 2048 * 2048 + 4096 * 1024  # packed bytes of w1, w3, w2 per expert
BLOCK_FP8 = (1024 * 4096 + 32768 * 1024 + 512 * 4096 + 8192 * 4096 + 4096 * 8192 + 3 * 2048 * 4096)
INDEXER_FP8 = 8192 * 1024


@pytest.fixture(scope="module")
def flash_state():
    model = abstract_model(FLASH, jnp.bfloat16)  # ShapeDtypeStructs only: no memory
    _, state = nnx.split(model)
    leaves = [(p, v.get_value()) for p, v in nnx.to_flat_state(state)]
    assert all(not hasattr(x, "addressable_data") for _, x in leaves), "eval_shape must not allocate"
    return leaves


def test_parameter_count_is_284b(flash_state):
    count = 0
    for path, x in flash_state:
        n = int(np.prod(x.shape))
        if path[-1] == "scale":
            continue  # scales are metadata, not parameters
        count += 2 * n if x.dtype == jnp.int8 else n  # two FP4 weights per byte
    assert abs(count - 284e9) / 284e9 < 0.01, count


def test_bytes_per_dtype_match_the_spec(flash_state):
    by = collections.Counter()
    for _, x in flash_state:
        by[np.dtype(x.dtype).name] += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    # Exact tower figures from the tensor map.
    assert by["int8"] == 43 * E * EXPERT_I8
    assert by["float8_e4m3fn"] == 43 * BLOCK_FP8 + 21 * INDEXER_FP8
    assert by["int32"] == 3 * V * 6 * 4  # tid2eid: I64 on disk, int32 in memory
    # DSpark stages (3 plain blocks + stage extras), to compare with the 0731 totals of spec 7.6.
    dspark = {
        "int8": 3 * E * EXPERT_I8,
        "float8_e4m3fn": 3 * BLOCK_FP8 + D * 3 * D,
        "bfloat16": 3 * (2 * D + 1024 + 512 + E * D) * 2 + (2 * D + 2 * V * 256 + (D + 256)) * 2,
        "float32": 3 * (2 * (24 * C * D + 24 + 3) + 64 + E) * 4 + (4 * C * D + 4 + 1) * 4,
        "uint8": 3 * E * (2 * 2048 * 128 + 4096 * 64),  # FP4 expert scales dominate
    }
    spec_totals_gb = {"int8": 148.18, "float8_e4m3fn": 6.30, "bfloat16": 2.97, "float32": 0.15, "uint8": 9.26}
    for name, total in spec_totals_gb.items():
        assert round((by[name] + dspark[name]) / GB, 2) == pytest.approx(total, abs=0.011), name
    assert set(by) == {"int8", "float8_e4m3fn", "bfloat16", "float32", "uint8", "int32"}


def test_official_tensor_count():
    # 0731 has 72,317 tensors, of which 4,705 belong to the 3 DSpark stages (spec 1, 7.4).
    inventory = tower_inventory(FLASH)
    assert len(inventory) == 72317 - 4705
    assert inventory["layers.0.ffn.gate.tid2eid"].shape == (V, 6)
    assert inventory["layers.3.ffn.gate.bias"].dtype == "F32"
    assert inventory["layers.2.attn.indexer.wq_b.scale"].shape == (64, 8)
    assert inventory["layers.41.attn.compressor.ape"].shape == (128, 512)
    assert inventory["layers.42.attn.compressor.ape"].shape == (4, 1024)
    assert inventory["layers.7.ffn.experts.255.w2.weight"].shape == (4096, 1024)
    assert inventory["layers.7.ffn.experts.255.w2.scale"].shape == (4096, 64)
    assert inventory["layers.0.attn.wo_a.scale"].shape == (64, 32)
    assert "layers.1.attn.compressor.wkv.weight" not in inventory
