"""A quantized artifact against the PyTorch reference holding the artifact's own weights: the export's faithfulness,
apart from the quantization's loss.

The quality profile judges how far a quantized artifact lies from the float reference, with limits as wide as the
scheme's own loss (int4: mean KL 0.15), so an export fault that moves the outputs less than 4-bit rounding does
passes there. Here each quantized parameter of a copy of the reference is replaced by the weight the artifact's
blocks dequantize to (exporter.verify.checks.weights.quantized.dequantized_weights, by the module each node lies
in), and ONNX Runtime runs every MatMulNBits in float math (accuracy level 0, or unprepacked at level 4:
float_matmul_settings). Both sides then compute one model in one float type, so the tolerance profile of the
artifact's dtype (float32, or float16 for float16 activations) judges them as it judges a float artifact: the
prefill batch (logits, every present, the loss) and the decode steps, each side feeding its own present back. An
export fault (a mask, a position, a layer's wiring) fails here by the multiple it would fail a float artifact;
whether the blocks are the parameters' is the weight audit's question, and what the scheme's rounding costs, the
quality profile's.

The copy holds the float weights once more while the check runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from exporter.artifact.folder import Artifact
from exporter.tolerances.parity import Profile
from exporter.verify.checks.health import HealthScan
from exporter.verify.checks.outputs import check_decode, check_prefill
from exporter.verify.checks.weights.quantized import dequantized_weights
from exporter.verify.inputs import ParitySettings
from exporter.verify.metrics import Comparison

NAME = "faithful to its own weights"


@dataclass(frozen=True)
class Faithfulness:
    """ONNX Runtime on `provider` against the reference holding the artifact's dequantized weights.

    replaced: the reference's parameters replaced by the artifact's weights; comparisons: the prefill and decode
    rows, judged by `profile` (its name).
    """

    provider: str
    profile: str
    replaced: int
    comparisons: tuple[Comparison, ...]

    @property
    def passed(self) -> bool:
        return bool(self.comparisons) and all(c.passed for c in self.comparisons)

    @property
    def detail(self) -> str:
        worst = max(self.comparisons, key=lambda c: c.needed.scale)
        failing = [c.name for c in self.comparisons if not c.passed]
        judged = (
            f"failing {', '.join(failing)}" if failing else "every row within it"
        ) + f"; the worst, {worst.name}, at {worst.needed.scale:.3g}x its tolerance"
        return (
            f"{self.provider}, MatMulNBits in float math, against the reference holding the artifact's "
            f"{self.replaced} dequantized weights, judged by the {self.profile} profile: {judged}"
        )

    def to_dict(self) -> dict:
        return {
            "name": NAME,
            "provider": self.provider,
            "profile": self.profile,
            "passed": self.passed,
            "replaced": self.replaced,
            "detail": self.detail,
            "comparisons": [c.to_dict() for c in self.comparisons],
        }


def _holding(model, weights: dict[str, np.ndarray], dtype):
    """A copy of `model` in `dtype` whose module of each key of `weights` holds that weight; with how many it holds.
    A tied parameter becomes one per module (the artifact may quantize the embedding and the lm_head differently)."""
    import torch

    held = copy.deepcopy(model).to(dtype).eval()
    replaced = 0
    for module, weight in weights.items():
        try:
            target = held.get_submodule(module)
        except AttributeError:
            continue  # a node in no module of the model: the weight audit fails it
        if tuple(getattr(target, "weight", torch.empty(0)).shape) != weight.shape:
            continue  # likewise
        target.weight = torch.nn.Parameter(torch.from_numpy(weight).to(dtype), requires_grad=False)
        replaced += 1
    return held, replaced


def check_faithfulness(
    artifact: Artifact, model, onnx_runner, batch: dict, settings: ParitySettings, profile: Profile
) -> Faithfulness:
    """ONNX Runtime against `model` holding the artifact's own dequantized weights (the module's docstring).

    Args:
        artifact: the quantized artifact.
        model: the PyTorch reference it was exported from.
        onnx_runner: an OrtRunner on it whose MatMulNBits compute in float (float_matmul_settings where they apply).
        batch: the prompt batch (prompt_batch).
        settings: the verification's settings (decode steps, seed).
        profile: the tolerance profile of the artifact's dtype on the runner's provider.
    """
    from exporter.verify.references.torch_runner import TorchRunner
    from reference.layers import TORCH_DTYPES

    manifest = artifact.manifest
    held, replaced = _holding(model, dequantized_weights(artifact), TORCH_DTYPES[manifest.dtype])
    reference = TorchRunner(held, manifest)
    health = HealthScan(manifest.dtype)  # the outputs' health is the quality check's: this one is not reported
    prefill, _ = check_prefill(reference, onnx_runner, manifest, batch, profile, health)
    decode, _ = check_decode(
        reference, onnx_runner, manifest, batch, settings, profile, health, np.random.default_rng(settings.seed + 1)
    )
    return Faithfulness(onnx_runner.provider, profile.name, replaced, (*prefill.comparisons, *decode.comparisons))
