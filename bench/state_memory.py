"""FLASH decode-state memory: bytes per token and per request in each storage format, and an
example plan for one H200. Abstract only (`jax.eval_shape`): allocates nothing, needs no GPU.

    python -m bench.state_memory
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from checkpoints.inventory import abstract_model
from dsv4.config import FLASH
from dsv4.memory import StateCosts, param_bytes, plan_memory, state_costs
from dsv4.state import IndexKeyFormat, KVFormat, StateGeometry, default_page_tokens

# The spec's per-token figures: bf16 (256 + 64) B x 21 CSA + 8 B x 20 HCA, and the packed
# layout (FP8 KV entries of 583 B, FP4 indexer keys of 68 B).
SPEC_BF16_BYTES_PER_TOKEN = 6880
SPEC_PACKED_BYTES_PER_TOKEN = 3509

FORMATS = {
    "dense bf16": (KVFormat.DENSE, IndexKeyFormat.DENSE, SPEC_BF16_BYTES_PER_TOKEN),
    "FP8 KV + FP4 index": (KVFormat.FP8, IndexKeyFormat.FP4, SPEC_PACKED_BYTES_PER_TOKEN),
    "FP8 KV + FP8 index": (KVFormat.FP8, IndexKeyFormat.FP8, SPEC_PACKED_BYTES_PER_TOKEN),
}

H200_BYTES = 141 * 10**9  # usable bytes of one H200, as a number (no device is queried)
PARAM_SHARDS = 4  # ~156 GB of FLASH parameters do not fit one 141 GB GPU


def report_costs(name: str, costs: StateCosts, spec_per_token: int) -> str:
    lines = [f"{name}: {costs.bytes_per_token:,.3f} B/token ({costs.bytes_per_token / spec_per_token:.4f} x spec "
             f"{spec_per_token:,}), {costs.bytes_per_page:,} B/page of {costs.page_tokens} tokens, "
             f"{costs.bytes_per_slot:,} B/slot ({costs.bytes_per_slot / 2**20:.2f} MiB)"]
    lines += [f"    per token  {k:<28} {v:10,.3f} B" for k, v in costs.pool_bytes_per_token().items()]
    lines += [f"    per slot   {k:<28} {v:10,} B" for k, v in costs.slot_pools.items()]
    return "\n".join(lines)


def main() -> None:
    page_tokens = default_page_tokens(FLASH)
    for name, (kv, index, spec) in FORMATS.items():
        template = StateGeometry(num_slots=1, num_pages=1, page_tokens=page_tokens, max_pages_per_seq=1,
                                 kv_format=kv, index_format=index, dtype=jnp.bfloat16)
        print(report_costs(name, state_costs(FLASH, template), spec))
        print()

    _, params = nnx.split(abstract_model(FLASH, jnp.bfloat16))
    total = param_bytes(params)
    print(f"FLASH parameters (tower + DSpark stages, abstract): {total / 1e9:.2f} GB; "
          f"split over {PARAM_SHARDS} GPUs: {total / PARAM_SHARDS / 1e9:.2f} GB per device")
    # 64 x 64K fits with room to spare; 64 x 1M shows where memory, not max_num_seqs, binds.
    for name, max_model_len in (("dense bf16", 65536), ("FP8 KV + FP4 index", 65536),
                                ("dense bf16", FLASH.max_position_embeddings),
                                ("FP8 KV + FP4 index", FLASH.max_position_embeddings)):
        kv, index, _ = FORMATS[name]
        plan = plan_memory(FLASH, device_bytes=H200_BYTES, memory_fraction=0.9,
                           param_bytes=total // PARAM_SHARDS, max_num_seqs=64, max_model_len=max_model_len,
                           kv_format=kv, index_format=index)
        print()
        print(f"one H200 ({H200_BYTES / 1e9:.0f} GB), params / {PARAM_SHARDS}, {name}, "
              f"max_model_len {max_model_len:,}:")
        print(plan.summary())


if __name__ == "__main__":
    main()
