"""Configuration of the teaching GPT (seed 003), kept free of torch like every family's config."""

from __future__ import annotations

from dataclasses import dataclass

from reference.configs import JsonConfig, check_positive_ints, check_token_ids
from reference.errors import ConfigError


@dataclass(frozen=True)
class TeachingGPTConfig(JsonConfig):
    vocab_size: int = 50304
    n_embed: int = 1024
    n_head: int = 16
    n_blocks: int = 24
    context_length: int = 1024
    bos_token_id: int | None = None  # the series' tokenizer marks no special tokens; generation runs to length
    eos_token_id: int | None = None

    def __post_init__(self):
        check_positive_ints(self, ("vocab_size", "n_embed", "n_head", "n_blocks", "context_length"))
        if self.n_embed % self.n_head:
            raise ConfigError(f"config field n_embed ({self.n_embed}) must be divisible by n_head ({self.n_head})")
        check_token_ids(self)

    # The sizes the export contract reads, under the names every family shares.
    @property
    def num_hidden_layers(self) -> int:
        return self.n_blocks

    @property
    def num_attention_heads(self) -> int:
        return self.n_head

    @property
    def num_key_value_heads(self) -> int:
        return self.n_head

    @property
    def hidden_size(self) -> int:
        return self.n_embed

    @property
    def head_dim(self) -> int:
        return self.n_embed // self.n_head

    @property
    def max_position_embeddings(self) -> int:
        return self.context_length


# Named configurations (reference/presets.py gathers every family's): the teaching GPT of seed 003, its smoke config
# (13,356,928) and its default (configs/base.json), then a tiny one for tests and quick trials.
PRESETS = {
    "teaching-gpt-smoke": TeachingGPTConfig(n_embed=128, n_head=4, n_blocks=2, context_length=256),
    "teaching-gpt": TeachingGPTConfig(),
    "teaching-gpt-tiny": TeachingGPTConfig(vocab_size=512, n_embed=64, n_head=4, n_blocks=2, context_length=64),
}
