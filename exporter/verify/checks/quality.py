"""The quality check of a weight-only quantized artifact: its next-token distributions against the reference's.

The same calls as the parity checks (exporter.verify.checks.outputs): the prefill batch, then `decode_steps`
single-token steps and one 3-token chunk with each side feeding its own present back as past, then a greedy run.
Each real position's two distributions give a KL divergence KL(reference || artifact), whether their argmax and
top-5 agree, how far the log-probability of the reference's top token moved, and each side's negative
log-likelihood of the token that follows it (ΔNLL, the perplexity ratio); the greedy run, how many tokens agree from
the start. A text is read whole: as many windows as cover it, TEXT_BATCH windows to a batch.
Each figure over positions carries its bootstrap confidence interval (over the text's windows, or the positions:
MIN_BOOTSTRAP_WINDOWS) and is judged by it: pass where the
whole interval keeps the limit, fail where none of it does, undecided where it straddles the limit (more positions
decide it; undecided is not passed). The limits, the confidence and their reasoning are in exporter.tolerances.quality
(QUALITY_PROFILES, QUALITY_CONFIDENCE); the statistics are llama.cpp's `perplexity --kl-divergence`.
The KL is also kept per position of the sequence (kl_by_position), for the reports' plot of where it grows.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from exporter.artifact.manifest import Manifest
from exporter.artifact.quantization import QualityTarget
from exporter.runtime.generation import NonFiniteLogits, generate_greedy
from exporter.runtime.protocol import RuntimeLabel
from exporter.runtime.runner import presents_as_past
from exporter.tolerances.quality import (
    DECISIVE_MARGIN,
    GREEDY_QUALITY_TOKENS,
    MIN_BOOTSTRAP_WINDOWS,
    MIN_DECISIVE_POSITIONS,
    QUALITY_CONFIDENCE,
    QUALITY_RESAMPLES,
    QualityProfile,
    QualityThreshold,
    target_thresholds,
)
from exporter.verify.inputs import (
    FINAL_CHUNK,
    GREEDY_PROMPT_LENGTH,
    ParitySettings,
    QualityText,
    greedy_prompt,
    next_tokens,
    prefill_feeds,
    prompt_batch,
    text_windows,
    window_length,
    windows_covering,
)
from exporter.verify.metrics import bootstrap_interval, match_length, token_statistics

log = logging.getLogger(__name__)

PASS, FAIL, UNDECIDED, NOT_JUDGED = "pass", "fail", "undecided", "not judged"
# Windows of a text run as one batch: the batch's KV caches and float64 distributions stay small however long the text.
TEXT_BATCH = 16


@dataclass(frozen=True)
class QualityCheck:
    """One metric against its threshold.

    `interval` is the value's bootstrap confidence interval over the positions it averages (None for a figure of
    one run, the greedy agreement, judged by its value alone); `note` says why the metric was not judged (value
    None), what excused it, or why it is undecided."""

    threshold: QualityThreshold
    value: float | None
    note: str = ""
    excused: bool = False
    interval: tuple[float, float] | None = None

    @property
    def judged(self) -> bool:
        """Whether there was a value to judge; one not judged fails nothing and is reported as not judged."""
        return self.value is not None

    @property
    def verdict(self) -> str:
        """PASS, FAIL, UNDECIDED (the interval straddles the limit) or NOT_JUDGED."""
        if not self.judged:
            return NOT_JUDGED
        if self.excused:
            return PASS
        if not math.isfinite(self.value):
            return FAIL
        holds = self.threshold.holds(self.value) if self.interval is None else self.threshold.holds_over(*self.interval)
        return UNDECIDED if holds is None else PASS if holds else FAIL

    @property
    def passed(self) -> bool | None:
        """None where the metric was not judged (`note` says why): neither passed nor failed. An undecided one has
        not passed."""
        return self.verdict == PASS if self.judged else None

    @property
    def multiple(self) -> float | None:
        """The error in multiples of what the limit allows (QualityThreshold.multiple), at the end of the interval
        farther from the limit's side, which the verdict rests on: at most 1 exactly where it passed. None where
        there is no error to scale: not judged, or excused (`note` says why)."""
        if not self.judged or self.excused:
            return None
        if self.interval is None or not math.isfinite(self.value):
            return self.threshold.multiple(self.value)
        return max(self.threshold.multiple(end) for end in self.interval)

    def to_dict(self) -> dict:
        return {
            **self.threshold.to_dict(),
            "value": self.value,
            "multiple": self.multiple,
            "interval": None if self.interval is None else list(self.interval),
            "verdict": self.verdict,
            "passed": self.passed,
            "note": self.note,
        }


@dataclass(frozen=True, kw_only=True)
class QualityReport:
    """One provider's quantized artifact against the float32 reference.

    `kl_by_position` is the mean KL(reference || artifact), in nats, at each position of the sequence the checks
    ran: first the `prefill_positions` columns of the left-padded prompt batch (position i is column i, which is an
    unpadded row's position id), then one per token of the decode calls, in order (the single-token steps, then
    the final chunk's tokens), positions prefill_positions, prefill_positions + 1, ... Each value is the mean over
    the batch rows holding a real token there; None where no row does (a column of padding only), NaN where a
    distribution was not finite. to_dict writes it as {"prefill": [...], "decode": [...]}, 4 significant digits.

    `text` is the text the checks read (None: seeded random ids); to_dict writes it as "input", with the `windows`
    (batch rows) of `window_length` ids read and the `seconds` the check took. `intervals` holds the bootstrap
    confidence interval (QUALITY_CONFIDENCE) of each figure averaged over positions, by its name in `metrics`.
    """

    provider: str  # the row's name: the execution provider, or the runtime and its configuration
    runtime: RuntimeLabel
    scheme: str
    profile: QualityProfile
    checks: tuple[QualityCheck, ...]
    metrics: dict  # every figure, the judged ones and the others (kl_max, kl_median, perplexity_ratio, ...)
    greedy_reference: list[int]
    greedy_onnx: list[int]
    intervals: dict = field(default_factory=dict)
    kl_by_position: tuple[float | None, ...] = ()
    prefill_positions: int = 0
    text: QualityText | None = None
    windows: int = 0
    window_length: int = 0
    seconds: float = 0.0
    resampled: str = "positions"  # what the intervals' bootstrap draws: "windows" (of a text) or "positions"

    @property
    def verdict(self) -> str:
        """FAIL where a judged metric failed, else UNDECIDED where one is undecided, else PASS (a metric not judged
        neither passes nor fails)."""
        verdicts = {c.verdict for c in self.checks}
        return FAIL if FAIL in verdicts else UNDECIDED if UNDECIDED in verdicts else PASS

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def __bool__(self) -> bool:
        return self.passed

    @property
    def failures(self) -> list[QualityCheck]:
        return [c for c in self.checks if c.verdict == FAIL]

    @property
    def undecided(self) -> list[QualityCheck]:
        return [c for c in self.checks if c.verdict == UNDECIDED]

    @property
    def attributed(self) -> bool:
        return self.runtime.attributes(self.passed)

    @property
    def worst_multiple(self) -> float | None:
        """The largest multiple of its limit among the checks that have one (QualityCheck.multiple); None: none
        has."""
        return max((c.multiple for c in self.checks if c.multiple is not None), default=None)

    def to_dict(self) -> dict:
        read = {"windows": self.windows, "window_length": self.window_length, "positions": self.metrics["positions"]}
        return {
            "provider": self.provider,
            "runtime": self.runtime.to_dict(),
            "scheme": self.scheme,
            "passed": self.passed,
            "verdict": self.verdict,
            "attributed": self.attributed,
            "worst_multiple": self.worst_multiple,
            "input": {"kind": "random ids", **read}
            if self.text is None
            else {"kind": "text", **self.text.to_dict(), **read},
            "seconds": round(self.seconds, 2),
            "profile": self.profile.to_dict(),
            "confidence": QUALITY_CONFIDENCE,
            "resamples": QUALITY_RESAMPLES,
            "resampled": self.resampled,
            "checks": [c.to_dict() for c in self.checks],
            "metrics": self.metrics,
            "intervals": {name: list(interval) for name, interval in self.intervals.items()},
            "greedy": {"reference_ids": self.greedy_reference, "onnx_ids": self.greedy_onnx},
            "kl_by_position": {
                "prefill": [_rounded(v) for v in self.kl_by_position[: self.prefill_positions]],
                "decode": [_rounded(v) for v in self.kl_by_position[self.prefill_positions :]],
            },
        }


def _rounded(value: float | None) -> float | None:
    """4 significant digits: a KL is read on a log scale (NaN and Inf stay, which JSON writes as null)."""
    return None if value is None else float(f"{value:.4g}")


def kl_by_position(kl: np.ndarray, valid: list[np.ndarray]) -> list[float | None]:
    """The mean KL in nats at each position of a sequence of calls, from the KL of each real token.

    Args:
        kl: (N,) the KL of each real token: each call's in turn, a call's in row-major order of its `valid`
            (token_statistics' "kl" of the logits taken at those positions, in that order).
        valid: per call, (B, L), true where the row holds a real token (padding is left out); N true in all.

    Returns:
        One value per position, each call's L in turn: the mean over the rows valid there; None where none is.
    """
    masks = [np.asarray(mask, bool) for mask in valid]
    bounds = np.cumsum([0, *(int(mask.sum()) for mask in masks)])  # each call's tokens are kl[bounds[i]:bounds[i+1]]
    if bounds[-1] != len(kl):
        raise ValueError(f"kl holds {len(kl)} tokens, the valid masks {bounds[-1]}")
    series: list[float | None] = []
    for mask, start, end in zip(masks, bounds, bounds[1:]):
        grid = np.zeros(mask.shape)
        grid[mask] = kl[start:end]  # boolean indexing is row-major: the tokens' order
        series += [float(total / n) if n else None for total, n in zip(grid.sum(axis=0), mask.sum(axis=0))]
    return series


def _real(logits: np.ndarray, valid: np.ndarray) -> np.ndarray:
    return logits.reshape(-1, logits.shape[-1])[np.asarray(valid, bool).reshape(-1)]


def _call_statistics(actual: dict, expected: dict, valid: np.ndarray, targets: np.ndarray) -> tuple[dict, np.ndarray]:
    """token_statistics of one call's real positions (row-major), with the id that follows each, and the call's
    (B, L) mask of them."""
    return token_statistics(
        _real(actual["logits"], valid), _real(expected["logits"], valid), targets=targets[valid]
    ), valid


def _run_batch(reference, onnx, manifest: Manifest, batch: dict, continuation: np.ndarray, steps, rng) -> list:
    """One batch through the prefill and the decode calls (`steps`, their lengths, fed `continuation`), each side
    feeding its own present back: per call, _call_statistics."""
    sequence = np.concatenate([batch["input_ids"], continuation], axis=1)
    targets = np.concatenate([sequence[:, 1:], np.full((len(sequence), 1), -1)], axis=1)  # the last has none
    feeds = prefill_feeds(manifest, batch)
    ref_out, ort_out = reference.prefill(feeds), onnx.prefill(feeds)
    mask = batch["attention_mask"]
    calls = [_call_statistics(ort_out, ref_out, np.asarray(mask) == 1, targets[:, : mask.shape[1]])]
    for length in steps:
        start = mask.shape[1]
        read = start - batch["input_ids"].shape[1]
        step_feeds, mask = next_tokens(manifest, mask, length, rng, continuation[:, read : read + length])
        ref_out = reference.decode({**step_feeds, **presents_as_past(manifest, ref_out)})
        ort_out = onnx.decode({**step_feeds, **presents_as_past(manifest, ort_out)})
        calls.append(
            _call_statistics(ort_out, ref_out, np.ones((len(mask), length), bool), targets[:, start : start + length])
        )
    return calls


def _batches(manifest: Manifest, batch: dict, settings: ParitySettings, steps, rng, text) -> list[tuple]:
    """(batch, continuation) of each batch the check runs: the prompt batch given with `rng`'s decode ids (drawn
    as next_tokens draws them, call after call), or a text's windows covering it, TEXT_BATCH to a batch."""
    if text is None:
        shape = len(batch["input_ids"])
        drawn = [rng.integers(0, manifest.config.vocab_size, (shape, n), dtype=np.int64) for n in steps]
        return [(batch, np.concatenate(drawn, axis=1))]
    length = window_length(settings)
    rows = text_windows(text.ids, windows_covering(len(text.ids), length, settings.batch), length)
    batches = []
    for start in range(0, len(rows), TEXT_BATCH):
        chunk = rows[start : start + TEXT_BATCH]
        fitted = dataclasses.replace(settings, batch=len(chunk))
        batches.append(
            (
                prompt_batch(manifest, fitted, rng, chunk[:, : settings.prompt_length]),
                chunk[:, settings.prompt_length :],
            )
        )
    return batches


def _mean(resamples: np.ndarray) -> np.ndarray:
    return resamples.mean(axis=-1)


def _p99(resamples: np.ndarray) -> np.ndarray:
    return np.percentile(resamples, 99, axis=-1)


def check_quality(
    reference,
    onnx,
    manifest: Manifest,
    batch: dict,
    settings: ParitySettings,
    profile: QualityProfile,
    rng: np.random.Generator,
    text: QualityText | None = None,
) -> QualityReport:
    """The distributional figures of `onnx` (an OrtRunner on a quantized artifact) against `reference`.

    Random ids put a trained model out of its distribution; with `text` (a tokenized text) the batch rows are
    windows of that text, as many as cover it, each with its continuation for the decode steps, and the greedy run
    starts from its first ids, so that the figures are measured where the model is used, on all of the text.

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference).
        onnx: the OrtRunner.
        manifest: the artifact's manifest (quantized).
        batch: the prompt batch (prompt_batch) of random ids; not read with `text`.
        settings: decode_steps and seed (the greedy run takes GREEDY_QUALITY_TOKENS, fitted to the positions);
            with `text`, the fewest windows (`batch`).
        profile: the limits.
        rng: the generator of the decode steps' new token ids.
        text: a text to read the batches, the decode steps and the greedy prompt from; None: random ids (the
            batch given, `rng`'s steps, the parity checks' greedy prompt).

    Returns:
        The QualityReport: each threshold's check with its interval, every figure, the greedy runs, and the mean
        KL at each position of the prefill batch and of the decode calls (kl_by_position; its contract is
        QualityReport's).
    """
    began = time.perf_counter()
    steps = [1] * settings.decode_steps + [FINAL_CHUNK]  # the decode calls' lengths
    batches = _batches(manifest, batch, settings, steps, rng, text)
    log.info(
        "%s: quality over %d batch(es) of %d rows: the prefill and %d decode calls",
        onnx.provider,
        len(batches),
        len(batches[0][0]["input_ids"]),
        len(steps),
    )
    runs = [_run_batch(reference, onnx, manifest, b, continuation, steps, rng) for b, continuation in batches]
    # call after call, each batch's rows in turn: the rows of all batches stacked, row-major within each call
    per_call = list(zip(*runs))
    stats = {key: np.concatenate([s[key] for call in per_call for s, _ in call]) for key in runs[0][0][0]}
    valid = [np.concatenate([v for _, v in call]) for call in per_call]
    first_rows = np.cumsum([0] + [len(b["input_ids"]) for b, _ in batches])
    rows = np.concatenate([np.nonzero(v)[0] + first_rows[b] for call in per_call for b, (_, v) in enumerate(call)])
    by_windows = text is not None and first_rows[-1] >= MIN_BOOTSTRAP_WINDOWS
    if text is None:
        prompt = greedy_prompt_of(manifest, settings)
    else:
        prompt = [int(i) for i in text.ids[:GREEDY_PROMPT_LENGTH]]
    tokens = min(GREEDY_QUALITY_TOKENS, manifest.config.max_position_embeddings - len(prompt))
    log.info("%s: greedy generation of %d tokens", onnx.provider, tokens)
    trace = reference.greedy(prompt, tokens, manifest.config.eos_token_id)
    try:
        actual = generate_greedy(onnx, prompt, tokens, manifest.config.eos_token_id).new_ids
    except NonFiniteLogits:
        actual = []
    agreed = match_length(actual, trace.ids)
    decisive = stats["margin"] >= DECISIVE_MARGIN
    decisive_k = stats["margin_k"] >= DECISIVE_MARGIN
    judged = int(decisive.sum()) >= MIN_DECISIVE_POSITIONS
    judged_k = int(decisive_k.sum()) >= MIN_DECISIVE_POSITIONS
    greedy_margin = None  # the reference's top-1 margin where the two greedy runs part
    if agreed < min(len(actual), len(trace.ids)):
        greedy_margin = float(
            token_statistics(trace.logits[agreed : agreed + 1], trace.logits[agreed : agreed + 1])["margin"][0]
        )
    known = ~np.isnan(stats["nll"])  # every position but each row's last, whose next id is not read
    nll_change = stats["nll"] - stats["nll_expected"]
    everywhere = np.ones(len(stats["kl"]), bool)
    samples = {  # each figure over positions: (its per-position values, the statistic of them, which positions)
        "kl_mean": (stats["kl"], _mean, everywhere),
        "kl_p99": (stats["kl"], _p99, everywhere),
        "top1_agreement": (stats["top1"], _mean, everywhere),
        "top5_overlap": (stats["top5"], _mean, everywhere),
        "top_logprob_delta_mean": (stats["top_delta"], _mean, everywhere),
        "nll_delta": (nll_change, _mean, known),
        **({"top1_agreement_decisive": (stats["top1"], _mean, decisive)} if judged else {}),
        **({"top5_overlap_decisive": (stats["top5"], _mean, decisive_k)} if judged_k else {}),
    }
    intervals = {  # resampling the text's windows where there are enough of them, else the positions
        name: bootstrap_interval(
            values[where],
            statistic,
            QUALITY_RESAMPLES,
            QUALITY_CONFIDENCE,
            clusters=rows[where] if by_windows else None,
        )
        for name, (values, statistic, where) in samples.items()
    }
    intervals["perplexity_ratio"] = tuple(float(np.exp(end)) for end in intervals["nll_delta"])
    nll_delta = float(nll_change[known].mean())
    metrics = {
        "positions": int(len(stats["kl"])),
        "nll_positions": int(known.sum()),
        "kl_mean": float(stats["kl"].mean()),
        "kl_median": float(np.median(stats["kl"])),
        "kl_p99": float(np.percentile(stats["kl"], 99)),
        "kl_max": float(stats["kl"].max()),
        "top1_agreement": float(stats["top1"].mean()),
        "top5_overlap": float(stats["top5"].mean()),
        "decisive_positions": int(decisive.sum()),
        "top1_agreement_decisive": float(stats["top1"][decisive].mean()) if judged else None,
        "decisive_top5_positions": int(decisive_k.sum()),
        "top5_overlap_decisive": float(stats["top5"][decisive_k].mean()) if judged_k else None,
        "top_logprob_delta_mean": float(stats["top_delta"].mean()),
        "top_logprob_delta_max": float(stats["top_delta"].max()),
        "nll_reference": float(stats["nll_expected"][known].mean()),
        "nll_onnx": float(stats["nll"][known].mean()),
        "nll_delta": nll_delta,
        "perplexity_ratio": float(np.exp(nll_delta)),
        "greedy_tokens": len(trace.ids),
        "greedy_match": agreed,
        # a reference that stops at EOS early gives fewer tokens: all of them agreeing is full agreement
        "greedy_agreement": agreed / len(trace.ids) if trace.ids else 1.0,
        "greedy_divergence_margin": greedy_margin,
    }
    sizes = {name: int(where.sum()) for name, (_, _, where) in samples.items()}
    checks = tuple(_check(t, metrics, intervals, sizes) for t in profile.thresholds)
    return QualityReport(
        provider=onnx.provider,
        runtime=onnx.runtime,
        scheme=manifest.precision,
        profile=profile,
        checks=checks,
        metrics=metrics,
        greedy_reference=list(trace.ids),
        greedy_onnx=list(actual),
        intervals=intervals,
        kl_by_position=tuple(kl_by_position(stats["kl"], valid)),
        prefill_positions=int(np.asarray(batches[0][0]["attention_mask"]).shape[1]),
        text=text,
        windows=sum(len(b["input_ids"]) for b, _ in batches),
        window_length=window_length(settings),
        seconds=time.perf_counter() - began,
        resampled="windows" if by_windows else "positions",
    )


def recorded_target_checks(target: QualityTarget) -> tuple[QualityCheck, ...]:
    """The figures an export made to `target` measured of itself on held-out text, as its manifest records them,
    against the target, each by its recorded interval: a record whose own figures miss its target (edited, or
    written otherwise than by the search) fails, as does one that records none."""
    checks = []
    for metric, threshold in zip(target.limits(), target_thresholds(target)):
        recorded = dataclasses.replace(
            threshold, metric=f"recorded held-out {metric}", why="the export's own figure on held-out text, as recorded"
        )
        value, interval = target.measured.get(metric), target.measured.get(f"{metric}_interval")
        if value is None or interval is None:
            checks.append(QualityCheck(recorded, math.nan, "the manifest records no held-out figure for its target"))
        else:
            checks.append(QualityCheck(recorded, float(value), interval=tuple(interval)))
    return tuple(checks)


def _check(threshold: QualityThreshold, metrics: dict, intervals: dict, sizes: dict) -> QualityCheck:
    """One threshold's check of `metrics`, judged by its interval where it has one (`sizes`: the positions each
    interval was drawn from)."""
    value = metrics.get(threshold.metric)
    if value is None:
        return QualityCheck(
            threshold,
            None,
            f"not judged: fewer than {MIN_DECISIVE_POSITIONS} of {metrics['positions']} positions have the "
            f"reference's top-1 (or 5th) token {DECISIVE_MARGIN} nats above the next (top-1: "
            f"{metrics['decisive_positions']}, top-5: {metrics['decisive_top5_positions']}): the reference "
            "is nearly uniform (random weights?); KL and ΔNLL judge it",
        )
    margin = metrics["greedy_divergence_margin"]
    if threshold.metric == "greedy_agreement" and not threshold.holds(value) and margin is not None:
        if margin < DECISIVE_MARGIN:
            return QualityCheck(
                threshold,
                float(value),
                f"the runs part at token {metrics['greedy_match']}, where the reference's top token leads by "
                f"{margin:.3g} nats (< {DECISIVE_MARGIN}): a near-tie, excused",
                excused=True,
            )
    check = QualityCheck(threshold, float(value), interval=intervals.get(threshold.metric))
    if check.verdict != UNDECIDED:
        return check
    low, high = check.interval
    return dataclasses.replace(
        check,
        note=f"undecided at {sizes[threshold.metric]} positions: its {QUALITY_CONFIDENCE:.0%} interval "
        f"[{low:.4g}, {high:.4g}] straddles the limit; more positions (a longer text) decide it",
    )


def greedy_prompt_of(manifest: Manifest, settings: ParitySettings) -> list[int]:
    """The greedy run's prompt: check_greedy's, from the same seed."""
    return greedy_prompt(manifest, np.random.default_rng(settings.seed + 2))
