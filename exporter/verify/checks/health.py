"""fp16 health: values that a NaN check alone misses.

A float16 norm that overflows can return zeros or saturate instead of NaN
(onnxruntime #29034). So ONNX Runtime's outputs are scanned for NaN, Inf and
all-zero rows, and the intermediate activations of a debug copy of
prefill.onnx for how close they come to float16's largest finite value (65504),
for values saturated at +-65504, and for Inf.

The one infinity a correct float16 graph may hold is its attention mask's fill:
-inf (the export's causal mask; its padding bias of -1e9 also rounds to -inf in
float16), in a value computed from that fill before the softmax consumes it
(DebugGraph.mask_fed). The export never fills with float16's lowest finite
value, so -65504, like +65504, is a saturated value, and -Inf anywhere else is
an overflow.

Where padding matters: NaN or Inf fails in a present at any position, padded
ones included (a later step weighs a padded key by zero, and 0 x NaN is NaN,
so it reaches the real tokens), and in logits at real query positions only (a
padded query's logits are read by nothing: noted, not failed). All-zero rows
fail at real positions only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from exporter.verify.metrics import real_keys, real_queries

FP16_MAX = 65504.0
# Flag activations within 16x (4 binades) of the limit: a norm's sum of squares of such values overflows.
HEADROOM_WARN = 16.0
MAX_LISTED = 12  # issues listed per report; the counts cover all


@dataclass(frozen=True)
class HealthReport:
    dtype: str
    passed: bool
    nan: int
    inf: int
    saturated: int  # float16 activations at +-65504
    zero_rows: int
    output_max_abs: float
    activation_max_abs: float | None  # over float16 activations; None: none scanned (a float32 export)
    activation_at: str  # the tensor holding activation_max_abs
    issues: list[str] = field(default_factory=list)  # failures: NaN, Inf, saturated values, zero rows
    warnings: list[str] = field(default_factory=list)  # close to the float16 limit; NaN/Inf in padded logits

    @property
    def headroom(self) -> float | None:
        """How many times the largest activation (or output) could grow before float16 overflows."""
        peak = self.activation_max_abs if self.activation_max_abs is not None else self.output_max_abs
        return FP16_MAX / peak if peak > 0 else None

    def to_dict(self) -> dict:
        return {
            "dtype": self.dtype,
            "passed": self.passed,
            "nan": self.nan,
            "inf": self.inf,
            "saturated": self.saturated,
            "zero_rows": self.zero_rows,
            "output_max_abs": self.output_max_abs,
            "activation_max_abs": self.activation_max_abs,
            "activation_at": self.activation_at,
            "fp16_headroom": self.headroom,
            "issues": self.issues,
            "warnings": self.warnings,
        }


class HealthScan:
    """Accumulates over every ONNX Runtime output a verification sees; `report()` gives the verdict."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.nan = self.inf = self.saturated = self.zero_rows = 0
        self.output_max = 0.0
        self.activation_max: float | None = None
        self.activation_at = ""
        self.issues: list[str] = []
        self.warnings: list[str] = []

    def _issue(self, text: str) -> None:
        if len(self.issues) < MAX_LISTED:
            self.issues.append(text)

    def scan_outputs(self, label: str, outputs: dict, mask: np.ndarray) -> None:
        """`mask` (B, total) marks real tokens: logits cover its last T columns, present tensors all of it."""
        for name, value in outputs.items():
            value, where = np.asarray(value, np.float32), f"{label} {name}"
            if value.ndim == 3:  # logits (B, T, V)
                real = real_queries(mask, value.shape[1])
                self._note_padded_logits(where, value[~real])
                self._scan_values(where, value[real], np.empty(0, np.float32))
                zero = np.all(value == 0, axis=-1) & real
            elif value.ndim == 4:  # present (B, Hkv, L, D)
                keys = real_keys(mask)
                real = np.broadcast_to(keys[..., None], value.shape)
                self._scan_values(where, value[real], value[~real])
                zero = np.any(np.all(value == 0, axis=-1), axis=1) & keys[:, 0]  # a zero row in any head
            else:  # the loss
                self._scan_values(where, value, np.empty(0, np.float32))
                continue
            if zero.any():
                self.zero_rows += int(zero.sum())
                self._issue(f"{where}: {int(zero.sum())} all-zero rows at real token positions")

    def _scan_values(self, where: str, real: np.ndarray, padded: np.ndarray) -> None:
        """NaN and Inf fail at real positions and at a present's padded ones: a later step weighs a padded key
        by zero, and 0 x NaN is NaN."""
        values = np.concatenate([real.ravel(), padded.ravel()])
        nan, inf = int(np.isnan(values).sum()), int(np.isinf(values).sum())
        if nan or inf:
            self.nan, self.inf = self.nan + nan, self.inf + inf
            at_padded = int((~np.isfinite(padded)).sum())
            self._issue(
                f"{where}: {nan} NaN, {inf} Inf"
                + (
                    f" ({at_padded} at padded positions, which a later step weighs by zero: 0 x NaN is NaN)"
                    if at_padded
                    else ""
                )
            )
        finite = values[np.isfinite(values)]
        if finite.size:
            self.output_max = max(self.output_max, float(np.abs(finite).max()))

    def _note_padded_logits(self, where: str, padded: np.ndarray) -> None:
        """A padded query's logits are read by nothing: NaN or Inf there is noted, not failed."""
        nan, inf = int(np.isnan(padded).sum()), int(np.isinf(padded).sum())
        if (nan or inf) and len(self.warnings) < MAX_LISTED:
            self.warnings.append(f"{where}: {nan} NaN, {inf} Inf at padded query positions, which no token reads")

    def scan_activations(
        self, values: dict, producers: dict | None = None, mask_fed: frozenset[str] = frozenset()
    ) -> None:
        """Intermediate tensors of the debug graph: NaN in any; in those held in float16 (the ones that can
        overflow; a float32 attention bias of -1e9 cannot), Inf, values saturated at +-65504, and the largest
        finite magnitude. -Inf is the mask's fill in the values `mask_fed` names, and an overflow elsewhere.
        An overflow need not reach the outputs: ONNX Runtime's CPU provider computes float16 ops such as a
        norm's Pow and ReduceMean in float32 and rounds only the tensors this debug copy exposes, so a norm
        whose float16 statistics overflow (|x| > 256 squared) gives right outputs on the CPU, while computed in
        float16 as declared (PyTorch does) every normalised row, and so every key, is zero.
        `producers` names each tensor's operator and module for the messages."""
        peak, where, scanned = 0.0, "", False
        producers = producers or {}
        for name, value in values.items():
            nan = int(np.isnan(value).sum())
            at = f" ({producers[name]})" if name in producers else ""
            if nan:
                self.nan += nan
                self._issue(f"activation {name}{at}: {nan} NaN")
            if value.dtype != np.float16:
                continue
            scanned = True
            positive = int(np.isposinf(value).sum())
            negative = 0 if name in mask_fed else int(np.isneginf(value).sum())
            if positive or negative:
                self.inf += positive + negative
                counts = ", ".join(f"{count} {sign}Inf" for count, sign in ((positive, "+"), (negative, "-")) if count)
                self._issue(
                    f"activation {name}{at}: {counts}, float16 overflow (beyond {FP16_MAX:g}); compute it in float32"
                )
            magnitude = np.abs(value[np.isfinite(value)].astype(np.float32))
            saturated = int((magnitude == FP16_MAX).sum())
            if saturated:
                self.saturated += saturated
                self._issue(
                    f"activation {name}{at}: {saturated} at +-{FP16_MAX:g}, saturated at float16's limit "
                    "(an overflow held there instead of Inf); compute it in float32"
                )
            if magnitude.size and magnitude.max() > peak:
                peak, where = float(magnitude.max()), name
        if scanned:
            self.activation_max, self.activation_at = peak, where

    def report(self) -> HealthReport:
        peak = self.activation_max if self.activation_max is not None else self.output_max
        warnings = list(self.warnings)
        if peak * HEADROOM_WARN >= FP16_MAX:
            where = self.activation_at or "the outputs"
            message = (
                f"largest value {peak:.4g} at {where} is within {HEADROOM_WARN:g}x of float16's limit {FP16_MAX:g}"
            )
            warnings.append(message + ("" if self.dtype == "float16" else " (matters for a float16 export)"))
        return HealthReport(
            self.dtype,
            not (self.issues or self.nan or self.inf or self.saturated or self.zero_rows),
            self.nan,
            self.inf,
            self.saturated,
            self.zero_rows,
            self.output_max,
            self.activation_max,
            self.activation_at,
            list(self.issues),
            warnings,
        )
