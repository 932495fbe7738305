"""Tolerances: the bound an output is held to (Tolerance), and the profiles per dtype and execution provider,
separately for logits, KV and loss; the quality profiles of quantized artifacts.

A profile is data with its reasoning attached (`why`), printed in the reports
and in the README; users override single terms (--atol logits=1e-3) or whole
kinds from a JSON/TOML file. The export's own checks and the verification judge by the same profiles, so this
layer sits below both. Data and numpy: no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exporter.artifact.paths import read_json_object
from exporter.artifact.quantization import QualityTarget
from exporter.errors import InputError
from exporter.runtime.providers import CPU, CUDA


@dataclass(frozen=True)
class Tolerance:
    """An element passes when |actual - expected| <= atol + rtol * |expected| + peak * max|expected of its row|.

    The first two terms are numpy.allclose. `peak` scales with the largest
    magnitude in the element's row: rounding errors of a dot product or a norm are
    set by the magnitude of what was summed, so an output near zero inherits an
    absolute error from its large neighbours that no elementwise rtol covers. The
    row is what one computation produced (verify.metrics.ROW_AXES: one position's logits, one
    kv head's keys or values), not the whole tensor: a peak taken over every position
    and head would let a head or a position of small magnitude be off by a share
    of the largest one's size, which its own rounding never explains.
    """

    atol: float
    rtol: float
    peak: float = 0.0

    def allowed(self, expected: np.ndarray, peaks: np.ndarray | None = None) -> np.ndarray:
        """The bound per element of `expected`; `peaks`: each element's row peak (verify.metrics.row_peaks), None:
        the tensor's peak for every element."""
        magnitude = finite_magnitude(expected)
        if peaks is None:
            peaks = magnitude.max() if magnitude.size else 0.0
        return self.atol + self.rtol * magnitude + self.peak * peaks

    def to_dict(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol, "peak": self.peak}


def finite_magnitude(expected: np.ndarray) -> np.ndarray:
    """|expected| with NaN and infinities as 0: one infinite value must not make every bound infinite."""
    return np.abs(np.where(np.isfinite(expected), expected, 0.0))


KINDS = ("logits", "kv", "loss")
TERMS = ("atol", "rtol", "peak")
FP16_UNIT_ROUNDOFF = 2.0**-11  # u: float16 keeps 11 significant bits
FP32_UNIT_ROUNDOFF = 2.0**-24  # float32 keeps 24


@dataclass(frozen=True)
class Profile:
    name: str
    logits: Tolerance
    kv: Tolerance
    loss: Tolerance
    why: str
    overridden: tuple[str, ...] = ()  # "logits.atol", ... set by the user

    def __getitem__(self, kind: str) -> Tolerance:
        return getattr(self, kind)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            **{kind: self[kind].to_dict() for kind in KINDS},
            "why": self.why,
            "overridden": list(self.overridden),
        }


_U = FP16_UNIT_ROUNDOFF
_U32 = FP32_UNIT_ROUNDOFF
# float32 on the CPU: both sides compute in float32 with different kernels and summation orders, so each
# carries float32's own rounding error and they differ by up to about the sum of the two. That error is
# set by the magnitudes summed, so it is bounded in units of the row's peak (u = 2^-24): the PyTorch
# reference in float32 against itself in float64 stays within ~140u of the logits' peak on the presets
# (docs/verification.md). Allowed: 512u of the peak (~2x the sum of two such errors) and nothing else; for
# logits peaking at 12 that is 3.7e-4, still 3 orders of magnitude below what a wrong graph gives (a wrong
# mask, position or weight moves logits by O(1)). No absolute term: one fitted to a model with small logits
# is tighter than float32's own error on a model with larger ones. No elementwise term: at the top logit it
# would widen the bound enough to pass faults such as one weight matrix off by a relative 1e-4 or every
# logit scaled by 1.0001. The loss is one float32 mean of ~ln(vocab) magnitude whose errors average out:
# 1e-5 + 1e-5|x| leaves wide headroom over them and still catches a perplexity change of 0.01% (at a loss
# of ln(vocab): 7e-5 for 512 tokens, 1e-4 for 6400).
_FP32_ACTIVATIONS = Tolerance(0.0, 0.0, 512 * _U32)
_CPU_FP32 = Profile(
    "float32/CPU",
    logits=_FP32_ACTIVATIONS,
    kv=_FP32_ACTIVATIONS,
    loss=Tolerance(1e-5, 1e-5),
    why="float32 on both sides, each with float32's own rounding error (measured against float64: up to "
    "139u of the logits peak, minimind2-small); allowed 512u of the peak, while a wrong graph moves "
    "logits by O(1)",
)
# float16: every stored activation is rounded to 11 significant bits and the two sides round at different
# points (ONNX Runtime's CPU provider upcasts many ops to float32, PyTorch keeps float16), so their
# difference is as large as float16's own loss against float32, about 7u of the logits' peak
# (docs/verification.md). Allowed: 16u of the row's peak (verify.metrics.ROW_AXES) plus 4u elementwise. The loss is
# computed in float32 from float16 logits; its error averages over positions: 2e-3 + 4u|x|.
_FP16_ACTIVATIONS = Tolerance(1e-3, 4 * _U, 16 * _U)
_CPU_FP16 = Profile(
    "float16/CPU",
    logits=_FP16_ACTIVATIONS,
    kv=_FP16_ACTIVATIONS,
    loss=Tolerance(2e-3, 4 * _U),
    why="float16 rounds every activation to 11 bits at different points on each side; measured ~7u of the "
    "logits peak, allowed 16u of the peak + 4u elementwise",
)
# CUDA float32: every session turns TF32 off (exporter.runtime.providers.session_providers), so the CUDA provider
# computes in float32 with its own kernels and summation orders: the CPU argument and bound, not calibrated
# on a GPU.
_CUDA_FP32 = dataclasses.replace(
    _CPU_FP32, name="float32/CUDA", why=_CPU_FP32.why + " (TF32 off; the CPU's reasoning, not calibrated on a GPU)"
)
# CUDA float16: fused kernels accumulate in float32 like the CPU provider's upcasts; the same rounding
# argument as float16/CPU applies; not calibrated on a GPU.
_CUDA_FP16 = dataclasses.replace(
    _CPU_FP16, name="float16/CUDA", why=_CPU_FP16.why + " (the CPU's reasoning, not calibrated on a GPU)"
)

PROFILES: dict[tuple[str, str], Profile] = {
    ("float32", CPU): _CPU_FP32,
    ("float16", CPU): _CPU_FP16,
    ("float32", CUDA): _CUDA_FP32,
    ("float16", CUDA): _CUDA_FP16,
}


def profile_for(dtype: str, provider: str = CPU) -> Profile:
    """The profile of (dtype, provider); a provider without its own profile gets the stricter CPU one."""
    return PROFILES.get((dtype, provider)) or PROFILES[(dtype, CPU)]


@dataclass(frozen=True)
class Overrides:
    """User-set tolerance terms, applied on top of every profile: (("logits", "atol", 1e-3), ...)."""

    terms: tuple[tuple[str, str, float], ...] = ()

    def apply(self, profile: Profile) -> Profile:
        if not self.terms:
            return profile
        values = {kind: profile[kind].to_dict() for kind in KINDS}
        for kind, term, value in self.terms:
            values[kind][term] = value
        return dataclasses.replace(
            profile, **{kind: Tolerance(**values[kind]) for kind in KINDS}, overridden=tuple(self.to_dict())
        )

    def to_dict(self) -> dict:
        """{"logits.atol": 1e-3, ...}; a term set twice (in a file, then on the command line) keeps its last value."""
        return {f"{kind}.{term}": value for kind, term, value in self.terms}

    @classmethod
    def from_dict(cls, data, where: str) -> Overrides:
        """to_dict's form read back (from a golden bundle); InputError names `where` when it is not that."""
        if not isinstance(data, dict):
            raise InputError(f'{where}: expected a table of tolerance terms like {{"logits.atol": 1e-3}}, got {data!r}')
        terms = []
        for name, value in data.items():
            kind, _, term = name.partition(".")
            if term not in TERMS:
                raise InputError(
                    f"{where}: {name!r} is no tolerance term; write KIND.TERM, TERM one of {', '.join(TERMS)}"
                )
            terms.append((_kind(kind, where), term, _value(value, f"{where} {name}")))
        return cls(tuple(terms))


@dataclass(frozen=True)
class AppliedOverrides:
    """The overrides a verification judges with, and where each came from: `given` for this run (options or
    file) and, on a golden replay, `recorded` in the bundle (None when no bundle is replayed).

    A replay applies the recorded terms, so that it judges as the recording did, and a given term takes the
    place of the recorded one of the same KIND.TERM while the other recorded terms stay. Term by term, not
    refused and not all-or-nothing: each term is its own bound, so terms of different names never conflict,
    and for one name the given value is the user's explicit, later choice (tightening logits.peak on a
    bundle recorded with a loosened kv.atol asks for that one change); the report names each term's origin,
    so no mix goes unseen. To replay a term with the profile's own value, give that value."""

    given: Overrides = Overrides()
    recorded: Overrides | None = None

    @property
    def overrides(self) -> Overrides:
        if self.recorded is None:
            return self.given
        replaced = self.given.to_dict()
        kept = tuple(
            (kind, term, value) for kind, term, value in self.recorded.terms if f"{kind}.{term}" not in replaced
        )
        return Overrides(kept + self.given.terms)

    def describe(self) -> str:
        """Each applied term with its value and origin, e.g. "logits.atol=0.001 (recorded in the golden bundle),
        kv.peak=0 (given, in place of the bundle's 0.0001)"; '' when none applies."""
        recorded = {} if self.recorded is None else self.recorded.to_dict()
        given = self.given.to_dict()

        def origin(name: str) -> str:
            if name not in given:
                return "recorded in the golden bundle"
            return f"given, in place of the bundle's {recorded[name]:g}" if name in recorded else "given"

        return ", ".join(f"{name}={value:g} ({origin(name)})" for name, value in self.overrides.to_dict().items())

    def to_dict(self) -> dict:
        return {
            "applied": self.overrides.to_dict(),
            "given": self.given.to_dict(),
            "recorded_in_golden_bundle": None if self.recorded is None else self.recorded.to_dict(),
        }


def _value(text, where: str) -> float:
    try:
        if isinstance(text, bool):  # a JSON or TOML true is not a tolerance
            raise TypeError
        value = float(text)
    except (TypeError, ValueError):
        raise InputError(f"{where}: {text!r} is not a number; write e.g. logits=1e-3 (`atol`)") from None
    if not 0 <= value < math.inf:
        raise InputError(f"{where}: tolerances must be finite and >= 0, got {text!r}")
    return value


def _kind(kind: str, where: str) -> str:
    if kind not in KINDS:
        raise InputError(f"{where}: unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    return kind


def parse_overrides(atol=(), rtol=(), peak=(), file: Path | None = None) -> Overrides:
    """Tolerance overrides from `KIND=VALUE` strings per term and/or a file; the strings win over the file's.

    Args:
        atol: `KIND=VALUE` strings for the atol term (e.g. ["logits=1e-3"]); a lone str is one string.
        rtol: the same for the rtol term.
        peak: the same for the peak term.
        file: a JSON or .toml file of {kind: {term: value}}, or None.

    Returns:
        The Overrides, the file's terms first.

    Raises:
        InputError: an unknown kind or term, a value that is not finite and >= 0, or one term given twice
            with two values.
    """
    terms: list[tuple[str, str, float]] = []
    if file is not None:
        data = read_json_object(
            file, InputError, "tolerance file", 'give a JSON or .toml file like {"logits": {"atol": 1e-3}}', toml=True
        )
        for kind, entry in data.items():
            _kind(kind, str(file))
            unknown = sorted(set(entry) - set(TERMS)) if isinstance(entry, dict) else []
            if unknown:
                raise InputError(
                    f"{file}: {kind} holds an unknown term {unknown[0]!r}; choose among {', '.join(TERMS)}"
                )
            if not isinstance(entry, dict):
                raise InputError(f"{file}: {kind} must map some of {', '.join(TERMS)} to numbers")
            terms += [(kind, term, _value(value, f"{file} {kind}.{term}")) for term, value in entry.items()]
    given: dict[tuple[str, str], float] = {}  # (kind, term) -> value, of the command-line terms
    for term, items in (("atol", atol), ("rtol", rtol), ("peak", peak)):
        for item in [items] if isinstance(items, str) else items:  # iterated, a str would be one term per character
            kind, sep, value = item.partition("=") if isinstance(item, str) else (item, "", "")
            if not sep:
                raise InputError(f"`{term}` {item!r}: expected KIND=VALUE, e.g. logits=1e-3")
            where = f"`{term}` {item}"
            key, number = (_kind(kind.strip(), where), term), _value(value.strip(), where)
            if given.get(key, number) != number:  # else the last one would win, silently
                raise InputError(
                    f"{where}: {key[0]}'s {term} is given twice ({given[key]:g} and {number:g}); give it once"
                )
            given[key] = number
            terms.append((*key, number))
    return Overrides(tuple(terms))


# The CPU profile per dtype, as {dtype: {"logits": Tolerance, "kv": ..., "loss": ...}}.
TOLERANCES = {
    dtype: {kind: profile[kind] for kind in ("logits", "kv", "loss")}
    for (dtype, provider), profile in PROFILES.items()
    if provider == CPU
}


# ------------------------------------------------------------------------------------- quantized artifacts
#
# A weight-only quantized artifact (manifest `quantization`) cannot meet a float32 profile: rounding every weight to
# 4 or 8 bits moves the logits by far more than float32's rounding, by design. It is judged instead by how far its
# next-token distributions lie from the float32 PyTorch reference's, with the statistics llama.cpp's
# `perplexity --kl-divergence` reports for its quantization types (mean and 99th-percentile KL divergence per token,
# "same top p", the change in perplexity), plus the top-5 overlap, the change of the log-probability the reference
# gives its own top token, and how many greedy tokens agree. The anchors are llama.cpp's published figures for
# 7-8B models on wikitext (its perplexity README and the KL tables of its quantization pull requests):
# Q8_0 (8 bits, blocks of 32, one scale) mean KL ~5e-4 to 1e-3, 99% KL ~5e-3 to 1e-2, same top ~98.5-99.5%,
# ΔPPL ~+0.01-0.1%; Q4_0/Q4_1 (4 bits, blocks of 32; Q4_1 with a minimum, as our asymmetric blocks) mean KL
# ~0.03-0.07, 99% KL ~0.3-0.6, same top ~90-93%, ΔPPL ~+2-6%. Our int8 and int4 are those block formats (round to
# nearest, block 32 by default), so each limit is the anchor's worse end with a margin of about 2-5x for the
# spread between models and texts: a correct export of a normal model lies well inside, while a broken one (a scale
# or zero point off, a block misaligned, the wrong matrix) moves the distributions by O(1) nats.


@dataclass(frozen=True)
class QualityThreshold:
    """One distributional metric's limit: `metric` must be <= `limit` ("at most"), >= it ("at least"), or within
    +-`limit` ("within +-": a change that is suspect either way)."""

    metric: str
    limit: float
    bound: str  # "at most", "at least" or "within +-"
    why: str

    def holds(self, value: float) -> bool:
        if self.bound == "within +-":
            return abs(value) <= self.limit
        return value <= self.limit if self.bound == "at most" else value >= self.limit

    def holds_over(self, low: float, high: float) -> bool | None:
        """Whether the limit holds over the whole interval [low, high] (True), at none of it (False), or at part
        of it (None: the interval straddles the limit). The values that hold form one interval, so both ends
        holding means all of it does."""
        if self.holds(low) and self.holds(high):
            return True
        if self.bound == "within +-":
            apart = high < -self.limit or low > self.limit
        else:
            apart = not self.holds(low if self.bound == "at most" else high)
        return False if apart else None

    def multiple(self, value: float) -> float:
        """`value`'s error in multiples of what the limit allows, at most 1 exactly where it holds: value / limit
        ("at most"), |value| / limit ("within +-"); an "at least" limit is on a share of agreement (top-1, top-5,
        greedy tokens), whose error is its shortfall from full agreement: (1 - value) / (1 - limit)."""
        if self.bound == "at least":
            return (1 - value) / (1 - self.limit)
        return (abs(value) if self.bound == "within +-" else value) / self.limit

    def to_dict(self) -> dict:
        return {"metric": self.metric, "limit": self.limit, "bound": self.bound, "why": self.why}


@dataclass(frozen=True)
class QualityProfile:
    """The distributional limits of one quantization scheme, with their reasoning."""

    name: str
    thresholds: tuple[QualityThreshold, ...]
    why: str

    def to_dict(self) -> dict:
        return {"name": self.name, "thresholds": [t.to_dict() for t in self.thresholds], "why": self.why}


_QUALITY_WHY = (
    "weight-only {scheme}: judged by distributional distance from the float32 PyTorch reference, anchored on "
    "llama.cpp's perplexity --kl-divergence figures for {anchor} (limits = the anchor's worse end x2-5)"
)
GREEDY_QUALITY_TOKENS = 64  # the greedy run of a quality profile, fitted to the model's positions
# Top-1 agreement, top-5 overlap and the greedy run measure how often the quantization flips the reference's choice,
# which depends on how decisive the reference is as much as on the quantization: at a near-tie any perturbation
# flips it. llama.cpp's "same top p" is measured on trained models over real text, where most positions are
# decisive. They are judged here at the positions where the reference's top token leads the runner-up by at least
# DECISIVE_MARGIN nats (1.65x its probability): int4's measured |Δ log p| of the top token is ~0.15 nats (tiny
# random model, block 32), so two tokens' log-probabilities drifting independently differ by ~0.2; 0.5 nats is
# ~2.5 of those, beyond which a flip is the export's doing rather than a coin toss. A randomly initialised model is
# nearly uniform (top token ~2% on 512 tokens, median margin ~0.18 nats): with fewer than MIN_DECISIVE_POSITIONS
# decisive positions these checks are reported as not judged, and KL and ΔNLL alone judge it. On the trained fixture
# (tests/fixtures/minimind-3-stdlib, benchmarks/quality.py) ~48% of positions are decisive, int4's |Δ log p| is
# ~0.04-0.06 and every top-1 flip falls below the margin (top-1 96.7% overall, 100% at decisive positions); its
# KL lies 40-100x inside the limits below, which stay anchored on llama.cpp's figures for real models.
DECISIVE_MARGIN = 0.5
MIN_DECISIVE_POSITIONS = 16
# Each figure averaged over positions is judged by its bootstrap confidence interval over those positions, as
# llama.cpp's perplexity --kl-divergence gives each figure with its uncertainty: a figure passes where the whole
# interval keeps its limit, fails where none of it does, and is undecided where the interval straddles the limit
# (more positions, a longer text, decide it). 95% over 1000 resamples: the interval's ends move by about 2% of its
# width from one seed of the resampling to another.
QUALITY_CONFIDENCE = 0.95
QUALITY_RESAMPLES = 1000

QUALITY_PROFILES: dict[str, QualityProfile] = {
    "int8": QualityProfile(
        "int8 quality",
        (
            QualityThreshold("kl_mean", 5e-3, "at most", "Q8_0: mean KL 5e-4..1e-3; x5"),
            QualityThreshold("kl_p99", 5e-2, "at most", "Q8_0: 99% KL 5e-3..1e-2; x5"),
            QualityThreshold(
                "top1_agreement_decisive", 0.97, "at least", "Q8_0: same top p 98.5-99.5%; 1.5 points lower"
            ),
            QualityThreshold(
                "top5_overlap_decisive", 0.97, "at least", "as top-1, at positions whose 5th token leads the 6th"
            ),
            QualityThreshold(
                "top_logprob_delta_mean",
                0.045,
                "at most",
                "|Δ log p| of the reference's top token; of the order of sqrt(2 x mean KL) for small shifts: "
                "sqrt(2 x 1e-3) at Q8_0's worse end",
            ),
            QualityThreshold(
                "nll_delta",
                0.01,
                "within +-",
                "Q8_0: ΔPPL +0.01..0.1%; 1% perplexity (0.01 nats) is 10x that, either way: a loss that drops by more "
                "than the scheme's noise is no better model but a different one (a scale or a head changed)",
            ),
            QualityThreshold(
                "greedy_agreement",
                0.25,
                "at least",
                "share of the 64 greedy tokens equal before the first difference; with same top p ~99% per step, "
                "an expected first flip after ~100 tokens, yet one near-tie ends it early: a quarter",
            ),
        ),
        _QUALITY_WHY.format(scheme="int8 (8-bit blocks of 32, scale + zero point)", anchor="Q8_0"),
    ),
    "int4": QualityProfile(
        "int4 quality",
        (
            QualityThreshold("kl_mean", 0.15, "at most", "Q4_0/Q4_1: mean KL 0.03..0.07; x2-5"),
            QualityThreshold("kl_p99", 1.5, "at most", "Q4_0/Q4_1: 99% KL 0.3..0.6; x2.5-5"),
            QualityThreshold(
                "top1_agreement_decisive", 0.85, "at least", "Q4_0/Q4_1: same top p 90-93%; 5 points lower"
            ),
            QualityThreshold(
                "top5_overlap_decisive", 0.85, "at least", "as top-1, at positions whose 5th token leads the 6th"
            ),
            QualityThreshold(
                "top_logprob_delta_mean",
                0.25,
                "at most",
                "|Δ log p| of the reference's top token; of the order of sqrt(2 x mean KL) for small shifts: "
                "sqrt(2 x 0.03) at Q4's better end, as the top token moves less than the tail",
            ),
            QualityThreshold(
                "nll_delta",
                0.10,
                "within +-",
                "Q4_0/Q4_1: ΔPPL +2..6%; 10% perplexity (0.1 nats), either way (as int8's)",
            ),
            QualityThreshold(
                "greedy_agreement",
                1 / 16,
                "at least",
                "share of the 64 greedy tokens equal before the first difference; with same top p ~90% per step "
                "the first flip is expected after ~10 tokens, so only the first few (4 of 64) are required",
            ),
        ),
        _QUALITY_WHY.format(scheme="int4 (4-bit blocks of 32, scale + zero point)", anchor="Q4_0/Q4_1"),
    ),
}


# An artifact made to a quality target (exporter.tuning: `export --quality-target kl=X[,top1=Y]`) is judged by the
# target in place of the profile's limits on the same figures: the target is the user's statement of the loss they
# accept, which the export measured on held-out text and records. Its mean KL is held to X, and its top-1 agreement
# over every position, where given, to Y. The profile's other limits stay: they catch a broken export, which moves
# every figure by O(1) nats, whatever the target.
TARGET_WHY = "the quality target the export was made to (exporter.tuning), in place of the profile's limit"


def target_thresholds(target: QualityTarget) -> tuple[QualityThreshold, ...]:
    """A quality target's limits as thresholds of the quality check's figures, in target.limits()' order."""
    bounds = {"kl_mean": "at most", "top1_agreement": "at least"}
    return tuple(
        QualityThreshold(metric, limit, bounds[metric], TARGET_WHY) for metric, limit in target.limits().items()
    )


def quality_profile_for(scheme: str, target: QualityTarget | None = None) -> QualityProfile:
    """The quality profile of a quantization scheme ("int4", "int8"), with `target`'s limits in place of the
    profile's on the same figures where the artifact was made to one; the provider does not change it: the
    quantization's error dwarfs any provider's rounding."""
    profile = QUALITY_PROFILES[scheme]
    if target is None:
        return profile
    added = target_thresholds(target)
    kept = tuple(t for t in profile.thresholds if t.metric not in target.limits())
    return QualityProfile(
        f"{profile.name}, target {target.describe()}",
        added + kept,
        f"{profile.why}; the export's quality target {target.describe()} in place of its limits on those figures",
    )
