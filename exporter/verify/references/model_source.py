"""Where an artifact's weights came from: the manifest's `source` record, written with the model at export and
read back by verification to choose the artifact's reference (the model rebuilt from it, a golden bundle, or none).

Importing this module imports no torch: choosing the reference, and replaying a golden bundle, work where only
onnxruntime is installed; building or rebuilding a model imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exporter.artifact.manifest import Manifest
from exporter.artifact.tokenizer import TokenizerSource, checkpoint_tokenizer
from exporter.errors import EXPORT_EXTRA, ArtifactError, InputError, ToolkitError, export_extra_error

REBUILT_KINDS = ("seeded", "checkpoint")  # the sources whose model the toolkit builds again


@dataclass(frozen=True)
class SourcedModel:
    """A model to export, with the `source` record export_artifact writes into the manifest for it, and the
    tokenizer its checkpoint brings."""

    model: object  # torch.nn.Module
    source: dict
    tokenizer: TokenizerSource | None = None


def seeded_source(preset: str, seed: int) -> dict:
    return {"kind": "seeded", "preset": preset.lower(), "seed": seed}


def seeded_model(preset: str, seed: int = 0) -> SourcedModel:
    """A preset's model with deterministically seeded weights; `export-onnx verify` seeds it again."""
    # imported here: it imports onnxruntime, which choosing a reference does not need
    from exporter.runtime.sessions import is_integer
    from reference import build_model, get_preset

    if not is_integer(seed):  # "x" seeded fine, and the manifest refused it after
        raise InputError(f"seed must be an integer, got {seed!r} ({type(seed).__name__})")
    seed = int(seed)  # a numpy integer is no JSON value for the manifest
    return SourcedModel(build_model(get_preset(preset), seed), seeded_source(preset, seed))


def checkpoint_model(
    path, preset: str | None = None, config_data: dict | None = None, with_tokenizer: bool = False
) -> SourcedModel:
    """A checkpoint's model (see reference.checkpoints.load_checkpoint: `preset` is a config it must fit exactly,
    `config_data` config fields for one that carries none); the record holds its path and fingerprint, so that
    `export-onnx verify` reads it again only while it is unchanged (a GGUF too: verify dequantizes it again),
    and how it was read. `with_tokenizer`: read the tokenizer the checkpoint brings too (checkpoint_tokenizer), a
    folder's files or a GGUF's own, checked against the model's vocabulary."""
    from reference import get_preset
    from reference.checkpoints import fingerprint, load_checkpoint

    model, report = load_checkpoint(path, config=get_preset(preset) if preset else None, config_data=config_data)
    source = {
        "kind": "checkpoint",
        "path": str(Path(path).resolve()),
        "sha256": fingerprint(path),
        **{k: v for k, v in report.to_dict().items() if k != "path"},
    }
    tokenizer = checkpoint_tokenizer(path, model.config.vocab_size) if with_tokenizer else None
    return SourcedModel(model, source, tokenizer)


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
        from reference.checkpoints import checkpoint_change

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
