"""Named model configurations: the published sizes (docs/models.md, "Families and presets") and tiny ones for tests.

Parameter counts (tied embeddings counted once) are asserted as integers in tests/reference_models/test_families.py.
Names are matched case-insensitively ("MiniMind2-small" works).
"""

from __future__ import annotations

from reference.errors import ConfigError
from reference.minimind_config import MiniMindConfig, YarnScaling
from reference.teaching_gpt_config import TeachingGPTConfig

_TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)

PRESETS: dict = {
    # Published models.
    "minimind-3": MiniMindConfig(),  # 63,912,192
    "minimind-3-moe": MiniMindConfig(use_moe=True),  # 198,416,640: 4 experts, top-1
    "minimind2-small": MiniMindConfig(version=2, hidden_size=512),  # 25,829,888
    "minimind2": MiniMindConfig(version=2, hidden_size=768, num_hidden_layers=16),  # 104,030,976
    "minimind2-moe": MiniMindConfig(
        version=2, hidden_size=640, use_moe=True
    ),  # 145,029,760: 4 routed + 1 shared, top-2
    # The teaching GPT of seed 003: its smoke config (13,356,928) and its default (configs/base.json).
    "teaching-gpt-smoke": TeachingGPTConfig(n_embed=128, n_head=4, n_blocks=2, context_length=256),
    "teaching-gpt": TeachingGPTConfig(),
    # Tiny configurations with the same structure, for tests and quick trials.
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
    "teaching-gpt-tiny": TeachingGPTConfig(vocab_size=512, n_embed=64, n_head=4, n_blocks=2, context_length=64),
}

DEFAULT_PRESET = "minimind-3"


def get_preset(name: str):
    config = PRESETS.get(name.lower()) if isinstance(name, str) else None
    if config is None:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return config
