"""export --dtype int4 and generate on the result; quantization refusals exit 2 with one line, writing nothing."""

from __future__ import annotations

import json

import onnx
import pytest
from helpers import assert_one_line_error, replayed_export, run_cli

from exporter.errors import ProviderError
from exporter.runtime import sessions


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
    assert sessions.matmul_nbits_unusable(sessions.CPU, 4) is None
    sessions.check_quantized_provider(sessions.CPU, manifest)  # the CPU provider has it
    monkeypatch.setattr(sessions, "matmul_nbits_unusable", lambda provider, bits: f"no {bits}-bit kernel")
    with pytest.raises(ProviderError, match="cannot run this int4 artifact: no 4-bit kernel"):
        sessions.check_quantized_provider(sessions.CUDA, manifest)
