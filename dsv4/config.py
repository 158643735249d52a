"""Model configuration: one frozen dataclass, built from a Hugging Face `config.json`.

Dimension legend (used in every einsum string and shape-suffixed name of the package):

    B batch            T query tokens       S key positions / compressed entries
    D model dim        N attention heads    H head dim (q = k = v width, 512 in FLASH)
    R rope dim         G output groups      L low rank (q_lora_rank / o_lora_rank)
    E routed experts   K routed top-k       F expert hidden
    V vocab            C hyper-connection streams
    I indexer heads    J indexer head dim   P pool slots (compressor window)

`ModelConfig` describes the architecture only. How weights are held in memory
(quantized or dequantized, which dtype) and which kernel backend runs the hot ops are
load-time choices (`dsv4.load_pretrained(..., dtype=, backend=)`), not config fields,
except `fake_quant`, which changes the model's numerics (the official QAT simulation of
the FP8 KV cache and FP4 indexer) and is therefore part of the model definition.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from typing import Any, Mapping


class ConfigError(ValueError):
    """An invalid or unsupported model configuration; the message names the field."""


class AttentionKind(enum.Enum):
    """What a layer attends to besides its sliding window."""

    SLIDING = "sliding_attention"  # window only
    CSA = "compressed_sparse_attention"  # + indexer-selected entries of an overlapped 4:1 pool
    HCA = "heavily_compressed_attention"  # + every completed entry of a 128:1 pool


class RoutingKind(enum.Enum):
    """How a MoE layer picks its experts."""

    HASH = "hash_moe"  # fixed token-id -> expert table (tid2eid)
    SCORE = "moe"  # top-k over sqrtsoftplus scores + selection bias


class ScoringFunc(enum.Enum):
    SQRTSOFTPLUS = "sqrtsoftplus"


class WeightFormat(enum.Enum):
    """On-disk format of a family of weights."""

    BF16 = "bf16"
    FP8 = "fp8"  # e4m3 with 128x128 E8M0 block scales
    FP4 = "fp4"  # e2m1 packed two per int8 with 1x32 E8M0 scales


# Legacy `compress_ratios` values -> attention kind (as in the official checkpoints).
_RATIO_TO_KIND = {0: AttentionKind.SLIDING, 4: AttentionKind.CSA, 128: AttentionKind.HCA}


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency blend used by compressed layers. No attention-scale change."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4 architecture. Field names follow the HF `config.json` where one exists."""

    vocab_size: int  # V
    hidden_size: int  # D
    num_hidden_layers: int
    num_attention_heads: int  # N
    head_dim: int  # H
    qk_rope_head_dim: int  # R: the LAST R dims of each H-wide vector are rotated
    q_lora_rank: int
    o_groups: int  # G
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[AttentionKind, ...]  # one per tower layer
    csa_ratio: int  # CSA pool width (tokens per compressed entry)
    hca_ratio: int  # HCA pool width
    index_n_heads: int  # I
    index_head_dim: int  # J
    index_topk: int  # compressed entries selected per query
    n_routed_experts: int  # E
    num_experts_per_tok: int  # K
    n_shared_experts: int
    moe_intermediate_size: int  # F
    mlp_layer_types: tuple[RoutingKind, ...]
    scoring_func: ScoringFunc = ScoringFunc.SQRTSOFTPLUS
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4  # C
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # sliding-only layers and draft stages
    compress_rope_theta: float = 160000.0  # compressed layers
    yarn: YarnScaling | None = YarnScaling()  # compressed layers only
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    # Weight formats on disk (the official release: FP8 attention/shared, FP4 experts).
    weight_format: WeightFormat = WeightFormat.BF16
    expert_format: WeightFormat = WeightFormat.BF16
    # The official reference's QAT simulation: KV dims [0, H-R) round-tripped through FP8
    # (per-64 E8M0 scales) and indexer q/keys through Hadamard + FP4 (per-32). On for real
    # checkpoints, off for parity with the Hugging Face port (which has neither).
    fake_quant: bool = False
    # Draft module (DSpark / classic MTP); 0 stages means the checkpoint has none.
    num_draft_stages: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0

    def __post_init__(self) -> None:
        self._validate()

    # ---- derived values -------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        """Non-rotated part of each head: H - R."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def group_in_dim(self) -> int:
        """Input width of one output group: N*H/G."""
        return self.num_attention_heads * self.head_dim // self.o_groups

    @property
    def draft_kind(self) -> str:
        """The checkpoint's draft module: "dspark" (stages with a block size), "mtp" (the
        preview's one classic MTP layer) or "none"."""
        if self.num_draft_stages and self.dspark_block_size:
            return "dspark"
        return "mtp" if self.num_draft_stages == 1 else "none"

    @property
    def hc_mix_dim(self) -> int:
        """Width of the mHC projection: pre (C) + post (C) + comb (C*C)."""
        return (2 + self.hc_mult) * self.hc_mult

    def compress_ratio(self, layer: int) -> int:
        """Tokens per compressed entry for `layer` (0 for sliding-only layers)."""
        kind = self.layer_types[layer]
        if kind is AttentionKind.CSA:
            return self.csa_ratio
        if kind is AttentionKind.HCA:
            return self.hca_ratio
        return 0

    def uses_yarn_rope(self, layer: int) -> bool:
        """Compressed layers use the compress theta (+ YaRN); sliding-only layers the main theta."""
        return self.layer_types[layer] is not AttentionKind.SLIDING

    # ---- validation -----------------------------------------------------------------
    def _validate(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "csa_ratio", "hca_ratio",
            "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        _require(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
        r = self.qk_rope_head_dim
        _require(r > 0 and r % 2 == 0, "qk_rope_head_dim", f"must be a positive even number, got {r}")
        _require(r <= self.head_dim, "qk_rope_head_dim", f"({r}) exceeds head_dim ({self.head_dim})")
        _require(r <= self.index_head_dim, "index_head_dim",
                 f"({self.index_head_dim}) must be >= qk_rope_head_dim ({r}): the indexer rotates its last R dims")
        _require(self.num_attention_heads % self.o_groups == 0, "o_groups",
                 f"num_attention_heads ({self.num_attention_heads}) must be divisible by o_groups ({self.o_groups})")
        _require(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
                 f"({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})")
        _require(len(self.layer_types) == self.num_hidden_layers, "layer_types",
                 f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        _require(len(self.mlp_layer_types) == self.num_hidden_layers, "mlp_layer_types",
                 f"has {len(self.mlp_layer_types)} entries for {self.num_hidden_layers} layers")
        for i, kind in enumerate(self.layer_types):
            _require(isinstance(kind, AttentionKind), "layer_types", f"entry {i} is {kind!r}, not an AttentionKind")
        for i, kind in enumerate(self.mlp_layer_types):
            _require(isinstance(kind, RoutingKind), "mlp_layer_types", f"entry {i} is {kind!r}, not a RoutingKind")
        _require(self.hc_mult >= 1, "hc_mult", "must be >= 1")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        _require(self.hc_eps >= 0, "hc_eps", "must be >= 0")
        _require(self.rope_theta > 1 and self.compress_rope_theta > 1, "rope_theta",
                 "rope_theta and compress_rope_theta must be > 1")
        for name in ("bos_token_id", "eos_token_id"):
            tid = getattr(self, name)
            _require(0 <= tid < self.vocab_size, name, f"({tid}) is outside the vocabulary [0, {self.vocab_size})")
        if self.yarn is not None:
            _require(self.yarn.factor >= 1.0, "rope_scaling.factor", f"must be >= 1, got {self.yarn.factor}")
            _require(self.yarn.original_max_position_embeddings > 0,
                     "rope_scaling.original_max_position_embeddings", "must be > 0")
        if self.fake_quant:
            # The official QAT quantizes the KV nope part in 64-wide blocks and the indexer in 32-wide
            # blocks after a Hadamard transform, which needs a power-of-two width.
            j = self.index_head_dim
            _require(j & (j - 1) == 0 and j % 32 == 0, "index_head_dim",
                     f"({j}) must be a power of two multiple of 32 when fake_quant is on")
        if self.expert_format is WeightFormat.FP4:
            for name in ("hidden_size", "moe_intermediate_size"):
                _require(getattr(self, name) % 32 == 0, name,
                         f"({getattr(self, name)}) must be a multiple of 32 for FP4 experts (1x32 scale groups)")
        for tid in self.dspark_target_layer_ids:
            _require(0 <= tid < self.num_hidden_layers, "dspark_target_layer_ids",
                     f"layer {tid} is outside [0, {self.num_hidden_layers})")
        _require(self.num_draft_stages >= 0, "num_draft_stages", "must be >= 0")

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_hf_json(cls, cfg: Mapping[str, Any] | str | os.PathLike, **overrides: Any) -> "ModelConfig":
        """Build from a DeepSeek-V4 `config.json` (a dict, a file, or a model directory).

        Accepts both the current transformers field names (`layer_types`, `compress_rates`,
        `mlp_layer_types`, `partial_rotary_factor`, nested `rope_parameters`) and the legacy
        ones the official checkpoints ship (`compress_ratios`, `compress_rate_csa/hca`,
        `num_hash_layers`, `qk_rope_head_dim`, flat `rope_scaling`). `compress_ratios` is
        longer than the tower (trailing entries belong to the draft stages) and is truncated.
        `fake_quant` follows the weight format: on for FP8 checkpoints (the official release
        ran its QAT simulation), off otherwise. `overrides` replace fields after parsing
        (e.g. `fake_quant=False` for parity with the Hugging Face port).
        """
        if not isinstance(cfg, Mapping):
            path = os.fspath(cfg)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                cfg = json.load(f)
        return cls(**{**_parse_hf(cfg), **overrides})

    def to_hf_json(self) -> dict[str, Any]:
        """The official-format `config.json` dict (legacy names, as the checkpoints ship it)."""
        ratios = [self.compress_ratio_code(i) for i in range(self.num_hidden_layers)]
        ratios += [0] * self.num_draft_stages
        n_hash = sum(1 for k in self.mlp_layer_types if k is RoutingKind.HASH)
        if tuple(self.mlp_layer_types) != _hash_prefix(n_hash, self.num_hidden_layers):
            raise ConfigError("mlp_layer_types: only a prefix of hash layers can be written as num_hash_layers")
        out: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "compress_ratios": ratios,
            "compress_rate_csa": self.csa_ratio,
            "compress_rate_hca": self.hca_ratio,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hash_layers": n_hash,
            "scoring_func": self.scoring_func.value,
            "topk_method": "noaux_tc",
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "num_nextn_predict_layers": self.num_draft_stages,
        }
        if self.yarn is not None:
            out["rope_scaling"] = {
                "type": "yarn",
                "factor": self.yarn.factor,
                "original_max_position_embeddings": self.yarn.original_max_position_embeddings,
                "beta_fast": self.yarn.beta_fast,
                "beta_slow": self.yarn.beta_slow,
            }
        if self.weight_format is WeightFormat.FP8:
            out["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128], "activation_scheme": "dynamic",
            }
        if self.expert_format is WeightFormat.FP4:
            out["expert_dtype"] = "fp4"
        if self.dspark_block_size:
            out.update(
                dspark_block_size=self.dspark_block_size,
                dspark_noise_token_id=self.dspark_noise_token_id,
                dspark_target_layer_ids=list(self.dspark_target_layer_ids),
                dspark_markov_rank=self.dspark_markov_rank,
            )
        return out

    def compress_ratio_code(self, layer: int) -> int:
        """The legacy `compress_ratios` code of a layer: 0, 4 (CSA) or 128 (HCA)."""
        return {AttentionKind.SLIDING: 0, AttentionKind.CSA: 4, AttentionKind.HCA: 128}[self.layer_types[layer]]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _require(ok: bool, field: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{field}: {msg}")


def _hash_prefix(n_hash: int, n_layers: int) -> tuple[RoutingKind, ...]:
    return tuple(RoutingKind.HASH if i < n_hash else RoutingKind.SCORE for i in range(n_layers))


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None, required: bool = False) -> Any:
    for name in names:
        if name in cfg and cfg[name] is not None:
            return cfg[name]
    if required:
        raise ConfigError(f"{names[0]}: missing from config.json")
    return default


def _kinds_from_ratios(ratios: list[Any], n_layers: int) -> tuple[list[AttentionKind], int | None]:
    """Attention kinds from legacy `compress_ratios`, and a literal HCA ratio if one is used.

    Entries: 0 = sliding only, 4 = CSA, 128 = HCA (the rate may then come from
    `compress_rate_hca`). The reference reads any other positive entry r as an HCA layer
    pooling r tokens (small rates make tiny test models); one such rate per model.
    """
    bad = [r for r in ratios if not isinstance(r, int) or isinstance(r, bool) or r < 0]
    if bad:
        raise ConfigError(f"compress_ratios: entries must be non-negative integers, found {bad[:3]}")
    extra = ratios[n_layers:]
    if any(extra):  # trailing entries belong to the draft stages, which never compress
        raise ConfigError(f"compress_ratios: draft-stage entries after layer {n_layers} must be 0, got {extra}")
    literal = sorted({r for r in ratios[:n_layers] if r not in _RATIO_TO_KIND})
    if len(literal) > 1:
        raise ConfigError(f"compress_ratios: one HCA ratio per model, found {literal}")
    if literal and 128 in ratios[:n_layers]:
        raise ConfigError(f"compress_ratios: mixes the HCA label 128 with a literal HCA ratio {literal[0]}")
    kinds = [_RATIO_TO_KIND.get(r, AttentionKind.HCA) for r in ratios]
    return kinds, (literal[0] if literal else None)


def _parse_rope(cfg: Mapping[str, Any]) -> tuple[float, float, YarnScaling | None]:
    """(main theta, compress theta, YaRN) from flat legacy keys or nested `rope_parameters`."""
    rope_theta = float(_get(cfg, "rope_theta", default=10000.0))
    compress_theta = float(_get(cfg, "compress_rope_theta", default=160000.0))
    yarn = None
    rp = cfg.get("rope_parameters")
    if isinstance(rp, Mapping) and isinstance(rp.get("compress"), Mapping):
        rope_theta = float(rp.get("main", {}).get("rope_theta", rope_theta))
        compress_theta = float(rp["compress"].get("rope_theta", compress_theta))
        scaling = rp["compress"]
    else:
        scaling = cfg.get("rope_scaling") or (rp if isinstance(rp, Mapping) else None)
    if scaling:
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        if rtype == "yarn":
            af = scaling.get("attention_factor")
            if af not in (None, 1.0, 1):
                raise ConfigError(f"rope_scaling.attention_factor: DeepSeek-V4 uses no YaRN mscale, got {af}")
            for key in ("factor", "original_max_position_embeddings"):
                if key not in scaling:
                    raise ConfigError(f"rope_scaling.{key}: missing from the YaRN block")
            yarn = YarnScaling(
                factor=float(scaling["factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                beta_fast=float(scaling.get("beta_fast") or 32.0),
                beta_slow=float(scaling.get("beta_slow") or 1.0),
            )
        elif rtype != "default":
            raise ConfigError(f"rope_scaling.type: only 'yarn' is supported, got {rtype!r}")
    return rope_theta, compress_theta, yarn


def _parse_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Map a `config.json` dict (current or legacy names) onto ModelConfig fields."""
    model_type = cfg.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"model_type: expected 'deepseek_v4', got {model_type!r}")
    n_layers = int(_get(cfg, "num_hidden_layers", "n_layers", required=True))
    head_dim = int(_get(cfg, "head_dim", required=True))

    # Attention kinds: explicit layer_types > legacy compress_ratios. There is deliberately
    # no default pattern: transformers' default is V4-Pro's, not Flash's.
    literal_hca = None
    if cfg.get("layer_types") is not None:
        try:
            kinds = [AttentionKind(t) for t in cfg["layer_types"]]
        except ValueError as e:
            raise ConfigError(f"layer_types: {e}") from None
    elif cfg.get("compress_ratios") is not None:
        kinds, literal_hca = _kinds_from_ratios(list(cfg["compress_ratios"]), n_layers)
    else:
        raise ConfigError("layer_types: config.json has neither layer_types nor compress_ratios")
    if len(kinds) < n_layers:
        raise ConfigError(f"layer_types: {len(kinds)} entries for num_hidden_layers={n_layers}")
    kinds = kinds[:n_layers]

    rates = dict(cfg.get("compress_rates") or {})
    csa_ratio = int(_get(cfg, "compress_rate_csa", default=rates.get(AttentionKind.CSA.value, 4)))
    hca_ratio = int(_get(cfg, "compress_rate_hca", default=rates.get(AttentionKind.HCA.value, 128)))
    if cfg.get("layer_types") is None and literal_hca is not None:
        explicit = _get(cfg, "compress_rate_hca", default=rates.get(AttentionKind.HCA.value))
        if explicit is not None and int(explicit) != literal_hca:
            raise ConfigError(f"compress_ratios: HCA ratio {literal_hca} contradicts compress_rate_hca {explicit}")
        hca_ratio = literal_hca

    if cfg.get("mlp_layer_types") is not None:
        try:
            routing = [RoutingKind(t) for t in cfg["mlp_layer_types"]][:n_layers]
        except ValueError as e:
            raise ConfigError(f"mlp_layer_types: {e}") from None
    else:
        n_hash = int(_get(cfg, "num_hash_layers", "n_hash_layers", default=3))
        routing = list(_hash_prefix(n_hash, n_layers))

    if cfg.get("qk_rope_head_dim") is not None:
        rope_dim = int(cfg["qk_rope_head_dim"])
    elif cfg.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * float(cfg["partial_rotary_factor"]))
    else:
        rope_dim = 64

    rope_theta, compress_theta, yarn = _parse_rope(cfg)

    n_kv = int(cfg.get("num_key_value_heads", 1))
    if n_kv != 1:
        raise ConfigError(f"num_key_value_heads: DeepSeek-V4 has one shared K=V latent, got {n_kv}")
    if cfg.get("tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings: DeepSeek-V4's head is untied")
    try:
        scoring = ScoringFunc(cfg.get("scoring_func", "sqrtsoftplus"))
    except ValueError:
        raise ConfigError(f"scoring_func: only 'sqrtsoftplus' is supported, got {cfg.get('scoring_func')!r}") from None
    n_shared = int(cfg.get("n_shared_experts", 1))
    if n_shared != 1:
        raise ConfigError(f"n_shared_experts: exactly one shared expert is supported, got {n_shared}")

    qc = cfg.get("quantization_config") or {}
    weight_format = WeightFormat.FP8 if qc.get("quant_method") == "fp8" else WeightFormat.BF16
    expert_dtype = cfg.get("expert_dtype", qc.get("expert_dtype"))
    expert_format = WeightFormat.FP4 if expert_dtype == "fp4" else weight_format

    block = int(cfg.get("dspark_block_size") or 0)
    target_ids = tuple(int(i) for i in (cfg.get("dspark_target_layer_ids") or ()))
    if block:
        n_draft = len(target_ids) or int(_get(cfg, "num_nextn_predict_layers", default=1))
    else:
        n_draft = int(_get(cfg, "num_nextn_predict_layers", "n_mtp_layers", default=0))

    eos = cfg.get("eos_token_id", 1)
    if isinstance(eos, (list, tuple)):
        eos = eos[0]
    return dict(
        vocab_size=int(_get(cfg, "vocab_size", required=True)),
        hidden_size=int(_get(cfg, "hidden_size", "dim", required=True)),
        num_hidden_layers=n_layers,
        num_attention_heads=int(_get(cfg, "num_attention_heads", "n_heads", required=True)),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=int(_get(cfg, "q_lora_rank", required=True)),
        o_groups=int(_get(cfg, "o_groups", required=True)),
        o_lora_rank=int(_get(cfg, "o_lora_rank", required=True)),
        sliding_window=int(_get(cfg, "sliding_window", "window_size", required=True)),
        layer_types=tuple(kinds),
        csa_ratio=csa_ratio,
        hca_ratio=hca_ratio,
        index_n_heads=int(_get(cfg, "index_n_heads", default=64)),
        index_head_dim=int(_get(cfg, "index_head_dim", default=128)),
        index_topk=int(_get(cfg, "index_topk", default=512)),
        n_routed_experts=int(_get(cfg, "n_routed_experts", "num_local_experts", required=True)),
        num_experts_per_tok=int(_get(cfg, "num_experts_per_tok", "n_activated_experts", required=True)),
        n_shared_experts=n_shared,
        moe_intermediate_size=int(_get(cfg, "moe_intermediate_size", "moe_inter_dim", "intermediate_size",
                                       required=True)),
        mlp_layer_types=tuple(routing),
        scoring_func=scoring,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", "route_scale", default=1.5)),
        swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
        hc_mult=int(cfg.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(cfg.get("hc_eps", 1e-6)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", "norm_eps", default=1e-6)),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        yarn=yarn,
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", "max_seq_len", default=1048576)),
        bos_token_id=int(cfg.get("bos_token_id", 0) or 0),
        eos_token_id=int(eos if eos is not None else 1),
        weight_format=weight_format,
        expert_format=expert_format,
        fake_quant=weight_format is WeightFormat.FP8,
        num_draft_stages=n_draft,
        dspark_block_size=block,
        dspark_noise_token_id=int(cfg.get("dspark_noise_token_id") or 0),
        dspark_target_layer_ids=target_ids,
        dspark_markov_rank=int(cfg.get("dspark_markov_rank") or 0),
    )


def _flash() -> ModelConfig:
    kinds = [AttentionKind.SLIDING] * 2 + [
        AttentionKind.CSA if i % 2 == 0 else AttentionKind.HCA for i in range(2, 43)
    ]
    return ModelConfig(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        sliding_window=128, layer_types=tuple(kinds), csa_ratio=4, hca_ratio=128,
        index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256,
        num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2048,
        mlp_layer_types=_hash_prefix(3, 43), weight_format=WeightFormat.FP8,
        expert_format=WeightFormat.FP4, fake_quant=True, num_draft_stages=3,
        dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=(40, 41, 42),
        dspark_markov_rank=256,
    )


def _tiny() -> ModelConfig:
    # Small but structurally complete: both routing kinds, all three attention kinds, a window
    # and an HCA ratio small enough that short sequences wrap and emit entries, awkward dims.
    kinds = (AttentionKind.SLIDING, AttentionKind.CSA, AttentionKind.HCA, AttentionKind.CSA, AttentionKind.HCA)
    return ModelConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=5, num_attention_heads=6, head_dim=40,
        qk_rope_head_dim=8, q_lora_rank=48, o_groups=3, o_lora_rank=24, sliding_window=16,
        layer_types=kinds, csa_ratio=4, hca_ratio=16, index_n_heads=5, index_head_dim=32,
        index_topk=4, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        moe_intermediate_size=32, mlp_layer_types=_hash_prefix(2, 5),
        yarn=YarnScaling(factor=4.0, original_max_position_embeddings=64),
        max_position_embeddings=4096,
    )


FLASH: ModelConfig = _flash()
"""DeepSeek-V4-Flash (0731): the real dimensions, FP8/FP4 weights, fake quant on, 3 DSpark stages."""

TINY: ModelConfig = _tiny()
"""A few-layer model with every structural feature, for tests and the embedded demo model."""


def rope_frequencies(theta: float, rope_dim: int, yarn: YarnScaling | None) -> list[float]:
    """Per-pair angular frequencies f_i (i < R/2), with the YaRN blend when given.

    Computed in Python float64 here and cast to f32 by the caller; the HF port and the
    reference compute `theta ** (2i/R)` in f32, which differs by < 1 f32 ulp.
    """
    half = rope_dim // 2
    freqs = [1.0 / theta ** (2 * i / rope_dim) for i in range(half)]
    if yarn is None:
        return freqs

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as the reference does
    out = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = 1.0 - ramp
        out.append(f / yarn.factor * (1.0 - keep) + f * keep)
    return out
