"""Graph passes: the ONNX graphs rewritten after tracing.

A graph is cut from the traced program (cut), then made ours (finish): torch.onnx's trace metadata stripped, its
RMSNorms in the form onnxruntime fuses, the contract's axis names set and linted.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

from exporter.artifact.axes import name_axes
from exporter.artifact.contract import GraphContract
from exporter.errors import ExportFailed

log = logging.getLogger(__name__)


def cut(model: onnx.ModelProto, contract: GraphContract) -> onnx.ModelProto:
    """The graph of `contract` cut from the traced program `model`, in place: only the contract's outputs and what
    computes them; a past input the contract lacks (prefill.onnx) becomes an empty (B, Hkv, 0, D) tensor, B read
    from input_ids, so that the graph computes the program on an empty cache."""
    graph = model.graph
    outputs = {o.name: o for o in graph.output}
    inputs = {i.name: i for i in graph.input}
    del graph.output[:]
    graph.output.extend(outputs[name] for name in contract.output_names)
    empty_nodes = []
    shapes: dict[tuple, str] = {}
    for name, value in inputs.items():
        if name in contract.input_names:
            continue
        if not name.startswith("past_key_values."):
            # labels, which the loss reads, and torch.export may read for the batch and sequence sizes it shares
            # with input_ids (both (batch, sequence) by the contract): those sizes are read from input_ids
            for node in graph.node:
                if node.op_type == "Shape" and node.input[0] == name:
                    node.input[0] = "input_ids"
            continue
        tensor = value.type.tensor_type
        _, heads, _, head_dim = (d.dim_value for d in tensor.shape.dim)
        key = (tensor.elem_type, heads, head_dim)
        if key not in shapes:
            shapes[key] = f"empty_past_{len(shapes)}"
            batch, sizes = f"{shapes[key]}_batch", f"{shapes[key]}_shape"
            empty_nodes += [
                helper.make_node("Shape", ["input_ids"], [batch], start=0, end=1),
                helper.make_node("Concat", [batch, f"{sizes}_rest"], [sizes], axis=0),
            ]
            graph.initializer.append(
                numpy_helper.from_array(np.array([heads, 0, head_dim], dtype=np.int64), f"{sizes}_rest")
            )
            zero = helper.make_tensor("value", tensor.elem_type, [1], [0])
            empty_nodes.append(helper.make_node("ConstantOfShape", [sizes], [shapes[key]], value=zero))
        empty_nodes.append(helper.make_node("Identity", [shapes[key]], [name]))
    nodes = empty_nodes + list(graph.node)
    needed = set(contract.output_names)
    kept = []
    for node in reversed(nodes):  # nodes are in topological order: a node's consumers come after it
        if any(out in needed for out in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    del graph.input[:]
    graph.input.extend(inputs[name] for name in contract.input_names)
    used = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(used)
    kept_info = [v for v in graph.value_info if v.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    missing = sorted(
        needed
        - {i.name for i in graph.input}
        - {t.name for t in graph.initializer}
        - {o for n in graph.node for o in n.output}
    )
    if missing:
        raise ExportFailed(
            f"{contract.file} cannot be cut from the traced program: it would read {', '.join(missing[:5])}"
        )
    return model


def finish(model: onnx.ModelProto, contract: GraphContract) -> onnx.ModelProto:
    """The exported graph (its weights already references into the shared file) made ours: trace metadata
    stripped, RMSNorms in their fusable form, the contract's axis names set and linted."""
    _strip_trace_metadata(model)
    _rsqrt_as_division(model)
    problems = name_axes(model, contract)
    if problems:
        raise ExportFailed(f"{contract.file} breaks the I/O contract: {'; '.join(problems[:5])}")
    return model


# Node metadata torch.onnx writes that the artifact drops: stack traces carry this machine's absolute paths; the
# namespace and class hierarchy repeat the module path that the name scopes (exporter.artifact.scopes, kept: they place
# each node in its module) give, with class names, at over half of a graph file's bytes.
_DROPPED_METADATA = (
    "pkg.torch.onnx.stack_trace",
    "pkg.torch.onnx.fx_node",
    "namespace",
    "pkg.torch.onnx.class_hierarchy",
)


def _strip_trace_metadata(model: onnx.ModelProto) -> None:
    for node in model.graph.node:
        kept = [p for p in node.metadata_props if p.key not in _DROPPED_METADATA]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)


def _rsqrt_as_division(model: onnx.ModelProto) -> None:
    """Rewrite x * Reciprocal(Sqrt(v)) as x / Sqrt(v), in place.

    torch exports rsqrt as Sqrt then Reciprocal, and ONNX Runtime fuses an RMSNorm into one
    SimplifiedLayerNormalization only in its division form; unfused, each norm stays six nodes.
    Every consumer running on onnxruntime gains a smaller optimised graph that runs faster.
    x * (1/s) rounds twice where x / s rounds once: a difference of an ulp or so.
    """
    graph = model.graph
    producer = {name: node for node in graph.node for name in node.output}
    users: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    outputs = {value.name for value in graph.output}
    dropped = set()
    for node in graph.node:
        root = producer.get(node.input[0]) if node.op_type == "Reciprocal" and node.domain == "" else None
        if root is None or root.op_type != "Sqrt" or node.output[0] in outputs:
            continue
        inverse = node.output[0]
        muls = users.get(inverse, [])
        if not muls or any(m.op_type != "Mul" or list(m.input).count(inverse) != 1 for m in muls):
            continue
        for mul in muls:
            numerator = mul.input[1] if mul.input[0] == inverse else mul.input[0]
            mul.op_type = "Div"
            del mul.input[:]
            mul.input.extend([numerator, root.output[0]])
        dropped.add(inverse)
    kept = [node for node in graph.node if not (node.op_type == "Reciprocal" and node.output[0] in dropped)]
    del graph.node[:]
    graph.node.extend(kept)
    kept_info = [value for value in graph.value_info if value.name not in dropped]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    log.debug("%d reciprocal square roots rewritten as divisions", len(dropped))
