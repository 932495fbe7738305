"""ONNX Runtime against the PyTorch reference: logits, present KV, loss, greedy tokens, at many shapes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_decode_graph_matches

from exporter import TOLERANCES, ParitySettings, compare, verify_artifact
from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import read_manifest
from exporter.runtime.providers import CUDA, cuda_unusable
from exporter.runtime.runner import OrtRunner, position_ids_from_mask
from exporter.verify.references.torch_runner import TorchRunner
from exporter.verify.reports import format_verify
from reference import build_model

requires_cuda = pytest.mark.skipif(cuda_unusable() is not None, reason=f"{CUDA}: {cuda_unusable()}")


def _assert_report_passes(report):
    failures = [c.to_dict() for r in report.reports for c in r.comparisons if not c.passed]
    greedy = [r.greedy.note for r in report.reports if not r.greedy.passed]
    assert report.passed, f"failed comparisons: {failures}; greedy: {greedy}"


# The default run (64 steps, sweep) is covered by test_verify_engine; these keep to 16 steps.
FAST = ParitySettings(decode_steps=16, sweep=False)


def test_fp32_artifact_matches_reference_on_cpu(artifact_fp32, tiny_model):
    report = verify_artifact(artifact_fp32, tiny_model, ["cpu"], settings=FAST)
    _assert_report_passes(report)
    [cpu] = report.reports
    names = [c.name for c in cpu.comparisons]
    assert names == [
        "prefill logits",
        "prefill present (all layers)",
        "prefill loss",
        "decode logits (17 steps)",
        "decode present (17 steps, all layers)",
    ]
    assert cpu.greedy.reference_ids == cpu.greedy.onnx_ids and len(cpu.greedy.onnx_ids) == 32


def test_fp16_artifact_matches_float16_reference_on_cpu(artifact_fp16, tiny_model):
    _assert_report_passes(verify_artifact(artifact_fp16, tiny_model, ["cpu"], settings=FAST))


@requires_cuda
@pytest.mark.parametrize("artifact", ["artifact_fp32", "artifact_fp16"])
def test_artifacts_match_reference_on_cuda(artifact, tiny_model, request):
    _assert_report_passes(verify_artifact(request.getfixturevalue(artifact), tiny_model, ["cuda"], settings=FAST))


@requires_cuda
def test_int4_with_float16_activations_passes_its_quality_profile_on_cuda(quantized_float16, tiny_model):
    report = verify_artifact(quantized_float16, tiny_model, ["cuda"], settings=FAST, genai=False, transformers_js=False)
    assert report.passed, format_verify(report)
    assert [q.provider for q in report.quality] == [CUDA]


def test_default_providers_report_unavailable_ones_as_skipped(artifact_fp32, tiny_model):
    report = verify_artifact(artifact_fp32, tiny_model, settings=FAST)
    verified = {r.provider for r in report.reports}
    assert "CPUExecutionProvider" in verified
    assert (CUDA in verified) != (CUDA in report.skipped)


def test_a_different_model_fails_parity(artifact_fp32, tiny_config):
    """The check can fail: the same architecture with other weights must not pass."""
    report = verify_artifact(artifact_fp32, build_model(tiny_config, seed=1), ["cpu"], settings=FAST)
    assert not report.passed
    assert report.reports[0].localisation.first_layer == 0  # other weights everywhere: the first layer already
    assert all(i.passed for i in report.invariants)  # the graphs themselves are sound
    assert not any(c.passed for c in report.reports[0].comparisons if "logits" in c.name)
    # the loss too: the loss row must compare ONNX Runtime's loss with the reference's, not pass on its own
    [loss] = [c for c in report.reports[0].comparisons if c.name == "prefill loss"]
    assert not loss.passed and loss.llm["loss_abs_diff"] > 1e-3, loss.to_dict()


# Shapes other than the export example (batch 2, sequence 3, past 4), including the edge cases
# a traced export tends to specialise: batch 1, sequence 1, past 0.
SHAPES = [(1, 1, 0), (1, 1, 1), (3, 1, 17), (2, 7, 0), (3, 2, 5), (1, 64, 1)]


@pytest.mark.parametrize("batch,length,past", SHAPES)
def test_decode_graph_matches_reference_at_other_sizes(artifact_fp32, tiny_model, batch, length, past):
    # The past is built by a prefill of the reference, so it is a real cache (ragged when batch > 1).
    assert_decode_graph_matches(artifact_fp32, tiny_model, batch, length, past)


@pytest.mark.parametrize("batch,length", [(1, 1), (3, 2), (2, 33)])
def test_prefill_graph_matches_reference_including_one_token_loss(artifact_fp32, tiny_model, batch, length):
    manifest = read_manifest(artifact_fp32, check_hashes=False)
    onnx, reference = OrtRunner(Artifact(artifact_fp32, manifest)), TorchRunner(tiny_model, manifest)
    rng = np.random.default_rng(length)
    ids = rng.integers(0, manifest.config.vocab_size, (batch, length), dtype=np.int64)
    mask = np.ones_like(ids)
    labels = ids.copy()
    labels[0, -1] = -100
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask), "labels": labels}
    expected, actual = reference.prefill(feeds), onnx.prefill(feeds)
    if length == 1:
        assert np.isnan(expected["loss"]) and np.isnan(actual["loss"])  # no target: PyTorch's NaN
    tolerances = TOLERANCES["float32"]
    for name, value in expected.items():
        kind = name if name in ("logits", "loss") else "kv"
        assert compare(name, kind, actual[name], value, tolerances[kind]).passed, name


def test_decode_with_past_zero_equals_prefill(artifact_fp32):
    onnx = OrtRunner(artifact_fp32, check_hashes=False)
    ids = np.array([[5, 9, 100, 3]], dtype=np.int64)
    mask = np.ones_like(ids)
    base = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
    prefill = onnx.prefill({**base, "labels": ids})
    decode = onnx.decode({**base, **onnx.empty_past(1)})
    for name, value in decode.items():
        np.testing.assert_array_equal(value, prefill[name], err_msg=name)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"decode_steps": "2"},
            r"^ParitySettings.decode_steps must be an integer, got '2' \(str\)",
        ),  # not TypeError: '<' not supported
        ({"batch": 2.0}, r"^ParitySettings.batch must be an integer, got 2.0 \(float\)"),
        ({"seed": -1}, r"^ParitySettings.seed must be an integer >= 0, got -1"),  # not numpy's ValueError mid-run
        ({"sweep": "no"}, r"^ParitySettings.sweep must be True or False, got 'no' \(str\)"),  # not "no" read as true
    ],
)
def test_parity_settings_of_the_wrong_type_are_refused_naming_the_field(kwargs, message):
    from exporter.errors import InputError

    with pytest.raises(InputError, match=message):
        ParitySettings(**kwargs)
