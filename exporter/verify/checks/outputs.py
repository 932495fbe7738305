"""Reference against ONNX Runtime on identical seeded inputs: prefill, stateful decode, sweep.

`reference` is anything with prefill(feeds) and decode(feeds): the PyTorch model
(exporter.verify.references.torch_runner.TorchRunner) or a recorded golden bundle
(exporter.verify.references.golden.recording.RecordedReference); `onnx` is an exporter.runtime.runner.OrtRunner.
Each call is judged by exporter.verify.checks.calls; greedy generation is exporter.verify.checks.greedy's. Nothing
here imports torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from exporter.artifact.manifest import Manifest
from exporter.runtime.runner import position_ids_from_mask, presents_as_past
from exporter.tolerances.parity import Profile
from exporter.verify.checks.calls import LayerError, RoutingFlip, all_layers, judge_call, referee_truth
from exporter.verify.checks.health import HealthScan
from exporter.verify.inputs import FINAL_CHUNK, ParitySettings, next_tokens, prefill_feeds, ragged_mask, sweep_grid
from exporter.verify.metrics import Comparison, aggregate, difference_histogram

log = logging.getLogger(__name__)

# Seconds between two progress lines of a long loop: the decode steps and the sweep can each run for minutes,
# which would otherwise pass without a line.
PROGRESS_INTERVAL = 5.0


class _Progress:
    """Progress lines of a long loop ("decode steps: 30/65 done"), at most one every PROGRESS_INTERVAL seconds,
    at the level of the other progress lines (info: -q hides them, --json keeps them on stderr); none for
    the last item, which the line after the loop reports."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.done = what, total, 0
        self.last_line = time.perf_counter()

    def advance(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.done < self.total and now - self.last_line >= PROGRESS_INTERVAL:
            log.info("%s: %d/%d done", self.what, self.done, self.total)
            self.last_line = now


@dataclass(frozen=True)
class PrefillResult:
    comparisons: list[Comparison]
    layers: list[LayerError]
    histogram: dict  # |logit difference| counts, for the report plot
    routing: RoutingFlip | None = None  # MoE: a failing call's expert choices


def check_prefill(
    reference,
    onnx,
    manifest: Manifest,
    batch: dict,
    profile: Profile,
    health: HealthScan,
    explain_routing=None,
    referee=None,
) -> tuple[PrefillResult, dict]:
    """Logits and every present at the real positions, and the loss. For MoE models a failure where the
    routers chose other experts at near-ties is judged at the positions those choices do not reach, the loss
    with their terms taken from the reference's logits.

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference).
        onnx: the OrtRunner.
        manifest: the artifact's manifest.
        batch: the prompt batch (prompt_batch): input_ids, attention_mask and labels.
        profile: the tolerances that judge it.
        health: the scan that ONNX Runtime's outputs are added to.
        explain_routing: for MoE models, as judge_call takes it; None: a failure stays unexplained.
        referee: the Float64Referee (exporter.verify.references.referee) that judges a comparison failing its
            fixed profile; None: the profile's verdict stands.

    Returns:
        The PrefillResult, and ONNX Runtime's outputs.
    """
    feeds = prefill_feeds(manifest, batch)  # labels only where the graph takes them (an export with loss)
    expected = reference.prefill(feeds)
    actual = onnx.prefill(feeds)
    real = batch["attention_mask"] == 1
    health.scan_outputs("prefill", actual, batch["attention_mask"])
    call = judge_call(
        manifest,
        "prefill",
        "prefill",
        feeds,
        actual,
        expected,
        profile,
        batch["attention_mask"],
        batch["attention_mask"],
        explain_routing,
        truth=referee_truth(referee, [("prefill", feeds)]),
    )
    rows = [call.logits, all_layers("prefill present (all layers)", call.layers)]
    if call.loss is not None:
        rows.append(call.loss)
    return PrefillResult(
        rows, call.layers, difference_histogram(actual["logits"][real], expected["logits"][real]), call.routing
    ), actual


@dataclass(frozen=True)
class StepError:
    """One decode step: the point of the error curve."""

    step: int
    tokens: int
    logits: Comparison
    kv: Comparison  # the worst layer
    first_failing_layer: int | None
    routing: RoutingFlip | None = None  # MoE: a failing step's expert choices
    fed_reference_cache: bool = False  # ONNX Runtime's past was the reference's present: see check_decode

    @property
    def passed(self) -> bool:
        return self.logits.passed and self.kv.passed

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "passed": self.passed,
            "logits_max_abs": self.logits.max_abs,
            "logits_needed_scale": self.logits.needed.scale,
            "kv_max_abs": self.kv.max_abs,
            "kv_needed_scale": self.kv.needed.scale,
            "kl_mean": self.logits.llm.get("kl_mean"),
            "top1_agreement": self.logits.llm.get("top1_agreement"),
            "first_failing_layer": self.first_failing_layer,
            "routing": self.routing.to_dict() if self.routing else None,
            "fed_reference_cache": self.fed_reference_cache,
        }


@dataclass(frozen=True)
class DecodeCall:
    """A decode call as the reference made it: the node-level probe runs decode.onnx on these feeds, the
    reference's past included, so that it judges that graph alone whatever cache ONNX Runtime built."""

    label: str  # "decode step 3"
    feeds: dict  # the token feeds and the reference's past


@dataclass(frozen=True)
class DecodeResult:
    comparisons: list[Comparison]
    curve: list[StepError]
    probe_call: DecodeCall  # the first failing call, or the first call when none fails


def check_decode(
    reference,
    onnx,
    manifest: Manifest,
    batch: dict,
    settings: ParitySettings,
    profile: Profile,
    health: HealthScan,
    rng: np.random.Generator,
    explain_routing=None,
    referee=None,
) -> tuple[DecodeResult, dict]:
    """Prefill, then `decode_steps` single-token steps and one 3-token chunk, each side feeding its own
    present back as past; the new tokens are the same seeded ids for both.

    For MoE models a call whose failure a routing near-tie explains is judged at the positions the flip did
    not reach, and the next step feeds ONNX Runtime the reference's present instead of its own: after one
    flipped expert the two caches differ for good, and the later steps would judge that flip again rather
    than the graph. The prefill is the prefill check's call, which reports it.

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference).
        onnx: the OrtRunner.
        manifest: the artifact's manifest.
        batch: the prompt batch (prompt_batch).
        settings: the verification's settings (decode_steps).
        profile: the tolerances that judge it.
        health: the scan that ONNX Runtime's outputs are added to.
        rng: the generator the new token ids are drawn from.
        explain_routing: for MoE models, as judge_call takes it; None: a failure stays unexplained.
        referee: as check_prefill takes it; its float64 run follows the same chain of calls.

    Returns:
        The DecodeResult, and ONNX Runtime's last outputs.
    """
    feeds = prefill_feeds(manifest, batch)
    ref_out, ort_out = reference.prefill(feeds), onnx.prefill(feeds)
    mask = batch["attention_mask"]
    flip = (
        None
        if explain_routing is None
        else judge_call(
            manifest, "decode prefill", "prefill", feeds, ort_out, ref_out, profile, mask, mask, explain_routing, True
        ).routing
    )
    resync = flip is not None and flip.explained
    chain = [("prefill", feeds)]
    curve, first_call, failing_call = [], None, None
    chunks = [1] * settings.decode_steps + [FINAL_CHUNK]
    progress = _Progress("decode steps", len(chunks))
    for step, length in enumerate(chunks):
        step_feeds, mask = next_tokens(manifest, mask, length, rng)
        ref_past = presents_as_past(manifest, ref_out)
        onnx_feeds = {**step_feeds, **(ref_past if resync else presents_as_past(manifest, ort_out))}
        label = f"decode step {step}"
        ref_call = DecodeCall(label, {**step_feeds, **ref_past})
        chain.append(("decode", step_feeds))
        ref_out = reference.decode(ref_call.feeds)
        ort_out = onnx.decode(onnx_feeds)
        health.scan_outputs(label, ort_out, mask)
        call = judge_call(
            manifest,
            label,
            "decode",
            onnx_feeds,
            ort_out,
            ref_out,
            profile,
            np.ones_like(step_feeds["input_ids"]),
            mask,
            explain_routing,
            truth=referee_truth(referee, chain),
        )
        failing = next((layer.layer for layer in call.layers if not layer.passed), None)
        curve.append(
            StepError(
                step, length, call.logits, all_layers(f"{label} present", call.layers), failing, call.routing, resync
            )
        )
        resync = call.routing is not None and call.routing.explained
        first_call = first_call or ref_call
        if failing_call is None and not curve[-1].passed:
            failing_call = ref_call
        progress.advance()
    rows = [
        aggregate(f"decode logits ({len(chunks)} steps)", [s.logits for s in curve]),
        aggregate(f"decode present ({len(chunks)} steps, all layers)", [s.kv for s in curve]),
    ]
    return DecodeResult(rows, curve, failing_call or first_call), ort_out


@dataclass(frozen=True)
class SweepCase:
    batch: int
    new_tokens: int
    past: int
    logits: Comparison
    kv: Comparison
    # MoE: the failing calls of the case (the past's prefill, the decode) with their expert choices; a flip
    # explained by near-ties leaves the positions it reached out of logits and kv (see RoutingFlip)
    routing: list[RoutingFlip] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.logits.passed and self.kv.passed and all(flip.explained for flip in self.routing)

    @property
    def routing_near_tie(self) -> bool:
        return any(flip.explained for flip in self.routing)

    @property
    def refereed(self) -> bool:
        """An output beyond its fixed profile was judged by the float64 referee."""
        return self.logits.referee is not None or self.kv.referee is not None

    @property
    def name(self) -> str:
        return f"batch {self.batch} x new {self.new_tokens} x past {self.past}"

    def to_dict(self) -> dict:
        return {
            "batch": self.batch,
            "new_tokens": self.new_tokens,
            "past": self.past,
            "passed": self.passed,
            "logits": self.logits.to_dict(),
            "kv": self.kv.to_dict(),
            "routing": [flip.to_dict() for flip in self.routing],
        }


def with_labels(manifest: Manifest, feeds: dict) -> dict:
    if "labels" in manifest.prefill.input_names:
        return {**feeds, "labels": np.where(feeds["attention_mask"] == 1, feeds["input_ids"], -100)}
    return feeds


def run_sweep(
    reference,
    onnx,
    manifest: Manifest,
    profile: Profile,
    health: HealthScan,
    rng: np.random.Generator,
    explain_routing=None,
    left_padded: bool = True,
    referee=None,
) -> list[SweepCase]:
    """Every (batch, new tokens, past) of the grid with ragged left padding: each side prefills the past
    with prefill.onnx (or starts from an empty cache) and decodes the new tokens on top of its own cache.

    For MoE models a failing call whose routers chose other experts at near-ties is judged at the positions
    that choice did not reach; after such a flip in the past's prefill, ONNX Runtime decodes on the
    reference's cache.

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference).
        onnx: the OrtRunner.
        manifest: the artifact's manifest (the grid fits its max_position_embeddings).
        profile: the tolerances that judge each case.
        health: the scan that ONNX Runtime's outputs are added to.
        rng: the generator the token ids are drawn from.
        explain_routing: for MoE models, as judge_call takes it; None: a failure stays unexplained.
        left_padded: the rows ragged (ragged_mask); False: every row unpadded, for a graph whose attention takes
            rows as right-padded (exporter.artifact.foreign).
        referee: as check_prefill takes it; its float64 run prefills the same past.
    """
    cases = []
    vocab = manifest.config.vocab_size
    grid = sweep_grid(manifest.config.max_position_embeddings)
    progress = _Progress("sweep shapes", len(grid))
    for batch, new, past in grid:
        mask = ragged_mask(batch, past, new) if left_padded else np.ones((batch, past + new), dtype=np.int64)
        ids = rng.integers(0, vocab, (batch, past + new), dtype=np.int64)
        label = f"sweep b{batch} n{new} p{past}"
        flips, chain = [], []
        if past:
            first = with_labels(
                manifest,
                {
                    "input_ids": ids[:, :past],
                    "attention_mask": mask[:, :past],
                    "position_ids": position_ids_from_mask(mask[:, :past]),
                },
            )
            chain.append(("prefill", first))
            ref_first, ort_first = reference.prefill(first), onnx.prefill(first)
            flip = (
                None
                if explain_routing is None
                else judge_call(
                    manifest,
                    f"{label} past prefill",
                    "prefill",
                    first,
                    ort_first,
                    ref_first,
                    profile,
                    mask[:, :past],
                    mask[:, :past],
                    explain_routing,
                    True,
                ).routing
            )
            if flip is not None:
                flips.append(flip)
            ref_past = presents_as_past(manifest, ref_first)
            ort_past = ref_past if flip is not None and flip.explained else presents_as_past(manifest, ort_first)
        else:
            ref_past = ort_past = onnx.empty_past(batch)
        feeds = {"input_ids": ids[:, past:], "attention_mask": mask, "position_ids": position_ids_from_mask(mask, past)}
        onnx_feeds = {**feeds, **ort_past}
        expected, actual = reference.decode({**feeds, **ref_past}), onnx.decode(onnx_feeds)
        health.scan_outputs(label, actual, mask)
        chain.append(("decode", feeds))
        call = judge_call(
            manifest,
            label,
            "decode",
            onnx_feeds,
            actual,
            expected,
            profile,
            mask[:, past:],
            mask,
            explain_routing,
            truth=referee_truth(referee, chain),
        )
        cases.append(
            SweepCase(
                batch,
                new,
                past,
                call.logits,
                all_layers(f"{label} present", call.layers),
                flips + ([call.routing] if call.routing is not None else []),
            )
        )
        progress.advance()
    log.info("sweep: %d/%d shapes pass", sum(c.passed for c in cases), len(cases))
    return cases
