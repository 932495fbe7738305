"""A quantized artifact is judged by its quality profile against the float32 reference, not by parity."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from exporter.artifact.manifest import file_entries
from exporter.errors import InputError
from exporter.verify.engine import verify_artifact
from exporter.verify.inputs import ParitySettings, text_windows
from exporter.verify.reports import format_verify

SETTINGS = ParitySettings(decode_steps=32, sweep=False)


def _double_a_scale(folder):
    """Multiply one external scale tensor of a MatMulNBits node by 2 and re-sign the manifest; returns the node."""
    graph = onnx.load(str(folder / "prefill.onnx"), load_external_data=False).graph
    initializers = {t.name: t for t in graph.initializer}
    node = next(
        n
        for n in graph.node
        if n.op_type == "MatMulNBits" and initializers[n.input[2]].data_location == onnx.TensorProto.EXTERNAL
    )
    info = {e.key: e.value for e in initializers[node.input[2]].external_data}
    offset, length = int(info["offset"]), int(info["length"])
    data = np.fromfile(folder / "weights.onnx.data", dtype=np.uint8)
    data[offset : offset + length] = (data[offset : offset + length].view(np.float32) * 2).view(np.uint8)
    data.tofile(folder / "weights.onnx.data")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"].update(file_entries(folder, ["weights.onnx.data"]))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return node.name


def test_int4_passes_its_quality_profile(quantized, tiny_model):
    report = verify_artifact(quantized["int4"], tiny_model, ["cpu"], SETTINGS, genai=False)
    assert report.passed, format_verify(report)
    assert not report.reports and len(report.quality) == 1  # no parity rows: they cannot pass by design
    quality = report.quality[0]
    metrics = quality.metrics
    # measured on the tiny random model: mean KL ~0.018, p99 ~0.05; ΔNLL ~-0.02 (random labels)
    assert metrics["kl_mean"] < 0.05 and metrics["kl_p99"] < 0.2
    assert report.weights.passed and all(i.passed for i in report.invariants)
    text = format_verify(report)
    assert "int4 quality" in text and "kl_mean" in text
    assert report.to_dict()["quality"][0]["checks"][0]["metric"] == "kl_mean"


def test_a_doubled_scale_fails(quantized, tiny_model, tmp_path):
    folder = shutil.copytree(quantized["int4"], tmp_path / "broken")
    name = _double_a_scale(folder)
    report = verify_artifact(folder, tiny_model, ["cpu"], ParitySettings(decode_steps=8, sweep=False), genai=False)
    assert not report.passed
    assert not report.weights.passed and name in report.weights.findings[0].detail
    assert not report.quality[0].passed  # the distributions moved too: decisive top-1 and |Δ log p|


def test_text_windows_spread_over_the_text():
    rows = text_windows(list(range(100)), 3, 10)
    assert rows[:, 0].tolist() == [0, 45, 90] and rows[2].tolist() == list(range(90, 100))
    with pytest.raises(InputError, match="fewer than the 10"):
        text_windows([1, 2, 3], 2, 10)
