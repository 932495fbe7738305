"""The float64 referee: an error judged against the error the reference's own precision makes on the same input.

A fixed profile (tolerances.parity.PROFILES) bounds ONNX Runtime's difference from the reference by a constant share
of each row's peak. That constant holds where both sides' rounding errors are typical, and a trained model breaks
it: on some inputs its computation is ill-conditioned (a softmax near a tie, a norm of a nearly cancelled residual),
and *both* float32 (or float16) computations then stray far from the exact result, each its own way. Their
difference says nothing about which one, if either, is wrong.

So where a comparison fails its fixed profile, the reference model is run again in float64 on the same token inputs,
along the same chain of calls (the past's prefill, the decode steps before), each side's own cache fed back: the
float64 run is the referee, exact to about 2^-53 against the 2^-24 or 2^-11 of the two computations judged. Both
sides' errors against it are measured as the fixed profile measures them, in units of each row's peak (one
position's logits, one kv head's keys or values; metrics.ROW_AXES), the worst row of each side:

    ratio = max over rows of (max|onnx - float64| / peak)  /  max over rows of (max|reference - float64| / peak)

with the reference's figure floored at one unit roundoff (no computation of that precision does better than
rounding its result once). The rows of one output share one scale, the reference's worst, because rounding errors
follow magnitudes: the reference's worst relative error shows how ill-conditioned this input is for any
computation of that precision, while its error in one particular row is partly luck (two correct float32 runs
differ row by row by factors that the worst rows do not). The comparison passes when ratio <= REFEREE_LIMIT, and
the report says "error against float64 N x the reference's own float32 error".

REFEREE_LIMIT: both sides compute the same operations in the same precision, with different kernels (blocked and
vectorised matrix products, fused softmax and norms) and summation orders. Rounding error analysis bounds a dot
product's error by the same gamma_n = n u for any order, but the typical error of an order depends on how partial
sums grow: sequential accumulation drifts as sqrt(n) u where a blocked one drifts as sqrt(n / b) u plus the blocks'
own, so two correct orders differ by a factor of a few, not more, on the same ill-conditioned input, and that
factor compounds at most through the few operations that amplify it (the softmax and the norms). 16 = 2^4 allows
a factor of 4 at two such amplifying stages. A wrong graph (a wrong mask, position, scale or weight) errs by O(1)
against errors of 1e-5..1e-3 in float32 and 1e-2..1 in float16: 10^2 to 10^5 times the reference's own.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from exporter.verify.metrics import ROW_AXES, Comparison, Refereed

REFEREE_LIMIT = 16.0
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11}


def referee_ratio(actual, expected, truth, kind: str, dtype: str, valid: np.ndarray | None = None) -> Refereed:
    """`actual`'s error against `truth` (the float64 run) in multiples of `expected`'s, row by row (see the module
    docstring).

    Args:
        actual: the judged side's values (ONNX Runtime's).
        expected: the reference's values, computed in `dtype`.
        truth: the float64 run's values, of the same shape.
        kind: the comparison kind, whose ROW_AXES make a row.
        dtype: the precision both sides computed in ("float32", "float16").
        valid: the positions judged, over the leading axes (as metrics.compare takes it); None: all.
    """
    actual, expected, truth = (np.asarray(x, np.float64) for x in (actual, expected, truth))
    judged = np.ones(actual.shape, bool)
    if valid is not None:
        valid = np.asarray(valid, bool)
        judged = np.broadcast_to(valid.reshape(valid.shape + (1,) * (actual.ndim - valid.ndim)), actual.shape)

    def error(side):
        """|side - truth| at the judged elements; 0 where both are NaN (a loss of no targets), inf where one is."""
        with np.errstate(invalid="ignore"):
            difference = np.where(np.isnan(side) & np.isnan(truth), 0.0, np.abs(side - truth))
        return np.where(judged, np.nan_to_num(difference, nan=np.inf), 0.0)

    onnx_error, reference_error = error(actual), error(expected)
    magnitude = np.where(judged & np.isfinite(truth), np.abs(truth), 0.0)
    axes = ROW_AXES.get(kind)
    rows = tuple(range(-axes, 0)) if axes is not None and actual.ndim >= axes else None
    if not actual.size:
        return Refereed(0.0, 0.0, 0.0, REFEREE_LIMIT, dtype)
    row_onnx, row_reference, peak = (x.max(axis=rows) for x in (onnx_error, reference_error, magnitude))
    with np.errstate(divide="ignore", invalid="ignore"):  # a row of zeros (all padding) has no peak: left out
        onnx_relative = np.where(peak > 0, row_onnx / peak, np.where(row_onnx > 0, np.inf, 0.0)).max()
        reference_relative = np.where(peak > 0, row_reference / peak, 0.0).max()
        ratio = onnx_relative / max(reference_relative, UNIT_ROUNDOFF[dtype]) if onnx_relative > 0 else 0.0
    return Refereed(float(onnx_error.max()), float(reference_error.max()), float(ratio), REFEREE_LIMIT, dtype)


def refereed(comparison: Comparison, ratio: Refereed) -> Comparison:
    """`comparison` judged by the referee instead of its fixed profile: passed when the ratio is within the limit.
    A comparison that compared nothing, or sides of other shapes (its `worst` says which), stays failed."""
    if comparison.worst:
        return comparison
    return replace(comparison, passed=ratio.passed, referee=ratio)
