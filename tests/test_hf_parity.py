"""Invariant 1: full-sequence logits equal the Hugging Face transformers DeepSeek-V4 port.

The HF model (float32, every parameter and buffer randomised, see tests/hf_oracle.py) is
exported under the official checkpoint names, written as safetensors shards, loaded through
our loader and compared: max |ours - HF| <= 1e-4 * max |HF| (tests/tolerances.py).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4 port (needs 5.23.0)",
                allow_module_level=True)

import dsv4  # noqa: E402
from tests import hf_oracle  # noqa: E402
from tests.tolerances import REL  # noqa: E402


@pytest.mark.parametrize("index", range(len(hf_oracle.TINY_CONFIGS)))
def test_logits_match_hf(index, tmp_path):
    cfg_json = hf_oracle.TINY_CONFIGS[index]
    seq = hf_oracle.TINY_SEQ_LENS[index]
    hf = hf_oracle.build_hf_model(cfg_json, seed=100 + index)
    state = hf_oracle.export_official_state_dict(hf, cfg_json)
    hf_oracle.write_official_checkpoint(tmp_path, state, cfg_json, n_shards=3)

    rng = np.random.default_rng(index)
    # Two sequences: one below the window-crossing length, one well above it.
    for length in (cfg_json["sliding_window"] - 1, seq):
        ids = rng.integers(0, cfg_json["vocab_size"], size=(2, length)).astype(np.int32)
        ref = hf_oracle.hf_logits(hf, ids)
        model = dsv4.load_pretrained(tmp_path, dtype="float32")
        assert not model.config.fake_quant
        ours = np.asarray(model.logits(ids))
        err = np.abs(ours - ref).max()
        scale = np.abs(ref).max()
        print(f"config {index} len {length}: max abs err {err:.3e}, max |logit| {scale:.3f}, ratio {err / scale:.2e}")
        assert err <= REL[np.dtype(np.float32)] * scale, (err, scale)
