"""The manifest's `source` record read back (reference.source writes it with the model at export): the artifact's
reference is the model rebuilt from it, a golden bundle, or none.

Importing this module imports no torch: choosing the reference, and replaying a golden bundle, work where only
onnxruntime is installed; rebuilding a model imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exporter.artifact.manifest import Manifest
from exporter.errors import EXPORT_EXTRA, ArtifactError, ToolkitError, export_extra_error

REBUILT_KINDS = ("seeded", "checkpoint")  # the sources whose model the toolkit builds again (reference.source)


@dataclass(frozen=True)
class RebuildProblem:
    """Why an artifact's reference model cannot be rebuilt here."""

    cause: str  # "source" (weights the toolkit does not build), "torch" (it does not import) or "checkpoint"
    source: dict  # the manifest's record
    detail: str = ""  # for "torch" the import error, for "checkpoint" what became of it ("is gone", "changed ...")

    @property
    def reason(self) -> str:
        if self.cause == "torch":
            return "PyTorch, which rebuilding the reference needs, does not import here"
        if self.cause == "checkpoint":
            return f"its checkpoint {self.source.get('path', '')} {self.detail}"
        kind = self.source.get("kind")
        return f"the weights came from {f'a {kind}' if kind else 'an unnamed'} source this toolkit cannot rebuild"

    def error(self, folder) -> ToolkitError:
        """The refusal of `export-onnx verify` and `verify_artifact`, which name a golden bundle as the way out."""
        if self.cause == "torch":
            return ToolkitError(
                f"verifying against the reference model needs PyTorch, which does not import here "
                f"({self.detail}); install the export extra ({EXPORT_EXTRA}), or replay a golden bundle "
                "(`golden`)"
            )
        if self.cause == "checkpoint":
            return ArtifactError(
                f"{folder} was exported from checkpoint {self.source['path']}, which {self.detail}; "
                "restore it, replay a golden bundle recorded from the artifact (`golden`), or re-export"
            )
        return ArtifactError(
            f"{folder} was exported from weights the toolkit cannot rebuild ({self.source}); verify "
            "it against a golden bundle (`golden`), from Python with "
            "verify_artifact(folder, model), or with the invariants alone (pytest --artifacts)"
        )


def rebuild_problem(manifest: Manifest) -> RebuildProblem | None:
    """Why the model the manifest's `source` records cannot be rebuilt here, or None when it can."""
    source = manifest.source
    if source.get("kind") not in REBUILT_KINDS:
        return RebuildProblem("source", source)
    missing = export_extra_error(("torch",))
    if missing is not None:
        return RebuildProblem("torch", source, missing)
    if source["kind"] == "checkpoint":
        from reference.checkpoint_files import checkpoint_change

        change = checkpoint_change(source.get("path", ""), source.get("sha256"))
        if change:
            return RebuildProblem("checkpoint", source, change)
    return None


def rebuild_reference(folder: Path, manifest: Manifest):
    """The reference model (torch.nn.Module) an artifact was exported from: seeded again, or its checkpoint read
    again."""
    problem = rebuild_problem(manifest)
    if problem is not None:
        raise problem.error(folder)
    source = manifest.source
    if source["kind"] == "seeded":
        from reference import build_model

        return build_model(manifest.config, source["seed"])
    from reference.checkpoints import load_checkpoint

    return load_checkpoint(Path(source["path"]), config=manifest.config)[0]


@dataclass(frozen=True)
class Reference:
    """What an artifact is verified against."""

    kind: str  # "rebuilt" (the model, from the manifest's source), "golden" (a bundle replayed) or "none"
    bundle: Path | None = None
    problem: RebuildProblem | None = None  # why the model cannot be rebuilt: for "none", or a bundle standing in

    def model(self, folder: Path, manifest: Manifest):
        """The reference model when it is rebuilt, None for a golden bundle; the problem's error for "none"."""
        if self.kind == "none":
            raise self.problem.error(folder)
        return rebuild_reference(folder, manifest) if self.kind == "rebuilt" else None


def reference_for(manifest: Manifest, golden: Path | None = None, stand_in: Path | None = None) -> Reference:
    """The artifact's reference: the golden bundle given; else the model rebuilt from the manifest's source; else
    the `stand_in` bundle, when its folder is there (one that lacks golden.json is then refused as no readable
    bundle, not passed over in silence); else none, with the problem. A bundle that travels with the artifact
    is `stand_in`, not `golden`: whoever altered the graphs could have recorded it from them."""
    if golden is not None:
        return Reference("golden", Path(golden))
    problem = rebuild_problem(manifest)
    if problem is None:
        return Reference("rebuilt")
    if stand_in is not None and Path(stand_in).exists():
        return Reference("golden", Path(stand_in), problem)
    return Reference("none", problem=problem)
