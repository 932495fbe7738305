"""The verification engine end to end on the tiny artifacts: curve, sweep, invariants, health,
localisation of a perturbed weight, golden bundles without torch, reports."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np
import onnx
import pytest

from exporter.errors import ArtifactError, OutputPathError, ToolkitError
from exporter.manifest import read_manifest, sha256_file
from exporter.reference_runner import TorchRunner
from exporter.runtime import OrtRunner
from exporter.verify import checks, invariants
from exporter.verify.engine import verify_artifact
from exporter.verify.golden import (GoldenMismatch, RecordedReference, _recording_digest, check_golden_destination,
                                    load_bundle)
from exporter.verify.inputs import PREFILL_BATCH, ParitySettings, prefill_feeds, prompt_batch
from exporter.verify.localise import probe_between, probe_reference
from exporter.verify.metrics import Needed, compare, real_queries
from exporter.verify.probe import DebugGraph, PositionAxes, real_elements
from exporter.verify.reports import format_verify, json_text, render_html, render_junit
from exporter.verify.tolerances import Overrides, profile_for
from helpers import (assert_one_line_error, claim_seed, edit_manifest, perturb_weight, run_cli,
                     scale_inline_weight)

QUICK = ParitySettings(decode_steps=2, greedy_tokens=4, sweep=False, probe=True)


@pytest.fixture(scope="module")
def full(artifact_fp32, tiny_model, tmp_path_factory):
    """One default verification (64 steps, sweep on) with the probe, recording a golden bundle."""
    bundle = tmp_path_factory.mktemp("golden")
    report = verify_artifact(artifact_fp32, tiny_model, ["cpu"], ParitySettings(probe=True), genai=False,
                             golden_save=bundle)
    return report, bundle


def test_default_verification_covers_curve_sweep_invariants_and_health(full):
    report, _ = full
    assert report.passed, format_verify(report)
    [cpu] = report.reports
    assert report and cpu  # truthy as they pass
    assert len(cpu.curve) == 65 and [s.tokens for s in cpu.curve[-2:]] == [1, 3]
    assert {(c.batch, c.new_tokens, c.past) for c in cpu.sweep} == {
        (b, n, p) for b in (1, 2, 3) for n in (1, 2, 7, 64) for p in (0, 1, 17)}
    assert [i.passed for i in report.invariants] == [True] * 6  # the sixth: a float32 export computes in float32
    assert cpu.health.passed and cpu.health.nan == cpu.health.zero_rows == 0
    assert cpu.repeat.max_abs == 0  # the CPU provider is deterministic
    # judged with float32's own profile: float16's (16 units of its 11 bits) is ~60x looser
    assert cpu.profile == profile_for("float32", "cpu")
    assert {(c.kind, c.tolerance) for c in cpu.comparisons} == {
        (kind, cpu.profile[kind]) for kind in ("logits", "kv", "loss")}
    logits = cpu.comparisons[0]
    assert logits.llm["top1_agreement"] == 1.0 and logits.llm["kl_mean"] < 1e-9 and logits.cosine > 0.999999
    assert 0 < logits.needed.scale < 1 and cpu.localisation.first_layer is None
    assert cpu.localisation.probe.first is None and cpu.localisation.probe.checked >= 10
    assert cpu.localisation.decode_probe.first is None and cpu.localisation.decode_probe.checked >= 10


def test_health_flags_zero_rows_and_nan_that_outputs_hide():
    from exporter.verify.health import HealthScan
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
    from exporter.verify.health import HealthScan
    values = {"pow_2": np.array([np.inf, 4.0e4, 1.0], np.float16),
              "mask": np.array([-np.inf, -5.0], np.float16),  # the attention mask's fill, -inf
              "bias": np.array([np.inf], np.float32)}
    scan = HealthScan("float16")
    scan.scan_activations(values, mask_fed=frozenset({"mask"}))
    report = scan.report()
    assert not report.passed and report.inf == 1 and report.activation_max_abs == 4.0e4
    scan = HealthScan("float16")
    scan.scan_activations(values, {"pow_2": "Pow in model.layers.0.input_layernorm"}, frozenset({"mask"}))
    report = scan.report()
    assert report.issues == ["activation pow_2 (Pow in model.layers.0.input_layernorm): 1 +Inf, float16 overflow "
                             "(beyond 65504); compute it in float32"]


def test_health_flags_saturation_and_an_infinity_no_mask_explains():
    # A float16 norm that overflows can saturate at +-65504 instead of giving Inf. The export masks attention with
    # -inf (reference/layers.py), never with float16's lowest value: -Inf is its mask only in a value computed
    # from that fill, and +-65504 is saturation wherever it is.
    from exporter.verify.health import HealthScan
    saturated_row = np.array([[65504.0] * 4, [1.0, -2.0, 3.0, 0.5]], np.float16)
    scan = HealthScan("float16")
    scan.scan_activations({"mlp": saturated_row, "scores": np.array([-np.inf, 3.0], np.float16)},
                          {"mlp": "Mul in model.layers.0.mlp"}, frozenset({"scores"}))
    report = scan.report()
    assert not report.passed and (report.saturated, report.inf) == (4, 0)
    assert report.issues == ["activation mlp (Mul in model.layers.0.mlp): 4 at +-65504, saturated at float16's "
                             "limit (an overflow held there instead of Inf); compute it in float32"]
    assert report.activation_max_abs == 65504 and report.activation_at == "mlp" and report.headroom == 1.0
    assert report.warnings == ["largest value 6.55e+04 at mlp is within 16x of float16's limit 65504"]

    overflowed = {"norm": np.array([-np.inf, 2.0], np.float16), "scores": np.array([-65504.0, 1.0], np.float16)}
    scan = HealthScan("float16")
    scan.scan_activations(overflowed, mask_fed=frozenset({"scores"}))
    report = scan.report()
    assert not report.passed and (report.inf, report.saturated) == (1, 1)
    assert report.issues == ["activation norm: 1 -Inf, float16 overflow (beyond 65504); compute it in float32",
                             "activation scores: 1 at +-65504, saturated at float16's limit (an overflow held "
                             "there instead of Inf); compute it in float32"]
    assert report.to_dict()["saturated"] == 1


@pytest.mark.parametrize("artifact", ["artifact_fp32", "artifact_fp16"])
def test_the_health_scan_excuses_the_exports_attention_mask_and_nothing_after_it(artifact, request):
    # The debug copy knows the values computed from the mask's fill up to the softmax: every value of the export
    # holding -inf is one of them, and no value the softmax computes is. A float16 export scans clean with them,
    # and fails on a row of its first MLP's output saturated at 65504.
    from exporter.verify.health import HealthScan
    folder = request.getfixturevalue(artifact)
    manifest = read_manifest(folder)
    debug = DebugGraph(folder, manifest, manifest.prefill)
    values = debug.run(prefill_feeds(manifest, prompt_batch(manifest, QUICK, np.random.default_rng(0))))
    holding_fill = {name for name, value in values.items() if np.isneginf(value).any()}
    assert holding_fill and holding_fill <= debug.mask_fed
    after_softmax = {o for n in debug.nodes if n.op_type == "Softmax" for o in n.outputs}
    assert after_softmax and not after_softmax & debug.mask_fed
    assert {n.module for n in debug.nodes if set(n.outputs) & debug.mask_fed} == {"model.layers.0.self_attn",
                                                                                   "model.layers.1.self_attn"}
    producers = {o: f"{n.op_type} in {n.module}" for n in debug.nodes for o in n.outputs}
    clean = HealthScan(manifest.dtype)
    clean.scan_activations(values, producers, debug.mask_fed)
    assert clean.report().passed and clean.report().saturated == 0
    if manifest.dtype == "float16":
        mlp = next(o for n in debug.nodes if n.module == "model.layers.0.mlp" for o in n.outputs
                   if values[o].dtype == np.float16)
        saturated = values[mlp].copy()
        saturated[0, -1] = 65504.0  # row 0's last token, a real one
        scan = HealthScan("float16")
        scan.scan_activations({**values, mlp: saturated}, producers, debug.mask_fed)
        report = scan.report()
        assert not report.passed and report.saturated == saturated.shape[-1] and report.activation_at == mlp
        assert report.issues[0].startswith(f"activation {mlp} ({producers[mlp]}): {saturated.shape[-1]} at +-65504")


def test_localisation_names_the_perturbed_layer_and_operator(artifact_copy, tiny_model):
    perturb_weight(artifact_copy, "model.layers.1.self_attn.k_proj", 0.05)
    report = verify_artifact(artifact_copy, tiny_model, ["cpu"], QUICK, genai=False)
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
    assert ("localisation: first diverging layer 1 (prefill present): the fault lies in layer 1's input norm or "
            "key/value path, or in layer 0's query path, attention, output projection or MLP") in text
    assert first.node in text
    # The invariants hold whatever the weights: they cannot see this fault.
    assert all(i.passed for i in report.invariants)


def test_localisation_places_a_fault_after_the_last_layers_key_value_path(artifact_copy, tiny_model):
    # A layer's present depends on that layer's input alone: failing logits with every present passing put the
    # fault after the last layer's key/value projections (here in its MLP).
    perturb_weight(artifact_copy, "model.layers.1.mlp.down_proj", 0.05)
    report = verify_artifact(artifact_copy, tiny_model, ["cpu"], QUICK, genai=False)
    [cpu] = report.reports
    assert cpu.comparisons[0].needed.scale > 1000 and all(layer.passed for layer in cpu.layers)
    assert all(step.first_failing_layer is None for step in cpu.curve)
    located = report.to_dict()["providers"][0]["localisation"]
    assert located["first_layer"] is None and located["where"] == "prefill logits diverge, every layer's present passing"
    assert located["fault_in"] == ("after layer 1's key/value path: in layer 1's query path, attention, output "
                                   "projection or MLP, the final norm or lm_head")
    assert located["probe"]["first"]["module"] == "model.layers.1.mlp.down_proj"
    assert ("localisation: prefill logits diverge, every layer's present passing: the fault lies after layer 1's "
            "key/value path") in format_verify(report)


@pytest.mark.parametrize("artifact", ["artifact_fp32", "artifact_fp16"])
def test_the_debug_copy_computes_with_the_artifacts_weights(artifact, request):
    # ONNX Runtime drops a given initializer that an optimisation folds (the CPU casts float16 weights) and
    # reads the weights file instead: the debug copy must then find the artifact's, not a stand-in.
    folder = request.getfixturevalue(artifact)
    manifest = read_manifest(folder)
    feeds = prefill_feeds(manifest, prompt_batch(manifest, QUICK, np.random.default_rng(0)))
    exposed = DebugGraph(folder, manifest, manifest.prefill).run(feeds)
    logits = OrtRunner(folder, manifest=manifest).prefill(feeds)["logits"]
    # The same graph, fused differently around the exposed values: rounding apart.
    assert compare("logits", "logits", exposed["logits"], logits, profile_for(manifest.dtype).logits).passed
    assert np.abs(logits).max() > 1


def test_golden_bundle_replays_without_torch_and_rejects_other_artifacts(full, artifact_fp32, artifact_copy):
    report, bundle = full
    code = textwrap.dedent(f"""
        import sys, json
        for blocked in ("torch", "onnxscript", "tokenizers", "safetensors", "onnxruntime_genai"):
            sys.modules[blocked] = None  # any import of it now fails: a replay needs none of them
        from exporter.verify.engine import verify_artifact
        golden = verify_artifact({str(artifact_fp32)!r}, None, ["cpu"], golden={str(bundle)!r}, genai=False)
        alone = verify_artifact({str(artifact_fp32)!r}, None, ["cpu"])
        print(json.dumps([golden.passed, golden.reference, len(golden.reports[0].curve), len(golden.reports[0].sweep),
                          [[c.name, c.max_abs] for c in golden.reports[0].comparisons], alone.passed,
                          alone.reference, len(alone.invariants), len(alone.reports)]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    passed, reference, steps, sweep, rows, alone_passed, alone_reference, invariants, providers = json.loads(
        out.stdout.strip().splitlines()[-1])
    assert passed and reference.startswith("golden bundle") and steps == 65 and sweep == 36
    # the same rows (the loss and the presents included) with the same numbers as against the model
    assert rows == [[c.name, c.max_abs] for c in report.reports[0].comparisons]
    assert alone_passed and alone_reference == "none" and invariants == 6 and providers == 0
    perturb_weight(artifact_copy, "model.layers.0.mlp.down_proj", 0.01)
    with pytest.raises(GoldenMismatch, match="weights.onnx.data"):
        verify_artifact(artifact_copy, None, ["cpu"], golden=bundle)


@pytest.fixture(scope="module")
def broken_and_bundle(artifact_fp32, tiny_model, tmp_path_factory):
    """A copy of the tiny artifact with 0.05 added to layer 1's k_proj weight, and a golden bundle recorded while
    verifying it without the probe."""
    folder = shutil.copytree(artifact_fp32, tmp_path_factory.mktemp("broken") / "artifact")
    perturb_weight(folder, "model.layers.1.self_attn.k_proj", 0.05)
    bundle = folder.parent / "golden"
    verify_artifact(folder, tiny_model, ["cpu"], dataclasses.replace(QUICK, probe=False), genai=False,
                    golden_save=bundle)
    return folder, bundle


def test_a_golden_replay_probes_against_the_module_outputs_its_bundle_recorded(broken_and_bundle, tiny_model):
    # Recorded without --probe, the bundle still lets its replay name what a live probe names, to the value.
    folder, bundle = broken_and_bundle
    live = verify_artifact(folder, tiny_model, ["cpu"], QUICK, genai=False).reports[0].localisation
    assert live.probe.first.module == "model.layers.1.self_attn.k_proj" and live.probe.first.op_type == "MatMul"
    result = run_cli("verify", folder, "--golden", bundle, "--probe", "--provider", "cpu", "--no-genai", "--json",
                     "-q")
    assert result.exit_code == 1, result.output  # the perturbed weight fails parity
    replayed = json.loads(result.stdout)["providers"][0]["localisation"]
    assert replayed == live.to_dict(), (replayed, live)


def test_a_bundle_recorded_before_module_outputs_were_kept_replays_without_the_probe(broken_and_bundle, tmp_path):
    folder, bundle = broken_and_bundle
    manifest = read_manifest(folder)
    recorded = load_bundle(bundle, manifest)
    recorded.reference.recorded_module_outputs = {}  # saved as an earlier v4 toolkit saved it
    old = recorded.reference.save(tmp_path / "old", manifest, recorded.settings, recorded.overrides,
                                  recorded.versions)
    assert not any(name.startswith("modules/") for name in np.load(old / "arrays.npz"))
    [cpu] = verify_artifact(folder, None, ["cpu"], QUICK, genai=False, golden=old).reports
    assert cpu.localisation.first_layer == 1 and cpu.localisation.probe is None
    assert cpu.localisation.probe_skipped == ("the bundle holds no module outputs: re-record it with golden_save "
                                              "(--golden-save)")
    assert cpu.localisation.decode_probe is None
    assert cpu.localisation.decode_probe_skipped.startswith("the bundle holds no module outputs of decode step 0")


@pytest.fixture(scope="module")
def decode_fault(artifact_fp32, tiny_model, tmp_path_factory):
    """A copy of the tiny artifact whose decode.onnx alone holds layer 0's q_norm weight x1.05 (each graph carries
    its norm weights itself; the export keeps one tensor for equal norm weights, so every q_norm and k_norm that
    reads it, layer 0's keys included, is scaled too), verified with the probe while a golden bundle is recorded."""
    folder = shutil.copytree(artifact_fp32, tmp_path_factory.mktemp("decode-fault") / "artifact")
    scale_inline_weight(folder, "decode.onnx", "layers.0.self_attn.q_norm.weight", 1.05)
    bundle = folder.parent / "golden"
    report = verify_artifact(folder, tiny_model, ["cpu"], QUICK, genai=False, golden_save=bundle)
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
    # the export keeps one tensor for the equal norm weights (every q_norm and k_norm of the seeded model), so
    # layer 0's keys are scaled too: its present diverges first, at the first decode step, prefill's passing
    assert (loc.first_layer, loc.where) == (0, "decode step 0 present"), loc
    first = loc.decode_probe.first
    assert (loc.decode_probe.graph, loc.decode_probe.call) == ("decode.onnx", "decode step 0, fed the reference's past")
    assert first.module == "model.layers.0.self_attn.q_norm" and first.op_type == "Mul" and first.needed_scale > 100
    text = format_verify(report)
    assert (f"probe decode.onnx (decode step 0, fed the reference's past): first diverging checked value "
            f"{first.tensor}, computed by {first.node} (Mul) in model.layers.0.self_attn.q_norm") in text
    assert "probe prefill.onnx (the prefill batch): no checked value diverges" in text
    assert "probe: no checked value diverges" not in text


def test_the_attribution_does_not_report_an_export_that_fails_decode_as_passing(decode_fault):
    # Its one leg, "export", was the prefill logits alone and passed at 0.024x while decode.onnx failed.
    _, report, _ = decode_fault
    legs = report.attribution.legs
    assert [(leg.cause, leg.covers, leg.comparison.passed) for leg in legs] == [
        ("export", "prefill.onnx, the prefill batch", True),
        ("export", "decode.onnx, the 3 decode steps after it", False)]
    assert legs[1].comparison.max_abs == max(s.logits.max_abs for s in report.reports[0].curve)
    text = format_verify(report)
    assert re.search(r"\nexport +decode\.onnx, the 3 decode steps after it +\S+ +\S+x +FAIL\n", text), text
    assert "repeat run of the prefill batch (nondeterminism)" in text  # it reruns the prefill batch only
    assert [leg["covers"] for leg in report.to_dict()["attribution"]["legs"]] == [leg.covers for leg in legs]
    assert ET.fromstring(render_junit(report)).find(
        ".//testcase[@name='export leg (decode.onnx, the 3 decode steps after it)']/failure") is not None


def test_a_golden_replay_probes_decode_onnx_only_with_the_decode_calls_module_outputs(decode_fault, tmp_path):
    folder, report, bundle = decode_fault
    live = report.reports[0].localisation
    manifest = read_manifest(folder)
    [cpu] = verify_artifact(folder, None, ["cpu"], QUICK, genai=False, golden=bundle).reports
    assert cpu.localisation == live  # the same operator, the same error
    # a bundle recorded before the decode call's module outputs were kept: the prefill probe alone, and why
    recorded = load_bundle(bundle, manifest)
    recorded.reference.recorded_module_outputs.pop("decode")
    old = recorded.reference.save(tmp_path / "old", manifest, recorded.settings, recorded.overrides,
                                  recorded.versions)
    report = verify_artifact(folder, None, ["cpu"], QUICK, genai=False, golden=old)
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
    debug = DebugGraph(artifact_fp32, manifest, manifest.prefill)
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
    from exporter.verify.probe import NodeInfo
    nodes = [NodeInfo(0, "mlp", "MatMul", ("in_1",), "model.layers.1.mlp"),
             NodeInfo(1, "norm", "Mul", ("in_10",), "model.layers.10.input_layernorm")]
    graph = SimpleNamespace(has_scopes=True, nodes=nodes, graph_outputs=frozenset(), graph_file="prefill.onnx",
                            dims={"in_1": ("batch_size", 4), "in_10": ("batch_size", 4)},
                            axes=PositionAxes("batch_size", frozenset({"sequence_length"})))
    values = {"in_1": np.ones((1, 4), np.float32), "in_10": np.zeros((1, 4), np.float32)}
    result = probe_reference(graph, values, {"model.layers.1": values["in_1"]}, profile_for("float32").kv,
                             np.ones((1, 3), np.int64), PREFILL_BATCH)
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
    # grouped-query attention ('2*sequence_length') and lm_head's flattened rows fold the sequence: left out
    result = probe_between(debug, values, values, tolerance, "run vs run", mask, PREFILL_BATCH)
    assert result.first is None and result.checked == 158
    assert result.note.startswith("10 values left out: their shape folds the sequence")
    # a left-out value is not judged at all, not judged whole: its padded elements are not told apart
    folded = next(o for n in debug.nodes for o in n.outputs if "2*sequence_length" in debug.dims[o])
    changed = {**values, folded: values[folded] + 1.0}
    result = probe_between(debug, changed, values, tolerance, "changed vs run", mask, PREFILL_BATCH)
    assert result.first is None and result.checked == 158, result


def test_the_values_fed_by_a_mask_fill_are_those_computed_from_it_before_the_softmax():
    # an initializer is a fill only when it holds nothing but the fills (-inf, -1e9): a constant holding one
    # among other values is not, nor an empty one
    from exporter.verify.probe import mask_fed_values
    helper = onnx.helper
    graph = helper.make_graph(
        [helper.make_node("Add", ["fill", "x"], ["scores"]), helper.make_node("Softmax", ["scores"], ["weights"]),
         helper.make_node("Mul", ["weights", "x"], ["mixed_out"]), helper.make_node("Add", ["mixed", "x"], ["other"]),
         helper.make_node("Concat", ["empty", "x"], ["joined"], axis=0)],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])], [],
        [onnx.numpy_helper.from_array(np.array([-np.inf, -1e9], np.float32), "fill"),
         onnx.numpy_helper.from_array(np.array([-1e9, 1.0], np.float32), "mixed"),
         onnx.numpy_helper.from_array(np.zeros(0, np.float32), "empty")])
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
    for dims in (("sequence_length*batch_size", 64), ("batch_size", 2, "2*sequence_length", 16),
                 ("batch_size", "sequence_length - 1"), (None, 4, "sequence_length", None)):
        assert real_elements(dims, (8,) * len(dims), axes, mask) is None, dims
    assert real_elements(("sequence_length*batch_size", 64), (8, 64), axes, np.ones((2, 4))).all()
    # a query axis shorter than the mask covers its last positions (a graph with a past names them apart)
    apart = PositionAxes("batch", frozenset({"sequence", "total"}))
    scores = real_elements(("batch", 4, "sequence", "total"), (2, 4, 2, 4), apart, mask)
    assert np.array_equal(scores, real[:, None, 2:, None] & real[:, None, None, :])


def test_a_damaged_or_half_saved_bundle_is_refused_as_damaged(full, artifact_fp32, tmp_path):
    manifest = read_manifest(artifact_fp32)

    def damaged(edit_arrays=None, edit_meta=None, rehash=True, edit_file=None):
        folder = tmp_path / f"bundle{len(list(tmp_path.iterdir()))}"
        shutil.copytree(full[1], folder)
        arrays = dict(np.load(folder / "arrays.npz"))
        if edit_arrays:
            edit_arrays(arrays)
            with open(folder / "arrays.npz", "wb") as f:
                np.savez(f, **arrays)
        if edit_file:
            edit_file(folder / "arrays.npz")
        meta = json.loads((folder / "golden.json").read_text())
        if rehash:
            meta["arrays_sha256"] = sha256_file(folder / "arrays.npz")
        if edit_meta:
            edit_meta(meta)
        if rehash:  # as a careful forger would: both hashes match, so what is checked is the content
            meta["recording_sha256"] = _recording_digest(meta)
        (folder / "golden.json").write_text(json.dumps(meta))
        with pytest.raises(ToolkitError) as caught:
            load_bundle(folder, manifest)
        assert "is damaged" in str(caught.value)
        assert "re-record it with golden_save (--golden-save)" in str(caught.value)
        return str(caught.value)

    def shift(arrays):
        arrays["0/out/logits"] = arrays["0/out/logits"] + 1

    # a save interrupted between its two files, or a value edited since: the arrays' hash differs
    assert "sha256 differs" in damaged(shift, rehash=False)
    # an edited greedy id, valid but not what the reference chose
    assert "greedy runs, settings or overrides in golden.json changed" in damaged(
        edit_meta=lambda m: m["greedy"][0]["ids"].__setitem__(5, 7), rehash=False)
    # the tolerance overrides the recording was judged with, which a replay applies: edited, left out or unreadable
    assert "overrides in golden.json changed" in damaged(edit_meta=lambda m: m.update(overrides={"logits.peak": 1}),
                                                         rehash=False)
    assert "golden.json records no tolerance overrides, which a v4 bundle holds" in damaged(
        edit_meta=lambda m: m.pop("overrides"), rehash=False)
    assert "golden.json overrides logits.atol: 'loose' is not a number" in damaged(
        edit_meta=lambda m: m.update(overrides={"logits.atol": "loose"}))
    assert "golden.json overrides: 'logits' is no tolerance term" in damaged(
        edit_meta=lambda m: m.update(overrides={"logits": 1e-3}))
    assert "logits has shape" in damaged(lambda a: a.update({"0/out/logits": a["0/out/logits"][:, :, :7]}))
    assert "holds the outputs" in damaged(lambda a: a.pop("0/out/present.0.key"),
                                          lambda m: m["calls"][0]["outputs"].remove("present.0.key"))
    assert "settings must be integers" in damaged(edit_meta=lambda m: m["settings"].update(seed=-1))
    assert "outside the vocabulary" in damaged(edit_meta=lambda m: m["greedy"][0].update(ids=["1", "2"]))
    vocab = manifest.config.vocab_size  # one past the last id; a greedy run of no new tokens
    assert f"outside the vocabulary [0, {vocab})" in damaged(
        edit_meta=lambda m: m["greedy"][0]["ids"].__setitem__(0, vocab))
    assert "or 0 new tokens" in damaged(edit_meta=lambda m: m["greedy"][0].update(max_new_tokens=0))
    # the module outputs a replay's probe reads: a value edited, a present cut or lost, a value of integers, the
    # token feeds cut or lost
    present, head, positions = "modules/out/present.1.key", "modules/out/lm_head", "modules/feed/position_ids"
    assert "sha256 differs" in damaged(lambda a: a.update({head: a[head] + 1}), rehash=False)
    assert "module outputs: present.1.key has shape" in damaged(lambda a: a.update({present: a[present][:, :, :5]}))
    assert "lack the presents ['present.1.key']" in damaged(lambda a: a.pop(present))
    assert "['lm_head'] hold no floating-point values" in damaged(lambda a: a.update({head: a[head].astype(int)}))
    assert "token feeds have shapes" in damaged(lambda a: a.update({positions: a[positions][:, :5]}))
    assert "KeyError: 'input_ids'" in damaged(lambda a: a.pop("modules/feed/input_ids"))

    # arrays.npz that is no archive at all: refused on its hash, or (hash forged) as no archive, never with numpy's
    # advice to load it unpickled
    garbage = damaged(edit_meta=None, rehash=False, edit_file=lambda f: f.write_bytes(b"PK not an archive"))
    assert "sha256 differs" in garbage and "pickle" not in garbage
    forged = damaged(edit_file=lambda f: f.write_bytes(b"\x80\x04 pickled"))
    assert "arrays.npz is no npz (zip) archive" in forged and "pickle" not in forged

    bundle = load_bundle(full[1], manifest)
    blocked = tmp_path / "blocked"
    (blocked / "arrays.npz").mkdir(parents=True)  # the swap into place fails
    with pytest.raises(OutputPathError, match="cannot write the golden bundle"):
        bundle.reference.save(blocked, manifest, bundle.settings, bundle.overrides, bundle.versions)
    assert [p.name for p in blocked.iterdir()] == ["arrays.npz"]  # no partial file left


def test_golden_save_over_another_artifacts_bundle_is_refused_and_over_its_own_re_records(full, artifact_fp32,
                                                                                          artifact_fp16):
    # --golden-save DIR replaced a bundle recorded from another artifact, silently.
    _, bundle = full
    before = (bundle / "golden.json").read_bytes()
    assert_one_line_error(run_cli("verify", artifact_fp16, "--golden-save", bundle, "-q"), 2,
                          f"golden_save (--golden-save) {bundle} holds a golden bundle recorded from another model "
                          "(differs in dtype: bundle float32, artifact float16), which this save would replace; "
                          "remove it or choose another folder")
    assert (bundle / "golden.json").read_bytes() == before
    check_golden_destination(bundle, read_manifest(artifact_fp32))  # the bundle's own artifact: re-recorded


def test_an_interrupted_first_golden_save_leaves_a_folder_the_next_save_accepts(artifact_fp32, tmp_path,
                                                                                  monkeypatch):
    folder = tmp_path / "golden"
    folder.mkdir()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("exporter.verify.golden.np.savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        RecordedReference().save(folder, read_manifest(artifact_fp32), ParitySettings(), Overrides(), {})
    assert list(folder.iterdir()) == []
    check_golden_destination(folder)  # an empty folder, not one that "holds no golden bundle"
    # the folders it made for the bundle are removed again: they stayed behind, empty
    with pytest.raises(KeyboardInterrupt):
        RecordedReference().save(tmp_path / "new" / "golden", read_manifest(artifact_fp32), ParitySettings(),
                                 Overrides(), {})
    assert list(tmp_path.iterdir()) == [folder]


def test_a_golden_save_interrupted_between_its_two_swaps_leaves_the_older_bundle_whole(full, artifact_fp32,
                                                                                        tmp_path, monkeypatch):
    """The new arrays were swapped in, then a Ctrl-C before the index: the older bundle was lost, refused as
    damaged ("sha256 differs")."""
    manifest = read_manifest(artifact_fp32)
    folder = shutil.copytree(full[1], tmp_path / "golden")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    replace = os.replace

    def ctrl_c_before_the_index(source, destination):
        if Path(destination).name == "golden.json":
            raise KeyboardInterrupt
        replace(source, destination)
    monkeypatch.setattr("exporter.verify.golden.os.replace", ctrl_c_before_the_index)
    with pytest.raises(KeyboardInterrupt):
        RecordedReference().save(folder, manifest, ParitySettings(), Overrides(), {})
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # and no hidden file left
    load_bundle(folder, manifest)


def test_a_second_golden_save_into_one_folder_waits_for_the_first(full, artifact_fp32, tmp_path):
    """Two saves into one bundle folder: their swaps interleaved could pair one's index with the other's arrays."""
    manifest = read_manifest(artifact_fp32)
    folder = shutil.copytree(full[1], tmp_path / "golden")
    bundle = load_bundle(folder, manifest)
    other = subprocess.Popen([sys.executable, "-c", f"""if True:
        import time
        from pathlib import Path
        from exporter.paths import folder_lock
        with folder_lock(Path({str(folder)!r})):
            print("saving", flush=True)
            time.sleep(1)  # the other save, slowed down: it swaps in its index last
            Path({str(folder / "golden.json")!r}).write_text("theirs")
        """], stdout=subprocess.PIPE, text=True)
    assert other.stdout.readline() == "saving\n"
    bundle.reference.save(folder, manifest, bundle.settings, bundle.overrides, bundle.versions)
    assert other.wait() == 0
    load_bundle(folder, manifest)  # this save's index and arrays, together


def test_a_bundle_of_another_format_version_is_refused(full, artifact_fp32, tmp_path):
    # Version 3 recorded no overrides and other prefill labels; a later version is a later toolkit's.
    manifest = read_manifest(artifact_fp32)
    old = shutil.copytree(full[1], tmp_path / "v3")
    meta = json.loads((old / "golden.json").read_text())
    assert meta["format_version"] == 4 and meta["overrides"] == {}
    for version, way_out in ((3, "re-record it"), (5, "a later version of this toolkit wrote it: upgrade the "
                                                     "toolkit, or re-record it")):
        meta["format_version"] = version
        (old / "golden.json").write_text(json.dumps(meta))
        with pytest.raises(ToolkitError, match=f"is format 'minimind-onnx-golden' v{version}, expected "
                                               f"'minimind-onnx-golden' v4; {way_out} with golden_save"):
            load_bundle(old, manifest)


def test_a_golden_replay_runs_with_the_settings_it_was_recorded_with(artifact_fp32, tiny_model, tmp_path):
    # Recorded with another seed and without the sweep; replayed with the default settings given, which the
    # bundle's replace (the default seed draws other prompts, which the recording does not hold).
    recorded = ParitySettings(seed=7, decode_steps=1, greedy_tokens=3, sweep=False)
    bundle = tmp_path / "bundle"
    assert verify_artifact(artifact_fp32, tiny_model, ["cpu"], recorded, genai=False, golden_save=bundle).passed
    replay = verify_artifact(artifact_fp32, None, ["cpu"], golden=bundle, genai=False)
    assert replay.passed, format_verify(replay)
    assert {k: replay.settings[k] for k in ("seed", "decode_steps", "greedy_tokens", "sweep")} == {
        "seed": 7, "decode_steps": 1, "greedy_tokens": 3, "sweep": False}
    assert replay.reports[0].sweep == [] and len(replay.reports[0].curve) == 2

def test_a_replay_fed_other_tokens_than_recorded_is_a_mismatch_not_a_failure():
    """The module's promise: replayed outputs are only handed out for the token inputs they were recorded with;
    other inputs (a toolkit that draws its prompts differently, say) must not read as a parity failure."""
    from exporter.verify.golden import RecordedReference
    ids = np.array([[5, 9, 100]])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(3)[None]}
    recorded = RecordedReference(None, [("prefill", feeds, {"logits": np.zeros((1, 3, 4), np.float32)})])
    assert recorded.prefill(feeds)["logits"].shape == (1, 3, 4)
    for changed in ({"input_ids": ids + 1}, {"attention_mask": np.array([[0, 1, 1]])}):
        recorded.rewind()
        with pytest.raises(GoldenMismatch, match="call 0 \\(prefill\\) does not match the recording"):
            recorded.prefill({**feeds, **changed})
    labelled = RecordedReference(None, [("prefill", {**feeds, "labels": ids}, {"logits": np.zeros((1, 3, 4))})])
    with pytest.raises(GoldenMismatch, match="call 0 \\(prefill\\) does not match the recording"):
        labelled.prefill(feeds)  # recorded with labels (the loss), replayed without: other inputs
    recorded.rewind()
    with pytest.raises(GoldenMismatch, match="call 0 \\(decode\\) does not match"):
        recorded.decode(feeds)
    assert recorded.module_outputs(feeds) is None  # none recorded: the probe says so
    norm = {"model.norm": np.ones((1, 3, 4), np.float32)}
    probed = RecordedReference(None, module_outputs={"prefill": (feeds, norm)})
    assert probed.module_outputs(feeds)["model.norm"].shape == (1, 3, 4)
    with pytest.raises(GoldenMismatch, match="module outputs were recorded for other inputs"):
        probed.module_outputs({**feeds, "input_ids": ids + 1})
    # a bundle keeps one decode call's: another decode call (a replay failing at another step) is not probed
    step = {"input_ids": ids[:, :1], "attention_mask": np.ones((1, 4), np.int64), "position_ids": np.array([[3]])}
    assert probed.module_outputs(step, "decode") is None
    probed.recorded_module_outputs["decode"] = (step, {"model.norm": np.ones((1, 1, 4), np.float32)})
    assert probed.module_outputs(step, "decode")["model.norm"].shape == (1, 1, 4)
    assert probed.module_outputs({**step, "input_ids": ids[:, 1:2]}, "decode") is None


def test_golden_bundle_of_another_dtype_is_a_mismatch_not_a_failure(full, artifact_fp16, artifact_fp32, tmp_path):
    with pytest.raises(GoldenMismatch, match="another model \\(differs in dtype: bundle float32, artifact float16\\)"):
        verify_artifact(artifact_fp16, None, ["cpu"], golden=full[1])
    # another config of the same dtype: the dtype is not named (it read "bundle float32, artifact float32")
    other = shutil.copytree(full[1], tmp_path / "other")
    meta = json.loads((other / "golden.json").read_text())
    meta["artifact"]["config"]["rms_norm_eps"] = 1e-5
    (other / "golden.json").write_text(json.dumps(meta))
    with pytest.raises(GoldenMismatch) as caught:
        load_bundle(other, read_manifest(artifact_fp32))
    assert "belongs to another model (differs in rms_norm_eps); " in str(caught.value)
    # a bundle of another family differed in some 25 fields, every one listed; the first five and a count now
    meta["artifact"]["config"] = {f"field_{i:02d}": i for i in range(8)}
    (other / "golden.json").write_text(json.dumps(meta))
    with pytest.raises(GoldenMismatch) as caught:
        load_bundle(other, read_manifest(artifact_fp32))
    assert re.search(r"\(differs in [34]\d config fields, among them attn_implementation, bos_token_id, dropout, "
                     r"eos_token_id, field_00\); verify against", str(caught.value)), caught.value
    manifest = read_manifest(artifact_fp32)  # a graph re-exported alone (its weights unchanged) is another export
    for graph in (manifest.prefill.file, manifest.decode.file):
        meta = json.loads((full[1] / "golden.json").read_text())
        meta["artifact"]["sha256"][graph] = "0" * 64
        (other / "golden.json").write_text(json.dumps(meta))
        with pytest.raises(GoldenMismatch, match=f"was recorded from another export: {graph} differ"):
            load_bundle(other, manifest)


def test_junit_and_html_reports(full, tmp_path):
    report, _ = full
    suites = ET.fromstring(render_junit(report))
    cases = suites.findall(".//testcase")
    assert len(cases) >= 36 + 5 and not suites.findall(".//failure")
    assert {s.get("name") for s in suites} >= {"CPUExecutionProvider float32", "invariants", "attribution"}
    page = render_html(report)
    assert "Attribution (export / provider / precision)" in page and "<td>export</td>" in page
    for plot in ("decode-curve", "layer-errors", "logit-histogram"):
        assert f'class="plot {plot}"' in page
    offline = page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # a namespace name, never fetched
    for fetch in ("<script", "http://", "https://", "src=", "url(", "@import", "<link"):
        assert fetch not in offline, fetch


def test_reports_of_a_broken_run_stay_readable_and_name_what_failed(full):
    # A folder name with XML-forbidden and markup characters; a sweep case failing on present alone;
    # a decode curve holding NaN and Inf, as a model whose outputs overflowed gives.
    report, _ = full
    [cpu] = report.reports
    case = cpu.sweep[5]
    kv = dataclasses.replace(case.kv, max_abs=0.5, passed=False, needed=Needed(0.5, 0.5, 3000.0))
    curve = [dataclasses.replace(s, logits=dataclasses.replace(s.logits, max_abs=value))
             for s, value in zip(cpu.curve, [float("nan"), float("inf")] + [s.logits.max_abs for s in cpu.curve[2:]])]
    broken = dataclasses.replace(report, folder="art\x01<&>", reports=[dataclasses.replace(
        cpu, sweep=[*cpu.sweep[:5], dataclasses.replace(case, kv=kv), *cpu.sweep[6:]], curve=curve)])

    suites = ET.fromstring(render_junit(broken))  # parses: the control character is replaced
    assert suites.get("name") == "verify art\ufffd<&>" and suites.get("time") == f"{report.seconds:.3f}"
    assert int(suites.get("tests")) == len(suites.findall(".//testcase"))
    assert int(suites.get("failures")) == len(suites.findall(".//failure")) == 1
    [failure] = suites.findall(".//failure")
    assert "present max abs 0.5 (3e+03x tol, FAIL)" in failure.text and "logits max abs" in failure.text
    assert failure.get("message") == failure.text[:200]  # what a CI system lists without opening the case

    text = format_verify(broken)
    assert f"3e+03x (present) at {case.name}" in text  # the summary row: the worse of the two outputs
    assert f"sweep FAIL: {case.name}: logits max abs" in text
    [row] = [line for line in text.splitlines() if line.startswith("shape sweep (36 shapes)")]
    [header] = [line for line in text.splitlines() if line.startswith(f"{cpu.provider} (")]
    assert row.split()[-1] == "FAIL" and header.endswith(": FAIL") and text.split("\n")[-1].startswith("overall: FAIL")

    document = broken.to_dict()  # the provider fails on its sweep alone: every comparison row passes
    assert all(c["passed"] for c in document["providers"][0]["comparisons"])
    assert document["providers"][0]["passed"] is False and document["passed"] is False

    def not_json(constant):
        raise AssertionError(f"{constant} is not JSON")
    steps = json.loads(json_text(document), parse_constant=not_json)["providers"][0]["decode_curve"]
    assert [s["logits_max_abs"] for s in steps[:3]] == [None, None, curve[2].logits.max_abs]

    page = render_html(broken)
    assert "art\x01&lt;&amp;&gt;" in page and "2 not finite, not drawn" in page
    assert not re.search(r'="[^"]*\b(nan|inf)\b', page)  # no SVG attribute holds a non-finite number
    assert ': FAIL</title>' in page and "<span class='FAIL'>FAIL</span></h1>" in page
    assert f'{cpu.provider} (float32): <span class="FAIL">FAIL</span></h2>' in page

    # MoE routing: one failing call's flip explained by a near-tie, another's not: the row fails
    from types import SimpleNamespace
    def flip(explained):
        return SimpleNamespace(explained=explained, describe=lambda: f"flip explained {explained}")
    routed = dataclasses.replace(cpu, prefill_routing=flip(False),
                                 curve=[dataclasses.replace(cpu.curve[0], routing=flip(True)), *cpu.curve[1:]])
    [row] = [line for line in format_verify(dataclasses.replace(report, reports=[routed])).splitlines()
             if line.startswith("routing near-ties")]
    assert "1/2 explained" in row and row.split()[-1] == "FAIL", row
    assert "health: 0 NaN, 0 Inf, 0 saturated, 0 zero rows" in page and ": pass</li>" in page


def test_every_report_carries_a_verdict_that_no_provider_row_shows(full):
    # Every provider passes; one invariant fails and a provider did not run. The whole report's verdict (JSON
    # "passed", the HTML heading and title, the text's last line) is the report's, not its providers'; the
    # provider that did not run is listed in each format; a repeat run within tolerance but not bit-identical
    # passes and is not called deterministic; an expert choice that measured nothing is skipped, not failed.
    report, _ = full
    [cpu] = report.reports
    first, *others = report.invariants
    reason = "not available in this onnxruntime build"
    from exporter.verify.routing import ExpertAgreement  # one that measured nothing: skipped, not failed
    varied = dataclasses.replace(cpu, repeat=dataclasses.replace(cpu.repeat, max_abs=1e-7),
                                 experts=ExpertAgreement(False, 0, 0, 0, "router TopK nodes not found"))
    failing = dataclasses.replace(report, reports=[varied], skipped={"CUDAExecutionProvider": reason},
                                  invariants=[dataclasses.replace(first, passed=False, detail="graph broken"), *others])
    assert varied.passed and not failing.passed

    document = failing.to_dict()
    assert document["passed"] is False and document["providers"][0]["passed"] is True
    assert document["skipped"] == {"CUDAExecutionProvider": reason}
    assert document["providers"][0]["repeat"]["deterministic"] is False and document["providers"][0]["repeat"]["passed"]
    assert report.to_dict()["providers"][0]["repeat"]["deterministic"] is True

    text = format_verify(failing)
    assert f"CUDAExecutionProvider: skipped ({reason})" in text and text.split("\n")[-1].startswith("overall: FAIL")

    page = render_html(failing)
    assert ": FAIL</title>" in page and "<span class='FAIL'>FAIL</span></h1>" in page
    assert f"<p>CUDAExecutionProvider: skipped ({reason})</p>" in page

    suites = ET.fromstring(render_junit(failing))
    [skipped] = [s for s in suites.findall("testsuite") if s.get("name") == "skipped"]
    [case] = [c for c in skipped.findall("testcase") if c.get("name") == "CUDAExecutionProvider"]
    assert case.find("skipped").get("message") == reason
    [provider] = [s for s in suites.findall("testsuite") if s.get("name") == f"{cpu.provider} float32"]
    assert (provider.get("failures"), provider.get("skipped")) == ("0", "1"), provider.attrib
    assert (suites.get("failures"), suites.get("skipped")) == ("1", str(2 + len(report.consumers_skipped)))
    [failure] = suites.findall(".//failure")
    assert failure.text == "graph broken"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_html_report_renders_with_its_plots_in_a_headless_browser(full, tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render_html(full[0]))
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    dom = out.stdout
    assert out.returncode == 0 and "</html>" in dom, out.stderr[-2000:]
    assert dom.count("<svg") == 3 and dom.count("<polyline") == 3 and dom.count("<rect") > 10
    assert "Verification of" in dom and "PASS" in dom


def test_a_routing_near_tie_excuses_only_the_positions_its_flip_reached(artifact_copy, tiny_model):
    """A real fault that fails every shape, with stand-in expert choices: a flip explained by near-ties leaves
    out of the comparison the positions it reached and nothing else, so the fault still fails every call with
    a position left to judge. A flip that is not a near-tie, or no differing choice at all, excuses nothing."""
    from exporter.verify.routing import CallRouting, ExpertAgreement
    from exporter.verify.checks import run_sweep
    from exporter.verify.health import HealthScan
    perturb_weight(artifact_copy, "model.layers.1.mlp.down_proj", 0.05)  # moves the logits only: the presents pass
    manifest = read_manifest(artifact_copy)
    reference, onnx = TorchRunner(tiny_model, manifest), OrtRunner(artifact_copy, manifest=manifest)
    profile = profile_for("float32", "cpu")

    def sweep(agreement, reach):
        def explain(graph, onnx_feeds, valid):
            assert graph == "decode"  # the past's prefill passes: only its presents are handed on
            return CallRouting(agreement, reach(np.shape(valid)))
        return run_sweep(reference, onnx, manifest, profile, HealthScan("float32"), np.random.default_rng(0),
                         explain)

    def everything(shape):
        return np.ones(shape, dtype=bool)

    def last_token(shape):
        reached = np.zeros(shape, dtype=bool)
        reached[:, -1] = True
        return reached
    tie = ExpertAgreement(True, 10, 9, 1, "1 of 10 differ, 1 explained")
    assert all(c.passed and c.routing_near_tie for c in sweep(tie, everything))
    cases = sweep(tie, last_token)
    assert [c.passed for c in cases] == [c.new_tokens == 1 for c in cases]  # a single new token: all reached
    assert all(c.routing_near_tie and c.routing[0].excluded == c.batch for c in cases)
    for other in (ExpertAgreement(True, 10, 9, 0, "not a tie"), ExpertAgreement(True, 10, 10, 0, "all agree"),
                  ExpertAgreement(False, 0, 0, 0, "not measured")):
        assert not any(c.passed or c.routing_near_tie for c in sweep(other, everything)), other.note


def test_a_routing_difference_is_a_near_tie_or_reached_by_an_earlier_layers_flip():
    """Two rows of two tokens, two layers, top-1 of 3 experts. A flip at layer 0 reaches, in later layers, its
    own token and the later tokens of its row (through attention): their differences follow from it whatever
    their router gaps. An earlier token of its row or a token of another row is not reached: a difference
    there is explained only as a near-tie of its own."""
    from exporter.verify.routing import _compare_choices
    from exporter.verify.metrics import Tolerance
    tolerance = Tolerance(1e-4, 1e-4)
    tie, clear = [0.5, 0.49999, 0.0], [0.9, 0.05, 0.05]  # a near-tie: experts 0 and 1 within 1e-5
    valid = np.ones((2, 2), dtype=bool)
    reference_ids = np.zeros((4, 1), dtype=np.int64)  # tokens in row order: (0, 0), (0, 1), (1, 0), (1, 1)

    def count(layer0_tie: int, layer0_flip: int, layer1_flips: list[int]):
        scores = np.array([tie if token == layer0_tie else clear for token in range(4)])
        flipped = [np.isin(np.arange(4), flips).astype(np.int64)[:, None] for flips in ([layer0_flip], layer1_flips)]
        reference = {0: (scores, reference_ids), 1: (np.array([clear] * 4), reference_ids)}
        result = _compare_choices(reference, dict(enumerate(flipped)), valid, tolerance)
        return (result.pairs, result.agreeing, result.explained), result.reached.tolist()
    # token (0, 0) flips at a near-tie; at layer 1 it and the next token of its row follow
    assert count(0, 0, [0, 1]) == ((8, 5, 3), [[True, True], [False, False]])
    # a clear flip in the other row at layer 1 is not reached
    assert count(0, 0, [2]) == ((8, 6, 1), [[True, True], [True, True]])
    # token (0, 1) flips at a near-tie; the earlier token (0, 0) is not reached by it
    assert count(1, 1, [0]) == ((8, 6, 1), [[True, True], [False, False]])
    # a flip at a clear choice is not explained; what it reached at layer 1 is
    assert count(1, 0, [0, 1]) == ((8, 5, 2), [[True, True], [False, False]])
    assert count(0, -1, []) == ((8, 8, 0), [[False, False], [False, False]])


class _DecodeFlipsAt:
    """An OrtRunner whose decode call `at` (counting from 0) returns logits and layer 1's key moved by 1 at
    its new positions, as a token routed to another expert would: a difference the next steps inherit
    through the cache."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.calls = inner, at, 0

    def prefill(self, feeds):
        return self.inner.prefill(feeds)

    def decode(self, feeds):
        outputs = self.inner.decode(feeds)
        self.calls += 1
        if self.calls - 1 != self.at:
            return outputs
        key = self.inner.manifest.cache.present(1, "key")
        moved = outputs[key].copy()
        moved[:, :, -feeds["input_ids"].shape[1]:] += 1
        return {**outputs, "logits": outputs["logits"] + 1, key: moved}


def test_after_an_explained_routing_flip_decode_continues_from_the_reference_cache(runner, tiny_model):
    """Without the reference's cache, every step after a flip inherits it and fails; with it, the later steps
    judge the graph again. A flip that is not a near-tie keeps its failure and ONNX Runtime its own cache."""
    from exporter.verify.routing import CallRouting, ExpertAgreement
    from exporter.verify.checks import check_decode
    from exporter.verify.health import HealthScan
    manifest = runner.manifest
    batch = prompt_batch(manifest, QUICK, np.random.default_rng(0))
    profile = profile_for("float32", "cpu")
    asked = []

    def decode(agreement):
        def explain(graph, onnx_feeds, valid):
            asked.append(graph)
            return CallRouting(agreement, np.ones(np.shape(valid), dtype=bool))
        return check_decode(TorchRunner(tiny_model, manifest), _DecodeFlipsAt(runner, 2), manifest, batch,
                            ParitySettings(decode_steps=5), profile, HealthScan("float32"), np.random.default_rng(1),
                            explain)[0]
    result = decode(ExpertAgreement(True, 4, 3, 1, "1 of 4 differ, 1 explained"))
    assert asked == ["decode"] and all(row.passed for row in result.comparisons)
    assert [s.routing is not None and s.routing.explained for s in result.curve] == [False, False, True, False,
                                                                                      False, False]
    assert [s.fed_reference_cache for s in result.curve] == [False, False, False, True, False, False]
    assert result.curve[2].routing.logits.needed.scale > 1000  # the whole call failed; none of it was judged
    not_a_tie = decode(ExpertAgreement(True, 4, 3, 0, "1 of 4 differ, not a near-tie"))
    assert [s.logits.passed for s in not_a_tie.curve] == [True, True, False, False, False, False]
    assert not any(s.fed_reference_cache for s in not_a_tie.curve)


class _DecodeLogitsShifted:
    """An OrtRunner whose decode.onnx logits are off by 1e-2, about a hundred times the float32 tolerance
    (512 float32 units of a peak near 3: 9e-5)."""

    def __init__(self, inner):
        self.inner = inner

    def prefill(self, feeds):
        return self.inner.prefill(feeds)

    def decode(self, feeds):
        outputs = self.inner.decode(feeds)
        return {**outputs, "logits": outputs["logits"] + np.float32(1e-2)}

    def empty_past(self, batch):
        return self.inner.empty_past(batch)


class _PaddingAttended(_DecodeLogitsShifted):
    """An OrtRunner whose prefill attends to left padding, as a graph that dropped the padding mask would."""

    def prefill(self, feeds):
        return self.inner.prefill({**feeds, "attention_mask": np.ones_like(feeds["attention_mask"])})

    def decode(self, feeds):
        return self.inner.decode(feeds)


class _PresentsNaN(_DecodeLogitsShifted):
    """An OrtRunner whose graphs both give NaN in the first present, as a model with NaN weights would: the
    two sides of every invariant still agree."""

    def _broken(self, outputs):
        first = next(name for name in outputs if name.startswith("present."))
        return {**outputs, first: np.full_like(outputs[first], np.nan)}

    def prefill(self, feeds):
        return self._broken(self.inner.prefill(feeds))

    def decode(self, feeds):
        return self._broken(self.inner.decode(feeds))


def test_each_invariant_fails_on_the_fault_it_guards_against(artifact_copy):
    from exporter.verify import invariants
    manifest = read_manifest(artifact_copy)
    runner = OrtRunner(artifact_copy, manifest=manifest)
    batch = prompt_batch(manifest, ParitySettings(), np.random.default_rng(0))
    profile = profile_for("float32", "cpu")
    assert all(i.passed for i in invariants.check_invariants(artifact_copy, runner, manifest, batch, profile))
    assert invariants.identical_weights(artifact_copy, manifest).detail == (
        "15 distinct weight tensors in the weights file and 10 floating initializers inline, equal by content")
    shifted = _DecodeLogitsShifted(runner)
    assert not invariants.split_prefill(shifted, manifest, batch, profile, k=7).passed
    assert not invariants.decode_past_zero(shifted, manifest, batch, profile).passed
    assert not invariants.padded_row_alone(_PaddingAttended(runner), manifest, batch, profile).passed
    broken = _PresentsNaN(runner)
    for invariant in (invariants.split_prefill(broken, manifest, batch, profile, k=7),
                      invariants.decode_past_zero(broken, manifest, batch, profile),
                      invariants.padded_row_alone(broken, manifest, batch, profile)):
        assert not invariant.passed and "NaN or Inf in" in invariant.detail, invariant.detail
        assert "present.0.key" in invariant.detail and "no invariant can vouch for" in invariant.detail

    # decode.onnx scales a norm weight kept inline (16 floats, under the weights file's 1 KiB threshold)
    clean = {name: (artifact_copy / name).read_bytes() for name in ("decode.onnx", "manifest.json")}
    scale_inline_weight(artifact_copy, "decode.onnx", "layers.0.self_attn.q_norm.weight", 1.05)
    weights = invariants.identical_weights(artifact_copy, manifest)
    assert not weights.passed and weights.detail == "1 tensor(s) only in prefill, 1 only in decode (shapes [16] inline)"
    for name, data in clean.items():
        (artifact_copy / name).write_bytes(data)

    # decode.onnx reads one weight from other bytes; then bakes the batch axis of input_ids
    model = onnx.load(str(artifact_copy / "decode.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    info = {e.key: e.value for e in tensor.external_data}
    with open(artifact_copy / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        data = bytearray(f.read(int(info["length"])))
    data[0] ^= 1
    (artifact_copy / "other.data").write_bytes(bytes(data))
    for entry in tensor.external_data:
        entry.value = {"location": "other.data", "offset": "0"}.get(entry.key, entry.value)
    onnx.save(model, str(artifact_copy / "decode.onnx"))
    weights = invariants.identical_weights(artifact_copy, manifest)
    assert not weights.passed and weights.detail == ("1 tensor(s) only in prefill, 1 only in decode "
                                                     "(shapes [512, 64] in the weights file)")
    assert invariants.symbolic_axes(artifact_copy, manifest).passed
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    onnx.save(model, str(artifact_copy / "decode.onnx"))
    axes = invariants.symbolic_axes(artifact_copy, manifest)
    assert not axes.passed and "input_ids" in axes.detail, axes.detail

    # a rounding to float16 in a float32 graph, which the CPU provider would drop unseen
    model.graph.node.append(onnx.helper.make_node("Cast", [model.graph.output[0].name], ["logits_float16"],
                                                  to=onnx.TensorProto.FLOAT16, name="rounding"))
    onnx.save(model, str(artifact_copy / "decode.onnx"))
    rounding = invariants.computes_in_float32(artifact_copy, manifest)
    assert not rounding.passed and "1 Cast(s) to float16 or bfloat16: decode.onnx: rounding" in rounding.detail


class _PrefillPresentNaN(_PresentsNaN):
    """An OrtRunner whose prefill.onnx alone gives NaN in the first present: decode(past 0) is finite."""

    def decode(self, feeds):
        return self.inner.decode(feeds)


class _PaddedQueriesNaN(_DecodeLogitsShifted):
    """An OrtRunner whose logits are NaN at padded queries, which nothing reads, and right elsewhere."""

    def _padded_nan(self, feeds, outputs):
        logits = outputs["logits"].copy()
        logits[~real_queries(feeds["attention_mask"], logits.shape[1])] = np.nan
        return {**outputs, "logits": logits}

    def prefill(self, feeds):
        return self._padded_nan(feeds, self.inner.prefill(feeds))

    def decode(self, feeds):
        return self._padded_nan(feeds, self.inner.decode(feeds))


def test_an_invariant_names_nan_on_either_side_and_judges_logits_at_real_queries_only(runner):
    # NaN on the expected side alone (prefill, against decode with an empty past) is named as such, not left to
    # read as a plain difference; NaN at a padded query's logits, which no token reads, fails nothing.
    manifest = runner.manifest
    batch = prompt_batch(manifest, ParitySettings(), np.random.default_rng(0))
    profile = profile_for("float32", "cpu")
    assert not batch["attention_mask"].all()  # row 0 is left-padded
    past0 = invariants.decode_past_zero(_PrefillPresentNaN(runner), manifest, batch, profile)
    assert not past0.passed and "NaN or Inf in present.0.key" in past0.detail, past0.detail
    padded = _PaddedQueriesNaN(runner)
    k = batch["input_ids"].shape[1] // 2 + 1
    for invariant in (invariants.split_prefill(padded, manifest, batch, profile, k),
                      invariants.decode_past_zero(padded, manifest, batch, profile),
                      invariants.padded_row_alone(padded, manifest, batch, profile)):
        assert invariant.passed, (invariant.name, invariant.detail)
    # the split falls past row 0's padding, so every row carries a real token in the past decode reads
    split = invariants.check_invariants(runner.folder, runner, manifest, batch, profile)[0]
    assert split.passed and split.detail.startswith(f"k={k} of {batch['input_ids'].shape[1]} tokens")
    assert batch["attention_mask"][:, :k].any(axis=1).all()


def test_a_weight_in_one_graph_alone_fails_the_identical_weights_check(artifact_copy):
    # decode.onnx holds a floating constant that prefill.onnx lacks, prefill.onnx none that decode.onnx lacks
    manifest = read_manifest(artifact_copy)
    model = onnx.load(str(artifact_copy / "decode.onnx"), load_external_data=False)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.full(3, 0.125, np.float32), "stray"))
    onnx.save(model, str(artifact_copy / "decode.onnx"))
    weights = invariants.identical_weights(artifact_copy, manifest)
    assert not weights.passed and weights.detail == "0 tensor(s) only in prefill, 1 only in decode (shapes [3] inline)"


def test_a_rounding_to_bfloat16_inside_a_graph_function_is_found(artifact_copy):
    # computes_in_float32 reads the nodes of the graph's local functions too, and bfloat16 is as much a rounding
    # the CPU provider drops unseen as float16 is
    manifest = read_manifest(artifact_copy)
    model = onnx.load(str(artifact_copy / "decode.onnx"), load_external_data=False)
    cast = onnx.helper.make_node("Cast", ["x"], ["y"], to=onnx.TensorProto.BFLOAT16, name="hidden_rounding")
    model.functions.append(onnx.helper.make_function("local", "round", ["x"], ["y"], [cast],
                                                     [onnx.helper.make_opsetid("", 18)]))
    model.opset_import.append(onnx.helper.make_opsetid("local", 1))
    model.graph.node.append(onnx.helper.make_node("round", [model.graph.output[0].name], ["logits_bfloat16"],
                                                  domain="local", name="call_round"))
    onnx.save(model, str(artifact_copy / "decode.onnx"))
    rounding = invariants.computes_in_float32(artifact_copy, manifest)
    assert not rounding.passed and rounding.detail == ("1 Cast(s) to float16 or bfloat16: decode.onnx: "
                                                       "hidden_rounding"), rounding.detail


def test_health_counts_a_zero_present_row_in_any_head_at_real_positions_only():
    # a norm that fails in one key/value head zeroes that head's row alone; a padded position may hold zeros
    from exporter.verify.health import HealthScan
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
    from exporter.verify.health import HealthScan
    scan = HealthScan("float32")
    scan.scan_activations({"attn": np.array([1.0, np.nan], np.float32)}, {"attn": "Softmax in model.layers.0"})
    report = scan.report()
    assert not report.passed and report.nan == 1 and report.activation_max_abs is None
    assert report.issues == ["activation attn (Softmax in model.layers.0): 1 NaN"]


def test_the_repeat_run_compares_the_second_run_with_the_first(runner):
    from exporter.verify.providers import repeat_run

    class Drifting(_DecodeLogitsShifted):  # the second prefill on the session differs, as a nondeterministic one
        provider = "cpu"

        def prefill(self, feeds):
            outputs = self.inner.prefill(feeds)
            return {**outputs, "logits": outputs["logits"] + np.float32(1e-2)}

    manifest = runner.manifest
    batch = prompt_batch(manifest, ParitySettings(), np.random.default_rng(0))
    first = runner.prefill(prefill_feeds(manifest, batch))
    profile = profile_for("float32", "cpu")
    assert repeat_run(runner, manifest, batch, first, profile).passed
    again = repeat_run(Drifting(runner), manifest, batch, first, profile)
    assert not again.passed and again.max_abs == pytest.approx(1e-2, rel=1e-3), again


def test_health_counts_nan_and_inf_at_real_positions():
    from exporter.verify.health import HealthScan
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
    from exporter.verify.health import HealthScan
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
    assert report.issues == ["prefill present.0.key: 1 NaN, 0 Inf (1 at padded positions, which a later step "
                             "weighs by zero: 0 x NaN is NaN)"]
    logits[0, 2, 3] = np.nan  # a real query
    scan = HealthScan("float32")
    scan.scan_outputs("prefill", {"logits": logits}, mask)
    assert not scan.report().passed and scan.report().issues == ["prefill logits: 1 NaN, 0 Inf"]


def test_layer_errors_judge_the_key_and_the_value_of_every_layer():
    """A fault in one present alone (a layer's value, the last layer's key) fails that layer and that kind only;
    a fault at a padded cache position fails nothing."""
    from types import SimpleNamespace

    from exporter.contract import CacheLayout
    manifest = SimpleNamespace(cache=CacheLayout(num_layers=3, num_key_value_heads=2, head_dim=4, dtype="float32"))
    rng = np.random.default_rng(0)
    mask = np.array([[0, 1, 1], [1, 1, 1]])
    clean = {f"present.{layer}.{kind}": rng.standard_normal((2, 2, 3, 4)) for layer in range(3)
             for kind in ("key", "value")}
    profile = profile_for("float32", "cpu")
    assert [e.layer for e in checks.layer_errors(manifest, clean, clean, profile, "x", mask)] == [0, 1, 2]
    for layer, kind in ((0, "value"), (1, "value"), (2, "key"), (2, "value")):
        name = f"present.{layer}.{kind}"
        faulty = {**clean, name: clean[name].copy()}
        faulty[name][1, 0, 0, 0] += 0.1
        errors = checks.layer_errors(manifest, faulty, clean, profile, "x", mask)
        assert [e.passed for e in errors] == [e.layer != layer for e in errors], name
        assert [errors[layer].key.passed, errors[layer].value.passed] == [kind != "key", kind != "value"], name
        assert getattr(errors[layer], kind).name == f"x {name}"
        faulty[name][1, 0, 0, 0] -= 0.1
        faulty[name][0, 1, 0, 2] = 7.0  # row 0's position 0 is padding
        assert all(e.passed for e in checks.layer_errors(manifest, faulty, clean, profile, "x", mask)), name


def test_a_call_fails_by_its_logits_any_present_or_its_loss_alone():
    """check_prefill's rows and judge_call's verdict read every output: a fault in one present or in the loss
    alone fails the call, as a decode step fails by its cache alone."""
    from types import SimpleNamespace

    from exporter.contract import CacheLayout
    from exporter.verify.health import HealthScan
    names = ["input_ids", "attention_mask", "position_ids", "labels"]
    manifest = SimpleNamespace(cache=CacheLayout(num_layers=2, num_key_value_heads=2, head_dim=3, dtype="float32"),
                               prefill=SimpleNamespace(input_names=names))
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]])
    batch = {"input_ids": np.ones((2, 4), np.int64), "attention_mask": mask, "position_ids": np.zeros((2, 4), np.int64),
             "labels": np.ones((2, 4), np.int64)}
    rng = np.random.default_rng(0)
    clean = {"logits": rng.standard_normal((2, 4, 5)).astype(np.float32), "loss": np.float32(2.5),
             **{f"present.{layer}.{kind}": rng.standard_normal((2, 2, 4, 3)).astype(np.float32)
                for layer in range(2) for kind in ("key", "value")}}
    profile = profile_for("float32", "cpu")

    def prefill(actual):
        side = lambda outputs: SimpleNamespace(prefill=lambda feeds: outputs)  # noqa: E731
        result, _ = checks.check_prefill(side(clean), side(actual), manifest, batch, profile, HealthScan("float32"))
        return result, checks.judge_call(manifest, "c", "prefill", batch, actual, clean, profile, mask, mask)

    result, call = prefill(clean)
    assert [c.name for c in result.comparisons] == ["prefill logits", "prefill present (all layers)", "prefill loss"]
    assert all(result.comparisons) and call.passed
    for name in clean:
        faulty = {**clean, name: clean[name] + np.float32(0.1)}
        result, call = prefill(faulty)
        assert [c.passed for c in result.comparisons] == [name != "logits", not name.startswith("present."),
                                                          name != "loss"], name
        assert not call.passed, name
    ok = compare("x", "kv", [1.0], [1.0], profile.kv)
    assert not checks.StepError(0, 1, ok, compare("x", "kv", [2.0], [1.0], profile.kv), 1).passed


def test_every_check_of_a_report_can_fail_the_verdict():
    """The overall verdict (exit code 1, pytest's FAILED) reads each check: a report whose only failure is the
    health scan, the repeat run, the greedy tokens, one sweep case, a provider-vs-provider row or a consumer
    fails. The checks' own tests build the failing rows; this one proves that they reach the verdict."""
    from types import SimpleNamespace

    from exporter.verify.results import ConsumerReport, ProviderReport, VerifyReport
    from exporter.verify.routing import ExpertAgreement
    ok, bad = SimpleNamespace(passed=True), SimpleNamespace(passed=False)
    differ, unmeasured = ExpertAgreement(True, 10, 9, 0, "1 differs"), ExpertAgreement(False, 0, 0, 0, "not found")
    parts = {"comparisons": [ok], "greedy": ok, "sweep": [ok], "health": ok, "repeat": ok, "experts": None}

    def provider(**broken):
        fields = {**parts, **broken}
        return ProviderReport("cpu", "float32", None, fields["comparisons"], fields["greedy"], [], [], {},
                              fields["sweep"], fields["health"], fields["repeat"], None, fields["experts"])

    assert provider().passed
    for name, value in (("comparisons", [ok, bad]), ("greedy", bad), ("sweep", [ok, bad]), ("health", bad),
                        ("repeat", bad), ("experts", differ)):
        assert not provider(**{name: value}).passed, name
    assert provider(experts=unmeasured).passed  # skipped: a limitation of the check, not a parity failure
    whole = dict(folder="x", reports=[provider()], reference="pytorch model", invariants=[ok], cross=[ok],
                 consumers=[ConsumerReport("onnxruntime-genai", "qwen3", ok)])
    assert VerifyReport(**whole).passed
    # nothing compared with the reference passes only where there is no reference and the invariants ran
    nothing = {**whole, "reports": [], "cross": [], "consumers": []}
    assert not VerifyReport(**nothing).passed  # every provider skipped
    assert VerifyReport(**{**nothing, "reference": "none"}).passed
    assert not VerifyReport(**{**nothing, "reference": "none", "invariants": []}).passed
    for name, value in (("reports", [provider(), provider(health=bad)]), ("invariants", [ok, bad]),
                        ("cross", [ok, bad]), ("consumers", [ConsumerReport("onnxruntime-genai", "qwen3", bad)])):
        assert not VerifyReport(**{**whole, name: value}).passed, name


def test_providers_are_compared_with_the_looser_profile_of_the_two(artifact_fp32, artifact_fp16, monkeypatch):
    from exporter.verify import tolerances
    from exporter.verify.providers import attribute, cross_providers
    from exporter.verify.tolerances import CPU, CUDA
    rng = np.random.default_rng(0)
    cpu = {"logits": rng.standard_normal((2, 5, 8)).astype(np.float32) * 4,
           "present.0.key": rng.standard_normal((2, 1, 5, 4)).astype(np.float32)}
    mask = np.ones((2, 5), np.int64)
    # a difference within a looser CUDA profile (4 float16 units more of the peak), beyond the CPU profile
    strict = profile_for("float32", CPU)
    looser = dataclasses.replace(strict.logits, peak=strict.logits.peak + 4 * 2.0 ** -11)
    monkeypatch.setitem(tolerances.PROFILES, ("float32", CUDA), dataclasses.replace(strict, logits=looser, kv=looser))
    peak = np.abs(cpu["logits"]).max()
    tf32 = {**cpu, "logits": cpu["logits"] + np.float32(2 * 2.0 ** -11 * peak)}
    assert not compare("cpu", "logits", tf32["logits"], cpu["logits"], strict.logits).passed
    assert all(c.passed for c in cross_providers({CPU: cpu, CUDA: tf32}, "float32", Overrides(), mask))
    assert all(c.passed for c in cross_providers({CUDA: tf32, CPU: cpu}, "float32", Overrides(), mask))
    wrong = {**cpu, "logits": cpu["logits"] + np.float32(0.5)}
    rows = cross_providers({CPU: cpu, CUDA: wrong}, "float32", Overrides(), mask)
    assert [c.name for c in rows if not c.passed] == [f"{CUDA} vs {CPU} prefill logits"]

    manifest = read_manifest(artifact_fp32)
    provider = attribute([], {CPU: cpu, CUDA: tf32}, rows, manifest, {}, None, Overrides())
    [leg] = provider.legs
    assert (leg.cause, leg.covers) == ("provider", "prefill.onnx, the prefill batch") and not leg.comparison.passed
    assert provider.skipped == "precision leg needs a float16 companion artifact"
    # the pair in the order the providers were given; CUDA alone has no provider leg
    flipped = attribute([], {CUDA: tf32, CPU: cpu},
                        cross_providers({CUDA: wrong, CPU: cpu}, "float32", Overrides(), mask), manifest, {}, None,
                        Overrides())
    [leg] = flipped.legs
    assert leg.comparison.name == f"{CPU} vs {CUDA} prefill logits" and not leg.comparison.passed
    cuda_only = attribute([], {CUDA: tf32}, [], manifest, {}, None, Overrides())
    assert not cuda_only.legs and "need CPUExecutionProvider too" in cuda_only.skipped
    cpu_only = attribute([], {CPU: cpu}, [], manifest, {}, None, Overrides())
    assert not cpu_only.legs and "need CUDAExecutionProvider" in cpu_only.skipped
    half = attribute([], {CPU: cpu, CUDA: tf32}, rows, read_manifest(artifact_fp16), {}, None, Overrides())
    assert not half.legs and "starts from a float32 artifact" in half.skipped


def test_the_precision_leg_compares_float16_with_cuda_float32_at_real_queries(artifact_fp32, artifact_fp16,
                                                                              monkeypatch):
    # No CUDA here: the float16 companion runs on the CPU in its place. The leg reads CUDA's float32 logits (not
    # the CPU's, far off here), at real queries only, with float16's CUDA profile; the user's overrides apply to
    # every profile, the provider pairs' included.
    from exporter.verify import providers
    from exporter.verify.tolerances import CPU, CUDA
    asked = []

    def on_the_cpu(folder, provider, manifest):
        asked.append(provider)
        return OrtRunner(folder, CPU, manifest=manifest)

    monkeypatch.setattr(providers, "OrtRunner", on_the_cpu)
    manifest, fp16_manifest = read_manifest(artifact_fp32), read_manifest(artifact_fp16)
    batch = prompt_batch(manifest, ParitySettings(), np.random.default_rng(0))
    fp32 = OrtRunner(artifact_fp32, manifest=manifest).prefill(prefill_feeds(manifest, batch))
    cuda = {**fp32, "logits": fp32["logits"].copy()}
    cuda["logits"][~real_queries(batch["attention_mask"], cuda["logits"].shape[1])] = 1e3  # read by no token
    cpu = {**fp32, "logits": fp32["logits"] + np.float32(1.0)}
    result = providers.attribute([], {CPU: cpu, CUDA: cuda}, [], manifest, batch, (artifact_fp16, fp16_manifest),
                                 Overrides())
    [leg] = result.legs
    assert asked == [CUDA] and (leg.cause, leg.covers) == ("precision", "prefill.onnx, the prefill batch")
    assert leg.comparison.passed and leg.comparison.tolerance == profile_for("float16", CUDA).logits, leg.comparison
    loosened = Overrides((("logits", "atol", 1.0),))
    rows = providers.cross_providers({CPU: fp32, CUDA: {**fp32, "logits": fp32["logits"] + np.float32(0.5)}},
                                     "float32", loosened, batch["attention_mask"])
    assert all(c.passed for c in rows) and rows[0].tolerance.atol == 1.0, rows


def test_a_decode_graphs_positions_are_its_query_and_its_total_length(artifact_fp32):
    # decode.onnx names the query length and the attention mask's (past and query) apart: both are positions
    manifest = read_manifest(artifact_fp32)
    axes = DebugGraph(artifact_fp32, manifest, manifest.decode).axes
    assert axes == PositionAxes("batch_size", frozenset({"sequence_length", "total_sequence_length"}))


def test_a_float16_companion_must_hold_the_same_weights(artifact_fp32, artifact_fp16, tmp_path):
    from exporter.errors import InputError
    from exporter.verify.providers import check_companion
    manifest = read_manifest(artifact_fp32)
    assert check_companion(artifact_fp16, manifest)[1].dtype == "float16"
    other = shutil.copytree(artifact_fp16, tmp_path / "other")
    edit_manifest(other, claim_seed(7))  # the precision leg would charge other weights to float16
    with pytest.raises(InputError, match="holds other weights .*seed 7 against .*seed 0"):
        check_companion(other, manifest)


def test_a_float16_companion_from_another_checkpoint_or_of_the_wrong_dtype_is_refused(artifact_fp32, artifact_fp16,
                                                                                       tmp_path):
    # a checkpoint is told by its content hash, not its path: the same bytes elsewhere are the same weights
    from exporter.errors import InputError
    from exporter.verify.providers import companion_for
    other = shutil.copytree(artifact_fp16, tmp_path / "other")
    edit_manifest(other, lambda m: m["model"].update(source={"kind": "checkpoint", "path": "/b.pth", "sha256": "b"}))
    ours = {"kind": "checkpoint", "path": "/a.pth", "sha256": "a"}
    with pytest.raises(InputError, match="holds other weights .checkpoint, sha256 b against checkpoint, sha256 a."):
        companion_for(other, "float32", None, ours)
    assert companion_for(other, "float32", None, {**ours, "sha256": "b"})[1].dtype == "float16"
    with pytest.raises(InputError, match="is not a float16 export .float32."):
        companion_for(artifact_fp32, "float32", None, None)
    with pytest.raises(InputError, match="needs a float32 artifact to verify; this one is float16"):
        companion_for(artifact_fp16, "float16", None, None)


def test_a_greedy_divergence_passes_only_at_a_near_tie_of_the_reference():
    from exporter.verify.checks import GreedyTrace, judge_greedy
    profile = profile_for("float32", "cpu")
    logits = np.zeros((3, 6), np.float32)
    logits[1, 2], logits[1, 4] = 5.0, 5.0 - 1e-5  # at token 1, ids 2 and 4 lie within the logits tolerance
    trace = GreedyTrace([0, 2, 3], logits)
    assert judge_greedy(trace, [0, 2, 3], profile).passed
    tie = judge_greedy(trace, [0, 4, 1], profile)
    assert tie.passed and tie.match_length == 1 and "a near-tie within tolerance" in tie.note
    logits[1, 4] = 4.9
    clear = judge_greedy(GreedyTrace([0, 2, 3], logits), [0, 4, 1], profile)
    assert not clear.passed and "not a tie" in clear.note
    early = judge_greedy(trace, [0, 2], profile)
    assert not early.passed and early.note == "one side stopped early"
    # the bound is the tolerance at the chosen logit: float16's relative term there (5), not at the row's
    # largest magnitude (-100): 0.9 apart lies beyond 1e-3 + 4u x 5 + 16u x 100 = 0.79 (u = 2^-11)
    row = np.zeros((2, 6), np.float32)
    row[1, 0], row[1, 2], row[1, 4] = -100.0, 5.0, 4.1
    assert not judge_greedy(GreedyTrace([0, 2], row), [0, 4], profile_for("float16", "cpu")).passed
    row[1, 4] = 4.3  # 0.7 apart: a near-tie
    assert judge_greedy(GreedyTrace([0, 2], row), [0, 4], profile_for("float16", "cpu")).passed

    # A consumer that leaves EOS (5) out: a list that ends first chose EOS there, judged by the same rule.
    logits[1, 5] = 5.0 - 1e-5
    stopped = GreedyTrace([0, 2, 3], logits)
    genai_stopped = judge_greedy(stopped, [0], profile, dropped_eos=5)
    assert genai_stopped.passed and "reference 2 vs onnx 5" in genai_stopped.note
    reference_stopped = judge_greedy(GreedyTrace([0, 5], logits[:2]), [0, 2, 3], profile, [0], dropped_eos=5)
    assert reference_stopped.passed and "reference 5 vs onnx 2" in reference_stopped.note
    logits[1, 5] = 4.0
    assert not judge_greedy(GreedyTrace([0, 2, 3], logits), [0], profile, dropped_eos=5).passed
    at_once = judge_greedy(GreedyTrace([5], logits[:1]), [], profile, [], dropped_eos=5)
    assert at_once.passed and at_once.note == "0 tokens identical (both stopped at EOS at once: nothing else to compare)"


def test_nan_logits_in_our_greedy_loop_are_a_failed_check_not_an_error(runner):
    from exporter.verify.checks import GreedyTrace, check_greedy

    class NaNRunner:  # generation's interface over an artifact whose logits hold a NaN
        manifest, cache = runner.manifest, []

        def start(self, input_ids, attention_mask, position_ids):
            logits = np.zeros((len(input_ids), self.manifest.config.vocab_size), np.float32)
            logits[:, 7] = np.nan
            return logits

        def step(self, input_ids, attention_mask, position_ids):
            raise AssertionError("a NaN in the prompt's logits ends the loop before any step")

    class Reference:
        def greedy(self, prompt, new_tokens, eos):
            return GreedyTrace([3] * new_tokens, np.zeros((new_tokens, 8), np.float32))

    result = check_greedy(Reference(), NaNRunner(), runner.manifest, [1, 2], QUICK, profile_for("float32", "cpu"))
    assert not result.passed and result.onnx_ids == [] and "not finite" in result.note


def test_a_model_of_another_config_or_family_is_refused_before_any_check(artifact_fp32):
    """Before, a minimind2-tiny model against this minimind-3-tiny artifact ran every check and failed each one
    (top1 0.000), blaming the export."""
    from exporter.errors import InputError
    from exporter.model_source import seeded_model
    from reference import build_model, get_preset
    other = build_model(get_preset("minimind2-tiny"), seed=0)
    with pytest.raises(InputError, match=r"^the model does not match the artifact: its config differs in "
                                         r"intermediate_size \(model 192, artifact 256\), .*rms_norm_eps.*, version; "
                                         r"pass the model the artifact was exported from"):
        verify_artifact(artifact_fp32, other, ["cpu"], QUICK, genai=False)
    gpt = build_model(get_preset("teaching-gpt-tiny"), seed=0)
    with pytest.raises(InputError, match=r"the model \(TeachingGPT with config TeachingGPTConfig\) is not of the "
                                         r"artifact's family minimind"):
        verify_artifact(artifact_fp32, gpt, ["cpu"], QUICK, genai=False)
    sourced = seeded_model("minimind-3-tiny")  # was "not of the artifact's family" (SourcedModel with config None)
    with pytest.raises(InputError, match=r"^model is a SourcedModel \(what seeded_model and checkpoint_model "
                                         r"return\); pass its model: verify_artifact\(folder, sourced.model\)$"):
        verify_artifact(artifact_fp32, sourced, ["cpu"], QUICK, genai=False)


def test_a_float16_companion_of_another_config_names_the_fields(artifact_fp16):
    from exporter.errors import InputError
    from exporter.verify.providers import companion_for
    from reference import get_preset
    with pytest.raises(InputError, match=r"is not a float16 export of the same model \(its config differs in "
                                         r"intermediate_size, .*, version\)"):
        companion_for(artifact_fp16, "float32", get_preset("minimind2-tiny"))


def test_golden_save_inside_the_artifact_is_refused_by_the_api_as_by_the_cli(artifact_copy, tiny_model):
    # The CLI refused it; verify_artifact wrote the bundle into the artifact, where the pytest plugin then found it.
    before = sorted(p.name for p in artifact_copy.iterdir())
    with pytest.raises(ToolkitError, match=r"^golden_save \(--golden-save\) .*golden lies inside the artifact folder "):
        verify_artifact(artifact_copy, tiny_model, "cpu", genai=False, golden_save=artifact_copy / "golden")
    assert sorted(p.name for p in artifact_copy.iterdir()) == before


def test_an_api_calls_refusal_names_the_parameter_beside_the_cli_flag(artifact_fp32, tiny_model, tmp_path):
    """A Python caller never typed --output or --golden-save: each refusal names the argument it passed first."""
    from exporter.errors import InputError, ProviderError
    from exporter.export import export_artifact
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(OutputPathError, match=r"choose another output folder \(folder, --output\) or empty it$"):
        export_artifact(tiny_model, foreign)
    with pytest.raises(InputError, match=r"^golden_save \(--golden-save\) records the PyTorch reference: it needs the "
                                         r"model and no golden bundle \(golden, --golden\)$"):
        verify_artifact(artifact_fp32, None, "cpu", golden_save=tmp_path / "bundle")
    with pytest.raises(InputError, match=r"^fp16_companion \(--fp16-companion\) .* is not a float16 export "
                                         r'\(float32\); export the same model as float16 '
                                         r'\(dtype="float16", --dtype float16\)$'):
        verify_artifact(artifact_fp32, None, "cpu", fp16_companion=artifact_fp32)
    with pytest.raises(ProviderError, match=r"; pass cpu or cuda \(provider or providers, --provider\)$"):
        verify_artifact(artifact_fp32, None, "bogus")
    assert (foreign / "notes.txt").read_text() == "keep me" and not (tmp_path / "bundle").exists()


def test_a_model_and_a_golden_bundle_together_are_refused_naming_which_to_drop(artifact_fp32, tiny_model, tmp_path):
    # The bundle was replayed and the model ignored, silently.
    from exporter.errors import InputError
    with pytest.raises(InputError, match=r"^give model or golden, not both: .*; drop golden to verify against the "
                                         r"model, or model to replay the bundle$"):
        verify_artifact(artifact_fp32, tiny_model, "cpu", golden=tmp_path / "bundle")  # refused before it is read


def test_arguments_of_the_wrong_type_are_refused_by_name_before_any_check(artifact_fp32, tiny_model):
    """Each failed deep in the engine (AttributeError, pathlib's or iteration's TypeError), genai="no" ran the
    check, and providers=[] verified nothing and failed."""
    from exporter.errors import InputError, ProviderError
    for kwargs, error, message in (
            ({"settings": {"decode_steps": 3}}, InputError, "settings must be a ParitySettings, got dict"),
            ({"overrides": "logits=1"}, InputError, "overrides must be an Overrides, got str"),
            ({"genai": "no"}, InputError, r"genai must be None, True or False, got 'no' \(str\)"),
            ({"providers": 5}, ProviderError, "providers must be a provider name or a list of them, got 5"),
            ({"providers": []}, ProviderError, r"providers is empty; pass e.g. \['cpu'\], or None"),
            ({"fp16_companion": 5}, InputError, "an artifact folder is a path .* got 5")):
        with pytest.raises(error, match=message):
            verify_artifact(artifact_fp32, tiny_model, **kwargs)
    with pytest.raises(ArtifactError, match=r"an artifact folder is a path \(str or Path\), got None"):
        verify_artifact(None, tiny_model)


def test_providers_given_as_a_str_name_one_provider(artifact_fp32, tiny_model):
    """A str was iterated before: "cpu" asked for the providers "c", "p" and "u" (ProviderError "not c")."""
    report = verify_artifact(artifact_fp32, tiny_model, "cpu", dataclasses.replace(QUICK, probe=False), genai=False)
    assert [r.provider for r in report.reports] == ["CPUExecutionProvider"]
    assert report.passed


def test_a_damaged_graph_listed_again_in_the_manifest_is_a_one_line_artifact_error(artifact_fp32, tiny_model,
                                                                                   tmp_path):
    # The debug copy read the graph before any session did: a truncated prefill.onnx ended in protobuf's
    # DecodeError and an empty one in KeyError: 'input_ids', both exit 3; another opset than the manifest's
    # passed.
    def damaged(name: str, content: bytes | None = None, opset: int | None = None) -> str:
        folder = shutil.copytree(artifact_fp32, tmp_path / name)
        graph = folder / "prefill.onnx"
        if content is not None:
            graph.write_bytes(content)
            edit_manifest(folder, lambda manifest: manifest["files"]["prefill.onnx"].update(
                sha256=sha256_file(graph), bytes=graph.stat().st_size))
        if opset is not None:
            edit_manifest(folder, lambda manifest: manifest.update(opset=opset))
        with pytest.raises(ArtifactError) as caught:
            verify_artifact(folder, tiny_model, ["cpu"], QUICK, genai=False)
        message = str(caught.value)
        assert len(message.splitlines()) == 1 and message.endswith("; re-export the folder"), message
        result = run_cli("verify", folder, "--provider", "cpu", "--no-genai", "-q")
        assert_one_line_error(result, 2, message)
        return message

    data = (artifact_fp32 / "prefill.onnx").read_bytes()
    messages = {"truncated": damaged("truncated", data[:len(data) // 2]), "empty": damaged("empty", b""),
                "opset": damaged("opset", opset=17)}
    assert "prefill.onnx is no ONNX model (Error parsing message" in messages["truncated"]
    assert ("prefill.onnx has the inputs [], its manifest lists [input_ids, attention_mask, position_ids, labels]"
            in messages["empty"])
    assert "prefill.onnx imports the opset [20], its manifest says 17" in messages["opset"]
    for name, message in messages.items():  # inspect showed each graph as "ok" and exited 0
        shown = run_cli("inspect", tmp_path / name, "--json")
        state = json.loads(shown.stdout)["file_status"]["prefill.onnx"]
        assert shown.exit_code == 2 and state != "ok" and f"prefill.onnx {state}; re-export" in message, state
    # An op type that is no UTF-8: onnxruntime's message quoting it fails to decode, a ValueError, on which its
    # Python binding printed a four-line "EP Error ... Falling back" banner to stdout, into --json's document.
    assert "'utf-8' codec can't decode byte 0xff" in damaged("op-type", data.replace(b"MatMul", b"\xffatMul", 1))
    result = run_cli("verify", tmp_path / "op-type", "--provider", "cpu", "--no-genai", "--json", "-q")
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["kind"] == "input", result.stdout


def test_the_decode_steps_and_the_sweep_report_progress(artifact_fp32, tiny_model, monkeypatch, caplog):
    # Each ran silent between its first line and the next check (20 s apiece on the tiny model under load).
    monkeypatch.setattr(checks, "PROGRESS_INTERVAL", 0.0)  # a line after every item but the last
    monkeypatch.setattr(checks, "sweep_grid", lambda context: [(1, 1, 0), (2, 2, 1), (3, 1, 17)])
    manifest = read_manifest(artifact_fp32)
    settings = ParitySettings(decode_steps=3, greedy_tokens=2, probe=False)
    with caplog.at_level(logging.INFO, logger=checks.__name__):
        report = verify_artifact(artifact_fp32, tiny_model, ["cpu"], settings, genai=False, manifest=manifest)
    assert report.passed
    lines = [r.getMessage() for r in caplog.records if r.name == checks.__name__]
    assert lines == ["decode steps: 1/4 done", "decode steps: 2/4 done", "decode steps: 3/4 done",
                     "sweep shapes: 1/3 done", "sweep shapes: 2/3 done", "sweep: 3/3 shapes pass"]
    caplog.clear()
    monkeypatch.setattr(checks, "PROGRESS_INTERVAL", 5.0)  # the default: a tiny loop this short says nothing
    with caplog.at_level(logging.INFO, logger=checks.__name__):
        verify_artifact(artifact_fp32, tiny_model, ["cpu"], settings, genai=False, manifest=manifest)
    assert [r.getMessage() for r in caplog.records if r.name == checks.__name__] == ["sweep: 3/3 shapes pass"]


def test_expert_choice_that_measured_nothing_is_skipped_in_every_report(moe2_artifact, moe2_model, monkeypatch):
    """Router TopK nodes that cannot be found (renamed or fused by another tool): the expert choice check measured
    nothing. Every report shows it as skipped with the reason and counts it in no pass; the verdict does not fail
    on it either (a limitation of the check, not a parity failure)."""
    from exporter.verify import routing
    monkeypatch.setattr(routing, "router_layers", lambda proto: {})
    report = verify_artifact(moe2_artifact, moe2_model, ["cpu"], QUICK, genai=False)
    [cpu] = report.reports
    assert not cpu.experts.measured and "not found" in cpu.experts.note
    assert not cpu.experts.passed and cpu.passed and report.passed, format_verify(report)
    [row] = [line for line in format_verify(report).splitlines() if line.startswith("expert choice")]
    assert row.split()[-1] == "skipped" and "not measured" in row, row
    assert f"  experts: {cpu.experts.note}" in format_verify(report)
    document = report.to_dict()["providers"][0]["expert_choice"]
    assert document["passed"] is None and document["skipped"] == cpu.experts.note, document
    assert f"expert choice: {cpu.experts.note} (skipped)" in render_html(report)
    suites = ET.fromstring(render_junit(report))
    [case] = [c for c in suites.iter("testcase") if c.get("name") == "expert choice"]
    assert [child.tag for child in case] == ["skipped"] and case.find("skipped").get("message") == cpu.experts.note
    [suite] = [s for s in suites.findall("testsuite") if s.find("testcase[@name='expert choice']") is not None]
    others = len({**report.skipped, **report.consumers_skipped})  # the providers and consumers that did not run
    assert suite.get("skipped") == "1" and suites.get("skipped") == str(1 + others)
