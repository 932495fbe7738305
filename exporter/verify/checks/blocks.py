"""Quantized blocks (MatMulNBits, GatherBlockQuantized) dequantized, and held to what onnxruntime's quantizer makes
of the parameter they stand for.

The export quantizes with onnxruntime's MatMulNBitsQuantizer (exporter/export/quantize.py), whose blocks MLAS makes
(`BlockwiseQuantizer::quantizeAndTranspose` with `range2scalezp`): per block of `block_size` consecutive weights v of
one row along K (the last block's padding left out), with M = 2^bits - 1, in float32 arithmetic:

    lo = min(0, min v), hi = max(0, max v)                       exact
    scale_f = (hi - lo) / M                                      two float32 roundings
    scale = scale_f in the graph's float type                    float32: exact; float16: one rounding
    zero_point = 0 if -lo/scale_f < 0, M if -lo/scale_f > M, else roundf(-lo/scale_f)   (half away from zero)
    q = clamp(roundf(v * (1/scale) + zero_point), 0, M)

Scale and zero point are computed with IEEE-754 basic operations, each correctly rounded, so numpy's float32 computes
them bit for bit (`expected_blocks`): a correct artifact's scales and zero points equal them exactly, and no tolerance
is needed or allowed. A scale × 1.05, or rounded to another format, is another block.

Each weight lies within half a step of its dequantized value (q - zero_point) * scale, up to rounding (QUANT_SLACK):
the block's range [lo, hi] spans [-zero_point, M - zero_point] steps of scale_f to within the half step the zero
point's rounding moves it, so rounding to nearest and clamping to [0, M] leave each weight within half a step. The
rounding on top, in steps: the stored scale differs from scale_f by at most u_T relative (the scale type's unit
roundoff; 0 in float32), which stretches the M steps by at most M·u_T; 1/scale and v·(1/scale) each round once
(u = 2^-24 relative, on |v/scale| <= M), and adding the zero point once more (u on a sum <= M + 1): at most 3(M + 1)u.
The bound is therefore scale · (1/2 + (M + 1)(u_T + 3u)). A weight of another block, layer or matrix lies steps away.

A 4-bit matrix made by onnxruntime's HQQ (`HQQWeightOnlyQuantizer.quantize_internal`, manifest algorithm "hqq") has
float zero points, which tell its blocks from round-to-nearest ones. The graph holds them as integer zero points and
the fractions the rounding left, added back after the node (exporter/export/quantize.py); `fitted_zero_points` puts
the two together again, and they are judged as the floats. Its scale spans the block's own range, in
float32 (torch divides a number by a tensor as the tensor's reciprocal times the number, each step an IEEE-754
operation, correctly rounded as numpy's):

    lo = min v, hi = max v (the padding's zeros counted)          exact
    inverse = (1 / (hi - lo)) · M (hi - lo = M where zero)        three roundings; at most 2e4
    scale = 1 / inverse, in the graph's float type                float32: one rounding; float16: two

and is held bit for bit (`hqq_scales`). Its zero point is what the half-quadratic solver fitted (a float mean over
the block, iterated), which no closed formula re-derives: it is held through the codes, q = clamp(round(v · inverse
+ zero_point), 0, M), each of which must be the nearest on the block's grid to its weight: within half a step, plus
rounding, of (q - zero_point) · scale, or at the grid's end (0 or M) with the weight beyond it. The rounding, in
steps: v · inverse and the sum with the zero point (a float of magnitude up to |zero_point|) each round once, on
magnitudes below M + 1 + |zero_point|, and the stored scale is 1/inverse within u_T + u relative, which (q -
zero_point) stretches by as many steps: (M + 1 + |zero_point|)(u_T + 3u). A zero point off by a step moves every
code's weight a step, another layer's blocks have other scales, and both fail; a zero point that moves the grid
whole steps off the block clamps its weights at the grid's ends, which only the quality check's figures judge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from exporter.artifact.quantization import QUANTIZED_OP

U32 = float(np.finfo(np.float32).eps) / 2  # float32's unit roundoff, 2^-24
# Rows dequantized at once: bounds the float64 copies a large table (a 150k-token embedding) would need whole.
CHUNK_ELEMENTS = 1 << 22


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def layout(node: onnx.NodeProto, b: np.ndarray) -> tuple[int, int, int, int]:
    """(N, K, bits, block_size) of a MatMulNBits node, or of a GatherBlockQuantized node's rows (N rows of K
    elements: its blocks are MatMulNBits', flattened per row)."""
    bits, block = _attribute(node, "bits", 4), _attribute(node, "block_size", 0)
    if node.op_type == QUANTIZED_OP:
        return _attribute(node, "N", 0), _attribute(node, "K", 0), bits, block
    return b.shape[0], b.shape[-1] * 8 // bits, bits, block


def quant_slack(bits: int, scale_dtype: np.dtype) -> float:
    """The rounding beyond half a step, in steps (the module's docstring derives it)."""
    scale_roundoff = float(np.finfo(scale_dtype).eps) / 2
    return 2**bits * (scale_roundoff + 3 * U32)


def _codes(node: onnx.NodeProto, b: np.ndarray, zero_points: np.ndarray | None, rows: slice) -> tuple:
    """The integer codes (rows, blocks, block) and zero points (rows, blocks) of `rows`."""
    n, k, bits, block = layout(node, b)
    raw = b.reshape(n, -(-k // block), -1)[rows]
    if bits == 4:
        q = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(*raw.shape[:2], -1)[:, :, :block]
    else:
        q = raw[:, :, :block]
    return q.astype(np.int64), _zero_points(node, b, zero_points, rows)


def _zero_points(node: onnx.NodeProto, b: np.ndarray, zero_points: np.ndarray | None, rows: slice) -> np.ndarray:
    """The zero points (rows, blocks) of `rows`: int64, unpacked; HQQ's floats as float64; the type's middle where
    the node has none."""
    n, k, bits, block = layout(node, b)
    blocks = -(-k // block)
    if zero_points is None:
        return np.full((len(range(n)[rows]), blocks), 2 ** (bits - 1), np.int64)
    if is_hqq(zero_points):
        return zero_points.reshape(n, blocks)[rows].astype(np.float64)
    if bits == 4:
        packed = zero_points.reshape(n, -1)[rows]
        return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(len(packed), -1)[:, :blocks].astype(np.int64)
    return zero_points.reshape(n, blocks)[rows].astype(np.int64)


def fitted_zero_points(
    node: onnx.NodeProto, b: np.ndarray, scales: np.ndarray, integers: np.ndarray, fractions: np.ndarray
) -> np.ndarray:
    """The float zero points an HQQ node was made with, from the integer ones it reads and the `fractions` (blocks,
    N) the graph adds back (exporter.artifact.quantization.ZeroPointFractions): z = round(z) - fraction / scale, in
    float64 (N x blocks,). The division undoes the fraction's one rounding to within a unit roundoff of the scale
    type relative, far inside the codes' slack; a block whose scale is 0 keeps its integer zero point."""
    n, k, bits, block = layout(node, b)
    blocks = -(-k // block)
    integer = _zero_points(node, b, integers, slice(0, n))
    scale = scales.reshape(n, blocks).astype(np.float64)
    fraction = fractions.astype(np.float64).reshape(blocks, n).T
    shift = np.divide(fraction, scale, out=np.zeros_like(fraction), where=scale != 0)
    return (integer - shift).reshape(-1)


def is_hqq(zero_points: np.ndarray | None) -> bool:
    """Whether a node's zero points are HQQ's floats (the module's docstring), not round-to-nearest's integers."""
    return zero_points is not None and np.issubdtype(zero_points.dtype, np.floating)


def _row_chunks(n: int, k: int):
    step = max(1, CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def dequantize_blocks(node: onnx.NodeProto, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None):
    """A MatMulNBits or GatherBlockQuantized node's weight as (N, K) float32, as ONNX Runtime computes it in float
    math: (q - zero_point) * scale, exact in float64 and rounded once (the Linear weight's (out, in) layout, the
    embedding's (vocab, hidden))."""
    n, k, _, block = layout(node, b)
    weight = np.empty((n, k), np.float32)
    scale = scales.reshape(n, -1).astype(np.float64)
    for rows in _row_chunks(n, k):
        q, zero = _codes(node, b, zero_points, rows)
        values = (q - zero[:, :, None]) * scale[rows, :, None]
        weight[rows] = values.reshape(len(q), -1)[:, :k]
    return weight


def expected_blocks(values: np.ndarray, bits: int, block: int, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The scales (in `scale_dtype`) and zero points onnxruntime's quantizer makes of `values` (N, K), per block of
    `block` along K: (N, blocks) each (the module's docstring)."""
    padded = _padded_blocks(values, block)  # zeros leave min(0, ·) and max(0, ·) as they are
    top = np.float32(2**bits - 1)
    lo = np.minimum(padded.min(axis=-1), np.float32(0))
    hi = np.maximum(padded.max(axis=-1), np.float32(0))
    scale_f = (hi - lo) / top
    with np.errstate(divide="ignore", invalid="ignore"):
        zero_f = np.where(scale_f != 0, np.float32(0) - lo / scale_f, lo)
    rounded = np.floor(np.abs(zero_f) + np.float32(0.5)) * np.sign(zero_f)  # roundf: half away from zero
    zero = np.where(zero_f < 0, 0, np.where(zero_f > top, top, rounded)).astype(np.int64)
    return scale_f.astype(scale_dtype), zero


def _padded_blocks(values: np.ndarray, block: int) -> np.ndarray:
    """`values` (N, K) as (N, blocks, block) float32, the last block padded with zeros, as both quantizers pad."""
    n, k = values.shape
    blocks = -(-k // block)
    padded = np.zeros((n, blocks * block), np.float32)
    padded[:, :k] = values
    return padded.reshape(n, blocks, block)


def hqq_scales(values: np.ndarray, bits: int, block: int, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The scales (in `scale_dtype`) onnxruntime's HQQ makes of `values` (N, K), per block of `block` along K, and
    the float32 inverses its codes are rounded with: (N, blocks) each (the module's docstring)."""
    padded = _padded_blocks(values, block)
    top = np.float32(2**bits - 1)
    span = padded.max(axis=-1) - padded.min(axis=-1)
    inverse = np.minimum(np.float32(1) / np.where(span == 0, top, span) * top, np.float32(2e4))
    return (np.float32(1) / inverse).astype(scale_dtype), inverse


@dataclass(frozen=True)
class BlockCheck:
    """A quantized matrix against the parameter it stands for.

    scales, zero_points: how many differ from the quantizer's (expected_blocks), of `blocks`; beyond: how many of
    `elements` dequantized weights lie beyond half a step plus rounding of their parameter; worst: the largest
    distance of a weight from its parameter, in multiples of that bound (a correct block: <= 1); worst_scale: the
    largest relative difference of a scale from the quantizer's.
    """

    blocks: int
    scales: int
    zero_points: int
    elements: int
    beyond: int
    worst: float
    worst_scale: float

    @property
    def passed(self) -> bool:
        return not (self.scales or self.zero_points or self.beyond)

    def describe(self) -> str:
        parts = []
        if self.scales:
            parts.append(
                f"{self.scales} of {self.blocks} scales are not the quantizer's (the worst off by "
                f"{self.worst_scale:.3g}, relative)"
            )
        if self.zero_points:
            parts.append(f"{self.zero_points} of {self.blocks} zero points are not the quantizer's")
        if self.beyond:
            parts.append(
                f"{self.beyond} of {self.elements} dequantized weights lie beyond half a step of their parameter, "
                f"the worst {self.worst:.3g}x that bound"
            )
        return "; ".join(parts)


def check_blocks(
    node: onnx.NodeProto, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, values: np.ndarray
) -> BlockCheck:
    """The node's blocks against `values` (N, K), the parameter in the graph's float type, as float32: scales and
    zero points exactly, each dequantized weight within half a step plus QUANT_SLACK; an HQQ node's scales exactly
    and each code the nearest on its grid (the module's docstring)."""
    n, k, bits, block = layout(node, b)
    stored = scales.reshape(n, -1)
    hqq = is_hqq(zero_points)
    if hqq:
        expected_scale, _ = hqq_scales(values, bits, block, stored.dtype)
    else:
        expected_scale, expected_zero = expected_blocks(values, bits, block, stored.dtype)
    scale_differs = stored.view(np.uint8).reshape(n, -1, stored.itemsize) != expected_scale.view(np.uint8).reshape(
        n, -1, stored.itemsize
    )
    scale_differs = scale_differs.any(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.abs(stored.astype(np.float64) / expected_scale.astype(np.float64) - 1)
    worst_scale = float(np.nanmax(np.where(scale_differs, ratio, 0))) if scale_differs.any() else 0.0
    slack = quant_slack(bits, stored.dtype)
    top = 2**bits - 1
    zero_differs = beyond = 0
    worst = 0.0
    for rows in _row_chunks(n, k):
        q, zero = _codes(node, b, zero_points, rows)
        if zero_points is not None and not hqq:
            zero_differs += int((zero != expected_zero[rows]).sum())
        step = expected_scale[rows].astype(np.float64)
        dequantized = ((q - zero[:, :, None]) * stored[rows, :, None].astype(np.float64)).reshape(len(q), -1)[:, :k]
        signed = dequantized - values[rows].astype(np.float64)
        error = np.abs(signed)
        if hqq:
            rounding = (2**bits + np.abs(zero)) * (float(np.finfo(stored.dtype).eps) / 2 + 3 * U32)
            bound = np.repeat(step * (0.5 + rounding), block, axis=1)[:, :k]
            # a code at the grid's end with its weight beyond it is the nearest there is
            codes = q.reshape(len(q), -1)[:, :k]
            error = np.where(((codes == 0) & (signed >= 0)) | ((codes == top) & (signed <= 0)), 0, error)
        else:
            bound = np.repeat(step * (0.5 + slack), block, axis=1)[:, :k]
        beyond += int((error > bound).sum())
        with np.errstate(divide="ignore", invalid="ignore"):
            multiple = np.where(bound > 0, error / bound, np.where(error > 0, np.inf, 0))
        worst = max(worst, float(multiple.max()))
    if hqq:  # a zero point no number: every code's weight is off
        zero_differs = int((~np.isfinite(zero_points)).sum())
    return BlockCheck(
        blocks=int(stored.size),
        scales=int(scale_differs.sum()),
        zero_points=zero_differs,
        elements=n * k,
        beyond=beyond,
        worst=worst,
        worst_scale=worst_scale,
    )
