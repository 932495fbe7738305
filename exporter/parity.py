"""Parity: ONNX Runtime against the PyTorch reference on identical inputs.

Checks, per execution provider:
- prefill: logits, every present key/value and the loss, on a left-padded
  batch whose labels contain -100;
- decode: after a prefill, single-token steps and a final 3-token chunk, each
  side feeding its own present back as past; logits and present every step;
- greedy generation: the ONNX Runtime loop against the reference's own cached
  decoding;
- for MoE models, expert-choice agreement: the fraction of (token, layer)
  pairs whose chosen experts are the same in the graphs and the reference
  (exporter/routing.py).
and once per artifact, when it can run, onnxruntime-genai's own generation
loop over the folder as it is (the consumer check).
Comparison functions are pure and return frozen result objects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from exporter.consumers import GENAI_CONFIG, genai_unsupported
from exporter.errors import ConsumerError
from exporter.genai import INSTALL_HINT, GenaiGenerator, genai_version
from exporter.manifest import Manifest, read_manifest
from exporter.reference_runner import TorchRunner, reference_greedy, reference_next_logits
from exporter.generation import generate_greedy
from exporter.routing import ExpertAgreement, check_expert_choice
from exporter.runtime import (OrtRunner, available_parity_providers, check_provider, position_ids_from_mask,
                              presents_as_past)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tolerance:
    """An element passes when |actual - expected| <= atol + rtol * |expected| + peak * max|expected|.

    The first two terms are numpy.allclose. `peak` scales with the largest
    magnitude in the tensor: rounding errors of a dot product or a norm are set
    by the magnitude of what was summed, so an output near zero inherits an
    absolute error from its large neighbours that no elementwise rtol covers.
    """

    atol: float
    rtol: float
    peak: float = 0.0

    def allowed(self, expected: np.ndarray) -> np.ndarray:
        magnitude = np.abs(np.where(np.isnan(expected), 0.0, expected))
        return self.atol + self.rtol * magnitude + self.peak * magnitude.max()

    def to_dict(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol, "peak": self.peak}


FP16_UNIT_ROUNDOFF = 2.0 ** -11

# Why these numbers (README "Tolerances" has the long form):
# float32: both sides compute in float32 with different kernels and summation
#   orders. Measured differences are ~5e-6 (tiny) and ~5e-5 (minimind-3) in
#   absolute terms on logits of magnitude up to ~12. 1e-4 + 1e-4 * |x| leaves
#   headroom for other CPUs and the CUDA provider while staying 3-4 orders of
#   magnitude below what a wrong graph produces (a wrong mask, position or
#   weight moves logits by O(1)).
# float16: every stored activation is rounded to 11 significant bits (unit
#   roundoff u = 2^-11) and the two sides round at different points
#   (onnxruntime's CPU provider upcasts many ops to float32, PyTorch keeps
#   float16 tensors). The difference is as large as float16's own loss against
#   float32 (measured: PyTorch fp16 vs fp32 4.9e-2, ONNX Runtime fp16 vs
#   PyTorch fp16 4.1e-2 on minimind-3 logits peaking at 12.1, i.e. ~7u of the
#   peak). The tolerance allows 16u of the tensor's peak plus 4u elementwise.
# The loss is a float32 mean of log-probabilities in both dtypes, compared
#   with the tolerance of the logits it is computed from.
_FP32 = Tolerance(atol=1e-4, rtol=1e-4)
_FP16 = Tolerance(atol=1e-3, rtol=4 * FP16_UNIT_ROUNDOFF, peak=16 * FP16_UNIT_ROUNDOFF)
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "float32": {"logits": _FP32, "kv": _FP32, "loss": _FP32},
    "float16": {"logits": _FP16, "kv": _FP16, "loss": _FP16},
}


@dataclass(frozen=True)
class Comparison:
    name: str
    kind: str  # "logits", "kv" or "loss"
    max_abs: float
    max_rel: float
    mean_abs: float
    tolerance: Tolerance
    passed: bool
    worst: str = ""  # for an aggregate: which member had the largest error

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "max_abs": self.max_abs, "max_rel": self.max_rel,
                "mean_abs": self.mean_abs, "tolerance": self.tolerance.to_dict(), "passed": self.passed,
                "worst": self.worst}


def compare(name: str, kind: str, actual, expected, tolerance: Tolerance) -> Comparison:
    """Elementwise comparison; NaN passes only where both sides are NaN (e.g. a loss with no targets)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return Comparison(name, kind, float("inf"), float("inf"), float("inf"), tolerance, False,
                          f"shape {actual.shape} != {expected.shape}")
    both_nan = np.isnan(actual) & np.isnan(expected)
    diff = np.where(both_nan, 0.0, np.abs(actual - expected))
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on one side only
    rel = diff / np.maximum(np.abs(np.where(both_nan, 1.0, expected)), np.finfo(np.float32).tiny)
    if diff.size == 0:
        return Comparison(name, kind, 0.0, 0.0, 0.0, tolerance, True)
    passed = bool(np.all(diff <= tolerance.allowed(expected)))
    return Comparison(name, kind, float(diff.max()), float(rel.max()), float(diff.mean()), tolerance, passed)


def aggregate(name: str, comparisons: list[Comparison]) -> Comparison:
    """One row for many comparisons of the same kind: the worst figures, passed only if all passed."""
    worst = max(comparisons, key=lambda c: c.max_abs)
    return Comparison(name, worst.kind, worst.max_abs, max(c.max_rel for c in comparisons),
                      float(np.mean([c.mean_abs for c in comparisons])), worst.tolerance,
                      all(c.passed for c in comparisons), worst.name)


@dataclass(frozen=True)
class ParitySettings:
    batch: int = 2
    prompt_length: int = 12
    left_padding: int = 3  # on the first row of the batch
    decode_steps: int = 16  # single-token steps, followed by one 3-token chunk
    greedy_tokens: int = 32
    seed: int = 0


@dataclass(frozen=True)
class GreedyResult:
    reference_ids: list[int]
    onnx_ids: list[int]
    match_length: int  # tokens equal from the start
    passed: bool
    note: str

    def to_dict(self) -> dict:
        return {"reference_ids": self.reference_ids, "onnx_ids": self.onnx_ids, "match_length": self.match_length,
                "passed": self.passed, "note": self.note}


@dataclass(frozen=True)
class ProviderReport:
    provider: str
    dtype: str
    comparisons: list[Comparison]
    greedy: GreedyResult
    experts: ExpertAgreement | None = None  # MoE models only

    @property
    def passed(self) -> bool:
        experts_ok = self.experts is None or self.experts.passed
        return all(c.passed for c in self.comparisons) and self.greedy.passed and experts_ok

    def to_dict(self) -> dict:
        return {"provider": self.provider, "dtype": self.dtype, "passed": self.passed,
                "comparisons": [c.to_dict() for c in self.comparisons], "greedy": self.greedy.to_dict(),
                "expert_choice": self.experts.to_dict() if self.experts is not None else None}


@dataclass(frozen=True)
class ConsumerReport:
    """Another runtime (onnxruntime-genai) loading the folder as it is, against the reference."""

    consumer: str  # name and version
    model_type: str
    greedy: GreedyResult

    @property
    def passed(self) -> bool:
        return self.greedy.passed

    def to_dict(self) -> dict:
        return {"consumer": self.consumer, "model_type": self.model_type, "passed": self.passed,
                "greedy": self.greedy.to_dict()}


@dataclass(frozen=True)
class VerifyReport:
    folder: str
    reports: list[ProviderReport]
    skipped: dict[str, str] = field(default_factory=dict)  # provider -> reason
    consumers: list[ConsumerReport] = field(default_factory=list)
    consumers_skipped: dict[str, str] = field(default_factory=dict)  # consumer -> reason

    @property
    def passed(self) -> bool:
        return bool(self.reports) and all(r.passed for r in self.reports) and all(c.passed for c in self.consumers)

    def to_dict(self) -> dict:
        return {"folder": self.folder, "passed": self.passed, "providers": [r.to_dict() for r in self.reports],
                "skipped": self.skipped, "consumers": [c.to_dict() for c in self.consumers],
                "consumers_skipped": self.consumers_skipped}


def _prompt_batch(manifest: Manifest, settings: ParitySettings, rng: np.random.Generator) -> dict:
    """A left-padded batch with labels holding -100 on padding and on a few real tokens."""
    b, t = settings.batch, settings.prompt_length
    input_ids = rng.integers(0, manifest.config.vocab_size, (b, t), dtype=np.int64)
    mask = np.ones((b, t), dtype=np.int64)
    mask[0, :settings.left_padding] = 0
    labels = np.where(mask == 1, input_ids, -100)
    labels[:, -2] = -100
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
            "labels": labels}


def _prefill_feeds(manifest: Manifest, batch: dict) -> dict:
    return {name: batch[name] for name in manifest.prefill.input_names}


def check_prefill(reference, onnx, manifest: Manifest, batch: dict) -> list[Comparison]:
    tolerances = TOLERANCES[manifest.dtype]
    feeds = _prefill_feeds(manifest, batch)
    expected = reference.prefill({**feeds, "labels": batch["labels"]})
    actual = onnx.prefill(feeds)
    presents = [compare(f"prefill {name}", "kv", actual[name], expected[name], tolerances["kv"])
                for name in actual if name.startswith("present.")]
    rows = [compare("prefill logits", "logits", actual["logits"], expected["logits"], tolerances["logits"]),
            aggregate("prefill present (all layers)", presents)]
    if "loss" in actual:
        rows.append(compare("prefill loss", "loss", actual["loss"], expected["loss"], tolerances["loss"]))
    return rows


def check_decode(reference, onnx, manifest: Manifest, batch: dict, settings: ParitySettings,
                 rng: np.random.Generator) -> list[Comparison]:
    """Each side feeds its own present back as past; the new tokens are the same seeded ids for both."""
    tolerances = TOLERANCES[manifest.dtype]
    feeds = _prefill_feeds(manifest, batch)
    ref_out, ort_out = reference.prefill(feeds), onnx.prefill(feeds)
    mask = batch["attention_mask"]
    logits, presents = [], []
    chunks = [1] * settings.decode_steps + [3]
    for step, length in enumerate(chunks):
        tokens = rng.integers(0, manifest.config.vocab_size, (mask.shape[0], length), dtype=np.int64)
        mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
        step_feeds = {"input_ids": tokens, "attention_mask": mask,
                      "position_ids": position_ids_from_mask(mask, mask.shape[1] - length)}
        ref_out = reference.decode({**step_feeds, **presents_as_past(manifest, ref_out)})
        ort_out = onnx.decode({**step_feeds, **presents_as_past(manifest, ort_out)})
        logits.append(compare(f"decode step {step} logits", "logits", ort_out["logits"], ref_out["logits"],
                              tolerances["logits"]))
        presents += [compare(f"decode step {step} {name}", "kv", ort_out[name], ref_out[name], tolerances["kv"])
                     for name in ort_out if name.startswith("present.")]
    return [aggregate(f"decode logits ({len(chunks)} steps)", logits),
            aggregate(f"decode present ({len(chunks)} steps, all layers)", presents)]


def greedy_prompt(manifest: Manifest, rng: np.random.Generator) -> list[int]:
    return [int(i) for i in rng.integers(0, manifest.config.vocab_size, 8)]


def judge_greedy(model: torch.nn.Module, manifest: Manifest, prompt: list[int], expected: list[int],
                 actual: list[int]) -> GreedyResult:
    """Token ids must be equal; a divergence passes only at a near-tie of the reference's logits.

    At a near-tie (the two candidates' reference logits closer than the logits
    tolerance) either choice is within the dtype's precision, which happens in
    float16; it is reported in the note.
    """
    match = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b), min(len(actual), len(expected)))
    if actual == expected:
        return GreedyResult(expected, actual, match, True, f"{len(actual)} tokens identical")
    if match == min(len(actual), len(expected)):
        return GreedyResult(expected, actual, match, False, "one side stopped early")
    logits = reference_next_logits(model, prompt + expected[:match])
    gap = abs(float(logits[expected[match]]) - float(logits[actual[match]]))
    allowed = TOLERANCES[manifest.dtype]["logits"].allowed(logits.astype(np.float64))
    near_tie = gap <= allowed[expected[match]]
    note = (f"diverged at token {match}: reference {expected[match]} vs onnx {actual[match]}, "
            f"reference logit gap {gap:.3g} ({'a near-tie within tolerance' if near_tie else 'not a tie'})")
    return GreedyResult(expected, actual, match, near_tie, note)


def check_greedy(model: torch.nn.Module, onnx, manifest: Manifest, settings: ParitySettings,
                 rng: np.random.Generator) -> GreedyResult:
    """Our ONNX Runtime loop against the reference's own cached decoding, from a seeded prompt."""
    prompt = greedy_prompt(manifest, rng)
    eos = manifest.config.eos_token_id
    expected = reference_greedy(model, prompt, settings.greedy_tokens, eos)
    actual = generate_greedy(onnx, prompt, settings.greedy_tokens, eos).new_ids
    return judge_greedy(model, manifest, prompt, expected, actual)


def run_parity(model: torch.nn.Module, folder: Path, provider: str, manifest: Manifest,
               settings: ParitySettings = ParitySettings()) -> ProviderReport:
    onnx = OrtRunner(folder, provider, manifest=manifest)
    reference = TorchRunner(model, manifest)
    log.info("parity on %s: prefill", onnx.provider)
    batch = _prompt_batch(manifest, settings, np.random.default_rng(settings.seed))
    rows = check_prefill(reference, onnx, manifest, batch)
    log.info("parity on %s: %d decode steps", onnx.provider, settings.decode_steps + 1)
    rows += check_decode(reference, onnx, manifest, batch, settings, np.random.default_rng(settings.seed + 1))
    log.info("parity on %s: greedy generation of %d tokens", onnx.provider, settings.greedy_tokens)
    greedy = check_greedy(reference.model, onnx, manifest, settings, np.random.default_rng(settings.seed + 2))
    rng = np.random.default_rng(settings.seed + 3)
    steps = [rng.integers(0, manifest.config.vocab_size, (settings.batch, n), dtype=np.int64)
             for n in [1] * settings.decode_steps + [3]]
    experts = check_expert_choice(reference, folder, manifest, onnx.provider, batch, steps,
                                  TOLERANCES[manifest.dtype]["logits"])
    return ProviderReport(onnx.provider, manifest.dtype, rows, greedy, experts)


def check_genai(model: torch.nn.Module, folder: Path, manifest: Manifest,
                settings: ParitySettings = ParitySettings()) -> ConsumerReport:
    """onnxruntime-genai's own loop over the folder against the reference, from check_greedy's prompt.

    onnxruntime-genai stops at EOS and leaves it out, so a final EOS of the
    reference is dropped before comparing.
    """
    prompt = greedy_prompt(manifest, np.random.default_rng(settings.seed + 2))
    eos = manifest.config.eos_token_id
    expected = reference_greedy(model, prompt, settings.greedy_tokens, eos)
    if expected and expected[-1] == eos:
        expected = expected[:-1]
    log.info("consumer check: greedy generation of %d tokens in onnxruntime-genai", settings.greedy_tokens)
    generator = GenaiGenerator(folder)
    actual = generator.greedy(prompt, settings.greedy_tokens)
    return ConsumerReport(f"onnxruntime-genai {genai_version()}", generator.model_type,
                          judge_greedy(model, manifest, prompt, expected, actual))


def _genai_skip_reason(folder: Path, manifest: Manifest) -> str:
    if genai_version() is None:
        return f"onnxruntime-genai is not installed ({INSTALL_HINT})"
    if genai_unsupported(manifest):
        return genai_unsupported(manifest)
    if not (Path(folder) / GENAI_CONFIG).is_file():
        return f"the folder has no {GENAI_CONFIG} (exported by an older toolkit); re-export it"
    return ""


def verify_artifact(folder: Path, model: torch.nn.Module, providers: list[str] | None = None,
                    settings: ParitySettings = ParitySettings(), genai: bool | None = None) -> VerifyReport:
    """Parity on the given providers (each must exist), or on every available one when None.

    genai: also check onnxruntime-genai's greedy tokens against the reference; None runs the check when
    it can (installed, a family it runs, a genai_config.json) and reports why not otherwise, True makes
    each of those a ConsumerError, False skips it.
    """
    manifest = read_manifest(folder)
    if providers is None:
        chosen, skipped = available_parity_providers()
    else:
        chosen, skipped = [check_provider(p) for p in providers], {}
    reports = [run_parity(model, folder, provider, manifest, settings) for provider in chosen]
    reason = "turned off" if genai is False else _genai_skip_reason(folder, manifest)
    if reason and genai:
        raise ConsumerError(f"cannot run the onnxruntime-genai check on {folder}: {reason}")
    if reason:
        return VerifyReport(str(folder), reports, skipped, consumers_skipped={"onnxruntime-genai": reason})
    consumer = check_genai(TorchRunner(model, manifest).model, folder, manifest, settings)
    return VerifyReport(str(folder), reports, skipped, consumers=[consumer])
