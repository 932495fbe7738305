"""Deep models traced three layers deep and grown to their depth (exporter/export/layer_template.py).

The grown graph is held to the graph torch.onnx gives when it traces every layer: the same nodes in the same
modules, the same inputs and outputs, and outputs equal bit for bit on ONNX Runtime. Where the layers do not
repeat, every layer is traced.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import torch
from hf_folders import hf_model, save_folder

from exporter.export import pipeline
from exporter.export.graphs import share_tied_table
from exporter.export.layer_template import TRACED_LAYERS, LayerTemplate
from exporter.verify.diagnosis.probe import module_of
from exporter.verify.references.model_source import checkpoint_model
from reference import build_model, get_preset

LAYERS = TRACED_LAYERS + 1  # one layer grown: a clone reading layer 2, read by the final norm


def _traced_layers(monkeypatch) -> list[int]:
    """Records the layer count of every graph torch.onnx traces."""
    counts = []
    trace = pipeline._torch_export

    def counting(module, args, names, contract):
        counts.append(sum(name.startswith("present.") for name in contract.output_names) // 2)
        return trace(module, args, names, contract)

    monkeypatch.setattr(pipeline, "_torch_export", counting)
    return counts


def _run(session: onnxruntime.InferenceSession, past: int) -> list[np.ndarray]:
    """The graph's outputs for a batch of 2 rows of 5 tokens (after `past` cached positions where it has a past)."""
    rng = np.random.default_rng(1)
    batch, length = 2, 5
    feeds = {}
    for spec in session.get_inputs():
        if spec.name in ("input_ids", "labels"):
            feeds[spec.name] = rng.integers(0, 200, (batch, length))
        elif spec.name == "attention_mask":
            feeds[spec.name] = np.ones((batch, past + length), np.int64)
        elif spec.name == "position_ids":
            feeds[spec.name] = np.arange(past, past + length)[None].repeat(batch, 0)
        else:
            heads, head_dim = spec.shape[1], spec.shape[3]
            dtype = np.float16 if spec.type == "tensor(float16)" else np.float32
            feeds[spec.name] = rng.standard_normal((batch, heads, past, head_dim)).astype(dtype)
    return session.run(None, feeds)


def _session(path) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _nodes(folder, graph: str) -> Counter:
    """Each node as (op, module it lies in): equal counters mean the same nodes in the same layers."""
    model = onnx.load(str(folder / graph), load_external_data=False)
    return Counter((node.domain, node.op_type, module_of(node)) for node in model.graph.node)


def _io(folder, graph: str) -> tuple[list, list]:
    model = onnx.load(str(folder / graph), load_external_data=False)
    return [v.name for v in model.graph.input], [v.name for v in model.graph.output]


def _assert_grown_equals_traced(model, source, tmp_path, monkeypatch) -> None:
    counts = _traced_layers(monkeypatch)
    grown = pipeline.export_artifact(model, tmp_path / "grown", source=source).folder
    assert counts == [TRACED_LAYERS, TRACED_LAYERS]  # the template path was taken, for both graphs
    traced = pipeline.export_artifact(model, tmp_path / "traced", source=source, trace_all_layers=True).folder
    assert counts[2:] == [LAYERS, LAYERS]
    for graph in ("prefill.onnx", "decode.onnx"):
        assert _io(grown, graph) == _io(traced, graph)
        nodes = _nodes(grown, graph)
        assert nodes == _nodes(traced, graph)
        assert any(module and module.startswith(f"model.layers.{LAYERS - 1}.") for _, _, module in nodes)
        past = 3 if graph == "decode.onnx" else 0
        for a, b in zip(_run(_session(grown / graph), past), _run(_session(traced / graph), past), strict=True):
            np.testing.assert_array_equal(a, b)


def test_grown_hf_graph_equals_every_layer_traced(tmp_path, monkeypatch):
    # qwen3: q/k norms, a tied head; every weight drawn, norms included, so that a layer reading another's
    # weights gives other outputs
    folder = save_folder(hf_model("qwen3", num_hidden_layers=LAYERS), "qwen3", tmp_path / "folder")
    sourced = checkpoint_model(folder)
    _assert_grown_equals_traced(sourced.model, sourced.source, tmp_path, monkeypatch)


def test_grown_moe_float16_decode_graph_equals_every_layer_traced():
    # sparse MoE: data-dependent sizes (tokens per expert) that each grown layer must have as its own; float16:
    # the optimiser splits Casts off the norms without scopes, placed in their layer by their neighbours
    config = dataclasses.replace(get_preset("minimind2-moe-tiny"), num_hidden_layers=LAYERS)
    model = build_model(config, seed=3)
    with torch.no_grad():  # norms drawn too: seeded MiniMind norms are all one, alike in every layer
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5)
    model = pipeline._copy_for_export(model, torch.float16)
    share_tied_table(model)
    template = LayerTemplate.for_model(model)
    grown = template.expand(pipeline._trace(template.short_model, "float16", with_loss=False, past=True))
    assert grown is not None
    traced = pipeline._trace(model, "float16", with_loss=False, past=True)
    outputs = []
    for graph in (grown, traced):
        proto = ir.serde.serialize_model(graph)
        assert sum(value.name.startswith("present.") for value in proto.graph.output) == 2 * LAYERS
        session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        outputs.append(_run(session, past=3))
    for a, b in zip(*outputs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_layers_that_differ_beyond_their_weights_are_all_traced():
    config = dataclasses.replace(get_preset("minimind-3-tiny"), num_hidden_layers=LAYERS)
    model = build_model(config)
    assert LayerTemplate.for_model(model) is not None
    model.model.layers[LAYERS - 1].input_layernorm.eps = 1e-2  # a layer no three-layer trace would see
    assert LayerTemplate.for_model(model) is None


def test_a_traced_graph_whose_layers_differ_is_not_grown(caplog):
    config = dataclasses.replace(get_preset("minimind-3-tiny"), num_hidden_layers=LAYERS)
    model = pipeline._copy_for_export(build_model(config), torch.float32)
    share_tied_table(model)
    template = LayerTemplate.for_model(model)
    graph = pipeline._trace(template.short_model, "float32", with_loss=False, past=False)
    [node] = [n for n in graph.graph if n.op_type == "Softmax" and "layers.2." in n.metadata_props["namespace"]]
    node.attributes["axis"] = ir.AttrInt64("axis", 0)  # layer 2's softmax now differs from layer 1's
    with caplog.at_level("INFO"):
        assert template.expand(graph) is None
    assert "do not repeat" in caplog.text
