"""manifest.json: what an artifact folder holds, and the checks that it still holds it."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exporter.artifact.contract import (
    DTYPES,
    CacheLayout,
    GraphContract,
    cache_layout,
    decode_contract,
    prefill_contract,
)
from exporter.artifact.paths import json_type, read_json_bounded
from exporter.artifact.quantization import Quantization
from exporter.errors import ArtifactError
from reference.errors import ConfigError
from reference.families import DecoderConfig, config_from_dict, family_of

MANIFEST = "manifest.json"
FORMAT = "minimind-onnx-artifact"
FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def config_differences(ours: dict, theirs: dict) -> list[str]:
    """The fields in which two model configs, as their to_dict() writes them, differ (sorted); empty: the same
    model. Configs of two families differ in the fields only one of them has."""
    return sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))


def file_entries(folder: Path, names: list[str]) -> dict:
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)} for name in names}


@dataclass(frozen=True)
class Manifest:
    config: DecoderConfig  # of the family recorded as model.family
    source: dict  # where the weights came from, e.g. {"kind": "seeded", "preset": ..., "seed": 0}
    dtype: str
    opset: int
    prefill: GraphContract
    decode: GraphContract
    cache: CacheLayout
    weights_file: str
    initializers: dict  # graph file -> [{"name", "offset", "length", "dtype", "shape"}] in weights_file
    versions: dict
    files: dict  # name -> {"bytes", "sha256"}
    # weight-only quantization (MatMulNBits); None: a float artifact, as every manifest written before the field
    quantization: Quantization | None = None

    @property
    def precision(self) -> str:
        """What the artifact holds its weights in: the quantization scheme ("int4", "int8"), else the dtype."""
        return self.quantization.scheme if self.quantization is not None else self.dtype

    @property
    def family(self) -> str:
        return family_of(self.config).name

    @property
    def with_loss(self) -> bool:
        return "loss" in self.prefill.output_names

    @property
    def is_moe(self) -> bool:
        """A mixture of experts: its graphs carry routers (families without MoE have no use_moe)."""
        return getattr(self.config, "use_moe", False) is True

    def contract(self, graph: str) -> GraphContract:
        """The contract of the graph named "prefill" or "decode"."""
        return {"prefill": self.prefill, "decode": self.decode}[graph]

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": {"family": self.family, "config": self.config.to_dict(), "source": self.source},
            "dtype": self.dtype,
            "opset": self.opset,
            "graphs": {"prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()},
            "cache": self.cache.to_dict(),
            "weights": {"file": self.weights_file, "initializers": self.initializers},
            "versions": self.versions,
            "files": self.files,
            # written only when set: a float artifact's manifest is what readers before the field read
            **({"quantization": self.quantization.to_dict()} if self.quantization is not None else {}),
        }

    def write(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"manifest format is {data.get('format')!r} v{data.get('format_version')}, "
                f"expected {FORMAT!r} v{FORMAT_VERSION}; re-export the folder with this toolkit"
            )
        return cls(
            config=config_from_dict(data["model"]["family"], data["model"]["config"]),
            source=data["model"]["source"],
            dtype=data["dtype"],
            opset=data["opset"],
            prefill=GraphContract.from_dict(data["graphs"]["prefill"]),
            decode=GraphContract.from_dict(data["graphs"]["decode"]),
            cache=CacheLayout.from_dict(data["cache"]),
            weights_file=data["weights"]["file"],
            initializers=data["weights"]["initializers"],
            versions=data["versions"],
            files=data["files"],
            quantization=None if data.get("quantization") is None else Quantization.from_dict(data["quantization"]),
        )


def _inconsistency(manifest: Manifest) -> str | None:
    """What in a parsed manifest cannot be right (an edit by hand, a damaged file), or None."""
    if manifest.dtype not in DTYPES:
        return f"dtype {manifest.dtype!r} is none of {', '.join(DTYPES)}"
    problem = manifest.quantization.problem() if manifest.quantization is not None else None
    if problem:
        return problem
    config, dtype = manifest.config, manifest.dtype
    expected = (
        prefill_contract(config, dtype, manifest.with_loss),
        decode_contract(config, dtype),
        cache_layout(config, dtype),
    )
    if expected != (manifest.prefill, manifest.decode, manifest.cache):
        return "its graphs' inputs, outputs or cache layout do not follow from its model config"
    problem = source_problem(manifest.source)
    if problem:
        return problem
    if not isinstance(manifest.versions, dict):
        return "versions is not an object"
    if not isinstance(manifest.files, dict):
        return "files is not an object of file names"
    for name, entry in manifest.files.items():
        if Path(name).name != name or name in (".", ".."):
            return f"file {name!r} lies outside the folder"
        if not (isinstance(entry, dict) and _is(entry.get("sha256"), str) and _is(entry.get("bytes"), int)):
            return f"file {name!r} has no sha256 or size"
    if not _is(manifest.weights_file, str):
        return f"weights.file is {manifest.weights_file!r}, not a file name"
    unlisted = [
        f for f in (manifest.prefill.file, manifest.decode.file, manifest.weights_file) if f not in manifest.files
    ]
    if unlisted:
        return f"{', '.join(unlisted)} not listed in files"
    return _initializer_problem(manifest)


def source_problem(source) -> str | None:
    """What makes `source` no model.source a manifest reader accepts, or None: the reader's rule, which the
    export applies to the source it is given."""
    if not isinstance(source, dict):
        return f"model.source is a {type(source).__name__}, not an object"
    if not _is(source.get("kind"), str):  # what verify reads first, to know whether it can rebuild the model
        return f"model.source.kind is {source.get('kind')!r}, expected str"
    required = {"seeded": {"preset": str, "seed": int}, "checkpoint": {"path": str, "sha256": str}}
    for key, kind in required.get(source.get("kind"), {}).items():
        if not _is(source.get(key), kind):
            return f"model.source.{key} is {source.get(key)!r}, expected {kind.__name__}"
    return None


def _is(value, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _initializer_problem(manifest: Manifest) -> str | None:
    """Each graph's table of weights must lie within the weights file, each entry the size of its shape."""
    tables = manifest.initializers
    graphs = {manifest.prefill.file, manifest.decode.file}
    if not isinstance(tables, dict) or set(tables) != graphs or not all(isinstance(t, list) for t in tables.values()):
        return f"weights.initializers must list the weights of {' and '.join(sorted(graphs))}"
    size = manifest.files[manifest.weights_file]["bytes"]
    for graph, table in tables.items():
        for entry in table:
            try:
                ok = (
                    _is(entry["name"], str)
                    and _is(entry["offset"], int)
                    and _is(entry["length"], int)
                    and all(_is(d, int) and d >= 0 for d in entry["shape"])
                    and math.prod(entry["shape"]) * np.dtype(entry["dtype"]).itemsize == entry["length"]
                    and 0 <= entry["offset"] <= size - entry["length"]
                )
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                return f"weights.initializers of {graph}: {str(entry)[:80]} does not lie within {manifest.weights_file}"
    return None


def listed_files(folder: Path) -> set[str] | None:
    """The names an artifact folder's manifest accounts for, or None when its manifest.json is not ours."""
    try:
        data = read_json_bounded(folder / MANIFEST)
        if data.get("format") == FORMAT and isinstance(data.get("files"), dict):
            return {MANIFEST, *data["files"]}
    except (OSError, ValueError, AttributeError, RecursionError):  # RecursionError: JSON nested too deep
        pass
    return None


def load_manifest(folder: Path) -> Manifest:
    """Load folder/manifest.json and check that it is consistent, not yet the files it lists."""
    if not isinstance(folder, (str, os.PathLike)):  # Path(None) raised pathlib's TypeError
        raise ArtifactError(f"an artifact folder is a path (str or Path), got {folder!r:.80}")
    folder = Path(folder)
    if not folder.is_dir():
        found = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ArtifactError(
            f"{folder} {found}; pass an artifact folder written by 'export-onnx export'{_moved_aside_hint(folder)}"
        )
    path = folder / MANIFEST
    if not path.is_file():
        raise ArtifactError(
            f"{folder} has no {MANIFEST}; it is not an artifact folder (export one with 'export-onnx export')"
            + _moved_aside_hint(folder)
        )
    try:
        data = read_json_bounded(path)  # JSON is UTF-8 whatever the locale; a stray byte is damage
    except OSError as exc:  # unreadable to this user: the artifact's files to fix (exit 2), not an internal error
        raise ArtifactError(
            f"{path} cannot be read ({exc.strerror or exc}); let this user read the artifact's "
            "files, or re-export the folder"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise ArtifactError(f"{path} is unreadable ({type(exc).__name__}: {exc}); re-export the folder") from None
    try:
        manifest = Manifest.from_dict(data) if isinstance(data, dict) else None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError, ConfigError) as exc:
        detail = f"no field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise ArtifactError(f"{path} is unreadable ({detail}); re-export the folder") from None
    if manifest is None:
        raise ArtifactError(f"{path} is unreadable (a JSON {json_type(data)}, not an object); re-export the folder")
    problem = _inconsistency(manifest)
    if problem:
        raise ArtifactError(f"{path} is inconsistent: {problem}; re-export the folder")
    return manifest


def _moved_aside_hint(folder: Path) -> str:
    """Where an export killed in its swap (between moving the earlier artifact aside, into the hidden sibling
    .NAME.old-*, and moving the new one in) left the artifact that was at `folder`, as a message's last clause;
    '' when no such folder is there."""
    try:
        pattern = f".{glob.escape(folder.name)}.old-*/{glob.escape(folder.name)}/{MANIFEST}"
        found = sorted(folder.parent.glob(pattern))
    except (OSError, ValueError):  # a parent this user may not read; a path without a name
        found = []
    if not found or not folder.name:
        return ""
    aside = found[-1].parent
    return (
        f"; an export stopped while swapping it left the earlier artifact in {aside}: move it back to {folder}, "
        "or export there again, which puts it back first"
    )


def read_manifest(folder: Path, check_hashes: bool = True) -> Manifest:
    """Load folder/manifest.json and check that every file it lists is there with its listed size and, unless
    check_hashes is False, its listed sha256."""
    manifest = load_manifest(folder)
    folder = Path(folder)
    status = file_status(folder, manifest, hashes=False)  # a truncated copy is found before the hashing reads it
    missing = [name for name, state in status.items() if state == "missing"]
    if missing:
        raise ArtifactError(
            f"{folder} lacks {len(missing)} file(s) its manifest lists: {', '.join(missing)}; re-export the folder"
        )
    linked = [f"{name} is {state}" for name, state in status.items() if state.startswith(LINKED_OUT)]
    if linked:
        raise ArtifactError(f"{folder}: {'; '.join(linked)}; {LINKED_OUT_FIX}")
    resized = [f"{name} is {state}" for name, state in status.items() if state != "ok"]
    if resized:
        raise ArtifactError(f"{folder}: {'; '.join(resized)} (truncated or modified); re-export the folder")
    if check_hashes:
        status = file_status(folder, manifest)
        unreadable = [
            f"{name} cannot be read {state.removeprefix(UNREADABLE + ' ')}"
            for name, state in status.items()
            if state.startswith(UNREADABLE)
        ]
        if unreadable:  # the artifact's files to fix (exit 2), not an internal error
            raise ArtifactError(
                f"{folder}: {'; '.join(unreadable)}; let this user read the artifact's files, or re-export the folder"
            )
        changed = [name for name, state in status.items() if state != "ok"]
        if changed:
            raise ArtifactError(
                f"{folder}: sha256 of {', '.join(changed)} does not match the manifest "
                "(file modified or corrupted); re-export the folder"
            )
    return manifest


@contextlib.contextmanager
def unchanged_while_read(folder):
    """The block reads the artifact folder `folder` file by file. An export into it meanwhile swaps a new folder in
    whole (exporter.artifact.destination builds it aside and renames it into place), so the block may have read some
    files of each, which read as a damaged artifact or as one that fails verification. ArtifactError saying so
    when `folder` is no longer the folder it was when the block began: on leaving the block, or when the block
    failed (a file missing between the swap's two renames is then the swap's doing, not damage)."""
    before = _folder_identity(folder)
    try:
        yield
    except Exception as exc:
        if _folder_identity(folder) != before:
            raise _replaced(folder) from exc
        raise
    if _folder_identity(folder) != before:
        raise _replaced(folder)


def _folder_identity(folder) -> tuple | None:
    """The folder at `folder` now: a swapped-in folder is another inode, and one that reuses a removed folder's inode
    has another ctime (a rename sets it too). None when there is none (or no path)."""
    try:
        stat = os.stat(folder)
    except (OSError, TypeError, ValueError):
        return None
    return stat.st_dev, stat.st_ino, stat.st_ctime_ns


def _inside(path: Path, folder) -> bool:
    """Whether `path`, through its links, lies inside `folder` (itself resolved)."""
    try:
        return Path(folder).resolve() in path.resolve().parents
    except (OSError, RuntimeError):  # a loop of links: is_file said it is a file, so it cannot be one
        return False


def _replaced(folder) -> ArtifactError:
    return ArtifactError(
        f"{folder} was replaced while it was read (an export into it meanwhile?), so what was read "
        "may mix the files of two artifacts; run again once the export is done"
    )


UNREADABLE = "unreadable"
LINKED_OUT = "a link out of the folder"
# What to do about a weights file LINKED_OUT.
LINKED_OUT_FIX = "copy the file into the folder in place of the link (cp --remove-destination TARGET LINK)"


def file_status(folder: Path, manifest: Manifest, hashes: bool = True) -> dict:
    """Each listed file's state, by name: "ok", "missing", "N bytes, not M" (not read further), for the weights
    file "a link out of the folder (to T), ..." or, with hashes, "sha256 differs" or "unreadable (why)"; what
    inspect shows of a damaged folder, and what read_manifest refuses."""
    status = {}
    for name, entry in manifest.files.items():
        path = Path(folder) / name
        if not path.is_file():
            status[name] = "missing"
        elif name == manifest.weights_file and not _inside(path, folder):
            # onnxruntime reads a graph's external data only from within the graph's folder (through links too)
            status[name] = f"{LINKED_OUT} (to {path.resolve()}), where onnxruntime refuses to read weights"
        elif path.stat().st_size != entry["bytes"]:
            status[name] = f"{path.stat().st_size} bytes, not {entry['bytes']}"
        elif not hashes:
            status[name] = "ok"
        else:
            try:
                status[name] = "ok" if sha256_file(path) == entry["sha256"] else "sha256 differs"
            except OSError as exc:  # shown, as a damaged file is: inspect exits 2 naming it
                status[name] = f"{UNREADABLE} ({exc.strerror or exc})"
    return status
