"""The model families the toolkit knows, as data: manifest name -> config class, model class.

A family's config exposes the sizes the export contract reads (num_hidden_layers,
num_key_value_heads, head_dim, vocab_size, max_position_embeddings,
bos_token_id, eos_token_id) and round-trips through to_dict/from_dict; its
model takes the shared forward signature and returns a CausalLMOutput. The
manifest records `model.family`, and everything that reads an artifact finds
the config class here instead of branching on architecture names.

No torch here: the ONNX Runtime side reads configs through this registry, so
model classes are named as "module:Class" and imported only to build a model.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Protocol

from reference.configs import DecoderSpec
from reference.errors import ConfigError
from reference.hf_decoder_config import HFDecoderConfig
from reference.minimind_config import MiniMindConfig
from reference.teaching_gpt_config import TeachingGPTConfig


class DecoderConfig(Protocol):
    """What the exporter, runtime and verifier read from any family's config."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None

    def to_dict(self) -> dict: ...


@dataclass(frozen=True)
class Family:
    name: str  # as written in manifest.json's model.family
    config_class: type
    model_class: str | None  # "module:Class"; None: the user brings the model (DecoderSpec)

    def model_type(self) -> type:
        """The family's nn.Module class (imports torch)."""
        if self.model_class is None:
            raise ConfigError(
                f"family {self.name!r} has no model the toolkit can build; pass your own model (see reference/byo.py)"
            )
        module, name = self.model_class.split(":")
        return getattr(importlib.import_module(module), name)

    def own_config(self, config):
        """`config` as the family's own class, its fields only: what the manifest records and reads back
        (a subclass's extra fields would be refused as unknown when the artifact is read)."""
        if type(config) is self.config_class:
            return config
        return self.config_class(
            **{field.name: getattr(config, field.name) for field in dataclasses.fields(self.config_class)}
        )

    def build(self, config, seed: int = 0):
        """A model with seeded weights, in eval mode."""
        from reference.init import seeded_init_

        return seeded_init_(self.model_type()(config), seed).eval()


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("minimind", MiniMindConfig, "reference.minimind:MiniMindForCausalLM"),
        Family("teaching-gpt", TeachingGPTConfig, "reference.teaching_gpt:TeachingGPT"),
        # llama, mistral, qwen2 and qwen3 from a Transformers folder (config.model_type says which)
        Family("hf-decoder", HFDecoderConfig, "reference.hf_decoder:HFDecoderForCausalLM"),
        Family("custom", DecoderSpec, None),
    )
}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"unknown model family {name!r}; known families: {', '.join(FAMILIES)}") from None


def family_of(config) -> Family:
    for family in FAMILIES.values():
        if isinstance(config, family.config_class):  # a subclass too: a user's DecoderSpec with methods
            return family
    raise ConfigError(
        f"{type(config).__name__} is not the config of a known family ({', '.join(FAMILIES)}); "
        "describe your own decoder with reference.byo.DecoderSpec"
    )


def config_from_dict(family: str, data: dict):
    return get_family(family).config_class.from_dict(data)


def build_model(config, seed: int = 0):
    """A reference model of the config's family with seeded weights, in eval mode."""
    return family_of(config).build(config, seed)
