"""What rounding each module's weights costs a model, measured in PyTorch on text.

A module's weights are rounded exactly as onnxruntime's quantizer rounds them
(exporter.export.quantize.matrix_blocks, or hqq_matrix_blocks where the scheme makes its blocks by HQQ; dequantized
as ONNX Runtime computes in float math by exporter.verify.checks.blocks.dequantize_blocks), swapped into the float
model, and the model's next-token distributions on windows of text compared with the float model's own by the
verification's statistics (exporter.verify.metrics.token_statistics: KL(float || rounded) and top-1 agreement per
position). One module rounded alone gives its sensitivity; a whole mix rounded at once gives the figures a mix is
chosen by. These are float-math figures: an artifact's own (ONNX Runtime, its MatMulNBits accuracy levels, and the
smoothing of an int8 scheme's inputs at level 4, which moves rounding from the inputs into the weights) are measured
on the built artifact by the quality check.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
from onnx import helper

from exporter.artifact.quantization import DEFAULT_ALGORITHM, QUANTIZED_OP, Quantization
from exporter.export.quantize import MS_DOMAIN, hqq_matrix_blocks, matrix_blocks, split_zero_points
from exporter.verify.checks.blocks import dequantize_blocks, fitted_zero_points
from exporter.verify.metrics import token_statistics

ROWS_PER_CALL = 4  # windows per forward pass: the float64 distributions of a call stay a few hundred MB at 50k tokens


@dataclass(frozen=True)
class RoundedBlocks:
    """A Linear's weight as an artifact's MatMulNBits node holds it (`node` gives its layout): packed codes, scales
    and zero points (None where symmetric), at a byte or half a byte per weight; `weight()` dequantizes it."""

    node: object
    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None

    def weight(self) -> np.ndarray:
        """(out, in) float32, as ONNX Runtime computes with it in float math."""
        return dequantize_blocks(self.node, self.packed, self.scales, self.zero_points)


def rounded_blocks(
    weight: np.ndarray, bits: int, scheme: Quantization, algorithm: str = DEFAULT_ALGORITHM
) -> RoundedBlocks:
    """A Linear's `weight` (out, in) as the artifact holds it at `bits`: onnxruntime's blocks of it, made by
    `algorithm` (ALGORITHMS); HQQ's float zero points as the graph computes with them (integers and their
    fractions, put together again)."""
    n, k = weight.shape
    node = helper.make_node(
        QUANTIZED_OP, ["A", "B", "scales"], ["Y"], domain=MS_DOMAIN, K=k, N=n, bits=bits, block_size=scheme.block_size
    )
    if algorithm == "hqq":
        packed, scales, zero_points = hqq_matrix_blocks(weight, bits, scheme)
        integers, fractions = split_zero_points(zero_points, scales, n, bits, scales.dtype)
        return RoundedBlocks(node, packed, scales, fitted_zero_points(node, packed, scales, integers, fractions))
    packed, scales, zero_points = matrix_blocks(weight.astype(np.float32), bits, scheme)
    return RoundedBlocks(node, packed, scales, None if scheme.symmetric else zero_points)


def module_bytes(
    shape: tuple[int, int], bits: int | None, scheme: Quantization, float_bytes: int, algorithm: str = DEFAULT_ALGORITHM
) -> int:
    """What a Linear's weight of `shape` (out, in) takes in an artifact: `bits`-bit blocks with their scales (of
    `float_bytes` each, the graphs' float type) and packed zero points (HQQ's: those and a float fraction per block,
    exporter/export/quantize.py), or float (bits None)."""
    n, k = shape
    if bits is None:
        return n * k * float_bytes
    blocks = -(-k // scheme.block_size)
    zero_points = 0 if scheme.symmetric and algorithm != "hqq" else n * -(-blocks * bits // 8)
    if algorithm == "hqq":
        zero_points += n * blocks * float_bytes
    return n * blocks * (scheme.block_size * bits // 8 + float_bytes) + zero_points


@dataclass(frozen=True)
class Figures:
    """Per-position KL(float || rounded) in nats and top-1 agreement (1.0 or 0.0) over some windows."""

    kl: np.ndarray
    top1: np.ndarray

    @property
    def kl_mean(self) -> float:
        return float(self.kl.mean())

    @property
    def top1_agreement(self) -> float:
        return float(self.top1.mean())


class Scorer:
    """The float model's next-token distributions on `rows` (W, L) of token ids, kept, against which the model with
    some modules' weights replaced is scored. Every position of a window is scored (its continuation is read from
    the window itself, all positions in one forward pass)."""

    def __init__(self, model, rows: np.ndarray):
        self.model = model
        self.rows = np.asarray(rows, np.int64)
        self._reference = [self._logits(chunk) for chunk in self._chunks()]

    def _chunks(self):
        return [self.rows[i : i + ROWS_PER_CALL] for i in range(0, len(self.rows), ROWS_PER_CALL)]

    def _logits(self, chunk: np.ndarray) -> np.ndarray:
        logits = _forward(self.model, chunk).logits
        return logits.float().numpy().reshape(-1, logits.shape[-1])

    def score(self, weights: dict[str, np.ndarray]) -> Figures:
        """The figures of the model holding `weights` ({module: (out, in) float32}) in place of its own."""
        with _holding(self.model, weights):
            stats = [
                token_statistics(self._logits(chunk), expected)
                for chunk, expected in zip(self._chunks(), self._reference)
            ]
        return Figures(np.concatenate([s["kl"] for s in stats]), np.concatenate([s["top1"] for s in stats]))


def _forward(model, rows: np.ndarray):
    """The model's output on `rows` (B, L) of token ids, every id real, positions from 0, as the reference runs a
    prefill."""
    import torch

    ids = torch.from_numpy(np.asarray(rows, np.int64))
    with torch.no_grad():
        return model(
            ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(ids.shape[1]).expand(ids.shape),
            use_cache=True,
        )


@contextlib.contextmanager
def _holding(model, weights: dict[str, np.ndarray]):
    """`model` with each module of `weights` holding that weight, its own put back after."""
    import torch

    kept = {}
    try:
        for name, weight in weights.items():
            module = model.get_submodule(name)
            kept[name] = module.weight.data
            module.weight.data = torch.from_numpy(weight).to(kept[name].dtype)
        yield model
    finally:
        for name, data in kept.items():
            model.get_submodule(name).weight.data = data
