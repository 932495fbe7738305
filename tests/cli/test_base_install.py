"""The base install, without the `export` extra: inspect, generate and verify --golden run on onnxruntime, onnx,
numpy and click alone, and the commands that need PyTorch say which extra to install in one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from helpers import ROOT, run_cli

from exporter.errors import EXPORT_EXTRA, EXPORT_MODULES
from exporter.verify.engine import verify_artifact
from exporter.verify.inputs import ParitySettings

# What the base install goes without: the export extra's modules, tokenizers (text prompts) and transformers.
ABSENT = (*EXPORT_MODULES, "tokenizers", "transformers")


def _names(requirements: list[str]) -> set[str]:
    """The distribution names of requirement strings, normalised as pip compares them (`onnx_ir` is `onnx-ir`)."""
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", r).group()).lower() for r in requirements}


def test_the_base_dependencies_leave_the_export_extra_out():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base, extras = _names(project["dependencies"]), project["optional-dependencies"]
    export = _names(extras["export"])
    assert _names(EXPORT_MODULES) <= export, "errors.EXPORT_MODULES names a module the export extra lacks"
    assert not base & export, f"the base install pulls {sorted(base & export)} of the export extra"
    assert not base & {"transformers", "onnxruntime-genai", "gguf"}, base
    # what the README's test command installs: every extra, the export one through the self-reference
    assert "export-onnx[export,genai,gguf,chat]" in extras["test"] and "export-onnx[export]" in extras["gguf"]
    # generate --chat renders with jinja2, which the base install goes without and the chat extra brings
    assert "jinja2" in _names(extras["chat"]) and "jinja2" not in base


def test_the_command_and_the_pytest_plugin_import_no_torch():
    # pytest loads the plugin in every run, a base install's included, and every command starts with the CLI module
    code = "import sys, exporter.cli, exporter.cli.pytest_plugin; print([m for m in sys.argv[1:] if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code, *ABSENT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-3000:]


@pytest.fixture(scope="module")
def base_install(tmp_path_factory):
    """A fresh virtual environment holding the package as pip installs it without extras (from a copy of the
    sources, so that the build writes nothing into the checkout), and the environment to run its commands in."""
    root = tmp_path_factory.mktemp("base-install")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("exporter", "reference"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    steps = (
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        # this interpreter's pip installs into the new one (--python), which needs no pip of its own
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-compile"]
        + ["--retries", "0", "--timeout", "30", str(source)],
    )
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # the installed copy runs
    probe = "import importlib.util, sys; print([m for m in sys.argv[1:] if importlib.util.find_spec(m)])"
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe, *ABSENT], capture_output=True, text=True, env=env, timeout=60
    )
    assert found.returncode == 0 and found.stdout.strip() == "[]", found.stdout + found.stderr  # really absent
    return venv / "bin" / "export-onnx", env


def _run(base_install, *args) -> subprocess.CompletedProcess:
    command, env = base_install
    return subprocess.run([str(command), *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test_inspect_generate_and_a_golden_replay_run_without_torch(base_install, artifact_fp32, tiny_model, tmp_path):
    bundle = tmp_path / "golden"
    settings = ParitySettings(decode_steps=2, greedy_tokens=4, sweep=False, long_context=False)
    recorded = verify_artifact(
        artifact_fp32, tiny_model, ["cpu"], settings, genai=False, transformers_js=False, golden_save=bundle
    )
    assert recorded.passed

    inspected = _run(base_install, "inspect", artifact_fp32, "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["model"]["source"] == {"kind": "seeded", "preset": "minimind-3-tiny", "seed": 0}

    generate = ("generate", artifact_fp32, "--prompt-ids", "1,42,7", "--max-new-tokens", "8", "--json", "-q")
    generated = _run(base_install, *generate)
    assert generated.returncode == 0, generated.stderr
    here = run_cli(*generate)  # the same ids as the full install's
    assert here.exit_code == 0 and json.loads(generated.stdout) == json.loads(here.stdout), here.output

    replayed = _run(base_install, "verify", artifact_fp32, "--golden", bundle, "--provider", "cpu", "--json", "-q")
    assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr
    report = json.loads(replayed.stdout)
    assert report["passed"] and report["reference"] == f"golden bundle {bundle}"
    # the same rows with the same numbers as the recording made against the model
    rows = [[row["name"], row["max_abs"]] for row in report["providers"][0]["comparisons"]]
    assert rows == [[row.name, row.max_abs] for row in recorded.reports[0].comparisons]


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["export", "--preset", "minimind-3-tiny"],
            "exporting needs the export extra (PyTorch, onnxscript, onnx-ir, safetensors), which does not import "
            f"here (No module named 'torch'); install it: {EXPORT_EXTRA}",
        ),
        (["run", "--preset", "minimind-3-tiny"], "exporting needs the export extra"),
        (
            ["verify", "ARTIFACT"],
            "verifying against the reference model needs PyTorch, which does not import here (No module named "
            f"'torch'); install the export extra ({EXPORT_EXTRA}), or replay a golden bundle (--golden)",
        ),
    ],
)
def test_a_command_that_needs_an_extra_names_it_in_one_line(base_install, artifact_fp32, tmp_path, args, said):
    args = [artifact_fp32 if a == "ARTIFACT" else a for a in args]
    if args[0] in ("export", "run"):
        args += ["-o", tmp_path / "new"]
    done = _run(base_install, *args, "-q")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], done.stderr
    assert not (tmp_path / "new").exists()
