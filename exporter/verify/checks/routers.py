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
import re
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort

from exporter.artifact.folder import Artifact
from exporter.artifact.scopes import ROUTER_SCOPE, SCOPES_KEY
from exporter.runtime.providers import session_providers
from exporter.runtime.settings import plain_session_options

if TYPE_CHECKING:
    import torch  # needed only by callers that hold the reference model


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
