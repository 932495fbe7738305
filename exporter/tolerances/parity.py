"""The parity profiles: the bound an output is held to (Tolerance), and the profiles per dtype and execution provider,
separately for logits, KV and loss, with the user's overrides of single terms or whole kinds.

A profile is data with its reasoning attached (`why`), printed in the reports
and in the README; users override single terms (--atol logits=1e-3) or whole
kinds from a JSON/TOML file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exporter.artifact.paths import read_json_object
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
