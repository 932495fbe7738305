"""Localisation: which layer, and which operator, is the first to go wrong (torch-free).

Layer level: each layer's present key/value is a checkpoint that depends only
on the layers before it and on the layer's own input norm and key/value path,
so the first layer whose present diverges holds the fault, or the output path
(query path, attention, output projection, MLP) of the layer just before it.
Where logits diverge and every present passes, every layer's input is right:
the fault lies after the last layer's key/value path, in that layer's output
path, the final norm or lm_head.

Operator level (the probe): a debug copy of a graph exposes every
intermediate value: prefill.onnx on the prefill batch, and decode.onnx on one
decode call fed the reference's own inputs and past, so that it judges that
graph alone. Against the PyTorch reference, each reference module's output
(recorded with forward hooks on the same call) is matched to the last value
computed in that module's scope with the same shape, and each present to the
graph output of its name; the first match in the graph's topological order
that diverges beyond tolerance names the operator that computed it. A fault in
an operator whose value is not checked (a scale inside attention, say) shows at
the next checked value: the probe names the first diverging checked value,
which lies at or after the fault and after the last agreeing one. Between two ONNX Runtime
runs (two providers), every value is compared by name.

Both judge real positions only, as every check of logits and presents does: a
value's dims (from the graph's value_info) say which axes are the batch and the
positions, and an element counts where each position axis indexes a real token
of its row. A value whose dims fold the sequence into another axis, or hold an
axis the export left unnamed, cannot be mapped to positions, so on a padded
batch it is left out and counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from exporter.tolerances.parity import Tolerance
from exporter.verify.checks.calls import LayerError
from exporter.verify.checks.outputs import StepError
from exporter.verify.diagnosis.probe import DebugGraph, real_elements
from exporter.verify.metrics import Comparison, compare


@dataclass(frozen=True)
class Divergence:
    node: str
    op_type: str
    module: str
    tensor: str
    max_abs: float
    needed_scale: float  # how many times the tolerance the error is

    def to_dict(self) -> dict:
        return {
            "node": self.node,
            "op_type": self.op_type,
            "module": self.module,
            "tensor": self.tensor,
            "max_abs": self.max_abs,
            "needed_scale": self.needed_scale,
        }


@dataclass(frozen=True)
class ProbeResult:
    mode: str  # "reference" or "<provider> vs <provider>"
    graph: str  # the graph file probed
    call: str  # the inputs it ran on: "the prefill batch", "decode step 3, fed the reference's past"
    checked: int  # values compared
    first: Divergence | None  # None: nothing diverged
    note: str = ""

    @property
    def covers(self) -> str:
        return f"{self.graph}, {self.call}"

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "graph": self.graph,
            "call": self.call,
            "checked": self.checked,
            "first": self.first.to_dict() if self.first else None,
            "note": self.note,
        }


@dataclass(frozen=True)
class Localisation:
    first_layer: int | None  # the first layer whose present diverges
    where: str  # which check found it
    fault_in: str  # the part of the model that holds the fault; "" when nothing diverges
    probe: ProbeResult | None = None  # prefill.onnx on the prefill batch
    probe_skipped: str = ""  # why there is no probe result
    # decode.onnx on the first failing call of the decode check (its first call when none fails)
    decode_probe: ProbeResult | None = None
    decode_probe_skipped: str = ""

    def describe(self) -> str:
        found = (
            f"first diverging layer {self.first_layer} ({self.where})" if self.first_layer is not None else self.where
        )
        return f"{found}: the fault lies {self.fault_in}"

    def to_dict(self) -> dict:
        return {
            "first_layer": self.first_layer,
            "where": self.where,
            "fault_in": self.fault_in,
            "probe": self.probe.to_dict() if self.probe else None,
            "probe_skipped": self.probe_skipped,
            "decode_probe": self.decode_probe.to_dict() if self.decode_probe else None,
            "decode_probe_skipped": self.decode_probe_skipped,
        }


def _output_path(layer: int) -> str:
    return f"layer {layer}'s query path, attention, output projection or MLP"


def _at_layer(layer: int, where: str) -> Localisation:
    before = "the token embedding" if layer == 0 else _output_path(layer - 1)
    return Localisation(layer, where, f"in layer {layer}'s input norm or key/value path, or in {before}")


def locate_layer(layers: list[LayerError], logits: Comparison, curve: list[StepError]) -> Localisation:
    """The layer level from the prefill's per-layer presents and logits and the decode steps: the first layer
    whose present diverges (in the prefill, else at the first decode step where one does); else, where logits
    diverge, the part after the last layer's key/value path."""
    first = next((layer.layer for layer in layers if not layer.passed), None)
    if first is not None:
        return _at_layer(first, "prefill present")
    step = next((s for s in curve if s.first_failing_layer is not None), None)
    if step is not None:
        return _at_layer(step.first_failing_layer, f"decode step {step.step} present")
    failing = (
        "prefill" if not logits.passed else next((f"decode step {s.step}" for s in curve if not s.logits.passed), None)
    )
    if failing is None:
        return Localisation(None, "", "")
    last = layers[-1].layer
    return Localisation(
        None,
        f"{failing} logits diverge, every layer's present passing",
        f"after layer {last}'s key/value path: in {_output_path(last)}, the final norm or lm_head",
    )


Pair = tuple[int, str, str, np.ndarray, np.ndarray]  # node index, module, tensor, actual, expected


def _first_failure(
    graph: DebugGraph, pairs: list[Pair], tolerance: Tolerance, mask: np.ndarray
) -> tuple[Divergence | None, int, str]:
    """The first pair in topological order that diverges at its real elements, how many pairs are compared,
    and a note on those left out."""
    judged = [
        (pair, real_elements(graph.dims[pair[2]], pair[3].shape, graph.axes, mask))
        for pair in sorted(pairs, key=lambda p: p[0])
    ]
    left_out = sum(valid is None for _, valid in judged)
    note = (
        (
            f"{left_out} values left out: their shape folds the sequence into another axis or has an axis the "
            "export left unnamed, so their real positions are unknown"
        )
        if left_out
        else ""
    )
    for (index, module, tensor, actual, expected), valid in judged:
        if valid is None:
            continue
        result = compare(tensor, "activation", actual, expected, tolerance, valid)
        if not result.passed:
            node = graph.nodes[index]
            divergence = Divergence(node.name, node.op_type, module, tensor, result.max_abs, result.needed.scale)
            return divergence, len(pairs) - left_out, note
    return None, len(pairs) - left_out, note


def probe_reference(
    graph: DebugGraph, values: dict, module_outputs: dict, tolerance: Tolerance, mask: np.ndarray, call: str
) -> ProbeResult:
    """The first graph value, in graph order, that differs from the reference module output it is matched to.

    Args:
        graph: the debug copy that exposes every value.
        values: the debug graph's outputs on `call`.
        module_outputs: reference module path (or graph output name) -> output array on the same call.
        tolerance: the Tolerance each matched value must meet.
        mask: the call's attention mask, whose padded positions are not judged.
        call: the inputs it ran on, as the result names them ("the prefill batch").

    Returns:
        The ProbeResult; nothing is compared when the graph carries no module scopes.
    """
    if not graph.has_scopes:
        return ProbeResult(
            "reference",
            graph.graph_file,
            call,
            0,
            None,
            "the graph carries no module scopes (not a torch.onnx dynamo export); compare two providers instead",
        )
    producers = {o: n.index for n in graph.nodes for o in n.outputs}
    pairs = []
    for module, expected in module_outputs.items():
        # a graph output the reference returns too (a present); a module path may equal the name of an
        # intermediate value (the teaching GPT's final `layer_norm` and its first block's LayerNormalization)
        if module in graph.graph_outputs and module in values:
            index = producers[module]
            pairs.append((index, graph.nodes[index].module, module, values[module], expected))
            continue
        inside = [n for n in graph.nodes if n.module == module or n.module.startswith(module + ".")]
        match = next(
            (
                (n.index, o)
                for n in reversed(inside)
                for o in n.outputs
                if o in values and values[o].shape == expected.shape
            ),
            None,
        )
        if match is not None:
            pairs.append((match[0], module, match[1], values[match[1]], expected))
    first, checked, note_left_out = _first_failure(graph, pairs, tolerance, mask)
    matched = f"{len(pairs)} of {len(module_outputs)} reference module outputs and presents matched to graph values"
    return ProbeResult(
        "reference", graph.graph_file, call, checked, first, "; ".join(filter(None, [matched, note_left_out]))
    )


def probe_between(
    graph: DebugGraph, values: dict, baseline: dict, tolerance: Tolerance, mode: str, mask: np.ndarray, call: str
) -> ProbeResult:
    """Every value of one run against the same value of another run of the same debug graph on `call`.

    Args:
        graph: the debug copy that exposes every value.
        values: the graph's outputs on one run (one provider's).
        baseline: its outputs on the other run, the reference side.
        tolerance: the Tolerance each value must meet.
        mode: the comparison's name ("<provider> vs <provider>").
        mask: the call's attention mask: only real positions are judged.
        call: the inputs it ran on, as the result names them.
    """
    pairs = [
        (n.index, n.module, o, values[o], baseline[o])
        for n in graph.nodes
        for o in n.outputs
        if o in values and o in baseline
    ]
    first, checked, note_left_out = _first_failure(graph, pairs, tolerance, mask)
    return ProbeResult(mode, graph.graph_file, call, checked, first, note_left_out)
