"""`pytest --artifacts DIR`: the suite on a user's own artifact folder, through the installed plugin."""

from __future__ import annotations

import shutil
import subprocess
import sys

from helpers import claim_seed, edit_manifest


def _pytest(cwd, *args):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=900)


def test_plugin_does_nothing_without_the_option(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_one():\n    pass\n")
    out = _pytest(tmp_path)
    assert out.returncode == 0 and "1 passed" in out.stdout and "--artifacts" not in out.stdout and "reference =" not in out.stdout


def test_plugin_runs_invariants_when_no_reference_is_available(artifact_fp32, tmp_path):
    # Weights of unknown origin: no seed to rebuild the reference, no golden bundle.
    folder = shutil.copytree(artifact_fp32, tmp_path / "mine")
    edit_manifest(folder, lambda manifest: manifest["model"].update(source={"kind": "checkpoint", "path": "elsewhere",
                                                                            "sha256": "0" * 64}))
    out = _pytest(tmp_path, "--artifacts", folder, "--artifact-provider", "cpu", "-rA")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "reference-free invariants only" in out.stdout and "1 passed" in out.stdout
    assert "mine[invariants]::invariants" in out.stdout


def test_plugin_reports_a_broken_artifact_as_failures(artifact_fp32, tmp_path):
    folder = shutil.copytree(artifact_fp32, tmp_path / "wrong")
    edit_manifest(folder, claim_seed(1))  # the reference is rebuilt with other weights
    out = _pytest(tmp_path, "--artifacts", folder, "--artifact-provider", "cpu", "-rA")
    assert out.returncode == 1, out.stdout[-3000:]
    assert "the reference model rebuilt from the manifest" in out.stdout
    assert "failed" in out.stdout and "prefill logits max abs" in out.stdout
    assert "PASSED ::wrong[rebuilt]::invariants" in out.stdout  # the graphs themselves are sound


def test_a_checkpoint_is_the_reference_only_while_it_is_unchanged(minimind2_artifact, minimind2_checkpoint, tmp_path):
    from exporter.pytest_plugin import reference_plan
    assert reference_plan(minimind2_artifact, None) == ("rebuilt", None)
    folder = shutil.copytree(minimind2_artifact, tmp_path / "copy")
    changed = tmp_path / "changed.pth"
    changed.write_bytes(minimind2_checkpoint.read_bytes()[:-1] + b"\0")
    edit_manifest(folder, lambda manifest: manifest["model"]["source"].update(path=str(changed)))
    assert reference_plan(folder, None) == ("invariants", None)


def test_plugin_reports_a_damaged_manifest_as_a_usage_error(artifact_fp32, tmp_path):
    folder = shutil.copytree(artifact_fp32, tmp_path / "damaged")
    edit_manifest(folder, lambda manifest: manifest.update(dtype="int8"))
    out = _pytest(tmp_path, "--artifacts", folder)
    assert out.returncode == 4, out.stdout[-2000:] + out.stderr[-2000:]  # pytest's usage error
    assert "INTERNALERROR" not in out.stdout + out.stderr and "dtype 'int8' is none of" in out.stderr
