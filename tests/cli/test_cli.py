"""The export-onnx command: the thin layer users meet first."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from helpers import CPU_ONLY, assert_one_line_error, claim_seed, edit_manifest, run_cli

# Verification options that keep a CLI test short; the default run is covered in test_verify_engine.
QUICK = ("--decode-steps", "16", "--no-sweep")


@pytest.fixture(scope="module")
def cli_artifact(tmp_path_factory):
    """An inference-only (no loss) tiny artifact exported and verified by `run`, the default command."""
    folder = tmp_path_factory.mktemp("cli") / "tiny"
    report = folder.parent / "report.json"
    result = run_cli(
        "run",
        "--preset",
        "minimind-3-tiny",
        "--no-loss",
        "-o",
        folder,
        *CPU_ONLY,
        "--decode-steps",
        "2",
        "--no-sweep",
        "--json",
        "-q",
        "--report-json",
        report,
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert json.loads(report.read_text()) == data["verify"]  # the verification's document, as `verify` writes it
    assert data["export"]["folder"] == str(folder) and data["export"]["dtype"] == "float32"
    assert data["verify"]["passed"] and len(data["verify"]["providers"][0]["decode_curve"]) == 3
    return folder


def test_no_command_runs_the_default_export_and_verification(monkeypatch):
    from exporter.errors import ToolkitError

    def stop(model, folder, dtype, with_loss, source, tokenizer, **quantization):
        raise ToolkitError(f"stopped before exporting {source} ({dtype}, loss {with_loss}) to {folder}")

    monkeypatch.setattr("exporter.export.pipeline.export_artifact", stop)
    result = run_cli()
    assert result.exit_code == 2, result.output
    assert (
        "stopped before exporting {'kind': 'seeded', 'preset': 'minimind-3', 'seed': 0} (float32, loss True) "
        "to artifacts/minimind-3"
    ) in result.stderr


def test_an_unexpected_failure_exits_three_with_one_line(cli_artifact, monkeypatch):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr("exporter.cli.export_report.format_inspect", broken)
    result = run_cli("inspect", cli_artifact)
    assert result.exit_code == 3
    assert result.stderr.strip() == "internal error: RuntimeError: boom (rerun with --verbose for the traceback)"
    verbose = run_cli("inspect", cli_artifact, "-v")
    assert verbose.exit_code == 3 and 'raise RuntimeError("boom")' in verbose.stderr
    assert verbose.stderr.strip().splitlines()[-1] == "internal error: RuntimeError: boom"
    verbose = run_cli("generate", cli_artifact, "--prompt-ids", "1,99999", "-v")  # an input error's origin too
    assert verbose.exit_code == 2 and "Traceback" in verbose.stderr and "in check_prompt" in verbose.stderr


def test_run_exits_one_on_a_parity_failure(artifact_fp32, tmp_path, monkeypatch):
    """`run` reports a failing verification by its exit code, as `verify` does (the export is the session's,
    copied: the exit code is what is checked here)."""
    from exporter.artifact.manifest import read_manifest
    from exporter.export.pipeline import ExportResult

    def exported(model, folder, dtype, with_loss, source, tokenizer, **quantization):
        shutil.copytree(artifact_fp32, folder)
        return ExportResult(folder, read_manifest(folder), 0.0, 0)

    monkeypatch.setattr("exporter.export.pipeline.export_artifact", exported)
    result = run_cli(
        "run",
        "--preset",
        "minimind-3-tiny",
        "-o",
        tmp_path / "tiny",
        *CPU_ONLY,
        "-q",
        *QUICK,
        "--atol",
        "logits=0",
        "--rtol",
        "logits=0",
        "--peak",
        "logits=0",
    )
    assert result.exit_code == 1, result.output
    assert "overall: FAIL" in result.stdout


def test_an_interrupted_command_exits_130_in_one_line(tmp_path, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C during the export

    monkeypatch.setattr("exporter.export.pipeline.export_artifact", interrupt)
    assert_one_line_error(
        run_cli("export", "--preset", "minimind-3-tiny", "-o", tmp_path / "x", "-q"),
        130,
        "interrupted; an export leaves no partial artifact",
    )


def test_help_explains_commands_and_exit_codes():
    result = run_cli("--help")
    assert result.exit_code == 0
    for word in ("run", "export", "verify", "generate", "inspect", "Exit codes"):
        assert word in result.output


def test_python_dash_m_runs_the_command():
    """`python -m exporter.cli` is the command where the console script is not on PATH: it runs the command, not
    exit 0 without doing anything."""
    out = subprocess.run(
        [sys.executable, "-m", "exporter.cli", "inspect", "--help"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "Show an artifact's I/O contract" in out.stdout, out.stderr[-3000:]


def test_help_lists_the_export_options_in_their_written_order():
    """The order of README's command table: the model first, the tokenizer last."""
    for command in ("export", "run"):
        result = run_cli(command, "--help")
        options = [
            re.match(r"  (?:-\w, )?(--[\w-]+)", line).group(1)
            for line in result.output.splitlines()
            if line.startswith("  -")
        ]
        assert options[:17] == [
            "--preset",
            "--checkpoint",
            "--config",
            "--seed",
            "--output",
            "--dtype",
            "--block-size",
            "--accuracy-level",
            "--quant-algorithm",
            "--smoothing",
            "--lm-head",
            "--embedding",
            "--activations",
            "--no-loss",
            "--tokenizer",
            "--no-tokenizer",
            "--trace-all-layers",
        ], options


def test_no_loss_export_drops_labels_and_loss(cli_artifact):
    manifest = json.loads((cli_artifact / "manifest.json").read_text())
    prefill = manifest["graphs"]["prefill"]
    assert [s["name"] for s in prefill["inputs"]] == ["input_ids", "attention_mask", "position_ids"]
    assert "loss" not in [s["name"] for s in prefill["outputs"]]


def test_verify_passes_with_json_and_exit_code_zero(cli_artifact):
    result = run_cli("verify", cli_artifact, "--provider", "cpu", "--json", "-q", *QUICK)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["providers"][0]["provider"] == "CPUExecutionProvider"
    assert report["consumers"][0]["model_type"] == "qwen3" and report["consumers"][0]["passed"]
    assert "prefill loss" not in [c["name"] for c in report["providers"][0]["comparisons"]]


def test_verify_exits_one_on_a_parity_failure(cli_artifact, tmp_path):
    # Same config, other weights: claim seed 1 in a copy of the manifest (hashes still match the files).
    copy = shutil.copytree(cli_artifact, tmp_path / "wrong")
    edit_manifest(copy, claim_seed(1))
    result = run_cli("verify", copy, "--provider", "cpu", "-q", *QUICK)
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.stdout


def test_a_failing_report_is_strict_json_on_stdout_and_in_its_file(cli_artifact, tmp_path):
    # Zero tolerances: each multiple of the tolerance is infinite, which Python's json would write as Infinity.
    path = tmp_path / "report.json"
    result = run_cli(
        "verify",
        cli_artifact,
        *CPU_ONLY,
        "-q",
        *QUICK,
        "--json",
        "--report-json",
        path,
        "--atol",
        "logits=0",
        "--rtol",
        "logits=0",
        "--peak",
        "logits=0",
    )
    assert result.exit_code == 1, result.output

    def not_json(constant):
        raise AssertionError(f"{constant} is not JSON")

    for text in (result.stdout, path.read_text()):
        report = json.loads(text, parse_constant=not_json)
        prefill = report["providers"][0]["comparisons"][0]
        assert prefill["name"] == "prefill logits" and not prefill["passed"] and prefill["needed"]["scale"] is None


def test_table_output_names_every_check(cli_artifact, cpu_only):
    result = run_cli("verify", cli_artifact, "-q", *QUICK)
    assert result.exit_code == 0, result.output
    for row in (
        "prefill logits",
        "decode logits (17 steps)",
        "reference-free invariants",
        "greedy tokens",
        "overall: PASS",
        "consumer onnxruntime-genai",
        "32/32 match, 32 tokens identical",
    ):
        assert row in result.stdout
    assert "CUDAExecutionProvider: skipped (not available in this onnxruntime build" in result.stdout
    result = run_cli("verify", cli_artifact, *CPU_ONLY, "-q", *QUICK)
    assert result.exit_code == 0 and "consumer onnxruntime-genai: skipped (turned off)" in result.stdout


def test_generate_and_inspect(cli_artifact):
    result = run_cli("generate", cli_artifact, "--prompt-ids", "1,17,230", "--max-new-tokens", "6", "-q")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.split()) == 6
    result = run_cli("inspect", cli_artifact)
    assert result.exit_code == 0, result.output
    assert "past_key_values.1.value" in result.stdout and "past_sequence_length" in result.stdout


def test_an_interrupted_generation_ends_its_streamed_line_and_says_nothing_of_exports(cli_artifact, monkeypatch):
    from exporter.runtime import generation

    def interrupted_after_two(*args):  # Ctrl-C while the third token is being computed
        yield [5]
        yield [6]
        raise KeyboardInterrupt

    monkeypatch.setattr(generation, "stream", interrupted_after_two)
    result = run_cli("generate", cli_artifact, "--prompt-ids", "1,17", "-q")
    assert result.exit_code == 130
    assert result.stdout == "5 6 \n" and result.stderr == "interrupted\n"


def test_reexport_replaces_the_artifact(cli_artifact, tmp_path):
    folder = shutil.copytree(cli_artifact, tmp_path / cli_artifact.name)  # the module's artifact stays inference-only
    before = json.loads((folder / "manifest.json").read_text())
    result = run_cli("export", "--preset", "minimind-3-tiny", "--seed", "3", "-o", folder, "-q")
    assert result.exit_code == 0, result.output
    after = json.loads((folder / "manifest.json").read_text())
    assert after["model"]["source"]["seed"] == 3 and "labels" not in [
        i["name"] for i in before["graphs"]["prefill"]["inputs"]
    ]
    assert after["files"]["weights.onnx.data"]["sha256"] != before["files"]["weights.onnx.data"]["sha256"]
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


def test_bad_inputs_give_one_line_errors(cli_artifact, tmp_path, cpu_only, tiny_tokenizer):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert_one_line_error(run_cli("export", "--preset", "minimind-9", "-q"), 2, "minimind-9")
    assert_one_line_error(run_cli("export", "--preset", "minimind-3-tiny", "-o", a_file, "-q"), 2, "is a file")
    assert_one_line_error(run_cli("verify", tmp_path, "-q"), 2, "has no manifest.json")
    assert_one_line_error(
        run_cli("generate", cli_artifact, "--prompt-ids", "1,99999", "-q"), 2, "outside the vocabulary"
    )
    assert_one_line_error(run_cli("generate", cli_artifact, "--prompt-ids", "1,x", "-q"), 2, "not a list of integers")
    assert_one_line_error(
        run_cli("generate", cli_artifact, "--prompt-ids", "1", "--max-new-tokens", "300", "-q"),
        2,
        "exceeds max_position_embeddings",
    )
    assert_one_line_error(run_cli("generate", cli_artifact, "-q"), 2, "one of --prompt-ids, --prompt and --chat")
    assert_one_line_error(
        run_cli("generate", cli_artifact, "--prompt-ids", "1", "--threads", "100000000000", "-q"),
        2,
        "must be an integer from 0 (one per core) to 1024, got 100000000000",
    )
    assert_one_line_error(
        run_cli("generate", cli_artifact, "--prompt-ids", "1", "--tokenizer", "none.json", "-q"),
        2,
        "--tokenizer reads --prompt text; with --prompt-ids, drop it",
    )
    assert_one_line_error(run_cli("generate", cli_artifact, "--prompt", "hi", "-q"), 2, "lists no tokenizer.json")
    assert_one_line_error(
        run_cli("generate", cli_artifact, "--prompt-ids", "1", "--save-optimized", cli_artifact / "opt", "-q"),
        2,
        "lies inside the artifact folder",
    )
    unlisted = shutil.copytree(cli_artifact, tmp_path / "unlisted")  # a tokenizer dropped in after the export
    shutil.copyfile(tiny_tokenizer / "tokenizer.json", unlisted / "tokenizer.json")
    assert_one_line_error(run_cli("generate", unlisted, "--prompt", "hi", "-q"), 2, "lists no tokenizer.json")
    assert_one_line_error(
        run_cli("export", "--preset", "minimind-3-tiny", "--tokenizer", a_file, "-o", tmp_path / "t", "-q"),
        2,
        "is not a readable JSON file",
    )
    assert not (tmp_path / "t").exists()
    assert_one_line_error(run_cli("verify", cli_artifact, "--provider", "cuda", "-q"), 2, "not available")
    assert_one_line_error(run_cli("verify", cli_artifact, "--atol", "logits", "-q"), 2, "expected KIND=VALUE")
    assert_one_line_error(run_cli("verify", cli_artifact, "--rtol", "weights=1", "-q"), 2, "unknown kind 'weights'")
    assert_one_line_error(run_cli("verify", cli_artifact, "--tolerances", a_file, "-q"), 2, "tolerance file")
    assert_one_line_error(run_cli("verify", cli_artifact, "--decode-steps", "0", "-q"), 2, "decode-steps")
    assert_one_line_error(
        run_cli("verify", cli_artifact, "--golden", tmp_path, "-q"), 2, "not a readable golden bundle"
    )
    tampered = shutil.copytree(cli_artifact, tmp_path / "tampered")
    data = bytearray((tampered / "genai_config.json").read_bytes())
    data[len(data) // 2] ^= 1  # same size, other content
    (tampered / "genai_config.json").write_bytes(data)
    assert_one_line_error(
        run_cli("generate", tampered, "--prompt-ids", "1", "-q"), 2, "sha256 of genai_config.json does not match"
    )
    (tampered / "genai_config.json").write_text("{}")
    assert_one_line_error(
        run_cli("generate", tampered, "--prompt-ids", "1", "-q"),
        2,
        f"genai_config.json is 2 bytes, not {len(data)} (truncated or modified)",
    )
    assert a_file.read_text() == "x"


def _commands_without_torch(commands: list[list]) -> list[tuple[int, str]]:
    """Each export-onnx command's exit code and stderr, in a process where torch does not import."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.modules["torch"] = None  # any import of torch now fails
        from click.testing import CliRunner
        from exporter.cli import main
        results = [CliRunner().invoke(main, args) for args in {[[str(a) for a in c] for c in commands]!r}]
        print(json.dumps([[r.exit_code, r.stderr] for r in results]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [tuple(r) for r in json.loads(out.stdout.strip().splitlines()[-1])]


def test_verify_writes_reports_and_a_golden_bundle_then_replays_it(cli_artifact, tmp_path):
    out = tmp_path / "out"
    result = run_cli(
        "verify",
        cli_artifact,
        *CPU_ONLY,
        "-q",
        "--decode-steps",
        "3",
        "--no-sweep",
        "--atol",
        "logits=2e-4",
        "--report-json",
        out / "r.json",
        "--junit",
        out / "r.xml",
        "--html",
        out / "r.html",
        "--golden-save",
        out / "golden",
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "r.json").read_text())
    assert report["providers"][0]["tolerances"]["logits"]["atol"] == 2e-4
    assert len(report["providers"][0]["decode_curve"]) == 4 and (out / "r.xml").is_file()
    assert "<svg" in (out / "r.html").read_text()
    result = run_cli("verify", cli_artifact, "--provider", "cpu", "--golden", out / "golden", "--json", "-q")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["reference"] == f"golden bundle {out / 'golden'}"
    without_torch = _commands_without_torch(
        [
            ["inspect", cli_artifact, "--json"],
            ["generate", cli_artifact, "--prompt-ids", "1,2", "--max-new-tokens", "2"],
            ["verify", cli_artifact, "--golden", out / "golden", "--no-genai", "--no-transformers-js", "-q"],
            ["verify", cli_artifact, "-q"],
            ["export", "--preset", "minimind-3-tiny", "-o", tmp_path / "new", "-q"],
        ]
    )
    assert [code for code, _ in without_torch] == [0, 0, 0, 2, 2], without_torch  # a deployment with onnxruntime only
    assert without_torch[3][1].startswith("error: verifying against the reference model needs PyTorch")
    assert "(--golden)" in without_torch[3][1] and "install the export extra" in without_torch[3][1]
    assert without_torch[4][1].startswith("error: exporting needs the export extra")
    result = run_cli(
        "verify",
        cli_artifact,
        "--provider",
        "cpu",
        "--atol",
        "logits=0",
        "--rtol",
        "logits=0",
        "--peak",
        "logits=0",
        "-q",
        "--decode-steps",
        "3",
        "--no-sweep",
        "--no-genai",
        "--no-transformers-js",
    )
    assert result.exit_code == 1 and "FAIL" in result.stdout  # nothing is bit-exact between the two sides


def _report_options(folder):
    return ("--report-json", folder / "r.json", "--junit", folder / "r.xml", "--html", folder / "r.html")


def test_a_verification_stopped_by_an_error_leaves_error_reports_not_an_earlier_pass(cli_artifact, tmp_path):
    reports = tmp_path / "reports"
    result = run_cli(
        "verify",
        cli_artifact,
        *CPU_ONLY,
        "-q",
        "--decode-steps",
        "2",
        "--no-sweep",
        *_report_options(reports),
    )
    assert result.exit_code == 0 and json.loads((reports / "r.json").read_text())["passed"], result.output
    earlier = {name: (reports / name).read_text() for name in ("r.json", "r.xml", "r.html")}
    # A usage error in the options themselves: nothing ran, so the reports are left as they were.
    refused = run_cli("verify", cli_artifact, "--atol", "logits", "-q", *_report_options(reports))
    assert refused.exit_code == 2 and {name: (reports / name).read_text() for name in earlier} == earlier
    damaged = shutil.copytree(cli_artifact, tmp_path / "damaged")
    with open(damaged / "weights.onnx.data", "r+b") as f:  # one flipped byte: the manifest's sha256 refuses it
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    result = run_cli(
        "verify",
        damaged,
        *CPU_ONLY,
        "-q",
        "--json",
        *_report_options(reports),
    )
    assert_one_line_error(result, 2, "sha256 of weights.onnx.data does not match")
    error = json.loads(result.stdout)
    assert json.loads((reports / "r.json").read_text()) == error and error["exit_code"] == 2
    suite = ET.fromstring((reports / "r.xml").read_text()).find("testsuite")
    assert (suite.get("tests"), suite.get("errors"), suite.get("failures")) == ("1", "1", "0")
    assert "sha256 of weights.onnx.data does not match" in suite.find("testcase/error").get("message")
    page = (reports / "r.html").read_text()
    assert "ERROR" in page and "sha256 of weights.onnx.data does not match" in page and "PASS" not in page
    assert sorted(p.name for p in reports.iterdir()) == ["r.html", "r.json", "r.xml"]  # no partial file left


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here to fail a write with ENOSPC")
def test_a_report_that_cannot_be_written_is_a_one_line_error_after_the_verdict(cli_artifact, tmp_path):
    result = run_cli(
        "verify",
        cli_artifact,
        *CPU_ONLY,
        "-q",
        "--decode-steps",
        "2",
        "--no-sweep",
        "--json",
        "--report-json",
        tmp_path / "r.json",
        "--junit",
        "/dev/full",
    )
    assert_one_line_error(result, 2, "--junit /dev/full: cannot write the report (No space left on device)")
    verdict = json.loads(result.stdout)  # the verdict alone: one JSON document, no error object after it
    assert verdict["passed"] and json.loads((tmp_path / "r.json").read_text()) == verdict
    assert Path("/dev/full").is_char_device()  # written as it is, never renamed over


def test_a_report_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from exporter.artifact.paths import write_text_whole

    report = tmp_path / "r.json"
    write_text_whole(report, "earlier")

    def interrupted(source, destination):
        raise KeyboardInterrupt

    monkeypatch.setattr("exporter.artifact.paths.os.replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_text_whole(report, "later")
    assert report.read_text() == "earlier" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_report_that_cannot_be_written_leaves_no_folder_made_for_it(tmp_path, monkeypatch):
    # --report-json reports/ci/r.json on a full disk left reports/ci/ behind, empty.
    from exporter.artifact.paths import write_text_whole

    def full_disk(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("exporter.artifact.paths.os.replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_text_whole(tmp_path / "reports" / "ci" / "r.json", "report")
    assert list(tmp_path.iterdir()) == []


def test_a_report_is_written_through_a_link_and_into_a_pipe_as_it_is(tmp_path):
    """Renamed over, a link would become a file of its own (the target keeping the earlier report) and a named
    pipe (or /dev/stdout) a regular file nobody reads."""
    from exporter.artifact.paths import write_text_whole

    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("earlier")
    link.symlink_to(target)
    write_text_whole(link, "later")
    assert link.is_symlink() and target.read_text() == "later"
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # a reader is there, so opening for writing does not block
    try:
        write_text_whole(pipe, "report")
        assert os.read(reader, 100) == b"report"
    finally:
        os.close(reader)
    assert pipe.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "pipe", "target.json"]


def test_a_golden_replay_judges_with_the_overrides_it_was_recorded_with(cli_artifact, tmp_path):
    # Recorded under zero tolerance for logits and present (float32's profile is the peak term alone), which
    # nothing meets: the replay must fail as the recording did, not pass under the default profile.
    golden = tmp_path / "golden"
    recorded = run_cli(
        "verify",
        cli_artifact,
        *CPU_ONLY,
        "-q",
        "--decode-steps",
        "3",
        "--no-sweep",
        "--peak",
        "logits=0",
        "--peak",
        "kv=0",
        "--golden-save",
        golden,
    )
    assert recorded.exit_code == 1 and json.loads((golden / "golden.json").read_text())["overrides"] == {
        "logits.peak": 0.0,
        "kv.peak": 0.0,
    }

    def replay(*overrides):
        args = ("verify", cli_artifact, *CPU_ONLY, "-q", "--golden", golden, *overrides)
        result, text = run_cli(*args, "--json"), run_cli(*args)
        assert text.exit_code == result.exit_code, text.output
        return result.exit_code, json.loads(result.stdout), text.stdout

    code, report, text = replay()
    assert code == 1 and report["tolerance_overrides"] == {
        "applied": {"logits.peak": 0.0, "kv.peak": 0.0},
        "given": {},
        "recorded_in_golden_bundle": {"logits.peak": 0.0, "kv.peak": 0.0},
    }
    assert report["providers"][0]["tolerances"]["overridden"] == ["logits.peak", "kv.peak"]
    assert (
        "tolerance overrides: logits.peak=0 (recorded in the golden bundle), kv.peak=0 (recorded in the golden bundle)"
    ) in text
    # A term given for the replay takes the place of the recorded one; the other recorded term stays.
    profile = report["providers"][0]["tolerances"]
    code, report, text = replay("--peak", "logits=1e-3")
    tolerances = report["providers"][0]["tolerances"]
    assert code == 1 and tolerances["logits"]["peak"] == 1e-3 and tolerances["kv"]["peak"] == 0
    assert tolerances["logits"]["atol"] == profile["logits"]["atol"]  # terms neither set keep the profile's
    assert {c["name"]: c["passed"] for c in report["providers"][0]["comparisons"]}["prefill logits"]
    assert "kv.peak=0 (recorded in the golden bundle), logits.peak=0.001 (given, in place of the bundle's 0)" in text
    code, report, _ = replay("--peak", "logits=1e-3", "--peak", "kv=1e-3")
    assert code == 0 and report["passed"], report
    # A bundle whose recorded overrides cannot be read is damaged, said in one line as the other bundle checks.
    meta = json.loads((golden / "golden.json").read_text())
    meta["overrides"] = {"logits.peak": "loose"}
    (golden / "golden.json").write_text(json.dumps(meta))
    assert_one_line_error(
        run_cli("verify", cli_artifact, "--golden", golden, "-q"),
        2,
        "golden.json overrides logits.peak: 'loose' is not a number",
    )


def test_generate_json_says_whether_a_row_stopped(cli_artifact):
    """Each row is Generation.to_dict(): a script tells a stop from reaching --max-new-tokens, which prompt_ids and
    new_ids alone would not say."""

    def rows(*options):
        result = run_cli(
            "generate",
            cli_artifact,
            "--prompt-ids",
            "1,17,230",
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--json",
            "-q",
            *options,
        )
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    [free] = rows()
    assert free == {"prompt_ids": [1, 17, 230], "new_ids": free["new_ids"], "stopped": False, "engine": "ort"}
    assert len(free["new_ids"]) == 6
    stop = free["new_ids"][2]
    [stopped] = rows("--stop-id", str(stop))
    assert stopped["new_ids"] == free["new_ids"][: free["new_ids"].index(stop) + 1]
    assert stopped["stopped"] is True


def test_generate_samples_with_the_options_given(cli_artifact):
    """Every sampling option reaches the sampler: the command's tokens are the Python API's with the same
    settings (an option dropped on the way would sample with its default, in silence)."""
    from exporter.runtime.generation import SamplingConfig, generate
    from exporter.runtime.runner import OrtRunner

    options = {"temperature": 0.5, "top_k": 8, "top_p": 0.9, "repetition_penalty": 3.0, "seed": 5}
    result = run_cli(
        "generate",
        cli_artifact,
        "--prompt-ids",
        "1,42,7",
        "--max-new-tokens",
        "16",
        "--sample",
        "--json",
        "-q",
        *[arg for name, value in options.items() for arg in (f"--{name.replace('_', '-')}", value)],
    )
    assert result.exit_code == 0, result.output
    runner = OrtRunner(cli_artifact)
    expected = generate(
        runner, [[1, 42, 7]], 16, SamplingConfig(do_sample=True, **options), runner.manifest.config.eos_token_id
    )[0].new_ids
    assert json.loads(result.stdout)[0]["new_ids"] == expected


def test_generate_stops_at_the_models_eos_unless_told_to_ignore_it(cli_artifact, tmp_path):
    folder = shutil.copytree(cli_artifact, tmp_path / "tiny")

    def row(*options):
        result = run_cli(
            "generate", folder, "--prompt-ids", "1,17,230", "--max-new-tokens", "10", "--json", "-q", *options
        )
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)[0]

    free = row("--ignore-eos")["new_ids"]
    eos = free[3]  # a token the model emits, made its eos
    edit_manifest(folder, lambda manifest: manifest["model"]["config"].update(eos_token_id=eos))
    stopped = {"prompt_ids": [1, 17, 230], "new_ids": free[: free.index(eos) + 1], "stopped": True, "engine": "ort"}
    assert row() == stopped
    assert row("--ignore-eos") == {"prompt_ids": [1, 17, 230], "new_ids": free, "stopped": False, "engine": "ort"}


@pytest.mark.parametrize(
    "command, step",
    [
        (
            ["inspect"],
            "exporter.artifact.manifest.file_status",
        ),  # a sound new export is not "damaged: sha256 differs"
        (["generate", "--prompt-ids", "1,2", "--max-new-tokens", "2"], "exporter.runtime.runner.OrtRunner"),
        (
            [
                "verify",
                "-q",
                *CPU_ONLY,
                "--decode-steps",
                "2",
                "--no-sweep",
            ],
            "exporter.verify.engine.verify_artifact",
        ),  # not a parity FAIL (exit 1) on a mix of two exports' files
    ],
    ids=["inspect", "generate", "verify"],
)
def test_a_folder_an_export_swaps_while_a_command_reads_it_is_a_one_line_error(
    artifact_copy, monkeypatch, command, step
):
    """An export into the folder landing after the command read the manifest (and hashed the files) and before it
    read the rest: what it read mixed two artifacts, named as damage or a parity failure, or used without a word."""
    from helpers import swapped_in_first

    module, name = step.rsplit(".", 1)
    monkeypatch.setattr(
        module + "." + name, swapped_in_first(getattr(__import__(module, fromlist=[name]), name), artifact_copy)
    )
    result = run_cli(command[0], artifact_copy, *command[1:])
    assert_one_line_error(
        result, 2, f"error: {artifact_copy} was replaced while it was read (an export into it meanwhile?)"
    )


def test_inspect_says_where_the_weights_came_from_in_words(cli_artifact):
    from exporter.cli.export_report import describe_source

    result = run_cli("inspect", cli_artifact)
    assert result.exit_code == 0, result.output
    assert "  weights from: seeded preset minimind-3-tiny, seed 0\n" in result.stdout  # a dict's repr before
    assert describe_source({"kind": "in-memory"}) == "in-memory"
    assert describe_source(
        {
            "kind": "checkpoint",
            "path": "/m/model.pth",
            "sha256": "ab12",
            "format": "torch",
            "converted": {},
            "assumed": {"max_position_embeddings": 32768},
        }
    ) == ("checkpoint, path=/m/model.pth, sha256=ab12, format=torch, assumed={'max_position_embeddings': 32768}")


def test_generate_names_the_flag_of_a_negative_count(cli_artifact):
    # click's check, as for --decode-steps and --seed: the flag the user typed, not the library's parameter name
    assert_one_line_error(
        run_cli("generate", cli_artifact, "--prompt-ids", "1", "--prompt-chunk", "-1", "-q"),
        2,
        "Invalid value for '--prompt-chunk': -1 is not in the range x>=0",
    )
    assert_one_line_error(
        run_cli("generate", cli_artifact, "--prompt-ids", "1", "--max-new-tokens", "-3", "-q"),
        2,
        "Invalid value for '--max-new-tokens': -3 is not in the range x>=0",
    )


@pytest.mark.parametrize(
    "option,value,named",
    [
        ("--temperature", "0", "--temperature must lie in"),
        ("--top-k", "-1", "--top-k must be an integer >= 0"),
        ("--top-p", "0", "--top-p must lie in (0, 1]"),
        ("--repetition-penalty", "0", "--repetition-penalty must lie in"),
        ("--stop-id", "600", "stop ids (--stop-id) [600] are not token ids"),
    ],
)
def test_generate_names_the_flag_of_a_sampling_value_out_of_range(cli_artifact, option, value, named):
    # The library's check names its parameter (`top_k`), the CLI the flag the user typed (--top-k), as the other
    # refusals that the API and the CLI share.
    assert_one_line_error(
        run_cli("generate", cli_artifact, "--prompt-ids", "1", "--sample", option, value, "-q"), 2, named
    )


def test_sampling_options_without_sample_are_refused(cli_artifact):
    # Ignored, they would print the greedy tokens with exit 0 as if --temperature 5 --top-p 0.1 --seed 9 had applied.
    assert_one_line_error(
        run_cli(
            "generate",
            cli_artifact,
            "--prompt-ids",
            "1,42,7",
            "--temperature",
            "5",
            "--top-p",
            "0.1",
            "--seed",
            "9",
            "-q",
        ),
        2,
        "--temperature, --top-p, --seed only shape sampling, and without --sample the decoding is "
        "greedy; add --sample, or drop them",
    )
    assert_one_line_error(
        run_cli("generate", cli_artifact, "--prompt-ids", "1,42,7", "--seed", "9", "-q"),
        2,
        "--seed only shapes sampling, and without --sample the decoding is greedy; add --sample, or drop it",
    )
    sampled = run_cli(
        "generate",
        cli_artifact,
        "--prompt-ids",
        "1,42,7",
        "--sample",
        "--temperature",
        "5",
        "--seed",
        "9",
        "--max-new-tokens",
        "2",
        "--json",
    )
    assert sampled.exit_code == 0, sampled.output


def test_the_python_api_records_the_source_the_cli_records_so_verify_rebuilds_it(
    cli_artifact, minimind2_artifact, minimind2_checkpoint, tmp_path
):
    from exporter.artifact.manifest import read_manifest
    from exporter.export.pipeline import export_artifact
    from reference.source import checkpoint_model, seeded_model

    assert seeded_model("minimind-3-tiny", seed=0).source == read_manifest(cli_artifact).source
    config = json.loads((minimind2_artifact.parent / "config.json").read_text())  # the export's --config
    sourced = checkpoint_model(minimind2_checkpoint, config_data=config)
    assert sourced.source == read_manifest(minimind2_artifact).source
    assert sourced.source["sha256"] and sourced.source["format"]  # the fingerprint and the LoadReport's fields
    folder = tmp_path / "api"
    export_artifact(sourced.model, folder, source=sourced.source)
    result = run_cli(
        "verify",
        folder,
        *CPU_ONLY,
        "--decode-steps",
        "1",
        "--no-sweep",
        "-q",
        "--json",
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["reference"].startswith("pytorch"), result.stdout[:500]


def test_a_checkpoints_default_artifact_folder_is_named_after_it(tmp_path, monkeypatch):
    # `--checkpoint .` is named after the current folder (Path(".").stem is ""), not artifacts/ itself, which would
    # then hold every later default export; MiniMind2-Small-v1.5/ and -v1.6/ keep their dots, so get folders of
    # their own; and two checkpoints fitting one --preset do not replace each other in artifacts/<preset>.
    from exporter.cli.exporting import output_folder
    from exporter.cli.options import DEFAULT_ROOT
    from exporter.errors import ToolkitError

    checkpoint = tmp_path / "MiniMind3-Tiny"
    (checkpoint / "MiniMind2-Small-v1.5").mkdir(parents=True)
    monkeypatch.chdir(checkpoint)
    assert output_folder(None, None, Path("."), "float32") == DEFAULT_ROOT / "minimind3-tiny"
    assert output_folder(None, None, Path("MiniMind2-Small-v1.5"), "float16") == (
        DEFAULT_ROOT / "minimind2-small-v1.5-float16"
    )
    assert output_folder(None, "minimind2-small", Path("full_sft_512.pth"), "float32") == DEFAULT_ROOT / "full_sft_512"
    assert output_folder(None, "minimind2-small", None, "float32") == DEFAULT_ROOT / "minimind2-small"
    # an int4 export for CUDA does not replace the one for the CPU
    assert output_folder(None, "minimind2-small", None, "int4", None) == DEFAULT_ROOT / "minimind2-small-int4"
    assert output_folder(None, "minimind2-small", None, "int4", "float32") == DEFAULT_ROOT / "minimind2-small-int4"
    assert output_folder(None, "minimind2-small", None, "int4", "float16") == (
        DEFAULT_ROOT / "minimind2-small-int4-float16"
    )
    assert output_folder(Path("out"), "minimind2-small", Path("."), "float32") == Path("out")
    with pytest.raises(
        ToolkitError,
        match=r"--checkpoint / has no name to call the artifact folder after; pass "
        r"--output DIR",
    ):
        output_folder(None, None, Path("/"), "float32")


def test_progress_lines_go_to_stderr_and_quiet_silences_them(tmp_path, monkeypatch):
    """stdout holds the result (or under --json the error object) alone: a progress line there would break every
    script reading it; -q leaves only the error line."""
    import logging

    from exporter.errors import ToolkitError

    def stopped(model, folder, dtype, with_loss, source, tokenizer, **quantization):
        logging.getLogger("exporter.export.tracing").info("exporting prefill.onnx with torch.onnx (dynamo)")
        raise ToolkitError("stopped after the first progress line")

    monkeypatch.setattr("exporter.export.pipeline.export_artifact", stopped)
    command = ("export", "--preset", "minimind-3-tiny", "-o", tmp_path / "x", "--json")
    loud = run_cli(*command)
    assert loud.exit_code == 2
    assert json.loads(loud.stdout)["error"]["message"] == "stopped after the first progress line"
    assert re.fullmatch(
        r"\[ *\d+\.\ds\] exporting prefill\.onnx with torch\.onnx \(dynamo\)\n"
        r"error: stopped after the first progress line\n",
        loud.stderr,
    ), loud.stderr
    quiet = run_cli(*command, "-q")
    assert quiet.exit_code == 2 and quiet.stderr == "error: stopped after the first progress line\n"
    assert json.loads(quiet.stdout) == json.loads(loud.stdout)


def test_stdout_closed_by_its_reader_exits_141_without_a_word(tmp_path, monkeypatch):
    # `export-onnx ... | head`: the reader went away, so there is no one to tell; the exit code says it.
    def closed(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("exporter.export.pipeline.export_artifact", closed)
    result = run_cli("export", "--preset", "minimind-3-tiny", "-o", tmp_path / "x", "-q")
    assert result.exit_code == 141 and result.stderr == "", result.output


def test_every_option_of_every_command_is_explained_in_its_help():
    import click

    from exporter.cli import main

    for name, command in main.commands.items():
        text = " ".join(run_cli(name, "--help").output.split())
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                assert param.help and param.help.strip(), f"{name} {param.opts[0]} has no help text"
                assert " ".join(param.help.split()[:4]) in text, (name, param.opts[0])


def test_inspect_shows_the_models_sizes_and_each_files_size(cli_artifact):
    result = run_cli("inspect", cli_artifact)
    assert result.exit_code == 0, result.output
    # minimind-3-tiny: 4 query heads over 2 kv heads, in that order
    assert "  model: minimind, 2 layers, hidden 64, heads 4/2, vocab 512, max positions 256\n" in result.stdout
    files = json.loads((cli_artifact / "manifest.json").read_text())["files"]
    rows = {line.split()[0]: line.split()[1:3] for line in result.stdout.splitlines() if line.endswith(" ok")}
    assert set(rows) == set(files)
    for name, entry in files.items():
        assert rows[name] == [f"{entry['bytes'] / 1e6:.2f}", "MB"], (name, rows[name], entry["bytes"])


def test_an_interrupt_outside_a_command_exits_130(tmp_path, monkeypatch):
    # A Ctrl-C while click parses or before the command's own handling starts: click's Abort, one word and 130
    # as for an interrupted command, not click's exit 1.
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr("exporter.cli.begin_command", interrupted)
    result = run_cli("inspect", tmp_path)
    assert result.exit_code == 130 and result.stderr.strip() == "aborted" and result.stdout == "", result.output


def test_an_interrupt_outside_a_command_still_prints_the_json_error(tmp_path, monkeypatch):
    # Under --json, stdout always parses: click's Abort left it empty.
    from exporter.cli.outcome import CommandState

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr("exporter.cli.begin_command", interrupted)
    monkeypatch.setattr("exporter.cli.outcome.state", CommandState())  # a fresh process's: no command has begun
    result = run_cli("inspect", tmp_path, "--json")
    assert result.exit_code == 130 and result.stderr.strip() == "aborted", result.output
    assert json.loads(result.stdout) == {"error": {"kind": "interrupted", "message": "aborted"}, "exit_code": 130}


def test_a_negative_prompt_id_is_named_as_outside_the_vocabulary_not_as_no_integer(cli_artifact):
    # "-1" is an integer: the refusal says where it lies, as for 99999 (input error), not that it is no number.
    result = run_cli("generate", cli_artifact, "--prompt-ids", "1,-1", "--json")
    assert_one_line_error(result, 2, "prompt token ids [-1] lie outside the vocabulary [0, 512)")
    assert json.loads(result.stdout)["error"]["kind"] == "input"


def test_export_says_what_it_wrote_in_one_line_above_the_files(artifact_fp16, tmp_path, monkeypatch):
    from exporter.artifact.manifest import read_manifest
    from exporter.export.pipeline import ExportResult

    def exported(model, folder, dtype, with_loss, source, tokenizer, **quantization):
        shutil.copytree(artifact_fp16, folder)
        return ExportResult(folder, read_manifest(folder), 2.54, 1_234_567)

    monkeypatch.setattr("exporter.export.pipeline.export_artifact", exported)
    folder = tmp_path / "half"
    result = run_cli("export", "--preset", "minimind-3-tiny", "--dtype", "float16", "-o", folder, "-q")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"exported {folder} (float16) in 2.5 s, 1.2 MB", lines[0]
    assert lines[1].split() == ["file", "size", "sha256"]
    assert {line.split()[0] for line in lines[3:]} == set(read_manifest(folder).files)


def test_the_cli_names_the_flag_of_each_parameter_the_library_names():
    """Library errors name parameters in backticks; a command's message names the flag that sets each instead,
    and leaves a parameter without a flag of its own as the library wrote it."""
    from exporter.cli.outcome import in_flags

    assert in_flags("choose another output folder (`folder`)") == "choose another output folder (--output)"
    assert in_flags('export it as float16 (`dtype="float16"`)') == "export it as float16 (--dtype float16)"
    assert in_flags('legs need both (`providers=["cpu", "cuda"]`)') == "legs need both (--provider cpu --provider cuda)"
    assert in_flags("`golden_save` records the reference") == "--golden-save records the reference"
    assert in_flags("`model` is missing; `settings` too") == "`model` is missing; `settings` too"


def test_one_error_hierarchy_covers_the_reference_models_errors():
    from exporter.errors import ToolkitError
    from reference.errors import CheckpointError, ConfigError, ContextLengthError, ModelError

    for error in (ModelError, ConfigError, CheckpointError, ContextLengthError):
        assert issubclass(error, ToolkitError) and issubclass(error, ValueError), error


def test_a_prompt_that_is_no_utf8_is_refused_in_one_line(artifact_fp32):
    # bytes of no UTF-8 in the command line reach Python as lone surrogates (os.fsdecode's surrogateescape)
    prompt = b"kalo \xff mine".decode("utf-8", "surrogateescape")
    result = run_cli("generate", artifact_fp32, "--prompt", prompt, "--max-new-tokens", "2", "-q")
    assert_one_line_error(result, 2, "the text is not valid UTF-8 (at character 5); give UTF-8 text")
