"""Making ONNX Runtime sessions on graphs: an artifact's own, read checked against its manifest before onnxruntime
loads them, a modified copy of one, or a graph file outside any artifact; the optimised graphs saved whole or not
at all, and onnxruntime's refusals named. `exporter.runtime.runner` runs the sessions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as _ort_errors

from exporter.artifact.contract import GraphContract
from exporter.artifact.folder import Artifact
from exporter.artifact.paths import (
    TEXT_PATH_FIX,
    check_text_path,
    folder_lock,
    parents_removed_unless_done,
    uninterrupted,
)
from exporter.errors import ArtifactError, OutputPathError, first_line
from exporter.runtime.providers import check_provider, session_providers
from exporter.runtime.settings import SessionSettings, session_options
from exporter.runtime.shared_weights import SharedWeightMap


def graph_session(
    model: bytes,
    folder: Path,
    graph_file: str,
    weights: SharedWeightMap,
    provider: str,
    settings: SessionSettings = SessionSettings(),
) -> ort.InferenceSession:
    """A session on a modified copy of one of an artifact's graphs, with this process's thread-pool rules.

    Args:
        model: the modified graph, serialised (e.g. a debug copy).
        folder: the artifact's folder, where the weights `weights` does not hold are read from.
        graph_file: the file name of the graph the copy was made from, whose initializers `weights` holds.
        weights: the artifact's shared weight mapping, used where onnxruntime takes the weights in place.
        provider: the provider to run on, checked (check_provider).
        settings: the session settings.
    """
    check_text_path(folder, "artifact folder", TEXT_PATH_FIX, ArtifactError)
    options = session_options(settings, graph_file, weights)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return _new_session(model, options, session_providers(check_provider(provider)))


def file_session(path: Path, provider: str, settings: SessionSettings = SessionSettings()) -> ort.InferenceSession:
    """A session on a graph file outside any artifact (a folder another exporter wrote), with this process's
    thread-pool rules; its weights are read by onnxruntime from beside it.

    Raises:
        ArtifactError: onnxruntime cannot load the graph.
        ProviderError: the provider is unknown or not available.
    """
    check_text_path(path.parent, "graph folder", TEXT_PATH_FIX, ArtifactError)
    options = session_options(settings, path.name, None, prepack=settings.prepack_weights)
    try:
        return _new_session(str(path), options, session_providers(check_provider(provider)))
    except _LOAD_ERRORS as exc:
        raise load_failure(path, exc) from None


@contextlib.contextmanager
def optimized_graphs_saved(folder: Path | None):
    """Yields the hidden folder in `folder` where the sessions made in the block save their optimised graphs (pass
    it to load_session), or None without `folder`. Its files (graphs and weights files) are moved into `folder`
    only once the block has made every session: a full disk, an interrupt, or a second graph that cannot be saved
    after the first was, leaves the files an earlier save wrote, never a truncated graph nor one graph of a new
    pair beside the other of an earlier one."""
    if folder is None:
        yield None
        return
    with parents_removed_unless_done(folder / "graph"):  # the folders made for the save (`folder` too), when it fails
        try:
            folder.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".optimized.partial-", dir=folder))
        except OSError as exc:
            raise _save_failed("graphs", folder, exc.strerror or str(exc)) from None
        try:
            yield staging
            try:
                # a Ctrl-C between moves would leave new weights beside an earlier graph; a second save into
                # `folder` moving its files meanwhile, one graph of each (its turn is waited for with Ctrl-C live)
                with folder_lock(folder), uninterrupted():
                    # the weights files before the graphs that name them
                    for name in sorted(os.listdir(staging), key=lambda name: (name.endswith(".onnx"), name)):
                        os.replace(staging / name, folder / name)
            except OSError as exc:
                raise _save_failed("graphs", folder, exc.strerror or str(exc)) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _new_session(
    model, options: ort.SessionOptions, providers: list, staging: Path | None = None
) -> ort.InferenceSession:
    """A session; where `options` asks for the optimised graph to be saved, onnxruntime writes it into `staging`
    (made by optimized_graphs_saved, which moves it into place), and a save that fails is named as such, not as a
    damaged artifact."""
    target = options.optimized_model_filepath and Path(options.optimized_model_filepath)
    if not target:
        return ort.InferenceSession(model, options, providers=providers, enable_fallback=0)
    options.optimized_model_filepath = str(staging / target.name)
    try:
        return ort.InferenceSession(model, options, providers=providers, enable_fallback=0)
    except _LOAD_ERRORS as exc:
        options.optimized_model_filepath = ""
        try:  # does it load without the save? Then the save failed, not the graph
            ort.InferenceSession(model, options, providers=providers, enable_fallback=0)
        except _LOAD_ERRORS:
            raise exc from None
        raise _save_failed(f"graph {target.name}", target.parent, first_line(exc, 200)) from None


def _save_failed(what: str, folder: Path, reason: str) -> OutputPathError:
    return OutputPathError(
        f"cannot save the optimised {what} in {folder} ({reason}); earlier "
        "files there are untouched: free space, or choose another folder (`optimized_model_dir`)"
    )


# UnicodeDecodeError: onnxruntime's refusal of a graph whose damaged bytes are a name it quotes, which the binding
# cannot turn into a str (a flipped byte in decode.onnx, say).
_LOAD_ERRORS = (
    _ort_errors.Fail,
    _ort_errors.InvalidArgument,
    _ort_errors.NoSuchFile,
    _ort_errors.InvalidProtobuf,
    _ort_errors.InvalidGraph,
    UnicodeDecodeError,
)


def load_session(
    artifact: Artifact,
    contract: GraphContract,
    options: ort.SessionOptions,
    providers: list[str],
    staging: Path | None = None,
) -> ort.InferenceSession:
    """A session on one of the artifact's graphs, which must be the graph its manifest describes.

    Args:
        artifact: the artifact holding the graph.
        contract: the manifest's description of the graph, checked against the file before onnxruntime reads it.
        options: the session options (session_options).
        providers: the session's providers list (session_providers).
        staging: where the optimised graph that `options` asks for is saved first (optimized_graphs_saved).

    Raises:
        ArtifactError: the graph is not the one the manifest describes, or onnxruntime cannot load it (or take
            the folder's path).
        OutputPathError: the optimised graph cannot be saved.
    """
    check_text_path(artifact.folder, "artifact folder", TEXT_PATH_FIX, ArtifactError)
    artifact.graph(contract)  # onnxruntime names neither a missing input nor another opset
    path = artifact.path(contract.file)
    try:
        return _new_session(str(path), options, providers, staging)
    except _LOAD_ERRORS as exc:
        raise load_failure(path, exc) from None


def load_failure(path: Path, exc: Exception) -> ArtifactError:
    """onnxruntime's refusal to load one of the artifact's graphs."""
    return ArtifactError(f"onnxruntime cannot load {path} ({first_line(exc, 200)}); re-export the folder")
