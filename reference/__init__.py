"""PyTorch reference models that the ONNX exports must reproduce."""

from reference.errors import ConfigError
from reference.init import seeded_init_
from reference.minimind import CausalLMOutput, MiniMindConfig, MiniMindForCausalLM
from reference.presets import DEFAULT_PRESET, PRESETS, get_preset


def build_model(config: MiniMindConfig, seed: int = 0) -> MiniMindForCausalLM:
    """A reference model with seeded weights, in eval mode."""
    return seeded_init_(MiniMindForCausalLM(config), seed).eval()


__all__ = ["CausalLMOutput", "ConfigError", "DEFAULT_PRESET", "MiniMindConfig", "MiniMindForCausalLM",
           "PRESETS", "build_model", "get_preset", "seeded_init_"]
