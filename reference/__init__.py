"""PyTorch reference models that the ONNX exports must reproduce, one file per family."""

from reference.byo import DecoderAdapter, DecoderSpec, check_adapter
from reference.errors import CheckpointError, ConfigError, ContextLengthError, ModelError
from reference.families import FAMILIES, build_model, family_of, get_family
from reference.init import seeded_init_
from reference.layers import CausalLMOutput
from reference.minimind import MiniMindConfig, MiniMindForCausalLM, YarnScaling
from reference.presets import DEFAULT_PRESET, PRESETS, get_preset
from reference.teaching_gpt import TeachingGPT, TeachingGPTConfig

__all__ = ["CausalLMOutput", "CheckpointError", "ConfigError", "ContextLengthError", "DEFAULT_PRESET",
           "DecoderAdapter", "DecoderSpec", "FAMILIES", "MiniMindConfig", "MiniMindForCausalLM", "PRESETS",
           "ModelError", "TeachingGPT", "TeachingGPTConfig", "YarnScaling", "build_model", "check_adapter",
           "family_of", "get_family", "get_preset", "seeded_init_"]
