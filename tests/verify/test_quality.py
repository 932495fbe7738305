"""A quantized artifact is judged by its quality profile against the float32 reference, not by parity."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import onnx
import pytest
from helpers import edit_manifest
from onnx import helper, numpy_helper

from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import file_entries
from exporter.errors import InputError
from exporter.runtime.protocol import RuntimeLabel
from exporter.runtime.runner import OrtRunner
from exporter.runtime.settings import SessionSettings
from exporter.tolerances.parity import profile_for
from exporter.tolerances.quality import (
    QUALITY_CONFIDENCE,
    QUALITY_RESAMPLES,
    QualityProfile,
    QualityThreshold,
    quality_profile_for,
)
from exporter.verify import engine
from exporter.verify.checks.invariants import FLOAT_MATMUL_NOTE
from exporter.verify.checks.quality import TEXT_BATCH, QualityCheck, QualityReport, check_quality, kl_by_position
from exporter.verify.engine import verify_artifact
from exporter.verify.inputs import (
    FINAL_CHUNK,
    ParitySettings,
    QualityText,
    prefill_feeds,
    prompt_batch,
    text_windows,
    window_length,
)
from exporter.verify.metrics import bootstrap_interval, compare_outputs, token_statistics
from exporter.verify.references.torch_runner import TorchRunner
from exporter.verify.reports import format_verify, json_text, render_html
from exporter.verify.reports.text import format_quality
from exporter.verify.results import VerifyReport

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
    report = verify_artifact(quantized["int4"], tiny_model, ["cpu"], SETTINGS, genai=False, transformers_js=False)
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


def test_int4_with_float16_activations_passes_its_quality_profile(quantized_float16, tiny_model):
    report = verify_artifact(quantized_float16, tiny_model, ["cpu"], SETTINGS, genai=False, transformers_js=False)
    assert report.passed, format_verify(report)
    assert report.weights.passed and all(i.passed for i in report.invariants)
    for name in (*NUMERIC_INVARIANTS, "padded row == same sequence alone"):  # level 4: judged unprepacked
        [invariant] = [i for i in report.invariants if i.name == name]
        assert FLOAT_MATMUL_NOTE in invariant.detail, invariant.detail
    # measured on the tiny random model: mean KL 0.0184, p99 0.040; with float32 activations (level 4) 0.0182, 0.038
    metrics = report.quality[0].metrics
    assert metrics["kl_mean"] < 0.05 and metrics["kl_p99"] < 0.2, metrics


def test_a_doubled_scale_fails(quantized, tiny_model, tmp_path):
    folder = shutil.copytree(quantized["int4"], tmp_path / "broken")
    name = _double_a_scale(folder)
    report = verify_artifact(
        folder, tiny_model, ["cpu"], ParitySettings(decode_steps=8, sweep=False), genai=False, transformers_js=False
    )
    assert not report.passed
    assert not report.weights.passed and name in report.weights.findings[0].detail
    assert not report.quality[0].passed  # the distributions moved too: decisive top-1 and |Δ log p|


NUMERIC_INVARIANTS = ("prefill(all) == prefill(first k) + decode(rest)", "decode(past 0) == prefill")


def _decode_logits_scaled(folder, factor: float) -> None:
    """decode.onnx alone multiplies its logits by `factor`; the manifest re-signed."""
    path = folder / "decode.onnx"
    model = onnx.load(str(path), load_external_data=False)
    [node] = [n for n in model.graph.node if "logits" in n.output]
    node.output[list(node.output).index("logits")] = "unscaled_logits"
    model.graph.node.append(helper.make_node("Mul", ["unscaled_logits", "logits_factor"], ["logits"]))
    model.graph.initializer.append(numpy_helper.from_array(np.array(factor, np.float32), "logits_factor"))
    onnx.save(model, str(path))
    edit_manifest(folder, lambda data: data["files"].update(file_entries(folder, ["decode.onnx"])))


def _invariants(folder) -> dict:
    report = verify_artifact(folder, None, ["cpu"], ParitySettings(sweep=False), genai=False, transformers_js=False)
    return {i.name: i for i in report.invariants}


def test_a_level_4_export_passes_its_invariants_with_both_graphs_unprepacked(quantized):
    folder = quantized["int4-level4"]
    invariants = _invariants(folder)
    assert all(i.passed for i in invariants.values()), [i.detail for i in invariants.values()]
    for name in (*NUMERIC_INVARIANTS, "padded row == same sequence alone"):
        assert FLOAT_MATMUL_NOTE in invariants[name].detail, invariants[name].detail
    assert "MatMulNBits" not in _invariants(quantized["int4"])["decode(past 0) == prefill"].detail  # level 0
    # one graph prepacked (int8 activations at level 4, as the runner and every consumer run it) against the same
    # graph unprepacked (float32): they differ by the activation quantization, far beyond float32's rounding, which
    # is why the invariants compare graphs in one layout
    artifact = Artifact.open(folder)
    settings = ParitySettings()
    batch = prompt_batch(artifact.manifest, settings, np.random.default_rng(settings.seed))
    feeds = prefill_feeds(artifact.manifest, batch)
    int8 = OrtRunner(artifact).prefill(feeds)
    float32 = OrtRunner(artifact, settings=SessionSettings(prepack_weights=False)).prefill(feeds)
    logits = compare_outputs("prefill", int8, float32, profile_for("float32"), batch["attention_mask"])[0]
    assert not logits.passed and logits.needed.scale > 100, logits


def test_a_decode_fault_fails_the_invariants_at_level_4(quantized, tmp_path):
    folder = shutil.copytree(quantized["int4-level4"], tmp_path / "int4-level4")
    _decode_logits_scaled(folder, 1.001)
    invariants = _invariants(folder)
    for name in NUMERIC_INVARIANTS:
        [logits] = [c for c in invariants[name].comparisons if c.name.endswith("logits")]
        # 1e-3 of the logits' peak: 33x float32's bound, yet within the ~1000x a bound covering the int8
        # activations of one graph against float32 in the other would need
        assert not invariants[name].passed and 10 < logits.needed.scale < 100, invariants[name].detail
    assert invariants["padded row == same sequence alone"].passed  # prefill.onnx alone, unchanged


def test_kl_by_position_against_closed_forms():
    # two-token distributions: KL(p || q) = sum p log(p / q), worked out from the probabilities themselves
    uniform, skewed = np.log([1.0, 1.0]), np.log([3.0, 1.0])  # softmax: (1/2, 1/2) and (3/4, 1/4)
    kl_uniform_skewed = 0.5 * np.log(0.5 / 0.75) + 0.5 * np.log(0.5 / 0.25)  # = ln(4/3) / 2
    kl_skewed_uniform = 0.75 * np.log(0.75 / 0.5) + 0.25 * np.log(0.25 / 0.5)  # the other direction
    nan = np.full(2, np.nan)  # a padded position's logits: arbitrary, never read
    # prefill (B=2, L=3), left-padded: column 0 is padding in both rows, column 1 in row 0
    expected = np.array([[nan, nan, uniform], [nan, uniform, uniform]])
    actual = np.array([[nan, nan, uniform + 5.0], [nan, skewed, skewed]])  # a shifted row is the same distribution
    valid = np.array([[False, False, True], [False, True, True]])
    # decode (B=2, L=2): the reference (expected) is the first distribution of KL(reference || artifact)
    expected_step = np.array([[skewed, uniform], [skewed, skewed]])
    actual_step = np.array([[uniform, skewed], [uniform, uniform]])
    step_valid = np.ones((2, 2), bool)
    # the per-token KLs as check_quality computes them: token_statistics of each call's real positions, in order
    kl = token_statistics(
        np.concatenate([actual[valid], actual_step[step_valid]]),
        np.concatenate([expected[valid], expected_step[step_valid]]),
    )["kl"]
    series = kl_by_position(kl, [valid, step_valid])
    assert series[0] is None and len(series) == 5
    want = [kl_uniform_skewed, kl_uniform_skewed / 2, kl_skewed_uniform, (kl_uniform_skewed + kl_skewed_uniform) / 2]
    np.testing.assert_allclose(series[1:], want, rtol=1e-12)
    assert abs(kl_uniform_skewed - kl_skewed_uniform) > 0.01  # the direction is tested, not only the size
    with pytest.raises(ValueError, match="kl holds 7 tokens, the valid masks 8"):
        kl_by_position(kl, [valid, np.ones((2, 2), bool), np.ones((1, 1), bool)])


class _Recording:
    """A runner whose prefill and decode calls check_quality makes are recorded: (attention mask, logits)."""

    def __init__(self, runner):
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "calls", [])

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def __setattr__(self, name, value):  # the greedy run sets the cache of the runner itself
        setattr(self._runner, name, value)

    def prefill(self, feeds):
        out = self._runner.prefill(feeds)
        self.calls.append((feeds["attention_mask"], out["logits"]))
        return out

    def decode(self, feeds):
        out = self._runner.decode(feeds)
        self.calls.append((feeds["attention_mask"], out["logits"]))
        return out


def _kl_by_column(mask, actual, expected):
    """Mean KL(reference || artifact) of each column over the rows real there, independently of the code."""

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(expected.astype(np.float64)), softmax(actual.astype(np.float64))
    kl = np.where(p > 0, p * np.log(np.where(p > 0, p, 1) / q), 0.0).sum(-1)  # (B, L)
    real = mask[:, mask.shape[1] - kl.shape[1] :] == 1
    return list(np.ma.masked_array(kl, ~real).mean(axis=0).filled(np.nan))


def test_kl_by_position_is_reported_and_plotted(quantized, tiny_model, monkeypatch):
    recorded = {}

    def recording_check(reference, onnx_runner, *args):
        recorded["reference"], recorded["onnx"] = _Recording(reference), _Recording(onnx_runner)
        return check_quality(recorded["reference"], recorded["onnx"], *args)

    check_quality = engine.check_quality
    monkeypatch.setattr(engine, "check_quality", recording_check)
    report = verify_artifact(
        quantized["int4"],
        tiny_model,
        ["cpu"],
        ParitySettings(decode_steps=4, sweep=False),
        genai=False,
        transformers_js=False,
    )
    (quality,) = report.quality
    prompt, steps = report.settings["prompt_length"], report.settings["decode_steps"]
    series = quality.kl_by_position
    assert quality.prefill_positions == prompt and len(series) == prompt + steps + FINAL_CHUNK

    ref_calls, ort_calls = recorded["reference"].calls, recorded["onnx"].calls
    assert len(ref_calls) == len(ort_calls) == 1 + steps + 1  # the prefill, the single steps, the final chunk
    want = [
        v for (mask, actual), (_, expected) in zip(ort_calls, ref_calls) for v in _kl_by_column(mask, actual, expected)
    ]
    assert len(want) == len(series) and all(v is not None for v in series)  # row 1 is never padded
    np.testing.assert_allclose(series, want, rtol=1e-6, atol=1e-12)
    assert max(series) > 0 and quality.metrics["kl_max"] >= max(series)

    document = json.loads(json_text(report.to_dict()))["quality"][0]["kl_by_position"]
    assert len(document["prefill"]) == prompt and len(document["decode"]) == steps + FINAL_CHUNK
    np.testing.assert_allclose(document["prefill"] + document["decode"], want, rtol=5e-4)

    page = render_html(report)
    (svg,) = re.findall(r'<svg class="plot kl-by-position".*?</svg>', page, re.S)
    points = re.findall(r'<circle class="point" cx="([\d.]+)" cy="([\d.]+)"[^>]*><title>(\w+) (\d+): ', svg)
    assert [int(x) for *_, x in points] == list(range(len(series)))  # one point per position, in order
    assert {kind for _, _, kind, x in points if int(x) < prompt} == {"prefill"}
    assert {kind for _, _, kind, x in points if int(x) >= prompt} == {"decode"}
    heights = [float(cy) for _, cy, _, _ in points]  # SVG y grows downwards: the largest KL is drawn highest
    assert heights.index(min(heights)) == int(np.argmax(series))
    limit = next(c.threshold.limit for c in quality.checks if c.threshold.metric == "kl_mean")
    assert f"mean KL limit: {limit:.4g}" in svg and 'class="rule"' in svg
    assert ">position</text>" in svg and ">KL (nats)</text>" in svg

    worst = int(np.argmax(series))
    line = f"KL by position: max {max(series):.4g} nats at position {worst}"
    assert line in format_verify(report) and line in page


def test_quality_text_refusals_of_the_api(quantized, tiny_model, tmp_path):
    folder, settings = quantized["int4"], ParitySettings(decode_steps=4, sweep=False)
    text = tmp_path / "text.txt"
    text.write_text("kalo mine ruto " * 20, encoding="utf-8")
    with pytest.raises(InputError, match="no model is given; pass the model"):
        verify_artifact(folder, None, ["cpu"], settings, genai=False, transformers_js=False, quality_text=text)
    with pytest.raises(InputError, match=r"`quality_text` ids gives 18 tokens, fewer than the 19 each of the 2"):
        verify_artifact(folder, tiny_model, ["cpu"], settings, quality_text=QualityText("ids", np.arange(18)))
    with pytest.raises(InputError, match="quality_text is a text file's path or a QualityText, got list"):
        verify_artifact(folder, tiny_model, ["cpu"], settings, quality_text=[1, 2, 3])


def test_text_windows_spread_over_the_text():
    rows = text_windows(list(range(100)), 3, 10)
    assert rows[:, 0].tolist() == [0, 45, 90] and rows[2].tolist() == list(range(90, 100))
    with pytest.raises(InputError, match="fewer than the 10"):
        text_windows([1, 2, 3], 2, 10)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_loss_change_is_judged_either_way(scheme):
    # a drop in the loss beyond the scheme's noise is a different model, not a better one: judged as a rise is
    (nll,) = [t for t in quality_profile_for(scheme).thresholds if t.metric == "nll_delta"]
    assert nll.holds(nll.limit * 0.9) and nll.holds(-nll.limit * 0.9)
    assert not nll.holds(nll.limit * 1.1) and not nll.holds(-nll.limit * 1.1)
    assert not QualityCheck(nll, -0.21).passed


def test_a_metric_not_judged_neither_passes_nor_fails():
    threshold = quality_profile_for("int4").thresholds[0]
    unjudged = QualityCheck(threshold, None, "not judged: too few decisive positions")
    assert unjudged.passed is None and unjudged.to_dict()["passed"] is None
    failing = QualityCheck(threshold, threshold.limit * 2)
    assert failing.passed is False


def test_the_bootstrap_is_seeded_and_its_interval_narrows_as_positions_grow():
    kl = np.random.default_rng(3).exponential(0.05, 10_000)  # per-position KLs: skewed, as real ones are

    def width(n: int) -> float:
        low, high = bootstrap_interval(kl[:n], lambda r: r.mean(axis=-1), QUALITY_RESAMPLES, QUALITY_CONFIDENCE)
        assert low < kl[:n].mean() < high
        return high - low

    # the width of a mean's interval falls as 1 / sqrt(positions): 100x the positions, a tenth of the width
    assert 7 < width(100) / width(10_000) < 14
    once = bootstrap_interval(kl[:155], lambda r: np.percentile(r, 99, axis=-1), 1000, 0.95)
    assert bootstrap_interval(kl[:155], lambda r: np.percentile(r, 99, axis=-1), 1000, 0.95) == once
    assert bootstrap_interval(kl[:155], lambda r: np.percentile(r, 99, axis=-1), 1000, 0.95, seed=1) != once


def test_a_window_bootstrap_spreads_as_the_windows_differ():
    """Positions that share a window's difficulty vary together: resampling whole windows gives the spread of the
    mean between texts (the windows' own spread / sqrt(windows)), which resampling positions understates."""
    rng = np.random.default_rng(4)
    windows, length = 20, 80
    difficulty = rng.exponential(0.1, windows)  # each window's own level
    kl = (difficulty[:, None] + rng.exponential(0.01, (windows, length))).reshape(-1)
    rows = np.repeat(np.arange(windows), length)

    def width(interval) -> float:
        return interval[1] - interval[0]

    by_positions = bootstrap_interval(kl, lambda r: r.mean(axis=-1), QUALITY_RESAMPLES, QUALITY_CONFIDENCE)
    by_windows = bootstrap_interval(kl, lambda r: r.mean(axis=-1), QUALITY_RESAMPLES, QUALITY_CONFIDENCE, clusters=rows)
    assert by_windows[0] < kl.mean() < by_windows[1]
    expected = 2 * 1.96 * kl.reshape(windows, length).mean(axis=1).std() / np.sqrt(windows)
    assert 0.75 < width(by_windows) / expected < 1.25
    assert width(by_windows) > 3 * width(by_positions)
    again = bootstrap_interval(kl, lambda r: np.percentile(r, 99, axis=-1), 200, 0.95, clusters=rows)
    assert again == bootstrap_interval(kl, lambda r: np.percentile(r, 99, axis=-1), 200, 0.95, clusters=rows)


@pytest.mark.parametrize(
    ("bound", "limit", "interval", "verdict"),
    [
        ("at most", 0.15, (0.10, 0.14), "pass"),
        ("at most", 0.15, (0.12, 0.18), "undecided"),
        ("at most", 0.15, (0.16, 0.20), "fail"),
        ("at least", 0.85, (0.80, 0.90), "undecided"),
        ("at least", 0.85, (0.86, 0.90), "pass"),
        ("within +-", 0.10, (-0.05, 0.08), "pass"),
        ("within +-", 0.10, (-0.12, 0.00), "undecided"),
        ("within +-", 0.10, (0.11, 0.20), "fail"),
        ("within +-", 0.10, (-0.30, -0.11), "fail"),
    ],
)
def test_a_figure_whose_interval_straddles_its_limit_is_undecided_and_not_passed(bound, limit, interval, verdict):
    threshold = QualityThreshold("kl_mean", limit, bound, "a limit")
    value = sum(interval) / 2  # passes by its value alone wherever the limit lies beyond the interval's middle
    check = QualityCheck(threshold, value, interval=interval)
    assert check.verdict == verdict and check.passed is (verdict == "pass")
    report = QualityReport(
        provider="cpu",
        runtime=RuntimeLabel("onnxruntime", "CPUExecutionProvider"),
        scheme="int4",
        profile=QualityProfile("p", (threshold,), "why"),
        checks=(check,),
        metrics={"positions": 155},
        greedy_reference=[],
        greedy_onnx=[],
    )
    assert report.verdict == verdict and report.passed is (verdict == "pass")
    assert VerifyReport(folder="f", reports=[], quality=[report]).verdict == verdict
    # the multiple rests on the interval's end the verdict rests on: within 1 exactly where it passed
    assert (check.multiple <= 1) is (verdict == "pass") and report.worst_multiple == check.multiple
    assert report.to_dict()["worst_multiple"] == report.to_dict()["checks"][0]["multiple"] == check.multiple


@pytest.mark.parametrize(
    "bound, limit, value, multiple",
    [
        ("at most", 0.15, 0.30, 2.0),  # twice the KL allowed
        ("within +-", 0.10, -0.05, 0.5),  # a loss change either way, half of it
        ("at least", 0.85, 0.70, 2.0),  # 30% of positions disagree where 15% may
        ("at least", 0.25, 1.0, 0.0),  # full agreement: no error
    ],
)
def test_a_quality_checks_multiple_is_its_error_over_what_its_limit_allows(bound, limit, value, multiple):
    check = QualityCheck(QualityThreshold("m", limit, bound, "a limit"), value)
    assert check.multiple == pytest.approx(multiple)
    # nothing to scale where the check was not judged, or was excused (a near-tie)
    assert QualityCheck(check.threshold, None, "not judged").multiple is None
    assert QualityCheck(check.threshold, value, "a near-tie", excused=True).multiple is None


def test_quality_text_is_read_whole_and_every_figure_has_its_interval(quantized, tiny_model):
    artifact = Artifact.open(quantized["int4"])
    manifest, settings = artifact.manifest, ParitySettings(decode_steps=4, sweep=False).fit(64)
    length = window_length(settings)
    ids = np.random.default_rng(5).integers(0, manifest.config.vocab_size, 20 * length + 7)
    onnx, reference = OrtRunner(artifact), TorchRunner(tiny_model, manifest)
    batch = prompt_batch(manifest, settings, np.random.default_rng(0))

    def quality(text):
        profile = quality_profile_for("int4")
        return check_quality(reference, onnx, manifest, batch, settings, profile, np.random.default_rng(1), text)

    whole = quality(QualityText("text", ids))
    assert whole.windows == 21 and whole.window_length == length  # 20 windows and 7 ids: a 21st covers those
    assert whole.resampled == "windows"  # at least MIN_BOOTSTRAP_WINDOWS of them
    starts = text_windows(np.arange(len(ids)), whole.windows, length)[:, 0]
    assert starts[0] == 0 and starts[-1] + length == len(ids) and (np.diff(starts) <= length).all()
    # every id of every window is a position, but the left padding of each batch's first row
    batches = -(-whole.windows // TEXT_BATCH)
    assert whole.metrics["positions"] == whole.windows * length - batches * settings.left_padding
    assert whole.metrics["nll_positions"] == whole.metrics["positions"] - whole.windows  # no next id after the last
    for check in whole.checks:
        if check.threshold.metric != "greedy_agreement" and check.judged:
            low, high = check.interval
            assert low <= check.value <= high, check
    low, high = whole.intervals["perplexity_ratio"]
    assert low <= whole.metrics["perplexity_ratio"] <= high
    # two windows of the same text: a wider interval on fewer positions
    part = quality(QualityText("text", ids[: 2 * length]))
    assert part.windows == 2 and part.metrics["positions"] < whole.metrics["positions"] / 8
    assert part.resampled == "positions"  # too few windows to resample

    def width(report):
        return report.intervals["kl_mean"][1] - report.intervals["kl_mean"][0]

    assert width(part) > 2 * width(whole)
    document = whole.to_dict()
    assert document["input"] == {
        "kind": "text",
        "source": "text",
        "tokens": len(ids),
        "windows": 21,
        "window_length": length,
        "positions": whole.metrics["positions"],
    }
    assert document["checks"][0]["interval"] == list(whole.intervals["kl_mean"]) and document["confidence"] == 0.95
    shown = format_quality(whole)
    assert f"text text, {len(ids)} tokens read whole (21 rows of {length} ids" in shown
    assert "intervals resample the windows" in shown and document["resampled"] == "windows"
    low, high = whole.intervals["kl_mean"]
    assert "95% interval" in shown and f"[{low:.4g}, {high:.4g}]" in shown
