"""export --dtype int4 and generate on the result, verify --quality-text; quantization refusals and bad quality texts
exit 2 with one line, writing nothing."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
from helpers import assert_one_line_error, replayed_export, run_cli
from tokenizers import Tokenizer

from exporter.errors import ProviderError
from exporter.runtime import providers
from exporter.verify import engine


def test_export_int4_then_generate(monkeypatch, artifact_fp32, tmp_path):
    replayed_export(monkeypatch, artifact_fp32)
    out = tmp_path / "int4"
    flags = ["--dtype", "int4", "--block-size", "16", "--lm-head", "float", "--embedding", "same"]
    result = run_cli("export", "--preset", "minimind-3-tiny", *flags, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    exported = json.loads(result.stdout)
    q = exported["quantization"]
    assert exported["dtype"] == "int4" and (q["block_size"], q["lm_head"], q["embedding"]) == (16, "float", "same")
    # the embedding in 4-bit rows of 16, the tied lm_head a float Gemm on a float copy of the table
    graph = onnx.load(str(out / "decode.onnx"), load_external_data=False).graph
    (lookup,) = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    assert {a.name: a.i for a in lookup.attribute if a.name in ("bits", "block_size")} == {"bits": 4, "block_size": 16}
    assert "Gemm" in {n.op_type for n in graph.node} and q["kept_float"] == ["lm_head (asked: lm_head float)"]
    # no --accuracy-level: int8 math on the CPU (level 4), recorded and written on every MatMulNBits
    levels = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}
    assert q["accuracy_level"] == 4 and levels == {4}
    result = run_cli("export", "--preset", "minimind-3-tiny", *flags, "-o", tmp_path / "text")
    assert "lm_head float, embedding same" in result.stdout, result.output
    result = run_cli("generate", out, "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)[0]["new_ids"]) == 5


@pytest.mark.parametrize(
    ("flags", "code", "fragment"),
    [
        (["--dtype", "int3"], 2, "int3"),
        (["--dtype", "int4", "--block-size", "24"], 2, "not a power of two"),
        (["--dtype", "int4", "--block-size", "128"], 2, "does not divide the model's hidden size"),
        (["--dtype", "int4", "--embedding", "int4"], 2, "'--embedding'"),
        (["--dtype", "int4", "--lm-head", "bf16"], 2, "'--lm-head'"),
        (["--dtype", "int4", "--activations", "bfloat16"], 2, "'--activations'"),
        (
            ["--dtype", "float16", "--activations", "float16"],
            2,
            "computes in float16: drop --activations, or choose --dtype int4 or --dtype int8",
        ),
        (["--dtype", "float32", "--block-size", "24"], 2, "quantizes nothing: drop --block-size, or choose"),
        (["--dtype", "float16", "--accuracy-level", "9"], 2, "quantizes nothing: drop --accuracy-level"),
        (["--lm-head", "float"], 2, "lm_head 'float' applies to int4/int8 exports only"),
    ],
)
def test_bad_quantization_exits_2(tmp_path, flags, code, fragment):
    out = tmp_path / "out"
    result = run_cli("export", "--preset", "minimind-3-tiny", "-o", out, *flags)
    assert_one_line_error(result, code, fragment)
    assert not out.exists() and not any(tmp_path.iterdir())


def test_a_provider_without_the_kernel_is_refused(monkeypatch, quantized):
    from exporter.artifact.folder import Artifact

    manifest = Artifact.open(quantized["int4"]).manifest
    assert providers.matmul_nbits_unusable(providers.CPU, 4) is None
    providers.check_quantized_provider(providers.CPU, manifest)  # the CPU provider has it
    monkeypatch.setattr(providers, "matmul_nbits_unusable", lambda provider, bits: f"no {bits}-bit kernel")
    with pytest.raises(ProviderError, match="cannot run this int4 artifact: no 4-bit kernel"):
        providers.check_quantized_provider(providers.CUDA, manifest)


# words of the tiny tokenizer's corpus (tests/conftest.py build_tokenizer)
TEXT = "kalo mine ruto savi depo gufe lomi neru tosa vide pogu feka " * 8
QUICK_VERIFY = ("--provider", "cpu", "--decode-steps", "4", "--no-sweep", "--no-genai", "--no-transformers-js")
WINDOW = 12 + 4 + 3  # the ids each row reads with QUICK_VERIFY: the prompt, the decode steps, the final chunk


def test_verify_reads_a_quality_text(quantized, tmp_path, monkeypatch):
    folder, text, report = quantized["int4"], tmp_path / "text.txt", tmp_path / "report.json"
    text.write_text(TEXT, encoding="utf-8")
    read = []

    def recording(*args):
        read.append(args[-1])
        return run_quality(*args)

    run_quality = engine._run_quality
    monkeypatch.setattr(engine, "_run_quality", recording)
    result = run_cli("verify", folder, "--quality-text", text, *QUICK_VERIFY, "--report-json", report)
    assert result.exit_code == 0, result.output
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids
    assert len(read) == 1 and np.array_equal(read[0].ids, ids)  # the artifact's tokenizer's ids of the text
    windows = max(2, -(-len(ids) // WINDOW))  # read whole: one window per 19 ids, rounded up, at least the batch
    assert f"input: text {text}, {len(ids)} tokens read whole ({windows} rows of {WINDOW} ids, " in result.stdout
    [quality] = json.loads(report.read_text())["quality"]
    positions = quality["metrics"]["positions"]
    assert quality["input"] == {
        "kind": "text",
        "source": str(text),
        "tokens": len(ids),
        "windows": windows,
        "window_length": WINDOW,
        "positions": positions,
    }
    assert positions == windows * WINDOW - 3  # the first row of the one batch is left-padded by 3


def test_verify_without_a_quality_text_reads_random_ids(quantized, tmp_path):
    report = tmp_path / "report.json"
    result = run_cli("verify", quantized["int4"], *QUICK_VERIFY, "--report-json", report)
    assert result.exit_code == 0, result.output
    assert f"input: seeded random ids (2 rows of {WINDOW} ids, {2 * WINDOW - 3} positions judged" in result.stdout
    document = json.loads(report.read_text())
    assert document["quality"][0]["input"] == {
        "kind": "random ids",
        "windows": 2,
        "window_length": WINDOW,
        "positions": 2 * WINDOW - 3,
    }
    assert document["verdict"] == "pass" and document["quality"][0]["verdict"] == "pass"


def test_an_undecided_quality_figure_exits_1_asking_for_a_longer_text(quantized, tmp_path, monkeypatch):
    def limit_at_the_value(*args):
        """The quality report with its mean KL judged against a limit at its own value, inside its interval."""
        report = run_quality(*args)
        kl = next(c for c in report.checks if c.threshold.metric == "kl_mean")
        at_value = dataclasses.replace(kl, threshold=dataclasses.replace(kl.threshold, limit=kl.value))
        return dataclasses.replace(report, checks=(at_value,))

    run_quality = engine._run_quality
    monkeypatch.setattr(engine, "_run_quality", limit_at_the_value)
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    report = tmp_path / "report.json"
    result = run_cli("verify", quantized["int4"], "--quality-text", text, *QUICK_VERIFY, "--report-json", report)
    assert result.exit_code == 1, result.output
    document = json.loads(report.read_text())
    [check] = document["quality"][0]["checks"]
    low, high = check["interval"]
    assert low < check["value"] < high and check["verdict"] == "undecided" and check["passed"] is False
    assert document["verdict"] == "undecided" and document["passed"] is False
    assert "UNDECIDED" in result.stdout and result.stdout.rstrip().splitlines()[-1].startswith("overall: UNDECIDED")
    positions = document["quality"][0]["metrics"]["positions"]
    assert result.stderr.splitlines()[-1] == (  # after the progress lines
        f"undecided: the 95% interval of kl_mean straddles its limit at {positions} positions; read more positions: "
        "give a longer --quality-text"
    )


@pytest.mark.parametrize(
    ("artifact", "text", "fragment"),
    [
        ("int4", None, "No such file or directory; give a UTF-8 text file"),
        ("int4", "folder", "Is a directory; give a UTF-8 text file"),
        ("int4", b"kalo \xff mine", "is not UTF-8 text (invalid start byte at byte 5); give UTF-8 text"),
        ("int4", "kalo mine", "tokens, fewer than the 19 each of the 2 windows reads (a 12-token prompt, 4 decode"),
        ("int8", TEXT, "is tokenized with the artifact's tokenizer.json, and"),
        ("float32", TEXT, "is float32, judged by parity with its reference on seeded random ids: drop --quality-text"),
    ],
)
def test_a_bad_quality_text_exits_2_writing_nothing(quantized, artifact_fp32, tmp_path, artifact, text, fragment):
    folder = artifact_fp32 if artifact == "float32" else quantized[artifact]
    path = tmp_path / "text.txt"
    if text == "folder":
        path.mkdir()
    elif isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text, encoding="utf-8")
    before = set(tmp_path.iterdir())
    report = tmp_path / "report.json"
    result = run_cli("verify", folder, "--quality-text", path, *QUICK_VERIFY, "--report-json", report)
    assert_one_line_error(result, 2, fragment)
    assert result.stderr.startswith(f"error: --quality-text {path}") or artifact != "int4", result.stderr
    assert set(tmp_path.iterdir()) == before  # no report, error or otherwise
