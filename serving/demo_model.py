"""The embedded default model: a random TINY checkpoint in the official format, and a byte tokenizer.

It has random weights, so its text is noise (and its drafts are rarely accepted); it exists
so every entry point runs on a fresh machine with no downloads, speculative decoding
included (it has a 3-stage DSpark head). Written once per directory and reused. The directory has no
tokenizer.json; its marker file `demo.json` tells `serving.tokenizer.load_tokenizer` to use the
`ByteTokenizer` (defined there, re-exported here).
"""

from __future__ import annotations

import json
import os

from dsv4.config import TINY
from serving.tokenizer import ByteTokenizer

__all__ = ["DEMO_MARKER", "DEMO_SEED", "ByteTokenizer", "ensure_demo_checkpoint"]

DEMO_SEED = 20261129
DEMO_MARKER = "demo.json"  # written last, so its presence means the checkpoint is complete
DEMO_VERSION = 2  # 2: with a DSpark draft head (--speculation dspark works on the demo)
DEMO_DRAFT_STAGES = 3


def ensure_demo_checkpoint(directory: str) -> str:
    """Write the demo checkpoint into `directory` unless it is already there; return the path."""
    from checkpoints.testing import write_tiny_checkpoint

    marker = os.path.join(directory, DEMO_MARKER)
    if _demo_version(marker) != DEMO_VERSION:
        if os.path.exists(marker):
            os.remove(marker)  # an older demo: written again, marker last
        write_tiny_checkpoint(TINY, directory, seed=DEMO_SEED, quantized=False, draft_stages=DEMO_DRAFT_STAGES)
        with open(marker, "w") as f:
            json.dump({"what": "dsv4-jax embedded demo model (random weights)", "seed": DEMO_SEED,
                       "version": DEMO_VERSION}, f)
    return directory


def _demo_version(marker: str) -> int | None:
    try:
        with open(marker) as f:
            return int(json.load(f).get("version", 1))
    except (OSError, ValueError, AttributeError):
        return None
