"""Seeded weight initialisation that gives the same weights on any machine.

torch's normal_ takes different code paths by CPU features and version, so the
draws come from numpy's PCG64 integer stream instead: each parameter gets its
own stream keyed by (seed, parameter name), independent of creation order, and
uniform draws are exact integer-to-float conversions, bit-identical everywhere.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from torch import nn

# std 0.02 with tied embeddings makes greedy decoding repeat one token; ~0.1
# gives varied, peaked next-token distributions, so token tests mean something.
DEFAULT_STD = 0.1
# Norm weights are uniform in [1 - NORM_HALF_WIDTH, 1 + NORM_HALF_WIDTH]. Distinct per channel and per norm, so
# that a norm applied in another's place (q_norm for k_norm, one layer's for another's), or dropped, changes the
# outputs: with every norm at one, as upstream initialises them, no comparison could tell. Around one, so that
# activations keep the scale unit norms give them.
NORM_HALF_WIDTH = 0.5


def _stream(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


@torch.no_grad()
def seeded_init_(model: nn.Module, seed: int = 0, std: float = DEFAULT_STD) -> nn.Module:
    """Norm weights (1-D weights named *norm*, or of a LayerNorm) are uniform around one
    (1 ± NORM_HALF_WIDTH); every other tensor (LayerNorm and Linear biases included) is uniform with the given
    std, centred on zero. Each parameter draws from its own stream, keyed by the seed and its name."""
    half_width = std * math.sqrt(3.0)
    layer_norms = {
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.LayerNorm)
    }
    for name, param in model.named_parameters():  # tied parameters are yielded once
        if param.ndim == 1 and name.endswith("weight") and ("norm" in name or name in layer_norms):
            low, high = 1.0 - NORM_HALF_WIDTH, 1.0 + NORM_HALF_WIDTH
        else:
            low, high = -half_width, half_width
        values = _stream(seed, name).uniform(low, high, size=tuple(param.shape))
        param.copy_(torch.from_numpy(values.astype(np.float32)))
    return model
