"""Why a call or a greedy run of an MoE model failed, as far as routing explains it: the expert choices of both
sides behind a failing call (the positions a differing choice reached, and the loss without them), or behind a
greedy run that differs, up to its differing token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exporter.artifact.manifest import Manifest
from exporter.runtime.protocol import Runner
from exporter.runtime.runner import presents_as_past
from exporter.tolerances.parity import Profile
from exporter.verify.checks.routers import RouterProbe
from exporter.verify.checks.routing import ChoiceCount, ExpertAgreement, agreement, compare_choices
from exporter.verify.metrics import log_softmax
from exporter.verify.references.golden.recording import RecordedReference


@dataclass(frozen=True)
class CallRouting:
    """One call's expert choices on both sides (each on its own inputs, e.g. its own cache)."""

    agreement: ExpertAgreement
    reached: np.ndarray  # (B, T): the tokens whose outputs a differing choice can have changed

    def loss_without_reached(self, actual: dict, expected: dict, labels: np.ndarray) -> float:
        """ONNX Runtime's loss of the call (one mean over the targets `labels` (B, T)) with the terms of the
        positions a differing choice reached taken from the reference's logits: compared with the reference's
        loss, it judges the other positions."""
        terms = _loss_terms(actual["logits"], labels) - _loss_terms(expected["logits"], labels)
        return float(actual["loss"]) - (terms * self.reached).sum() / max(int((labels[:, 1:] != -100).sum()), 1)


def _loss_terms(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(B, T): each position's term of MiniMind's shifted cross entropy, -log p(the next label) at t, 0 where
    that label is ignored (-100) and at the last position."""
    log_p = log_softmax(logits[:, :-1].astype(np.float64))
    target = labels[:, 1:]
    picked = np.take_along_axis(log_p, np.where(target == -100, 0, target)[..., None], axis=-1)[..., 0]
    return np.pad(np.where(target == -100, 0.0, -picked), ((0, 0), (0, 1)))


def routing_agreement(
    reference_routing: dict, probe: RouterProbe, onnx_feeds: dict, valid: np.ndarray, tolerance
) -> CallRouting:
    """Expert choices of one call, each side on its own inputs: did the two route some real token differently,
    and only at near-ties and where one reached?

    Args:
        reference_routing: {layer: (scores, ids)} of the reference's call; empty: no routers recorded.
        probe: a RouterProbe of the graph that ran the call.
        onnx_feeds: ONNX Runtime's feeds of the call, run again through the probe.
        valid: (B, T), 1 at the call's real tokens.
        tolerance: the Tolerance of router scores (score_bound): their agreement, and what makes a near-tie.

    Returns:
        The CallRouting: the agreement (not measured when either side's routers are missing) and the
        positions a differing choice reached.
    """
    valid = np.asarray(valid) == 1
    if not reference_routing or not probe.complete:
        return CallRouting(
            ExpertAgreement(False, 0, 0, 0, "router choices not found; not measured"), np.zeros_like(valid)
        )
    count = compare_choices(reference_routing, probe.choices(onnx_feeds), valid, tolerance)
    return CallRouting(agreement([count]), count.reached)


def greedy_choices(
    reference_calls: list[dict], onnx, probe: RouterProbe, manifest, prompt: list[int], shared: list[int], tolerance
) -> ExpertAgreement:
    """Expert choices of a greedy run up to the token where the two sides' runs differ.

    ONNX Runtime's calls are replayed through decode.onnx as OrtRunner.start and step ran them, on its own
    cache. A difference at a router near-tie in one call reaches every later call through the cache, so the
    differing token is explained when the first call whose routers differ does so at near-ties only (or at
    tokens an earlier layer's difference reached, as in one call of judge_call); the differences of the
    calls after it are its consequences.

    Args:
        reference_calls: the reference run's routing per call ({layer: (scores, ids)}): the prompt, then each
            chosen token fed back, call i choosing token i.
        onnx: the OrtRunner whose decode.onnx replays the calls.
        probe: a RouterProbe of decode.onnx.
        manifest: the artifact's manifest.
        prompt: the prompt's token ids.
        shared: the tokens both sides chose before they differed.
        tolerance: the Tolerance of router scores (score_bound): their agreement, and what makes a near-tie.

    Returns:
        The ExpertAgreement over the calls up to the differing token; not measured when the graph's routers
        were not found or the reference's were not recorded.
    """
    calls = len(shared) + 1  # the last one chose the differing token
    if not probe.complete or len(reference_calls) < calls:
        what = (
            "the graph's router TopK nodes were not found"
            if not probe.complete
            else "the reference's router choices of the greedy run were not recorded"
        )
        return ExpertAgreement(False, 0, 0, 0, f"{what}; not measured")
    past = onnx.empty_past(1)
    counts, explained = [], 0
    first = None  # the first call whose routers differ
    for call, routing in enumerate(reference_calls[:calls]):
        tokens, length = (prompt if call == 0 else [shared[call - 1]]), len(prompt) + call
        feeds = {
            "input_ids": np.array([tokens], dtype=np.int64),
            "attention_mask": np.ones((1, length), np.int64),
            "position_ids": np.arange(length - len(tokens), length, dtype=np.int64)[None],
            **past,
        }
        past = presents_as_past(manifest, onnx.decode(feeds))
        count = compare_choices(routing, probe.choices(feeds), np.ones(feeds["input_ids"].shape, bool), tolerance)
        if first is not None:  # consequences of the first difference: explained, neither near-ties nor scores
            count = ChoiceCount(count.pairs, count.agreeing, count.pairs - count.agreeing, 0, 0.0, count.reached)
        explained += count.explained
        counts.append(count)
        if first is None and count.pairs > count.agreeing:
            first = call
    where = (
        ""
        if first is None
        else f", first in call {first} ({'the prompt' if first == 0 else f'generated token {first - 1} fed back'})"
    )
    return agreement(counts, f" of the {calls} call{'s' * (calls > 1)} up to the differing token", where, explained)


class RoutingExplainer:
    """For MoE models: the expert choices of both sides behind a failing call (judge_call's explain_routing,
    asked right after the reference's call) or a greedy run that differs (check_greedy's); each graph's
    router probe is built at its first use."""

    def __init__(self, reference: RecordedReference, onnx: Runner, manifest: Manifest, profile: Profile):
        self.reference, self.onnx, self.manifest, self.tolerance = reference, onnx, manifest, profile.kv
        self._probes: dict[str, RouterProbe] = {}

    def _probe(self, graph: str) -> RouterProbe:
        if graph not in self._probes:
            self._probes[graph] = RouterProbe(self.onnx.artifact, graph, self.onnx.provider)
        return self._probes[graph]

    def call(self, graph: str, onnx_feeds: dict, valid) -> CallRouting:
        return routing_agreement(self.reference.last_routing(), self._probe(graph), onnx_feeds, valid, self.tolerance)

    def greedy(self, reference_calls: list[dict], prompt: list[int], shared: list[int]) -> ExpertAgreement:
        return greedy_choices(
            reference_calls, self.onnx, self._probe("decode"), self.manifest, prompt, shared, self.tolerance
        )
