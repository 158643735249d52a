"""ModelConfig from official / current HF config.json field names; validation errors name the field."""

import json

import pytest

from dsv4.config import FLASH, TINY, AttentionKind, ConfigError, ModelConfig, RoutingKind, WeightFormat, rope_frequencies

# The official DeepSeek-V4-Flash-0731 config.json (legacy field names), spec 2.1.
OFFICIAL_0731 = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
    "num_hidden_layers": 43, "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0], "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "moe_intermediate_size": 2048, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    "expert_dtype": "fp4", "torch_dtype": "bfloat16", "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [40, 41, 42], "dspark_markov_rank": 256,
}


def test_official_config_equals_flash_preset():
    assert ModelConfig.from_hf_json(OFFICIAL_0731) == FLASH


def test_flash_schedule():
    kinds = FLASH.layer_types
    assert kinds[:2] == (AttentionKind.SLIDING,) * 2
    assert kinds.count(AttentionKind.CSA) == 21 and kinds.count(AttentionKind.HCA) == 20
    assert kinds[2] is AttentionKind.CSA and kinds[3] is AttentionKind.HCA and kinds[42] is AttentionKind.CSA
    assert FLASH.mlp_layer_types[:3] == (RoutingKind.HASH,) * 3 and FLASH.mlp_layer_types[3] is RoutingKind.SCORE
    assert FLASH.num_draft_stages == 3  # from dspark_target_layer_ids, not num_nextn_predict_layers (pitfall 1)
    assert FLASH.compress_ratio(3) == 128 and FLASH.compress_ratio(4) == 4 and FLASH.compress_ratio(0) == 0
    assert FLASH.weight_format is WeightFormat.FP8 and FLASH.expert_format is WeightFormat.FP4 and FLASH.fake_quant


def test_current_hf_field_names():
    cfg = dict(OFFICIAL_0731)
    for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "rope_theta",
              "compress_rope_theta"):
        cfg.pop(k)
    cfg["layer_types"] = [k.value for k in FLASH.layer_types]
    cfg["mlp_layer_types"] = [k.value for k in FLASH.mlp_layer_types]
    cfg["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    cfg["partial_rotary_factor"] = 0.125
    cfg["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                     "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1,
                     "attention_factor": 1.0},
    }
    assert ModelConfig.from_hf_json(cfg) == FLASH


def test_json_round_trip(tmp_path):
    for cfg in (FLASH, TINY):
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_json()))
        assert ModelConfig.from_hf_json(tmp_path) == cfg.replace(fake_quant=cfg.weight_format is WeightFormat.FP8)


def test_literal_hca_ratio_as_the_reference_reads_it():
    cfg = dict(OFFICIAL_0731, compress_ratios=[0, 0] + [4, 16] * 20 + [4, 0, 0, 0])
    parsed = ModelConfig.from_hf_json(cfg)
    assert parsed.hca_ratio == 16 and parsed.layer_types == FLASH.layer_types
    with pytest.raises(ConfigError, match="contradicts"):
        ModelConfig.from_hf_json(dict(cfg, compress_rate_hca=32))


def test_compress_ratios_longer_than_tower_are_truncated():
    cfg = ModelConfig.from_hf_json(OFFICIAL_0731)
    assert len(cfg.layer_types) == 43


@pytest.mark.parametrize("field,value,needle", [
    ("o_groups", 7, "o_groups"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ("num_experts_per_tok", 300, "num_experts_per_tok"),
    ("hidden_size", 0, "hidden_size"),
    ("compress_ratios", [0, 0, 5, 6] + [4] * 39, "compress_ratios"),
    ("compress_ratios", [0, 0, 5, 128] + [4] * 39, "compress_ratios"),
    ("compress_ratios", [0, -4] + [4] * 41, "compress_ratios"),
    ("num_key_value_heads", 8, "num_key_value_heads"),
    ("scoring_func", "softmax", "scoring_func"),
    ("index_head_dim", 32, "index_head_dim"),
    ("eos_token_id", 999999, "eos_token_id"),
    ("compress_ratios", [0] * 10, "layer_types"),
    ("moe_intermediate_size", 2040, "moe_intermediate_size"),  # FP4 experts need multiples of 32
])
def test_invalid_config_names_the_field(field, value, needle):
    cfg = dict(OFFICIAL_0731, **{field: value})
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_hf_json(cfg)


def test_missing_required_field():
    cfg = dict(OFFICIAL_0731)
    del cfg["q_lora_rank"]
    with pytest.raises(ConfigError, match="q_lora_rank"):
        ModelConfig.from_hf_json(cfg)


def test_no_layer_pattern_is_an_error():
    # transformers' default pattern is V4-Pro's; we never guess.
    cfg = dict(OFFICIAL_0731)
    del cfg["compress_ratios"]
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf_json(cfg)


def test_yarn_spot_values():
    # Spec 5.9: f'_0 = 1.0, f'_16 = 2.265625e-3, f'_20 = 2.9697779e-4, f'_25 = 5.3723124e-6.
    f = rope_frequencies(160000.0, 64, FLASH.yarn)
    assert f[0] == 1.0
    assert f[16] == pytest.approx(2.265625e-3, rel=1e-6)
    assert f[20] == pytest.approx(2.9697779e-4, rel=1e-6)
    assert f[25] == pytest.approx(5.3723124e-6, rel=1e-6)
    assert rope_frequencies(160000.0, 64, None)[25] == pytest.approx(5.3723124e-6 * 16, rel=1e-6)
