"""An int4/int8 export made to a quality target: the smallest mix of precisions found whose artifact keeps the target
on held-out text.

The calibration text's token ids are cut in two: the first half ranks the modules, the second half is held out and
judges every mix. On the first half's windows each quantizable module is rounded alone at the scheme's bits and its
sensitivity measured (exporter.tuning.sensitivity: the mean KL from the float model's distributions). Above the
scheme's precision lie rungs a module can be raised to: int4 climbs to HQQ's blocks (a fitted zero point per block,
a float more per block; only where no algorithm was asked, else that algorithm's blocks are the scheme's) and then to
int8, int8 to float. A step raises one module one rung: every module up the first rung, most sensitive first, then up
the next. The mix of the first k steps is judged on the held-out windows, and k is the smallest that keeps the target,
found by bisection (bytes grow with every step, and the KL falls near enough monotonically, as each step raises the
next most sensitive module). The steps stop one short of every module on the top rung, so that the artifact stays
smaller than the top rung's scheme would make it (int4: the int8 artifact). Raised modules take the scheme's
accuracy level.

The artifact of that mix is then exported and its own figures measured by the verification's quality check (ONNX
Runtime against the float reference, on the held-out half, as `verify --quality-text` reads a text): where they miss
the target (ONNX Runtime's accuracy levels compute otherwise than the float-math rounding), k grows by a quarter of
what is left, up to RETRIES times. A target is kept where the whole bootstrap interval of each of its figures is
(tolerances.quality: the quality profile's judgement). The artifact moves into place only once kept, its manifest
recording the mix and the target with the held-out figures; else QualityTargetMissed names the best figures found.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exporter.artifact.destination import check_destination, move_into_place
from exporter.artifact.paths import read_text_file
from exporter.artifact.quantization import (
    DEFAULT_ALGORITHM,
    SCHEMES,
    ModulePrecision,
    QualityTarget,
    QuantizationSettings,
    requested_scheme,
)
from exporter.artifact.tokenizer import export_tokenizer
from exporter.errors import InputError, QualityTargetMissed
from exporter.export.pipeline import ExportResult, export_artifact
from exporter.export.quantize import quantizable_modules
from exporter.export.smoothing import Calibration
from exporter.tolerances.quality import (
    MIN_BOOTSTRAP_WINDOWS,
    QUALITY_CONFIDENCE,
    QUALITY_RESAMPLES,
    quality_profile_for,
)
from exporter.tuning.sensitivity import Figures, RoundedBlocks, Scorer, module_bytes, rounded_blocks
from exporter.verify.inputs import ParitySettings, QualityText, text_windows, windows_covering
from exporter.verify.metrics import bootstrap_interval

log = logging.getLogger(__name__)

WINDOW = 128  # token ids per window of the held-out half the PyTorch figures of a mix read
# Windows of the first half that rank the modules, and their length: each module costs a forward pass over them, so
# they are few and short (the ranking needs the large differences between modules, which 128 positions show).
CALIBRATION_WINDOWS, CALIBRATION_WINDOW = 2, 64
# Windows of the held-out half that judge each mix in PyTorch, spread over it: one pass over them per mix the
# bisection tries, as many as the window bootstrap needs (tolerances.quality); the artifact's own figures are then
# measured on all of the held-out half.
HELD_OUT_WINDOWS = MIN_BOOTSTRAP_WINDOWS
RETRIES = 3  # exports after the first, each with more modules raised, when the artifact misses the target


@dataclass(frozen=True)
class Candidate:
    """One mix the search judged in PyTorch: the first `raised` steps up the rungs (the module's docstring), its
    weights' bytes (`weight_bytes`: the quantizable modules' alone), and its figures on the held-out windows."""

    raised: int
    weight_bytes: int
    kl_mean: float
    kl_interval: tuple[float, float]
    top1_agreement: float
    kept: bool

    def to_dict(self) -> dict:
        return {
            "raised": self.raised,
            "weight_bytes": self.weight_bytes,
            "kl_mean": self.kl_mean,
            "kl_interval": list(self.kl_interval),
            "top1_agreement": self.top1_agreement,
            "kept": self.kept,
        }


@dataclass(frozen=True)
class _Rung:
    """A precision a module can be raised to: its name ("int4 hqq", "int8", "float"), bits (None: float), algorithm
    and accuracy level, and each module's weight there and its bytes: the float weight itself, or the blocks the
    artifact would hold (a byte or half a byte per weight, dequantized when a mix is scored: three float copies of
    every projection would not fit beside a 1B model)."""

    name: str
    bits: int | None
    algorithm: str
    accuracy_level: int
    weights: dict[str, np.ndarray | RoundedBlocks]
    sizes: dict[str, int]

    def precision(self, module: str) -> ModulePrecision:
        return ModulePrecision(module, self.bits, self.accuracy_level, self.algorithm)

    def weight(self, module: str) -> np.ndarray:
        """The module's weight at this rung as the artifact computes with it, (out, in) float32."""
        held = self.weights[module]
        return held.weight() if isinstance(held, RoundedBlocks) else held


@dataclass(frozen=True)
class TargetExport:
    """What export_to_target made: the export, the target with its held-out figures (as the manifest records it),
    the modules by sensitivity (most sensitive first, with its mean KL on the calibration windows), and each mix
    judged in PyTorch, in the order judged."""

    export: ExportResult
    target: QualityTarget
    ranked: tuple[tuple[str, float], ...]
    candidates: tuple[Candidate, ...]

    def to_dict(self) -> dict:
        return {
            **self.export.to_dict(),
            "target": self.target.to_dict(),
            "ranked": [{"module": m, "kl_mean": kl} for m, kl in self.ranked],
            "candidates": [c.to_dict() for c in self.candidates],
        }


def _interval(values: np.ndarray, windows: int) -> tuple[float, float]:
    """The bootstrap interval of the mean of `values`, `windows` equal windows' positions in order: resampling the
    windows where there are enough of them, as the quality check does, else the positions."""
    clusters = np.repeat(np.arange(windows), len(values) // windows) if windows >= MIN_BOOTSTRAP_WINDOWS else None
    return bootstrap_interval(
        values, lambda r: r.mean(axis=-1), QUALITY_RESAMPLES, QUALITY_CONFIDENCE, clusters=clusters
    )


def _keeps(profile, figures: dict[str, float], intervals: dict[str, tuple[float, float]], target) -> bool:
    """Whether every figure the target bounds keeps its limit over its whole interval, as the quality check judges."""
    thresholds = {t.metric: t for t in profile.thresholds}
    return all(thresholds[m].holds_over(*intervals[m]) is True for m in target.limits()) and all(
        np.isfinite(figures[m]) for m in target.limits()
    )


def _split(ids: np.ndarray, source: str, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The calibration windows of the first half and the held-out half's ids, or InputError for a short text."""
    half = len(ids) // 2
    if half < window:
        raise InputError(
            f"`calibration_text` {source} gives {len(ids)} tokens; its two halves (calibration, held out) need "
            f"{window} each: give a longer text"
        )
    return text_windows(ids[:half], CALIBRATION_WINDOWS, min(window, CALIBRATION_WINDOW)), ids[half:]


def export_to_target(
    model,
    folder: Path,
    dtype: str,
    target: QualityTarget,
    calibration_text: Path,
    source: dict | None = None,
    tokenizer=None,
    *,
    quantization: QuantizationSettings | None = None,
    with_loss: bool = True,
    trace_all_layers: bool = False,
) -> TargetExport:
    """Export `model` as `dtype` ("int4", "int8") with the fewest modules raised a rung that keeps `target` on the
    held-out half of `calibration_text` (the module's docstring).

    Args:
        model: the reference model, as export_artifact takes it (float32).
        folder: the output folder; an earlier artifact there is replaced only by one that keeps the target.
        dtype: "int4" or "int8".
        target: the QualityTarget (parse_quality_target), without figures.
        calibration_text: a UTF-8 text file, tokenized with the export's tokenizer.
        source: where the weights came from (export_artifact's).
        tokenizer: the export's tokenizer (export_artifact's); required, to read the text.
        quantization: block size, accuracy level, lm_head, embedding, activations (no mix: the search makes it).
        with_loss: give prefill.onnx its loss.
        trace_all_layers: export_artifact's.

    Returns:
        The TargetExport.

    Raises:
        InputError: a float dtype, no tokenizer, an unreadable or too short text, a mix given.
        QualityTargetMissed: no mix below the rung above keeps the target; the message gives the best figures.
        and whatever export_artifact raises.
    """
    from exporter.runtime.runner import OrtRunner
    from exporter.verify.checks.quality import check_quality
    from exporter.verify.references.torch_runner import TorchRunner

    if dtype not in SCHEMES:
        raise InputError(
            f"a quality target applies to int4/int8 exports; {dtype!r} quantizes nothing: choose `dtype` int4 or int8"
        )
    if not isinstance(target, QualityTarget):
        raise InputError(f"target must be a QualityTarget (parse_quality_target), got {type(target).__name__}")
    settings = QuantizationSettings() if quantization is None else quantization
    if settings.mix:
        raise InputError("`quantization.mix` is what a quality target's search makes; drop it, or drop the target")
    folder = Path(os.path.abspath(folder))
    check_destination(folder)
    config = model.config
    scheme = requested_scheme(dtype, config.hidden_size, settings)
    tokens = export_tokenizer(tokenizer, config.vocab_size)
    if tokens is None:
        raise InputError(
            "`calibration_text` is tokenized with the export's tokenizer, and none is given: pass `tokenizer`"
        )
    shown = str(calibration_text)
    ids = np.asarray(tokens.loaded.encode(read_text_file(calibration_text, "calibration_text")).ids, np.int64)
    window = min(WINDOW, config.max_position_embeddings)
    calibration, held_ids = _split(ids, shown, window)
    # an int8 export that smooths its projections' inputs measures them on the calibration half too
    smoothing_calibration = (
        Calibration(calibration, f"{len(calibration)} windows of {window} tokens of the first half of {shown}")
        if scheme.smoothing is not None
        else None
    )
    held_rows = text_windows(held_ids, min(HELD_OUT_WINDOWS, windows_covering(len(held_ids), window)), window)
    profile = quality_profile_for(dtype, target)
    model.eval()  # as the reference runs it

    began = time.perf_counter()
    modules = quantizable_modules(model, config.vocab_size)
    weights = {m: model.get_submodule(m).weight.detach().float().numpy() for m in modules}
    float_bytes = 2 if settings.activations == "float16" else 4

    def rung(name: str, bits: int | None, algorithm: str = DEFAULT_ALGORITHM) -> _Rung:
        made = {m: w if bits is None else rounded_blocks(w, bits, scheme, algorithm) for m, w in weights.items()}
        sizes = {m: module_bytes(w.shape, bits, scheme, float_bytes, algorithm) for m, w in weights.items()}
        level = scheme.accuracy_level if bits is not None else 0
        return _Rung(name, bits, algorithm, level, made, sizes)

    base = rung(f"int{scheme.bits} {scheme.algorithm}", scheme.bits, scheme.algorithm)
    # the rungs above the scheme's, in order: int4 with no algorithm asked climbs through HQQ's blocks first
    rungs = [rung("int4 hqq", 4, "hqq")] if scheme.bits == 4 and settings.algorithm is None else []
    rungs.append(rung("int8", 8) if scheme.bits == 4 else rung("float", None))
    log.info(
        "quality target %s: ranking %d modules on %d calibration windows of %d tokens (the first half of %s's %d)",
        target.describe(),
        len(modules),
        len(calibration),
        calibration.shape[1],
        shown,
        len(ids),
    )
    scorer = Scorer(model, calibration)
    sensitivity = {}
    for index, module in enumerate(modules, 1):
        sensitivity[module] = scorer.score({module: base.weight(module)}).kl_mean
        if index % max(1, len(modules) // 10) == 0 or index == len(modules):
            log.info("sensitivity: %d/%d modules (%.0f s)", index, len(modules), time.perf_counter() - began)
    ranked = sorted(modules, key=lambda m: -sensitivity[m])
    # each step raises one module one rung: every module up the first rung, most sensitive first, then up the next;
    # one short of every module on the top rung, so that the artifact stays smaller than the top rung's scheme
    steps = [(m, r) for r in range(len(rungs)) for m in ranked][:-1]
    held = Scorer(model, held_rows)
    candidates: dict[int, Candidate] = {}

    def placed(k: int) -> dict[str, int]:
        """Each module's rung after the first `k` steps (-1: the scheme's)."""
        where = dict.fromkeys(modules, -1)
        for module, index in steps[:k]:
            where[module] = index
        return where

    def judge(k: int) -> Candidate:
        if k not in candidates:
            where = placed(k)
            mix = {m: (rungs[r] if r >= 0 else base).weight(m) for m, r in where.items()}
            figures: Figures = held.score(mix)
            windows = len(held_rows)
            intervals = {"kl_mean": _interval(figures.kl, windows), "top1_agreement": _interval(figures.top1, windows)}
            values = {"kl_mean": figures.kl_mean, "top1_agreement": figures.top1_agreement}
            candidates[k] = Candidate(
                k,
                sum(rungs[r].sizes[m] if r >= 0 else base.sizes[m] for m, r in where.items()),
                figures.kl_mean,
                intervals["kl_mean"],
                figures.top1_agreement,
                _keeps(profile, values, intervals, target),
            )
            c = candidates[k]
            log.info(
                "%s: held-out mean KL %.4g [%.4g, %.4g], top-1 %.3f: %s",
                _described(where, rungs, len(modules)),
                c.kl_mean,
                *c.kl_interval,
                c.top1_agreement,
                "keeps the target" if c.kept else "misses it",
            )
        return candidates[k]

    most = len(steps)
    if not judge(0).kept:
        if not judge(most).kept:
            raise _missed(target, dtype, rungs[-1].name, judge(most), None)
        low, high = 0, most  # low misses, high keeps
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if judge(middle).kept else (middle, high)
        k = high
    else:
        k = 0
    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.target-", dir=parent))
    text = QualityText(f"{shown} (held-out second half)", held_ids)
    parity = ParitySettings().fit(config.max_position_embeddings)
    try:
        for attempt in range(RETRIES + 1):
            where = placed(k)
            mix = tuple(rungs[where[m]].precision(m) for m in ranked if where[m] >= 0)
            built = work / f"k{k}"
            log.info("exporting %s; then its own figures on the held-out half", _described(where, rungs, len(modules)))
            export = export_artifact(
                model,
                built,
                dtype,
                with_loss,
                source,
                tokens,
                quantization=dataclasses.replace(settings, mix=mix),
                calibration=smoothing_calibration,
                trace_all_layers=trace_all_layers,
            )
            manifest = export.manifest
            report = check_quality(
                TorchRunner(model, manifest),
                OrtRunner(built),
                manifest,
                None,
                parity,
                profile,
                np.random.default_rng(parity.seed + 1),
                text,
            )
            measured = _measured(report, text, len(ids))
            kept = all(c.passed for c in report.checks if c.threshold.metric in target.limits())
            log.info(
                "artifact of %d step(s): held-out mean KL %.4g [%.4g, %.4g], top-1 %.3f: %s",
                k,
                measured["kl_mean"],
                *measured["kl_mean_interval"],
                measured["top1_agreement"],
                "keeps the target" if kept else "misses it",
            )
            if kept:
                recorded = dataclasses.replace(target, measured=measured)
                manifest = dataclasses.replace(
                    manifest, quantization=dataclasses.replace(manifest.quantization, target=recorded)
                )
                manifest.write(built)
                move_into_place(built, folder)
                export = dataclasses.replace(export, folder=folder, manifest=manifest)
                return TargetExport(
                    export, recorded, tuple((m, sensitivity[m]) for m in ranked), tuple(candidates.values())
                )
            if k >= most or attempt == RETRIES:
                raise _missed(target, dtype, rungs[-1].name, None, measured | {"raised": k})
            shutil.rmtree(built, ignore_errors=True)
            k = min(most, k + max(1, (most - k) // 4))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    raise AssertionError("unreachable: the loop returns or raises")


def _measured(report, text: QualityText, tokens: int) -> dict:
    """The held-out figures the manifest records of a quality report."""
    metrics, intervals = report.metrics, report.intervals
    return {
        "kl_mean": metrics["kl_mean"],
        "kl_mean_interval": list(intervals["kl_mean"]),
        "kl_p99": metrics["kl_p99"],
        "kl_p99_interval": list(intervals["kl_p99"]),
        "top1_agreement": metrics["top1_agreement"],
        "top1_agreement_interval": list(intervals["top1_agreement"]),
        "positions": metrics["positions"],
        "text": text.source,
        "part": f"token ids {tokens // 2}..{tokens} of {tokens} (the first half ranked the modules)",
    }


def _described(where: dict[str, int], rungs: list[_Rung], modules: int) -> str:
    """How many of the `modules` a placement (placed) raised to each rung."""
    counts = [sum(r == index for r in where.values()) for index in range(len(rungs))]
    raised = ", ".join(f"{count} at {r.name}" for count, r in zip(counts, rungs) if count)
    return f"{raised or 'none'} of {modules} modules raised"


def _missed(target: QualityTarget, dtype: str, top: str, candidate: Candidate | None, measured: dict | None):
    if candidate is not None:
        best = (
            f"every module but one at {top}, held-out mean KL {candidate.kl_mean:.4g} "
            f"(interval up to {candidate.kl_interval[1]:.4g}), top-1 {candidate.top1_agreement:.3f}"
        )
    else:
        best = (
            f"the artifact of {measured['raised']} step(s) up: held-out mean KL {measured['kl_mean']:.4g} "
            f"(interval up to {measured['kl_mean_interval'][1]:.4g}), top-1 {measured['top1_agreement']:.3f}"
        )
    return QualityTargetMissed(
        f"no {dtype} mix below {top} keeps the quality target {target.describe()}; the best found, {best}: "
        f"loosen the target (`quality_target`), or export {top} (`dtype`)"
    )
