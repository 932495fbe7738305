"""Where a fault lies: the health scan of outputs and of the debug copy's values, the localisation to a layer
and the attribution, and the module probe, live or replayed from a golden bundle."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from xml.etree import ElementTree as ET

import numpy as np
import onnx
import pytest
from helpers import CPU_ONLY, QUICK, perturb_weight, run_cli, scale_inline_weight

from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import read_manifest
from exporter.runtime.runner import OrtRunner
from exporter.tolerances.parity import profile_for
from exporter.verify.diagnosis.localise import probe_between, probe_reference
from exporter.verify.diagnosis.probe import DebugGraph, PositionAxes, real_elements
from exporter.verify.engine import verify_artifact
from exporter.verify.inputs import PREFILL_BATCH, prefill_feeds, prompt_batch
from exporter.verify.metrics import compare
from exporter.verify.references.golden.reading import load_bundle
from exporter.verify.references.golden.writing import save_bundle
from exporter.verify.references.torch_runner import TorchRunner
from exporter.verify.reports import format_verify, render_junit


def test_health_flags_zero_rows_and_nan_that_outputs_hide():
    from exporter.verify.checks.health import HealthScan

    scan = HealthScan("float16")
    logits = np.ones((1, 3, 4), np.float16)
    logits[0, 1] = 0  # a real position whose logits are all zero: a silent norm failure
    present = np.ones((1, 2, 3, 4), np.float16)
    scan.scan_outputs("step", {"logits": logits, "present.0.key": present}, np.array([[1, 1, 1]]))
    scan.scan_activations({"norm": np.array([30000.0, -5.0], np.float16), "bias": np.array([-1e9], np.float32)})
    report = scan.report()
    assert not report.passed and report.zero_rows == 1 and report.nan == 0
    assert report.activation_max_abs == 30000.0 and report.activation_at == "norm" and report.warnings
    padded = HealthScan("float16")
    padded.scan_outputs("step", {"logits": logits}, np.array([[1, 0, 1]]))  # the zero row is padding
    assert padded.report().passed


def test_health_flags_a_float16_overflow_that_the_outputs_do_not_show():
    # ONNX Runtime's CPU provider computes a norm's float16 Pow and ReduceMean in float32, so a norm whose float16
    # statistics overflow gives right outputs there: the debug copy's +Inf is the only trace of an overflow that
    # zeroes every key where float16 is computed as declared (PyTorch does)
    from exporter.verify.checks.health import HealthScan

    values = {
        "pow_2": np.array([np.inf, 4.0e4, 1.0], np.float16),
        "mask": np.array([-np.inf, -5.0], np.float16),  # the attention mask's fill, -inf
        "bias": np.array([np.inf], np.float32),
    }
    scan = HealthScan("float16")
    scan.scan_activations(values, mask_fed=frozenset({"mask"}))
    report = scan.report()
    assert not report.passed and report.inf == 1 and report.activation_max_abs == 4.0e4
    scan = HealthScan("float16")
    scan.scan_activations(values, {"pow_2": "Pow in model.layers.0.input_layernorm"}, frozenset({"mask"}))
    report = scan.report()
    assert report.issues == [
        "activation pow_2 (Pow in model.layers.0.input_layernorm): 1 +Inf, float16 overflow "
        "(beyond 65504); compute it in float32"
    ]


def test_health_flags_saturation_and_an_infinity_no_mask_explains():
    # A float16 norm that overflows can saturate at +-65504 instead of giving Inf. The export masks attention with
    # -inf (reference/layers.py), never with float16's lowest value: -Inf is its mask only in a value computed
    # from that fill, and +-65504 is saturation wherever it is.
    from exporter.verify.checks.health import HealthScan

    saturated_row = np.array([[65504.0] * 4, [1.0, -2.0, 3.0, 0.5]], np.float16)
    scan = HealthScan("float16")
    scan.scan_activations(
        {"mlp": saturated_row, "scores": np.array([-np.inf, 3.0], np.float16)},
        {"mlp": "Mul in model.layers.0.mlp"},
        frozenset({"scores"}),
    )
    report = scan.report()
    assert not report.passed and (report.saturated, report.inf) == (4, 0)
    assert report.issues == [
        "activation mlp (Mul in model.layers.0.mlp): 4 at +-65504, saturated at float16's "
        "limit (an overflow held there instead of Inf); compute it in float32"
    ]
    assert report.activation_max_abs == 65504 and report.activation_at == "mlp" and report.headroom == 1.0
    assert report.warnings == ["largest value 6.55e+04 at mlp is within 16x of float16's limit 65504"]

    overflowed = {"norm": np.array([-np.inf, 2.0], np.float16), "scores": np.array([-65504.0, 1.0], np.float16)}
    scan = HealthScan("float16")
    scan.scan_activations(overflowed, mask_fed=frozenset({"scores"}))
    report = scan.report()
    assert not report.passed and (report.inf, report.saturated) == (1, 1)
    assert report.issues == [
        "activation norm: 1 -Inf, float16 overflow (beyond 65504); compute it in float32",
        "activation scores: 1 at +-65504, saturated at float16's limit (an overflow held "
        "there instead of Inf); compute it in float32",
    ]
    assert report.to_dict()["saturated"] == 1


@pytest.mark.parametrize("artifact", ["artifact_fp32", "artifact_fp16"])
def test_the_health_scan_excuses_the_exports_attention_mask_and_nothing_after_it(artifact, request):
    # The debug copy knows the values computed from the mask's fill up to the softmax: every value of the export
    # holding -inf is one of them, and no value the softmax computes is. A float16 export scans clean with them,
    # and fails on a row of its first MLP's output saturated at 65504.
    from exporter.verify.checks.health import HealthScan

    folder = request.getfixturevalue(artifact)
    manifest = read_manifest(folder)
    debug = DebugGraph(Artifact(folder, manifest), manifest.prefill)
    values = debug.run(prefill_feeds(manifest, prompt_batch(manifest, QUICK, np.random.default_rng(0))))
    holding_fill = {name for name, value in values.items() if np.isneginf(value).any()}
    assert holding_fill and holding_fill <= debug.mask_fed
    after_softmax = {o for n in debug.nodes if n.op_type == "Softmax" for o in n.outputs}
    assert after_softmax and not after_softmax & debug.mask_fed
    assert {n.module for n in debug.nodes if set(n.outputs) & debug.mask_fed} == {
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    }
    producers = {o: f"{n.op_type} in {n.module}" for n in debug.nodes for o in n.outputs}
    clean = HealthScan(manifest.dtype)
    clean.scan_activations(values, producers, debug.mask_fed)
    assert clean.report().passed and clean.report().saturated == 0
    if manifest.dtype == "float16":
        mlp = next(
            o
            for n in debug.nodes
            if n.module == "model.layers.0.mlp"
            for o in n.outputs
            if values[o].dtype == np.float16
        )
        saturated = values[mlp].copy()
        saturated[0, -1] = 65504.0  # row 0's last token, a real one
        scan = HealthScan("float16")
        scan.scan_activations({**values, mlp: saturated}, producers, debug.mask_fed)
        report = scan.report()
        assert not report.passed and report.saturated == saturated.shape[-1] and report.activation_at == mlp
        assert report.issues[0].startswith(f"activation {mlp} ({producers[mlp]}): {saturated.shape[-1]} at +-65504")


def test_health_counts_a_zero_present_row_in_any_head_at_real_positions_only():
    # a norm that fails in one key/value head zeroes that head's row alone; a padded position may hold zeros
    from exporter.verify.checks.health import HealthScan

    mask = np.array([[0, 1, 1]])
    present = np.ones((1, 2, 3, 4), np.float32)
    present[0, 1, 0] = 0  # the padded position, in one head
    scan = HealthScan("float32")
    scan.scan_outputs("prefill", {"present.0.key": present}, mask)
    assert scan.report().passed and scan.report().zero_rows == 0
    present[0, 1, 2] = 0  # a real position, in one head
    scan = HealthScan("float32")
    scan.scan_outputs("prefill", {"present.0.key": present}, mask)
    report = scan.report()
    assert not report.passed and report.zero_rows == 1
    assert report.issues == ["prefill present.0.key: 1 all-zero rows at real token positions"]


def test_health_counts_nan_in_a_float32_activation():
    # only float16 values can overflow, but NaN fails in any
    from exporter.verify.checks.health import HealthScan

    scan = HealthScan("float32")
    scan.scan_activations({"attn": np.array([1.0, np.nan], np.float32)}, {"attn": "Softmax in model.layers.0"})
    report = scan.report()
    assert not report.passed and report.nan == 1 and report.activation_max_abs is None
    assert report.issues == ["activation attn (Softmax in model.layers.0): 1 NaN"]


def test_health_counts_nan_and_inf_at_real_positions():
    from exporter.verify.checks.health import HealthScan

    scan = HealthScan("float32")
    logits = np.ones((1, 3, 4), np.float32)
    logits[0, 0, 1], logits[0, 2, 3] = np.nan, np.inf
    scan.scan_outputs("prefill", {"logits": logits}, np.array([[1, 1, 1]]))
    report = scan.report()
    assert not report.passed and (report.nan, report.inf, report.zero_rows) == (1, 1, 0)
    assert report.issues == ["prefill logits: 1 NaN, 1 Inf"]
    activations = HealthScan("float16")
    activations.scan_activations({"attn": np.array([1.0, np.nan], np.float16)})
    assert not activations.report().passed and activations.report().nan == 1


def test_nan_fails_in_a_padded_present_but_not_in_a_padded_querys_logits():
    # A later step weighs a padded key by zero, and 0 x NaN is NaN: the real tokens read a padded present.
    # Nothing reads a padded query's logits.
    from exporter.verify.checks.health import HealthScan

    mask = np.array([[0, 1, 1]])
    logits = np.ones((1, 3, 4), np.float32)
    logits[0, 0, :2] = np.nan, np.inf  # position 0 is padding
    present = np.ones((1, 2, 3, 4), np.float32)
    scan = HealthScan("float32")
    scan.scan_outputs("prefill", {"logits": logits, "present.0.key": present}, mask)
    report = scan.report()
    assert report.passed and (report.nan, report.inf) == (0, 0)
    assert report.warnings == ["prefill logits: 1 NaN, 1 Inf at padded query positions, which no token reads"]
    present[0, 1, 0, 2] = np.nan  # the padded position, in one head
    scan = HealthScan("float32")
    scan.scan_outputs("prefill", {"logits": logits, "present.0.key": present}, mask)
    report = scan.report()
    assert not report.passed and (report.nan, report.inf) == (1, 0)
    assert report.issues == [
        "prefill present.0.key: 1 NaN, 0 Inf (1 at padded positions, which a later step weighs by zero: 0 x NaN is NaN)"
    ]
    logits[0, 2, 3] = np.nan  # a real query
    scan = HealthScan("float32")
    scan.scan_outputs("prefill", {"logits": logits}, mask)
    assert not scan.report().passed and scan.report().issues == ["prefill logits: 1 NaN, 0 Inf"]


def test_localisation_names_the_perturbed_layer_and_operator(artifact_copy, tiny_model):
    perturb_weight(artifact_copy, "model.layers.1.self_attn.k_proj", 0.05)
    report = verify_artifact(artifact_copy, tiny_model, ["cpu"], QUICK, genai=False, transformers_js=False)
    [cpu] = report.reports
    assert not report.passed and not cpu.comparisons[0].passed
    assert not report and not cpu  # `if verify_artifact(...)` read true for a failed report, as any dataclass
    assert cpu.localisation.first_layer == 1  # layer 0's present is untouched
    assert cpu.layers[0].passed and not cpu.layers[1].key.passed and cpu.layers[1].value.passed
    first = cpu.localisation.probe.first
    assert first.module == "model.layers.1.self_attn.k_proj" and first.op_type == "MatMul", first
    # decode.onnx reads the same weight: probed on the reference's past, it names the same module
    decoded = cpu.localisation.decode_probe
    assert decoded.call == "decode step 0, fed the reference's past" and decoded.first.module == first.module
    text = format_verify(report)
    assert (
        "localisation: first diverging layer 1 (prefill present): the fault lies in layer 1's input norm or "
        "key/value path, or in layer 0's query path, attention, output projection or MLP"
    ) in text
    assert first.node in text
    # The invariants hold whatever the weights: they cannot see this fault.
    assert all(i.passed for i in report.invariants)


def test_localisation_places_a_fault_after_the_last_layers_key_value_path(artifact_copy, tiny_model):
    # A layer's present depends on that layer's input alone: failing logits with every present passing put the
    # fault after the last layer's key/value projections (here in its MLP).
    perturb_weight(artifact_copy, "model.layers.1.mlp.down_proj", 0.05)
    report = verify_artifact(artifact_copy, tiny_model, ["cpu"], QUICK, genai=False, transformers_js=False)
    [cpu] = report.reports
    assert cpu.comparisons[0].needed.scale > 1000 and all(layer.passed for layer in cpu.layers)
    assert all(step.first_failing_layer is None for step in cpu.curve)
    located = report.to_dict()["providers"][0]["localisation"]
    assert (
        located["first_layer"] is None and located["where"] == "prefill logits diverge, every layer's present passing"
    )
    assert located["fault_in"] == (
        "after layer 1's key/value path: in layer 1's query path, attention, output "
        "projection or MLP, the final norm or lm_head"
    )
    assert located["probe"]["first"]["module"] == "model.layers.1.mlp.down_proj"
    assert (
        "localisation: prefill logits diverge, every layer's present passing: the fault lies after layer 1's "
        "key/value path"
    ) in format_verify(report)


@pytest.mark.parametrize("artifact", ["artifact_fp32", "artifact_fp16"])
def test_the_debug_copy_computes_with_the_artifacts_weights(artifact, request):
    # ONNX Runtime drops a given initializer that an optimisation folds (the CPU casts float16 weights) and
    # reads the weights file instead: the debug copy must then find the artifact's, not a stand-in.
    folder = request.getfixturevalue(artifact)
    manifest = read_manifest(folder)
    feeds = prefill_feeds(manifest, prompt_batch(manifest, QUICK, np.random.default_rng(0)))
    exposed = DebugGraph(Artifact(folder, manifest), manifest.prefill).run(feeds)
    logits = OrtRunner(Artifact(folder, manifest)).prefill(feeds)["logits"]
    # The same graph, fused differently around the exposed values: rounding apart.
    assert compare("logits", "logits", exposed["logits"], logits, profile_for(manifest.dtype).logits).passed
    assert np.abs(logits).max() > 1


def test_a_decode_graphs_positions_are_its_query_and_its_total_length(artifact_fp32):
    # decode.onnx names the query length and the attention mask's (past and query) apart: both are positions
    manifest = read_manifest(artifact_fp32)
    axes = DebugGraph(Artifact(artifact_fp32, manifest), manifest.decode).axes
    assert axes == PositionAxes("batch_size", frozenset({"sequence_length", "total_sequence_length"}))


@pytest.fixture(scope="module")
def broken_and_bundle(artifact_fp32, tiny_model, tmp_path_factory):
    """A copy of the tiny artifact with 0.05 added to layer 1's k_proj weight, and a golden bundle recorded while
    verifying it without the probe."""
    folder = shutil.copytree(artifact_fp32, tmp_path_factory.mktemp("broken") / "artifact")
    perturb_weight(folder, "model.layers.1.self_attn.k_proj", 0.05)
    bundle = folder.parent / "golden"
    verify_artifact(
        folder,
        tiny_model,
        ["cpu"],
        dataclasses.replace(QUICK, probe=False),
        genai=False,
        transformers_js=False,
        golden_save=bundle,
    )
    return folder, bundle


def test_a_golden_replay_probes_against_the_module_outputs_its_bundle_recorded(broken_and_bundle, tiny_model):
    # Recorded without --probe, the bundle still lets its replay name what a live probe names, to the value.
    folder, bundle = broken_and_bundle
    live = (
        verify_artifact(folder, tiny_model, ["cpu"], QUICK, genai=False, transformers_js=False).reports[0].localisation
    )
    assert live.probe.first.module == "model.layers.1.self_attn.k_proj" and live.probe.first.op_type == "MatMul"
    result = run_cli(
        "verify",
        folder,
        "--golden",
        bundle,
        "--probe",
        *CPU_ONLY,
        "--json",
        "-q",
    )
    assert result.exit_code == 1, result.output  # the perturbed weight fails parity
    replayed = json.loads(result.stdout)["providers"][0]["localisation"]
    assert replayed == live.to_dict(), (replayed, live)


def test_a_bundle_recorded_before_module_outputs_were_kept_replays_without_the_probe(broken_and_bundle, tmp_path):
    folder, bundle = broken_and_bundle
    manifest = read_manifest(folder)
    recorded = load_bundle(bundle, manifest)
    recorded.reference.recorded_module_outputs = {}  # saved as an earlier v4 toolkit saved it
    old = save_bundle(
        recorded.reference, tmp_path / "old", manifest, recorded.settings, recorded.overrides, recorded.versions
    )
    assert not any(name.startswith("modules/") for name in np.load(old / "arrays.npz"))
    [cpu] = verify_artifact(folder, None, ["cpu"], QUICK, genai=False, transformers_js=False, golden=old).reports
    assert cpu.localisation.first_layer == 1 and cpu.localisation.probe is None
    assert cpu.localisation.probe_skipped == ("the bundle holds no module outputs: re-record it with `golden_save`")
    assert cpu.localisation.decode_probe is None
    assert cpu.localisation.decode_probe_skipped.startswith("the bundle holds no module outputs of decode step 0")


@pytest.fixture(scope="module")
def decode_fault(artifact_fp32, tiny_model, tmp_path_factory):
    """A copy of the tiny artifact whose decode.onnx alone holds layer 0's q_norm weight x1.05 (each graph carries
    its small norm weights itself), verified with the probe while a golden bundle is recorded."""
    folder = shutil.copytree(artifact_fp32, tmp_path_factory.mktemp("decode-fault") / "artifact")
    scale_inline_weight(folder, "decode.onnx", "layers.0.self_attn.q_norm.weight", 1.05)
    bundle = folder.parent / "golden"
    report = verify_artifact(folder, tiny_model, ["cpu"], QUICK, genai=False, transformers_js=False, golden_save=bundle)
    return folder, report, bundle


def test_a_fault_in_decode_onnx_alone_is_localised_in_decode_onnx(decode_fault):
    # The probe ran on prefill.onnx alone and printed "probe: no checked value diverges" under decode checks
    # failing at 2.8e3x the tolerance.
    _, report, _ = decode_fault
    [cpu] = report.reports
    assert all(c.passed for c in cpu.comparisons if c.name.startswith("prefill")) and all(x.passed for x in cpu.layers)
    assert not cpu.curve[0].logits.passed and cpu.curve[0].logits.needed.scale > 100
    loc = cpu.localisation
    assert (loc.probe.graph, loc.probe.call, loc.probe.first) == ("prefill.onnx", PREFILL_BATCH, None)
    # layer 0's q_norm scales its queries alone: layer 0's present (keys and values) agrees, and layer 1's, which
    # layer 0's attention output feeds, diverges first, at the first decode step, prefill's passing
    assert (loc.first_layer, loc.where) == (1, "decode step 0 present"), loc
    first = loc.decode_probe.first
    assert (loc.decode_probe.graph, loc.decode_probe.call) == ("decode.onnx", "decode step 0, fed the reference's past")
    assert first.module == "model.layers.0.self_attn.q_norm" and first.op_type == "Mul" and first.needed_scale > 100
    text = format_verify(report)
    assert (
        f"probe decode.onnx (decode step 0, fed the reference's past): first diverging checked value "
        f"{first.tensor}, computed by {first.node} (Mul) in model.layers.0.self_attn.q_norm"
    ) in text
    assert "probe prefill.onnx (the prefill batch): no checked value diverges" in text
    assert "probe: no checked value diverges" not in text


def test_the_attribution_does_not_report_an_export_that_fails_decode_as_passing(decode_fault):
    # The "export" leg covers decode.onnx too: the prefill logits alone would pass while decode.onnx fails.
    _, report, _ = decode_fault
    legs = report.attribution.legs
    assert [(leg.cause, leg.covers, leg.comparison.passed) for leg in legs] == [
        ("export", "prefill.onnx, the prefill batch", True),
        ("export", "decode.onnx, the 3 decode steps after it", False),
    ]
    assert legs[1].comparison.max_abs == max(s.logits.max_abs for s in report.reports[0].curve)
    text = format_verify(report)
    assert re.search(r"\nexport +decode\.onnx, the 3 decode steps after it +\S+ +\S+x +FAIL\n", text), text
    assert "repeat run of the prefill batch (nondeterminism)" in text  # it reruns the prefill batch only
    assert [leg["covers"] for leg in report.to_dict()["attribution"]["legs"]] == [leg.covers for leg in legs]
    assert (
        ET.fromstring(render_junit(report)).find(
            ".//testcase[@name='export leg (decode.onnx, the 3 decode steps after it)']/failure"
        )
        is not None
    )


def test_a_golden_replay_probes_decode_onnx_only_with_the_decode_calls_module_outputs(decode_fault, tmp_path):
    folder, report, bundle = decode_fault
    live = report.reports[0].localisation
    manifest = read_manifest(folder)
    [cpu] = verify_artifact(folder, None, ["cpu"], QUICK, genai=False, transformers_js=False, golden=bundle).reports
    assert cpu.localisation == live  # the same operator, the same error
    # a bundle recorded before the decode call's module outputs were kept: the prefill probe alone, and why
    recorded = load_bundle(bundle, manifest)
    recorded.reference.recorded_module_outputs.pop("decode")
    old = save_bundle(
        recorded.reference, tmp_path / "old", manifest, recorded.settings, recorded.overrides, recorded.versions
    )
    report = verify_artifact(folder, None, ["cpu"], QUICK, genai=False, transformers_js=False, golden=old)
    loc = report.reports[0].localisation
    assert loc.probe == live.probe and loc.decode_probe is None
    assert loc.decode_probe_skipped.startswith("the bundle holds no module outputs of decode step 0")
    assert f"probe of the decode graph: {loc.decode_probe_skipped}" in format_verify(report)


@pytest.fixture(scope="module")
def probed(artifact_fp32, tiny_model):
    """The debug copy of the tiny artifact, its values and the reference's module outputs on the default batch
    (row 0 left-padded by 3)."""
    manifest = read_manifest(artifact_fp32)
    batch = prompt_batch(manifest, QUICK, np.random.default_rng(0))
    debug = DebugGraph(Artifact(artifact_fp32, manifest), manifest.prefill)
    values = debug.run(prefill_feeds(manifest, batch))
    expected = TorchRunner(tiny_model, manifest).module_outputs(batch)
    return debug, values, expected, profile_for(manifest.dtype).kv, batch["attention_mask"]


def test_the_probe_checks_the_presents_where_the_layer_level_localisation_looks(probed):
    # A fault between layer 1's k_proj and its present (the rotary embedding, say) shows in present.1.key
    # before o_proj: the probe must name the present's operator, as the layer-level check names layer 1.
    debug, values, expected, tolerance, mask = probed
    assert probe_reference(debug, values, expected, tolerance, mask, PREFILL_BATCH).first is None
    values = {**values, "present.1.key": -values["present.1.key"]}
    first = probe_reference(debug, values, expected, tolerance, mask, PREFILL_BATCH).first
    assert first.tensor == "present.1.key" and first.module.startswith("model.layers.1.self_attn"), first


def test_a_module_named_like_an_intermediate_value_is_matched_by_its_scope(probed):
    # The teaching GPT's final norm is the module `layer_norm`, and its first block's LayerNormalization computes
    # the value `layer_norm`: the probe took that module's output for that value, and named a clean export's
    # first LayerNormalization at 4e4x the tolerance. Only the graph's own outputs (presents) match by name.
    debug, values, expected, tolerance, mask = probed
    inner = next(o for n in debug.nodes if n.module == "model.layers.0.input_layernorm" for o in n.outputs)
    assert inner not in debug.graph_outputs
    named_like = {**expected, inner: values[inner] + 1.0}  # a module of that path, with its own output
    result = probe_reference(debug, values, named_like, tolerance, mask, PREFILL_BATCH)
    assert result.first is None and result.note.startswith(f"36 of {len(named_like)} reference module outputs"), result


def test_a_module_is_matched_inside_its_own_scope_not_one_its_path_prefixes():
    # the module layers.1 holds layers.1.mlp, not layers.10 (a model of 11 or more layers)
    from types import SimpleNamespace

    from exporter.verify.diagnosis.probe import NodeInfo

    nodes = [
        NodeInfo(0, "mlp", "MatMul", ("in_1",), "model.layers.1.mlp"),
        NodeInfo(1, "norm", "Mul", ("in_10",), "model.layers.10.input_layernorm"),
    ]
    graph = SimpleNamespace(
        has_scopes=True,
        nodes=nodes,
        graph_outputs=frozenset(),
        graph_file="prefill.onnx",
        dims={"in_1": ("batch_size", 4), "in_10": ("batch_size", 4)},
        axes=PositionAxes("batch_size", frozenset({"sequence_length"})),
    )
    values = {"in_1": np.ones((1, 4), np.float32), "in_10": np.zeros((1, 4), np.float32)}
    result = probe_reference(
        graph,
        values,
        {"model.layers.1": values["in_1"]},
        profile_for("float32").kv,
        np.ones((1, 3), np.int64),
        PREFILL_BATCH,
    )
    assert result.first is None and result.checked == 1, result


def test_the_probe_judges_real_positions_only(probed):
    # A model may leave a padded position arbitrary (nothing real reads it): a difference there is no
    # divergence, against the reference or between two runs; one at a single real token is named.
    debug, values, expected, tolerance, mask = probed
    assert debug.axes == PositionAxes("batch_size", frozenset({"sequence_length"}))
    padded, real = (0, slice(0, 3)), (0, 3)  # row 0's padding and its first real token
    hidden = next(o for n in debug.nodes for o in n.outputs if debug.dims[o] == ("batch_size", "sequence_length", 64))
    for tensor in ("present.0.value", hidden):
        axis = 2 if tensor.startswith("present.") else 1  # presents are (B, kv_heads, L, head_dim)
        for where, diverges in ((padded, False), (real, True)):
            changed = values[tensor].copy()
            np.moveaxis(changed, axis, 1)[where] += 1.0
            faulty = {**values, tensor: changed}
            between = probe_between(debug, faulty, values, tolerance, "changed vs run", mask, PREFILL_BATCH)
            assert (between.first is not None) == diverges, (tensor, where, between)
            assert not diverges or between.first.tensor == tensor
            if tensor.startswith("present."):
                first = probe_reference(debug, faulty, expected, tolerance, mask, PREFILL_BATCH).first
                assert (first is not None) == diverges and (first is None or first.tensor == tensor), (where, first)
    # grouped-query attention ('2*sequence_length') and lm_head's flattened rows fold the sequence: left out.
    # Judged: 162 values, each present among them as the concatenation of the empty past and the new keys/values,
    # which are judged too
    result = probe_between(debug, values, values, tolerance, "run vs run", mask, PREFILL_BATCH)
    assert result.first is None and result.checked == 162
    assert result.note.startswith("10 values left out: their shape folds the sequence")
    # a left-out value is not judged at all, not judged whole: its padded elements are not told apart
    folded = next(o for n in debug.nodes for o in n.outputs if "2*sequence_length" in debug.dims[o])
    changed = {**values, folded: values[folded] + 1.0}
    result = probe_between(debug, changed, values, tolerance, "changed vs run", mask, PREFILL_BATCH)
    assert result.first is None and result.checked == 162, result


def test_the_values_fed_by_a_mask_fill_are_those_computed_from_it_before_the_softmax():
    # an initializer is a fill only when it holds nothing but the fills (-inf, -1e9): a constant holding one
    # among other values is not, nor an empty one
    from exporter.verify.diagnosis.probe import mask_fed_values

    helper = onnx.helper
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["fill", "x"], ["scores"]),
            helper.make_node("Softmax", ["scores"], ["weights"]),
            helper.make_node("Mul", ["weights", "x"], ["mixed_out"]),
            helper.make_node("Add", ["mixed", "x"], ["other"]),
            helper.make_node("Concat", ["empty", "x"], ["joined"], axis=0),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [],
        [
            onnx.numpy_helper.from_array(np.array([-np.inf, -1e9], np.float32), "fill"),
            onnx.numpy_helper.from_array(np.array([-1e9, 1.0], np.float32), "mixed"),
            onnx.numpy_helper.from_array(np.zeros(0, np.float32), "empty"),
        ],
    )
    assert mask_fed_values(graph) == {"fill", "scores"}


def test_a_values_real_elements_follow_its_batch_and_position_axes():
    axes = PositionAxes("batch_size", frozenset({"sequence_length"}))
    mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1]])
    real = mask == 1
    scores = real_elements(("batch_size", 4, "sequence_length", "sequence_length"), (2, 4, 4, 4), axes, mask)
    assert np.array_equal(scores, real[:, None, :, None] & real[:, None, None, :])  # (B, 1, query, key)
    present = real_elements(("batch_size", 2, "sequence_length", 16), (2, 2, 4, 16), axes, mask)
    assert np.array_equal(present, real[:, None, :, None])
    hidden = real_elements(("batch_size", "sequence_length", 64), (2, 4, 64), axes, mask)
    assert np.array_equal(hidden, real[:, :, None])
    # a causal mask (no batch axis) and a per-row value (no position axis) cannot depend on a row's padding
    for dims in (("sequence_length", "sequence_length"), ("batch_size", 64), ()):
        whole = real_elements(dims, (4,) * len(dims), axes, mask)
        assert whole.shape == (1,) * len(dims) and whole.all(), dims
    for dims in (
        ("sequence_length*batch_size", 64),
        ("batch_size", 2, "2*sequence_length", 16),
        ("batch_size", "sequence_length - 1"),
        (None, 4, "sequence_length", None),
    ):
        assert real_elements(dims, (8,) * len(dims), axes, mask) is None, dims
    assert real_elements(("sequence_length*batch_size", 64), (8, 64), axes, np.ones((2, 4))).all()
    # a query axis shorter than the mask covers its last positions (a graph with a past names them apart)
    apart = PositionAxes("batch", frozenset({"sequence", "total"}))
    scores = real_elements(("batch", 4, "sequence", "total"), (2, 4, 2, 4), apart, mask)
    assert np.array_equal(scores, real[:, None, 2:, None] & real[:, None, None, :])
