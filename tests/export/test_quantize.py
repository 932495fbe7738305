"""--dtype int4 / int8: weight-only MatMulNBits quantization of the exported graphs."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
from helpers import edit_manifest
from onnx import numpy_helper

from exporter.artifact.folder import Artifact
from exporter.errors import InputError
from exporter.export.pipeline import export_artifact
from exporter.verify.checks.invariants import identical_weights


def _blocks(folder, graph):
    """Each MatMulNBits node's quantized inputs, as (dtype, shape, bytes), in node order."""
    model = onnx.load(str(folder / graph))
    initializers = {t.name: t for t in model.graph.initializer}
    return [
        tuple(
            (t.data_type, tuple(t.dims), numpy_helper.to_array(t).tobytes()) for t in map(initializers.get, n.input[1:])
        )
        for n in model.graph.node
        if n.op_type == "MatMulNBits"
    ]


@pytest.mark.parametrize(("scheme", "bits", "largest_ratio"), [("int4", 4, 0.3), ("int8", 8, 0.35)])
def test_quantized_export_shrinks_and_shares(quantized, artifact_fp32, scheme, bits, largest_ratio):
    folder = quantized[scheme]
    manifest = json.loads((folder / "manifest.json").read_text())
    q = manifest["quantization"]
    assert manifest["dtype"] == "float32" and manifest["cache"]["dtype"] == "float32"
    assert (q["scheme"], q["bits"], q["block_size"], q["op"]) == (scheme, bits, 32, "MatMulNBits")
    # 2 layers x (q, k, v, o, gate, up, down); the tied lm_head (a Gemm on the embedding table) and the embedding
    # (a Gather) stay float
    assert q["matrices"] == 14 and any("tied" in kept for kept in q["kept_float"])
    # measured: int4 0.16 (4 bits + a float32 scale and a 4-bit zero point per 32 weights), int8 0.29
    assert q["quantized_bytes"] <= largest_ratio * q["float_bytes"]
    float_weights = (artifact_fp32 / "weights.onnx.data").stat().st_size
    assert (folder / "weights.onnx.data").stat().st_size < float_weights
    # both graphs carry the same blocks, byte for byte, stored once
    prefill, decode = _blocks(folder, "prefill.onnx"), _blocks(folder, "decode.onnx")
    assert len(prefill) == 14 and sorted(prefill) == sorted(decode)
    assert identical_weights(Artifact.open(folder)).passed


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"dtype": "int3"}, "dtype 'int3' is not supported"),
        ({"dtype": "int4", "block_size": 48}, "not a power of two"),
        ({"dtype": "int4", "block_size": 8}, "not a power of two >= 16"),
        ({"dtype": "int4", "block_size": 128}, "does not divide the model's hidden size 64"),
        ({"dtype": "int8", "accuracy_level": 7}, "accuracy_level 7"),
        ({"dtype": "int8", "lm_head": "int2"}, "lm_head 'int2'"),
    ],
)
def test_bad_quantization_refused_before_anything_is_written(tiny_model, tmp_path, arguments, fragment):
    with pytest.raises(InputError, match=fragment):
        export_artifact(tiny_model, tmp_path / "out", **arguments)
    assert not any(tmp_path.iterdir())


def test_dequantized_blocks_lie_within_a_scale(quantized, tiny_model):
    from exporter.verify.checks.weights import audit_weights

    audit = audit_weights(Artifact.open(quantized["int4"]), tiny_model)
    assert audit.passed, [f.describe() for f in audit.findings]
    assert all(g.quantized == 14 and g.carried == g.parameters for g in audit.graphs)


def test_blocks_of_other_bits_than_the_manifest_records_fail_the_audit(quantized, tiny_model, tmp_path):
    # An int8 artifact whose manifest says int4: its 8-bit blocks still lie within their scales of the parameters,
    # so only the scheme check tells it from the int4 artifact it claims to be (an export once wrote such a thing).
    from exporter.verify.checks.weights import audit_weights

    folder = shutil.copytree(quantized["int8"], tmp_path / "labelled-int4")
    edit_manifest(folder, lambda manifest: manifest["quantization"].update(scheme="int4", bits=4))
    audit = audit_weights(Artifact.open(folder), tiny_model)
    findings = [f for f in audit.findings if f.problem == "scheme"]
    assert not audit.passed and len(findings) == len(audit.findings) == 28, [f.describe() for f in audit.findings]
    expected = "a projection, holds 8-bit blocks of 32, but the manifest records int4 with 4-bit blocks of 32"
    assert expected in findings[0].detail, findings[0].detail
