"""Pure comparison functions returning frozen result objects (no torch, no onnxruntime).

Every comparison reports the elementwise error figures (max and mean abs, max
rel, cosine similarity), the pass/fail verdict against a Tolerance, and the
smallest tolerance that would have passed. Logits add the LLM-level figures
(top-1 agreement, top-k overlap, KL divergence between the softmax
distributions), the loss its abs difference and the perplexity ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from exporter.tolerances.parity import Tolerance, finite_magnitude

TOP_K = 5


@dataclass(frozen=True)
class Needed:
    """The smallest tolerance that would have passed: each figure with the other two terms kept as given.

    scale: the factor the whole tolerance would need (below 1 is headroom).
    """

    atol: float
    rtol: float
    scale: float

    def to_dict(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol, "scale": self.scale}

    @staticmethod
    def worst(items: list[Needed]) -> Needed:
        return Needed(max(n.atol for n in items), max(n.rtol for n in items), max(n.scale for n in items))


NOTHING_NEEDED = Needed(0.0, 0.0, 0.0)
NOTHING_COMPARED = "nothing compared: no position was left to judge"


@dataclass(frozen=True)
class Refereed:
    """A comparison judged against the float64 referee."""

    onnx_error: float  # max |actual - float64| over the judged elements
    reference_error: float  # max |expected - float64|
    ratio: float  # the worst row's ratio (module docstring)
    limit: float
    dtype: str  # the precision both sides computed in

    @property
    def passed(self) -> bool:
        return bool(self.ratio <= self.limit)

    def describe(self) -> str:
        return f"error against float64 {self.ratio:.2g}x the reference's own {self.dtype} error (limit {self.limit:g}x)"

    def to_dict(self) -> dict:
        return {
            "onnx_error": self.onnx_error,
            "reference_error": self.reference_error,
            "ratio": self.ratio,
            "limit": self.limit,
            "dtype": self.dtype,
            "passed": self.passed,
            "describe": self.describe(),
        }


@dataclass(frozen=True)
class Comparison:
    name: str
    kind: str  # "logits", "kv", "loss" or "activation"
    max_abs: float
    max_rel: float
    mean_abs: float
    tolerance: Tolerance
    passed: bool
    worst: str = ""  # for an aggregate: the member with the largest error; for a shape mismatch: the shapes
    cosine: float = 1.0
    needed: Needed = NOTHING_NEEDED
    llm: dict = field(default_factory=dict)  # logits: top1_agreement, topk_overlap, kl_mean, kl_max; loss: ...
    # judged against the float64 referee in place of the tolerance (exporter.verify.checks.referee); None: it was not
    referee: Refereed | None = None
    members_multiple: float | None = None  # an aggregate's: its members' largest multiple; None: not an aggregate

    def __bool__(self) -> bool:
        return self.passed

    @property
    def multiple(self) -> float:
        """The error in multiples of what its judgement allows, at most 1 where it passed: the float64 referee's
        ratio over its limit where the referee judged it, else needed.scale (the factor the fixed tolerance would
        need); an aggregate's, the largest of its members' (members_multiple), each judged its own way. A
        comparison that compared nothing has no error to scale: NaN, and failed."""
        if self.members_multiple is not None:
            return self.members_multiple
        if self.worst == NOTHING_COMPARED:
            return float("nan")
        return self.needed.scale if self.referee is None else self.referee.ratio / self.referee.limit

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "mean_abs": self.mean_abs,
            "cosine": self.cosine,
            "tolerance": self.tolerance.to_dict(),
            "needed": self.needed.to_dict(),
            "multiple": self.multiple,
            "passed": self.passed,
            "worst": self.worst,
            "referee": None if self.referee is None else self.referee.to_dict(),
            **self.llm,
        }


# The trailing axes of one row, over which a Tolerance's peak is taken, per comparison kind: logits
# (B, T, V) per position; presents (B, kv_heads, L, head_dim) per kv head, over its positions; a layer's
# activations (B, T, hidden) per position. The loss is one number.
ROW_AXES = {"logits": 1, "kv": 2, "activation": 1}


def row_peaks(expected: np.ndarray, kind: str, judged: np.ndarray | None = None) -> np.ndarray:
    """Each element's row peak: the largest finite |expected| among the judged elements of its row (ROW_AXES
    of `kind`; the whole tensor for a kind without rows), broadcast to `expected`'s shape.

    Args:
        expected: the reference's values.
        kind: the comparison kind, a key of ROW_AXES or another (one row).
        judged: elements judged, of `expected`'s shape; the others (padding) do not raise a row's peak.
    """
    magnitude = finite_magnitude(expected)
    if judged is not None:
        magnitude = np.where(judged, magnitude, 0.0)
    axes = ROW_AXES.get(kind)
    if axes is None or magnitude.ndim < axes or not magnitude.size:
        return np.full(magnitude.shape, magnitude.max() if magnitude.size else 0.0)
    return np.broadcast_to(magnitude.max(axis=tuple(range(-axes, 0)), keepdims=True), magnitude.shape)


def _needed(diff: np.ndarray, expected: np.ndarray, tolerance: Tolerance, peaks: np.ndarray) -> Needed:
    magnitude = finite_magnitude(expected)
    peak = tolerance.peak * peaks
    atol = float(np.max(diff - tolerance.rtol * magnitude - peak))
    rest = diff - tolerance.atol - peak
    with np.errstate(divide="ignore", invalid="ignore"):
        rtol = np.where(rest > 0, rest / magnitude, 0.0)  # inf where the expected value is 0
        scale = np.where(diff > 0, diff / tolerance.allowed(expected, peaks), 0.0)
    return Needed(max(atol, 0.0), float(np.max(rtol)), float(np.max(scale)))


def _cosine(actual: np.ndarray, expected: np.ndarray) -> float:
    a, e = actual.ravel(), expected.ravel()
    if not (np.isfinite(a).all() and np.isfinite(e).all()):
        return float("nan")
    norm = np.linalg.norm(a) * np.linalg.norm(e)
    return float(a @ e / norm) if norm > 0 else float(np.array_equal(a, e))


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _kl(log_q: np.ndarray, log_p: np.ndarray) -> np.ndarray:
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    return np.maximum(kl, 0.0)  # a float64 sum of a true KL of ~1e-17 can round below zero


def token_statistics(actual: np.ndarray, expected: np.ndarray, k: int = TOP_K, targets=None) -> dict:
    """Per-position figures of two logits arrays (N, V), in float64: KL(expected || actual), argmax agreement,
    top-k overlap ("top5", k capped at the vocabulary), |Δ log p| of the expected's top token, and how far the
    expected's top-1 and k-th tokens lead the next ("margin", "margin_k"). With `targets` (N,), the id that
    follows each position (negative where none is known): each side's negative log-likelihood of it ("nll" of
    `actual`, "nll_expected"), NaN where none is known."""
    log_q = log_softmax(np.asarray(actual, np.float64))
    log_p = log_softmax(np.asarray(expected, np.float64))
    top = log_p.argmax(-1)
    k = min(k, log_p.shape[-1])
    top_p, top_q = np.argpartition(-log_p, k - 1, -1)[:, :k], np.argpartition(-log_q, k - 1, -1)[:, :k]
    rows = np.arange(len(top))
    ranked = -np.sort(-log_p, axis=-1)[:, : k + 1]
    nll = {}
    if targets is not None:
        known = np.asarray(targets) >= 0
        picked = np.where(known, targets, 0)
        nll = {
            "nll": np.where(known, -log_q[rows, picked], np.nan),
            "nll_expected": np.where(known, -log_p[rows, picked], np.nan),
        }
    return {
        **nll,
        # how far the reference's k-th token leads its (k+1)-th: how decisive its top-1 and top-k sets are
        "margin": ranked[:, 0] - ranked[:, 1] if ranked.shape[1] > 1 else np.full(len(top), np.inf),
        "margin_k": ranked[:, k - 1] - ranked[:, k] if ranked.shape[1] > k else np.full(len(top), np.inf),
        "kl": _kl(log_q, log_p),
        "top1": log_q.argmax(-1) == top,
        "top5": np.array([len(set(a) & set(b)) / k for a, b in zip(top_p, top_q)]),
        "top_delta": np.abs(log_q[rows, top] - log_p[rows, top]),
    }


def bootstrap_interval(
    samples, statistic, resamples: int, confidence: float, seed: int = 0, clusters=None
) -> tuple[float, float]:
    """The percentile bootstrap confidence interval of `statistic` over `samples`: the statistic of `resamples`
    resamples drawn with replacement from a generator seeded with `seed` (the same samples give the same interval),
    cut at the (1 - confidence) / 2 quantiles of both ends. Each resample draws samples, as many as there are; or,
    where `clusters` is given, whole clusters, as many as there are, and holds every sample of each drawn (a
    cluster bootstrap: samples that share a cluster vary together, so drawing them one by one would understate the
    statistic's spread).

    Args:
        samples: (N,) the per-position values, N >= 1.
        statistic: maps a (R, N) array of resamples to its (R,) values along the last axis (a mean, a percentile);
            with `clusters`, it is given one resample at a time, (1, n), n the drawn clusters' samples.
        resamples: how many resamples.
        confidence: the share of the resampled values the interval holds, in (0, 1).
        seed: the generator's seed.
        clusters: None, or (N,) each sample's cluster (any integer label).

    Returns:
        (low, high).
    """
    samples = np.asarray(samples, np.float64).reshape(-1)
    rng = np.random.default_rng(seed)
    values = np.empty(resamples)
    if clusters is None:
        block = max(1, (1 << 22) // len(samples))  # resamples drawn at once: at most 4M indices in memory
        for start in range(0, resamples, block):
            count = min(block, resamples - start)
            values[start : start + count] = statistic(samples[rng.integers(0, len(samples), (count, len(samples)))])
    else:
        labels = np.asarray(clusters).reshape(-1)
        members = [samples[labels == label] for label in np.unique(labels)]
        for index, drawn in enumerate(rng.integers(0, len(members), (resamples, len(members)))):
            values[index] = statistic(np.concatenate([members[c] for c in drawn])[None])[0]
    tail = (1 - confidence) / 2
    low, high = np.quantile(values, [tail, 1 - tail])
    return float(low), float(high)


def logits_metrics(actual: np.ndarray, expected: np.ndarray, valid: np.ndarray | None = None, k: int = TOP_K) -> dict:
    """LLM-level agreement over the positions where `valid` is true.

    Args:
        actual: ONNX Runtime's logits (..., V).
        expected: the reference's logits, of the same shape.
        valid: the positions judged, over the logits' leading axes; None: every position.
        k: the top-k size of topk_overlap, capped at the vocabulary.

    Returns:
        top1_agreement: share of positions whose argmax is equal; topk_overlap: mean share of the reference's
        top-k ids also in ONNX Runtime's top-k; kl_mean and kl_max: KL(reference || onnx) of the softmax
        distributions; positions: how many were judged. Empty when no position is.
    """
    vocab = expected.shape[-1]
    a = np.asarray(actual, np.float64).reshape(-1, vocab)
    e = np.asarray(expected, np.float64).reshape(-1, vocab)
    if valid is not None:
        keep = np.asarray(valid, bool).reshape(-1)
        a, e = a[keep], e[keep]
    if not len(e):
        return {}
    stats = token_statistics(a, e, k)
    return {
        "top1_agreement": float(np.mean(stats["top1"])),
        "topk_overlap": float(np.mean(stats["top5"])),
        "kl_mean": float(np.mean(stats["kl"])),
        "kl_max": float(np.max(stats["kl"])),
        "positions": int(len(e)),
    }


def loss_metrics(actual: float, expected: float) -> dict:
    """The loss is a mean negative log-likelihood, so exp(actual - expected) is the perplexity ratio."""
    diff = float(actual) - float(expected)
    return {"loss_abs_diff": abs(diff), "perplexity_ratio": float(np.exp(diff))}


def real_queries(mask: np.ndarray, length: int) -> np.ndarray:
    """compare's `valid` for logits (B, length, V) of the last `length` positions of `mask` (B, total):
    (B, length), true where the query is a real token."""
    mask = np.asarray(mask)
    return mask[:, mask.shape[1] - length :] == 1


def real_keys(mask: np.ndarray) -> np.ndarray:
    """compare's `valid` for a present (B, kv_heads, L, head_dim) covering `mask` (B, L): (B, 1, L), true
    where the cache position holds a real token, in every head."""
    return np.asarray(mask)[:, None, :] == 1


def compare(
    name: str, kind: str, actual, expected, tolerance: Tolerance, valid: np.ndarray | None = None
) -> Comparison:
    """Elementwise comparison; NaN passes only where both sides are NaN (e.g. a loss with no targets), an
    infinity only where both sides hold the same one (e.g. a masked score). Health reports both apart.

    A padded query attends to no real token, so its output is whatever the model's mask makes of that (a
    boolean mask that leaves it no key at all makes it arbitrary), and nothing reads it; a padded key is
    weighed by zero, so only whether it is finite matters, which the health check judges. Hence `valid`.

    Args:
        name: the row's name in reports.
        kind: "logits" (adds the LLM-level metrics), "loss" (adds the loss metrics), "kv" or "activation".
        actual: ONNX Runtime's values.
        expected: the reference's values; a shape other than `actual`'s fails the comparison.
        tolerance: the bound each judged element must meet.
        valid: the positions judged, over the leading axes and broadcast over the rest (see real_queries and
            real_keys): every figure, the verdict and the logits metrics leave the others out. None: all.

    Returns:
        The Comparison: figures, verdict and the smallest tolerance that would have passed.
    """
    # NaN or Inf on a side is a finding the metrics report (and the health check counts), not a warning
    with np.errstate(all="ignore"):
        return _compare(name, kind, actual, expected, tolerance, valid)


def _compare(name: str, kind: str, actual, expected, tolerance: Tolerance, valid: np.ndarray | None) -> Comparison:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        inf = float("inf")
        return Comparison(
            name,
            kind,
            inf,
            inf,
            inf,
            tolerance,
            False,
            f"shape {actual.shape} != {expected.shape}",
            float("nan"),
            Needed(inf, inf, inf),
        )
    judged = None
    if valid is not None:
        valid = np.asarray(valid, bool)
        judged = np.broadcast_to(valid.reshape(valid.shape + (1,) * (actual.ndim - valid.ndim)), actual.shape)
    llm = logits_metrics(actual, expected, None if judged is None else judged[..., 0]) if kind == "logits" else {}
    peaks = row_peaks(expected, kind, judged)
    if judged is not None:
        actual, expected, peaks = actual[judged], expected[judged], peaks[judged]
    if actual.size == 0:  # every position left out: nothing was compared, which proves nothing
        return Comparison(name, kind, 0.0, 0.0, 0.0, tolerance, False, NOTHING_COMPARED)
    both_nan = np.isnan(actual) & np.isnan(expected)
    same_non_finite = both_nan | (np.isinf(expected) & (actual == expected))
    diff = np.where(same_non_finite, 0.0, np.abs(actual - expected))
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on one side only, or infinities that differ
    rel = diff / np.maximum(np.abs(np.where(same_non_finite, 1.0, expected)), np.finfo(np.float32).tiny)
    passed = bool(np.all(diff <= tolerance.allowed(expected, peaks)))
    if kind == "loss" and not both_nan.all():
        llm = loss_metrics(actual, expected)
    cosine = (
        1.0
        if same_non_finite.all()
        else _cosine(np.where(same_non_finite, 0, actual), np.where(same_non_finite, 0, expected))
    )
    return Comparison(
        name,
        kind,
        float(diff.max()),
        float(rel.max()),
        float(diff.mean()),
        tolerance,
        passed,
        cosine=cosine,
        needed=_needed(diff, expected, tolerance, peaks),
        llm=llm,
    )


def aggregate(name: str, comparisons: list[Comparison]) -> Comparison:
    """One row for many comparisons of the same kind: the worst figures, passed only if all passed."""
    worst = max(comparisons, key=lambda c: c.max_abs)
    llm = {}
    if worst.kind == "logits":
        rows = [c.llm for c in comparisons if c.llm]
        llm = {
            "top1_agreement": min(r["top1_agreement"] for r in rows),
            "topk_overlap": min(r["topk_overlap"] for r in rows),
            "kl_mean": float(np.mean([r["kl_mean"] for r in rows])),
            "kl_max": max(r["kl_max"] for r in rows),
        }
    return Comparison(
        name,
        worst.kind,
        worst.max_abs,
        max(c.max_rel for c in comparisons),
        float(np.mean([c.mean_abs for c in comparisons])),
        worst.tolerance,
        all(c.passed for c in comparisons),
        worst.name,
        min(c.cosine for c in comparisons),
        Needed.worst([c.needed for c in comparisons]),
        llm,
        max((c.referee for c in comparisons if c.referee is not None), key=lambda r: r.ratio, default=None),
        max((c.multiple for c in comparisons if not math.isnan(c.multiple)), default=float("nan")),
    )


def compare_outputs(label: str, actual: dict, expected: dict, profile, mask: np.ndarray) -> list[Comparison]:
    """Logits and every present of two runs of one call: the logits row, then one row for the presents of all
    layers.

    Args:
        label: the call's name, which begins each row's name ("prefill").
        actual: ONNX Runtime's outputs by name: "logits" and the presents.
        expected: the reference's outputs by name.
        profile: the tolerances.parity.Profile whose logits and kv tolerances judge them.
        mask: the call's attention mask (B, total): only real positions are judged.
    """
    rows = [
        compare(
            f"{label} logits",
            "logits",
            actual["logits"],
            expected["logits"],
            profile.logits,
            valid=real_queries(mask, actual["logits"].shape[1]),
        )
    ]
    kv = [
        compare(f"{label} {n}", "kv", actual[n], expected[n], profile.kv, valid=real_keys(mask))
        for n in actual
        if n.startswith("present.")
    ]
    return rows + ([aggregate(f"{label} present (all layers)", kv)] if kv else [])


def match_length(a: list[int], b: list[int]) -> int:
    """How many tokens are equal from the start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def difference_histogram(actual: np.ndarray, expected: np.ndarray, bins: int = 24) -> dict:
    """Counts of |actual - expected| over log10-spaced bins, for the report plot; exact zeros and differences
    that are not finite (a NaN or Inf on either side) are counted apart."""
    diff = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64)).ravel()
    finite = np.isfinite(diff)
    non_finite = int(diff.size - finite.sum())
    diff = diff[finite]
    nonzero = diff[diff > 0]
    if not len(nonzero):
        return {"zeros": int(len(diff)), "non_finite": non_finite, "edges": [], "counts": []}
    low, high = np.floor(np.log10(nonzero.min())), np.ceil(np.log10(nonzero.max()))
    edges = np.logspace(low, max(high, low + 1), bins + 1)
    counts, _ = np.histogram(nonzero, edges)
    return {
        "zeros": int(len(diff) - len(nonzero)),
        "non_finite": non_finite,
        "edges": [float(x) for x in edges],
        "counts": [int(c) for c in counts],
    }
