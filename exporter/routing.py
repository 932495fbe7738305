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
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort

from exporter.contract import GraphContract
from exporter.runtime import plain_session_options, position_ids_from_mask, presents_as_past, session_providers
from exporter.verify.probe import SCOPES_KEY

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

    def __init__(self, folder: Path, contract: GraphContract, provider: str, num_layers: int):
        folder = Path(folder)
        proto = onnx.load(str(folder / contract.file), load_external_data=False)
        self.layers = router_layers(proto)
        self.complete = sorted(self.layers) == list(range(num_layers))
        for name in self.layers.values():
            proto.graph.output.append(onnx.ValueInfoProto(name=name))
        options = plain_session_options()
        options.log_severity_level = 3
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
        self.session = ort.InferenceSession(proto.SerializeToString(), options, providers=session_providers(provider))

    def expert_ids(self, feeds: dict) -> dict[int, np.ndarray]:
        """layer -> (N, k) chosen expert ids for the N = batch * sequence tokens of `feeds`."""
        layers = sorted(self.layers)
        values = self.session.run([self.layers[layer] for layer in layers], feeds)
        return dict(zip(layers, values))


@dataclass(frozen=True)
class ExpertAgreement:
    """How often ONNX Runtime's routers chose the same experts as the reference's, over (token, layer) pairs.

    A token agrees when its set of top-k expert ids is the same on both sides.
    A disagreement is a near-tie when the reference's k-th and (k+1)-th router
    scores are closer than the dtype's tolerance: either choice is then within
    the precision of the computation. Within one call, a disagreement is
    explained when it is a near-tie at the first layer that differs, or comes
    after such a layer whose every disagreement is one (see _compare_choices).
    Parity passes when every disagreement is explained. `measured` is False
    when the graph's routers could not be found.
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
        return not self.measured or self.pairs - self.agreeing == self.explained

    def to_dict(self) -> dict:
        return {"measured": self.measured, "pairs": self.pairs, "agreeing": self.agreeing,
                "fraction": self.fraction, "explained": self.explained, "passed": self.passed, "note": self.note}


def _compare_choices(reference_routing: dict, onnx_ids: dict, keep: np.ndarray, tolerance) -> tuple[int, int, int]:
    """(pairs, agreeing, explained) over the layers of one call. A token routed differently at one layer
    reaches the next layers with other hidden states (and, through attention, so do its neighbours), so only
    the first layer that differs can be judged against the reference's router scores: its disagreements are
    explained when each is a near-tie, and then every later disagreement of the call follows from them."""
    pairs = agreeing = 0
    first_differing = None  # (disagreements, near-ties) of the lowest layer that differs
    for layer in sorted(onnx_ids):
        scores, ref_ids = reference_routing[layer]
        same = (np.sort(ref_ids, axis=-1) == np.sort(onnx_ids[layer], axis=-1)).all(axis=-1)[keep]
        pairs, agreeing = pairs + same.size, agreeing + int(same.sum())
        if first_differing is None and not same.all():
            k = ref_ids.shape[-1]
            ranked = -np.sort(-scores, axis=-1)
            gap = ranked[:, k - 1] - (ranked[:, k] if ranked.shape[1] > k else -np.inf)
            tie = (gap <= tolerance.allowed(ranked[:, k - 1].astype(np.float64)))[keep]
            first_differing = (int((~same).sum()), int((~same & tie).sum()))
    if first_differing is None:
        return pairs, agreeing, 0
    differing, near_ties = first_differing
    return pairs, agreeing, (pairs - agreeing) if near_ties == differing else near_ties


def routing_agreement(reference_routing: dict, probe: RouterProbe, onnx_feeds: dict, valid: np.ndarray,
                      tolerance) -> ExpertAgreement:
    """Expert choices of one decode call, each side on its own inputs (e.g. its own cache): did the two
    route some real token (`valid`, (B, T)) differently, and only at near-ties? `reference_routing` is
    {layer: (scores, ids)} of the reference's call, `probe` a RouterProbe of decode.onnx."""
    if not reference_routing or not probe.complete:
        return ExpertAgreement(False, 0, 0, 0, "router choices not found; not measured")
    pairs, agreeing, explained = _compare_choices(reference_routing, probe.expert_ids(onnx_feeds),
                                                  valid.reshape(-1) == 1, tolerance)
    note = f"{pairs - agreeing} of {pairs} (token, layer) expert choices differ"
    if pairs > agreeing:
        note += (f", {explained} explained by near-ties of the reference's router scores at the first layer "
                 f"that differs{' (a precision flip of a discrete choice)' if explained == pairs - agreeing else ''}")
    return ExpertAgreement(True, pairs, agreeing, explained, note)


def check_expert_choice(reference, folder: Path, manifest, provider: str, batch: dict, decode_tokens: list,
                        tolerance) -> ExpertAgreement | None:
    """Expert choices on the prefill batch and then on decode steps fed the reference's own cache.

    `reference` is a RecordedReference (the PyTorch model's calls, or a golden bundle's), which hands
    out each call's router choices; `decode_tokens` a list of (B, n) token arrays. Both sides get
    identical inputs at every step, so this measures the graphs' routing alone. None for models
    without routers.
    """
    layers = manifest.cache.num_layers
    feeds = {name: batch[name] for name in manifest.prefill.input_names}
    ref_out = reference.prefill(feeds)
    if not reference.last_routing():
        return None
    probes = [RouterProbe(folder, contract, provider, layers) for contract in (manifest.prefill, manifest.decode)]
    if not all(probe.complete for probe in probes):
        found = sorted(probes[0].layers)
        return ExpertAgreement(False, 0, 0, 0, f"router TopK nodes not found in the graphs (found layers {found} "
                                               f"of {layers}); expert choice not measured")
    mask = batch["attention_mask"]
    totals = np.array(_compare_choices(reference.last_routing(), probes[0].expert_ids(feeds), mask.reshape(-1) == 1,
                                       tolerance))
    for tokens in decode_tokens:
        mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
        step = {"input_ids": tokens, "attention_mask": mask,
                "position_ids": position_ids_from_mask(mask, mask.shape[1] - tokens.shape[1]),
                **presents_as_past(manifest, ref_out)}
        ref_out = reference.decode(step)
        keep = np.ones(tokens.size, dtype=bool)
        totals += _compare_choices(reference.last_routing(), probes[1].expert_ids(step), keep, tolerance)
    pairs, agreeing, explained = (int(v) for v in totals)
    note = f"{agreeing}/{pairs} (token, layer) choices agree"
    if pairs > agreeing:
        note += (f"; {explained} of {pairs - agreeing} disagreements are explained by near-ties of the "
                 "reference's router scores at the first layer that differs in their call")
    return ExpertAgreement(True, pairs, agreeing, explained, note)
