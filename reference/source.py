"""A model to export with the record of where its weights came from: the manifest's `source`, from which the
verification builds the same model again (exporter.verify.references.model_source).

Importing this module imports no torch; building a model imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exporter.artifact.tokenizer import TokenizerSource, checkpoint_tokenizer
from exporter.errors import InputError, is_integer
from reference.families import build_model
from reference.presets import get_preset


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
    from reference.checkpoint_files import fingerprint  # imports torch
    from reference.checkpoints import load_checkpoint

    model, report = load_checkpoint(path, config=get_preset(preset) if preset else None, config_data=config_data)
    source = {
        "kind": "checkpoint",
        "path": str(Path(path).resolve()),
        "sha256": fingerprint(path),
        **{k: v for k, v in report.to_dict().items() if k != "path"},
    }
    tokenizer = checkpoint_tokenizer(path, model.config.vocab_size) if with_tokenizer else None
    return SourcedModel(model, source, tokenizer)
