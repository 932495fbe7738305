"""The float64 referee (exporter/verify/checks/referee.py): a comparison beyond its fixed profile is judged by ONNX
Runtime's error against a float64 run, in multiples of the reference's own error; a correct export passes that way
and a wrong graph stays far outside it."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil

import numpy as np
import pytest
import torch
from helpers import QUICK, edit_graphs
from mutants import causal_mask_leaks_one

from exporter import verify_artifact
from exporter.artifact.folder import open_artifact
from exporter.runtime.runner import presents_as_past
from exporter.tolerances.parity import Tolerance, parse_overrides, profile_for
from exporter.verify import engine
from exporter.verify.checks.referee import REFEREE_LIMIT, referee_ratio
from exporter.verify.references.referee import Float64Referee
from exporter.verify.references.torch_runner import TorchRunner


@pytest.fixture
def nothing_allowed(monkeypatch):
    """Every profile's logits and kv bounds tightened to 0 (as the profile's own, not overridden): every comparison
    fails its fixed profile, so that the referee judges them all."""

    def tightened(dtype, provider="cpu"):
        return dataclasses.replace(profile_for(dtype, provider), logits=Tolerance(0, 0, 0), kv=Tolerance(0, 0, 0))

    monkeypatch.setattr(engine, "profile_for", tightened)


def test_ratio_is_the_onnx_error_over_the_reference_error_in_units_of_each_rows_peak():
    rng = np.random.default_rng(0)
    truth = rng.normal(size=(1, 2, 8))  # two rows (positions) of logits
    truth[0, 1] *= 0.01  # the second of small magnitude
    peak = np.abs(truth).max(-1, keepdims=True)
    noise = rng.choice([-1.0, 1.0], size=truth.shape) * 1e-5 * peak  # well above the floor, u = 6e-8 of the peak
    expected, actual = truth + noise, truth + 3 * noise
    assert referee_ratio(actual, expected, truth, "logits", "float32").ratio == pytest.approx(3.0)
    # the small row off by as much as the large row's error, in absolute terms: ~100x more in its own peak's units
    louder = float(peak[0, 0, 0] / peak[0, 1, 0])
    actual[0, 1] = truth[0, 1] + 3 * noise[0, 1] * louder
    assert louder > 50
    assert referee_ratio(actual, expected, truth, "logits", "float32").ratio == pytest.approx(3 * louder)


def test_ratio_floors_the_reference_error_at_one_rounding_and_leaves_out_padding():
    truth = np.array([[[4.0, 2.0], [1.0, -1.0]]])
    unit = 2.0**-24
    actual = truth + np.array([[[0.0, 8 * unit], [100.0, 0.0]]])  # row 2 is padding: its 100 is never judged
    ratio = referee_ratio(actual, truth, truth, "logits", "float32", valid=np.array([[True, False]]))
    assert ratio.ratio == pytest.approx(2.0)  # 8u of a peak of 4 over the floor u: the reference's own error is 0
    assert ratio.onnx_error == pytest.approx(8 * unit)
    assert not referee_ratio(truth + np.nan, truth, truth, "logits", "float32").passed  # a NaN is no agreement


def test_the_float64_chain_resumes_where_it_stopped_and_restarts_on_another(tiny_model, artifact_fp32):
    manifest = open_artifact(artifact_fp32).manifest
    calls = []

    class Counting(TorchRunner):
        def prefill(self, feeds):
            calls.append("prefill")
            return super().prefill(feeds)

        def decode(self, feeds):
            calls.append("decode")
            return super().decode(feeds)

    counting = Counting(tiny_model, manifest, torch.float64)
    referee = Float64Referee(lambda: contextlib.nullcontext(counting), manifest)
    ids = np.array([[1, 2, 3, 4]])
    prompt = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None]}
    step = {"input_ids": np.array([[5]]), "attention_mask": np.ones((1, 5), np.int64), "position_ids": np.array([[4]])}
    first = referee.truth([("prefill", prompt)])
    second = referee.truth([("prefill", prompt), ("decode", step)])
    assert calls == ["prefill", "decode"]  # the second chain continued the first
    assert second["logits"].dtype == np.float64
    whole = TorchRunner(tiny_model, manifest, torch.float64)
    again = whole.decode({**step, **presents_as_past(manifest, whole.prefill(prompt))})
    np.testing.assert_array_equal(second["logits"], again["logits"])
    referee.truth([("prefill", {**prompt, "input_ids": ids + 1})])
    assert calls == ["prefill", "decode", "prefill"]
    assert first["logits"].shape == (1, 4, manifest.config.vocab_size)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_reference_computes_in_float64_in_place_and_is_restored_exactly(tiny_model, artifact_fp32, dtype):
    manifest = dataclasses.replace(open_artifact(artifact_fp32).manifest, dtype=dtype)
    runner = TorchRunner(tiny_model, manifest)
    before = {name: tensor.clone() for name, tensor in runner.model.state_dict().items()}
    ids = np.array([[1, 2, 3, 4]])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None]}
    with runner.in_float64() as float64:
        inside = float64.prefill(feeds)
        assert all(t.dtype == torch.float64 for t in runner.model.parameters())
    copy = TorchRunner(runner.model, manifest, torch.float64).prefill(feeds)  # a float64 copy of the same weights
    np.testing.assert_array_equal(inside["logits"], copy["logits"])
    after = runner.model.state_dict()
    assert all(after[name].dtype == value.dtype and torch.equal(after[name], value) for name, value in before.items())


@pytest.mark.parametrize("artifact", ["artifact_fp32", "artifact_fp16"])
def test_a_correct_export_beyond_a_tightened_profile_passes_by_the_referee(
    artifact, tiny_model, request, nothing_allowed
):
    report = verify_artifact(
        request.getfixturevalue(artifact), tiny_model, ["cpu"], QUICK, genai=False, transformers_js=False
    )
    rows = report.reports[0].comparisons
    assert all(c.referee is not None for c in rows if c.kind != "loss"), [c.name for c in rows if c.referee is None]
    assert all(c.passed for c in rows), [(c.name, c.referee.describe()) for c in rows if not c.passed]
    assert max(c.referee.ratio for c in rows if c.referee) <= REFEREE_LIMIT / 2  # a clean run leaves half the limit


def test_a_wrong_graph_stays_far_beyond_the_referee(tiny_model, artifact_fp32, tmp_path):
    folder = shutil.copytree(artifact_fp32, tmp_path / "leaky")
    edit_graphs(folder, causal_mask_leaks_one)
    report = verify_artifact(folder, tiny_model, ["cpu"], QUICK, genai=False, transformers_js=False)
    logits = next(c for c in report.reports[0].comparisons if c.name == "prefill logits")
    assert not report.passed and not logits.passed
    assert logits.referee.ratio > 100 * REFEREE_LIMIT, logits.referee.describe()


def test_a_tolerance_override_is_the_verdict_without_a_referee(tiny_model, artifact_fp32):
    # the user's own bound, tighter than any float32 computation meets: no referee overrules it
    overrides = parse_overrides(peak=["logits=0"])
    report = verify_artifact(
        artifact_fp32, tiny_model, ["cpu"], QUICK, genai=False, transformers_js=False, overrides=overrides
    )
    logits = next(c for c in report.reports[0].comparisons if c.name == "prefill logits")
    assert not report.passed and not logits.passed and logits.referee is None
