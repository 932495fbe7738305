"""Greedy generation against the reference's: ONNX Runtime's loop and the reference's own cached decoding from one
prompt, the tokens equal, or diverging only at a near-tie of the reference's logits.

A reference's greedy(prompt, n, eos) gives a GreedyTrace (the PyTorch model's TorchRunner, a golden bundle's
RecordedReference). `judge_greedy` judges any consumer's tokens against one (onnxruntime-genai, transformers.js);
`check_greedy` runs our own loop against it. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from exporter.artifact.manifest import Manifest
from exporter.runtime.generation import NonFiniteLogits, generate_greedy
from exporter.tolerances.parity import Profile
from exporter.verify.checks.routing import ExpertAgreement
from exporter.verify.inputs import ParitySettings
from exporter.verify.metrics import match_length


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
    after one are in judge_call (exporter.verify.checks.calls).

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference).
        onnx: the OrtRunner.
        manifest: the artifact's manifest (its eos_token_id ends both runs).
        prompt: the seeded prompt's token ids.
        settings: the verification's settings (greedy_tokens).
        profile: the profile whose logits tolerance defines a near-tie.
        explain_routing: for MoE models, explain_routing(reference_calls, prompt, shared) -> ExpertAgreement
            (exporter.verify.checks.routing_explainer.greedy_choices), which compares the expert choices of the two runs
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
