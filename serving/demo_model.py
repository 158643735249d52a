"""The embedded default model: a random TINY checkpoint in the official format, and a byte tokenizer.

It has random weights, so its text is noise; it exists so every entry point runs on a fresh
machine with no downloads. Written once per directory and reused.
"""

from __future__ import annotations

import json
import os

from dsv4.config import TINY

DEMO_SEED = 20261129
BYTE_OFFSET = 2  # ids 0 and 1 are bos / eos; byte b is token b + 2


def ensure_demo_checkpoint(directory: str) -> str:
    """Write the demo checkpoint into `directory` unless it is already there; return the path."""
    from checkpoints.testing import write_tiny_checkpoint

    marker = os.path.join(directory, "demo.json")
    if not os.path.exists(marker):
        write_tiny_checkpoint(TINY, directory, seed=DEMO_SEED, quantized=False)
        with open(marker, "w") as f:
            json.dump({"what": "dsv4-jax embedded demo model (random weights)", "seed": DEMO_SEED}, f)
    return directory


class ByteTokenizer:
    """UTF-8 bytes as tokens (byte b -> id b + 2); ids outside the byte range decode to nothing."""

    def __init__(self, vocab_size: int, bos_token_id: int = 0, eos_token_id: int = 1):
        if vocab_size < 256 + BYTE_OFFSET:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {256 + BYTE_OFFSET}, got {vocab_size}")
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET)
        return data.decode("utf-8", errors="replace")
