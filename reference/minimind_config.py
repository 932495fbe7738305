"""Configuration of the MiniMind family, kept free of torch so that the ONNX Runtime
side (manifest, runtime) can read it without importing PyTorch."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from reference.errors import ConfigError

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(frozen=True)
class MiniMindConfig:
    vocab_size: int = 6400
    hidden_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int | None = None  # None: ceil(hidden * pi / 64) * 64
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = True
    hidden_act: str = "silu"
    dropout: float = 0.0
    bos_token_id: int = 1
    eos_token_id: int = 2
    attn_implementation: str = "sdpa"

    def __post_init__(self):
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", math.ceil(self.hidden_size * math.pi / 64) * 64)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config field hidden_size ({self.hidden_size}) must be divisible by "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config field num_attention_heads ({self.num_attention_heads}) must be divisible "
                              f"by num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim (hidden_size / num_attention_heads = {self.head_dim}) must be even for RoPE")
        if self.hidden_act != "silu":
            raise ConfigError(f"config field hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ConfigError(f"config field attn_implementation must be one of {ATTENTION_IMPLEMENTATIONS}, "
                              f"got {self.attn_implementation!r}")
        for name in ("bos_token_id", "eos_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"config field {name} ({getattr(self, name)}) must lie in [0, vocab_size)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def n_rep(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MiniMindConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
