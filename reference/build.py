"""Reference models with seeded weights."""

from reference.init import seeded_init_
from reference.minimind import MiniMindForCausalLM
from reference.minimind_config import MiniMindConfig


def build_model(config: MiniMindConfig, seed: int = 0) -> MiniMindForCausalLM:
    """A reference model with seeded weights, in eval mode."""
    return seeded_init_(MiniMindForCausalLM(config), seed).eval()
