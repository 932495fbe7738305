"""The quality check of a weight-only quantized artifact: its next-token distributions against the reference's.

The same calls as the parity checks (exporter.verify.checks.outputs): the prefill batch, then `decode_steps`
single-token steps and one 3-token chunk with each side feeding its own present back as past, then a greedy run.
Each real position's two distributions give a KL divergence KL(reference || artifact), whether their argmax and
top-5 agree, and how far the log-probability of the reference's top token moved; the prefill graph's own loss gives
ΔNLL and the perplexity ratio; the greedy run, how many tokens agree from the start. The limits and their reasoning
are in exporter.tolerances (QUALITY_PROFILES); the statistics are llama.cpp's `perplexity --kl-divergence`.
The KL is also kept per position of the sequence (kl_by_position), for the reports' plot of where it grows.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from exporter.artifact.manifest import Manifest
from exporter.runtime.generation import NonFiniteLogits, generate_greedy
from exporter.runtime.protocol import RuntimeLabel
from exporter.runtime.runner import presents_as_past
from exporter.tolerances import (
    DECISIVE_MARGIN,
    GREEDY_QUALITY_TOKENS,
    MIN_DECISIVE_POSITIONS,
    QualityProfile,
    QualityThreshold,
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
)
from exporter.verify.metrics import match_length, token_statistics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QualityCheck:
    """One metric against its threshold; `note` says why it was not judged (value None) or what excused it."""

    threshold: QualityThreshold
    value: float | None
    note: str = ""
    excused: bool = False

    @property
    def judged(self) -> bool:
        """Whether there was a value to judge; one not judged fails nothing and is reported as not judged."""
        return self.value is not None

    @property
    def passed(self) -> bool | None:
        """None where the metric was not judged (`note` says why): neither passed nor failed."""
        if not self.judged:
            return None
        return self.excused or (math.isfinite(self.value) and self.threshold.holds(self.value))

    def to_dict(self) -> dict:
        return {**self.threshold.to_dict(), "value": self.value, "passed": self.passed, "note": self.note}


@dataclass(frozen=True, kw_only=True)
class QualityReport:
    """One provider's quantized artifact against the float32 reference.

    `kl_by_position` is the mean KL(reference || artifact), in nats, at each position of the sequence the checks
    ran: first the `prefill_positions` columns of the left-padded prompt batch (position i is column i, which is an
    unpadded row's position id), then one per token of the decode calls, in order (the single-token steps, then
    the final chunk's tokens), positions prefill_positions, prefill_positions + 1, ... Each value is the mean over
    the batch rows holding a real token there; None where no row does (a column of padding only), NaN where a
    distribution was not finite. to_dict writes it as {"prefill": [...], "decode": [...]}, 4 significant digits.

    `text` is the text the checks read (None: seeded random ids); to_dict writes it as "input".
    """

    provider: str  # the row's name: the execution provider, or the runtime and its configuration
    runtime: RuntimeLabel
    scheme: str
    profile: QualityProfile
    checks: tuple[QualityCheck, ...]
    metrics: dict  # every figure, the judged ones and the others (kl_max, kl_median, perplexity_ratio, ...)
    greedy_reference: list[int]
    greedy_onnx: list[int]
    kl_by_position: tuple[float | None, ...] = ()
    prefill_positions: int = 0
    text: QualityText | None = None

    @property
    def passed(self) -> bool:
        """No judged metric failed (one not judged neither passes nor fails)."""
        return not self.failures

    def __bool__(self) -> bool:
        return self.passed

    @property
    def failures(self) -> list[QualityCheck]:
        return [c for c in self.checks if c.passed is False]

    @property
    def attributed(self) -> bool:
        return self.runtime.attributes(self.passed)

    def to_dict(self) -> dict:
        return {
            "provider": self.provider,
            "runtime": self.runtime.to_dict(),
            "scheme": self.scheme,
            "passed": self.passed,
            "attributed": self.attributed,
            "input": {"kind": "random ids"} if self.text is None else {"kind": "text", **self.text.to_dict()},
            "profile": self.profile.to_dict(),
            "checks": [c.to_dict() for c in self.checks],
            "metrics": self.metrics,
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

    Random ids put a trained model out of its distribution; with `text` (a tokenized text) every row of the
    batch is a window of that text, the decode steps feed its continuation and the greedy run starts from its
    first ids, so that the figures are measured where the model is used.

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference).
        onnx: the OrtRunner.
        manifest: the artifact's manifest (quantized).
        batch: the prompt batch (prompt_batch), whose labels the loss is computed from.
        settings: decode_steps and seed (the greedy run takes GREEDY_QUALITY_TOKENS, fitted to the positions).
        profile: the limits.
        rng: the generator of the decode steps' new token ids.
        text: a text to read the batch, the decode steps and the greedy prompt from; None: random ids (the
            batch given, `rng`'s steps, the parity checks' greedy prompt).

    Returns:
        The QualityReport: each threshold's check, every figure, the greedy runs, and the mean KL at each position
        of the prefill batch and of the decode calls (kl_by_position; its contract is QualityReport's).
    """
    steps = [1] * settings.decode_steps + [FINAL_CHUNK]  # the decode calls' lengths
    continuation = None
    if text is not None:
        rows = text_windows(text.ids, settings.batch, window_length(settings))
        batch = prompt_batch(manifest, settings, rng, rows[:, : settings.prompt_length])
        continuation = rows[:, settings.prompt_length :]
    pairs = []  # (actual, expected) logits of the real positions
    valid = []  # (B, L) of each call, true at its real positions: where `pairs` took them, for kl_by_position
    feeds = prefill_feeds(manifest, batch)
    ref_out, ort_out = reference.prefill(feeds), onnx.prefill(feeds)
    mask = batch["attention_mask"]
    pairs.append((_real(ort_out["logits"], mask), _real(ref_out["logits"], mask)))
    valid.append(np.asarray(mask) == 1)
    nll = (float(ort_out["loss"]), float(ref_out["loss"])) if "loss" in ort_out else None
    log.info("%s: quality over the prefill batch and %d decode steps", onnx.provider, settings.decode_steps + 1)
    read = 0
    for length in steps:
        ids = None if continuation is None else continuation[:, read : read + length]
        step_feeds, mask = next_tokens(manifest, mask, length, rng, ids)
        read += length
        ref_out = reference.decode({**step_feeds, **presents_as_past(manifest, ref_out)})
        ort_out = onnx.decode({**step_feeds, **presents_as_past(manifest, ort_out)})
        pairs.append(
            (
                ort_out["logits"].reshape(-1, ort_out["logits"].shape[-1]),
                ref_out["logits"].reshape(-1, ref_out["logits"].shape[-1]),
            )
        )
        valid.append(np.ones(ort_out["logits"].shape[:2], bool))
    stats = token_statistics(np.concatenate([a for a, _ in pairs]), np.concatenate([e for _, e in pairs]))
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
    metrics = {
        "positions": int(len(stats["kl"])),
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
        "nll_reference": None if nll is None else nll[1],
        "nll_onnx": None if nll is None else nll[0],
        "nll_delta": None if nll is None else nll[0] - nll[1],
        "perplexity_ratio": None if nll is None else float(np.exp(nll[0] - nll[1])),
        "greedy_tokens": len(trace.ids),
        "greedy_match": agreed,
        # a reference that stops at EOS early gives fewer tokens: all of them agreeing is full agreement
        "greedy_agreement": agreed / len(trace.ids) if trace.ids else 1.0,
        "greedy_divergence_margin": greedy_margin,
    }
    checks = tuple(_check(t, metrics, nll is not None) for t in profile.thresholds)
    return QualityReport(
        provider=onnx.provider,
        runtime=onnx.runtime,
        scheme=manifest.precision,
        profile=profile,
        checks=checks,
        metrics=metrics,
        greedy_reference=list(trace.ids),
        greedy_onnx=list(actual),
        kl_by_position=tuple(kl_by_position(stats["kl"], valid)),
        prefill_positions=int(np.asarray(batch["attention_mask"]).shape[1]),
        text=text,
    )


def _check(threshold: QualityThreshold, metrics: dict, has_loss: bool) -> QualityCheck:
    value = metrics.get(threshold.metric)
    if threshold.metric == "nll_delta" and not has_loss:
        return QualityCheck(threshold, None, "not judged: exported without labels, no loss output")
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
    return QualityCheck(threshold, float(value))


def greedy_prompt_of(manifest: Manifest, settings: ParitySettings) -> list[int]:
    """The greedy run's prompt: check_greedy's, from the same seed."""
    return greedy_prompt(manifest, np.random.default_rng(settings.seed + 2))
