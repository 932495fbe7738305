"""`export-onnx run`, the default command: export, then verify the artifact against the model just exported."""

from __future__ import annotations

import click

from exporter.cli.exporting import export_as_asked, export_folder, planned_artifact
from exporter.cli.options import (
    ExportOptions,
    VerifyOptions,
    common_options,
    export_options,
    genai_option,
    provider_option,
    transformers_js_option,
    verify_options,
)
from exporter.cli.outcome import handle_errors, setup_logging
from exporter.cli.verification import finish_verification, run_verification, verification_plan


@click.command("run")
@export_options
@provider_option
@genai_option
@transformers_js_option
@verify_options
@common_options
@handle_errors
def run(to_export: ExportOptions, providers, runtimes, genai, transformers_js, as_json, quiet, verbose, **options):
    """Export a preset or a checkpoint, then verify the artifact against the reference (the default command)."""
    setup_logging(verbose, quiet)
    options = VerifyOptions(**options)
    from exporter.cli.export_report import format_export
    from exporter.verify.reports import format_verify

    # a bad verification option must not cost an export
    plan = verification_plan(
        export_folder(to_export),
        providers,
        runtimes,
        genai,
        options,
        planned=planned_artifact(to_export.preset, to_export.seed, to_export.checkpoint, to_export.dtype),
    )
    model, exported = export_as_asked(to_export)
    report = run_verification(
        exported.folder, providers, runtimes, genai, options, plan, model, transformers_js=transformers_js
    )
    finish_verification(
        report,
        options,
        {"export": exported.to_dict(), "verify": report.to_dict()},
        as_json,
        format_export(exported) + "\n\n" + format_verify(report),
    )
