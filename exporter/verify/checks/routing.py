"""MoE expert choices on both sides of parity: the reference's routers and the exported graphs' TopK nodes.

The graphs' outputs are the I/O contract only; which experts a token chose is
an intermediate. On the reference side a forward hook on every router module
(one with `is_moe_router = True` at `...layers.{i}.mlp.gate`, returning
scores, top-k weights, top-k ids) records it; the recording reference
(verify/golden.py) keeps it with each call, so that a golden bundle replays it
without torch. On the ONNX side the probe finds
each router's TopK node by the module scope the exporter records in node
metadata, adds its indices as extra outputs to an in-memory copy of the graph,
and runs that copy (the weights are read from the artifact folder; nothing on
disk changes).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort

from exporter.artifact.folder import Artifact
from exporter.runtime.runner import position_ids_from_mask, presents_as_past
from exporter.runtime.sessions import plain_session_options, session_providers
from exporter.verify.diagnosis.probe import SCOPES_KEY
from exporter.verify.inputs import prefill_feeds
from exporter.verify.metrics import log_softmax

if TYPE_CHECKING:  # torch is needed only by callers that hold the reference model
    import torch

ROUTER_SCOPE = re.compile(r"layers\.(\d+)\.mlp\.gate$")


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


def router_layers(model: onnx.ModelProto) -> dict[int, str]:
    """layer -> name of the TopK indices value of that layer's router, from the node scopes."""
    found: dict[int, str] = {}
    for node in model.graph.node:
        if node.op_type != "TopK":
            continue
        scopes = next((p.value for p in node.metadata_props if p.key == SCOPES_KEY), "")
        for scope in re.findall(r"'([^']*)'", scopes):
            match = ROUTER_SCOPE.search(scope)
            if match:
                found[int(match.group(1))] = node.output[1]
    return found


class RouterProbe:
    """One graph of an artifact, run with its routers' chosen expert ids as extra outputs."""

    def __init__(self, artifact: Artifact, graph: str, provider: str):
        manifest = artifact.manifest
        proto = artifact.graph(manifest.contract(graph))
        self.layers = router_layers(proto)
        self.complete = sorted(self.layers) == list(range(manifest.cache.num_layers))
        for name in self.layers.values():
            proto.graph.output.append(onnx.ValueInfoProto(name=name))
        options = plain_session_options()
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(artifact.folder))
        self.session = ort.InferenceSession(
            proto.SerializeToString(), options, providers=session_providers(provider), enable_fallback=0
        )

    def expert_ids(self, feeds: dict) -> dict[int, np.ndarray]:
        """layer -> (N, k) chosen expert ids for the N = batch * sequence tokens of `feeds`."""
        layers = sorted(self.layers)
        values = self.session.run([self.layers[layer] for layer in layers], feeds)
        return dict(zip(layers, values))


@dataclass(frozen=True)
class ExpertAgreement:
    """How often ONNX Runtime's routers chose the same experts as the reference's, over (token, layer) pairs.

    A token agrees when its set of top-k expert ids is the same on both sides.
    A disagreement is explained when it is a near-tie (the reference's k-th and
    (k+1)-th router scores closer than the dtype's tolerance: either choice is
    then within the precision of the computation), or when an earlier layer's
    disagreement reached the token (see _compare_choices). Parity passes when
    every disagreement is explained. `measured` is False when the graph's
    routers could not be found: the check then neither passes nor fails (it is
    skipped, `note` saying why; `result` is None), and `failed` is what a verdict reads.
    """

    measured: bool
    pairs: int
    agreeing: int
    explained: int
    note: str

    @property
    def fraction(self) -> float:
        return self.agreeing / self.pairs if self.pairs else 1.0

    @property
    def passed(self) -> bool:
        return self.measured and self.pairs - self.agreeing == self.explained

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
            "passed": self.result,  # null: skipped, for the reason in "skipped"
            "skipped": None if self.measured else self.note,
            "note": self.note,
        }


@dataclass(frozen=True)
class ChoiceCount:
    """The (token, layer) expert choices of one call compared; `reached` (B, T) marks each row's tokens from
    its first differing choice on: the tokens whose outputs a differing choice can have changed."""

    pairs: int
    agreeing: int
    explained: int
    reached: np.ndarray


def _compare_choices(reference_routing: dict, onnx_ids: dict, valid: np.ndarray, tolerance) -> ChoiceCount:
    """The expert choices of one call at its real tokens (`valid`, (B, T)), layer by layer.

    A token routed differently at layer l reaches the later layers with other hidden states, and through
    their attention so do the later tokens of its row (never earlier ones, never other rows). So at each
    layer a disagreement is explained when an earlier layer's disagreement reached the token (its router saw
    other inputs than the reference's), or else when it is a near-tie of the reference's router scores."""
    rows, length = valid.shape
    position = np.arange(length)
    first_reached = np.full(rows, length)  # per row: the first token an earlier layer's disagreement reached
    pairs = agreeing = explained = 0
    for layer in sorted(onnx_ids):
        scores, ref_ids = reference_routing[layer]
        same = (np.sort(ref_ids, axis=-1) == np.sort(onnx_ids[layer], axis=-1)).all(axis=-1).reshape(rows, length)
        k = ref_ids.shape[-1]
        ranked = -np.sort(-scores, axis=-1)
        gap = ranked[:, k - 1] - (ranked[:, k] if ranked.shape[1] > k else -np.inf)
        tie = (gap <= tolerance.allowed(ranked[:, k - 1].astype(np.float64))).reshape(rows, length)
        differ = ~same & valid
        reached = position >= first_reached[:, None]
        pairs, agreeing = pairs + int(valid.sum()), agreeing + int((same & valid).sum())
        explained += int((differ & (reached | tie)).sum())
        first_reached = np.minimum(first_reached, np.where(differ.any(axis=1), differ.argmax(axis=1), length))
    return ChoiceCount(pairs, agreeing, explained, position >= first_reached[:, None])


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
        tolerance: the Tolerance whose bound on the reference's k-th router score makes a near-tie.

    Returns:
        The CallRouting: the agreement (not measured when either side's routers are missing) and the
        positions a differing choice reached.
    """
    valid = np.asarray(valid) == 1
    if not reference_routing or not probe.complete:
        return CallRouting(
            ExpertAgreement(False, 0, 0, 0, "router choices not found; not measured"), np.zeros_like(valid)
        )
    count = _compare_choices(reference_routing, probe.expert_ids(onnx_feeds), valid, tolerance)
    return CallRouting(
        ExpertAgreement(
            True,
            count.pairs,
            count.agreeing,
            count.explained,
            _choices_note(count.pairs, count.agreeing, count.explained),
        ),
        count.reached,
    )


def _choices_note(pairs: int, agreeing: int, explained: int, scope: str = "", first: str = "") -> str:
    """'N of M (token, layer) expert choices{scope} differ{first}', and how many of those are explained."""
    differing = pairs - agreeing
    note = f"{differing} of {pairs} (token, layer) expert choices{scope} differ{first}"
    if differing:
        note += (
            f"; {explained} explained by near-ties of the reference's router scores or reached by an earlier "
            "differing choice"
        )
        if explained == differing:
            note += " (a precision flip of a discrete choice)"
    return note


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
        tolerance: the Tolerance that makes a near-tie of router scores.

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
    pairs = agreeing = explained = 0
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
        count = _compare_choices(routing, probe.expert_ids(feeds), np.ones(feeds["input_ids"].shape, bool), tolerance)
        differing = count.pairs - count.agreeing
        pairs, agreeing = pairs + count.pairs, agreeing + count.agreeing
        explained += count.explained if first is None else differing
        if first is None and differing:
            first = call
    where = (
        ""
        if first is None
        else f", first in call {first} ({'the prompt' if first == 0 else f'generated token {first - 1} fed back'})"
    )
    return ExpertAgreement(
        True,
        pairs,
        agreeing,
        explained,
        _choices_note(
            pairs, agreeing, explained, f" of the {calls} call{'s' * (calls > 1)} up to the differing token", where
        ),
    )


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
        tolerance: the Tolerance that makes a near-tie of router scores.

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
        _compare_choices(reference.last_routing(), probes[0].expert_ids(feeds), batch["attention_mask"] == 1, tolerance)
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
                reference.last_routing(), probes[1].expert_ids(step), np.ones(tokens.shape, dtype=bool), tolerance
            )
        )
    pairs, agreeing, explained = (sum(getattr(c, name) for c in counts) for name in ("pairs", "agreeing", "explained"))
    note = f"{agreeing}/{pairs} (token, layer) choices agree"
    if pairs > agreeing:
        note += (
            f"; {explained} of {pairs - agreeing} disagreements are explained by near-ties of the "
            "reference's router scores or reached by an earlier layer's differing choice in their call"
        )
    return ExpertAgreement(True, pairs, agreeing, explained, note)
