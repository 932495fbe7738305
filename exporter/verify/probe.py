"""A debug copy of a graph that exposes every intermediate value as an output (torch-free).

The copy lives in memory and is never written, so the artifact itself is never
touched: its weights are the artifact's, shared in place through the manifest's
initializer table where ONNX Runtime takes them, and read from the artifact's
weights file otherwise (a session places a given initializer only where it
planned it: not on a CUDA device, nor before a graph optimisation folds it into a
new constant, as for the float16 weights the CPU casts). Each node keeps the module
scope that torch.onnx recorded in its metadata, which lets localisation map
intermediate tensors back to the reference model's modules.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from exporter.manifest import Manifest
from exporter.runtime import SharedWeightMap, graph_session

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
SCOPES_KEY = "pkg.torch.onnx.name_scopes"


@dataclass(frozen=True)
class NodeInfo:
    index: int  # position in the graph's (topologically sorted) node list
    name: str
    op_type: str
    outputs: tuple[str, ...]  # the float outputs exposed by the debug copy
    module: str  # module path inside the exported model ('' when unknown or at its root)


def module_of(node: onnx.NodeProto) -> str | None:
    """The reference module path of a node from torch.onnx's name scopes, e.g. 'model.layers.1.self_attn.k_proj'.

    The scopes run from the exported wrapper ('') through its child holding the model ('model') down to the op
    itself (last), so the module is the second to last scope with the wrapper's child stripped.
    """
    entry = next((p.value for p in node.metadata_props if p.key == SCOPES_KEY), None)
    if entry is None:
        return None
    try:
        scopes = ast.literal_eval(entry)
    except (ValueError, SyntaxError):
        return None
    if len(scopes) < 3:
        return ""
    root, path = scopes[1], scopes[-2]
    return path[len(root) + 1:] if path.startswith(root + ".") else ""


class DebugGraph:
    def __init__(self, folder: Path, manifest: Manifest, graph_file: str):
        folder = Path(folder)
        model = onnx.load(str(folder / graph_file), load_external_data=False)
        types = {v.name: v for v in model.graph.value_info}
        declared = {o.name for o in model.graph.output}
        self.nodes: list[NodeInfo] = []
        self.has_scopes = False
        for index, node in enumerate(model.graph.node):
            exposed = tuple(o for o in node.output if o in types and o not in declared
                            and types[o].type.tensor_type.elem_type in FLOAT_TYPES)
            model.graph.output.extend(types[o] for o in exposed)
            module = module_of(node)
            self.has_scopes |= module is not None
            outputs = exposed + tuple(o for o in node.output if o in declared)
            self.nodes.append(NodeInfo(index, node.name, node.op_type, outputs, module or ""))
        self._model = model.SerializeToString()
        self._folder = folder
        self.graph_file = graph_file
        self._weights = SharedWeightMap(folder, manifest)
        self._sessions: dict = {}

    def run(self, feeds: dict, provider: str = "cpu") -> dict[str, np.ndarray]:
        """Every exposed value (and the graph's own outputs) by tensor name."""
        if provider not in self._sessions:
            self._sessions[provider] = graph_session(self._model, self._folder, self.graph_file, self._weights,
                                                     provider)
        session = self._sessions[provider]
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds)))
