"""Export a deep decoder by tracing three of its layers and repeating the last one in the ONNX graph.

torch.export, its decompositions, the translation and the optimiser each cost time in proportion to the
number of nodes, and a decoder's nodes are its layers, all alike. A stack of N identical layers is therefore
traced as a stack of three (`LayerTemplate.short_model`), whose graph is then grown to N layers
(`LayerTemplate.expand`): layer 2's nodes are cloned for layers 3 .. N-1, each clone reading its own past, the
previous clone's outputs and its own layer's weights, and writing its own present; what read layer 2's output
(the final norm) reads the last clone's.

Correctness rests on checks, not on assumptions about the model:

- The three traced layers hold placeholder weights, random and distinct, so that every initializer the
  optimiser derives from a layer's weight (as it is, transposed, cast to float32) is found by its bytes; the
  real weights then replace the placeholders, in every layer, through the same derivation. An initializer of a
  layer that no weight explains is a constant, which layers 1 and 2 must hold equal.
- Layers 1 and 2 must be the same graph node for node: op, attributes, and every input of the same kind (a value
  of its own layer at the same place, the layer before's output, its own past, its own weight under the same
  derivation, or one shared value). Layer 0 is not compared: the optimiser may have kept there what all layers
  share. Whatever leaves layer 2 must be a present or the output layer 3 would read.
- The layers never traced are held to the traced ones by what they compute besides their weights (`_signature`:
  each submodule's class, plain attributes and buffers), compared before anything is traced.
- What the parent's forward hands each layer is invisible to both checks: a forward giving layers >= 3 a sliding
  window, chosen by their index, traces three layers that repeat and grows clones without the window. The template
  therefore applies only to a model whose class declares `uniform_layers = True`: a contract that its forward calls
  every layer alike. The toolkit's families declare it; a bring-your-own adapter (reference.byo.DecoderAdapter)
  does not unless its author sets it, and is traced whole.

Where a check fails, `expand` returns None with the reason in the log and the caller traces the whole model;
so does a model that is not one of the families laid out as `model.model.layers`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from exporter.artifact.scopes import SCOPES_KEY, parse_scopes

log = logging.getLogger(__name__)

TRACED_LAYERS = 3
# The module path of the layer list inside the export wrappers (PrefillGraph/DecodeGraph hold the model as
# `model`), as torch.onnx names it in each node's scopes.
LAYERS_SCOPE = "model.model.layers"
_PER_LAYER_IO = re.compile(r"(past_key_values|present)\.(\d+)\.(key|value)")


class NotRepeatable(Exception):
    """The traced graph is not three repetitions of one layer; the caller traces the whole model."""


@dataclass(frozen=True)
class _Derivation:
    """How an initializer is made from a layer's weight: `weight` (its name inside the layer, e.g.
    'self_attn.q_proj.weight'), transposed or not, in `dtype`, reshaped to the initializer's shape."""

    weight: str
    transposed: bool
    dtype: np.dtype


def _layer_list(model: nn.Module) -> nn.ModuleList | None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) else None


def _digest(array: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).digest()


class LayerTemplate:
    """The three-layer stand-in of a model whose layers repeat, and the expansion of its graph to the model's depth.

    Build with `for_model`, which returns None for a model this does not apply to.
    """

    def __init__(self, model: nn.Module, layers: nn.ModuleList):
        self.model = model
        self.layers = layers
        self.num_layers = len(layers)
        self._placeholders: list[dict[str, torch.Tensor]] = []
        self.short_model = self._short_model()
        self._derivations = self._index_placeholders()

    @classmethod
    def for_model(cls, model: nn.Module) -> LayerTemplate | None:
        """A template for `model`, or None: not laid out as model.model.layers (the teaching GPT), no deeper than the
        three layers traced, not declaring `uniform_layers` (a bring-your-own adapter, unless its author declares
        it), or layers of more than one class."""
        layers = _layer_list(model)
        if layers is None or len(layers) <= TRACED_LAYERS or not dataclasses.is_dataclass(model.config):
            return None
        if not getattr(model, "uniform_layers", False):
            log.info("tracing every layer: %s does not declare uniform_layers", type(model).__name__)
            return None
        first = _signature(layers[0])
        if any(_signature(layer) != first for layer in layers[1:]):
            log.info("tracing every layer: the layers differ in more than their weights")
            return None
        return cls(model, layers)

    def _short_model(self) -> nn.Module:
        """A shallow copy of the model whose layer list is three placeholder layers (its other modules and weights
        are the model's own) and whose config says three layers."""
        generator = torch.Generator().manual_seed(0)
        short_layers = nn.ModuleList()
        for layer in self.layers[:TRACED_LAYERS]:
            placeholder = copy.deepcopy(layer)
            weights = {}
            for name, weight in placeholder.named_parameters():
                weight.data = torch.randn(weight.shape, generator=generator).to(weight.dtype)
                weights[name] = weight.data
            self._placeholders.append(weights)
            short_layers.append(placeholder)
        config = dataclasses.replace(self.model.config, num_hidden_layers=TRACED_LAYERS)
        inner = copy.copy(self.model.model)
        inner._modules = dict(inner._modules, layers=short_layers)
        inner.config = config
        short = copy.copy(self.model)
        short._modules = dict(short._modules, model=inner)
        short.config = config
        return short

    def _index_placeholders(self) -> dict[bytes, tuple[int, _Derivation]]:
        """Every placeholder weight by the digest of each form the optimiser may fold it into."""
        index = {}
        for layer, weights in enumerate(self._placeholders):
            for name, weight in weights.items():
                array = weight.numpy()
                for transposed in (False, True) if array.ndim == 2 else (False,):
                    oriented = array.T if transposed else array
                    for dtype in dict.fromkeys((array.dtype, np.dtype(np.float32))):
                        index[_digest(oriented.astype(dtype, copy=False))] = (
                            layer,
                            _Derivation(name, transposed, np.dtype(dtype)),
                        )
        return index

    def _real_tensor(
        self, layer: int, derivation: _Derivation, like: ir.TensorProtocol, name: str
    ) -> ir.TensorProtocol:
        """Layer `layer`'s weight made as `derivation` says, shaped as `like`; computed when it is written, so that
        no more than one derived copy is held at a time."""
        weight = dict(self.layers[layer].named_parameters())[derivation.weight].detach()
        shape = tuple(like.shape.numpy())
        if not derivation.transposed and weight.numpy().dtype == derivation.dtype:
            return ir.Tensor(weight.numpy().reshape(shape), name=name)

        def make():
            array = weight.numpy()
            array = array.T if derivation.transposed else array
            return ir.Tensor(np.ascontiguousarray(array.astype(derivation.dtype, copy=False)).reshape(shape), name=name)

        return ir.LazyTensor(make, like.dtype, ir.Shape(shape), name=name)

    def expand(self, model: ir.Model) -> ir.Model | None:
        """The short model's graph grown to the model's depth with the model's weights, in place; None (the reason
        logged) where it is not three repetitions of one layer."""
        try:
            _Expansion(self, model.graph).run()
        except NotRepeatable as exc:
            log.info("tracing every layer: the three traced layers do not repeat (%s)", exc)
            return None
        return model


def _signature(layer: nn.Module) -> list:
    """What a layer computes besides its weights: each submodule's class and plain attributes (sizes, eps, flags,
    functions), and the bytes of its buffers. Layers of equal signatures trace to the same graph; the layers beyond
    the three traced are held to this, as the traced ones are held to their graphs."""
    signature = []
    for name, module in layer.named_modules():
        plain = sorted((key, repr(value)) for key, value in vars(module).items() if not key.startswith("_"))
        buffers = [(key, _digest(buffer.detach().cpu().numpy())) for key, buffer in module.named_buffers(recurse=False)]
        signature.append((name, type(module), plain, buffers))
    return signature


def _layer_of(node: ir.Node) -> int | None:
    prefix = LAYERS_SCOPE + "."
    for entry in parse_scopes(node.metadata_props.get(SCOPES_KEY)) or []:
        if isinstance(entry, str) and entry.startswith(prefix) and entry[len(prefix) :].isdigit():
            return int(entry[len(prefix) :])
    return None


def _layers_of(graph: ir.Graph) -> dict[int, int]:
    """The layer of each node that lies in one ({id(node): layer}): by its scopes, or, for a node the optimiser
    made without any (a Cast it split off), by its neighbours where all of them that lie in a layer lie in the
    same one."""
    layers = {id(node): layer for node in graph if (layer := _layer_of(node)) is not None}
    unplaced = [node for node in graph if id(node) not in layers and SCOPES_KEY not in node.metadata_props]
    while unplaced:
        still = []
        for node in unplaced:
            around = {
                layers.get(id(value.producer())) for value in node.inputs if value is not None and value.producer()
            }
            around |= {layers.get(id(user)) for value in node.outputs for user, _ in value.uses()}
            around.discard(None)
            if len(around) == 1:
                layers[id(node)] = around.pop()
            else:
                still.append(node)
        if len(still) == len(unplaced):
            break
        unplaced = still
    return layers


def _relabel(text: str, layer: int) -> str:
    return re.sub(r"(?<=layers\.)2\b", str(layer), text)


class _Expansion:
    def __init__(self, template: LayerTemplate, graph: ir.Graph):
        self.template = template
        self.graph = graph
        self.nodes: list[list[ir.Node]] = [[] for _ in range(TRACED_LAYERS)]
        layers = _layers_of(graph)
        for node in graph:
            if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
                raise NotRepeatable(f"node {node.name} holds a subgraph")
            layer = layers.get(id(node))
            if layer is not None and layer >= TRACED_LAYERS:
                raise NotRepeatable(f"the graph holds layer {layer}, beyond the {TRACED_LAYERS} traced")
            if layer is not None:
                self.nodes[layer].append(node)
        self.layer_of_node = {id(node): layer for layer, nodes in enumerate(self.nodes) for node in nodes}
        self.index_in_layer = {id(node): i for nodes in self.nodes for i, node in enumerate(nodes)}
        self.derived: dict[str, tuple[int, _Derivation]] = self._derive_initializers()
        self.names = {value.name for node in graph for value in node.outputs} | set(graph.initializers)
        self.names |= {value.name for value in graph.inputs}
        self.input_dims = {
            str(dim.value)
            for value in graph.inputs
            if value.shape is not None
            for dim in value.shape
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None
        }
        self.weights: dict[tuple[int, str], ir.Value] = {}  # (layer, layer 2's initializer): the clone's

    def _derive_initializers(self) -> dict[str, tuple[int, _Derivation]]:
        derived = {}
        for name, value in self.graph.initializers.items():
            tensor = value.const_value
            if tensor is None or tensor.size < 2:
                continue
            found = self.template._derivations.get(_digest(tensor.numpy()))
            if found is not None:
                derived[name] = found
        return derived

    def _producer(self, value: ir.Value) -> tuple[int, int, int] | None:
        """(layer, index in the layer, output index) of a value a layer's node produced."""
        node = value.producer()
        if node is None or id(node) not in self.layer_of_node:
            return None
        return self.layer_of_node[id(node)], self.index_in_layer[id(node)], value.index()

    def _per_layer_io(self, value: ir.Value) -> tuple[str, int, str] | None:
        match = _PER_LAYER_IO.fullmatch(value.name or "")
        return None if match is None else (match[1], int(match[2]), match[3])

    def _kind(self, value: ir.Value | None, layer: int):
        """What an input of a node of `layer` is: ("own", index, output) or ("previous", index, output), a value of its
        own layer's or of the layer before's; ("io", "past_key_values", part), its own past; ("weight", derivation),
        its own weight; ("constant", value), an initializer no weight explains; ("shared", value), anything else."""
        if value is None:
            return ("none",)
        produced = self._producer(value)
        if produced is not None and produced[0] == layer:
            return ("own", produced[1], produced[2])
        if produced is not None and produced[0] == layer - 1:
            return ("previous", produced[1], produced[2])
        io = self._per_layer_io(value)
        if io is not None and io[1] == layer and value.is_graph_input():
            return ("io", io[0], io[2])
        if value.name in self.derived:
            owner, derivation = self.derived[value.name]
            if owner != layer:
                raise NotRepeatable(f"layer {layer} reads {value.name}, a weight of layer {owner}")
            return ("weight", derivation)
        if value.is_initializer():
            return ("constant", value)
        return ("shared", value)

    def _check_layers_repeat(self) -> dict[int, tuple[int, int]]:
        """Compare layers 1 and 2 node for node; returns, for the previous layer's values that layer 2 reads, where
        each sits in its layer ({id(value of layer 1): (index, output)})."""
        first, second = self.nodes[1], self.nodes[2]
        if not first or len(first) != len(second):
            raise NotRepeatable(f"layers 1 and 2 have {len(first)} and {len(second)} nodes")
        previous = {}
        for a, b in zip(first, second):
            if (a.domain, a.op_type, a.overload, len(a.inputs), len(a.outputs)) != (
                b.domain,
                b.op_type,
                b.overload,
                len(b.inputs),
                len(b.outputs),
            ):
                raise NotRepeatable(f"{a.name} ({a.op_type}) and {b.name} ({b.op_type}) differ")
            if _attributes(a) != _attributes(b):
                raise NotRepeatable(f"{a.name} and {b.name} have different attributes")
            for x, y in zip(a.inputs, b.inputs):
                kx, ky = self._kind(x, 1), self._kind(y, 2)
                if x is y and ky[0] in ("shared", "constant"):  # for layer 1, a value of layer 0 that all layers read
                    continue
                if kx[0] != ky[0]:
                    raise NotRepeatable(f"input {y.name if y else None} of {b.name} is not as layer 1's is")
                if kx[0] in ("own", "io", "weight") and kx[1:] != ky[1:]:
                    raise NotRepeatable(f"input {y.name} of {b.name} is not as layer 1's is")
                if kx[0] == "shared" and x is not y:
                    raise NotRepeatable(f"{a.name} and {b.name} read different values {x.name}, {y.name}")
                if kx[0] == "constant" and not _equal_tensors(x.const_value, y.const_value):
                    raise NotRepeatable(f"{a.name} and {b.name} read different constants")
                if ky[0] == "previous":
                    previous[id(y)] = ky[1:]
        for node in second:  # what leaves layer 2: its presents, or what layer 3 would read in place of layer 1's
            index = self.index_in_layer[id(node)]
            for value in node.outputs:
                outside = [user for user, _ in value.uses() if self.layer_of_node.get(id(user)) != 2]
                if not outside and not value.is_graph_output():
                    continue
                if value.is_graph_output():
                    io = self._per_layer_io(value)
                    if io is None or io[0] != "present" or io[1] != 2:
                        raise NotRepeatable(f"layer 2 writes the graph output {value.name}")
                counterpart = first[index].outputs[value.index()]
                if outside and id(counterpart) not in previous:
                    raise NotRepeatable(f"{value.name} leaves layer 2, but layer 2 does not read layer 1's")
        return previous

    def _fresh(self, name: str, layer: int) -> str:
        """Layer 2's name for a value or node made the clone's: a past or present named for its layer, a weight
        or module path relabelled, any other name given a suffix; unique in the graph."""
        io = _PER_LAYER_IO.fullmatch(name)
        if io is not None:
            return f"{io[1]}.{layer}.{io[3]}"
        renamed = _relabel(name, layer)
        if renamed == name:
            renamed = f"{name}_layer{layer}"
        while renamed in self.names:
            renamed += "_"
        self.names.add(renamed)
        return renamed

    def run(self) -> None:
        template, graph = self.template, self.graph
        previous = self._check_layers_repeat()
        # The real weights in place of the placeholders, in the three traced layers.
        for name, (layer, derivation) in self.derived.items():
            value = graph.initializers[name]
            value.const_value = template._real_tensor(layer, derivation, value.const_value, name)
        second = self.nodes[2]
        # Each value of layer 2 as the layer last cloned computes it; clone k reads clone k-1's in place of layer 1's.
        last = {id(value): value for node in second for value in node.outputs}
        readers = [  # what reads layer 2's output after it (the final norm): it will read the last layer's
            (user, slot, value)
            for node in second
            for value in node.outputs
            for user, slot in value.uses()
            if self.layer_of_node.get(id(user)) != 2
        ]
        kinds = [[self._kind(value, 2) for value in node.inputs] for node in second]  # the same in every clone
        new_inputs: dict[str, ir.Value] = {}
        new_outputs, new_nodes = [], []
        for layer in range(TRACED_LAYERS, template.num_layers):
            made: dict[int, ir.Value] = {}
            for node, node_kinds in zip(second, kinds):
                inputs = []
                for value, kind in zip(node.inputs, node_kinds):
                    if kind[0] == "own":
                        inputs.append(made[id(value)])
                    elif kind[0] == "previous":
                        index, output = previous[id(value)]
                        inputs.append(last[id(second[index].outputs[output])])
                    elif kind[0] == "io":
                        inputs.append(self._past(layer, value, new_inputs))
                    elif kind[0] == "weight":
                        inputs.append(self._weight(layer, kind[1], value))
                    else:
                        inputs.append(value)
                clone = ir.Node(
                    node.domain,
                    node.op_type,
                    inputs,
                    attributes=list(node.attributes.values()),
                    overload=node.overload,
                    num_outputs=len(node.outputs),
                    version=node.version,
                    name=self._fresh(node.name or node.op_type, layer),
                    metadata_props={
                        key: _relabel(text, layer) if key == SCOPES_KEY else text
                        for key, text in node.metadata_props.items()
                    },
                )
                for old, new in zip(node.outputs, clone.outputs):
                    new.name = self._fresh(old.name, layer)
                    new.shape = self._clone_shape(old.shape)
                    new.type = old.type
                    made[id(old)] = new
                    if old.is_graph_output():
                        new_outputs.append(new)
                new_nodes.append(clone)
            last = {id(old): made[id(old)] for node in second for old in node.outputs}
        for user, slot, value in readers:
            user.replace_input_with(slot, last[id(value)])
        graph.extend(new_nodes)
        for values, new in ((graph.inputs, list(new_inputs.values())), (graph.outputs, new_outputs)):
            ordered = self._in_layer_order([*values, *new])
            values.clear()
            values.extend(ordered)
        graph.sort()

    def _clone_shape(self, shape: ir.Shape | None) -> ir.Shape | None:
        """A shape of layer 2's for its clone: a size that depends on values (a MoE layer's tokens per expert, an
        unbacked symbol of torch.export) is the clone's own, so it is left unknown; sizes named by the graph's
        inputs hold in every layer."""
        if shape is None:
            return None
        dims = []
        for dim in shape:
            names = re.findall(r"[A-Za-z_]\w*", str(dim.value)) if isinstance(dim, ir.SymbolicDim) else []
            dims.append(None if any(name not in self.input_dims for name in names) else dim)
        return ir.Shape(dims)

    def _in_layer_order(self, values: list[ir.Value]) -> list[ir.Value]:
        """The contract's order: the pasts (or presents) together, by layer, key before value, where the first
        of them was; the other inputs (outputs) where they were."""
        per_layer = sorted(
            (value for value in values if self._per_layer_io(value)),
            key=lambda value: (self._per_layer_io(value)[1], self._per_layer_io(value)[2] != "key"),
        )
        ordered = []
        for value in values:
            if not self._per_layer_io(value):
                ordered.append(value)
            elif per_layer:
                ordered.extend(per_layer)
                per_layer = []
        return ordered

    def _past(self, layer: int, value: ir.Value, new_inputs: dict[str, ir.Value]) -> ir.Value:
        """Layer `layer`'s graph input standing for layer 2's past `value`, made once ({name: input})."""
        io = _PER_LAYER_IO.fullmatch(value.name)
        name = f"{io[1]}.{layer}.{io[3]}"
        if name not in new_inputs:
            shape = value.shape.copy() if value.shape is not None else None
            new_inputs[name] = ir.Value(name=name, shape=shape, type=value.type)
        return new_inputs[name]

    def _weight(self, layer: int, derivation: _Derivation, value: ir.Value) -> ir.Value:
        key = (layer, value.name)
        if key in self.weights:
            return self.weights[key]
        name = self._fresh(value.name, layer)
        tensor = self.template._real_tensor(layer, derivation, value.const_value, name)
        made = ir.Value(name=name, shape=ir.Shape(tuple(value.const_value.shape.numpy())), type=value.type)
        made.const_value = tensor
        self.graph.register_initializer(made)
        self.weights[key] = made
        return made


def _attributes(node: ir.Node) -> dict:
    out = {}
    for name, attr in node.attributes.items():
        value = attr.value
        if isinstance(value, ir.TensorProtocol):
            value = (value.dtype, tuple(value.shape.numpy()), _digest(value.numpy()))
        elif isinstance(value, (list, tuple)):
            value = tuple(value)
        out[name] = (attr.type, value)
    return out


def _equal_tensors(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return (
        a.dtype == b.dtype
        and tuple(a.shape.numpy()) == tuple(b.shape.numpy())
        and _digest(a.numpy()) == _digest(b.numpy())
    )
