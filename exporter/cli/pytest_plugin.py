"""pytest plugin: `pytest --artifacts=DIR [--artifacts=DIR ...]` runs the verification suite on your own artifacts.

Registered through the `pytest11` entry point, so it is active wherever this package is installed;
without --artifacts it adds nothing. Each folder is collected as `DIR/manifest.json` with one test item
per check, after the test paths given (alone when none is). The session itself holds these items:
pytest never collects the folder or its parents as directories, since collecting a directory imports
its conftest.py, and one above a downloaded artifact is as foreign as one inside it. A path option is
written as one argument (`--artifacts=DIR`): pytest picks its rootdir and ini file from the arguments
before this plugin registers its options, so in `--artifacts DIR` it takes DIR for a test path and an
ini file beside or above the artifact would configure the run; the two-argument form is refused. Per
folder the reference is, in this order: a golden bundle given (--golden-bundle=DIR), the reference model
rebuilt from the manifest's `source` (its seed, or its unchanged checkpoint), a `golden/` bundle inside
the artifact (only when the reference cannot be rebuilt), or none, in which case only the reference-free
invariants run, the other checks are skipped with the reason and the terminal summary warns that nothing
was compared with the reference (--require-reference makes it a usage error instead). Everything that can
be checked without running the graphs (the manifest, the file sizes, the providers, the golden bundle) is
checked at startup: a problem there is one line and pytest's usage-error exit code, 4.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the plugin imports the toolkit only once --artifacts is given
    from exporter.verify.references.golden.reading import GoldenBundle

GOLDEN_IN_ARTIFACT = "golden"
PATH_OPTIONS = ("--artifacts", "--golden-bundle")  # written --option=DIR: see the module's docstring
# Files pytest would run (conftest.py) or read as its configuration (the ini files) from a folder it collects
# or starts in; an artifact holds none of them.
PYTEST_FILES = {
    "conftest.py": "run as code",
    **{
        name: "read as its configuration"
        for name in ("pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")
    },
}
_PLANS = pytest.StashKey[dict]()  # absolute folder (a pytest node's path) -> Plan
NO_REFERENCE_FIX = (
    "pass --golden-bundle=DIR recorded with `export-onnx verify --golden-save`, or export the "
    "artifact from a checkpoint"
)


# The plugin's options by the library parameter each sets (see exporter.cli.outcome.FLAGS).
OPTIONS = {"provider": "--artifact-provider", "providers": "--artifact-provider", "golden": "--golden-bundle=DIR"}


def _in_options(message) -> str:
    from exporter.cli.outcome import in_flags

    return in_flags(str(message), OPTIONS)


def pytest_addoption(parser):
    group = parser.getgroup("export-onnx", "verification of exported ONNX artifacts")
    group.addoption(
        "--artifacts",
        action="append",
        type=Path,
        default=None,
        metavar="DIR",
        help="artifact folder to run the verification suite on, written --artifacts=DIR (one argument, "
        "else pytest reads DIR as a test path when it picks its ini file); repeatable",
    )
    group.addoption(
        "--golden-bundle",
        type=Path,
        default=None,
        metavar="DIR",
        help="golden bundle to verify the artifacts against, written --golden-bundle=DIR (instead of "
        "rebuilding the reference)",
    )
    group.addoption(
        "--artifact-provider",
        action="append",
        default=None,
        metavar="NAME",
        help="execution provider, cpu or cuda (repeatable); default: every available one",
    )
    group.addoption(
        "--require-reference",
        action="store_true",
        default=False,
        help="refuse an artifact with no reference to compare with (weights exported from memory, no "
        "golden bundle) instead of running its invariants alone",
    )


class BundleRefused(Exception):
    """A golden bundle that cannot be a folder's reference (another artifact's, damaged, of another format);
    `given`: it is --golden-bundle's, not the folder's own golden/."""

    def __init__(self, message: str, given: bool):
        super().__init__(message)
        self.given = given


@dataclass(frozen=True)
class Plan:
    """What a folder is verified against: 'golden' (bundle), 'rebuilt' or 'invariants' (no reference: why)."""

    reference: str
    bundle: Path | None = None
    reason: str = ""  # why the reference could not be rebuilt, for 'invariants' and an in-folder bundle
    overrides: str = ""  # the tolerance overrides a golden bundle was recorded with, which its replay applies
    loaded: GoldenBundle | None = field(default=None, compare=False, repr=False)  # the bundle, read at startup


def reference_plan(folder: Path, golden: Path | None) -> Plan:
    """The folder's reference, from what it offers; ToolkitError when the folder cannot be used, BundleRefused
    (naming the folder) when the bundle cannot, CheckpointError when the checkpoint it was exported from is gone
    or changed and no bundle stands in.

    A `golden/` bundle inside the artifact comes after the rebuilt reference: it travels with the artifact,
    so whoever altered the graphs could have recorded it from them, with loosened tolerances."""
    from exporter.artifact.manifest import read_manifest
    from exporter.errors import EXPORT_EXTRA, ToolkitError
    from exporter.verify.references.model_source import reference_for
    from reference.errors import CheckpointError

    manifest = read_manifest(folder, check_hashes=False)  # hashes are checked when the verification runs
    for name, fate in PYTEST_FILES.items():
        if (Path(folder) / name).exists():
            raise ToolkitError(f"{folder} holds a {name}, which pytest would {fate}; an artifact holds none: remove it")
    reference = reference_for(manifest, golden, stand_in=Path(folder) / GOLDEN_IN_ARTIFACT)
    if reference.kind == "rebuilt":
        return Plan("rebuilt")
    problem = reference.problem
    if reference.kind == "golden":
        try:
            return _golden_plan(reference.bundle, manifest, reason=problem.reason if problem else "")
        except ToolkitError as exc:  # the bundle's message names the bundle alone: say which folder it was for
            raise BundleRefused(f"{folder}: {exc}", given=golden is not None) from None
    if problem.cause == "checkpoint":  # as `export-onnx verify` refuses it: a stale artifact must not pass
        raise CheckpointError(f"{folder}: {problem.reason}; restore it, pass --golden-bundle=DIR, or re-export")
    if problem.cause == "torch":  # the checks must not be skipped as if none could run
        raise ToolkitError(
            f"{folder}: {problem.reason}; install the export extra ({EXPORT_EXTRA}) or pass --golden-bundle=DIR"
        )
    return Plan("invariants", reason=problem.reason)


def _golden_plan(bundle: Path, manifest, reason: str = "") -> Plan:
    """Read whole, as the replay reads it: a damaged bundle is a usage error here, as `verify --golden` refuses it
    (exit 2), not nine items that could not run (exit 1, as if the artifact had failed)."""
    from exporter.tolerances.parity import AppliedOverrides
    from exporter.verify.references.golden.reading import load_bundle

    loaded = load_bundle(bundle, manifest)  # kept: the verification replays this one, not a second read
    return Plan(
        "golden",
        Path(bundle),
        reason=reason,
        overrides=AppliedOverrides(recorded=loaded.overrides).describe(),
        loaded=loaded,
    )


def pytest_configure(config):
    folders = config.getoption("artifacts")
    if not folders:
        given = [
            flag
            for flag, name in (
                ("--golden-bundle", "golden_bundle"),
                ("--artifact-provider", "artifact_provider"),
                ("--require-reference", "require_reference"),
            )
            if config.getoption(name) not in (None, False)
        ]
        if given:
            raise pytest.UsageError(f"{', '.join(given)} without --artifacts: name the artifact folders to verify")
        return
    split = [option for option in PATH_OPTIONS if option in _command_line(config)]
    if split:
        raise pytest.UsageError(
            f"write {split[0]}=DIR as one argument: in `{split[0]} DIR` pytest takes DIR for a "
            "test path when it picks its rootdir and ini file, so a pytest.ini beside or above "
            "it would configure the run"
        )
    from exporter.errors import ProviderError, ToolkitError, first_of
    from exporter.runtime.providers import check_parity_providers

    try:
        check_parity_providers(config.getoption("artifact_provider") or [])
    except ProviderError as exc:
        raise pytest.UsageError(f"--artifact-provider: {_in_options(exc)}") from None
    try:
        plans = {
            Path(os.path.abspath(folder)): reference_plan(Path(folder), config.getoption("golden_bundle"))
            for folder in folders
        }
    except BundleRefused as exc:
        raise pytest.UsageError(f"{'--golden-bundle' if exc.given else '--artifacts'}: {exc}") from None
    except ToolkitError as exc:
        from exporter.verify.references.golden.reading import misplaced_bundle_hint

        manifests = [str(f) for f in folders if Path(f).name == "manifest.json" and Path(f).is_file()]
        hint = (f" ({', '.join(manifests)}: pass the artifact folder, not its manifest.json)" if manifests else "") + (
            misplaced_bundle_hint(folders, "--golden-bundle=DIR", "--artifacts=DIR")
        )
        raise pytest.UsageError(f"--artifacts: {_in_options(exc)}{hint}") from None
    if config.getoption("require_reference"):
        missing = {folder: plan.reason for folder, plan in plans.items() if plan.reference == "invariants"}
        if len(missing) == 1:
            [(folder, reason)] = missing.items()
            raise pytest.UsageError(
                f"--require-reference: {folder} has no reference to compare with ({reason}); {NO_REFERENCE_FIX}"
            )
        if missing:
            raise pytest.UsageError(
                f"--require-reference: {len(missing)} artifact folders have no reference to "
                f"compare with: {first_of(missing, 3)} "
                f"({'; '.join(dict.fromkeys(missing.values()))}); "
                f"{NO_REFERENCE_FIX}"
            )
    config.stash[_PLANS] = plans
    if config.args_source != pytest.Config.ArgsSource.ARGS:  # no test paths given: the folders alone
        config.args[:] = []


def _command_line(config) -> list[str]:
    """The arguments pytest picked its rootdir and ini file from: PYTEST_ADDOPTS, then the command line."""
    return shlex.split(os.environ.get("PYTEST_ADDOPTS", "")) + [str(arg) for arg in config.invocation_params.args]


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """The session collects each folder's manifest.json itself, after the test paths. Given as a test path,
    the manifest would be reached through a directory collector for each folder from the rootdir down, and
    pytest imports the conftest.py of every directory it collects: one beside or above the artifact
    (`/downloads/conftest.py` for `--artifacts=/downloads/model`) would run as code."""
    report = yield
    plans = collector.config.stash.get(_PLANS, None)
    if isinstance(collector, pytest.Session) and plans and report.passed:
        # The id is relative to the rootdir, which is where pytest starts, so it may lie beside the folder: pytest's
        # own id for a path outside the rootdir drops the folder ("::manifest.json"), and with it what tells
        # two folders apart.
        report.result += [
            ArtifactFile.from_parent(
                collector,
                path=folder / "manifest.json",
                plan=plan,
                nodeid=os.path.relpath(folder / "manifest.json", collector.config.rootpath),
            )
            for folder, plan in plans.items()
        ]
    return report


class ArtifactFile(pytest.File):
    """An artifact folder's manifest; its items share one verification run."""

    def __init__(self, *, plan: Plan, **kwargs):
        super().__init__(**kwargs)
        self.plan, self.outcome = plan, None  # outcome: the VerifyReport, or the error that stopped it

    def collect(self):
        for name, pick in CHECKS.items():
            yield ArtifactCheck.from_parent(self, name=name, pick=pick)

    def verify(self):
        if self.outcome is None:
            try:
                self.outcome = _verify(self.path.parent, self.plan, self.config.getoption("artifact_provider"))
            except Exception as exc:  # noqa: BLE001 -- kept, so the folder's other items report it, not rerun it
                self.outcome = exc
        return self.outcome


class VerificationStopped(Exception):
    """The folder's verification stopped with an error; every item reports it in one line."""


class ArtifactCheck(pytest.Item):
    def __init__(self, *, pick, **kwargs):
        super().__init__(**kwargs)
        self.pick = pick

    def runtest(self):
        artifact = self.parent
        folder = artifact.path.parent
        if self.name != "invariants" and artifact.plan.reference == "invariants":
            pytest.skip(
                f"{folder}::{self.name}: no reference to compare with: {artifact.plan.reason}; pass --golden-bundle=DIR"
            )
        outcome = artifact.verify()
        if isinstance(outcome, Exception):
            from exporter.errors import ToolkitError, first_line

            known = isinstance(outcome, ToolkitError)  # else a fault of this toolkit: say which
            raise VerificationStopped(
                _in_options(first_line(outcome))
                if known
                else f"internal error {type(outcome).__name__}: {first_line(outcome)}"
            )
        verdict = self.pick(outcome)
        if verdict is SKIP:
            pytest.skip(f"{folder}::{self.name}: {_skip_reason(self.name, outcome)}")
        passed, detail = verdict
        if not passed:
            raise AssertionError(detail)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, (AssertionError, VerificationStopped)):
            what = "failed" if isinstance(excinfo.value, AssertionError) else "could not run"
            return f"{self.name} {what} on {self.parent.path.parent}: {excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"{self.parent.path.parent}::{self.name}"


def _verify(folder: Path, plan: Plan, providers):
    from exporter.artifact.folder import Artifact
    from exporter.verify.engine import verify_artifact
    from exporter.verify.references.model_source import rebuild_reference

    artifact = Artifact.open(folder)  # once: it hashes every file, the weights included
    model = rebuild_reference(folder, artifact.manifest) if plan.reference == "rebuilt" else None
    golden = plan.loaded if plan.loaded is not None else plan.bundle  # not read a second time
    return verify_artifact(artifact, model, providers, golden=golden)


SKIP = object()  # a check that does not apply to this artifact or run


def _skip_reason(name: str, report) -> str:
    if name == "expert_choice":
        unmeasured = [f"{r.provider}: {r.experts.note}" for r in report.reports if r.experts is not None]
        return "; ".join(unmeasured) if unmeasured else "a dense model: no expert routing to compare"
    if name == "shape_sweep":  # the plugin's own runs sweep: only a golden bundle's recorded settings leave it out
        return "no shape sweep ran: the golden bundle was recorded with --no-sweep"
    if name == "weight_audit":
        return f"no PyTorch model to audit the weights against (reference: {report.reference})"
    if name == "providers_agree":
        skipped = "; ".join(f"{p}: {why}" for p, why in report.skipped.items())
        return f"one provider ran ({report.reports[0].provider})" + (f"; skipped {skipped}" if skipped else "")
    consumer = CONSUMERS[name]  # the reason names the consumer itself
    return report.consumers_skipped.get(consumer, f"{consumer} did not run")


def _worst(comparisons) -> tuple[bool, str]:
    bad = [c for c in comparisons if not c.passed]
    return not bad, ", ".join(f"{c.name} max abs {c.max_abs:.3g} ({c.needed.scale:.2g}x tol)" for c in bad)


SWEEP_FAILURES_SHOWN = 3  # a broken graph fails every shape: 36 of them made one line of some 5,000 characters


def _sweep(cases) -> tuple[bool, str]:
    bad = [c for c in cases if not c.passed]  # a MoE routing near-tie leaves out what it reached, as in verify
    shown = "; ".join(_sweep_failure(c) for c in bad[:SWEEP_FAILURES_SHOWN])
    more = len(bad) - SWEEP_FAILURES_SHOWN
    return not bad, shown + (
        f"; {more} more fail ({len(bad)} of the {len(cases)} shapes; export-onnx verify --json lists each)"
        if more > 0
        else ""
    )


def _sweep_failure(case) -> str:
    parts = [_worst([case.logits, case.kv])[1]] + [flip.describe() for flip in case.routing if not flip.explained]
    return f"{case.name}: {', '.join(part for part in parts if part)}"


def _per_provider(part):
    """A check judged on every provider that ran."""

    def pick(report):
        verdicts = [(r.provider, *part(r)) for r in report.reports]
        failed = [f"{provider}: {detail}" for provider, ok, detail in verdicts if not ok]
        if not verdicts:
            return False, "no provider ran"
        return not failed, "; ".join(failed)

    return pick


def _shape_sweep(report):
    if not report.settings.get("sweep"):  # no case ran: nothing to pass
        return SKIP
    return _per_provider(lambda r: _sweep(r.sweep))(report)


def _experts(report):
    """Skipped where no provider measured expert choice (a dense model, routers not found), as verify reports it;
    else judged on those that did: one that measured nothing has not failed."""
    if all(r.experts is None or not r.experts.measured for r in report.reports):
        return SKIP
    return _per_provider(lambda r: (not r.experts.failed, r.experts.note))(report)


# The consumer checks' items, and the consumer each judges (exporter.verify.consumers names them so; not imported
# here, where the plugin loads in every pytest run).
CONSUMERS = {"onnxruntime_genai": "onnxruntime-genai", "transformers_js": "transformers.js"}


def _consumer(item: str):
    """The check of one consumer's greedy tokens; skipped where it did not run."""

    def pick(report):
        ran = [c for c in report.consumers if c.consumer.startswith(f"{CONSUMERS[item]} ")]  # "name version"
        if not ran:
            return SKIP
        failed = [f"{c.consumer}: {c.greedy.note}" for c in ran if not c.passed]
        return not failed, "; ".join(failed)

    return pick


CHECKS = {
    "invariants": lambda r: (
        all(i.passed for i in r.invariants),
        "; ".join(f"{i.name}: {i.detail}" for i in r.invariants if not i.passed),
    ),
    "weight_audit": lambda r: (
        SKIP if r.weights is None else (r.weights.passed, "; ".join(g.detail for g in r.weights.graphs if not g.passed))
    ),
    "prefill_and_decode": _per_provider(lambda p: _worst(p.comparisons)),
    "greedy": _per_provider(lambda p: (p.greedy.passed, p.greedy.note)),
    "shape_sweep": _shape_sweep,
    "fp16_health": _per_provider(lambda p: (p.health.passed, "; ".join(p.health.issues))),
    "repeat_run": _per_provider(lambda p: (p.repeat.passed, f"max abs {p.repeat.max_abs:.3g}")),
    "expert_choice": _experts,
    "providers_agree": lambda r: _worst(r.cross) if len(r.reports) > 1 else SKIP,
    **{item: _consumer(item) for item in CONSUMERS},
}


def pytest_report_header(config):
    plans = config.stash.get(_PLANS, None)
    if not plans:
        return None
    described = {
        "golden": lambda p: (
            f"golden bundle {p.bundle}"
            + (f" ({p.reason})" if p.reason else "")
            + (f"; tolerance overrides: {p.overrides}" if p.overrides else "")
        ),
        "rebuilt": lambda p: "the reference model rebuilt from the manifest (its seed or checkpoint)",
        "invariants": lambda p: f"none ({p.reason}): reference-free invariants only",
    }
    return [f"artifact {folder}: reference = {described[plan.reference](plan)}" for folder, plan in plans.items()]


def pytest_terminal_summary(terminalreporter, config):
    """One warning line per folder that had no reference: its run passes on the invariants alone, which compared
    nothing with the reference (--require-reference makes it a usage error)."""
    plans = config.stash.get(_PLANS, None) or {}
    for folder, plan in plans.items():
        if plan.reference == "invariants":
            terminalreporter.write_line(
                f"WARNING: {folder}: only the reference-free invariants ran, nothing was "
                f"compared with the reference ({plan.reason}); {NO_REFERENCE_FIX} "
                "(--require-reference makes this an error)",
                yellow=True,
                bold=True,
            )
