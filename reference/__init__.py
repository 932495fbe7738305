"""PyTorch reference models that the ONNX exports must reproduce, one file per family.

Configs, presets and the family registry import without torch (the ONNX
Runtime side reads them); the model classes load torch on first use.
"""

from reference.configs import DecoderSpec
from reference.errors import CheckpointError, ConfigError, ContextLengthError, ModelError
from reference.families import FAMILIES, build_model, family_of, get_family
from reference.hf_decoder_config import HFDecoderConfig, RopeScaling
from reference.minimind_config import MiniMindConfig, YarnScaling
from reference.presets import DEFAULT_PRESET, PRESETS, get_preset
from reference.teaching_gpt_config import TeachingGPTConfig

_TORCH_EXPORTS = {
    "CausalLMOutput": "reference.layers",
    "DecoderAdapter": "reference.byo",
    "check_adapter": "reference.byo",
    "MiniMindForCausalLM": "reference.minimind",
    "HFDecoderForCausalLM": "reference.hf_decoder",
    "TeachingGPT": "reference.teaching_gpt",
    "seeded_init_": "reference.init",
}


def __getattr__(name):
    if name in _TORCH_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_TORCH_EXPORTS[name]), name)
    raise AttributeError(f"module 'reference' has no attribute {name!r}")


__all__ = [
    "CausalLMOutput",
    "CheckpointError",
    "ConfigError",
    "ContextLengthError",
    "DEFAULT_PRESET",
    "DecoderAdapter",
    "DecoderSpec",
    "FAMILIES",
    "HFDecoderConfig",
    "HFDecoderForCausalLM",
    "MiniMindConfig",
    "MiniMindForCausalLM",
    "PRESETS",
    "RopeScaling",
    "ModelError",
    "TeachingGPT",
    "TeachingGPTConfig",
    "YarnScaling",
    "build_model",
    "check_adapter",
    "family_of",
    "get_family",
    "get_preset",
    "seeded_init_",
]
