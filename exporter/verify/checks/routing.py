"""MoE expert choices on both sides of parity: the reference's routers and the exported graphs' TopK nodes.

The graphs' outputs are the I/O contract only; which experts a token chose is
an intermediate. On the reference side a forward hook on every router module
(one with `is_moe_router = True` at `...layers.{i}.mlp.gate`, returning
scores, top-k weights, top-k ids) records it; the recording reference
(verify/references/golden/recording.py) keeps it with each call, so that a golden bundle replays it
without torch. On the ONNX side the probe finds
each router's TopK node by the module scope the exporter records in node
metadata, adds its indices as extra outputs to an in-memory copy of the graph,
and runs that copy (the weights are read from the artifact folder; nothing on
disk changes).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort

from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import Manifest
from exporter.artifact.scopes import ROUTER_SCOPE, SCOPES_KEY
from exporter.runtime.protocol import Runner
from exporter.runtime.providers import session_providers
from exporter.runtime.runner import position_ids_from_mask, presents_as_past
from exporter.runtime.settings import plain_session_options
from exporter.tolerances import Profile
from exporter.verify.inputs import FINAL_CHUNK, ParitySettings, prefill_feeds
from exporter.verify.metrics import log_softmax

if TYPE_CHECKING:
    import torch  # needed only by callers that hold the reference model

    from exporter.verify.references.golden.recording import RecordedReference  # which imports this module

log = logging.getLogger(__name__)


@contextlib.contextmanager
def record_reference_routing(model: torch.nn.Module):
    """Collect {layer: [(scores (N, E), ids (N, k)), ...]} from every router call inside the block
    (nothing for a model without routers)."""
    calls: dict[int, list] = {}
    handles = []
    for name, module in model.named_modules():
        match = ROUTER_SCOPE.search(name)
        if match and getattr(module, "is_moe_router", False):
            layer = int(match.group(1))

            def hook(_module, _inputs, output, layer=layer):
                scores, _weight, ids = output
                calls.setdefault(layer, []).append((scores.float().numpy(), ids.numpy()))

            handles.append(module.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def router_layers(model: onnx.ModelProto) -> dict[int, tuple[str, str]]:
    """layer -> names of the (scores, expert ids) values of that layer's router TopK node, from the node
    scopes: the scores it ranks (its input) and the indices it chooses."""
    found: dict[int, tuple[str, str]] = {}
    for node in model.graph.node:
        if node.op_type != "TopK":
            continue
        scopes = next((p.value for p in node.metadata_props if p.key == SCOPES_KEY), "")
        for scope in re.findall(r"'([^']*)'", scopes):
            match = ROUTER_SCOPE.search(scope)
            if match:
                found[int(match.group(1))] = (node.input[0], node.output[1])
    return found


class RouterProbe:
    """One graph of an artifact, run with its routers' scores and chosen expert ids as extra outputs."""

    def __init__(self, artifact: Artifact, graph: str, provider: str):
        manifest = artifact.manifest
        proto = artifact.graph(manifest.contract(graph))
        self.layers = router_layers(proto)
        self.complete = sorted(self.layers) == list(range(manifest.cache.num_layers))
        for names in self.layers.values():
            proto.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names)
        options = plain_session_options()
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(artifact.folder))
        self.session = ort.InferenceSession(
            proto.SerializeToString(), options, providers=session_providers(provider), enable_fallback=0
        )

    def choices(self, feeds: dict) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """layer -> (scores (N, E), chosen expert ids (N, k)) for the N = batch * sequence tokens of `feeds`,
        as record_reference_routing records the reference's."""
        layers = sorted(self.layers)
        values = self.session.run([name for layer in layers for name in self.layers[layer]], feeds)
        return {
            layer: (values[2 * i].reshape(-1, values[2 * i].shape[-1]).astype(np.float32), values[2 * i + 1])
            for i, layer in enumerate(layers)
        }


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
    (see _compare_choices). Parity passes when every disagreement is explained,
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


def _compare_choices(reference_routing: dict, onnx_routing: dict, valid: np.ndarray, tolerance) -> ChoiceCount:
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
    count = _compare_choices(reference_routing, probe.choices(onnx_feeds), valid, tolerance)
    return CallRouting(_agreement([count]), count.reached)


def _agreement(counts: list[ChoiceCount], scope: str = "", first: str = "", explained: int | None = None):
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
        count = _compare_choices(routing, probe.choices(feeds), np.ones(feeds["input_ids"].shape, bool), tolerance)
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
    return _agreement(counts, f" of the {calls} call{'s' * (calls > 1)} up to the differing token", where, explained)


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
        _compare_choices(reference.last_routing(), probes[0].choices(feeds), batch["attention_mask"] == 1, tolerance)
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
            _compare_choices(
                reference.last_routing(), probes[1].choices(step), np.ones(tokens.shape, dtype=bool), tolerance
            )
        )
    return _agreement(counts)


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
