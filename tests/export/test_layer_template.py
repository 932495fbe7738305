"""Deep models traced three layers deep and grown to their depth (exporter/export/layer_template.py).

The grown graph is held to the graph torch.onnx gives when it traces every layer (the same nodes in the same
modules, the same inputs and outputs, outputs equal bit for bit on ONNX Runtime), or to the eager model. Where
the layers do not repeat, or a bring-your-own adapter does not declare them uniform, every layer is traced. Whole
exports through the grown graphs: the session's 7-layer model (four clones; its mutants in tests/mutants.py) and the
trained fixture (four layers), verified in tests/verify/test_trained_fixture.py.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import torch
from helpers import QUICK
from hf_folders import hf_model, save_folder

from exporter import verify_artifact
from exporter.artifact.scopes import SCOPES_KEY, module_of
from exporter.export import tracing
from exporter.export.graphs import share_tied_table
from exporter.export.layer_template import TRACED_LAYERS, LayerTemplate
from exporter.verify.reports import format_verify
from reference import build_model, get_preset
from reference.byo import DecoderAdapter
from reference.configs import DecoderSpec
from reference.source import checkpoint_model

LAYERS = TRACED_LAYERS + 1  # one layer grown: a clone reading layer 2, read by the final norm


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


def _session(graph: ir.Model) -> onnxruntime.InferenceSession:
    proto = ir.serde.serialize_model(graph)
    return onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _nodes(graph: ir.Model) -> Counter:
    """Each node as (op, module it lies in): equal counters mean the same nodes in the same layers."""
    proto = ir.serde.serialize_model(graph)
    return Counter((node.domain, node.op_type, module_of(node)) for node in proto.graph.node)


def _grown(model, dtype: str, with_loss: bool) -> ir.Model:
    template = LayerTemplate.for_model(model)
    grown = template.expand(tracing.trace(template.short_model, dtype, with_loss))
    assert grown is not None  # the traced layers repeat
    return grown


def test_grown_hf_float16_graph_equals_every_layer_traced(tmp_path):
    """qwen3 (q/k norms, a tied head, every weight drawn so that a layer reading another's weights shows) in
    float16, where the optimiser splits Casts off the norms without scopes: placed in their layer by their
    neighbours. The traced program with its loss, on an empty past."""
    folder = save_folder(hf_model("qwen3", num_hidden_layers=LAYERS), "qwen3", tmp_path / "folder")
    model = tracing.copy_for_export(checkpoint_model(folder).model, torch.float16)
    share_tied_table(model)
    grown = _grown(model, "float16", with_loss=True)
    traced = tracing.trace(model, "float16", with_loss=True)
    assert [v.name for v in grown.graph.inputs] == [v.name for v in traced.graph.inputs]
    assert [v.name for v in grown.graph.outputs] == [v.name for v in traced.graph.outputs]
    nodes = _nodes(grown)
    assert nodes == _nodes(traced)
    assert any(module and module.startswith(f"model.layers.{LAYERS - 1}.") for _, _, module in nodes)
    for a, b in zip(_run(_session(grown), 0), _run(_session(traced), 0), strict=True):
        np.testing.assert_array_equal(a, b)


def test_grown_moe_decode_graph_computes_the_model():
    """Sparse MoE: sizes that depend on values (tokens per expert), which each grown layer must have as its own.
    The grown decode graph against the eager model, on a past the model computed itself."""
    config = dataclasses.replace(get_preset("minimind2-moe-tiny"), num_hidden_layers=LAYERS)
    model = build_model(config, seed=3)
    with torch.no_grad():  # norms drawn too: seeded MiniMind norms are all one, alike in every layer
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5)
    exported = tracing.copy_for_export(model, torch.float32)
    share_tied_table(exported)
    session = _session(_grown(exported, "float32", with_loss=False))
    ids = torch.tensor([[5, 9, 100, 3, 17, 40], [7, 7, 8, 9, 250, 11]])
    with torch.no_grad():
        prompt = model(ids[:, :3], use_cache=True)
        step = model(ids[:, 3:], past_key_values=prompt.past_key_values, use_cache=True)
    feeds = {
        "input_ids": ids[:, 3:].numpy(),
        "attention_mask": np.ones((2, 6), np.int64),
        "position_ids": np.arange(3, 6)[None].repeat(2, 0),
    }
    for layer, (key, value) in enumerate(prompt.past_key_values):  # the reference's (B, L, Hkv, D), as (B, Hkv, L, D)
        feeds[f"past_key_values.{layer}.key"] = key.transpose(1, 2).numpy()
        feeds[f"past_key_values.{layer}.value"] = value.transpose(1, 2).numpy()
    logits, *presents = session.run(None, feeds)
    # float32 sums over a 64-wide tiny model: differences of a few ulps of logits of order 1
    np.testing.assert_allclose(logits, step.logits.numpy(), atol=1e-4, rtol=0)
    for layer, (key, value) in enumerate(step.past_key_values):
        np.testing.assert_allclose(presents[2 * layer], key.transpose(1, 2).numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(presents[2 * layer + 1], value.transpose(1, 2).numpy(), atol=1e-4, rtol=0)


def test_layers_that_differ_beyond_their_weights_are_all_traced():
    config = dataclasses.replace(get_preset("minimind-3-tiny"), num_hidden_layers=LAYERS)
    model = build_model(config)
    assert LayerTemplate.for_model(model) is not None
    model.model.layers[LAYERS - 1].input_layernorm.eps = 1e-2  # a layer no three-layer trace would see
    assert LayerTemplate.for_model(model) is None


def test_a_traced_graph_whose_layers_differ_is_not_grown(caplog):
    config = dataclasses.replace(get_preset("minimind-3-tiny"), num_hidden_layers=LAYERS)
    model = tracing.copy_for_export(build_model(config), torch.float32)
    share_tied_table(model)
    template = LayerTemplate.for_model(model)
    graph = tracing.trace(template.short_model, "float32", with_loss=False)
    [node] = [n for n in graph.graph if n.op_type == "Softmax" and "layers.2." in n.metadata_props[SCOPES_KEY]]
    node.attributes["axis"] = ir.AttrInt64("axis", 0)  # layer 2's softmax now differs from layer 1's
    with caplog.at_level("INFO"):
        assert template.expand(graph) is None
    assert "do not repeat" in caplog.text


class _WindowedAbove2(DecoderAdapter):
    """A bring-your-own decoder whose forward would give layers >= 3 a sliding window, chosen by their index outside
    the layers' modules: nothing in the layers' modules or in three traced layers shows it."""

    def forward(self, *args, **kwargs):  # never traced here: the template is decided before any trace
        raise NotImplementedError


def _adapter(cls):
    config = dataclasses.replace(get_preset("minimind-3-tiny"), num_hidden_layers=LAYERS + 3)
    inner = build_model(config).model  # laid out as .layers, each layer alike
    spec = DecoderSpec(
        name="windowed",
        num_hidden_layers=config.num_hidden_layers,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
    )
    return cls(inner, spec)


def test_a_bring_your_own_adapter_is_traced_whole_unless_it_declares_uniform_layers(caplog):
    with caplog.at_level("INFO"):
        assert LayerTemplate.for_model(_adapter(_WindowedAbove2)) is None
    assert "does not declare uniform_layers" in caplog.text

    class Declared(_WindowedAbove2):
        uniform_layers = True  # its author's contract: every layer called alike

    assert LayerTemplate.for_model(_adapter(Declared)) is not None


def test_a_seven_layer_export_grows_four_clones_and_passes_verify(deep_artifact, deep_model):
    """The session's 7-layer export (tests/conftest.py) went through the template: layers 3-6 are clones of layer 2,
    each in its own layer's modules, and the artifact passes verify."""
    graph = onnx.load(str(deep_artifact / "prefill.onnx"), load_external_data=False).graph
    clones = {layer for node in graph.node for layer in range(TRACED_LAYERS, 7) if f"_layer{layer}" in node.name}
    assert clones == {3, 4, 5, 6}
    modules = {module_of(node) or "" for node in graph.node}
    assert {f"model.layers.{layer}.self_attn.k_proj" for layer in range(7)} <= modules
    report = verify_artifact(deep_artifact, deep_model, ["cpu"], QUICK, genai=False, transformers_js=False)
    assert report.passed, format_verify(report)
