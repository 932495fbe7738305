"""Named model configurations: the published MiniMind sizes and tiny ones for tests."""

from __future__ import annotations

from reference.errors import ConfigError
from reference.minimind_config import MiniMindConfig

PRESETS: dict[str, MiniMindConfig] = {
    # 63,912,192 parameters (REFERENCE-MODELS.md section 3).
    "minimind-3": MiniMindConfig(),
    # Small enough for unit tests and fast exports, with the same structure (GQA n_rep 2).
    "minimind-3-tiny": MiniMindConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    ),
}

DEFAULT_PRESET = "minimind-3"


def get_preset(name: str) -> MiniMindConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
