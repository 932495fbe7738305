"""Bad input to the export-onnx command: refused in one line with exit code 2, before any work is spent,
and without losing anything on disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from helpers import CPU_ONLY, assert_one_line_error, edit_graphs, edit_json, edit_manifest, run_cli


def refused(result, fragment: str) -> None:
    assert_one_line_error(result, 2, fragment)


def test_an_export_never_replaces_a_folder_holding_what_it_did_not_write(artifact_fp32, tmp_path, monkeypatch):
    webapp = tmp_path / "webapp"
    webapp.mkdir()
    (webapp / "manifest.json").write_text('{"name": "app"}')
    (webapp / "index.html").write_text("x")
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "-o", webapp, "-q"), "holds no manifest.json of this toolkit"
    )
    assert sorted(p.name for p in webapp.iterdir()) == ["index.html", "manifest.json"]

    artifact = shutil.copytree(artifact_fp32, tmp_path / "artifact")
    (artifact / "NOTES.md").write_text("mine")
    (artifact / "golden").mkdir()
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "-o", artifact, "-q"),
        "holds NOTES.md, golden/, which its artifact does not list and replacing it would delete them; move them out",
    )
    assert (artifact / "NOTES.md").read_text() == "mine"
    (artifact / "golden").rmdir()
    # One file is "it", several "them"; past five the rest are counted.
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "-o", artifact, "-q"),
        "holds NOTES.md, which its artifact does not list and replacing it would delete it; move it out",
    )
    for i in range(6):
        (artifact / f"note{i}.txt").write_text("mine")
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "-o", artifact, "-q"),
        "holds NOTES.md, note0.txt, note1.txt, note2.txt, note3.txt and 2 more, which",
    )
    for i in range(6):
        (artifact / f"note{i}.txt").unlink()
    (artifact / "NOTES.md").unlink()
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "-o", artifact / "sub", "-q"),
        f"lies inside the artifact folder {artifact}",
    )
    assert not (artifact / "sub").exists()
    monkeypatch.chdir(artifact)
    refused(run_cli("export", "--preset", "minimind-3-tiny", "-o", ".", "-q"), "holds the current directory")
    (tmp_path / "link").symlink_to(tmp_path)  # the same folder by another path
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "-o", tmp_path / "link" / "artifact", "-q"),
        "holds the current directory",
    )
    (tmp_path / "link").unlink()
    (tmp_path / "alias").symlink_to(artifact)  # the swap would replace the link, not the artifact
    refused(run_cli("export", "--preset", "minimind-3-tiny", "-o", tmp_path / "alias", "-q"), "is a symbolic link")
    assert (tmp_path / "alias").is_symlink()
    (tmp_path / "alias").unlink()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_checkpoint_inside_the_output_folder_is_not_read_before_the_folder_is_refused(tmp_path, monkeypatch):
    # The folder is refused before the checkpoint (gigabytes for a real model) is read.
    import reference.source

    monkeypatch.setattr(
        reference.source,
        "checkpoint_model",
        lambda *args, **kwargs: pytest.fail("the checkpoint was read before the folder was refused"),
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pth").write_bytes(b"weights")
    for command in ("export", "run"):
        refused(
            run_cli(command, "--checkpoint", out / "model.pth", "-o", out, "-q"),
            "holds no manifest.json of this toolkit",
        )
    assert [p.name for p in out.iterdir()] == ["model.pth"]


def test_run_checks_its_verification_options_before_exporting(tmp_path, monkeypatch):
    out = tmp_path / "never"
    report = tmp_path / "report.out"
    for option, fragment in (
        (["--atol", "foo=1"], "unknown kind 'foo'"),
        (["--atol", "logits=inf"], "finite"),
        (["--provider", "bogus"], "not bogus; pass cpu or cuda (--provider)"),
        (["--report-json", tmp_path], "is a folder; give the path of a file"),
        (
            ["--report-json", report, "--junit", report],
            f"--junit {report} is also the path of --report-json; give each report its own file",
        ),
    ):
        refused(run_cli("run", "--preset", "minimind-3-tiny", "-o", out, "-q", *option), fragment)
        assert not out.exists() and not list(tmp_path.glob(".never*"))
    import exporter.runtime.genai

    monkeypatch.setattr(exporter.runtime.genai, "genai_version", lambda: None)
    refused(
        run_cli("run", "--preset", "minimind-3-tiny", "-o", out, "-q", "--genai"),
        "--genai asks for the onnxruntime-genai check, but it is not installed (pip install onnxruntime-genai)",
    )
    assert not out.exists()


def test_run_checks_its_float16_companion_before_exporting(artifact_fp16, tmp_path):
    # the companion is the precision leg of a float32 artifact's attribution; the engine refused a companion of a
    # float16 export, or of other weights, only after the export (44 s for the tiny model)
    out = tmp_path / "never"
    for option, fragment in (
        (["--dtype", "float16"], "--fp16-companion needs a float32 artifact to verify"),
        (
            ["--seed", "1"],
            "holds other weights (seeded, minimind-3-tiny, seed 0 against seeded, minimind-3-tiny, seed 1)",
        ),
        (["--preset", "minimind2-tiny"], "is not a float16 export of the same model"),
    ):
        refused(
            run_cli("run", "--preset", "minimind-3-tiny", "-o", out, "-q", "--fp16-companion", artifact_fp16, *option),
            fragment,
        )
        assert not out.exists() and not list(tmp_path.glob(".never*"))
    from exporter.cli.exporting import planned_artifact
    from exporter.verify.checks.providers import companion_for

    companion_for(artifact_fp16, *planned_artifact("minimind-3-tiny", 0, None, "float32"))  # its own float32 export


def test_verify_refuses_bad_paths_and_conflicting_options_before_running(artifact_fp32, tmp_path, monkeypatch):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.txt").write_text("x")
    refused(run_cli("verify", artifact_fp32, "--golden-save", foreign, "-q"), "holds no golden bundle")
    assert sorted(p.name for p in foreign.iterdir()) == ["data.txt"]
    refused(run_cli("verify", artifact_fp32, "--fp16-companion", tmp_path / "none", "-q"), "does not exist")
    refused(run_cli("verify", artifact_fp32, "--fp16-companion", artifact_fp32, "-q"), "is not a float16 export")
    refused(
        run_cli("verify", artifact_fp32, "--report-json", artifact_fp32 / "manifest.json", "-q"),
        "lies inside the artifact folder",
    )
    for flag in ("--report-json", "--golden-save"):
        refused(
            run_cli("verify", artifact_fp32, flag, artifact_fp32, "-q"),
            f"{flag} {artifact_fp32} is the artifact folder this command reads, which it would change",
        )
    refused(
        run_cli("generate", artifact_fp32, "--prompt-ids", "1", "--save-optimized", artifact_fp32, "-q"),
        f"--save-optimized {artifact_fp32} is the artifact folder this command reads, which it would change",
    )
    refused(
        run_cli(
            "verify", artifact_fp32, "--golden-save", tmp_path / "g", "--junit", tmp_path / "g" / "golden.json", "-q"
        ),
        "--junit " + str(tmp_path / "g" / "golden.json") + " lies inside the golden bundle folder of --golden-save",
    )
    refused(
        run_cli("verify", artifact_fp32, "--golden", foreign, "--report-json", foreign / "arrays.npz", "-q"),
        "lies inside the golden bundle folder of --golden",
    )
    assert sorted(p.name for p in foreign.iterdir()) == ["data.txt"]
    # Tried rather than read from permission bits, which say nothing to root.
    refused(
        run_cli("verify", artifact_fp32, "--report-json", "/proc/report.json", "-q"),
        "--report-json: cannot write to /proc (permission denied)",
    )
    refused(
        run_cli("verify", artifact_fp32, "--golden", foreign, "--decode-steps", "5", "-q"),
        "--golden replays the checks recorded in the bundle, with its settings; drop --decode-steps",
    )

    import onnxruntime

    monkeypatch.setattr(
        onnxruntime, "get_available_providers", lambda: ["AzureExecutionProvider", "CPUExecutionProvider"]
    )
    refused(
        run_cli("verify", artifact_fp32, "--provider", "azure", "-q"),
        "runs and verifies on CPUExecutionProvider and CUDAExecutionProvider, not AzureExecutionProvider",
    )
    refused(
        run_cli("generate", artifact_fp32, "--prompt-ids", "1", "--provider", "azure", "-q"),
        "runs and verifies on CPUExecutionProvider and CUDAExecutionProvider, not AzureExecutionProvider",
    )


def test_reports_and_bundles_are_never_written_into_another_artifact_folder(artifact_fp32, artifact_copy, tmp_path):
    # Written there, they would be files its manifest does not list, which a re-export into that folder refuses to
    # delete.
    from exporter.artifact.paths import check_outside_artifact

    other, before = artifact_copy, sorted(p.name for p in artifact_copy.iterdir())
    for flag, path in (
        ("--report-json", other / "report.json"),
        ("--junit", other / "reports" / "junit.xml"),
        ("--html", other / "report.html"),
        ("--golden-save", other / "golden"),
    ):
        refused(
            run_cli("verify", artifact_fp32, flag, path, "-q"),
            f"{flag} {path} lies inside the artifact folder {other}, which it would change; write it elsewhere",
        )
    refused(
        run_cli("verify", artifact_fp32, "--golden-save", other, "-q"),
        f"--golden-save {other} is an artifact folder, which it would change; write it elsewhere",
    )
    refused(
        run_cli("generate", artifact_fp32, "--prompt-ids", "1", "--save-optimized", other / "optimized", "-q"),
        f"--save-optimized {other / 'optimized'} lies inside the artifact folder {other}",
    )
    assert sorted(p.name for p in other.iterdir()) == before
    webapp = tmp_path / "webapp"  # a manifest.json that is not this toolkit's makes no artifact
    webapp.mkdir()
    (webapp / "manifest.json").write_text('{"name": "app"}')
    check_outside_artifact(webapp / "report.json", "--report-json", artifact_fp32)


def test_a_report_never_overwrites_a_file_that_is_no_report_of_its_kind(artifact_fp32, tmp_path):
    """A report path mistyped onto a source file (`--report-json verify.py`) overwrote it, unasked; an empty file
    or an earlier report of that kind, whoever wrote it, is replaced."""
    source = tmp_path / "verify.py"
    source.write_text("print('mine')\n")
    for flag, kind in (("--report-json", "JSON"), ("--junit", "JUnit XML"), ("--html", "HTML")):
        refused(
            run_cli("verify", artifact_fp32, flag, source, "-q"),
            f"{flag} {source} is a file that holds no {kind} report; refusing to overwrite it",
        )
    assert source.read_text() == "print('mine')\n"
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "pytest.xml").write_text('<?xml version="1.0" encoding="utf-8"?><testsuites></testsuites>')
    (tmp_path / "page.html").write_text("\n<!doctype HTML><html></html>")
    result = run_cli(
        "verify",
        artifact_fp32,
        *CPU_ONLY,
        "--no-sweep",
        "--decode-steps",
        "1",
        "--report-json",
        tmp_path / "empty.json",
        "--junit",
        tmp_path / "pytest.xml",
        "--html",
        tmp_path / "page.html",
        "-q",
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "empty.json").read_text())["passed"] is True
    assert "<testcase" in (tmp_path / "pytest.xml").read_text() and "svg" in (tmp_path / "page.html").read_text()


def test_damaged_manifests_are_input_errors(artifact_fp32, tmp_path):
    folder = shutil.copytree(artifact_fp32, tmp_path / "damaged")
    manifest = (folder / "manifest.json").read_text()
    for change, fragment in (
        (lambda m: m["model"]["config"].update(vocab_size=1024), "do not follow from its model config"),
        (lambda m: m.update(dtype="int8"), "dtype 'int8' is none of float32, float16"),
        (lambda m: m["files"].update({"../../etc/passwd": {"sha256": "0"}}), "lies outside the folder"),
        (lambda m: m["files"]["decode.onnx"].pop("sha256"), "has no sha256"),
        (lambda m: m["weights"].update(file="config.json"), "does not lie within config.json"),
        (lambda m: m["model"]["source"].update(seed="x"), "model.source.seed is 'x', expected int"),
        (lambda m: m["weights"].update(file=5), "weights.file is 5, not a file name"),
    ):
        (folder / "manifest.json").write_text(manifest)
        edit_manifest(folder, change)
        refused(run_cli("inspect", folder), fragment)
    # A JSON list, a missing field: said in words, not "(AttributeError: ...)" or "(KeyError: 'files')".
    (folder / "manifest.json").write_text("[1, 2]")
    refused(run_cli("inspect", folder), "manifest.json is unreadable (a JSON array, not an object)")
    (folder / "manifest.json").write_text(manifest)
    edit_manifest(folder, lambda m: m.pop("files"))
    refused(run_cli("inspect", folder), "manifest.json is unreadable (no field 'files')")
    (folder / "manifest.json").write_text("[" * 100000 + "]" * 100000)  # deeper than json's recursion
    refused(run_cli("inspect", folder), "manifest.json is unreadable (RecursionError")
    (folder / "manifest.json").write_bytes(manifest.encode() + b"\xff")  # an input error, not exit 3
    for command in (["inspect", folder], ["generate", folder, "--prompt-ids", "1"]):
        refused(run_cli(*command), "manifest.json is unreadable (UnicodeDecodeError")
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "-o", folder, "-q"), "holds no manifest.json of this toolkit"
    )


def test_inspect_shows_a_damaged_folder_with_each_files_state_then_exits_2(artifact_fp32, tmp_path):
    # inspect is what a user reaches for when something is wrong, so it shows the contract and every file's state,
    # not only "config.json is 452 bytes, not 451", and exits 2 after saying what is damaged.
    folder = shutil.copytree(artifact_fp32, tmp_path / "damaged")
    size = (folder / "config.json").stat().st_size
    with open(folder / "config.json", "a") as f:
        f.write(" ")
    (folder / "decode.onnx").unlink()
    weights = bytearray((folder / "weights.onnx.data").read_bytes())
    weights[0] ^= 1  # same size, other content
    (folder / "weights.onnx.data").write_bytes(bytes(weights))
    expected = {
        "decode.onnx": "missing",
        "weights.onnx.data": "sha256 differs",
        "config.json": f"{size + 1} bytes, not {size}",
    }
    message = (
        f"{folder} is damaged: decode.onnx: missing; weights.onnx.data: sha256 differs; "
        f"config.json: {size + 1} bytes, not {size}; re-export the folder"
    )
    result = run_cli("inspect", folder)
    assert_one_line_error(result, 2, message)
    assert "past_key_values.1.value" in result.stdout  # the contract, as for an intact folder
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.split()[:1] and "MB" in line}
    assert set(rows) == set(json.loads((folder / "manifest.json").read_text())["files"])
    for name, row in rows.items():
        assert row.endswith(expected.get(name, "ok")), row
    result = run_cli("inspect", folder, "--json")
    report = json.loads(result.stdout)  # one object: what inspect shows, and the error
    assert result.exit_code == 2 and report["exit_code"] == 2
    assert report["error"] == {"kind": "input", "message": message}
    assert report["file_status"] == {name: expected.get(name, "ok") for name in rows}
    assert report["graphs"]["decode"]["file"] == "decode.onnx"
    intact = run_cli("inspect", artifact_fp32, "--json")
    assert intact.exit_code == 0 and set(json.loads(intact.stdout)["file_status"].values()) == {"ok"}
    assert "error" not in json.loads(intact.stdout)


def test_json_nested_deeper_than_the_parser_goes_is_a_named_input_error_in_every_reader(artifact_fp32, tmp_path):
    from exporter.artifact.manifest import read_manifest
    from exporter.artifact.tokenizer import find_tokenizer
    from exporter.errors import ToolkitError
    from exporter.tolerances.parity import parse_overrides
    from exporter.verify.references.golden.reading import check_bundle
    from reference.checkpoint_files import read_checkpoint

    deep = "[" * 100000 + "]" * 100000  # json raises RecursionError, not a ValueError, on this
    for name in ("tolerances.json", "tokenizer.json", "golden.json", "config.json"):
        (tmp_path / name).write_text(deep)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    readers = [
        (lambda: parse_overrides(file=tmp_path / "tolerances.json"), "tolerance file .* not a readable JSON"),
        (lambda: find_tokenizer(tmp_path / "tokenizer.json", 512), "tokenizer .* not a readable JSON"),
        (lambda: check_bundle(tmp_path, read_manifest(artifact_fp32)), "golden bundle"),
        (lambda: read_checkpoint(tmp_path), "config.json is not a readable JSON file"),
    ]
    for read, fragment in readers:
        with pytest.raises(ToolkitError, match=fragment) as info:
            read()
        assert "recursion" in str(info.value), info.value


def test_bad_config_values_and_tokenizers_are_named(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"rms_norm_eps": "x"}))
    import torch

    from reference import build_model, get_preset

    checkpoint = tmp_path / "model.pth"
    torch.save(build_model(get_preset("minimind-3-tiny")).state_dict(), checkpoint)
    refused(
        run_cli("export", "--checkpoint", checkpoint, "--config", config, "-o", tmp_path / "a", "-q"),
        "config field rms_norm_eps must be float or None, got 'x'",
    )
    state = build_model(get_preset("minimind-3-tiny")).state_dict()
    state["model.norm.weight"] = state["model.norm.weight"].long()
    torch.save(state, tmp_path / "integers.pth")
    refused(
        run_cli(
            "export",
            "--checkpoint",
            tmp_path / "integers.pth",
            "--preset",
            "minimind-3-tiny",
            "-o",
            tmp_path / "a",
            "-q",
        ),
        "weights stored as integers",
    )
    config.write_text(json.dumps({"dropout": 2}))
    refused(
        run_cli("export", "--checkpoint", checkpoint, "--config", config, "-o", tmp_path / "a", "-q"),
        "config field dropout must lie in [0, 1), got 2",
    )
    config.write_text("[" * 100000 + "]" * 100000)
    refused(
        run_cli("export", "--checkpoint", checkpoint, "--config", config, "-o", tmp_path / "a", "-q"),
        "is not a readable JSON file (maximum recursion depth exceeded",
    )
    config.write_bytes(b"\xff\xfe\x00{")
    refused(
        run_cli("export", "--checkpoint", checkpoint, "--config", config, "-o", tmp_path / "a", "-q"),
        "is not a readable JSON file",
    )
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 3.7}, "unk_token": "a"}}))
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "--tokenizer", tokenizer, "-o", tmp_path / "b", "-q"),
        "is not a readable tokenizer.json",
    )
    tokenizer.write_text(json.dumps({"model": {"vocab": {"a": 0}}, "added_tokens": [{"content": "<s>"}]}))
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "--tokenizer", tokenizer, "-o", tmp_path / "b", "-q"),
        "malformed vocabulary or added_tokens",
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_errors_under_json_are_a_json_object_on_stdout(artifact_fp32, tmp_path):
    result = run_cli("inspect", tmp_path / "none", "--json")
    assert result.exit_code == 2
    error = json.loads(result.stdout)
    assert (
        error["exit_code"] == 2
        and error["error"]["kind"] == "input"
        and "none does not exist" in error["error"]["message"]
    )
    (tmp_path / "notes.txt").write_text("")
    refused(run_cli("inspect", tmp_path / "notes.txt"), "notes.txt is a file, not a folder; pass an artifact folder")
    for ids in ("1,,2", "1_000", "\u0661\u0662"):  # a lost id; what int() reads but no one writes as a token id
        result = run_cli("generate", artifact_fp32, "--prompt-ids", ids, "--json")
        assert result.exit_code == 2 and json.loads(result.stdout)["error"]["kind"] == "usage", ids


def test_onnxruntime_missing_is_one_line_naming_it(tmp_path):
    # A deployment set up with --no-deps without onnxruntime: every command says so in one line, no traceback.
    command = Path(sys.executable).parent / "export-onnx"
    (tmp_path / "onnxruntime").mkdir()
    (tmp_path / "onnxruntime" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'onnxruntime'\", name='onnxruntime')"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    for json_flag in ([], ["--json"]):
        result = subprocess.run(
            [str(command), "inspect", str(tmp_path), *json_flag], capture_output=True, text=True, env=env, timeout=120
        )
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            "error: onnxruntime does not import here (No module named 'onnxruntime'); install it (pip install "
            "onnxruntime), or reinstall this package with its dependencies"
        ], result.stderr
        if json_flag:
            assert json.loads(result.stdout)["error"]["kind"] == "input"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_an_error_under_json_with_an_unwritable_stdout_is_still_one_line(tmp_path):
    command = Path(sys.executable).parent / "export-onnx"
    with open("/dev/full", "w") as full:  # every write fails: No space left on device
        result = subprocess.run(
            [str(command), "inspect", str(tmp_path / "none"), "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'none'} does not exist; pass an artifact folder written by 'export-onnx export'"
    ]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["inspect", "--json"],
        ["generate", "--prompt-ids", "1,2"],
        ["generate", "--prompt-ids", "1", "--prompt-ids", "2"],
        ["generate", "--prompt-ids", "1,2", "--json"],
    ],
)
def test_a_result_that_stdout_cannot_take_is_an_input_error_not_an_internal_one(artifact_fp32, command):
    # A full disk under stdout is the user's disk, not a fault of the toolkit: exit 2 with one line, not an
    # internal error (exit 3).
    script = Path(sys.executable).parent / "export-onnx"
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [str(script), command[0], str(artifact_fp32), *command[1:]],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: cannot write the result to stdout (No space left on device)"
    ], result.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("command", [["--help"], ["verify", "--help"]])
def test_help_that_stdout_cannot_take_is_one_line_not_a_traceback(command):
    # one line, not the OSError's traceback after click printed the help
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [str(Path(sys.executable).parent / "export-onnx"), *command],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: cannot write the help to stdout (No space left on device)"
    ], result.stderr


@pytest.mark.parametrize("command", [["--help"], ["verify", "--help"]])
def test_help_into_a_closed_pipe_exits_141_without_a_word(command):
    # `export-onnx --help | true`: click turned the closed pipe into exit 1, where a command's output exits 141
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader gone before the help is written: every write fails with EPIPE
    try:
        result = subprocess.run(
            [str(Path(sys.executable).parent / "export-onnx"), *command],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 141 and result.stderr == "", result.stderr


def test_a_terminated_export_removes_its_partial_folder(tmp_path):
    out = tmp_path / "art"
    command = Path(sys.executable).parent / "export-onnx"  # the installed script, as users run it
    export = subprocess.Popen(
        [str(command), "export", "--preset", "minimind2-tiny", "-o", str(out), "-q"], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".art.partial-*")) and export.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    export.send_signal(signal.SIGTERM)
    _, stderr = export.communicate(timeout=120)
    assert export.returncode == 143, stderr[-2000:]
    assert "interrupted (SIGTERM)" in stderr
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_refused_for_its_config_is_one_line_without_the_fields_it_assumed(tmp_path):
    # One line: no "max_position_embeddings is not visible in the weights; assuming 32768" warning before it; a
    # --config size past what a tensor holds is refused by the toolkit, not by torch with C++ frames.
    import torch

    from reference import build_model, get_preset

    state = build_model(get_preset("minimind-3-tiny")).state_dict()
    torch.save(state, tmp_path / "model.pth")
    config = tmp_path / "config.json"
    for size, fragment in (
        (10**30, "Overflow when unpacking long long"),
        (2**62, "Storage size calculation overflowed"),
    ):
        config.write_text(json.dumps({"intermediate_size": size}))
        result = run_cli(
            "export", "--checkpoint", tmp_path / "model.pth", "--config", config, "-o", tmp_path / "a", "-q"
        )
        refused(result, "model.pth: the config's sizes make tensors too large to build (")
        assert fragment in result.stderr
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name] = state[name][:, :-1].clone()
    torch.save(state, tmp_path / "narrow.pth")
    refused(
        run_cli("export", "--checkpoint", tmp_path / "narrow.pth", "-o", tmp_path / "a", "-q"),
        f"1 mis-shaped ({name}: checkpoint (64, 63) vs model (64, 64))",
    )
    assert not (tmp_path / "a").exists()


def test_an_internal_error_is_one_line_even_when_its_message_is_not(artifact_fp32, monkeypatch):
    # torch's C++ errors carry their stack frames after the first line
    import exporter.artifact.manifest

    def fails(folder):
        raise RuntimeError("size overflowed\nException raised from f at x.h:79\nframe #0: c10::Error::Error")

    monkeypatch.setattr(exporter.artifact.manifest, "load_manifest", fails)
    result = run_cli("inspect", artifact_fp32, "--json")
    assert_one_line_error(result, 3, "internal error: RuntimeError: size overflowed (rerun with --verbose")
    assert json.loads(result.stdout)["error"]["message"].startswith("RuntimeError: size overflowed (rerun")


def test_a_long_first_line_keeps_its_start_and_its_end():
    """onnxruntime puts the reason last, after the source file and the kernel's C++ signature: a cut message
    keeps both ends and leaves out the middle."""
    from exporter.errors import first_line

    error = RuntimeError("[ONNXRuntimeError] : 1 : FAIL : " + "signature " * 60 + "the reason\nsecond line")
    line = first_line(error, 100)
    assert line.startswith("[ONNXRuntimeError] : 1 : FAIL") and line.endswith("signature the reason"), line
    assert " ... " in line and len(line) <= 100
    assert first_line(ValueError("short\nsecond"), 100) == "short" and first_line(ValueError()) == "ValueError"


def test_an_artifact_file_this_user_cannot_read_is_an_input_error_naming_it(artifact_fp32, monkeypatch):
    # chmod 000 on manifest.json or the weights: an input error naming the file in inspect, generate and verify, not
    # PermissionError as an internal error. Simulated, since the tests may run as root, whom permission bits do not
    # stop.
    import pathlib

    import exporter.artifact.manifest

    denied = PermissionError(13, "Permission denied")
    real_sha256 = exporter.artifact.manifest.sha256_file

    def sha256_file(path):
        if Path(path).name == "weights.onnx.data":
            raise denied
        return real_sha256(path)

    monkeypatch.setattr(exporter.artifact.manifest, "sha256_file", sha256_file)
    result = run_cli("inspect", artifact_fp32, "--json")
    assert_one_line_error(
        result,
        2,
        "is damaged: weights.onnx.data: unreadable (Permission denied); let this user read the artifact's files",
    )
    assert json.loads(result.stdout)["file_status"]["weights.onnx.data"] == "unreadable (Permission denied)"
    refused(
        run_cli("generate", artifact_fp32, "--prompt-ids", "1"),
        "weights.onnx.data cannot be read (Permission denied); let this user read the artifact's files",
    )
    monkeypatch.setattr(exporter.artifact.manifest, "sha256_file", real_sha256)
    real_open = os.open

    def denying_open(path, *args, **kwargs):  # the bounded JSON reader (artifact/paths.py) opens with os.open
        if pathlib.Path(path).name == "manifest.json":
            raise denied
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denying_open)
    for command in (["inspect", artifact_fp32], ["generate", artifact_fp32, "--prompt-ids", "1"]):
        refused(run_cli(*command), "manifest.json cannot be read (Permission denied); let this user read")


def test_an_empty_path_is_refused_rather_than_read_as_the_current_folder(artifact_fp32, tmp_path, monkeypatch):
    # An unset shell variable: `--save-optimized ""` must not write the optimised graphs into the current folder,
    # nor `--checkpoint ""` read it as a model folder.
    monkeypatch.chdir(tmp_path)
    for command in (
        ["export", "--preset", "minimind-3-tiny", "-o", ""],
        ["export", "--checkpoint", ""],
        ["generate", artifact_fp32, "--prompt-ids", "1", "--save-optimized", ""],
        ["inspect", ""],
        ["verify", artifact_fp32, "--report-json", ""],
    ):
        result = run_cli(*command, "--json")
        refused(result, "the path is empty; give a path (. for the current folder)")
        assert json.loads(result.stdout)["error"]["kind"] == "usage"
    assert list(tmp_path.iterdir()) == []


def test_an_output_under_a_folder_this_user_cannot_search_is_refused_in_one_line(tmp_path, monkeypatch):
    # chmod 000 on a parent of -o: one line, not Path.exists' PermissionError. Simulated (root ignores the bits).
    import pathlib

    locked = tmp_path / "locked"
    real_exists = pathlib.Path.exists

    def exists(path, *args, **kwargs):
        if locked in (path, *path.parents) and path != locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_exists(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "exists", exists)
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "-o", locked / "art", "-q"),
        f"output folder {locked / 'art'} cannot be reached (Permission denied); choose another path",
    )


def test_an_output_on_a_read_only_mount_says_so_rather_than_permission_denied(tmp_path, monkeypatch):
    # A read-only bind mount (EROFS) read "permission denied", sending root to chmod. Simulated: mount needs root.
    import errno
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    refused(
        run_cli("export", "--preset", "minimind-3-tiny", "-o", tmp_path / "art", "-q"),
        f"output folder: cannot write to {tmp_path} (read-only file system); choose another path",
    )
    assert list(tmp_path.iterdir()) == []


def test_a_report_being_written_by_another_process_is_not_taken_over(tmp_path):
    # Two verifies writing one report path each write a partial file of their own: sharing `.r.json.partial`, one
    # would rename the other's half-written file into place, and the other's rename then fail and lose the report.
    from exporter.artifact.paths import write_text_whole

    theirs = tmp_path / ".r.json.partial"
    theirs.write_text('{"half')
    write_text_whole(tmp_path / "r.json", '{"passed": true}\n')
    assert (tmp_path / "r.json").read_text() == '{"passed": true}\n' and theirs.read_text() == '{"half'
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.json.partial", "r.json"]


def test_a_signal_this_process_was_started_ignoring_stays_ignored():
    # `export-onnx export &` in a script (or nohup) starts it ignoring SIGINT; the command keeps ignoring it, so a
    # Ctrl-C meant for the script does not stop the export it shields.
    import signal

    from exporter.cli.outcome import begin_command

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        begin_command()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)  # routed to the cleanup
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_an_interrupt_while_the_command_starts_is_one_line_not_a_traceback(tmp_path):
    # A Ctrl-C while the command's modules import is one line and 130, not Python's traceback of the import it
    # stopped (`import ctypes ... KeyboardInterrupt`) nor a death by the signal.
    script = """if True:
        import builtins, os, signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, were pytest started with `&`
        real_import = builtins.__import__
        def ctrl_c_during(name, *args, **kwargs):
            if name == "exporter.runtime.generation":
                os.kill(os.getpid(), signal.SIGINT)
            return real_import(name, *args, **kwargs)
        builtins.__import__ = ctrl_c_during
        sys.argv = ["export-onnx", "inspect", "--json"]
        from exporter.cli import main
        main()
        """
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 130, result.stderr
    assert result.stderr == "interrupted (SIGINT)\n"
    assert json.loads(result.stdout) == {
        "error": {"kind": "interrupted", "message": "interrupted (SIGINT)"},
        "exit_code": 130,
    }
    import signal

    from exporter import cli

    assert signal.getsignal(signal.SIGINT) is not cli._interrupted_while_starting  # an importer keeps its own


def _interrupted_start(hook: str) -> subprocess.CompletedProcess:
    """`export-onnx generate --json` in a fresh interpreter, a SIGINT sent where `hook` (the script's code, with
    os, signal and builtins imported and real_import the real __import__) sends it."""
    script = f"""if True:
        import builtins, os, signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, were pytest started with `&`
        real_import = builtins.__import__
        {hook}
        sys.argv = ["export-onnx", "generate", "--prompt-ids", "1", "--json"]
        from exporter.cli import main
        main()
        """
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_an_interrupt_inside_onnxruntimes_import_is_an_interruption_not_a_missing_onnxruntime():
    # onnxruntime's extension module is built with pybind11, which turns an exception raised during its init (the
    # SystemExit of the startup's signal handler) into `ImportError: initialization failed`: a Ctrl-C then is an
    # interruption (130, one line, one JSON document), not "error: onnxruntime does not import here".
    result = _interrupted_start("""def ctrl_c_during(name, *args, **kwargs):
            if name == "exporter.runtime.generation":
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                except SystemExit as exc:  # as pybind11 reports it
                    raise ImportError("initialization failed", name="onnxruntime") from exc
            return real_import(name, *args, **kwargs)
        builtins.__import__ = ctrl_c_during""")
    assert result.returncode == 130, result.stderr
    assert result.stderr == "interrupted (SIGINT)\n"
    assert json.loads(result.stdout)["exit_code"] == 130


def test_an_interrupt_while_the_commands_are_defined_is_one_line_not_a_traceback():
    # The startup's handler stays up until the module has defined its commands too (click's types translate their
    # names through gettext, which reads the disk): a Ctrl-C there is one line and 130, not Python's traceback.
    result = _interrupted_start("""import click
        real_init = click.Path.__init__
        def ctrl_c_in(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            real_init(self, *args, **kwargs)
        click.Path.__init__ = ctrl_c_in""")
    assert result.returncode == 130, result.stderr
    assert result.stderr == "interrupted (SIGINT)\n"
    assert json.loads(result.stdout)["exit_code"] == 130


def test_inspect_shows_a_graph_swapped_in_under_a_relisted_hash_as_damaged(artifact_fp32, tmp_path):
    """Intact bytes are not the right graph: decode.onnx replaced by prefill.onnx, its size and sha256 listed
    again in the manifest, passes the file check; inspect still says what it is and exits 2."""
    from exporter.artifact.manifest import sha256_file

    folder = shutil.copytree(artifact_fp32, tmp_path / "swapped")
    shutil.copyfile(folder / "prefill.onnx", folder / "decode.onnx")
    edit_manifest(
        folder,
        lambda m: m["files"]["decode.onnx"].update(
            sha256=sha256_file(folder / "decode.onnx"), bytes=(folder / "decode.onnx").stat().st_size
        ),
    )
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 2, result.output
    state = json.loads(result.stdout)["file_status"]["decode.onnx"]
    assert state.startswith("has the inputs [") and "its manifest lists" in state, state
    assert f"{folder} is damaged: decode.onnx: {state}; re-export the folder" in result.stderr


def test_a_report_never_overwrites_the_tolerance_file_it_reads(artifact_fp32, tmp_path):
    # any JSON file counts as a JSON report that may be replaced, so --report-json tol.json --tolerances tol.json
    # would replace the overrides with the report: refused, and the file left as it is
    tolerances = tmp_path / "tol.json"
    tolerances.write_text('{"logits": {"atol": 1e-3}}')
    refused(
        run_cli("verify", artifact_fp32, "--tolerances", tolerances, "--report-json", tolerances, "-q"),
        f"--report-json {tolerances} is also the path of --tolerances; give each report its own file",
    )
    assert tolerances.read_text() == '{"logits": {"atol": 1e-3}}'


def test_golden_given_a_file_or_the_artifact_says_which_folder_to_pass(artifact_fp32, tmp_path):
    # --golden g/golden.json and --golden ARTIFACT name the folder to pass, not an OS error on a path joined to it
    # with advice to record a bundle the user already has
    bundle = tmp_path / "g"
    bundle.mkdir()
    (bundle / "golden.json").write_text("{}")
    refused(
        run_cli("verify", artifact_fp32, "--golden", bundle / "golden.json", "-q"),
        f"{bundle / 'golden.json'} is a file, not a golden bundle; pass the folder that holds golden.json: {bundle}",
    )
    refused(
        run_cli("verify", artifact_fp32, "--golden", artifact_fp32, "-q"),
        f"{artifact_fp32} is an artifact folder, not a golden bundle; pass the folder that --golden-save wrote",
    )
    # and the other way round: the pytest plugin's hint, which verify lacked
    refused(
        run_cli("verify", bundle, "-q"),
        f"{bundle} has no manifest.json; it is not an artifact folder (export one "
        f"with 'export-onnx export') ({bundle}: a golden bundle; pass it as --golden DIR, with the artifact it was "
        "recorded from as FOLDER)",
    )


def test_tolerances_given_twice_is_refused_rather_than_dropping_the_first_file(artifact_fp32, tmp_path):
    # --atol logits=1 --atol logits=2 is refused, and so is --tolerances a.json --tolerances b.json: b.json alone
    # would drop a.json in silence
    (tmp_path / "a.json").write_text('{"logits": {"atol": 1e-3}}')
    (tmp_path / "b.json").write_text('{"kv": {"atol": 1e-3}}')
    refused(
        run_cli(
            "verify", artifact_fp32, "--tolerances", tmp_path / "a.json", "--tolerances", tmp_path / "b.json", "-q"
        ),
        "--tolerances given 2 times; give one file (it may hold every kind)",
    )


def test_a_key_given_twice_in_a_users_json_file_is_refused_naming_it(
    artifact_fp32, tiny_tokenizer, tiny_config, tmp_path
):
    # json.loads keeps the last value in silence: read so, this file would loosen logits' atol to 5
    tolerances = tmp_path / "tol.json"
    tolerances.write_text('{"logits": {"atol": 1e-3, "atol": 5}}')
    refused(
        run_cli("verify", artifact_fp32, "--tolerances", tolerances, "-q"),
        f"tolerance file {tolerances} gives the key 'atol' twice; keep one",
    )
    config = tmp_path / "config.json"
    config.write_text('{"rms_norm_eps": 1e-6, "rms_norm_eps": 1e-5}')
    refused(
        run_cli("export", "--checkpoint", tmp_path / "model.pth", "--config", config, "-o", tmp_path / "a", "-q"),
        f"--config {config} gives the key 'rms_norm_eps' twice; keep one",
    )
    # a tokenizer.json that gives a key twice is read, as the tokenizers library reads it (the last value holds)
    from exporter.artifact.tokenizer import find_tokenizer

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0", ' + (tiny_tokenizer / "tokenizer.json").read_text()[1:])
    assert find_tokenizer(tokenizer, tiny_config.vocab_size).max_id == tiny_config.vocab_size - 1


def _undecodable(parent: Path, name: str) -> Path:
    """parent/name followed by the byte 0xff, which is no UTF-8 (a name Latin-1 tools write); skipped where the file
    system refuses such a name."""
    path = parent / os.fsdecode(os.fsencode(name) + b"\xff")
    try:
        path.mkdir()
        path.rmdir()
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    return path


def test_an_artifact_path_that_is_no_utf8_is_refused_in_one_line(artifact_fp32, tmp_path):
    # onnxruntime's binding takes a path as UTF-8 only: such a path is refused in one line before onnxruntime sees
    # it, not as an argument of the wrong type (exit 3).
    folder = shutil.copytree(artifact_fp32, _undecodable(tmp_path, "art"))
    fragment = "holds the byte 0xff, which is no UTF-8, and onnx and onnxruntime take only UTF-8 paths; rename it"
    for command in (
        ["generate", folder, "--prompt-ids", "1,2"],
        ["generate", artifact_fp32, "--prompt-ids", "1,2", "--save-optimized", tmp_path / "opt\udcff"],
        ["verify", folder, "--no-sweep", "--decode-steps", "1"],
        ["verify", artifact_fp32, "--fp16-companion", folder],
    ):
        result = run_cli(*command, "--json")
        refused(result, fragment)
        assert "\\xff" in json.loads(result.stdout)["error"]["message"]  # shown as \xff, not a lone surrogate
    assert not (tmp_path / "opt\udcff").exists()
    # the library too, where it hands the path to onnxruntime
    from exporter.artifact.folder import Artifact
    from exporter.errors import ArtifactError
    from exporter.runtime.runner import OrtRunner

    with pytest.raises(ArtifactError, match="holds the byte 0xff"):
        OrtRunner(Artifact.open(folder))
    # inspect reads the folder in Python, which takes any name the file system does
    assert run_cli("inspect", folder).exit_code == 0


def test_an_export_folder_that_is_no_utf8_is_refused_before_the_export(tmp_path, monkeypatch):
    # Refused before the export, not by onnx.checker after it ("incompatible function arguments").
    import exporter.export.pipeline

    def no_build(*args, **kwargs):
        raise AssertionError("the export was built")

    monkeypatch.setattr(exporter.export.pipeline, "_build", no_build)
    output = _undecodable(tmp_path, "out")
    for command in (["export", "-o", output], ["run", "-o", output], ["export", "-o", output / "artifact"]):
        refused(
            run_cli(*command, "--preset", "minimind-3-tiny", "-q"),
            "holds the byte 0xff, which is no UTF-8, and onnx and onnxruntime take only UTF-8 paths; choose an "
            "output folder whose path is UTF-8 (--output)",
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(__import__("fcntl"), "F_SETPIPE_SZ"), reason="needs Linux's pipe sizes")
def test_an_interrupt_while_the_json_result_is_written_leaves_it_whole(artifact_fp32):
    # A SIGINT while the document filled a slow reader's pipe: stdout held the document cut mid-string, then the
    # error object, which parses as neither. It is now written to its end, and no error object follows it.
    import array
    import fcntl
    import termios

    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)  # the inspect document (13 kB) fills it three times
    size = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ)
    command = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "inspect", str(artifact_fp32), "--json"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)

    def unread() -> int:
        count = array.array("i", [0])
        fcntl.ioctl(read_end, termios.FIONREAD, count)
        return count[0]

    deadline = time.monotonic() + 120
    while unread() < size and command.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert unread() == size, "the document did not fill the pipe"  # the command waits in its write: interrupt it
    command.send_signal(signal.SIGINT)
    stdout = b""
    while chunk := os.read(read_end, 1 << 16):
        stdout += chunk
    os.close(read_end)
    _, stderr = command.communicate(timeout=60)
    assert command.returncode == 130 and stderr == "interrupted (SIGINT)\n", stderr
    document = json.loads(stdout)
    assert document["file_status"]["weights.onnx.data"] == "ok" and "error" not in document


def test_inspect_of_a_folder_an_export_killed_in_its_swap_points_to_the_artifact_moved_aside(artifact_fp32, tmp_path):
    # kill -9 between the swap's two renames: inspect says where the earlier artifact lies, not only "does not
    # exist".
    folder = tmp_path / "art"
    aside = shutil.copytree(artifact_fp32, tmp_path / ".art.old-999999-abc" / "art")
    hint = f"an export stopped while swapping it left the earlier artifact in {aside}: move it back to {folder}"
    for command in (["inspect", folder], ["generate", folder, "--prompt-ids", "1"]):
        refused(run_cli(*command), f"{folder} does not exist; pass an artifact folder written by")
        refused(run_cli(*command), hint)
    folder.mkdir()
    refused(run_cli("inspect", folder), f"{folder} has no manifest.json; it is not an artifact folder")
    refused(run_cli("inspect", folder), hint)


@pytest.fixture
def alarm():
    """Fail a test that blocks (a read of a FIFO no one writes) after 60 s, rather than hang the suite."""

    def blocked(signum, frame):
        raise AssertionError("blocked reading a file")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _special_file(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A file the option readers must refuse without reading it all (or waiting on it), and the refusal's words."""
    if kind == "device":
        return Path("/dev/zero"), "is a device, not a regular file: reading it may never end"
    if kind == "fifo":
        path = tmp_path / "pipe.json"
        os.mkfifo(path)
        return path, "is a FIFO (a named pipe), not a regular file: reading it would wait for a writer"
    path = tmp_path / "huge.json"
    with open(path, "wb") as file:
        file.truncate((16 << 20) + 1)  # sparse: no disk spent
    return path, "holds more than 16 MiB, the most this reads of it"


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/zero").exists(), reason="needs FIFOs and /dev/zero")
@pytest.mark.parametrize("kind", ["device", "fifo", "oversized"])
def test_an_option_file_that_is_no_regular_file_or_too_large_is_refused_unread(artifact_fp32, tmp_path, alarm, kind):
    # --config /dev/zero and --tolerances /dev/zero would be read until memory runs out, and a FIFO would block:
    # refused unread.
    path, reason = _special_file(tmp_path, kind)
    out = tmp_path / "out"
    refused(
        run_cli("export", "--checkpoint", tmp_path / "model.pth", "--config", path, "-o", out, "-q"),
        f"--config {path} {reason}; pass a JSON object of config fields",
    )
    refused(
        run_cli("verify", artifact_fp32, "--tolerances", path, "-q"),
        f"tolerance file {path} {reason}; give a JSON or .toml file",
    )
    assert not out.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_checkpoint_that_is_a_fifo_is_refused_rather_than_waited_on(tmp_path, alarm):
    # `--checkpoint` naming a FIFO is refused at once, not read while it waits for a writer.
    fifo = tmp_path / "model.pth"
    os.mkfifo(fifo)
    refused(
        run_cli("export", "--checkpoint", fifo, "-o", tmp_path / "out", "-q"),
        f"checkpoint {fifo} is no regular file (a FIFO, a device or a socket), which would be read without end",
    )


def test_a_weights_file_linked_from_outside_the_folder_is_damage_to_inspect_as_to_verify(artifact_fp32, tmp_path):
    # inspect called the link ok, while onnxruntime (generate, verify) refuses weights read from outside the folder.
    folder = shutil.copytree(artifact_fp32, tmp_path / "art")
    outside = tmp_path / "elsewhere.data"
    (folder / "weights.onnx.data").rename(outside)
    (folder / "weights.onnx.data").symlink_to(outside)
    state = f"a link out of the folder (to {outside}), where onnxruntime refuses to read weights"
    fix = "copy the file into the folder in place of the link (cp --remove-destination TARGET LINK)"
    result = run_cli("inspect", folder, "--json")
    refused(result, f"{folder} is damaged: weights.onnx.data: {state}; {fix}")
    assert json.loads(result.stdout)["file_status"]["weights.onnx.data"] == state
    for command in (["generate", folder, "--prompt-ids", "1"], ["verify", folder, "--no-sweep"]):
        refused(run_cli(*command), f"{folder}: weights.onnx.data is {state}; {fix}")
    (folder / "weights.onnx.data").unlink()  # a link that stays inside the folder is read as the file
    (folder / "data").mkdir()
    outside.rename(folder / "data" / "w")
    (folder / "weights.onnx.data").symlink_to(Path("data") / "w")
    assert run_cli("inspect", folder).exit_code == 0


def test_an_export_that_fails_leaves_the_folder_it_would_replace_untouched(artifact_copy, tmp_path):
    # A verify reading the folder meanwhile tells a swapped-in folder by its inode and ctime: an export that fails at
    # once (no such checkpoint) must not change them, not even by probing the folder's writability with a file inside
    before = os.stat(artifact_copy)
    result = run_cli("export", "--checkpoint", tmp_path / "none.pth", "-o", artifact_copy, "-q")
    assert_one_line_error(result, 2, "does not exist")
    after = os.stat(artifact_copy)
    assert (after.st_ino, after.st_ctime_ns, after.st_mtime_ns) == (
        before.st_ino,
        before.st_ctime_ns,
        before.st_mtime_ns,
    )


def _point_first_external_weight_at(location: str):
    def change(graph):
        tensor = next(t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
        next(entry for entry in tensor.external_data if entry.key == "location").value = location

    return change


@pytest.mark.parametrize("location", ["../../../../etc/passwd", "/etc/passwd"])
def test_inspect_refuses_a_graph_whose_weights_lie_outside_its_folder(artifact_copy, location):
    edit_graphs(artifact_copy, _point_first_external_weight_at(location))  # and the manifest re-signed
    assert_one_line_error(run_cli("inspect", artifact_copy, "-q"), 2, f"names weights outside the folder ({location})")


def _foreign_folder(tmp_path, genai_config) -> Path:
    """A folder that reads as onnxruntime-genai builder's: its genai_config.json and a graph."""
    folder = tmp_path / "foreign"
    folder.mkdir(parents=True)
    (folder / "genai_config.json").write_text(json.dumps(genai_config))
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    onnx.save(onnx.helper.make_model(graph), str(folder / "model.onnx"))
    return folder


@pytest.mark.parametrize(
    ("genai_config", "fragment"),
    [
        ({"model": {"decoder": {"filename": "../other/model.onnx"}}}, "names model.decoder.filename '../other/model"),
        ({"model": {"decoder": {"filename": "/etc/passwd"}}}, "names model.decoder.filename '/etc/passwd', which"),
        ({"model": [1]}, "model must be an object"),
        ({"model": {"decoder": "x"}}, "model.decoder must be an object"),
        ({"model": {"decoder": {"filename": 5}}}, "model.decoder.filename must be a file name"),
        ({"model": {"decoder": {"filename": None}}}, "model.decoder.filename must be a file name"),
        ({"model": {"decoder": {"inputs": [1]}}}, "model.decoder.inputs must be an object"),
    ],
)
def test_a_foreign_genai_config_naming_what_it_cannot_is_refused(tmp_path, genai_config, fragment):
    outside = tmp_path / "other"
    outside.mkdir()
    shutil.copy(_foreign_folder(tmp_path / "x", {}) / "model.onnx", outside / "model.onnx")
    folder = _foreign_folder(tmp_path, genai_config)
    assert_one_line_error(run_cli("inspect", folder, "-q"), 2, fragment)


def _decoder_named_folder(folder: Path, reference: Path, logits_axes: int) -> Path:
    """A folder that reads as Optimum's (`reference`'s config.json beside a model.onnx) whose graph has a decoder's
    inputs and outputs, by name, for `reference`'s sizes (2 layers, 2 kv heads of 32), and computes no decoder: its
    presents are its past, and its logits the input ids as floats, as (batch, tokens) or repeated over a vocabulary
    of 256 (logits_axes 2 or 3)."""
    helper, tensor = onnx.helper, onnx.TensorProto
    folder.mkdir()
    shutil.copy(reference / "config.json", folder)
    inputs = [
        helper.make_tensor_value_info(name, tensor.INT64, ["batch", axis])
        for name, axis in (("input_ids", "tokens"), ("attention_mask", "total"), ("position_ids", "tokens"))
    ]
    outputs, nodes = [], [helper.make_node("Cast", ["input_ids"], ["ids"], to=tensor.FLOAT)]
    if logits_axes == 2:
        nodes.append(helper.make_node("Identity", ["ids"], ["logits"]))
    else:
        nodes += [
            helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("axes", tensor.INT64, [1], [2])),
            helper.make_node("Unsqueeze", ["ids", "axes"], ["column"]),
            helper.make_node(
                "Constant", [], ["vocab"], value=helper.make_tensor("vocab", tensor.INT64, [3], [1, 1, 256])
            ),
            helper.make_node("Expand", ["column", "vocab"], ["logits"]),
        ]
    outputs.append(helper.make_tensor_value_info("logits", tensor.FLOAT, ["batch", "tokens", "vocab"][:logits_axes]))
    for layer in range(2):
        for kind in ("key", "value"):
            past, present = f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"
            inputs.append(helper.make_tensor_value_info(past, tensor.FLOAT, ["batch", 2, "past", 32]))
            outputs.append(helper.make_tensor_value_info(present, tensor.FLOAT, ["batch", 2, "total", 32]))
            nodes.append(helper.make_node("Identity", [past], [present]))
    graph = helper.make_graph(nodes, "no-decoder", inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "model.onnx"))
    return folder


def test_a_foreign_graph_named_as_a_decoder_that_is_none_is_refused_in_one_line(hf_folders, tmp_path):
    reference = hf_folders["qwen3"]
    flat = _decoder_named_folder(tmp_path / "flat", reference, logits_axes=2)
    declared = "model.onnx has a decoder's input and output names but is no decoder: logits has 2 axes where"
    assert_one_line_error(run_cli("inspect", flat, "-q"), 2, declared)
    assert_one_line_error(run_cli("verify", flat, "--reference", reference, "-q"), 2, declared)
    # declared as a decoder's: what it returns is refused at its first run, before any comparison reads it
    echo = _decoder_named_folder(tmp_path / "echo", reference, logits_axes=3)
    verified = run_cli("verify", echo, "--reference", reference, "--decode-steps", "2", "--no-sweep", "-q")
    assert_one_line_error(verified, 2, "is no decoder: it returned present.0.key of shape (2, 2, 0, 32) where")
    for folder in (flat, echo):
        generated = run_cli("generate", folder, "--prompt-ids", "1,2", "--max-new-tokens", "2", "-q")
        assert_one_line_error(generated, 2, "has no manifest.json; it is not an artifact folder")


def _without(folder: Path, tensor: str) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    del weights[tensor]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda folder: (folder / "model.safetensors").unlink(), "transformers cannot load {folder} (OSError: "),
        (
            lambda folder: _without(folder, "model.layers.1.mlp.up_proj.weight"),
            "{folder} lacks 1 weight(s) its config.json's model has (model.layers.1.mlp.up_proj.weight)",
        ),
        (
            lambda folder: edit_json(folder / "config.json", intermediate_size=128),
            "the weights in {folder} do not fit its config.json: model.layers.0.mlp.down_proj.weight is (64, 96) in "
            "the weights where the config gives (64, 128) (and 5 more)",
        ),
    ],
    ids=["no-weights", "a-weight-missing", "mismatched-sizes"],
)
def test_a_reference_folder_transformers_cannot_load_whole_is_refused_in_one_line(
    hf_folders, tmp_path, damage, fragment
):
    import logging

    reference = shutil.copytree(hf_folders["qwen3"], tmp_path / "reference")
    damage(reference)
    folder = _decoder_named_folder(tmp_path / "foreign", hf_folders["qwen3"], logits_axes=3)
    reported = []  # transformers' load report is a warning of many lines: none may pass its loggers
    handler = logging.Handler(logging.WARNING)
    handler.emit = reported.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        result = run_cli("verify", folder, "--reference", reference, "-q")
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert_one_line_error(result, 2, fragment.format(folder=reference))
    assert not reported, [record.getMessage()[:200] for record in reported]


def test_json_files_of_an_artifact_are_read_within_a_bound(artifact_copy):
    # a sparse manifest.json past the bound is refused at the bound, never read whole into memory
    from exporter.artifact.folder import open_artifact
    from exporter.errors import ArtifactError

    with open(artifact_copy / "manifest.json", "r+b") as file:
        file.truncate(2 << 30)
    with pytest.raises(ArtifactError, match="holds more than 16 MiB, the most this reads of it"):
        open_artifact(artifact_copy)
