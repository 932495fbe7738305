"""An int8 export at accuracy level 4 smooths its projections' inputs (SmoothQuant): each reads Div(x, divisors) and
holds its weight's columns times them; the weight audit derives those blocks bit for bit, ONNX Runtime computes the
model the reference computes, and an outlier channel no longer costs its block of inputs their int8 precision."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import TINY_SOURCE
from helpers import edit_initializers, edit_manifest, quantized_blocks, replayed_export, shared_folder

from exporter.artifact.folder import Artifact
from exporter.artifact.quantization import QUANTIZED_OP, QuantizationSettings, smoothing_divisors
from exporter.artifact.scopes import module_of
from exporter.errors import InputError
from exporter.export.pipeline import export_artifact
from exporter.export.quantize import quantizable_modules
from exporter.export.smoothing import Calibration, input_maxima, measured_divisors
from exporter.verify.checks.weights.audit import audit_weights
from exporter.verify.metrics import token_statistics

MODULE = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="session")
def smoothed(tmp_path_factory, tiny_model, artifact_fp32, tiny_tokenizer):
    """The tiny model at int8 with the defaults (accuracy level 4: smoothed, measured on the built-in text)."""

    def build(root):
        with pytest.MonkeyPatch.context() as monkeypatch:
            replayed_export(monkeypatch, artifact_fp32)
            export_artifact(tiny_model, root / "int8", dtype="int8", source=TINY_SOURCE, tokenizer=tiny_tokenizer)

    return shared_folder(tmp_path_factory, "quantized-smoothed", build) / "int8"


def _graph(folder):
    return onnx.load(str(folder / "prefill.onnx"), load_external_data=False).graph


def _divisors_of(model) -> list[str]:
    """The initializer of divisors the quantized node of MODULE reads its input through, in `model`."""
    [node] = [n for n in model.graph.node if n.op_type == QUANTIZED_OP and module_of(n) == MODULE]
    return [smoothing_divisors(model.graph)[node.name]]


def test_every_projection_reads_its_input_divided_and_the_audit_holds_its_blocks(smoothed, tiny_model):
    smoothing = Artifact.open(smoothed).manifest.quantization.smoothing
    assert smoothing.alpha == 0.5 and "of the built-in calibration text" in smoothing.calibration
    graph = _graph(smoothed)
    nodes = {module_of(n): n for n in graph.node if n.op_type == QUANTIZED_OP}
    divisors = smoothing_divisors(graph)
    # every projection, not the lm_head (its blocks are the tied embedding's, stored once for both)
    assert {module_of(n) for n in graph.node if n.name in divisors} == set(
        quantizable_modules(tiny_model, tiny_model.config.vocab_size)
    )
    assert nodes["lm_head"].name not in divisors
    audit = audit_weights(Artifact.open(smoothed), tiny_model)
    assert audit.passed, [f.describe() for f in audit.findings]
    assert all(g.quantized == len(nodes) + 1 and g.carried == g.parameters for g in audit.graphs)  # + embedding


def test_int8_at_level_0_and_int4_are_not_smoothed(quantized):
    for name in ("int8", "int4-level4"):  # int8 at level 0; int4 at level 4
        assert Artifact.open(quantized[name]).manifest.quantization.smoothing is None
        graph = _graph(quantized[name])
        assert not smoothing_divisors(graph) and not [n for n in graph.node if n.name.endswith("_smooth")]


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_the_divisors_balance_each_channel_between_input_and_weight(tiny_model, alpha):
    # s = max|x|^alpha / max|W|^(1 - alpha): alpha 1 leaves every input channel the same maximum; alpha 0.5 gives
    # each channel's input and weight maxima the same ratio
    rows = np.random.default_rng(1).integers(0, tiny_model.config.vocab_size, (3, 40))
    modules = ["model.layers.0.self_attn.q_proj", MODULE]
    divisors = measured_divisors(tiny_model, modules, Calibration(rows, "test ids"), alpha)
    maxima = input_maxima(tiny_model, modules, rows)
    for module in modules:
        inputs = maxima[module] / divisors[module]
        weights = tiny_model.get_submodule(module).weight.detach().abs().double().amax(0).numpy() * divisors[module]
        balanced = inputs if alpha == 1.0 else inputs / weights
        assert np.ptp(balanced) < 1e-9 * balanced.mean(), (module, balanced)
        assert np.ptp(divisors[module]) > 0.1  # the channels differ, so the divisors do


def test_a_changed_divisor_or_no_recorded_smoothing_fails_the_audit(smoothed, tiny_model, tmp_path):
    folder = shutil.copytree(smoothed, tmp_path / "divisor")

    def scaled(values):
        values[3] *= np.float32(1.05)
        return values

    edit_initializers(folder, lambda model: {_divisors_of(model)[0]: scaled})
    findings = audit_weights(Artifact.open(folder), tiny_model).findings
    assert len(findings) == 2 and all(MODULE in f.detail and f.problem == "differs" for f in findings), findings

    folder = shutil.copytree(smoothed, tmp_path / "negative")
    edit_initializers(folder, lambda model: {_divisors_of(model)[0]: lambda values: -values})
    findings = audit_weights(Artifact.open(folder), tiny_model).findings
    expected = f"{MODULE}.weight: the smoothing divisors {MODULE}.input_divisors of"
    assert len(findings) == 2 and all(expected in f.detail for f in findings), findings
    assert "hold no 256 positive finite divisors, one per input channel" in findings[0].detail

    folder = shutil.copytree(smoothed, tmp_path / "unrecorded")
    edit_manifest(folder, lambda manifest: manifest["quantization"].pop("smoothing"))
    findings = audit_weights(Artifact.open(folder), tiny_model).findings
    projections = len(smoothing_divisors(_graph(smoothed)))
    expected = "reads its input divided by smoothing divisors, but the manifest records no smoothing of it"
    assert len(findings) == 2 * projections and all(expected in f.detail for f in findings), findings[0].detail


def test_the_blocks_without_their_divisors_fail_the_audit(smoothed, tiny_model, tmp_path):
    # the blocks of the smoothed weight read as the parameter's own: the held divisors set to 1
    folder = shutil.copytree(smoothed, tmp_path / "ones")
    edit_initializers(folder, lambda model: {_divisors_of(model)[0]: np.ones_like})
    findings = audit_weights(Artifact.open(folder), tiny_model).findings
    assert len(findings) == 2 and all(MODULE in f.detail for f in findings), findings
    assert (
        quantized_blocks(onnx.load(str(folder / "prefill.onnx"), load_external_data=False), MODULE)[-1]
        == (_divisors_of(onnx.load(str(folder / "prefill.onnx"), load_external_data=False))[0])
    )


def test_a_smoothed_artifact_is_faithful_to_its_weights(smoothed, tiny_model):
    from exporter import verify_artifact
    from exporter.verify.inputs import ParitySettings

    settings = ParitySettings(decode_steps=8, sweep=False)
    report = verify_artifact(smoothed, tiny_model, ["cpu"], settings, genai=False, transformers_js=False)
    assert report.faithfulness is not None and report.faithfulness.passed, report.faithfulness
    assert report.weights.passed


def _prefill_kl(folder, model, ids) -> float:
    """Mean KL(float model || artifact) of the prefill's next-token distributions over `ids` (B, T)."""
    session = ort.InferenceSession(str(folder / "prefill.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    feeds["position_ids"] = np.repeat(feeds["position_ids"], len(ids), 0)
    names = {i.name for i in session.get_inputs()}
    logits = session.run(["logits"], {k: v for k, v in feeds.items() if k in names})[0]
    with torch.no_grad():
        expected = model(torch.from_numpy(ids), attention_mask=torch.ones_like(torch.from_numpy(ids))).logits
    vocab = logits.shape[-1]
    return float(token_statistics(logits.reshape(-1, vocab), expected.float().numpy().reshape(-1, vocab))["kl"].mean())


def test_smoothing_recovers_what_an_outlier_channel_costs_at_level_4(tiny_model, tmp_path):
    # The same function with one input channel of the first layer's q/k/v 64x larger, their weights' column 64x
    # smaller: at level 4 the channel's block of 32 inputs is rounded to int8 by its outlier, unless smoothed.
    model = copy.deepcopy(tiny_model).eval()
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.input_layernorm.weight[5] *= 64
        for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            projection.weight[:, 5] /= 64
    kl = {}
    for smoothing in (None, "none"):
        folder = tmp_path / str(smoothing)
        settings = QuantizationSettings(smoothing=smoothing)
        export_artifact(model, folder, dtype="int8", with_loss=False, quantization=settings)
        ids = np.random.default_rng(2).integers(0, model.config.vocab_size, (4, 48))
        kl[smoothing] = _prefill_kl(folder, model, ids)
    assert kl[None] < kl["none"] / 3, kl


def test_calibration_for_an_export_that_smooths_nothing_is_refused(tiny_model, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("some text " * 100)
    with pytest.raises(InputError, match=r"`calibration` is what an int8 export smoothing"):
        export_artifact(tiny_model, tmp_path / "out", dtype="int4", calibration=text)
    with pytest.raises(InputError, match=r"`calibration_text` is tokenized with the export's tokenizer, and none"):
        export_artifact(tiny_model, tmp_path / "out", dtype="int8", calibration=text)
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.txt"]


def test_float16_activations_divide_in_float16_and_the_audit_holds_the_blocks(
    tiny_model, artifact_fp16, tmp_path, monkeypatch
):
    replayed_export(monkeypatch, artifact_fp16)
    folder = tmp_path / "int8-float16"
    settings = QuantizationSettings(activations="float16")
    export_artifact(tiny_model, folder, dtype="int8", source=TINY_SOURCE, quantization=settings)
    graph = _graph(folder)
    initializers = {t.name: t for t in graph.initializer}
    divisors = smoothing_divisors(graph)
    assert len(divisors) == 14 and {initializers[name].data_type for name in divisors.values()} == {
        onnx.TensorProto.FLOAT16
    }
    audit = audit_weights(Artifact.open(folder), tiny_model)
    assert audit.passed, [f.describe() for f in audit.findings]


@pytest.mark.parametrize(
    ("rows", "fragment"),
    [
        (np.zeros((2, 3, 4), np.int64), r"must be a non-empty \(windows, length\) array of token ids"),
        (np.full((2, 8), 512), r"holds token id 512, beyond the vocabulary of 512"),
    ],
)
def test_calibration_ids_the_model_cannot_read_are_refused(tiny_model, tmp_path, rows, fragment):
    with pytest.raises(InputError, match=fragment):
        export_artifact(tiny_model, tmp_path / "out", dtype="int8", calibration=Calibration(rows, "test"))
    assert not any(tmp_path.iterdir())
