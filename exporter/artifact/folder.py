"""An artifact folder opened once: its manifest read and checked, each listed file's size and sha256 checked once,
each graph (without its weights) parsed once and held to the manifest.

Everything that works on an artifact (the runner, the verification engine, onnxruntime-genai) takes an `Artifact`
and asks it for paths, the manifest and graphs, rather than reading the folder again by path.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from exporter.artifact.contract import GraphContract
from exporter.artifact.manifest import Manifest, read_manifest
from exporter.artifact.paths import outside_folder
from exporter.errors import ArtifactError, InputError, first_line


class Artifact:
    """An artifact folder and its manifest, read once.

    Build one with `Artifact.open(folder)` (reads manifest.json and checks every listed file), or, where the
    manifest was just written and the files are known to be what it lists (the export's own smoke run), with
    `Artifact(folder, manifest)`.
    """

    def __init__(self, folder: Path, manifest: Manifest):
        self.folder = Path(folder)
        self.manifest = manifest
        self._graphs: dict[str, onnx.ModelProto] = {}

    @classmethod
    def open(cls, folder: Path, check_hashes: bool = True) -> Artifact:
        """Read folder/manifest.json and check that every file it lists is there with its listed size and, unless
        check_hashes is False, its listed sha256 (ArtifactError, in one line, otherwise)."""
        return cls(Path(folder), read_manifest(folder, check_hashes=check_hashes))

    def __repr__(self) -> str:
        return f"Artifact({str(self.folder)!r})"

    def path(self, name: str) -> Path:
        """The path of one of the artifact's files."""
        return self.folder / name

    def graph(self, contract: GraphContract) -> onnx.ModelProto:
        """A copy of one of the artifact's graphs without its weights, checked against the manifest: it parses,
        takes and gives the values the contract names, and imports the manifest's opset. The file is parsed once;
        each call returns a copy that the caller may edit (add outputs, say)."""
        if contract.file not in self._graphs:
            path = self.path(contract.file)
            model, problem = _checked_graph(path, self.manifest, contract)
            if problem:
                raise ArtifactError(f"{path} {problem}; re-export the folder")
            self._graphs[contract.file] = model
        copy = onnx.ModelProto()
        copy.CopyFrom(self._graphs[contract.file])
        return copy


def open_artifact(artifact, check_hashes: bool = True) -> Artifact:
    """`artifact` as an Artifact: itself when it is one, else the folder at that path opened (Artifact.open).

    Args:
        artifact: an Artifact, or an artifact folder's path (str or os.PathLike).
        check_hashes: check each file's sha256 when opening a path.

    Raises:
        InputError: `artifact` is neither.
        ArtifactError: the folder is no artifact, or a file differs from its manifest.
    """
    if isinstance(artifact, Artifact):
        return artifact
    if not isinstance(artifact, (str, os.PathLike)):
        raise InputError(f"an artifact is an Artifact or an artifact folder's path (str or Path), got {artifact!r:.80}")
    return Artifact.open(artifact, check_hashes=check_hashes)


def _listed(names: list) -> str:
    return "[" + ", ".join(str(name) for name in names[:4]) + (", ...]" if len(names) > 4 else "]")


def graph_state(path: Path, manifest: Manifest, contract: GraphContract) -> str:
    """What inspect shows of a graph: "ok", or how it is not the graph its manifest describes."""
    return _checked_graph(path, manifest, contract)[1] or "ok"


def external_data_outside(model: onnx.ModelProto, folder: Path) -> str | None:
    """The first location of external data that `model` names outside `folder` (where it lies), or None: onnx would
    read any file such a graph names. By the name alone: a file named inside that is a link out is the file checks'
    to report (file_status)."""
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((entry.value for entry in tensor.external_data if entry.key == "location"), "")
            if outside_folder(folder, location, through_links=False):
                return location
    return None


def _checked_graph(
    path: Path, manifest: Manifest, contract: GraphContract
) -> tuple[onnx.ModelProto | None, str | None]:
    try:
        model = onnx.load(str(path), load_external_data=False)
    except DecodeError as exc:
        return None, f"is no ONNX model ({first_line(exc, 200)})"
    outside = external_data_outside(model, path.parent)
    if outside is not None:
        return model, f"names weights outside the folder ({outside})"
    initializers = {tensor.name for tensor in model.graph.initializer}
    inputs = [value.name for value in model.graph.input if value.name not in initializers]
    outputs = [value.name for value in model.graph.output]
    for kind, found, listed in (("inputs", inputs, contract.input_names), ("outputs", outputs, contract.output_names)):
        if sorted(found) != sorted(listed):
            return model, f"has the {kind} {_listed(found)}, its manifest lists {_listed(listed)}"
    opsets = [entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")]
    if opsets != [manifest.opset]:
        return model, f"imports the opset {_listed(opsets)}, its manifest says {manifest.opset}"
    return model, None
