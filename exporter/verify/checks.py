"""Reference against ONNX Runtime on identical seeded inputs: prefill, stateful decode, greedy, sweep.

`reference` is anything with prefill(feeds), decode(feeds) and greedy(prompt, n, eos) -> GreedyTrace:
the PyTorch model (exporter.reference_runner.TorchRunner) or a recorded golden bundle
(exporter.verify.golden.RecordedReference); `onnx` is an exporter.runtime.OrtRunner. Nothing here
imports torch.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from exporter.contract import KV_KINDS
from exporter.generation import NonFiniteLogits, generate_greedy
from exporter.manifest import Manifest
from exporter.runtime import position_ids_from_mask, presents_as_past
from exporter.verify.health import HealthScan
from exporter.verify.inputs import FINAL_CHUNK, ParitySettings, next_tokens, prefill_feeds, ragged_mask, sweep_grid
from exporter.verify.metrics import (Comparison, aggregate, compare, difference_histogram, match_length,
                                     real_keys)
from exporter.verify.tolerances import Profile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerError:
    """Present key and value of one layer; the layer's KV depends only on the layers before it and on its
    own input norm and key/value projections."""

    layer: int
    key: Comparison
    value: Comparison

    @property
    def passed(self) -> bool:
        return self.key.passed and self.value.passed

    def to_dict(self) -> dict:
        return {"layer": self.layer, "passed": self.passed, "key_max_abs": self.key.max_abs,
                "value_max_abs": self.value.max_abs, "key_needed_scale": self.key.needed.scale,
                "value_needed_scale": self.value.needed.scale}


def layer_errors(manifest: Manifest, actual: dict, expected: dict, profile: Profile, label: str,
                 mask: np.ndarray) -> list[LayerError]:
    """Judged at the cache positions `mask` (B, L) marks real."""
    cache = manifest.cache
    return [LayerError(layer, *(compare(f"{label} {cache.present(layer, kind)}", "kv", actual[cache.present(layer, kind)],
                                        expected[cache.present(layer, kind)], profile.kv, valid=real_keys(mask))
                                for kind in KV_KINDS))
            for layer in range(cache.num_layers)]


@dataclass(frozen=True)
class PrefillResult:
    comparisons: list[Comparison]
    layers: list[LayerError]
    histogram: dict  # |logit difference| counts, for the report plot


def check_prefill(reference, onnx, manifest: Manifest, batch: dict, profile: Profile,
                  health: HealthScan) -> tuple[PrefillResult, dict]:
    """Logits and every present at the real positions, the loss; returns the result and ONNX Runtime's outputs."""
    feeds = prefill_feeds(manifest, batch)  # labels only where the graph takes them (an export with loss)
    expected = reference.prefill(feeds)
    actual = onnx.prefill(feeds)
    real = batch["attention_mask"] == 1
    health.scan_outputs("prefill", actual, batch["attention_mask"])
    layers = layer_errors(manifest, actual, expected, profile, "prefill", batch["attention_mask"])
    rows = [compare("prefill logits", "logits", actual["logits"], expected["logits"], profile.logits, valid=real),
            aggregate("prefill present (all layers)", [c for layer in layers for c in (layer.key, layer.value)])]
    if "loss" in actual:
        rows.append(compare("prefill loss", "loss", actual["loss"], expected["loss"], profile.loss))
    return PrefillResult(rows, layers, difference_histogram(actual["logits"][real], expected["logits"][real])), actual


@dataclass(frozen=True)
class StepError:
    """One decode step: the point of the error curve."""

    step: int
    tokens: int
    logits: Comparison
    kv: Comparison  # the worst layer
    first_failing_layer: int | None

    def to_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "passed": self.logits.passed and self.kv.passed,
                "logits_max_abs": self.logits.max_abs, "logits_needed_scale": self.logits.needed.scale,
                "kv_max_abs": self.kv.max_abs, "kv_needed_scale": self.kv.needed.scale,
                "kl_mean": self.logits.llm.get("kl_mean"), "top1_agreement": self.logits.llm.get("top1_agreement"),
                "first_failing_layer": self.first_failing_layer}


@dataclass(frozen=True)
class DecodeResult:
    comparisons: list[Comparison]
    curve: list[StepError]


def check_decode(reference, onnx, manifest: Manifest, batch: dict, settings: ParitySettings, profile: Profile,
                 health: HealthScan, rng: np.random.Generator) -> tuple[DecodeResult, dict]:
    """Prefill, then `decode_steps` single-token steps and one 3-token chunk, each side feeding its own
    present back as past; the new tokens are the same seeded ids for both. Returns the result and ONNX
    Runtime's last outputs."""
    feeds = prefill_feeds(manifest, batch)
    ref_out, ort_out = reference.prefill(feeds), onnx.prefill(feeds)
    mask = batch["attention_mask"]
    curve = []
    chunks = [1] * settings.decode_steps + [FINAL_CHUNK]
    for step, length in enumerate(chunks):
        step_feeds, mask = next_tokens(manifest, mask, length, rng)
        ref_out = reference.decode({**step_feeds, **presents_as_past(manifest, ref_out)})
        ort_out = onnx.decode({**step_feeds, **presents_as_past(manifest, ort_out)})
        health.scan_outputs(f"decode step {step}", ort_out, mask)
        layers = layer_errors(manifest, ort_out, ref_out, profile, f"decode step {step}", mask)
        failing = next((layer.layer for layer in layers if not layer.passed), None)
        curve.append(StepError(step, length,
                               compare(f"decode step {step} logits", "logits", ort_out["logits"], ref_out["logits"],
                                       profile.logits),
                               aggregate(f"decode step {step} present",
                                         [c for layer in layers for c in (layer.key, layer.value)]), failing))
    rows = [aggregate(f"decode logits ({len(chunks)} steps)", [s.logits for s in curve]),
            aggregate(f"decode present ({len(chunks)} steps, all layers)", [s.kv for s in curve])]
    return DecodeResult(rows, curve), ort_out


@dataclass(frozen=True)
class GreedyTrace:
    """The reference's greedy tokens and, per token, the logits it was chosen from."""

    ids: list[int]
    logits: np.ndarray  # (len(ids), vocab) float32


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


def judge_greedy(trace: GreedyTrace, actual: list[int], profile: Profile, expected: list[int] | None = None,
                 dropped_eos: int | None = None) -> GreedyResult:
    """Token ids must be equal; a divergence passes only at a near-tie of the reference's logits.

    At a near-tie (the two candidates' reference logits closer than the logits tolerance) either choice is
    within the dtype's precision, which happens in float16; it is reported in the note. `expected`
    defaults to the trace's ids. A consumer that stops at EOS and leaves it out passes `expected` without a
    final EOS and `dropped_eos`: where one side's list ends before the other's, that side chose EOS there.
    """
    expected = trace.ids if expected is None else expected
    match = match_length(actual, expected)
    if actual == expected:
        stopped = " (both stopped at EOS at once: nothing else to compare)" if not actual and dropped_eos is not None \
            and trace.ids[:1] == [dropped_eos] else ""
        return GreedyResult(expected, actual, match, True, f"{len(actual)} tokens identical{stopped}")
    if match == min(len(actual), len(expected)) and (dropped_eos is None or match >= len(trace.logits)):
        return GreedyResult(expected, actual, match, False, "one side stopped early")
    chosen, other = (ids[match] if match < len(ids) else dropped_eos for ids in (expected, actual))
    logits = trace.logits[match].astype(np.float64)
    gap = abs(logits[chosen] - logits[other])
    near_tie = bool(gap <= profile.logits.allowed(logits)[chosen])
    note = (f"diverged at token {match}: reference {chosen} vs onnx {other}, "
            f"reference logit gap {gap:.3g} ({'a near-tie within tolerance' if near_tie else 'not a tie'})")
    return GreedyResult(expected, actual, match, near_tie, note)


def check_greedy(reference, onnx, manifest: Manifest, prompt: list[int], settings: ParitySettings,
                 profile: Profile) -> GreedyResult:
    """Our ONNX Runtime loop against the reference's own cached decoding, from a seeded prompt."""
    eos = manifest.config.eos_token_id
    trace = reference.greedy(prompt, settings.greedy_tokens, eos)
    try:
        actual = generate_greedy(onnx, prompt, settings.greedy_tokens, eos).new_ids
    except NonFiniteLogits:  # a result to report with the others, not an error that ends the run
        return GreedyResult(trace.ids, [], 0, False, NonFiniteLogits.reason)
    return judge_greedy(trace, actual, profile)


@dataclass(frozen=True)
class SweepCase:
    batch: int
    new_tokens: int
    past: int
    logits: Comparison
    kv: Comparison
    # MoE: a failing case whose every expert-choice disagreement is a near-tie of the reference's router
    # scores diverged within the precision of the routing decision (like a greedy near-tie); the note says so.
    routing_near_tie: bool = False
    routing_note: str = ""

    @property
    def passed(self) -> bool:
        return (self.logits.passed and self.kv.passed) or self.routing_near_tie

    @property
    def name(self) -> str:
        return f"batch {self.batch} x new {self.new_tokens} x past {self.past}"

    def to_dict(self) -> dict:
        return {"batch": self.batch, "new_tokens": self.new_tokens, "past": self.past, "passed": self.passed,
                "logits": self.logits.to_dict(), "kv": self.kv.to_dict(), "routing_near_tie": self.routing_near_tie,
                "routing_note": self.routing_note}


def _with_labels(manifest: Manifest, feeds: dict) -> dict:
    if "labels" in manifest.prefill.input_names:
        return {**feeds, "labels": np.where(feeds["attention_mask"] == 1, feeds["input_ids"], -100)}
    return feeds


def run_sweep(reference, onnx, manifest: Manifest, profile: Profile, health: HealthScan,
              rng: np.random.Generator, explain_routing=None) -> list[SweepCase]:
    """Every (batch, new tokens, past) of the grid with ragged left padding: each side prefills the past
    with prefill.onnx (or starts from an empty cache) and decodes the new tokens on top of its own cache.

    explain_routing(onnx_feeds, valid) -> ExpertAgreement, for MoE models: asked about a failing case right
    after the reference's decode call, it tells whether the two sides routed some token differently, and at a
    near-tie."""
    cases = []
    vocab = manifest.config.vocab_size
    for batch, new, past in sweep_grid(manifest.config.max_position_embeddings):
        mask = ragged_mask(batch, past, new)
        ids = rng.integers(0, vocab, (batch, past + new), dtype=np.int64)
        if past:
            first = _with_labels(manifest, {"input_ids": ids[:, :past], "attention_mask": mask[:, :past],
                                            "position_ids": position_ids_from_mask(mask[:, :past])})
            ref_past = presents_as_past(manifest, reference.prefill(first))
            ort_past = presents_as_past(manifest, onnx.prefill(first))
        else:
            ref_past = ort_past = onnx.empty_past(batch)
        feeds = {"input_ids": ids[:, past:], "attention_mask": mask, "position_ids": position_ids_from_mask(mask, past)}
        expected, actual = reference.decode({**feeds, **ref_past}), onnx.decode({**feeds, **ort_past})
        label = f"sweep b{batch} n{new} p{past}"
        health.scan_outputs(label, actual, mask)
        kv = [compare(f"{label} {name}", "kv", actual[name], expected[name], profile.kv, valid=real_keys(mask))
              for name in actual if name.startswith("present.")]
        case = SweepCase(batch, new, past, compare(f"{label} logits", "logits", actual["logits"], expected["logits"],
                                                   profile.logits, valid=mask[:, past:]),
                         aggregate(f"{label} present", kv))
        if not case.passed and explain_routing is not None:
            routing = explain_routing({**feeds, **ort_past}, mask[:, past:])
            diverged = routing.measured and routing.agreeing < routing.pairs
            case = dataclasses.replace(case, routing_near_tie=diverged and routing.passed, routing_note=routing.note)
        cases.append(case)
    log.info("sweep: %d/%d shapes pass", sum(c.passed for c in cases), len(cases))
    return cases
