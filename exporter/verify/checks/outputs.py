"""Reference against ONNX Runtime on identical seeded inputs: prefill, stateful decode, greedy, sweep.

`reference` is anything with prefill(feeds), decode(feeds) and greedy(prompt, n, eos) -> GreedyTrace:
the PyTorch model (exporter.verify.references.torch_runner.TorchRunner) or a recorded golden bundle
(exporter.verify.references.golden.RecordedReference); `onnx` is an exporter.runtime.runner.OrtRunner. Nothing here
imports torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np

from exporter.artifact.contract import KV_KINDS
from exporter.artifact.manifest import Manifest
from exporter.runtime.generation import NonFiniteLogits, generate_greedy
from exporter.runtime.runner import position_ids_from_mask, presents_as_past
from exporter.tolerances import Profile
from exporter.verify.checks.health import HealthScan
from exporter.verify.checks.referee import referee_ratio, refereed
from exporter.verify.checks.routing import ExpertAgreement
from exporter.verify.inputs import FINAL_CHUNK, ParitySettings, next_tokens, prefill_feeds, ragged_mask, sweep_grid
from exporter.verify.metrics import Comparison, aggregate, compare, difference_histogram, match_length, real_keys

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
        return {
            "layer": self.layer,
            "passed": self.passed,
            "key_max_abs": self.key.max_abs,
            "value_max_abs": self.value.max_abs,
            "key_needed_scale": self.key.needed.scale,
            "value_needed_scale": self.value.needed.scale,
        }


def layer_errors(
    manifest: Manifest, actual: dict, expected: dict, profile: Profile, label: str, mask: np.ndarray
) -> list[LayerError]:
    """Each layer's present key and value compared, at the real cache positions.

    Args:
        manifest: the artifact's manifest, which names the presents.
        actual: ONNX Runtime's outputs by name.
        expected: the reference's outputs by name.
        profile: the profile whose kv tolerance judges them.
        label: the call's name, which begins each comparison's name.
        mask: (B, L), 1 at the cache positions judged.
    """
    cache = manifest.cache
    return [
        LayerError(
            layer,
            *(
                compare(
                    f"{label} {cache.present(layer, kind)}",
                    "kv",
                    actual[cache.present(layer, kind)],
                    expected[cache.present(layer, kind)],
                    profile.kv,
                    valid=real_keys(mask),
                )
                for kind in KV_KINDS
            ),
        )
        for layer in range(cache.num_layers)
    ]


def all_layers(label: str, layers: list[LayerError]) -> Comparison:
    return aggregate(label, [c for layer in layers for c in (layer.key, layer.value)])


@dataclass(frozen=True)
class RoutingFlip:
    """A call of a MoE model that failed its tolerance, with what the two sides' routers chose.

    explained: some real token was routed to other experts, each time at a near-tie of the reference's router
    scores or where an earlier layer's differing choice reached it (exporter.verify.checks.routing): those outputs
    differ by an expert's contribution, within the precision of a discrete choice. The call is then judged at the
    positions no differing choice reached (`excluded` of its `positions` real ones are left out), and in a
    chain of calls ONNX Runtime takes the reference's cache for the next one, which would otherwise inherit
    the difference for good. Not explained, the call keeps its verdict. `logits` and `present` compare the
    whole call (and `loss`, a prefill's), before anything was left out.
    """

    call: str
    agreement: ExpertAgreement
    explained: bool
    excluded: int
    positions: int
    logits: Comparison
    present: Comparison
    loss: Comparison | None = None

    def describe(self) -> str:
        whole = "the whole call: " + ", ".join(
            f"{output} max abs {c.max_abs:.3g} ({c.needed.scale:.2g}x tol)"
            for output, c in (("logits", self.logits), ("present", self.present), ("loss", self.loss))
            if c is not None
        )
        if not self.explained:
            return f"{self.call}: {self.agreement.note}; not a near-tie: judged whole ({whole})"
        return (
            f"{self.call}: {self.agreement.note}; judged at the {self.positions - self.excluded} of "
            f"{self.positions} positions no differing choice reaches ({whole})"
        )

    def to_dict(self) -> dict:
        return {
            "call": self.call,
            "explained": self.explained,
            "excluded_positions": self.excluded,
            "positions": self.positions,
            "expert_choice": self.agreement.to_dict(),
            "whole_call": {
                "logits": self.logits.to_dict(),
                "present": self.present.to_dict(),
                "loss": self.loss.to_dict() if self.loss is not None else None,
            },
        }


@dataclass(frozen=True)
class CallResult:
    """One call's outputs against the reference's: what judge_call returns."""

    logits: Comparison
    layers: list[LayerError]
    loss: Comparison | None  # prefill.onnx with labels
    routing: RoutingFlip | None  # MoE: a failing call's expert choices

    @property
    def cache_passed(self) -> bool:
        return all(layer.passed for layer in self.layers)

    @property
    def passed(self) -> bool:
        return self.logits.passed and self.cache_passed and (self.loss is None or self.loss.passed)


def judge_call(
    manifest: Manifest,
    call: str,
    graph: str,
    onnx_feeds: dict,
    actual: dict,
    expected: dict,
    profile: Profile,
    valid: np.ndarray,
    cache: np.ndarray,
    explain_routing=None,
    cache_only: bool = False,
    truth=None,
) -> CallResult:
    """A call's logits at its real tokens, each layer's present at the real cache positions and the loss,
    named after the call. For a MoE model whose call failed, also its RoutingFlip, and when that is explained
    the comparisons of the positions it did not reach, the loss with the reached positions' terms from the
    reference's logits. Where a comparison fails its fixed profile and `truth` is given, the float64 referee
    judges it instead (exporter.verify.checks.referee).

    Args:
        manifest: the artifact's manifest.
        call: the call's name in reports ("decode step 3").
        graph: the graph it ran, "prefill" or "decode".
        onnx_feeds: ONNX Runtime's feeds of the call (the labels among them for a loss).
        actual: ONNX Runtime's outputs by name.
        expected: the reference's outputs by name.
        profile: the tolerances that judge them.
        valid: (B, T), 1 at the call's real tokens.
        cache: (B, L), 1 at the real cache positions, the call's tokens last.
        explain_routing: for MoE models, explain_routing(graph, onnx_feeds, valid) ->
            exporter.verify.checks.routing.CallRouting, asked right after the reference's call: the expert
            choices of that call on both sides; None: a failure stays unexplained.
        cache_only: a call that only builds the cache of the next one (its logits and loss are judged
            elsewhere or not at all) fails only by its presents.
        truth: truth() -> the float64 referee's outputs of this call (Float64Referee.truth of its chain), asked
            only when a comparison fails; None: the fixed profile's verdict stands.
    """
    real = np.asarray(valid) == 1
    cache = np.asarray(cache) == 1

    def judge(reached: np.ndarray, loss, routing: RoutingFlip | None = None) -> CallResult:
        kept_cache = cache & np.pad(~reached, ((0, 0), (cache.shape[1] - reached.shape[1], 0)), constant_values=True)
        return CallResult(
            compare(
                f"{call} logits", "logits", actual["logits"], expected["logits"], profile.logits, valid=real & ~reached
            ),
            layer_errors(manifest, actual, expected, profile, call, kept_cache),
            None if loss is None else compare(f"{call} loss", "loss", loss, expected["loss"], profile.loss),
            routing,
        )

    # A reference giving no loss for labels (a decoder behind an artifact with the loss: the export refuses
    # that pair, an older artifact may hold it) leaves the artifact's loss nothing to compare with: judged
    # without it, as a --no-loss artifact is.
    judged_loss = "loss" in actual and "loss" in expected
    result = judge(np.zeros_like(real), actual["loss"] if judged_loss else None)
    if truth is not None and not (result.cache_passed if cache_only else result.passed):
        return _refereed_call(result, manifest, actual, expected, truth(), real, cache)
    if explain_routing is None or (result.cache_passed if cache_only else result.passed):
        return result
    routing = explain_routing(graph, onnx_feeds, valid)
    flip = RoutingFlip(
        call,
        routing.agreement,
        routing.agreement.explained_flip,
        int((routing.reached & real).sum()),
        int(real.sum()),
        result.logits,
        all_layers(f"{call} present", result.layers),
        result.loss,
    )
    if not flip.explained:
        return replace(result, routing=flip)
    loss = None if not judged_loss else routing.loss_without_reached(actual, expected, onnx_feeds["labels"])
    return judge(routing.reached, loss, flip)


def referee_truth(referee, chain: list):
    """judge_call's `truth` for the last call of `chain` (a snapshot of it), or None without a referee."""
    if referee is None:
        return None
    calls = tuple(chain)
    return lambda: referee.truth(calls)


def _refereed_call(
    result: CallResult, manifest: Manifest, actual: dict, expected: dict, truth: dict, real, cache
) -> CallResult:
    """`result` with each failing comparison judged by the float64 referee's outputs `truth` instead."""

    def rejudge(comparison: Comparison, name: str, kind: str, valid) -> Comparison:
        if comparison.passed:
            return comparison
        return refereed(
            comparison, referee_ratio(actual[name], expected[name], truth[name], kind, manifest.dtype, valid)
        )

    presents = manifest.cache.present
    return replace(
        result,
        logits=rejudge(result.logits, "logits", "logits", real),
        layers=[
            LayerError(
                layer.layer,
                rejudge(layer.key, presents(layer.layer, "key"), "kv", real_keys(cache)),
                rejudge(layer.value, presents(layer.layer, "value"), "kv", real_keys(cache)),
            )
            for layer in result.layers
        ],
        loss=None if result.loss is None else rejudge(result.loss, "loss", "loss", None),
    )


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
class GreedyTrace:
    """The reference's greedy tokens and, per token, the logits it was chosen from."""

    ids: list[int]
    logits: np.ndarray  # (len(ids), vocab) float32
    # MoE: per call of the run (the prompt, then each chosen token fed back; call i chose token i) the routers'
    # {layer: (scores, ids)}; empty for models without routers, or a bundle recorded before it was kept
    routing: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class GreedyResult:
    reference_ids: list[int]
    onnx_ids: list[int]
    match_length: int  # tokens equal from the start
    passed: bool
    note: str
    routing: ExpertAgreement | None = None  # MoE: the expert choices of both runs up to the differing token

    def to_dict(self) -> dict:
        return {
            "reference_ids": self.reference_ids,
            "onnx_ids": self.onnx_ids,
            "match_length": self.match_length,
            "passed": self.passed,
            "note": self.note,
            "expert_choice": self.routing.to_dict() if self.routing is not None else None,
        }


def judge_greedy(
    trace: GreedyTrace,
    actual: list[int],
    profile: Profile,
    expected: list[int] | None = None,
    dropped_eos: int | None = None,
) -> GreedyResult:
    """Token ids must be equal; a divergence passes only at a near-tie of the reference's logits.

    At a near-tie (the two candidates' reference logits closer than the logits tolerance) either choice is
    within the dtype's precision, which happens in float16; it is reported in the note.

    Args:
        trace: the reference's greedy run, whose logits judge a divergence.
        actual: the other side's new token ids.
        profile: the profile whose logits tolerance defines a near-tie.
        expected: the ids to compare with; None: the trace's. A consumer that stops at EOS and leaves it out
            passes them without a final EOS.
        dropped_eos: the EOS id such a consumer left out: where one side's list ends before the other's, that
            side chose EOS there. None: a list that ends early stopped early.
    """
    expected = trace.ids if expected is None else expected
    match = match_length(actual, expected)
    if actual == expected:
        stopped = (
            " (both stopped at EOS at once: nothing else to compare)"
            if not actual and dropped_eos is not None and trace.ids[:1] == [dropped_eos]
            else ""
        )
        return GreedyResult(expected, actual, match, True, f"{len(actual)} tokens identical{stopped}")
    if match == min(len(actual), len(expected)) and (dropped_eos is None or match >= len(trace.logits)):
        return GreedyResult(expected, actual, match, False, "one side stopped early")
    chosen, other = (ids[match] if match < len(ids) else dropped_eos for ids in (expected, actual))
    logits = trace.logits[match].astype(np.float64)
    gap = abs(logits[chosen] - logits[other])
    near_tie = bool(gap <= profile.logits.allowed(logits)[chosen])
    note = (
        f"diverged at token {match}: reference {chosen} vs onnx {other}, "
        f"reference logit gap {gap:.3g} ({'a near-tie within tolerance' if near_tie else 'not a tie'})"
    )
    return GreedyResult(expected, actual, match, near_tie, note)


def check_greedy(
    reference,
    onnx,
    manifest: Manifest,
    prompt: list[int],
    settings: ParitySettings,
    profile: Profile,
    explain_routing=None,
) -> GreedyResult:
    """Our ONNX Runtime loop against the reference's own cached decoding, from a seeded prompt.

    A router near-tie in an earlier call reaches every later token through the cache, so for MoE models a
    differing token after one is within the precision of a discrete choice, as a failing call's positions
    after one are in judge_call.

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference).
        onnx: the OrtRunner.
        manifest: the artifact's manifest (its eos_token_id ends both runs).
        prompt: the seeded prompt's token ids.
        settings: the verification's settings (greedy_tokens).
        profile: the profile whose logits tolerance defines a near-tie.
        explain_routing: for MoE models, explain_routing(reference_calls, prompt, shared) -> ExpertAgreement
            (exporter.verify.checks.routing.greedy_choices), which compares the expert choices of the two runs
            up to a differing token that is no near-tie of the reference's logits; None: no such comparison.
    """
    eos = manifest.config.eos_token_id
    trace = reference.greedy(prompt, settings.greedy_tokens, eos)
    try:
        actual = generate_greedy(onnx, prompt, settings.greedy_tokens, eos).new_ids
    except NonFiniteLogits:  # a result to report with the others, not an error that ends the run
        return GreedyResult(trace.ids, [], 0, False, NonFiniteLogits.reason)
    result = judge_greedy(trace, actual, profile)
    if result.passed or explain_routing is None or result.match_length == min(len(actual), len(trace.ids)):
        return result
    routing = explain_routing(trace.routing, prompt, trace.ids[: result.match_length])
    flip = "explained by a router near-tie: " if routing.explained_flip else "routers: "
    return replace(result, passed=routing.explained_flip, note=f"{result.note}; {flip}{routing.note}", routing=routing)


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
