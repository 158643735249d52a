"""dsv4: DeepSeek-V4-Flash in JAX/Flax.

Public API: `load_pretrained(path, dtype=, backend=, quantized=, fake_quant=)` -> `Model`
with `Model.logits(token_ids)`; configs in `dsv4.config` (`ModelConfig`, `FLASH`, `TINY`).
Importing the package has no side effects.
"""

from dsv4.api import Model, load_pretrained
from dsv4.config import FLASH, TINY, ModelConfig

__all__ = ["FLASH", "TINY", "Model", "ModelConfig", "load_pretrained"]
