"""verify_artifact end to end on the tiny artifacts: what the default run covers (curve, sweep, invariants,
health, probe), the arguments it refuses, its progress lines, and an expert choice that measured nothing."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from xml.etree import ElementTree as ET

import pytest
from helpers import CPU_ONLY, QUICK, assert_one_line_error, edit_manifest, run_cli

from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import read_manifest, sha256_file
from exporter.errors import ArtifactError, OutputPathError, ToolkitError
from exporter.tolerances.parity import profile_for
from exporter.verify.checks import outputs as checks
from exporter.verify.engine import verify_artifact
from exporter.verify.inputs import ParitySettings
from exporter.verify.reports import format_verify, render_html, render_junit


def test_default_verification_covers_curve_sweep_invariants_and_health(full):
    report, _ = full
    assert report.passed, format_verify(report)
    [cpu] = report.reports
    assert report and cpu  # truthy as they pass
    assert len(cpu.curve) == 65 and [s.tokens for s in cpu.curve[-2:]] == [1, 3]
    assert {(c.batch, c.new_tokens, c.past) for c in cpu.sweep} == {
        (b, n, p) for b in (1, 2, 3) for n in (1, 2, 7, 64) for p in (0, 1, 17)
    }
    assert [i.passed for i in report.invariants] == [True] * 6  # the sixth: a float32 export computes in float32
    assert cpu.health.passed and cpu.health.nan == cpu.health.zero_rows == 0
    assert cpu.repeat.max_abs == 0  # the CPU provider is deterministic
    # judged with float32's own profile: float16's (16 units of its 11 bits) is ~60x looser
    assert cpu.profile == profile_for("float32", "cpu")
    assert {(c.kind, c.tolerance) for c in cpu.comparisons} == {
        (kind, cpu.profile[kind]) for kind in ("logits", "kv", "loss")
    }
    logits = cpu.comparisons[0]
    assert logits.llm["top1_agreement"] == 1.0 and logits.llm["kl_mean"] < 1e-9 and logits.cosine > 0.999999
    assert logits.needed.scale > 0 and cpu.localisation.first_layer is None
    assert cpu.localisation.probe.first is None and cpu.localisation.probe.checked >= 10
    assert cpu.localisation.decode_probe.first is None and cpu.localisation.decode_probe.checked >= 10


# A correct float32 export's errors are float32 rounding on both sides: against the same model in float64 the
# reference stays within ~140 of the 512 units the profile allows (docs/verification.md), so a clean run needs
# at most about half its tolerance. A change that doubles the errors, or a fault near the bound, fails here
# before it fails users: a check that only asked for "< 1" would let the errors grow several times over.
CLEAN_MARGIN = 0.5


def _every_comparison(report):
    for c in report.comparisons:
        yield "summary", c
    for step in report.curve:
        yield f"decode step {step.step}", step.logits
        yield f"decode step {step.step}", step.kv
    for layer in report.layers:
        yield f"layer {layer.layer}", layer.key
        yield f"layer {layer.layer}", layer.value
    for case in report.sweep:
        yield case.name, case.logits
        yield case.name, case.kv


def test_a_clean_run_needs_at_most_half_of_each_tolerance(full):
    report, _ = full
    [cpu] = report.reports
    needed = {f"{where}: {c.name}": c.needed.scale for where, c in _every_comparison(cpu)}
    assert len(needed) > 100 and max(needed.values()) > 0
    over = {name: scale for name, scale in needed.items() if scale > CLEAN_MARGIN}
    assert not over, over


def test_a_model_of_another_config_or_family_is_refused_before_any_check(artifact_fp32):
    """A minimind2-tiny model against this minimind-3-tiny artifact is refused before any check, not run through
    every check to fail each one (top1 0.000), blaming the export."""
    from exporter.errors import InputError
    from reference import build_model, get_preset
    from reference.source import seeded_model

    other = build_model(get_preset("minimind2-tiny"), seed=0)
    with pytest.raises(
        InputError,
        match=r"^the model does not match the artifact: its config differs in "
        r"intermediate_size \(model 192, artifact 256\), .*rms_norm_eps.*, version; "
        r"pass the model the artifact was exported from",
    ):
        verify_artifact(artifact_fp32, other, ["cpu"], QUICK, genai=False, transformers_js=False)
    gpt = build_model(get_preset("teaching-gpt-tiny"), seed=0)
    with pytest.raises(
        InputError,
        match=r"the model \(TeachingGPT with config TeachingGPTConfig\) is not of the "
        r"artifact's family minimind",
    ):
        verify_artifact(artifact_fp32, gpt, ["cpu"], QUICK, genai=False, transformers_js=False)
    sourced = seeded_model("minimind-3-tiny")  # told to pass its model, not "not of the artifact's family"
    with pytest.raises(
        InputError,
        match=r"^model is a SourcedModel \(what seeded_model and checkpoint_model "
        r"return\); pass its model: verify_artifact\(folder, sourced.model\)$",
    ):
        verify_artifact(artifact_fp32, sourced, ["cpu"], QUICK, genai=False, transformers_js=False)


def test_golden_save_inside_the_artifact_is_refused_by_the_api_as_by_the_cli(artifact_copy, tiny_model):
    # The CLI refused it; verify_artifact wrote the bundle into the artifact, where the pytest plugin then found it.
    before = sorted(p.name for p in artifact_copy.iterdir())
    with pytest.raises(ToolkitError, match=r"^`golden_save` .*golden lies inside the artifact folder "):
        verify_artifact(
            artifact_copy, tiny_model, "cpu", genai=False, transformers_js=False, golden_save=artifact_copy / "golden"
        )
    assert sorted(p.name for p in artifact_copy.iterdir()) == before


def test_an_api_calls_refusal_names_the_parameter_beside_the_cli_flag(artifact_fp32, tiny_model, tmp_path):
    """A Python caller never typed --output or --golden-save: each refusal names the argument it passed first."""
    from exporter.errors import InputError, ProviderError
    from exporter.export.pipeline import export_artifact

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(OutputPathError, match=r"choose another output folder \(`folder`\) or empty it$"):
        export_artifact(tiny_model, foreign)
    with pytest.raises(
        InputError,
        match=r"^`golden_save` records the PyTorch reference: it needs the "
        r"model and no golden bundle \(`golden`\)$",
    ):
        verify_artifact(artifact_fp32, None, "cpu", golden_save=tmp_path / "bundle")
    with pytest.raises(
        InputError,
        match=r"^`fp16_companion` .* is not a float16 export "
        r"\(float32\); export the same model as float16 "
        r'\(`dtype="float16"`\)$',
    ):
        verify_artifact(artifact_fp32, None, "cpu", fp16_companion=artifact_fp32)
    with pytest.raises(ProviderError, match=r"; pass cpu or cuda \(`provider`\)$"):
        verify_artifact(artifact_fp32, None, "bogus")
    assert (foreign / "notes.txt").read_text() == "keep me" and not (tmp_path / "bundle").exists()


def test_a_model_and_a_golden_bundle_together_are_refused_naming_which_to_drop(artifact_fp32, tiny_model, tmp_path):
    # Refused, not one of them ignored in silence.
    from exporter.errors import InputError

    with pytest.raises(
        InputError,
        match=r"^give model or golden, not both: .*; drop golden to verify against the "
        r"model, or model to replay the bundle$",
    ):
        verify_artifact(artifact_fp32, tiny_model, "cpu", golden=tmp_path / "bundle")  # refused before it is read


def test_arguments_of_the_wrong_type_are_refused_by_name_before_any_check(artifact_fp32, tiny_model):
    """Each is refused by name, not left to fail deep in the engine (AttributeError, pathlib's or iteration's
    TypeError); genai="no" is refused, not read as true, and providers=[] too, rather than verifying nothing."""
    from exporter.errors import InputError, ProviderError

    for kwargs, error, message in (
        ({"settings": {"decode_steps": 3}}, InputError, "settings must be a ParitySettings, got dict"),
        ({"overrides": "logits=1"}, InputError, "overrides must be an Overrides, got str"),
        ({"genai": "no"}, InputError, r"genai must be None, True or False, got 'no' \(str\)"),
        ({"providers": 5}, ProviderError, "providers must be a provider name or a list of them, got 5"),
        ({"providers": []}, ProviderError, r"providers is empty; pass e.g. \['cpu'\], or None"),
        ({"fp16_companion": 5}, InputError, r"an artifact is an Artifact or an artifact folder's path .* got 5"),
    ):
        with pytest.raises(error, match=message):
            verify_artifact(artifact_fp32, tiny_model, **kwargs)
    with pytest.raises(InputError, match=r"an artifact is an Artifact or an artifact folder's path .*, got None"):
        verify_artifact(None, tiny_model)


def test_providers_given_as_a_str_name_one_provider(artifact_fp32, tiny_model):
    """A str is one provider's name, not iterated into the providers "c", "p" and "u"."""
    report = verify_artifact(
        artifact_fp32, tiny_model, "cpu", dataclasses.replace(QUICK, probe=False), genai=False, transformers_js=False
    )
    assert [r.provider for r in report.reports] == ["CPUExecutionProvider"]
    assert report.passed


def test_a_damaged_graph_listed_again_in_the_manifest_is_a_one_line_artifact_error(artifact_fp32, tiny_model, tmp_path):
    # The graph is held to the manifest before the debug copy or any session reads it: a truncated prefill.onnx,
    # an empty one or one of another opset than the manifest's is one ArtifactError line, not protobuf's
    # DecodeError or KeyError: 'input_ids' (exit 3), nor a pass.
    def damaged(name: str, content: bytes | None = None, opset: int | None = None) -> str:
        folder = shutil.copytree(artifact_fp32, tmp_path / name)
        graph = folder / "prefill.onnx"
        if content is not None:
            graph.write_bytes(content)
            edit_manifest(
                folder,
                lambda manifest: manifest["files"]["prefill.onnx"].update(
                    sha256=sha256_file(graph), bytes=graph.stat().st_size
                ),
            )
        if opset is not None:
            edit_manifest(folder, lambda manifest: manifest.update(opset=opset))
        with pytest.raises(ArtifactError) as caught:
            verify_artifact(folder, tiny_model, ["cpu"], QUICK, genai=False, transformers_js=False)
        message = str(caught.value)
        assert len(message.splitlines()) == 1 and message.endswith("; re-export the folder"), message
        result = run_cli("verify", folder, *CPU_ONLY, "-q")
        assert_one_line_error(result, 2, message)
        return message

    data = (artifact_fp32 / "prefill.onnx").read_bytes()
    messages = {
        "truncated": damaged("truncated", data[: len(data) // 2]),
        "empty": damaged("empty", b""),
        "opset": damaged("opset", opset=17),
    }
    assert "prefill.onnx is no ONNX model (Error parsing message" in messages["truncated"]
    assert (
        "prefill.onnx has the inputs [], its manifest lists [input_ids, attention_mask, position_ids, labels]"
        in messages["empty"]
    )
    assert "prefill.onnx imports the opset [20], its manifest says 17" in messages["opset"]
    for name, message in messages.items():  # inspect showed each graph as "ok" and exited 0
        shown = run_cli("inspect", tmp_path / name, "--json")
        state = json.loads(shown.stdout)["file_status"]["prefill.onnx"]
        assert shown.exit_code == 2 and state != "ok" and f"prefill.onnx {state}; re-export" in message, state
    # An op type that is no UTF-8: onnxruntime's message quoting it fails to decode, a ValueError, on which its
    # Python binding printed a four-line "EP Error ... Falling back" banner to stdout, into --json's document.
    assert "'utf-8' codec can't decode byte 0xff" in damaged("op-type", data.replace(b"MatMul", b"\xffatMul", 1))
    result = run_cli("verify", tmp_path / "op-type", *CPU_ONLY, "--json", "-q")
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["kind"] == "input", result.stdout


def test_the_decode_steps_and_the_sweep_report_progress(artifact_fp32, tiny_model, monkeypatch, caplog):
    # Long checks report progress between their first line and the next check, not silence.
    monkeypatch.setattr(checks, "PROGRESS_INTERVAL", 0.0)  # a line after every item but the last
    monkeypatch.setattr(checks, "sweep_grid", lambda context: [(1, 1, 0), (2, 2, 1), (3, 1, 17)])
    artifact = Artifact.open(artifact_fp32)
    settings = ParitySettings(decode_steps=3, greedy_tokens=2, probe=False)
    with caplog.at_level(logging.INFO, logger=checks.__name__):
        report = verify_artifact(artifact, tiny_model, ["cpu"], settings, genai=False, transformers_js=False)
    assert report.passed
    lines = [r.getMessage() for r in caplog.records if r.name == checks.__name__]
    assert lines == [
        "decode steps: 1/4 done",
        "decode steps: 2/4 done",
        "decode steps: 3/4 done",
        "sweep shapes: 1/3 done",
        "sweep shapes: 2/3 done",
        "sweep: 3/3 shapes pass",
    ]
    caplog.clear()
    monkeypatch.setattr(checks, "PROGRESS_INTERVAL", 5.0)  # the default: a tiny loop this short says nothing
    with caplog.at_level(logging.INFO, logger=checks.__name__):
        verify_artifact(artifact, tiny_model, ["cpu"], settings, genai=False, transformers_js=False)
    assert [r.getMessage() for r in caplog.records if r.name == checks.__name__] == ["sweep: 3/3 shapes pass"]


def test_expert_choice_that_measured_nothing_is_skipped_in_every_report(moe2_artifact, moe2_model, monkeypatch):
    """Router TopK nodes that cannot be found (renamed or fused by another tool): the expert choice check measured
    nothing. Every report shows it as skipped with the reason and counts it in no pass; the verdict does not fail
    on it either (a limitation of the check, not a parity failure)."""
    from exporter.verify.checks import routers

    monkeypatch.setattr(routers, "router_layers", lambda proto: {})
    report = verify_artifact(moe2_artifact, moe2_model, ["cpu"], QUICK, genai=False, transformers_js=False)
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


def test_a_folder_an_export_swaps_during_the_verification_is_an_error_not_a_report(artifact_copy, monkeypatch):
    """The checks after the sessions loaded (the invariants, the debug copies, onnxruntime-genai) read the folder
    again: after an export landed there, they read the other artifact's files, and a report judged the mix."""
    from helpers import swapped_in_first

    import exporter.verify.engine as engine

    monkeypatch.setattr(engine, "check_invariants", swapped_in_first(engine.check_invariants, artifact_copy))
    with pytest.raises(ArtifactError, match=r"was replaced while it was read \(an export into it meanwhile\?\)"):
        verify_artifact(artifact_copy, settings=QUICK, genai=False, transformers_js=False)


def test_verify_reads_the_manifest_once_and_hashes_each_file_once(artifact_fp32, monkeypatch):
    """`export-onnx verify` opens the artifact once and hands it down: manifest.json is read once, each listed file
    hashed once, each graph parsed once (the sessions load the graph files themselves)."""
    import collections
    import pathlib

    from exporter.artifact import folder as folder_module
    from exporter.artifact import manifest as manifest_module

    listed = read_manifest(artifact_fp32, check_hashes=False).files
    manifest_reads, hashed, parsed = collections.Counter(), collections.Counter(), collections.Counter()
    read_text, read_bytes = pathlib.Path.read_text, pathlib.Path.read_bytes
    sha256_file, load = manifest_module.sha256_file, folder_module.onnx.load

    def counted_read_text(path, *args, **kwargs):
        if path.name == "manifest.json":
            manifest_reads[str(path)] += 1
        return read_text(path, *args, **kwargs)

    def counted_read_bytes(path):
        if path.name == "manifest.json":
            manifest_reads[str(path)] += 1
        return read_bytes(path)

    def counted_sha256(path):
        hashed[pathlib.Path(path).name] += 1
        return sha256_file(path)

    def counted_load(path, *args, **kwargs):
        parsed[pathlib.Path(path).name] += 1
        return load(path, *args, **kwargs)

    def counted_open(path, *args, **kwargs):  # the bounded JSON reader (artifact/paths.py) opens with os.open
        if pathlib.Path(path).name == "manifest.json":
            manifest_reads[str(path)] += 1
        return real_open(path, *args, **kwargs)

    real_open = os.open
    monkeypatch.setattr(pathlib.Path, "read_text", counted_read_text)
    monkeypatch.setattr(pathlib.Path, "read_bytes", counted_read_bytes)
    monkeypatch.setattr(os, "open", counted_open)
    monkeypatch.setattr(manifest_module, "sha256_file", counted_sha256)
    monkeypatch.setattr(folder_module.onnx, "load", counted_load)
    result = run_cli(
        "verify",
        artifact_fp32,
        *CPU_ONLY,
        "--decode-steps",
        "2",
        "--no-sweep",
    )
    assert result.exit_code == 0, result.output
    assert list(manifest_reads.values()) == [1], manifest_reads
    assert hashed == {name: 1 for name in listed}, hashed
    assert parsed == {"prefill.onnx": 1, "decode.onnx": 1}, parsed
