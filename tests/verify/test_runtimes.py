"""Runtimes beside ONNX Runtime in the verification: OpenVINO's two rows on the float32 artifact, and a runtime of the
test's own whose logits are off, failing where nothing explains it and attributed where its configuration does; a
runner lacking the debug graphs is not checked there, with the reason."""

from __future__ import annotations

import dataclasses
from xml.etree import ElementTree as ET

from helpers import QUICK

from exporter.artifact.folder import Artifact
from exporter.runtime import openvino_runner, registry
from exporter.runtime.protocol import Runner, RuntimeLabel
from exporter.runtime.runner import OrtRunner
from exporter.runtime.settings import checking_settings
from exporter.runtime.steps import NumpySteps
from exporter.verify.engine import verify_artifact
from exporter.verify.reports import format_verify, render_html, render_junit


def test_openvino_at_f32_passes_float32_and_its_default_row_names_its_precision(artifact_fp32, tiny_model, monkeypatch):
    # as on a CPU with bf16 units, where OpenVINO computes float32 graphs in bf16 unless told f32
    monkeypatch.setattr(openvino_runner, "compiled_precision", lambda compiled: "bf16")
    report = verify_artifact(
        artifact_fp32, tiny_model, settings=QUICK, genai=False, transformers_js=False, runtimes=["openvino"]
    )
    text = format_verify(report)
    assert report.passed, text
    f32, default = report.reports
    assert (f32.provider, default.provider) == ("openvino f32", "openvino default")
    assert f32.runtime.name.startswith("openvino ") and "INFERENCE_PRECISION_HINT=f32" in f32.runtime.configuration
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE=0" in f32.runtime.configuration and not f32.runtime.known_cause
    assert max(c.needed.scale for c in f32.comparisons) < 0.5  # the CPU profile, with headroom
    assert default.runtime.known_cause == "OpenVINO's default inference precision bf16"
    assert "known cause of differences: OpenVINO's default inference precision bf16" in text
    assert report.to_dict()["providers"][1]["runtime"]["known_cause"] == default.runtime.known_cause
    assert report.invariants and all(i.passed for i in report.invariants)  # in ONNX Runtime, as ever
    for check in ("activation scan (openvino f32)", "probe (openvino default)"):
        assert "needs debug graphs" in report.not_checked[check] and "openvino" in report.not_checked[check]


class Scaled(NumpySteps):
    """ONNX Runtime's CPU answers with every logit scaled by 1.001 ("off", "by-design") or as they are ("honest"):
    a runtime that computes the logits wrongly, with or without a known cause. It lacks every capability."""

    def __init__(self, artifact, target: str, weights=None):
        self._ort = OrtRunner(artifact, "cpu", settings=checking_settings(artifact.manifest), weights=weights)
        self.artifact, self.manifest = artifact, artifact.manifest
        self.provider = f"scaled {target}"
        self.capabilities = frozenset()
        self.cache = None
        self._factor = 1.0 if target == "honest" else 1.001
        cause = "logits scaled by 1.001" if target == "by-design" else ""
        self.runtime = RuntimeLabel("scaled 1.0", target, known_cause=cause)

    def prefill(self, feeds: dict) -> dict:
        return self._scaled(self._ort.prefill(feeds))

    def decode(self, feeds: dict) -> dict:
        return self._scaled(self._ort.decode(feeds))

    def empty_past(self, batch: int) -> dict:
        return self._ort.empty_past(batch)

    def _scaled(self, outputs: dict) -> dict:
        return {**outputs, "logits": outputs["logits"] * self._factor}


def test_a_runtime_whose_logits_are_off_fails_unless_its_configuration_explains_it(
    artifact_fp32, tiny_model, monkeypatch
):
    targets = ["honest", "off", "by-design"]
    scaled = registry.Runtime(
        "scaled", "pip install scaled", lambda: "1.0", lambda manifest, providers: (targets, {}), Scaled
    )
    monkeypatch.setitem(registry._RUNTIMES, "scaled", scaled)
    report = verify_artifact(
        artifact_fp32, tiny_model, settings=QUICK, genai=False, transformers_js=False, runtimes=["scaled"]
    )
    text = format_verify(report)
    honest, off, by_design = report.reports
    assert honest.passed and not off.passed and not off.attributed and by_design.attributed, text
    # the worst multiple of a tolerance over each row's compared outputs: within 1 where the row passed, above it
    # where the scaled logits failed it; the JSON carries it per row
    assert honest.worst_multiple <= 1 < off.worst_multiple and by_design.worst_multiple > 1
    providers = report.to_dict()["providers"]
    assert [p["worst_multiple"] for p in providers] == [r.worst_multiple for r in report.reports]
    assert not report.passed
    assert f"scaled off (float32, profile float32/CPU): FAIL (worst check at {off.worst_multiple:.3g}x" in text
    assert f"scaled honest (float32, profile float32/CPU): PASS (worst check at {honest.worst_multiple:.3g}x" in text
    assert "scaled by-design (float32, profile float32/CPU): DIFFERS, known cause: logits scaled by 1.001" in text
    assert "DIFFERS, known cause" in render_html(report)
    suites = {suite.get("name"): suite for suite in ET.fromstring(render_junit(report)).iter("testsuite")}
    assert int(suites["scaled off float32"].get("failures")) > 0
    attributed = suites["scaled by-design float32"]
    assert attributed.get("failures") == "0" and "known cause" in attributed.find("testcase/skipped").get("message")
    assert attributed.find("properties/property").get("value") == "scaled 1.0, by-design"
    # the runners without the capability are not checked there, with the reason
    assert "needs debug graphs" in report.not_checked["activation scan (scaled off)"]
    # without the row nothing explains, the attributed one leaves the verdict to the honest one
    cross = [c for c in report.cross if "scaled off" not in c.name]
    assert dataclasses.replace(report, reports=[honest, by_design], cross=cross).passed
    assert isinstance(Scaled(Artifact.open(artifact_fp32), "honest"), Runner)


def test_the_registrys_runners_take_the_thread_count_asked_for(artifact_fp32):
    runtimes, artifact = registry.registered_runtimes(), Artifact.open(artifact_fp32)
    for threads in (None, 1):
        ort = runtimes["onnxruntime"].runner(artifact, "CPUExecutionProvider", threads=threads)
        assert ort.decode_session.get_session_options().intra_op_num_threads == (threads or 0)  # 0: one per core
    openvino = runtimes["openvino"].runner(artifact, "default", threads=1)
    compiled = openvino._graphs[artifact.manifest.decode.file].model
    assert int(compiled.get_property("INFERENCE_NUM_THREADS")) == 1
    assert openvino.runtime.configuration.endswith(", INFERENCE_NUM_THREADS=1")
    assert "defaults: inference precision" in openvino.runtime.configuration  # still OpenVINO's defaults otherwise
