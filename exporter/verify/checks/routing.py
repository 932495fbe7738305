"""MoE expert choice judged: the (token, layer) expert choices of ONNX Runtime's routers against the reference's
(exporter.verify.checks.routers records both), a differing choice explained as a near-tie of the reference's
router scores or as reached by an earlier one, and the expert-choice check, which feeds both sides identical inputs
so that it judges the graphs' routing alone.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from exporter.artifact.folder import Artifact
from exporter.runtime.runner import position_ids_from_mask, presents_as_past
from exporter.tolerances.parity import Profile
from exporter.verify.checks.routers import RouterProbe
from exporter.verify.inputs import FINAL_CHUNK, ParitySettings, prefill_feeds

if TYPE_CHECKING:
    # whose module imports checks.greedy, which imports this module
    from exporter.verify.references.golden.recording import RecordedReference

log = logging.getLogger(__name__)


# The most near-tie flips (the root differences, not the tokens they reach) excused in one check, as a share of
# its judged (token, layer) pairs. A flip is a precision flip only where the reference's router scores of the
# two choices lie within the score bound (a near-tie), and such ties are rare: the gap between a token's k-th
# and (k+1)-th scores spreads over the scores' range (~0.1 to 0.5 for 4 to 8 experts), while the bound is
# ~1e-3 in float16 and ~1e-5 in float32, so a few percent of tokens at most sit that close. A share above one
# in eight is not what rounding does, but a fault that moves many scores each within the bound; a sample of
# eight pairs can still hold one honest flip, and any sample one (ExpertAgreement.near_ties_allowed).
MAX_NEAR_TIE_SHARE = 1 / 8


@dataclass(frozen=True)
class ExpertAgreement:
    """How often ONNX Runtime's routers chose the same experts as the reference's, over (token, layer) pairs.

    A token agrees when its set of top-k expert ids is the same on both sides.
    A disagreement is explained when it is a near-tie (every expert chosen by
    one side only has a reference router score within the score bound of the
    reference's k-th score: either choice is then within the precision of the
    computation), or when an earlier layer's disagreement reached the token
    (see compare_choices). Parity passes when every disagreement is explained,
    the near-tie flips are at most MAX_NEAR_TIE_SHARE of the pairs, and the
    routers' scores at the tokens no differing choice reached agree within the
    bound (`score_scale` <= 1, where measured). `measured` is False when the
    graph's routers could not be found: the check then neither passes nor fails
    (it is skipped, `note` saying why; `result` is None), and `failed` is what a
    verdict reads.

    near_ties: the disagreements explained as near-ties (the others explained were reached by one).
    score_scale: the largest |ONNX score - reference score| at unreached tokens, in units of the score
        bound; None where the scores were not compared.
    """

    measured: bool
    pairs: int
    agreeing: int
    explained: int
    note: str
    near_ties: int = 0
    score_scale: float | None = None

    @property
    def fraction(self) -> float:
        return self.agreeing / self.pairs if self.pairs else 1.0

    @property
    def near_tie_share(self) -> float:
        return self.near_ties / self.pairs if self.pairs else 0.0

    @property
    def near_ties_allowed(self) -> int:
        """MAX_NEAR_TIE_SHARE of the pairs, and at least one: a single flip at a tie is what rounding does at any
        sample size (one decode step of one token holds only a pair per layer)."""
        return max(1, math.floor(MAX_NEAR_TIE_SHARE * self.pairs))

    @property
    def passed(self) -> bool:
        return (
            self.measured
            and self.pairs > 0  # nothing compared proves nothing
            and self.pairs - self.agreeing == self.explained
            and self.near_ties <= self.near_ties_allowed
            and (self.score_scale is None or self.score_scale <= 1.0)
        )

    @property
    def result(self) -> bool | None:
        """passed, or None where nothing was measured (skipped): what every report shows."""
        return self.passed if self.measured else None

    @property
    def failed(self) -> bool:
        """Measured, and some disagreement is not explained (one not measured has not failed: it is skipped)."""
        return self.result is False

    @property
    def explained_flip(self) -> bool:
        """Some real token was routed differently, each time at a near-tie or as a consequence of one: the
        outputs it reached differ within the precision of a discrete choice."""
        return self.measured and self.agreeing < self.pairs and self.passed

    def to_dict(self) -> dict:
        return {
            "measured": self.measured,
            "pairs": self.pairs,
            "agreeing": self.agreeing,
            "fraction": self.fraction,
            "explained": self.explained,
            "near_ties": self.near_ties,
            "near_tie_share": self.near_tie_share,
            "near_ties_allowed": self.near_ties_allowed,
            "score_scale": self.score_scale,
            "passed": self.result,  # null: skipped, for the reason in "skipped"
            "skipped": None if self.measured else self.note,
            "note": self.note,
        }


@dataclass(frozen=True)
class ChoiceCount:
    """The (token, layer) expert choices of one call compared; `reached` (B, T) marks each row's tokens from
    its first differing choice on: the tokens whose outputs a differing choice can have changed.
    `score_scale`: the largest router score difference at unreached real tokens, in units of the bound."""

    pairs: int
    agreeing: int
    explained: int
    near_ties: int
    score_scale: float
    reached: np.ndarray


def score_bound(tolerance, scores: np.ndarray) -> np.ndarray:
    """The bound on |ONNX score - reference score| of each token's router scores (N, E), per token (N, 1).

    The scores are a softmax over the router's logits, computed from the layer's normalised hidden state as
    the presents' keys and values are (one projection of it), with the errors the graph carries up to that
    layer. So they are held to the tolerance of the presents (`tolerance`, the kv profile), each token's
    scores being one row: its peak term is the token's largest score."""
    return tolerance.allowed(scores, np.max(np.abs(scores), axis=-1, keepdims=True))


def compare_choices(reference_routing: dict, onnx_routing: dict, valid: np.ndarray, tolerance) -> ChoiceCount:
    """The expert choices of one call at its real tokens (`valid`, (B, T)), layer by layer.

    A token routed differently at layer l reaches the later layers with other hidden states, and through
    their attention so do the later tokens of its row (never earlier ones, never other rows). So at each
    layer a disagreement is explained when an earlier layer's disagreement reached the token (its router saw
    other inputs than the reference's), or else when it is a near-tie: every expert that one side chose and
    the other did not has a reference score within the score bound of the reference's k-th score (a choice
    between tied experts; one far below, or far above, is not a tie whatever the k-th gap). At the tokens no
    disagreement reached, both routers saw the same inputs up to the graph's error, and their scores are
    compared with the bound (score_scale)."""
    rows, length = valid.shape
    position = np.arange(length)
    first_reached = np.full(rows, length)  # per row: the first token an earlier layer's disagreement reached
    pairs = agreeing = explained = near_ties = 0
    score_scale = 0.0
    for layer in sorted(onnx_routing):
        scores, ref_ids = reference_routing[layer]
        onnx_scores, onnx_ids = onnx_routing[layer]
        scores = scores.astype(np.float64)
        experts, k = scores.shape[-1], ref_ids.shape[-1]
        chosen_ref = np.zeros(scores.shape, bool)
        chosen_onnx = np.zeros(scores.shape, bool)
        np.put_along_axis(chosen_ref, ref_ids.reshape(-1, k), True, axis=-1)
        np.put_along_axis(chosen_onnx, np.clip(onnx_ids.reshape(-1, k), 0, experts - 1), True, axis=-1)
        same = (chosen_ref == chosen_onnx).all(axis=-1).reshape(rows, length)
        kth = -np.sort(-scores, axis=-1)[:, k - 1 : k]
        bound = score_bound(tolerance, scores)
        tied = np.abs(scores - kth) <= bound
        tie = (~(chosen_ref ^ chosen_onnx) | tied).all(axis=-1).reshape(rows, length)
        differ = ~same & valid
        reached = position >= first_reached[:, None]
        pairs, agreeing = pairs + int(valid.sum()), agreeing + int((same & valid).sum())
        explained += int((differ & (reached | tie)).sum())
        near_ties += int((differ & ~reached & tie).sum())
        unreached = (valid & ~reached).reshape(-1)
        if unreached.any():
            error = np.abs(onnx_scores.astype(np.float64) - scores)[unreached] / bound[unreached]
            score_scale = max(score_scale, float(error.max()))
        first_reached = np.minimum(first_reached, np.where(differ.any(axis=1), differ.argmax(axis=1), length))
    return ChoiceCount(pairs, agreeing, explained, near_ties, score_scale, position >= first_reached[:, None])


def agreement(counts: list[ChoiceCount], scope: str = "", first: str = "", explained: int | None = None):
    """The ExpertAgreement of some calls' counts, with its note: 'N of M (token, layer) expert choices{scope}
    differ{first}', how many of those are explained and how, and the router scores' largest difference.

    Args:
        counts: the calls' ChoiceCounts.
        scope: words after "expert choices" (" of the 3 calls up to the differing token").
        first: words after "differ" (where the first difference is).
        explained: the explained count when the caller knows more than the counts (greedy_choices); None:
            the counts' sum.
    """
    pairs, agreeing, near_ties = (sum(getattr(c, name) for c in counts) for name in ("pairs", "agreeing", "near_ties"))
    explained = sum(c.explained for c in counts) if explained is None else explained
    score_scale = max((c.score_scale for c in counts), default=0.0)
    differing = pairs - agreeing
    note = f"{differing} of {pairs} (token, layer) expert choices{scope} differ{first}"
    if differing:
        note += (
            f"; {explained} explained: {near_ties} at near-ties of the reference's router scores "
            f"({near_ties / pairs:.1%} of the choices; at most max(1, {MAX_NEAR_TIE_SHARE:.1%}) excused), "
            f"{explained - near_ties} reached by an earlier differing choice"
        )
    note += f"; router scores within {score_scale:.2g}x their bound"
    return ExpertAgreement(True, pairs, agreeing, explained, note, near_ties, score_scale)


def check_expert_choice(
    reference, artifact: Artifact, provider: str, batch: dict, decode_tokens: list, tolerance
) -> ExpertAgreement | None:
    """Expert choices on the prefill batch and then on decode steps fed the reference's own cache.

    Both sides get identical inputs at every step, so this judges the graphs' routing alone.

    Args:
        reference: a RecordedReference (the PyTorch model's calls, or a golden bundle's), which hands out each
            call's router choices.
        artifact: the artifact whose graphs are probed for their routers.
        provider: the provider the probes run on.
        batch: the prompt batch (prompt_batch).
        decode_tokens: the decode steps' new tokens, a list of (B, n) token arrays.
        tolerance: the Tolerance of router scores (score_bound): their agreement, and what makes a near-tie.

    Returns:
        The ExpertAgreement (not measured when the graphs' routers are not found), or None for models
        without routers.
    """
    manifest = artifact.manifest
    layers = manifest.cache.num_layers
    feeds = prefill_feeds(manifest, batch)
    ref_out = reference.prefill(feeds)
    if not reference.last_routing():
        return None
    probes = [RouterProbe(artifact, graph, provider) for graph in ("prefill", "decode")]
    if not all(probe.complete for probe in probes):
        found = sorted(probes[0].layers)
        return ExpertAgreement(
            False,
            0,
            0,
            0,
            f"router TopK nodes not found in the graphs (found layers {found} of {layers}); expert choice not measured",
        )
    counts = [
        compare_choices(reference.last_routing(), probes[0].choices(feeds), batch["attention_mask"] == 1, tolerance)
    ]
    mask = batch["attention_mask"]
    for tokens in decode_tokens:
        mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
        step = {
            "input_ids": tokens,
            "attention_mask": mask,
            "position_ids": position_ids_from_mask(mask, mask.shape[1] - tokens.shape[1]),
            **presents_as_past(manifest, ref_out),
        }
        ref_out = reference.decode(step)
        counts.append(
            compare_choices(
                reference.last_routing(), probes[1].choices(step), np.ones(tokens.shape, dtype=bool), tolerance
            )
        )
    return agreement(counts)


def expert_choice(
    reference: RecordedReference,
    artifact: Artifact,
    provider: str,
    batch: dict,
    settings: ParitySettings,
    profile: Profile,
) -> ExpertAgreement | None:
    """MoE routing agreement against the reference's routers, live or from a golden bundle (None for models
    without routers)."""
    manifest = artifact.manifest
    if not manifest.is_moe:
        return None
    log.info("%s: expert choice of the MoE routers", provider)
    rng = np.random.default_rng(settings.seed + 4)
    steps = [
        rng.integers(0, manifest.config.vocab_size, (settings.batch, n), dtype=np.int64)
        for n in [1] * min(settings.decode_steps, 16) + [FINAL_CHUNK]
    ]
    return check_expert_choice(reference, artifact, provider, batch, steps, profile.kv)
