"""A debug copy of a graph that exposes every intermediate value as an output (torch-free).

The copy lives in memory and is never written, so the artifact itself is never
touched: its weights are the artifact's, shared in place through the manifest's
initializer table where ONNX Runtime takes them, and read from the artifact's
weights file otherwise (a session places a given initializer only where it
planned it: not on a CUDA device, nor before a graph optimisation folds it into a
new constant, as for the float16 weights the CPU casts). Each node keeps the module
scope that torch.onnx recorded in its metadata, which lets localisation map
intermediate tensors back to the reference model's modules, and each exposed value
keeps the dims its value_info declares, which tell which of its elements belong to
real (not padded) positions, and the values computed from an attention mask's
fill, where -inf is the mask and not an overflow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from exporter.artifact.contract import GraphContract
from exporter.artifact.folder import Artifact
from exporter.artifact.scopes import module_of
from exporter.runtime.sessions import graph_session
from exporter.runtime.settings import SessionSettings
from exporter.runtime.shared_weights import SharedWeightMap
from exporter.verify.metrics import real_queries

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
# The export's attention mask fills (reference/layers.py attention_bias): -inf above the causal diagonal, -1e9 on
# padded keys.
MASK_FILLS = (-np.inf, -1e9)
# A softmax, whole or decomposed, turns the fill into zero weights: what it computes holds no fill.
MASK_CONSUMERS = {"Softmax", "Exp"}

Dim = str | int | None  # a symbolic name ('batch_size', '2*sequence_length'), a fixed size, or unknown


@dataclass(frozen=True)
class NodeInfo:
    index: int  # position in the graph's (topologically sorted) node list
    name: str
    op_type: str
    outputs: tuple[str, ...]  # the float outputs exposed by the debug copy
    module: str  # module path inside the exported model ('' when unknown or at its root)


def dims_of(value: onnx.ValueInfoProto) -> tuple[Dim, ...]:
    return tuple(
        d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None
        for d in value.type.tensor_type.shape.dim
    )


@dataclass(frozen=True)
class PositionAxes:
    """The graph's own names for the batch axis and the token positions, read from its inputs: the query
    length of input_ids and the total length of attention_mask (the same positions in a prefill)."""

    batch: str
    positions: frozenset[str]

    @staticmethod
    def of_graph(graph: onnx.GraphProto) -> PositionAxes:
        inputs = {v.name: dims_of(v) for v in graph.input}
        batch, query = inputs["input_ids"]
        return PositionAxes(batch, frozenset({query, inputs["attention_mask"][1]}))


def _hides_positions(dim: Dim, names: frozenset[str]) -> bool:
    """An unknown dim, or one that folds the batch or a position axis into another ('2*sequence_length',
    'sequence_length*batch_size', 'sequence_length - 1'): the value's real elements cannot be told apart."""
    if dim is None:
        return True
    return isinstance(dim, str) and dim not in names and bool(names & set(re.findall(r"[A-Za-z_]\w*", dim)))


def real_elements(
    dims: tuple[Dim, ...], shape: tuple[int, ...], axes: PositionAxes, mask: np.ndarray
) -> np.ndarray | None:
    """compare's `valid` (of the value's rank) for one graph value; None when its real positions are unknown.

    An element is real when each of its position axes indexes a real token of its row: an axis of size n
    covers the mask's last n positions (the queries of a call after a past). A value without a batch axis
    (a causal mask) or without a position axis cannot depend on a row's padding, so it is judged whole, as
    every value is when nothing is padded.

    Args:
        dims: the dims the value's value_info declares (symbolic names, sizes, or None where unknown).
        shape: the value's actual shape.
        axes: the graph's names for the batch axis and the token positions.
        mask: the call's attention mask (B, L).
    """
    whole = np.ones((1,) * len(dims), bool)
    if np.all(np.asarray(mask) == 1):
        return whole
    if any(_hides_positions(dim, axes.positions | {axes.batch}) for dim in dims):
        return None
    position_axes = [i for i, dim in enumerate(dims) if dim in axes.positions]
    if axes.batch not in dims or not position_axes:
        return whole
    batch_axis = dims.index(axes.batch)
    valid = whole
    for axis in position_axes:
        real = real_queries(mask, shape[axis])  # (B, n)
        valid = valid & np.moveaxis(real.reshape(real.shape + (1,) * (len(dims) - 2)), (0, 1), (batch_axis, axis))
    return valid


def mask_fed_values(graph: onnx.GraphProto) -> frozenset[str]:
    """The values computed from a mask fill (an initializer holding nothing but MASK_FILLS; the exporter folds
    constants into initializers) before a softmax consumes them: the mask, the biases built from it, the scores
    it is added to."""
    fed = set()
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:  # a weight: a fill is a small constant
            continue
        values = numpy_helper.to_array(tensor)
        if values.size and values.dtype.kind == "f" and np.isin(values, MASK_FILLS).all():
            fed.add(tensor.name)
    for node in graph.node:  # topologically sorted: a node's inputs are settled before it
        if node.op_type not in MASK_CONSUMERS and any(name in fed for name in node.input):
            fed.update(node.output)
    return frozenset(fed)


class DebugGraph:
    """One of an artifact's graphs with every float value it computes exposed as an output; its sessions read
    `weights` (SharedWeightMap.of: the artifact's one mapping, or their own)."""

    def __init__(
        self,
        artifact: Artifact,
        contract: GraphContract,
        weights: SharedWeightMap | None = None,
        settings: SessionSettings = SessionSettings(),
    ):
        model = artifact.graph(contract)
        types = {v.name: v for v in model.graph.value_info}
        declared = {o.name for o in model.graph.output}
        self.graph_outputs = frozenset(declared)  # the graph's own outputs (logits, presents)
        self.nodes: list[NodeInfo] = []
        self.dims = {o.name: dims_of(o) for o in model.graph.output}  # every exposed value's, as added below
        self.axes = PositionAxes.of_graph(model.graph)
        self.mask_fed = mask_fed_values(model.graph)
        self.has_scopes = False
        for index, node in enumerate(model.graph.node):
            exposed = tuple(
                o
                for o in node.output
                if o in types and o not in declared and types[o].type.tensor_type.elem_type in FLOAT_TYPES
            )
            model.graph.output.extend(types[o] for o in exposed)
            self.dims.update((o, dims_of(types[o])) for o in exposed)
            module = module_of(node)
            self.has_scopes |= module is not None
            outputs = exposed + tuple(o for o in node.output if o in declared)
            self.nodes.append(NodeInfo(index, node.name, node.op_type, outputs, module or ""))
        self._model = model.SerializeToString()
        self._folder = artifact.folder
        self.graph_file = contract.file
        self._weights = SharedWeightMap.of(artifact, weights)
        self._settings = settings
        self._sessions: dict = {}

    def run(self, feeds: dict, provider: str = "cpu") -> dict[str, np.ndarray]:
        """Every exposed value (and the graph's own outputs) by tensor name."""
        if provider not in self._sessions:
            self._sessions[provider] = graph_session(
                self._model, self._folder, self.graph_file, self._weights, provider, self._settings
            )
        session = self._sessions[provider]
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds)))
