"""`pytest --artifacts=DIR`: the suite on a user's own artifact folder, through the installed plugin."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import claim_seed, edit_manifest, perturb_weight

from exporter.cli.pytest_plugin import CHECKS, SKIP, BundleRefused, Plan, _skip_reason, reference_plan
from exporter.errors import ToolkitError
from exporter.verify.checks.outputs import SweepCase
from exporter.verify.references.golden.bundle import FORMAT, FORMAT_VERSION
from reference.errors import CheckpointError


def _pytest(cwd, *args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


def test_plugin_does_nothing_without_the_option(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_one():\n    pass\n")
    out = _pytest(tmp_path)
    assert (
        out.returncode == 0
        and "1 passed" in out.stdout
        and "--artifacts" not in out.stdout
        and "reference =" not in out.stdout
    )


def test_plugin_collects_each_folder_as_one_item_per_check_and_nothing_else(artifact_fp32, tmp_path):
    # Two folders of one name: each item's id carries its path. Without test paths only the folders are collected.
    folders = [shutil.copytree(artifact_fp32, tmp_path / side / "model") for side in ("a", "b")]
    (tmp_path / "test_x.py").write_text("def test_one():\n    pass\n")
    out = _pytest(tmp_path, "--collect-only", "-q", *(f"--artifacts={folder}" for folder in folders))
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(ids) == len(set(ids)) == 2 * len(CHECKS) and "22 tests collected" in out.stdout
    assert {i.split("::")[0] for i in ids} == {"a/model/manifest.json", "b/model/manifest.json"}
    with_tests = _pytest(tmp_path, "--collect-only", "-q", "test_x.py", f"--artifacts={folders[0]}")
    assert "test_x.py::test_one" in with_tests.stdout and "12 tests collected" in with_tests.stdout
    # A repeated --artifacts adds its folders; test files inside a folder are not collected, and a conftest.py
    # there, which pytest would import, is refused before anything runs.
    (folders[0] / "test_extra.py").write_text("def test_extra():\n    pass\n")
    after = _pytest(tmp_path, "--collect-only", "-q", f"--artifacts={folders[0]}", "test_x.py")  # either order
    assert "test_x.py::test_one" in after.stdout and "12 tests collected" in after.stdout
    repeated = _pytest(tmp_path, "--collect-only", "-q", f"--artifacts={folders[0]}", f"--artifacts={folders[1]}")
    assert "22 tests collected" in repeated.stdout and "test_extra" not in repeated.stdout
    (folders[0] / "conftest.py").write_text("print('code from the artifact folder ran')\n")
    refused = _pytest(tmp_path, "--collect-only", "-q", "-s", f"--artifacts={folders[0]}")
    assert refused.returncode == 4 and "holds a conftest.py, which pytest would run as code" in refused.stderr
    assert "code from the artifact folder ran" not in refused.stdout + refused.stderr


def test_a_path_option_in_two_arguments_and_pytest_files_in_the_artifact_are_refused(artifact_fp32, tmp_path):
    # In `--artifacts DIR` pytest takes DIR for a test path when it picks its rootdir and ini file, before the
    # plugin's option exists: an ini file beside or above the artifact would configure the run.
    folder = shutil.copytree(artifact_fp32, tmp_path / "model")
    for args in (["--artifacts", folder], [f"--artifacts={folder}", "--golden-bundle", folder / "golden"]):
        split = _pytest(tmp_path, "--collect-only", "-q", *args)
        assert (
            split.returncode == 4
            and f"write {args[-2]}=DIR as one argument: in `{args[-2]} DIR` pytest takes "
            "DIR for a test path when it picks its rootdir and ini file"
            in split.stderr
        ), split.stderr[-2000:]
    split = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTEST_ADDOPTS": f"--artifacts {folder}"},
    )
    assert split.returncode == 4 and "write --artifacts=DIR as one argument" in split.stderr, split.stderr[-2000:]
    for name in ("pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"):
        (folder / name).write_text("[pytest]\n")
        refused = _pytest(tmp_path, "--collect-only", "-q", f"--artifacts={folder}")
        assert refused.returncode == 4, refused.stdout[-2000:]
        assert f"holds a {name}, which pytest would read as its configuration" in refused.stderr, refused.stderr
        (folder / name).unlink()


def test_a_hostile_ini_file_above_the_artifact_is_not_read(artifact_fp32, tmp_path):
    # Unpacked with a pytest.ini one folder up that would run its own plugin and turn the run into a collection.
    download = tmp_path / "downloads"
    folder = shutil.copytree(artifact_fp32, download / "model")
    marker = tmp_path / "ran"
    (download / "hostile.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (download / "pytest.ini").write_text("[pytest]\npythonpath = .\naddopts = -p hostile --collect-only\n")
    project = tmp_path / "project"
    project.mkdir()
    out = _pytest(project, f"--artifacts={folder}", "--co")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"rootdir: {project}\n" in out.stdout and "configfile" not in out.stdout, out.stdout[:2000]
    assert f"collected {len(CHECKS)} items" in out.stdout and not marker.exists()


def test_a_conftest_above_the_artifact_is_not_imported_while_the_test_paths_keep_theirs(artifact_fp32, tmp_path):
    # An artifact unpacked with a conftest.py beside it, one folder up: pytest imports the conftest.py of every
    # directory it collects, from the rootdir down to a test path, so it must never collect the folders.
    download = tmp_path / "downloads" / "pack"
    folder = shutil.copytree(artifact_fp32, download / "model")
    marker = tmp_path / "imported"
    (download / "conftest.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    suite = tmp_path / "suite"  # the user's own tests, whose conftest.py must still apply to them
    suite.mkdir()
    (suite / "conftest.py").write_text("import pytest\n\n@pytest.fixture\ndef answer():\n    return 42\n")
    (suite / "test_x.py").write_text("def test_one(answer):\n    assert answer == 42\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd, args in (
        (tmp_path, [f"--artifacts={folder.relative_to(tmp_path)}"]),
        (elsewhere, [f"--artifacts={folder}"]),
        (tmp_path, ["suite", f"--artifacts={folder}"]),
    ):
        out = _pytest(cwd, "--collect-only", "-q", *args)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert f"{len(CHECKS) + (args[0] == 'suite')} tests collected" in out.stdout, out.stdout[-2000:]
        beside = "../" if cwd == elsewhere else ""  # the rootdir is where pytest starts: ids are relative to it
        assert f"\n{beside}downloads/pack/model/manifest.json::greedy\n" in out.stdout, out.stdout[-2000:]
        assert not marker.exists(), args
    ran = _pytest(tmp_path, "suite", f"--artifacts={folder}", "-k", "test_one")
    assert ran.returncode == 0 and "1 passed" in ran.stdout, ran.stdout[-2000:]
    assert not marker.exists()


def test_plugin_runs_invariants_and_skips_the_rest_with_the_reason_when_no_reference_is_available(
    artifact_fp32, tmp_path
):
    # Weights exported from memory: no seed or checkpoint to rebuild the reference from, no golden bundle.
    folder = shutil.copytree(artifact_fp32, tmp_path / "mine")
    edit_manifest(folder, lambda manifest: manifest["model"].update(source={"kind": "in-memory"}))
    out = _pytest(tmp_path, f"--artifacts={folder}", "--artifact-provider", "cpu", "-rA")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "reference-free invariants only" in out.stdout and "1 passed, 10 skipped" in out.stdout
    assert "PASSED mine/manifest.json::invariants" in out.stdout
    assert (
        f"{folder}::greedy: no reference to compare with: the weights came from a in-memory source this toolkit "
        "cannot rebuild; pass --golden-bundle=DIR"
    ) in out.stdout  # the skip names its folder and check
    # A CI job passing on the invariants alone compared nothing with the reference: the summary says so, once
    [warning] = [line for line in out.stdout.splitlines() if "only the reference-free invariants ran" in line]
    assert warning.startswith(f"WARNING: {folder}: ") and "--require-reference" in warning, warning


def test_require_reference_makes_an_artifact_without_a_reference_a_usage_error(artifact_fp32, tmp_path):
    folder = shutil.copytree(artifact_fp32, tmp_path / "mine")
    edit_manifest(folder, lambda manifest: manifest["model"].update(source={"kind": "in-memory"}))
    out = _pytest(tmp_path, f"--artifacts={folder}", "--artifact-provider", "cpu", "--require-reference")
    assert out.returncode == 4, out.stdout[-3000:] + out.stderr[-2000:]
    [line] = out.stderr.strip().splitlines()
    assert (
        f"--require-reference: {folder} has no reference to compare with (the weights came from a in-memory "
        "source this toolkit cannot rebuild); pass --golden-bundle=DIR recorded with `export-onnx verify "
        "--golden-save`, or export the artifact from a checkpoint"
    ) in line, line
    # an artifact whose reference can be rebuilt (its seed) is accepted
    seeded = _pytest(tmp_path, "--collect-only", "-q", f"--artifacts={artifact_fp32}", "--require-reference")
    assert seeded.returncode == 0, seeded.stdout[-3000:] + seeded.stderr[-2000:]
    both = _pytest(
        tmp_path, "--collect-only", "-q", f"--artifacts={artifact_fp32}", f"--artifacts={folder}", "--require-reference"
    )
    assert both.returncode == 4 and f"--require-reference: {folder} has no reference" in both.stderr, both.stderr
    # several without one: all are counted and the first few named, in one line
    others = [shutil.copytree(folder, tmp_path / f"mine{index}") for index in range(2, 6)]
    several = _pytest(
        tmp_path,
        "--collect-only",
        "-q",
        f"--artifacts={artifact_fp32}",
        *(f"--artifacts={f}" for f in (folder, *others)),
        "--require-reference",
    )
    assert several.returncode == 4, several.stdout[-3000:] + several.stderr[-2000:]
    [line] = several.stderr.strip().splitlines()
    assert (
        f"--require-reference: 5 artifact folders have no reference to compare with: {folder}, {others[0]}, "
        f"{others[1]} and 2 more (the weights came from a in-memory source this toolkit cannot rebuild); pass "
        "--golden-bundle=DIR"
    ) in line, line
    alone = _pytest(tmp_path, "--require-reference")
    assert alone.returncode == 4 and "--require-reference without --artifacts" in alone.stderr, alone.stderr[-2000:]


def test_plugin_reports_a_broken_artifact_as_one_line_failures(artifact_fp32, tmp_path):
    folder = shutil.copytree(artifact_fp32, tmp_path / "wrong")
    edit_manifest(folder, claim_seed(1))  # the reference is rebuilt with other weights
    out = _pytest(tmp_path, f"--artifacts={folder}", "--artifact-provider", "cpu", "-rA")
    assert out.returncode == 1, out.stdout[-3000:]
    assert "the reference model rebuilt from the manifest" in out.stdout
    assert "prefill_and_decode failed on " in out.stdout and "prefill logits max abs" in out.stdout
    assert "FAILED wrong/manifest.json::onnxruntime_genai" in out.stdout  # its tokens are not the reference's
    # every one of the 24 parameters differs from the other seed's, each named (the first ones in the line)
    assert (
        f"weight_audit failed on {folder}: 24 finding(s): model.layers.0.self_attn.q_norm.weight differs" in out.stdout
    )
    assert "PASSED wrong/manifest.json::invariants" in out.stdout  # the graphs themselves are sound
    assert "SKIPPED" in out.stdout and "a dense model: no expert routing to compare" in out.stdout


def test_a_golden_bundle_is_judged_with_the_overrides_it_was_recorded_with(artifact_fp32, tiny_model, tmp_path):
    # The plugin takes no tolerance options: a bundle recorded under a tightened logits.peak (0: nothing meets
    # it) must fail its replay here too, and the header must say what the bundle overrides.
    from exporter.tolerances.parity import parse_overrides
    from exporter.verify.engine import verify_artifact
    from exporter.verify.inputs import ParitySettings

    bundle = tmp_path / "bundle"
    recorded = verify_artifact(
        artifact_fp32,
        tiny_model,
        ["cpu"],
        ParitySettings(decode_steps=2, sweep=False),
        genai=False,
        transformers_js=False,
        golden_save=bundle,
        overrides=parse_overrides(peak=["logits=0"]),
    )
    assert not recorded.passed
    out = _pytest(
        tmp_path, f"--artifacts={artifact_fp32}", f"--golden-bundle={bundle}", "--artifact-provider", "cpu", "-rA"
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    assert (
        f"reference = golden bundle {bundle}; tolerance overrides: logits.peak=0 (recorded in the golden bundle)"
    ) in out.stdout
    assert "prefill_and_decode failed on " in out.stdout and "PASSED" in out.stdout  # the invariants


def test_a_golden_bundle_inside_the_artifact_stands_in_only_when_the_reference_cannot_be_rebuilt(
    artifact_fp32, tiny_model, tmp_path
):
    # A perturbed artifact carrying a bundle recorded from itself with every tolerance loosened: the bundle
    # travels with the artifact, so it must not outrank the reference rebuilt from the seed.
    from exporter.tolerances.parity import parse_overrides
    from exporter.verify.engine import verify_artifact
    from exporter.verify.inputs import ParitySettings

    folder = shutil.copytree(artifact_fp32, tmp_path / "perturbed")
    perturb_weight(folder, "model.layers.0.self_attn.q_proj", 0.002)
    verify_artifact(
        folder,
        tiny_model,
        ["cpu"],
        ParitySettings(decode_steps=2, sweep=False),
        genai=False,
        transformers_js=False,
        golden_save=tmp_path / "loosened",
        overrides=parse_overrides(atol=["logits=1", "kv=1", "loss=1"]),
    )
    shutil.copytree(tmp_path / "loosened", folder / "golden")
    assert reference_plan(folder, None) == Plan("rebuilt")
    with pytest.MonkeyPatch.context() as patch:  # without torch the seed cannot be rebuilt: the bundle stands in
        patch.setitem(sys.modules, "torch", None)
        plan = reference_plan(folder, None)
        assert plan.reference == "golden" and plan.reason.startswith("PyTorch, which rebuilding the reference")
        shutil.rmtree(folder / "golden")
        with pytest.raises(
            ToolkitError, match="does not import here; install the export extra .* or pass --golden-bundle=DIR"
        ):
            reference_plan(folder, None)
        (folder / "golden").mkdir()  # a golden/ without its golden.json is refused, not passed over in silence
        with pytest.raises(
            BundleRefused, match=f"{folder}: {folder / 'golden'} is not a readable golden bundle"
        ) as refused:
            reference_plan(folder, None)
        assert not refused.value.given  # the usage error names --artifacts: no --golden-bundle was given
        (folder / "golden").rmdir()
        shutil.copytree(tmp_path / "loosened", folder / "golden")
    out = _pytest(tmp_path, f"--artifacts={folder}", "--artifact-provider", "cpu", "-rA")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    assert "reference = the reference model rebuilt from the manifest" in out.stdout
    assert "prefill_and_decode failed on " in out.stdout
    # Weights exported from memory cannot be rebuilt: the bundle is the reference, its --no-sweep recording
    # leaves the shape sweep out, and the header says why the bundle stands in.
    edit_manifest(folder, lambda manifest: manifest["model"].update(source={"kind": "in-memory"}))
    out = _pytest(tmp_path, f"--artifacts={folder}", "--artifact-provider", "cpu", "-rA")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert (
        f"reference = golden bundle {folder / 'golden'} (the weights came from a in-memory source this toolkit "
        "cannot rebuild); tolerance overrides: "
    ) in out.stdout
    assert (
        f"{folder}::shape_sweep: no shape sweep ran: the golden bundle was recorded with --no-sweep" in out.stdout
        and "7 passed, 4 skipped" in out.stdout  # the weight audit: no model to audit against
        and f"{folder}::weight_audit: no PyTorch model to audit the weights against" in out.stdout
    ), out.stdout[-3000:]


def test_a_broken_torch_install_is_refused_as_torch_missing_not_as_an_internal_error(artifact_fp32, tmp_path):
    # torch raises OSError, not ImportError, when one of its shared libraries cannot be loaded: that is torch
    # missing (a usage error), not an INTERNALERROR traceback here nor an internal error in `export-onnx verify`.
    fake = tmp_path / "broken" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise OSError('libtorch_cpu.so: cannot open shared object file')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])}
    out = _pytest(tmp_path, f"--artifacts={artifact_fp32}", env=env)
    assert out.returncode == 4 and "INTERNALERROR" not in out.stdout + out.stderr, out.stderr[-2000:]
    assert (
        "PyTorch, which rebuilding the reference needs, does not import here; install the export extra (pip "
        "install 'export-onnx[export]') or pass --golden-bundle=DIR"
    ) in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize(
    "module, error, said",
    [
        ("exporter.errors", "ArtifactError", ""),
        ("reference.errors", "CheckpointError", ""),
        ("builtins", "RuntimeError", "internal error RuntimeError: "),
    ],
)  # a fault of ours: reported once too
def test_a_verification_that_cannot_run_fails_each_item_in_one_line_and_runs_once(
    artifact_fp32, tmp_path, module, error, said
):
    (tmp_path / "conftest.py").write_text(
        "import exporter.verify.engine as engine\n"
        f"from {module} import {error}\n"
        "def cannot_run(folder, model, providers, **kwargs):\n"
        "    print('verification started on', providers)\n"
        f"    raise {error}('onnxruntime cannot load decode.onnx; re-export the folder')\n"
        "engine.verify_artifact = cannot_run\n"
    )
    folder = shutil.copytree(artifact_fp32, tmp_path / "model")
    out = _pytest(tmp_path, f"--artifacts={folder}", "--artifact-provider", "cpu", "-s")
    assert out.returncode == 1 and f"{len(CHECKS)} failed" in out.stdout, out.stdout[-3000:]
    assert out.stdout.count("verification started") == 1 and "Traceback" not in out.stdout
    assert "verification started on ['cpu']" in out.stdout  # --artifact-provider's, not every available one
    assert (
        f"greedy could not run on {folder}: {said}onnxruntime cannot load decode.onnx; re-export the folder"
        in out.stdout
    )


def test_the_shape_sweep_item_judges_a_routing_near_tie_as_verify_does():
    failing = SimpleNamespace(passed=False, name="logits", max_abs=0.5, needed=SimpleNamespace(scale=3.0))
    passing = SimpleNamespace(passed=True, name="kv", max_abs=0.0, needed=SimpleNamespace(scale=0.0))

    def judged(logits, explained):
        flip = SimpleNamespace(explained=explained, describe=lambda: "past prefill: 1 of 8 differ, not a near-tie")
        case = SweepCase(batch=2, new_tokens=1, past=3, logits=logits, kv=passing, routing=[flip])
        return CHECKS["shape_sweep"](
            SimpleNamespace(settings={"sweep": True}, reports=[SimpleNamespace(provider="cpu", sweep=[case])])
        )

    # an explained flip has left the positions it reached out of the comparisons: what is left must pass
    assert judged(passing, explained=True) == (True, "")
    assert judged(failing, explained=True) == (False, "cpu: batch 2 x new 1 x past 3: logits max abs 0.5 (3x tol)")
    assert judged(passing, explained=False) == (
        False,
        "cpu: batch 2 x new 1 x past 3: past prefill: 1 of 8 differ, not a near-tie",
    )
    # a broken graph fails every shape: the first three are named, the rest counted
    many = [SweepCase(batch=1, new_tokens=n, past=0, logits=failing, kv=passing, routing=[]) for n in range(1, 6)]
    many.append(SweepCase(batch=3, new_tokens=1, past=0, logits=passing, kv=passing, routing=[]))
    passed, detail = CHECKS["shape_sweep"](
        SimpleNamespace(settings={"sweep": True}, reports=[SimpleNamespace(provider="cpu", sweep=many)])
    )
    assert not passed and detail.count("logits max abs") == 3, detail
    assert detail.endswith("; 2 more fail (5 of the 6 shapes; export-onnx verify --json lists each)"), detail
    # a golden bundle recorded with --no-sweep replays no case: there is nothing to pass
    assert (
        CHECKS["shape_sweep"](
            SimpleNamespace(settings={"sweep": False}, reports=[SimpleNamespace(provider="cpu", sweep=[])])
        )
        is SKIP
    )


def test_each_per_provider_item_fails_when_its_own_check_failed():
    # The broken-artifact run above fails on its logits, so it cannot tell whether the greedy, fp16_health and
    # repeat_run items read their own verdict: here each one's check alone fails, on one of two providers.
    bad = SimpleNamespace(passed=False, name="cpu repeat run", max_abs=0.25, needed=SimpleNamespace(scale=2.0))
    good = SimpleNamespace(passed=True, note="32 tokens identical", issues=[], max_abs=0.0)
    failing = {
        "greedy": {"greedy": SimpleNamespace(passed=False, note="diverged at token 3")},
        "fp16_health": {"health": SimpleNamespace(passed=False, issues=["prefill logits: 1 NaN, 0 Inf"])},
        "repeat_run": {"repeat": bad},
    }
    for item, broken in failing.items():
        provider = {"greedy": good, "health": good, "repeat": good, **broken}
        report = SimpleNamespace(
            reports=[
                SimpleNamespace(provider="cuda", greedy=good, health=good, repeat=good),
                SimpleNamespace(provider="cpu", **provider),
            ]
        )
        passed, detail = CHECKS[item](report)
        assert not passed and detail.startswith("cpu: "), (item, detail)


def test_the_invariants_and_prefill_and_decode_items_fail_on_any_one_of_their_rows():
    # The broken artifact above fails on its prefill logits and passes every invariant: here the failing row is
    # the last one, a decode row or one invariant of several.
    def row(name, passed):
        return SimpleNamespace(
            name=name,
            passed=passed,
            max_abs=0.0 if passed else 0.5,
            needed=SimpleNamespace(scale=0.5 if passed else 4.0),
        )

    rows = [row("prefill logits", True), row("prefill present", True), row("decode logits (65 steps)", False)]
    report = SimpleNamespace(reports=[SimpleNamespace(provider="cpu", comparisons=rows)])
    assert CHECKS["prefill_and_decode"](report) == (False, "cpu: decode logits (65 steps) max abs 0.5 (4x tol)")
    invariants = [
        SimpleNamespace(name="batch independence", passed=True, detail="identical"),
        SimpleNamespace(name="mask respected", passed=False, detail="padding changed row 1"),
    ]
    assert CHECKS["invariants"](SimpleNamespace(invariants=invariants)) == (
        False,
        "mask respected: padding changed row 1",
    )


def test_expert_choice_is_skipped_not_passed_when_the_graphs_routers_were_not_found():
    # What ExpertAgreement could not measure (router TopK nodes renamed or fused) neither passes nor fails
    from exporter.cli.pytest_plugin import _skip_reason
    from exporter.verify.checks.routing import ExpertAgreement

    lost = ExpertAgreement(
        False, 0, 0, 0, "router TopK nodes not found in the graphs (found layers [] of 2); expert choice not measured"
    )
    report = SimpleNamespace(reports=[SimpleNamespace(provider="CPUExecutionProvider", experts=lost)])
    assert not lost.passed and not lost.failed and CHECKS["expert_choice"](report) is SKIP
    assert _skip_reason("expert_choice", report) == f"CPUExecutionProvider: {lost.note}"
    dense = SimpleNamespace(reports=[SimpleNamespace(provider="CPUExecutionProvider", experts=None)])
    assert _skip_reason("expert_choice", dense) == "a dense model: no expert routing to compare"
    measured = ExpertAgreement(True, 8, 7, 0, "7/8 agree")
    report.reports.append(SimpleNamespace(provider="CUDAExecutionProvider", experts=measured))
    assert CHECKS["expert_choice"](report) == (False, "CUDAExecutionProvider: 7/8 agree")
    report.reports[1] = SimpleNamespace(provider="CUDAExecutionProvider", experts=ExpertAgreement(True, 8, 8, 0, "8/8"))
    assert CHECKS["expert_choice"](report) == (True, "")  # the provider that measured nothing does not fail it


def test_a_checkpoint_is_the_reference_only_while_it_is_unchanged(minimind2_artifact, minimind2_checkpoint, tmp_path):
    # Gone or changed, it is refused as `export-onnx verify` refuses it: a stale artifact must not pass on skips.
    from exporter.artifact.manifest import read_manifest
    from exporter.verify.engine import verify_artifact
    from exporter.verify.inputs import ParitySettings
    from exporter.verify.references.model_source import rebuild_reference

    assert reference_plan(minimind2_artifact, None) == Plan("rebuilt")
    bundle = tmp_path / "bundle"
    verify_artifact(
        minimind2_artifact,
        rebuild_reference(minimind2_artifact, read_manifest(minimind2_artifact)),
        ["cpu"],
        ParitySettings(decode_steps=1, sweep=False),
        genai=False,
        transformers_js=False,
        golden_save=bundle,
    )
    folder = shutil.copytree(minimind2_artifact, tmp_path / "copy")
    changed = tmp_path / "elsewhere" / minimind2_checkpoint.name  # the same name: only the content differs
    changed.parent.mkdir()
    content = bytearray(minimind2_checkpoint.read_bytes())
    content[len(content) // 2] ^= 0xFF
    changed.write_bytes(bytes(content))
    edit_manifest(folder, lambda manifest: manifest["model"]["source"].update(path=str(changed)))
    with pytest.raises(CheckpointError, match=f"its checkpoint {changed} changed since the export; restore it"):
        reference_plan(folder, None)
    edit_manifest(folder, lambda manifest: manifest["model"]["source"].update(path="/dev/null"))
    with pytest.raises(CheckpointError, match="its checkpoint /dev/null is gone"):
        reference_plan(folder, None)
    with pytest.raises(
        ToolkitError,
        match="which is gone; restore it, replay a golden bundle recorded from the "
        "artifact \\(`golden`\\), or re-export",
    ):  # verify's way out too
        rebuild_reference(folder, read_manifest(folder))
    out = _pytest(tmp_path, f"--artifacts={folder}")
    assert out.returncode == 4 and "its checkpoint /dev/null is gone" in out.stderr, out.stderr[-2000:]
    # A bundle inside the artifact stands in for a reference that cannot be rebuilt.
    shutil.copytree(bundle, folder / "golden")
    assert reference_plan(folder, None) == Plan("golden", folder / "golden", reason="its checkpoint /dev/null is gone")


def test_what_can_be_checked_before_running_is_a_usage_error(artifact_fp32, tiny_model, tmp_path):
    def usage_error(folder, fragment, *options):
        out = _pytest(tmp_path, f"--artifacts={folder}", *options)
        assert out.returncode == 4, out.stdout[-2000:] + out.stderr[-2000:]  # pytest's usage error
        assert "INTERNALERROR" not in out.stdout + out.stderr and fragment in out.stderr, out.stderr[-2000:]

    damaged = shutil.copytree(artifact_fp32, tmp_path / "damaged")
    edit_manifest(damaged, lambda manifest: manifest.update(dtype="int8"))
    usage_error(damaged, "dtype 'int8' is none of")
    truncated = shutil.copytree(artifact_fp32, tmp_path / "truncated")
    with open(truncated / "weights.onnx.data", "r+b") as weights:
        weights.truncate(4096)
    usage_error(truncated, "weights.onnx.data is 4096 bytes, not ")
    usage_error(
        artifact_fp32,
        "runs and verifies on CPUExecutionProvider and CUDAExecutionProvider, not bogus; pass "
        "cpu or cuda (--artifact-provider)",
        "--artifact-provider",
        "bogus",
    )
    other = tmp_path / "other-bundle"
    other.mkdir()
    (other / "golden.json").write_text(
        json.dumps(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "artifact": {"config": {"hidden_size": 1}, "dtype": "float32", "sha256": {}},
            }
        )
    )
    # named as --golden-bundle's problem, for the folder it was given with (one bundle, several folders)
    usage_error(
        artifact_fp32,
        f"--golden-bundle: {artifact_fp32}: golden bundle {other} belongs to another model",
        f"--golden-bundle={other}",
    )
    usage_error(tmp_path / "none", "does not exist", f"--golden-bundle={other}")  # the folder is checked first
    # a bundle of this artifact, damaged since: refused before anything runs, as `verify --golden` refuses it, not
    # items that "could not run" (exit 1, as if the artifact had failed)
    from exporter.verify.engine import verify_artifact
    from exporter.verify.inputs import ParitySettings

    damaged_bundle = tmp_path / "damaged-bundle"
    verify_artifact(
        artifact_fp32,
        tiny_model,
        ["cpu"],
        ParitySettings(decode_steps=1, sweep=False),
        genai=False,
        transformers_js=False,
        golden_save=damaged_bundle,
    )
    arrays = bytearray((damaged_bundle / "arrays.npz").read_bytes())
    arrays[len(arrays) // 2] ^= 1
    (damaged_bundle / "arrays.npz").write_bytes(bytes(arrays))
    usage_error(
        artifact_fp32,
        f"--golden-bundle: {artifact_fp32}: golden bundle {damaged_bundle} is damaged",
        f"--golden-bundle={damaged_bundle}",
    )
    usage_error(
        artifact_fp32 / "manifest.json",
        f"({artifact_fp32 / 'manifest.json'}: pass the artifact folder, not its manifest.json)",
    )
    usage_error(
        damaged_bundle,
        f"({damaged_bundle}: a golden bundle; pass it as --golden-bundle=DIR, with the "
        "artifact it was recorded from as --artifacts=DIR)",
    )
    alone = _pytest(tmp_path, f"--golden-bundle={other}")  # an option of the plugin's without its folders
    assert alone.returncode == 4 and "--golden-bundle without --artifacts" in alone.stderr, alone.stderr[-2000:]


def test_each_consumer_item_judges_its_own_consumer_and_skips_with_the_verifications_own_words():
    # The reason as the verification words it, not prefixed with the consumer's name a second time.
    reason = "onnxruntime-genai is not installed (pip install onnxruntime-genai)"
    assert _skip_reason("onnxruntime_genai", SimpleNamespace(consumers_skipped={"onnxruntime-genai": reason})) == reason
    failed = SimpleNamespace(consumer="transformers.js 4.3.2", passed=False, greedy=SimpleNamespace(note="diverged"))
    report = SimpleNamespace(consumers=[failed], consumers_skipped={"onnxruntime-genai": reason})
    assert CHECKS["onnxruntime_genai"](report) is SKIP and _skip_reason("onnxruntime_genai", report) == reason
    assert CHECKS["transformers_js"](report) == (False, "transformers.js 4.3.2: diverged")


def test_a_golden_bundle_is_read_once_and_the_verification_takes_it_as_loaded(
    artifact_fp32, artifact_copy, tiny_model, tmp_path, monkeypatch
):
    # Read whole at startup, so that a damaged one is a usage error; the verification then replays that one
    # rather than reading the folder again.
    from exporter.artifact.manifest import read_manifest
    from exporter.cli.pytest_plugin import _verify
    from exporter.verify import plan as verify_plan
    from exporter.verify.engine import verify_artifact
    from exporter.verify.inputs import ParitySettings
    from exporter.verify.references.golden import reading
    from exporter.verify.references.golden.bundle import GoldenMismatch
    from exporter.verify.references.golden.reading import load_bundle

    bundle = tmp_path / "bundle"
    verify_artifact(
        artifact_fp32,
        tiny_model,
        ["cpu"],
        ParitySettings(decode_steps=2, sweep=False),
        genai=False,
        transformers_js=False,
        golden_save=bundle,
    )
    reads = []

    def counting(folder, manifest):
        reads.append(folder)
        return load_bundle(folder, manifest)

    monkeypatch.setattr(reading, "load_bundle", counting)
    monkeypatch.setattr(verify_plan, "load_bundle", counting)
    plan = reference_plan(artifact_fp32, bundle)
    report = _verify(artifact_fp32, plan, ["cpu"])
    assert reads == [bundle] and report.passed and report.reference == f"golden bundle {bundle}", reads
    # A loaded bundle is held to the artifact as its folder would be
    perturb_weight(artifact_copy, "model.layers.1.mlp.down_proj", 0.05)
    with pytest.raises(GoldenMismatch, match=f"golden bundle {bundle} was recorded from another export"):
        verify_artifact(artifact_copy, None, ["cpu"], golden=load_bundle(bundle, read_manifest(artifact_fp32)))
