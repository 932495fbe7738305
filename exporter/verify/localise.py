"""Localisation: which layer, and which operator, is the first to go wrong (torch-free).

Layer level: each layer's present key/value is a checkpoint that depends only
on the layers before it and on the layer's own input norm and key/value path,
so the first layer whose present diverges holds the fault, or the output path
(attention output projection, MLP) of the layer just before it.

Operator level (the probe): a debug copy of prefill.onnx exposes every
intermediate value. Against the PyTorch reference, each reference module's
output (recorded with forward hooks) is matched to the last value computed in
that module's scope with the same shape, and each present to the graph output
of its name; the first match in the graph's topological order that diverges
beyond tolerance names the operator that computed it. A fault in an operator
whose value is not checked (a scale inside attention, say) shows at the next
checked value: the probe names the first diverging checked value, which lies
at or after the fault and after the last agreeing one. Between two ONNX Runtime
runs (two providers), every value is compared by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exporter.verify.checks import LayerError
from exporter.verify.metrics import Tolerance, compare
from exporter.verify.probe import DebugGraph


@dataclass(frozen=True)
class Divergence:
    node: str
    op_type: str
    module: str
    tensor: str
    max_abs: float
    needed_scale: float  # how many times the tolerance the error is

    def to_dict(self) -> dict:
        return {"node": self.node, "op_type": self.op_type, "module": self.module, "tensor": self.tensor,
                "max_abs": self.max_abs, "needed_scale": self.needed_scale}


@dataclass(frozen=True)
class ProbeResult:
    mode: str  # "reference" or "<provider> vs <provider>"
    checked: int  # values compared
    first: Divergence | None  # None: nothing diverged
    note: str = ""

    def to_dict(self) -> dict:
        return {"mode": self.mode, "checked": self.checked, "first": self.first.to_dict() if self.first else None,
                "note": self.note}


@dataclass(frozen=True)
class Localisation:
    first_layer: int | None
    where: str  # which check found it
    probe: ProbeResult | None
    probe_skipped: str = ""  # why there is no probe result

    def to_dict(self) -> dict:
        return {"first_layer": self.first_layer, "where": self.where,
                "probe": self.probe.to_dict() if self.probe else None, "probe_skipped": self.probe_skipped}


def first_diverging_layer(layers: list[LayerError]) -> int | None:
    return next((layer.layer for layer in layers if not layer.passed), None)


def _first_failure(graph: DebugGraph, pairs: list[tuple[int, str, str, np.ndarray, np.ndarray]],
                   tolerance: Tolerance) -> Divergence | None:
    for index, module, tensor, actual, expected in sorted(pairs, key=lambda p: p[0]):
        result = compare(tensor, "activation", actual, expected, tolerance)
        if not result.passed:
            node = graph.nodes[index]
            return Divergence(node.name, node.op_type, module, tensor, result.max_abs, result.needed.scale)
    return None


def probe_reference(graph: DebugGraph, values: dict, module_outputs: dict, tolerance: Tolerance) -> ProbeResult:
    """`values`: the debug graph's outputs; `module_outputs`: reference module path (or graph output name)
    -> output array."""
    if not graph.has_scopes:
        return ProbeResult("reference", 0, None, "the graph carries no module scopes (not a torch.onnx dynamo "
                                                 "export); compare two providers instead")
    producers = {o: n.index for n in graph.nodes for o in n.outputs}
    pairs = []
    for module, expected in module_outputs.items():
        if module in producers and module in values:  # a graph output the reference returns too (a present)
            index = producers[module]
            pairs.append((index, graph.nodes[index].module, module, values[module], expected))
            continue
        inside = [n for n in graph.nodes if n.module == module or n.module.startswith(module + ".")]
        match = next(((n.index, o) for n in reversed(inside) for o in n.outputs
                      if o in values and values[o].shape == expected.shape), None)
        if match is not None:
            pairs.append((match[0], module, match[1], values[match[1]], expected))
    first = _first_failure(graph, pairs, tolerance)
    return ProbeResult("reference", len(pairs), first,
                       f"{len(pairs)} of {len(module_outputs)} reference module outputs and presents matched to "
                       "graph values")


def probe_between(graph: DebugGraph, values: dict, baseline: dict, tolerance: Tolerance, mode: str) -> ProbeResult:
    """Every value of one run against the same value of another run of the same debug graph."""
    pairs = [(n.index, n.module, o, values[o], baseline[o]) for n in graph.nodes for o in n.outputs
             if o in values and o in baseline]
    return ProbeResult(mode, len(pairs), _first_failure(graph, pairs, tolerance))
