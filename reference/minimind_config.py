"""Configuration of the MiniMind family (both generations), kept free of torch so that the
ONNX Runtime side (manifest, runtime) can read it without importing PyTorch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from reference.configs import JsonConfig, check_field_types, check_positive_ints, check_token_ids
from reference.errors import ConfigError

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
MOE_IMPLEMENTATIONS = ("dense", "sparse")
# Defaults that differ between the generations: field -> {version: value}.
GENERATION_DEFAULTS = {
    "num_key_value_heads": {3: 4, 2: 2},
    "rms_norm_eps": {3: 1e-6, 2: 1e-5},
    "num_experts_per_tok": {3: 1, 2: 2},
    "n_shared_experts": {3: 0, 2: 1},
    "router_aux_loss_coef": {3: 5e-4, 2: 0.01},
    "seq_aux": {3: False, 2: True},
}


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (upstream `rope_scaling` when `inference_rope_scaling`)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 2048
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0


@dataclass(frozen=True)
class MiniMindConfig(JsonConfig):
    version: int = 3  # 3: minimind-3, 2: MiniMind2
    vocab_size: int = 6400
    hidden_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None  # None: 4 (v3), 2 (v2)
    intermediate_size: int | None = None  # None: ceil(h * pi / 64) * 64 (v3), 64 * ceil(int(8h/3) / 64) (v2)
    max_position_embeddings: int = 32768
    rms_norm_eps: float | None = None  # None: 1e-6 (v3), 1e-5 (v2)
    rope_theta: float = 1e6
    inference_rope_scaling: bool = False
    rope_scaling: YarnScaling | None = None  # None with inference_rope_scaling: YarnScaling()
    tie_word_embeddings: bool = True
    hidden_act: str = "silu"
    dropout: float = 0.0
    bos_token_id: int = 1
    eos_token_id: int = 2
    attn_implementation: str = "sdpa"
    use_moe: bool = False
    num_experts: int = 4  # routed experts
    num_experts_per_tok: int | None = None  # None: 1 (v3), 2 (v2)
    n_shared_experts: int | None = None  # None: 0 (v3), 1 (v2); added at weight 1 for every token
    moe_intermediate_size: int | None = None  # None: intermediate_size
    norm_topk_prob: bool = True
    router_aux_loss_coef: float | None = None  # None: 5e-4 (v3), aux_loss_alpha 0.01 (v2)
    seq_aux: bool | None = None  # None: False (v3), True (v2): per-sequence load in the aux loss
    moe_implementation: str = "sparse"  # "dense": every expert on every token (E times the FFN compute)

    def __post_init__(self):
        if self.version not in (2, 3):
            raise ConfigError(f"config field version must be 2 (MiniMind2) or 3 (minimind-3), got {self.version!r}")
        for name, by_version in GENERATION_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, by_version[self.version])
        if self.intermediate_size is None:
            h = self.hidden_size
            size = math.ceil(h * math.pi / 64) * 64 if self.version == 3 else 64 * ((int(h * 8 / 3) + 63) // 64)
            object.__setattr__(self, "intermediate_size", size)
        if self.moe_intermediate_size is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", _yarn_from_dict(self.rope_scaling))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ConfigError(f"config field rope_scaling must be an object of YaRN fields, got {self.rope_scaling!r}")
        if self.inference_rope_scaling and self.rope_scaling is None:
            object.__setattr__(self, "rope_scaling", YarnScaling())
        self._validate()

    def _validate(self):
        check_positive_ints(
            self,
            (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "max_position_embeddings",
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
            ),
        )
        if not isinstance(self.n_shared_experts, int) or self.n_shared_experts < 0:
            raise ConfigError(f"config field n_shared_experts must be an integer >= 0, got {self.n_shared_experts!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"config field hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config field num_attention_heads ({self.num_attention_heads}) must be divisible "
                f"by num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim (hidden_size / num_attention_heads = {self.head_dim}) must be even for RoPE")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"config field num_experts_per_tok ({self.num_experts_per_tok}) must not exceed "
                f"num_experts ({self.num_experts})"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"config field {name} must be positive and finite, got {getattr(self, name)!r}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"config field dropout must lie in [0, 1), got {self.dropout!r}")
        if not 0 <= self.router_aux_loss_coef < math.inf:
            raise ConfigError(
                f"config field router_aux_loss_coef must be finite and >= 0, got {self.router_aux_loss_coef!r}"
            )
        if self.rope_scaling is not None and not self.inference_rope_scaling:
            raise ConfigError(
                "config field rope_scaling is set but inference_rope_scaling is False; "
                "set inference_rope_scaling=True to apply it, or drop rope_scaling"
            )
        choices = {
            "hidden_act": ("silu",),
            "attn_implementation": ATTENTION_IMPLEMENTATIONS,
            "moe_implementation": MOE_IMPLEMENTATIONS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"config field {name} must be one of {allowed}, got {getattr(self, name)!r}")
        check_token_ids(self, optional=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _yarn_from_dict(data: dict) -> YarnScaling:
    fields = {f.name for f in dataclasses.fields(YarnScaling)}
    kind = data.get("type", data.get("rope_type", "yarn"))
    unknown = sorted(set(data) - fields - {"type", "rope_type"})
    if kind != "yarn" or unknown:
        raise ConfigError(
            f"config field rope_scaling must describe YaRN with fields {sorted(fields)}; "
            f"got type {kind!r} and unknown fields {unknown}"
        )
    check_field_types(YarnScaling, data, prefix="rope_scaling.")
    scaling = YarnScaling(**{k: v for k, v in data.items() if k in fields})
    for name in fields:
        if not 0 < getattr(scaling, name) < math.inf:
            raise ConfigError(
                f"config field rope_scaling.{name} must be positive and finite, got {getattr(scaling, name)!r}"
            )
    return scaling


_TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)

# Named configurations (reference/presets.py gathers every family's): the published sizes (docs/models.md, "Families
# and presets"), then tiny ones with the same structure, for tests and quick trials. Parameter counts (tied
# embeddings counted once) are asserted as integers in tests/reference_models/test_families.py.
PRESETS = {
    "minimind-3": MiniMindConfig(),  # 63,912,192
    "minimind-3-moe": MiniMindConfig(use_moe=True),  # 198,416,640: 4 experts, top-1
    "minimind2-small": MiniMindConfig(version=2, hidden_size=512),  # 25,829,888
    "minimind2": MiniMindConfig(version=2, hidden_size=768, num_hidden_layers=16),  # 104,030,976
    "minimind2-moe": MiniMindConfig(
        version=2, hidden_size=640, use_moe=True
    ),  # 145,029,760: 4 routed + 1 shared, top-2
    "minimind-3-tiny": MiniMindConfig(num_key_value_heads=2, **_TINY),
    "minimind-3-moe-tiny": MiniMindConfig(num_key_value_heads=2, use_moe=True, **_TINY),
    "minimind2-tiny": MiniMindConfig(version=2, **_TINY),
    "minimind2-moe-tiny": MiniMindConfig(version=2, use_moe=True, **_TINY),
    "minimind-3-yarn-tiny": MiniMindConfig(
        num_key_value_heads=2,
        inference_rope_scaling=True,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16),
        **_TINY,
    ),
}
