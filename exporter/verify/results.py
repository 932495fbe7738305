"""The frozen result objects of a verification; to_dict() is the JSON report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from exporter.runtime.protocol import RuntimeLabel
from exporter.tolerances.parity import AppliedOverrides, Profile
from exporter.verify.checks.calls import LayerError, RoutingFlip
from exporter.verify.checks.faithfulness import Faithfulness
from exporter.verify.checks.greedy import GreedyResult
from exporter.verify.checks.health import HealthReport
from exporter.verify.checks.invariants import Invariant
from exporter.verify.checks.long_context import LongCase
from exporter.verify.checks.outputs import StepError, SweepCase
from exporter.verify.checks.quality import QualityReport
from exporter.verify.checks.routing import ExpertAgreement
from exporter.verify.checks.weights.results import WeightAudit
from exporter.verify.diagnosis.localise import Localisation, ProbeResult
from exporter.verify.metrics import Comparison


@dataclass(frozen=True, kw_only=True)
class ProviderReport:
    provider: str  # the row's name: the execution provider, or the runtime and its configuration
    runtime: RuntimeLabel
    dtype: str
    profile: Profile
    comparisons: list[Comparison]  # prefill and decode summary rows
    greedy: GreedyResult
    curve: list[StepError]  # one point per decode step
    layers: list[LayerError]  # prefill present, per layer
    histogram: dict  # |prefill logit difference|
    sweep: list[SweepCase]
    health: HealthReport
    repeat: Comparison  # a second run of the prefill batch against the first: nondeterminism
    localisation: Localisation
    experts: ExpertAgreement | None = None  # MoE models against the PyTorch reference; None otherwise
    prefill_routing: RoutingFlip | None = None  # MoE: the failing prefill's expert choices
    long_context: list[LongCase] = field(default_factory=list)  # none when turned off or replayed from an old bundle

    @property
    def chain_flips(self) -> list[RoutingFlip]:
        """The failing calls of the prefill and decode checks whose expert choices were compared."""
        return ([self.prefill_routing] if self.prefill_routing else []) + [s.routing for s in self.curve if s.routing]

    @property
    def routing_flips(self) -> list[RoutingFlip]:
        """Every failing call whose expert choices were compared: the prefill, decode steps, sweep calls."""
        return self.chain_flips + [flip for case in self.sweep for flip in case.routing]

    @property
    def passed(self) -> bool:
        return (
            all(c.passed for c in self.comparisons)
            and self.greedy.passed
            and all(c.passed for c in self.sweep)
            and all(c.passed for c in self.long_context)
            and self.health.passed
            and self.repeat.passed
            and (self.experts is None or not self.experts.failed)
        )

    def __bool__(self) -> bool:
        return self.passed

    @property
    def attributed(self) -> bool:
        return self.runtime.attributes(self.passed)

    @property
    def worst_multiple(self) -> float:
        """The largest multiple of its tolerance (Comparison.multiple) among the row's compared outputs: the prefill
        and decode rows, the sweep's and the long positions' cases, the repeat run. Greedy tokens and the outputs'
        health pass or fail without one. NaN where no comparison has one."""
        compared = [
            *self.comparisons,
            *(c for case in [*self.sweep, *self.long_context] for c in (case.logits, case.kv)),
            self.repeat,
        ]
        return max((c.multiple for c in compared if not math.isnan(c.multiple)), default=float("nan"))

    def to_dict(self) -> dict:
        return {
            "provider": self.provider,
            "runtime": self.runtime.to_dict(),
            "dtype": self.dtype,
            "passed": self.passed,
            "attributed": self.attributed,
            "worst_multiple": self.worst_multiple,
            "tolerances": self.profile.to_dict(),
            "comparisons": [c.to_dict() for c in self.comparisons],
            "greedy": self.greedy.to_dict(),
            "decode_curve": [s.to_dict() for s in self.curve],
            "layers": [layer.to_dict() for layer in self.layers],
            "logit_diff_histogram": self.histogram,
            "sweep": [c.to_dict() for c in self.sweep],
            "long_context": [c.to_dict() for c in self.long_context],
            "health": self.health.to_dict(),
            "repeat": {**self.repeat.to_dict(), "deterministic": self.repeat.max_abs == 0},
            "localisation": self.localisation.to_dict(),
            "expert_choice": self.experts.to_dict() if self.experts is not None else None,
            "routing_flips": {
                "failing_calls": len(self.routing_flips),
                "explained": sum(flip.explained for flip in self.routing_flips),
                "prefill": self.prefill_routing.to_dict() if self.prefill_routing else None,
            },
        }


@dataclass(frozen=True)
class ConsumerReport:
    """Another runtime (onnxruntime-genai, transformers.js) loading the folder as it is, against the reference."""

    consumer: str  # name and version
    model_type: str
    greedy: GreedyResult
    eos_dropped: bool = False  # the consumer leaves out the EOS it stops at, so a final EOS is not compared

    @property
    def passed(self) -> bool:
        return self.greedy.passed

    def to_dict(self) -> dict:
        return {
            "consumer": self.consumer,
            "model_type": self.model_type,
            "passed": self.passed,
            "eos_dropped": self.eos_dropped,
            "greedy": self.greedy.to_dict(),
        }


@dataclass(frozen=True)
class IndependentReport:
    """ONNX Runtime, or the toolkit's PyTorch reference, against a reference the toolkit did not write
    (Transformers' own model of the folder the artifact was exported from): the prefill batch and the decode
    steps, as against the PyTorch reference."""

    reference: str  # name and version, e.g. "transformers 5.25.0"
    provider: str | None  # the ONNX Runtime provider compared; None: the toolkit's PyTorch reference was
    source: str  # what the reference loaded (the checkpoint folder)
    comparisons: list[Comparison]

    @property
    def compared(self) -> str:
        """What was compared with the independent reference, in words."""
        return f"ONNX Runtime ({self.provider})" if self.provider else "the pytorch reference"

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons)

    def to_dict(self) -> dict:
        return {
            "reference": self.reference,
            "compared": self.compared,
            "provider": self.provider,
            "source": self.source,
            "passed": self.passed,
            "comparisons": [c.to_dict() for c in self.comparisons],
        }


@dataclass(frozen=True)
class AttributionLeg:
    cause: str  # "export", "provider" or "precision"
    covers: str  # the graph and the inputs compared, e.g. "prefill.onnx, the prefill batch"
    comparison: Comparison  # of the logits

    def to_dict(self) -> dict:
        return {"cause": self.cause, "covers": self.covers, **self.comparison.to_dict()}


@dataclass(frozen=True)
class Attribution:
    """PyTorch fp32 -> ORT CPU fp32 -> ORT CUDA fp32 -> ORT CUDA fp16: each leg's error is one cause (export,
    provider, precision) on the graph and inputs it covers. The export has a leg per graph; the provider and
    precision legs cover the prefill batch."""

    legs: list[AttributionLeg]
    skipped: str = ""  # why some or all legs are missing

    def to_dict(self) -> dict:
        return {"legs": [leg.to_dict() for leg in self.legs], "skipped": self.skipped}


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    folder: str
    reports: list[ProviderReport]
    quality: list[QualityReport] = field(default_factory=list)  # a quantized artifact's, in place of `reports`
    skipped: dict[str, str] = field(default_factory=dict)  # provider -> reason
    consumers: list[ConsumerReport] = field(default_factory=list)
    consumers_skipped: dict[str, str] = field(default_factory=dict)  # consumer -> reason
    independent: list[IndependentReport] = field(default_factory=list)  # independent references compared
    independent_skipped: dict[str, str] = field(default_factory=dict)  # independent reference -> why not
    # check -> why it could not run on this folder (a foreign graph has no loss, say): never counted as passed
    not_checked: dict[str, str] = field(default_factory=dict)
    writer: dict = field(default_factory=dict)  # a foreign folder's writer and contract (ForeignGraph.to_dict)
    reference: str = ""  # what the ONNX side was compared with; "none" for the invariants alone
    invariants: list[Invariant] = field(default_factory=list)
    weights: WeightAudit | None = None  # the initializers against the PyTorch model's parameters; None without one
    # a quantized artifact against the reference holding its own weights; None for a float one or without a model
    faithfulness: Faithfulness | None = None
    cross: list[Comparison] = field(default_factory=list)  # provider against provider
    cross_probes: list[ProbeResult] = field(default_factory=list)
    attribution: Attribution | None = None
    settings: dict = field(default_factory=dict)
    tolerance_overrides: AppliedOverrides = field(default_factory=AppliedOverrides)
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        """ "pass"; "fail"; or "undecided": nothing failed, but a quantized artifact's quality figure has a
        confidence interval across its limit (QualityReport.verdict), which more positions decide. A runner's row
        attributed to a known cause is left out (_judged_rows)."""
        judged = self._judged_rows()
        quality = {row.verdict for row in judged if isinstance(row, QualityReport)}
        if "fail" in quality or not self._others_passed(judged):
            return "fail"
        return "undecided" if "undecided" in quality else "pass"

    @property
    def passed(self) -> bool:
        """Passed, not undecided."""
        return self.verdict == "pass"

    def _judged_rows(self) -> list:
        """The runners' rows (ProviderReport, QualityReport) that carry the verdict: a row that failed with its
        configuration's known cause is left out where a row of the same runtime without one carries it."""
        rows = [*self.reports, *self.quality]
        honest = {row.runtime.name for row in rows if not row.runtime.known_cause}
        return [row for row in rows if not (row.attributed and row.runtime.name in honest)]

    def _others_passed(self, judged: list) -> bool:
        """Something was checked, and every check but the judged quality rows passed."""
        checked = bool(judged) or (self.reference == "none" and bool(self.invariants))
        return (
            checked
            and all(row.passed for row in judged if not isinstance(row, QualityReport))
            and all(c.passed for c in self.consumers)
            and all(r.passed for r in self.independent)
            and all(i.passed for i in self.invariants)
            and (self.weights is None or self.weights.passed)
            and (self.faithfulness is None or self.faithfulness.passed)
            and all(c.passed for c in self.cross)
        )

    def __bool__(self) -> bool:  # else `if verify_artifact(...)` would read true for a failed report, as a dataclass
        return self.passed

    def to_dict(self) -> dict:
        return {
            "folder": self.folder,
            "passed": self.passed,
            "verdict": self.verdict,
            "reference": self.reference,
            "seconds": round(self.seconds, 2),
            "settings": self.settings,
            "tolerance_overrides": self.tolerance_overrides.to_dict(),
            "providers": [r.to_dict() for r in self.reports],
            **({"quality": [q.to_dict() for q in self.quality]} if self.quality else {}),
            "skipped": self.skipped,
            "invariants": [i.to_dict() for i in self.invariants],
            "weight_audit": self.weights.to_dict() if self.weights is not None else None,
            "faithfulness": self.faithfulness.to_dict() if self.faithfulness is not None else None,
            "cross_provider": [c.to_dict() for c in self.cross],
            "cross_provider_probes": [p.to_dict() for p in self.cross_probes],
            "attribution": self.attribution.to_dict() if self.attribution else None,
            "consumers": [c.to_dict() for c in self.consumers],
            "consumers_skipped": self.consumers_skipped,
            "independent_references": [r.to_dict() for r in self.independent],
            "independent_references_skipped": self.independent_skipped,
            **({"foreign": self.writer} if self.writer else {}),
            "not_checked": self.not_checked,
        }
