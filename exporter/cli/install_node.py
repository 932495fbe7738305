"""`export-onnx install-node`: the Node runtimes' npm packages, installed at the pinned versions."""

from __future__ import annotations

import click

from exporter.cli.options import PathOption, common_options
from exporter.cli.outcome import emit, handle_errors, setup_logging


@click.command("install-node")
@click.option(
    "--folder",
    type=PathOption(),
    default=None,
    help="Where to install them [default: $EXPORT_ONNX_NPM, else ~/.cache/export-onnx/npm, where the Node "
    "runtimes look for them].",
)
@common_options
@handle_errors
def install_node(folder, as_json, quiet, verbose):
    """Install the npm packages of the Node runtimes (onnxruntime-web, onnxruntime-node, transformers.js) at the
    versions this toolkit pins, from the npm registry, running none of their install scripts. Needs node and npm
    (Debian: apt-get install nodejs npm); does nothing when they are installed already.
    """
    setup_logging(verbose, quiet)
    from exporter.runtime.node import NODE_PACKAGES, install_node_packages

    installed = install_node_packages(folder)
    shown = ", ".join(f"{name} {version}" for name, version in NODE_PACKAGES.items())
    emit({"folder": str(installed), "packages": NODE_PACKAGES}, as_json, f"{shown} in {installed}")
