"""One call's outputs against the reference's: its logits at the real tokens, each layer's present at the real cache
positions and the loss, judged by a profile, by the float64 referee where one is given, and for a MoE model whose
call failed, at the positions no near-tie of the routers reached.

The parity checks (exporter.verify.checks.outputs) and the long-context check judge every call they make here.
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from exporter.artifact.contract import KV_KINDS
from exporter.artifact.manifest import Manifest
from exporter.tolerances.parity import Profile
from exporter.verify.checks.referee import referee_ratio, refereed
from exporter.verify.checks.routing import ExpertAgreement
from exporter.verify.metrics import Comparison, aggregate, compare, real_keys


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
            exporter.verify.checks.routing_explainer.CallRouting, asked right after the reference's call: the expert
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
