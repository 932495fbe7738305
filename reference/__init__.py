"""PyTorch reference models that the ONNX exports must reproduce.

Configs and presets import without torch (the ONNX Runtime side reads them);
the model classes load torch on first use.
"""

from reference.errors import ConfigError
from reference.minimind_config import MiniMindConfig
from reference.presets import DEFAULT_PRESET, PRESETS, get_preset

_TORCH_EXPORTS = {
    "CausalLMOutput": "reference.minimind",
    "MiniMindForCausalLM": "reference.minimind",
    "seeded_init_": "reference.init",
    "build_model": "reference.build",
}


def __getattr__(name):
    if name in _TORCH_EXPORTS:
        import importlib
        return getattr(importlib.import_module(_TORCH_EXPORTS[name]), name)
    raise AttributeError(f"module 'reference' has no attribute {name!r}")


__all__ = ["CausalLMOutput", "ConfigError", "DEFAULT_PRESET", "MiniMindConfig", "MiniMindForCausalLM",
           "PRESETS", "build_model", "get_preset", "seeded_init_"]
