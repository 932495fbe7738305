"""Folders other exporters wrote, verified against transformers: onnxruntime-genai's builder (float32, int4, the
int4 also on a text) and Optimum (float32, in its own environment, see helpers.optimum_python), a damaged graph, and
the bad inputs.

One tiny Qwen3 folder with the default rope (the builder cannot read the yarn parameters transformers 5 writes) and
the tiny tokenizer (which each writer copies), exported once per writer for the module."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import build_tokenizer
from helpers import assert_one_line_error, edit_json, optimum_python, run_cli
from hf_folders import hf_model, save_folder
from onnx import numpy_helper
from tokenizers import Tokenizer

from exporter.verify.checks.invariants import FLOAT_MATMUL_NOTE
from exporter.verify.foreign import verify_foreign
from exporter.verify.inputs import ParitySettings, QualityText
from exporter.verify.reports.html import render_html
from exporter.verify.reports.junit import render_junit
from exporter.verify.reports.text import format_verify

QUICK = ParitySettings(decode_steps=4, greedy_tokens=8, sweep=False)
QUICK_CLI = ("--provider", "cpu", "--decode-steps", "4", "--no-sweep")
# words of the tiny tokenizer's corpus (tests/conftest.py build_tokenizer)
TEXT = "kalo mine ruto savi depo gufe lomi neru tosa vide pogu feka " * 12


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    model = hf_model("qwen3", rope_scaling=None, max_position_embeddings=2048)
    folder = save_folder(model, "qwen3", tmp_path_factory.mktemp("foreign") / "qwen3")
    build_tokenizer(model.config.vocab_size).save(str(folder / "tokenizer.json"))
    return folder


def _builder(source: Path, precision: str, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"builder-{precision}")
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(source), "-i", str(source)]
    command += ["-o", str(out), "-p", precision, "-e", "cpu", "-c", str(out / "cache")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    shutil.rmtree(out / "cache", ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def builder_fp32(qwen3, tmp_path_factory) -> Path:
    return _builder(qwen3, "fp32", tmp_path_factory)


@pytest.fixture(scope="module")
def builder_int4(qwen3, tmp_path_factory) -> Path:
    return _builder(qwen3, "int4", tmp_path_factory)


@pytest.fixture(scope="module")
def optimum_fp32(qwen3, tmp_path_factory) -> Path:
    cli = optimum_python().parent / "optimum-cli"
    out = tmp_path_factory.mktemp("optimum")
    command = [str(cli), "export", "onnx", "--model", str(qwen3), "--task", "text-generation-with-past", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_builder_fp32_passes_every_check_it_can_run(builder_fp32, qwen3):
    report = verify_foreign(builder_fp32, qwen3, ["cpu"], ParitySettings(decode_steps=4, greedy_tokens=8))
    assert report.passed, report.to_dict()
    (provider,) = report.reports
    assert provider.profile.name.startswith("float32") and provider.greedy.match_length == 8
    assert provider.sweep and all(case.passed for case in provider.sweep)
    assert [i.name for i in report.invariants] == ["prefill(all) == prefill(first k) + decode(rest)"]
    # the builder's attention takes rows as right-padded: said, never counted as passed
    assert report.settings["left_padding"] == 0 and "left-padded rows" in report.not_checked
    assert {"loss", "weight audit"} <= set(report.not_checked)
    # the graph leaves the head dimension symbolic: its genai_config.json's head_size stands for it
    assert report.writer["writer"] == "onnxruntime-genai model builder" and report.writer["head_dim"] == 32


def test_builder_int4_is_judged_by_the_quality_profile(builder_int4, qwen3):
    report = verify_foreign(builder_int4, qwen3, ["cpu"], QUICK)
    assert report.passed and not report.reports
    (quality,) = report.quality
    assert quality.scheme == "int4" and quality.profile.name.startswith("int4")
    kl = next(c for c in quality.checks if c.threshold.metric == "kl_mean")
    assert 0 < kl.value <= kl.threshold.limit  # quantized: a distance, within the profile's limit
    # the builder's int4 for the CPU is at accuracy level 4: the invariants run MatMulNBits in float32
    assert report.invariants and all(FLOAT_MATMUL_NOTE in i.detail for i in report.invariants), report.invariants
    # no loss output: ΔNLL comes from the logits, each side's log-probability of the token that follows
    nll = next(c for c in quality.checks if c.threshold.metric == "nll_delta")
    assert nll.judged and nll.interval[0] <= nll.value <= nll.interval[1] and nll.passed, nll
    # the random model is nearly uniform: its decisive top-1 is not judged, and no report calls it passed
    top1 = next(c for c in quality.checks if c.threshold.metric == "top1_agreement_decisive")
    assert not top1.judged and top1.to_dict()["passed"] is None
    (row,) = [line for line in format_verify(report).splitlines() if line.lstrip().startswith("top1_agreement_d")]
    assert "not judged" in row and " pass " not in row
    assert re.search(r'name="top1_agreement_decisive"[^>]*>\s*<skipped', render_junit(report))
    html = render_html(report)
    assert "quality profile int4" in html and html.count("not judged") >= 2  # verdict cell and its reason


def test_builder_int4_is_judged_on_a_text_tokenized_with_its_own_tokenizer(builder_int4, qwen3, tmp_path):
    text, report = tmp_path / "text.txt", tmp_path / "report.json"
    text.write_text(TEXT, encoding="utf-8")
    result = run_cli(
        "verify", builder_int4, "--reference", qwen3, "--quality-text", text, *QUICK_CLI, "--report-json", report
    )
    assert result.exit_code == 0, result.output
    [quality] = json.loads(report.read_text())["quality"]
    ids = Tokenizer.from_file(str(builder_int4 / "tokenizer.json")).encode(TEXT).ids
    window = 12 + 4 + 3  # the prompt, the decode steps, the final chunk
    windows = -(-len(ids) // window)
    # read whole with the folder's tokenizer, every row unpadded (the builder's attention takes rows right-padded)
    assert quality["input"] == {
        "kind": "text",
        "source": str(text),
        "tokens": len(ids),
        "windows": windows,
        "window_length": window,
        "positions": windows * window,
    }
    assert quality["verdict"] == "pass" and quality["scheme"] == "int4"
    checks = {c["metric"]: c for c in quality["checks"]}
    for metric in ("kl_mean", "kl_p99", "nll_delta"):  # each judged by its interval, which holds its value
        low, high = checks[metric]["interval"]
        assert checks[metric]["verdict"] == "pass" and low <= checks[metric]["value"] <= high, checks[metric]
    low, high = quality["intervals"]["perplexity_ratio"]
    assert low <= quality["metrics"]["perplexity_ratio"] <= high
    assert f"input: text {text}, {len(ids)} tokens read whole" in result.stdout


def test_a_builder_int4_with_a_scaled_head_fails_on_a_text(builder_int4, qwen3, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(builder_int4, damaged)
    model = onnx.load(str(damaged / "model.onnx"))
    scales = next(t for t in model.graph.initializer if t.name == "lm_head.MatMul.weight_scales")
    array = numpy_helper.to_array(scales)
    scales.CopyFrom(numpy_helper.from_array((array * np.float32(1.5)).astype(array.dtype), scales.name))
    onnx.save(model, str(damaged / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    ids = Tokenizer.from_file(str(damaged / "tokenizer.json")).encode(TEXT).ids
    report = verify_foreign(damaged, qwen3, ["cpu"], QUICK, quality_text=QualityText("text", np.asarray(ids)))
    (quality,) = report.quality
    assert not report.passed and quality.verdict == "fail" and quality.windows == -(-len(ids) // 19)
    # logits 1.5 times sharper: the text's perplexity rises well beyond 10%, its whole interval past the limit
    nll = next(c for c in quality.checks if c.threshold.metric == "nll_delta")
    assert nll.verdict == "fail" and nll.interval[0] > nll.threshold.limit, nll


def test_bad_quality_texts_of_a_foreign_folder_are_one_line_and_exit_2(builder_int4, builder_fp32, qwen3, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")

    def verify(folder, path=text):
        return run_cli("verify", folder, "--reference", qwen3, "--quality-text", path, *QUICK_CLI)

    assert_one_line_error(
        verify(builder_fp32), 2, "is float32, judged by parity with its reference on seeded random ids: drop"
    )
    short = tmp_path / "short.txt"
    short.write_text("kalo mine", encoding="utf-8")
    assert_one_line_error(verify(builder_int4, short), 2, "tokens, fewer than the 19 each of the 2 windows reads")
    untokenized = tmp_path / "untokenized"
    shutil.copytree(builder_int4, untokenized)
    (untokenized / "tokenizer.json").unlink()
    assert_one_line_error(
        verify(untokenized),
        2,
        f"--quality-text is tokenized with the folder's own tokenizer.json, and {untokenized} has none "
        "(onnxruntime-genai model builder copies the one of the Hugging Face folder it exports)",
    )
    larger = tmp_path / "larger"
    shutil.copytree(builder_int4, larger)
    build_tokenizer(512).save(str(larger / "tokenizer.json"))  # ids past the graph's 256 logits
    assert_one_line_error(verify(larger), 2, "but the model's vocab_size is 256")


def test_optimum_fp32_verifies_through_the_cli(optimum_fp32, qwen3, tmp_path):
    junit = tmp_path / "report.xml"
    result = run_cli(
        "verify",
        optimum_fp32,
        "--reference",
        qwen3,
        "--decode-steps",
        "4",
        "--no-sweep",
        "--junit",
        junit,
        "--json",
        "-q",
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["passed"] and document["foreign"]["writer"] == "Optimum"
    assert document["foreign"]["position_ids"] and document["foreign"]["left_padding"]
    assert [i["name"] for i in document["invariants"]][1] == "padded row == same sequence alone"
    assert "loss" in document["not_checked"] and 'name="loss"' in junit.read_text()


def test_a_damaged_foreign_graph_fails(builder_fp32, qwen3, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(builder_fp32, damaged)
    model = onnx.load(str(damaged / "model.onnx"))
    weight = next(t for t in model.graph.initializer if "layers.1" in t.name and "o_proj" in t.name)
    array = numpy_helper.to_array(weight)
    weight.CopyFrom(numpy_helper.from_array((array * np.float32(1.05)).astype(array.dtype), weight.name))
    onnx.save(model, str(damaged / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    result = run_cli("verify", damaged, "--reference", qwen3, "--decode-steps", "2", "--no-sweep", "-q")
    assert result.exit_code == 1, result.output
    assert "prefill logits" in result.stdout and "overall: FAIL" in result.stdout


def test_inspect_names_the_writer_and_the_contract(builder_fp32):
    result = run_cli("inspect", builder_fp32)
    assert result.exit_code == 0, result.output
    assert "writer: onnxruntime-genai model builder" in result.stdout
    assert "positions derived from the mask; right padding only" in result.stdout


def _files(folder: Path) -> list:
    return sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir())


def test_bad_inputs_are_one_line_and_exit_2(builder_fp32, qwen3, tmp_path):
    before = _files(builder_fp32)
    assert_one_line_error(run_cli("verify", builder_fp32), 2, "pass --reference HF_FOLDER")
    no_graph = tmp_path / "no-graph"
    no_graph.mkdir()
    shutil.copy(qwen3 / "config.json", no_graph)
    assert_one_line_error(run_cli("verify", no_graph, "--reference", qwen3), 2, "holds no graph model.onnx")
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    shutil.copy(qwen3 / "config.json", unknown)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    onnx.save(onnx.helper.make_model(graph), str(unknown / "model.onnx"))
    assert_one_line_error(
        run_cli("verify", unknown, "--reference", qwen3), 2, "follows no contract this toolkit reads: expected inputs"
    )
    other = tmp_path / "other-config"
    other.mkdir()
    shutil.copy(qwen3 / "config.json", other)
    edit_json(other / "config.json", num_hidden_layers=3, layer_types=None)
    assert_one_line_error(
        run_cli("verify", builder_fp32, "--reference", other),
        2,
        f"the reference folder {other} does not match {builder_fp32}: its config.json gives num_hidden_layers 3 where "
        "the folder has 2; pass the Hugging Face folder the graph was exported from (--reference)",
    )
    # a size the graph leaves symbolic, which a reference of another model would feed it: the reference is named
    edit_json(other / "config.json", num_hidden_layers=2, head_dim=16)
    assert_one_line_error(
        run_cli("verify", builder_fp32, "--reference", other),
        2,
        "its config.json gives head_dim 16 where the folder has 32",
    )
    assert_one_line_error(
        run_cli("verify", builder_fp32, "--reference", qwen3, "--transformers-js"),
        2,
        "--transformers-js cannot serve a folder onnxruntime-genai model builder wrote",
    )
    assert _files(builder_fp32) == before  # nothing written into the folder
