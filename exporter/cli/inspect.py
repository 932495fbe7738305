"""`export-onnx inspect`: an artifact's contract, files and their state, a damaged folder shown before it exits 2."""

from __future__ import annotations

import sys

import click

from exporter.cli.document import error_document
from exporter.cli.options import common_options, folder_argument
from exporter.cli.outcome import EXIT_INPUT_ERROR, emit, handle_errors, setup_logging


@click.command("inspect")
@folder_argument
@common_options
@handle_errors
def inspect(folder, as_json, quiet, verbose):
    """Show an artifact's I/O contract, file sizes, hashes, the versions that wrote it, and each file's state.

    A damaged folder (a file missing, or not the size or sha256 its manifest lists, a graph without the
    inputs, outputs or opset its manifest lists, or a consumer config giving other ids or sizes than its
    manifest's model config) is shown too, then exits 2; an unreadable manifest is a one-line
    error. FOLDER defaults to artifacts/minimind-3.
    """
    setup_logging(verbose, quiet)
    from exporter.artifact.foreign import foreign_writer, read_foreign

    if foreign_writer(folder) is not None:
        graph = read_foreign(folder)
        shown = graph.to_dict()
        emit(shown, as_json, "\n".join(f"{key}: {value}" for key, value in shown.items()))
        return
    from exporter.artifact.consumers import sidecar_differences
    from exporter.artifact.folder import graph_state
    from exporter.artifact.manifest import (
        LINKED_OUT,
        LINKED_OUT_FIX,
        UNREADABLE,
        file_status,
        load_manifest,
        unchanged_while_read,
    )
    from exporter.cli.export_report import format_inspect

    with unchanged_while_read(folder):  # an export swapping it meanwhile is no damage
        manifest = load_manifest(folder)
        status = file_status(folder, manifest)
        for contract in (manifest.prefill, manifest.decode):
            if status.get(contract.file) == "ok":  # intact bytes, which a re-listed hash does not make the right graph
                status[contract.file] = graph_state(folder / contract.file, manifest, contract)
        for name, differences in sidecar_differences(folder, manifest).items():
            if status.get(name) == "ok":  # intact bytes, which a re-listed hash does not make the model's ids
                status[name] = ", ".join(differences)
    result = {**manifest.to_dict(), "file_status": status}
    damaged = {name: state for name, state in status.items() if state != "ok"}
    if damaged:  # shown all the same: inspect is what a user reaches for when something is wrong
        fix = (
            "let this user read the artifact's files, or re-export the folder"
            if any(state.startswith(UNREADABLE) for state in damaged.values())
            else LINKED_OUT_FIX
            if any(state.startswith(LINKED_OUT) for state in damaged.values())
            else "re-export the folder"
        )
        message = (
            f"{folder} is damaged: " + "; ".join(f"{name}: {state}" for name, state in damaged.items()) + f"; {fix}"
        )
        click.echo(f"error: {message}", err=True)
        result.update(error_document("input", message, EXIT_INPUT_ERROR))
    emit(result, as_json, format_inspect(manifest, str(folder), status))
    if damaged:
        sys.exit(EXIT_INPUT_ERROR)
