"""pytest plugin: `pytest --artifacts DIR [DIR ...]` runs the verification suite on your own artifacts.

Registered through the `pytest11` entry point, so it is active wherever this package is installed;
without --artifacts it adds nothing. Per folder the reference is, in this order: a golden bundle
(--golden-bundle DIR, or a `golden/` folder inside the artifact), the reference model rebuilt from the
manifest's `source` (its seed, or its unchanged checkpoint), or none, in which case only the reference-free invariants run. The header says
which for each folder, and every check of the report becomes one test item.
"""

from __future__ import annotations

from pathlib import Path

import pytest

GOLDEN_IN_ARTIFACT = "golden"


def pytest_addoption(parser):
    group = parser.getgroup("minimind-onnx", "verification of exported ONNX artifacts")
    group.addoption("--artifacts", nargs="+", type=Path, default=None, metavar="DIR",
                    help="artifact folder(s) to run the verification suite on")
    group.addoption("--golden-bundle", type=Path, default=None, metavar="DIR",
                    help="golden bundle to verify the artifacts against (instead of rebuilding the reference)")
    group.addoption("--artifact-provider", action="append", default=None, metavar="NAME",
                    help="execution provider (repeatable); default: every available one")


def reference_plan(folder: Path, golden: Path | None) -> tuple[str, Path | None]:
    """('golden', bundle) | ('rebuilt', None) | ('invariants', None), from what the folder offers."""
    from exporter.manifest import read_manifest
    bundle = golden or (folder / GOLDEN_IN_ARTIFACT if (folder / GOLDEN_IN_ARTIFACT / "golden.json").is_file() else None)
    if bundle is not None:
        return "golden", bundle
    source = read_manifest(folder, check_hashes=False).source
    if source.get("kind") == "seeded" or (source.get("kind") == "checkpoint" and _unchanged(source)):
        return "rebuilt", None
    return "invariants", None


def _unchanged(source: dict) -> bool:
    """The checkpoint the artifact was exported from is still there (a file or a folder), as it was."""
    path = Path(source.get("path", ""))
    if not path.exists():
        return False
    from reference.checkpoints import fingerprint
    return fingerprint(path) == source.get("sha256")


def _verify(folder: Path, plan: str, bundle: Path | None, providers):
    from exporter.manifest import read_manifest
    from exporter.verify.engine import verify_artifact
    manifest = read_manifest(folder)  # once: it hashes every file, the weights included
    model = None
    if plan == "rebuilt":
        from exporter.reference_runner import rebuild_reference
        model = rebuild_reference(folder, manifest)
    return verify_artifact(folder, model, providers, golden=bundle, manifest=manifest)


class ArtifactCheck(pytest.Item):
    def __init__(self, *, folder: Path, plan: str, bundle: Path | None, providers, pick, cache: dict, **kwargs):
        super().__init__(**kwargs)
        self.folder, self.plan, self.bundle, self.providers, self.pick, self.cache = (folder, plan, bundle, providers,
                                                                                       pick, cache)

    def runtest(self):
        if self.folder not in self.cache:  # one verification per folder, shared by its items
            self.cache[self.folder] = _verify(self.folder, self.plan, self.bundle, self.providers)
        passed, detail = self.pick(self.cache[self.folder])
        if not passed:
            raise AssertionError(detail)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, AssertionError):
            return f"{self.name} failed on {self.folder}: {excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.folder, None, f"{self.folder}::{self.name}"


def _picks(plan: str) -> dict:
    def provider_part(part):
        def pick(report):
            rows = [(r.provider, part(r)) for r in report.reports]
            failed = [f"{provider}: {detail}" for provider, (ok, detail) in rows if not ok]
            return not failed and bool(rows), "; ".join(failed) or "no provider ran"
        return pick

    def worst(comparisons):
        bad = [c for c in comparisons if not c.passed]
        return not bad, ", ".join(f"{c.name} max abs {c.max_abs:.3g} ({c.needed.scale:.2g}x tol)" for c in bad)

    picks = {"invariants": lambda r: (all(i.passed for i in r.invariants),
                                      "; ".join(f"{i.name}: {i.detail}" for i in r.invariants if not i.passed))}
    if plan != "invariants":
        picks.update({
            "prefill and decode": provider_part(lambda p: worst(p.comparisons)),
            "greedy": provider_part(lambda p: (p.greedy.passed, p.greedy.note)),
            "shape sweep": provider_part(lambda p: worst([c.logits for c in p.sweep] + [c.kv for c in p.sweep])),
            "fp16 health": provider_part(lambda p: (p.health.passed, "; ".join(p.health.issues))),
            "repeat run": provider_part(lambda p: (p.repeat.passed, f"max abs {p.repeat.max_abs:.3g}")),
            "expert choice": provider_part(lambda p: (p.experts is None or p.experts.passed,
                                                      p.experts.note if p.experts is not None else "")),
            "providers agree": lambda r: worst(r.cross) if r.cross else (True, ""),
        })
    return picks


def pytest_collection_modifyitems(session, config, items):
    folders = config.getoption("artifacts")
    if not folders:
        return
    from exporter.errors import ToolkitError
    cache: dict = {}
    for folder in folders:
        try:
            plan, bundle = reference_plan(folder, config.getoption("golden_bundle"))
        except ToolkitError as exc:
            raise pytest.UsageError(f"--artifacts: {exc}") from None
        for name, pick in _picks(plan).items():
            items.append(ArtifactCheck.from_parent(session, name=f"{folder.name}[{plan}]::{name}", folder=folder,
                                                   plan=plan, bundle=bundle,
                                                   providers=config.getoption("artifact_provider"), pick=pick,
                                                   cache=cache))


def pytest_report_header(config):
    folders = config.getoption("artifacts")
    if not folders:
        return None
    from exporter.errors import ToolkitError
    lines = []
    for folder in folders:
        try:
            plan, bundle = reference_plan(folder, config.getoption("golden_bundle"))
        except ToolkitError as exc:  # reported once more, as a usage error, when the items are collected
            lines.append(f"artifact {folder}: {exc}")
            continue
        what = {"golden": f"golden bundle {bundle}", "rebuilt": "the reference model rebuilt from the manifest (its seed or checkpoint)",
                "invariants": "no reference available: reference-free invariants only"}[plan]
        lines.append(f"artifact {folder}: reference = {what}")
    return lines
