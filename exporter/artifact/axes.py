"""Axis lint: every axis the contract declares dynamic must be symbolic in the saved graph.

torch.export names some axes itself ("s53", "past_sequence_length +
sequence_length"); they are renamed to the contract's names. An axis baked to
a number, or two contract axes merged into one symbol, is a specialisation the
graph would silently get wrong at other sizes, so the export fails.
"""

from __future__ import annotations

import onnx

from exporter.artifact.contract import GraphContract, TensorSpec


def _dims(value_info: onnx.ValueInfoProto):
    return list(value_info.type.tensor_type.shape.dim)


def _problems_and_renames(model: onnx.ModelProto, contract: GraphContract):
    graph_values = {v.name: v for v in list(model.graph.input) + list(model.graph.output)}
    problems: list[str] = []
    renames: dict[str, str] = {}
    specs: list[TensorSpec] = [*contract.inputs, *contract.outputs]
    for spec in specs:
        value = graph_values.get(spec.name)
        if value is None:
            problems.append(f"{contract.file}: missing {spec.name}")
            continue
        dims = _dims(value)
        if len(dims) != len(spec.axes):
            problems.append(f"{contract.file}: {spec.name} has rank {len(dims)}, expected {len(spec.axes)}")
            continue
        for index, (dim, axis) in enumerate(zip(dims, spec.axes)):
            where = f"{contract.file}: {spec.name} axis {index}"
            if isinstance(axis, int):
                if dim.dim_value != axis:
                    problems.append(f"{where} is {dim.dim_param or dim.dim_value}, expected {axis}")
            elif not dim.dim_param:
                problems.append(f"{where} ({axis}) was baked to {dim.dim_value}")
            elif renames.setdefault(dim.dim_param, axis) != axis:
                problems.append(
                    f"{where}: symbol {dim.dim_param!r} stands for both {renames[dim.dim_param]} and {axis}"
                )
    extra = set(graph_values) - {s.name for s in specs}
    problems += [f"{contract.file}: unexpected input/output {name}" for name in sorted(extra)]
    return problems, renames


def lint_axes(model: onnx.ModelProto, contract: GraphContract) -> list[str]:
    """Problems found (empty when the graph honours the contract's axes and names)."""
    problems, renames = _problems_and_renames(model, contract)
    return problems + [
        f"{contract.file}: axis named {old!r}, expected {new!r}" for old, new in renames.items() if old != new
    ]


def name_axes(model: onnx.ModelProto, contract: GraphContract) -> list[str]:
    """Rename exporter-chosen symbols to the contract's names in place; return lint problems."""
    problems, renames = _problems_and_renames(model, contract)
    values = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    for value in values:
        for dim in _dims(value):
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]
    return problems
