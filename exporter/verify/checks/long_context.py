"""Long positions: the positions where a model's math changes, which the other checks (prompts of 12 tokens, 64 decode
steps, the sweep's 17 + 64) never reach.

Rotary embeddings turn each query and key by its position times a frequency; a rope scaling (yarn, llama3, linear)
changes the low frequencies, whose turns stay below any tolerance at the first hundred positions and reach O(1)
only near `original_max_position_embeddings` and beyond. So every scaled model is checked at positions straddling
`original_max_position_embeddings`, and every model at the last positions before `max_position_embeddings` (the
largest angles, where float32's rounding of them is largest too). Those positions are given as position ids on a
short cache: a left-padded batch of LONG_PROMPT tokens whose ids start where the case begins, then LONG_STEPS single
tokens crossing the boundary, each side feeding its own present back. What a position changes is the rotation, which
the graphs compute from the position ids, so the cost does not grow with the context (a few calls of a few tokens
at any size). A real cache of REAL_CACHE positions (or the model's context, when shorter) then checks attention and
its mask over many keys: its cost is one prefill of that length, the cap of this check's work at 1B-class sizes.

Each call is judged as the decode check's calls are (outputs.judge_call), the float64 referee included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from exporter.artifact.manifest import Manifest
from exporter.runtime.runner import position_ids_from_mask, presents_as_past
from exporter.tolerances.parity import Profile
from exporter.verify.checks.calls import all_layers, judge_call, referee_truth
from exporter.verify.checks.health import HealthScan
from exporter.verify.checks.outputs import with_labels
from exporter.verify.inputs import next_tokens
from exporter.verify.metrics import Comparison, aggregate

log = logging.getLogger(__name__)

LONG_PROMPT = 8  # tokens of each case's prompt, the first row left-padded by LONG_PADDING
LONG_PADDING = 2
LONG_STEPS = 4  # single-token decode steps after it, the boundary between the second and third
REAL_CACHE = 512  # positions of the real cache's prefill (the model's context when shorter)
# The prefill's logits judged at its last positions only: every position's presents are judged, and the logits of
# 512 positions over a vocabulary of 10^5 would cost verify more memory (their float64 statistics) than the model
JUDGED_LOGITS = LONG_PROMPT


@dataclass(frozen=True)
class LongCase:
    """One case: its calls' logits and presents, each the worst of its calls."""

    name: str  # "positions 4086..4097 across original_max_position_embeddings 4096"
    why: str  # what changes there
    first_position: int
    cache: int  # the real cache's length at its last call
    logits: Comparison
    kv: Comparison

    @property
    def passed(self) -> bool:
        return self.logits.passed and self.kv.passed

    @property
    def refereed(self) -> bool:
        return self.logits.referee is not None or self.kv.referee is not None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "why": self.why,
            "first_position": self.first_position,
            "cache": self.cache,
            "passed": self.passed,
            "logits": self.logits.to_dict(),
            "kv": self.kv.to_dict(),
        }


def long_positions(manifest: Manifest) -> list[tuple[int, str]]:
    """(the first position of a case's prompt, why) for each boundary of the model's config, the cases on a short
    cache; [] where the context is too short for a case beyond the other checks' positions."""
    config = manifest.config
    context = config.max_position_embeddings
    span = LONG_PROMPT + LONG_STEPS
    boundaries = []
    scaling = getattr(config, "rope_scaling", None)
    original = getattr(scaling, "original_max_position_embeddings", None)
    if scaling is not None and original and original + span // 2 < context:
        kind = getattr(scaling, "rope_type", "yarn")
        boundaries.append(
            (original, f"original_max_position_embeddings {original}, beyond which the {kind} scaling turns apart")
        )
    boundaries.append((context - span // 2, f"the last positions before max_position_embeddings {context}"))
    # each case starts LONG_PROMPT + LONG_STEPS // 2 positions before its boundary, so that half its decode steps
    # cross it; one starting within the real cache's positions is that case's already
    starts = [(at - LONG_PROMPT - LONG_STEPS // 2, why) for at, why in boundaries]
    return [(first, why) for first, why in starts if first >= REAL_CACHE]


def _last_logits(outputs: dict) -> dict:
    """`outputs` with the logits of the last JUDGED_LOGITS positions alone."""
    return {**outputs, "logits": outputs["logits"][:, -JUDGED_LOGITS:]}


def _chain_case(
    reference,
    onnx,
    manifest: Manifest,
    profile: Profile,
    health: HealthScan,
    rng: np.random.Generator,
    referee,
    name: str,
    why: str,
    batch: dict,
    offset: int,
) -> LongCase:
    """A prefill of `batch` then LONG_STEPS single-token steps, their position ids shifted by `offset` (as the
    batch's already are), each side on its own cache; judged call by call."""
    feeds = with_labels(manifest, batch)
    feeds = {k: v for k, v in feeds.items() if k in manifest.prefill.input_names}
    chain = [("prefill", feeds)]
    expected, actual = reference.prefill(feeds), onnx.prefill(feeds)
    mask = batch["attention_mask"]
    health.scan_outputs(f"{name} prefill", actual, mask)
    truth = referee_truth(referee, chain)
    calls = [
        judge_call(
            manifest,
            f"{name} prefill",
            "prefill",
            feeds,
            _last_logits(actual),
            _last_logits(expected),
            profile,
            mask[:, -JUDGED_LOGITS:],
            mask,
            truth=truth and (lambda: _last_logits(truth())),
        )
    ]
    for step in range(LONG_STEPS):
        step_feeds, mask = next_tokens(manifest, mask, 1, rng)
        step_feeds["position_ids"] = step_feeds["position_ids"] + offset
        chain.append(("decode", step_feeds))
        expected = reference.decode({**step_feeds, **presents_as_past(manifest, expected)})
        actual = onnx.decode({**step_feeds, **presents_as_past(manifest, actual)})
        label = f"{name} step {step}"
        health.scan_outputs(label, actual, mask)
        calls.append(
            judge_call(
                manifest,
                label,
                "decode",
                step_feeds,
                actual,
                expected,
                profile,
                np.ones_like(step_feeds["input_ids"]),
                mask,
                truth=referee_truth(referee, chain),
            )
        )
    return LongCase(
        name,
        why,
        offset,
        mask.shape[1],
        aggregate(f"{name} logits", [c.logits for c in calls]),
        aggregate(f"{name} present", [all_layers(f"{name} present", c.layers) for c in calls]),
    )


def check_long_context(
    reference, onnx, manifest: Manifest, profile: Profile, health: HealthScan, rng: np.random.Generator, referee=None
) -> list[LongCase]:
    """The long-position cases (long_positions), then the real cache's (module docstring).

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference).
        onnx: the OrtRunner.
        manifest: the artifact's manifest, whose config gives the boundaries.
        profile: the tolerances that judge each call.
        health: the scan that ONNX Runtime's outputs are added to.
        rng: the generator the token ids are drawn from.
        referee: the Float64Referee of comparisons beyond their fixed profile, or None.
    """
    cases = []
    vocab = manifest.config.vocab_size
    for first, why in long_positions(manifest):
        mask = np.ones((2, LONG_PROMPT), np.int64)
        mask[0, :LONG_PADDING] = 0
        ids = rng.integers(0, vocab, mask.shape, dtype=np.int64)
        batch = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask) + first}
        last = first + LONG_PROMPT + LONG_STEPS - 1
        name = f"positions {first}..{last}"
        log.info("%s: long positions %s (%s)", onnx.provider, name, why)
        cases.append(_chain_case(reference, onnx, manifest, profile, health, rng, referee, name, why, batch, first))
    length = min(REAL_CACHE, manifest.config.max_position_embeddings - LONG_STEPS)
    ids = rng.integers(0, vocab, (1, length), dtype=np.int64)
    mask = np.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
    log.info("%s: a real cache of %d positions", onnx.provider, length)
    cases.append(
        _chain_case(
            reference,
            onnx,
            manifest,
            profile,
            health,
            rng,
            referee,
            f"a real cache of {length} positions",
            "attention and its mask over many keys",
            batch,
            0,
        )
    )
    log.info("long context: %d/%d cases pass", sum(c.passed for c in cases), len(cases))
    return cases
