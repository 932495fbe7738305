"""The runtime registry: what --runtime selects and refuses in one line, and what OpenVINO's rows say of its
configuration (its default precision, the accuracy_level it ignores)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import assert_one_line_error, run_cli

from exporter.artifact.folder import Artifact
from exporter.artifact.quantization import Quantization
from exporter.errors import InputError
from exporter.runtime import openvino_runner, registry
from exporter.runtime.protocol import Runner
from exporter.runtime.registry import ALL, register_runtime, registered_runtimes, select_runtimes


@pytest.fixture
def openvino_missing(monkeypatch):
    """The registry as where openvino is not installed."""
    runtime = registered_runtimes()["openvino"]
    monkeypatch.setitem(registry._RUNTIMES, "openvino", dataclasses.replace(runtime, version=lambda: None))


def test_onnxruntime_alone_by_default_and_first_among_all():
    assert [r.name for r in select_runtimes(None)[0]] == ["onnxruntime"]
    chosen, skipped = select_runtimes(["openvino", ALL])
    assert [r.name for r in chosen][:2] == ["onnxruntime", "openvino"] and not skipped


def test_an_unknown_runtime_is_refused_in_one_line_naming_the_choices():
    with pytest.raises(InputError) as caught:
        select_runtimes(["tensorrt"])
    message = str(caught.value)
    assert message.startswith("unknown runtime 'tensorrt'; choose from onnxruntime, ") and "\n" not in message
    choices = message.partition("choose from ")[2].removesuffix(" (`runtimes`)").split(", ")
    assert sorted(choices) == sorted([*registered_runtimes(), ALL]) and choices[-1] == ALL


def test_a_runtime_not_installed_is_refused_by_name_and_skipped_by_all(openvino_missing):
    with pytest.raises(InputError, match="runtime openvino is not installed here: pip install openvino"):
        select_runtimes("openvino")
    chosen, skipped = select_runtimes([ALL])
    assert "openvino" not in [r.name for r in chosen] and chosen[0].name == "onnxruntime"
    assert skipped["openvino"] == "not installed (pip install openvino)"


def test_providers_need_onnxruntime_among_the_runtimes():
    with pytest.raises(InputError, match="add onnxruntime to them"):
        select_runtimes(["openvino"], ["cpu"])


def test_a_runtime_is_registered_once():
    with pytest.raises(InputError, match="registered already"):
        register_runtime(registered_runtimes()["openvino"])


def test_the_cli_refuses_an_unknown_or_missing_runtime_in_one_line(artifact_fp32, openvino_missing):
    assert_one_line_error(run_cli("verify", artifact_fp32, "--runtime", "tensorrt"), 2, "unknown runtime 'tensorrt'")
    assert_one_line_error(
        run_cli("verify", artifact_fp32, "--runtime", "openvino"), 2, "not installed here: pip install openvino"
    )


def test_the_cli_refuses_providers_without_onnxruntime(artifact_fp32):
    assert_one_line_error(
        run_cli("verify", artifact_fp32, "--runtime", "openvino", "--provider", "cpu"),
        2,
        "add onnxruntime to them (--runtime), or drop --provider",
    )


def test_the_runners_of_every_runtime_follow_the_protocol(artifact_fp32):
    artifact = Artifact.open(artifact_fp32)
    for runtime in registered_runtimes().values():
        targets, _ = runtime.targets(artifact.manifest, None)
        runner = runtime.runner(artifact, targets[0])
        assert isinstance(runner, Runner), runtime.name
        assert runner.runtime.name.startswith(f"{runtime.name} ")


def test_openvino_names_its_default_precision_and_the_accuracy_level_it_ignores(artifact_fp32):
    float32 = Artifact.open(artifact_fp32).manifest
    assert openvino_runner.default_cause(float32, "f32", 32) == ""  # no activation quantization in a float graph
    assert openvino_runner.default_cause(float32, "bf16", 32) == "OpenVINO's default inference precision bf16"
    assert openvino_runner.accuracy_level_notes(float32) == ()
    level = {level: Quantization("int4", 4, 32, level, "same") for level in (0, 4)}
    int4 = {n: dataclasses.replace(float32, dtype="float32", quantization=q) for n, q in level.items()}
    assert openvino_runner.accuracy_level_notes(int4[0]) == ()
    [note] = openvino_runner.accuracy_level_notes(int4[4])
    assert "ignores this artifact's MatMulNBits accuracy_level 4" in note
    cause = openvino_runner.default_cause(int4[4], "bf16", 32)
    assert cause.startswith("OpenVINO's default inference precision bf16; ") and "groups of 32" in cause
