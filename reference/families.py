"""The model families the toolkit knows, one registration each: manifest name -> everything read about the family.

A family's record names its config class (the sizes the export contract reads: num_hidden_layers,
num_key_value_heads, head_dim, vocab_size, max_position_embeddings, bos_token_id, eos_token_id, and a
to_dict/from_dict round trip), its model class (the shared forward signature, returning a CausalLMOutput), its
checkpoint loader (reference/checkpoint_loaders.py: the config read from config.json or inferred from the tensors, the
state dict prepared for the model), the config.json model_types that name its checkpoints, the type each consumer
(onnxruntime-genai, Optimum) is told its artifacts are, and its presets, the tiny ones being the tests' fixtures.
The manifest records `model.family`, and everything that reads an artifact or a checkpoint finds the family here
instead of branching on its name. docs/extending.md walks through adding one.

No torch here: the ONNX Runtime side reads configs through this registry, so model and loader classes are named as
"module:Class" and imported only when a model is built or a checkpoint read.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from reference.configs import DecoderSpec
from reference.errors import ConfigError
from reference.hf_decoder_config import MODEL_TYPES as HF_MODEL_TYPES
from reference.hf_decoder_config import HFDecoderConfig
from reference.hf_types import HF_TYPES
from reference.minimind_config import PRESETS as MINIMIND_PRESETS
from reference.minimind_config import MiniMindConfig
from reference.teaching_gpt_config import PRESETS as TEACHING_GPT_PRESETS
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


# The consumers' types: (onnxruntime-genai model.type, Optimum model_type) of a family's config, None where that
# consumer cannot run it. The types only choose the consumers' defaults (input names, how to size the first-step
# cache from config.json); neither rebuilds the architecture, so a type is chosen for the attention layout it
# implies. qwen3, llama and the generic "decoder" type run a contract-following graph unmodified in
# onnxruntime-genai, qwen3 and llama in Optimum (the consumer tests in tests/artifact/ load each); docs/runtime.md
# tabulates them.
ConsumerTypes = Callable[[object], tuple[str | None, str | None]]


def _minimind_consumers(config: MiniMindConfig) -> tuple[str, str]:
    """minimind-3 is a Qwen3-style decoder (q/k norm, GQA, RoPE, SwiGLU): qwen3; MiniMind2 has no q/k norm and no
    biases, Llama's layout: llama. The MoE variants keep their generation's attention; onnxruntime-genai has no type
    for a MoE FFN it would not compute anyway, so they are "decoder" there (the generic type), and their
    generation's type for Optimum, which reads only the sizes."""
    attention = "qwen3" if config.version == 3 else "llama"
    return "decoder" if config.use_moe else attention, attention


def _hf_consumers(config: HFDecoderConfig) -> tuple[str, str]:
    """A Hugging Face decoder is told its own type, as its record in reference/hf_types.py names it."""
    hf_type = HF_TYPES[config.model_type]
    return hf_type.genai, hf_type.optimum


def _generic_consumers(config) -> tuple[str, str]:
    """Learned positions, LayerNorm or a design of one's own: "decoder" in onnxruntime-genai; Optimum's types for
    learned-position models (gpt2) expect other input names, so Optimum gets llama, which it uses only to size the
    cache."""
    return "decoder", "llama"


@dataclass(frozen=True)
class Family:
    """One model family's registration.

    Attributes:
        name: as written in manifest.json's model.family.
        config_class: its frozen config dataclass.
        model_class: "module:Class" of its nn.Module; None: the user brings the model (DecoderSpec).
        consumer_types: config -> (onnxruntime-genai model.type, Optimum model_type), None where that consumer
            cannot run it.
        loader_class: "module:Class" of its checkpoint loader (claims, translate, infer, visible_sizes, prepare: see
            reference/checkpoint_loaders.py); None: no checkpoint format.
        model_types: the config.json model_type values that name its checkpoints.
        presets: its named configs; the "-tiny" ones are the tests' fixtures (a Hugging Face type's fixture is its
            record's `tiny`, reference/hf_types.py).
        transformers: whether transformers loads its checkpoints, which makes it verify's independent reference.
    """

    name: str
    config_class: type
    model_class: str | None
    consumer_types: ConsumerTypes
    loader_class: str | None = None
    model_types: tuple[str, ...] = ()
    presets: Mapping[str, object] = field(default_factory=dict)
    transformers: bool = False

    def model_type(self) -> type:
        """The family's nn.Module class (imports torch)."""
        if self.model_class is None:
            raise ConfigError(
                f"family {self.name!r} has no model the toolkit can build; pass your own model (see reference/byo.py)"
            )
        return _imported(self.model_class)

    def checkpoint_loader(self) -> type | None:
        """The family's checkpoint loader class, None for a family without one (imports torch)."""
        return None if self.loader_class is None else _imported(self.loader_class)

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


def _imported(name: str) -> type:
    module, attribute = name.split(":")
    return getattr(importlib.import_module(module), attribute)


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "minimind",
            MiniMindConfig,
            "reference.minimind:MiniMindForCausalLM",
            _minimind_consumers,
            loader_class="reference.checkpoint_loaders:MiniMindCheckpoints",
            model_types=("minimind",),
            presets=MINIMIND_PRESETS,
        ),
        Family(
            "teaching-gpt",
            TeachingGPTConfig,
            "reference.teaching_gpt:TeachingGPT",
            _generic_consumers,
            loader_class="reference.checkpoint_loaders:TeachingGPTCheckpoints",
            presets=TEACHING_GPT_PRESETS,
        ),
        # The model types of reference/hf_types.py from a Transformers folder (config.model_type says which)
        Family(
            "hf-decoder",
            HFDecoderConfig,
            "reference.hf_decoder:HFDecoderForCausalLM",
            _hf_consumers,
            loader_class="reference.checkpoint_loaders:HFDecoderCheckpoints",
            model_types=HF_MODEL_TYPES,
            transformers=True,
        ),
        Family("custom", DecoderSpec, None, _generic_consumers),
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


def family_named_by(model_type) -> Family | None:
    """The family whose checkpoints config.json's `model_type` names, or None."""
    return next((family for family in FAMILIES.values() if model_type in family.model_types), None)


def config_from_dict(family: str, data: dict):
    return get_family(family).config_class.from_dict(data)


def build_model(config, seed: int = 0):
    """A reference model of the config's family with seeded weights, in eval mode."""
    return family_of(config).build(config, seed)
