"""The weight audit (exporter/verify/checks/weights/): every family's clean export passes it; each weight fault
written into a copy of an artifact (its manifest re-signed) fails it, naming the parameter, in float32 and
float16, inline and in the shared weights file; and verify's verdict and reports carry it."""

from __future__ import annotations

import json
import shutil
from xml.etree import ElementTree as ET

import numpy as np
import onnx
import pytest
from helpers import edit_graphs, edit_weights, graph_weight, run_cli, scaled, swapped
from mutants import causal_mask_leaks_one
from onnx import numpy_helper

from exporter import ParitySettings, verify_artifact
from exporter.artifact.folder import Artifact
from exporter.verify.checks.weights.audit import audit_weights
from exporter.verify.references.model_source import rebuild_reference
from exporter.verify.reports import format_verify, render_junit

CLEAN = {  # fixture names: artifact, reference model
    "minimind-3 float32": ("artifact_fp32", "tiny_model"),
    "minimind-3 float16": ("artifact_fp16", "tiny_model"),
    "minimind-3 hidden 256, norms in the weights file": ("wide_artifact", "wide_model"),
    "minimind-3 MoE + YaRN (dense)": ("moe3_dense_artifact", "moe3_dense_model"),
    "minimind-3 MoE + YaRN float16 (sparse)": ("moe3_artifact_fp16", "moe3_model"),
    "MiniMind2 MoE (sparse)": ("moe2_artifact", "moe2_model"),
    "teaching GPT": ("gpt_artifact", "gpt_model"),
    "seed 001 demo (bring your own)": ("byo_artifact", "byo_adapter"),
}


def _clean(audit, computed_tables: int) -> None:
    assert audit.passed, [g.detail for g in audit.graphs]
    for graph in audit.graphs:
        assert graph.weights == graph.matched > 0 and graph.carried == graph.parameters > 0, graph.summary
        assert graph.constants == computed_tables, graph.summary


@pytest.mark.parametrize("family", CLEAN)
def test_a_clean_export_of_every_family_passes_the_weight_audit(family, request):
    artifact, model = (request.getfixturevalue(name) for name in CLEAN[family])
    audit = audit_weights(Artifact.open(artifact), model)
    _clean(audit, computed_tables=0 if family.startswith(("teaching", "seed")) else 1)  # minimind: RoPE frequencies
    prefill = audit.graphs[0]
    if "float16" in family and "MoE" not in family:  # minimind-3 scales by its norm weights in float32
        assert prefill.upcast == 2 * 4 + 1, prefill.summary  # per layer two RMSNorms, q_norm, k_norm; the final
    if family == "teaching GPT":  # untied lm_head and every Linear without Gemm: read transposed by MatMul
        assert prefill.transposed == 2 * (3 * 4 + 3) + 1, prefill.summary


def test_a_minimind2_checkpoint_export_passes_the_weight_audit(minimind2_artifact):
    """Exported from a float16 .pth through the CLI; the reference is rebuilt from that checkpoint."""
    artifact = Artifact.open(minimind2_artifact)
    _clean(audit_weights(artifact, rebuild_reference(minimind2_artifact, artifact.manifest)), computed_tables=1)


# fault -> (the modules' weights edited, how, the parameters the audit must name)
FAULTS = {
    "one channel of a norm x 1.01": (
        lambda f: {"model.layers.1.post_attention_layernorm": scaled(5, 1.01)},
        {"model.layers.1.post_attention_layernorm.weight"},
    ),
    "one v_proj weight x 1.05": (
        lambda f: {"model.layers.0.self_attn.v_proj": scaled(None, 1.05)},
        {"model.layers.0.self_attn.v_proj.weight"},
    ),
    "one down_proj weight x 1.1": (
        lambda f: {"model.layers.1.mlp.down_proj": scaled(None, 1.1)},
        {"model.layers.1.mlp.down_proj.weight"},
    ),
    "one embedding row x 1.01": (
        lambda f: {"model.embed_tokens": scaled(7, 1.01)},
        {"model.embed_tokens.weight"},
    ),
    "q_norm <-> k_norm swapped": (
        lambda f: swapped(f, "model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"),
        {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"},
    ),
}
FAULTED = {  # artifact fixture, its model
    "float32": ("artifact_fp32", "tiny_model"),
    "float16": ("artifact_fp16", "tiny_model"),
    "float32, norms in the weights file": ("wide_artifact", "wide_model"),
}


def _copy(request, tmp_path, kind: str):
    artifact, model = (request.getfixturevalue(name) for name in FAULTED[kind])
    return shutil.copytree(artifact, tmp_path / artifact.name), model


@pytest.mark.parametrize("kind", FAULTED)
@pytest.mark.parametrize("fault", FAULTS)
def test_each_weight_fault_fails_the_audit_naming_its_parameter(fault, kind, request, tmp_path):
    folder, model = _copy(request, tmp_path, kind)
    changes, named = FAULTS[fault]
    edit_weights(folder, changes(folder))
    audit = audit_weights(Artifact.open(folder), model)  # opened with every hash checked: the manifest re-signed
    assert not audit.passed
    for graph in audit.graphs:  # both graphs read the edited tensor
        assert {f.parameter for f in graph.findings} == named, graph.detail
        assert {f.problem for f in graph.findings} == ({"misplaced"} if "swapped" in fault else {"differs"})
    if fault == "one v_proj weight x 1.05":
        [finding] = audit.graphs[0].findings
        assert "1 of " in finding.detail and "× 1.05" in finding.detail, finding.detail


def test_the_wide_artifact_keeps_its_norms_in_the_weights_file_and_passes_verify(wide_artifact, wide_model):
    model = onnx.load(str(wide_artifact / "prefill.onnx"), load_external_data=False)
    for norm in ("model.layers.0.self_attn.q_norm", "model.layers.1.input_layernorm", "model.norm"):
        assert graph_weight(model, norm).data_location == onnx.TensorProto.EXTERNAL, norm
    report = verify_artifact(wide_artifact, wide_model, ["cpu"], ParitySettings(decode_steps=8, sweep=False))
    assert report.passed, format_verify(report)
    assert report.weights.passed and report.weights.graphs[0].carried == 2 * 11 + 2  # per layer 11; embedding, norm


def test_a_stray_initializer_and_a_dropped_norm_fail_the_audit(artifact_fp32, tiny_model, tmp_path):
    stray = shutil.copytree(artifact_fp32, tmp_path / "stray")
    noise = np.random.default_rng(0).uniform(0.5, 1.5, 64).astype(np.float32)  # a norm weight of no layer
    edit_graphs(stray, lambda graph: graph.initializer.append(numpy_helper.from_array(noise, "stray")))
    audit = audit_weights(Artifact.open(stray), tiny_model)
    for graph in audit.graphs:
        [finding] = graph.findings
        assert (finding.problem, finding.initializer, finding.parameter) == ("unmatched", "stray", ""), finding

    # The final norm dropped: its Mul reads a one-element 1.0 in place of the weight, which is removed.
    dropped = shutil.copytree(artifact_fp32, tmp_path / "dropped")

    def drop(graph):
        name = graph_weight(onnx.ModelProto(graph=graph), "model.norm").name
        [index] = [i for i, tensor in enumerate(graph.initializer) if tensor.name == name]
        del graph.initializer[index]
        graph.initializer.append(numpy_helper.from_array(np.ones((), np.float32), "one"))
        for node in graph.node:
            node.input[:] = ["one" if value == name else value for value in node.input]

    edit_graphs(dropped, drop)
    audit = audit_weights(Artifact.open(dropped), tiny_model)
    for graph in audit.graphs:
        [finding] = graph.findings
        assert (finding.problem, finding.parameter) == ("missing", "model.norm.weight"), finding


def test_verify_fails_a_float16_weight_fault_and_every_report_names_the_parameter(artifact_fp16, tmp_path):
    """A weight off by 5% in a float16 export: the command exits 1, and the text, JSON and JUnit reports name
    the parameter."""
    folder = shutil.copytree(artifact_fp16, tmp_path / "fp16")
    edit_weights(folder, {"model.layers.0.self_attn.v_proj": scaled(None, 1.05)})
    junit = tmp_path / "report.xml"
    result = run_cli(
        "verify",
        folder,
        "--decode-steps",
        "2",
        "--no-sweep",
        "--no-genai",
        "--no-transformers-js",
        "--json",
        "--junit",
        junit,
        "-q",
    )
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    audit = document["weight_audit"]
    assert document["passed"] is False and audit["passed"] is False
    for graph in audit["graphs"]:
        [finding] = graph["findings"]
        assert finding["parameter"] == "model.layers.0.self_attn.v_proj.weight", finding
    [suite] = [s for s in ET.parse(junit).getroot() if s.get("name") == "weight audit"]
    assert suite.get("failures") == "2" and "v_proj.weight" in suite.find(".//failure").text


def test_the_text_report_shows_the_audit_and_each_finding(full, tiny_model, artifact_fp32, tmp_path):
    import dataclasses

    report, _ = full
    text = format_verify(report)
    assert "weight audit (every initializer against the PyTorch model's parameters)" in text
    [row] = [line for line in text.splitlines() if line.startswith("prefill.onnx ")]
    assert row.split()[-1] == "pass" and "24 of 24 parameters carried" in row, row
    folder = shutil.copytree(artifact_fp32, tmp_path / "fp32")
    edit_weights(folder, {"model.layers.1.mlp.down_proj": scaled(None, 1.1)})
    broken = dataclasses.replace(report, weights=audit_weights(Artifact.open(folder), tiny_model))
    text = format_verify(broken)
    assert not broken.passed and text.split("\n")[-1].startswith("overall: FAIL")
    rows = [line for line in text.splitlines() if "differs: model.layers.1.mlp.down_proj.weight differs" in line]
    assert len(rows) == 2 and all(row.endswith("FAIL") for row in rows), text
    suites = ET.fromstring(render_junit(broken))
    [suite] = [s for s in suites if s.get("name") == "weight audit"]
    assert suite.get("failures") == "2"


def test_every_quantized_block_is_placed_in_its_module_and_is_the_quantizers(
    quantized, quantized_float16, deep_int4, tiny_model, deep_model
):
    """int4 and int8 at float32 activations, int4 at float16 (float16 scales), and int4 7 layers deep through the
    template: every MatMulNBits and GatherBlockQuantized holds its own module's parameter, scales and zero points bit
    for bit as the quantizer makes them, and the embedding's row-id table is the identity."""
    cases = [(folder, tiny_model) for folder in (*quantized.values(), quantized_float16)] + [(deep_int4, deep_model)]
    for folder, model in cases:
        audit = audit_weights(Artifact.open(folder), model)
        assert audit.passed, [g.detail for g in audit.graphs]
        for graph in audit.graphs:
            layers = model.config.num_hidden_layers
            assert graph.quantized == 7 * layers + 2 and graph.tables == 1, graph.summary  # + embedding, lm_head


def test_a_quantized_node_in_no_module_cannot_be_placed(deep_int4, deep_model, tmp_path):
    """An artifact whose MatMulNBits carry no scope (as onnxruntime's quantizer leaves them): no parameter is due."""
    folder = shutil.copytree(deep_int4, tmp_path / "int4")

    def unscoped(graph):
        for node in graph.node:
            if node.op_type == "MatMulNBits":
                del node.metadata_props[:]

    edit_graphs(folder, unscoped)
    audit = audit_weights(Artifact.open(folder), deep_model)
    for graph in audit.graphs:
        assert {f.problem for f in graph.findings} == {"unplaced", "missing"}, graph.detail
        assert sum(f.problem == "unplaced" for f in graph.findings) == 7 * 7 + 1  # every projection and the lm_head


def test_the_faithfulness_check_passes_a_correct_int4_export_and_fails_a_wrong_mask(deep_int4, deep_model, tmp_path):
    """The reference holding the artifact's own weights, against ONNX Runtime in float math, judged by the float32
    profile: a correct export lies within it, while the causal mask letting each query see the next token (a fault
    the int4 quality profile may not tell from 4-bit rounding) fails it."""
    settings = ParitySettings(decode_steps=2, greedy_tokens=4, sweep=False)
    report = verify_artifact(deep_int4, deep_model, ["cpu"], settings, genai=False, transformers_js=False)
    assert report.weights.passed and report.faithfulness.passed, report.faithfulness.detail
    assert report.faithfulness.replaced == 7 * 7 + 2
    assert max(c.needed.scale for c in report.faithfulness.comparisons) < 0.5  # a clean run: half the tolerance
    folder = shutil.copytree(deep_int4, tmp_path / "int4")
    edit_graphs(folder, causal_mask_leaks_one)
    broken = verify_artifact(folder, deep_model, ["cpu"], settings, genai=False, transformers_js=False)
    assert broken.weights.passed and not broken.faithfulness.passed, broken.faithfulness.detail
    assert "faithfulness" in json.dumps(broken.to_dict())
