"""`export-onnx export`: a preset or a checkpoint exported to an artifact folder."""

from __future__ import annotations

import click

from exporter.cli.exporting import export_as_asked
from exporter.cli.options import ExportOptions, common_options, export_options, quality_target_options
from exporter.cli.outcome import emit, handle_errors, setup_logging


@click.command("export")
@export_options
@quality_target_options
@common_options
@handle_errors
def export(to_export: ExportOptions, quality_target, calibration_text, as_json, quiet, verbose):
    """Export prefill.onnx, decode.onnx, one shared weights file, manifest.json, and the configs that let
    onnxruntime-genai and Optimum load the folder as it is."""
    setup_logging(verbose, quiet)
    from exporter.cli.export_report import format_export

    _, exported = export_as_asked(to_export, (quality_target, calibration_text))
    emit(exported.to_dict(), as_json, format_export(exported))
