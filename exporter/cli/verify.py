"""`export-onnx verify`: an artifact verified against its reference (the model rebuilt from its manifest, a golden
bundle, or for a folder another exporter wrote, transformers' model of --reference)."""

from __future__ import annotations

import click

from exporter.cli.options import (
    PathOption,
    VerifyOptions,
    common_options,
    folder_argument,
    genai_option,
    provider_option,
    transformers_js_option,
    verify_options,
)
from exporter.cli.outcome import handle_errors, setup_logging
from exporter.cli.verification import finish_verification, run_verification, verification_plan
from exporter.errors import InputError


@click.command("verify")
@folder_argument
@provider_option
@genai_option
@transformers_js_option
@verify_options
@click.option(
    "--golden",
    type=PathOption(),
    default=None,
    metavar="DIR",
    help="Compare with a golden bundle instead of the PyTorch model (needs no torch), judged with "
    "the tolerance overrides it was recorded with; --atol, --rtol, --peak and --tolerances "
    "replace its terms one by one.",
)
@click.option(
    "--reference",
    type=PathOption(),
    default=None,
    metavar="HF_FOLDER",
    help="For a folder Optimum or onnxruntime-genai's builder wrote: the Hugging Face folder it was exported "
    "from, whose model transformers loads as the reference.",
)
@click.option(
    "--quality-text",
    type=PathOption(),
    default=None,
    metavar="FILE",
    help="For a quantized artifact: a UTF-8 text file, tokenized with the artifact's tokenizer.json, which the "
    "quality check reads whole in place of seeded random ids: as many windows as cover it (each a prompt and the "
    "decode steps' continuation; the greedy prompt is its start). The report states the positions read and the "
    "time; a figure whose confidence interval straddles its limit is undecided (exit 1) until a longer text "
    "decides it.",
)
@common_options
@handle_errors
def verify(
    folder,
    providers,
    runtimes,
    genai,
    transformers_js,
    golden,
    reference,
    quality_text,
    as_json,
    quiet,
    verbose,
    **options,
):
    """Verify an artifact FOLDER: against the PyTorch reference (prefill, a 64-step decode error curve,
    greedy tokens, the shape sweep), with reference-free invariants, fp16 health, a repeat run,
    providers against each other, and the greedy tokens of onnxruntime-genai and transformers.js on the folder
    as it is.

    The reference is rebuilt from the manifest (the config with the weight seed, or the checkpoint file it
    was exported from, which must be unchanged), or replayed from a golden bundle (--golden). Exits 1 when
    any check fails, 2 on bad input (e.g. a bundle of another artifact). FOLDER defaults to
    artifacts/minimind-3.
    """
    setup_logging(verbose, quiet)
    from exporter.artifact.foreign import foreign_writer
    from exporter.verify.reports import format_verify

    options = VerifyOptions(**options)
    writer = foreign_writer(folder)
    if writer is not None or reference is not None:
        consumers = {"--genai": genai, "--transformers-js": transformers_js}
        _verify_foreign(
            folder, writer, reference, providers, runtimes, consumers, golden, quality_text, options, as_json
        )
        return
    if golden is not None:
        context = click.get_current_context()
        flags = {"decode_steps": "--decode-steps", "sweep": "--sweep/--no-sweep", "golden_save": "--golden-save"}
        given = [
            flag
            for name, flag in flags.items()
            if context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
        ]
        if given:
            raise click.UsageError(
                f"--golden replays the checks recorded in the bundle, with its settings; drop {', '.join(given)}"
            )
    plan = verification_plan(folder, providers, runtimes, genai, options, golden, quality_text=quality_text)
    report = run_verification(
        folder, providers, runtimes, genai, options, plan, golden=golden, transformers_js=transformers_js
    )
    finish_verification(report, options, report.to_dict(), as_json, format_verify(report))


def _verify_foreign(
    folder, writer, reference, providers, runtimes, consumers, golden, quality_text, options, as_json
) -> None:
    """verify of a folder another exporter wrote, against transformers' model of --reference; `consumers`: the
    consumer checks' flags ({"--genai": value}), which such a folder cannot serve."""
    from exporter.runtime.registry import DEFAULT_RUNTIME
    from exporter.verify.foreign import verify_foreign
    from exporter.verify.reports import format_verify

    if writer is None:
        raise click.UsageError(
            f"--reference is for a folder Optimum or onnxruntime-genai's builder wrote; {folder} is none "
            "(an artifact of this toolkit rebuilds its reference from its manifest): drop --reference"
        )
    if reference is None:
        raise InputError(
            f"{folder} was written by {writer}, not by this toolkit: pass --reference HF_FOLDER, the Hugging Face "
            "folder it was exported from"
        )
    given = [
        flag
        for flag, value in (
            ("--golden", golden),
            ("--golden-save", options.golden_save),
            ("--fp16-companion", options.fp16_companion),
            *consumers.items(),
            ("--runtime", [name for name in runtimes if name != DEFAULT_RUNTIME]),
        )
        if value
    ]
    if given:
        raise click.UsageError(f"{', '.join(given)} cannot serve a folder {writer} wrote; drop it")
    overrides, settings, *_ = verification_plan(folder, providers, (), None, options)
    report = verify_foreign(folder, reference, list(providers) or None, settings, overrides, quality_text)
    finish_verification(report, options, report.to_dict(), as_json, format_verify(report))
