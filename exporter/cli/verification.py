"""The verification as `verify` and `run` ask for it: its options checked before anything runs
(verification_plan), the engine run with them (run_verification), and the reports and exit once the verdict is in
(finish_verification)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from exporter.artifact.paths import TEXT_PATH_FIX, check_output_path, check_outside_artifact, check_text_path
from exporter.cli import outcome
from exporter.cli.options import REPORT_PARAMETERS, VerifyOptions
from exporter.errors import ArtifactError, ConsumerError, ToolkitError


def verification_plan(
    folder: Path,
    providers,
    runtimes,
    genai: bool | None,
    options: VerifyOptions,
    golden: Path | None = None,
    planned: tuple | None = None,
    quality_text: Path | None = None,
):
    """The verification's options, each checked before anything runs (for `run`, before the export).

    Args:
        folder: the artifact folder to verify, which no report path may lie inside.
        providers: the --provider names (possibly none: every available one).
        runtimes: the --runtime names (possibly none: onnxruntime), each installed.
        genai: --genai/--no-genai, or None when neither is given; True needs onnxruntime-genai installed.
        options: the verification's options as click passed them.
        golden: the --golden bundle folder, which no report may be written into.
        planned: for `run`, the (dtype, config, source) of the artifact about to be exported
            (planned_artifact in exporter/cli/exporting.py), which --fp16-companion is held to before the export
            (the engine checks it again after); None: the companion is only read here.
        quality_text: verify's --quality-text file, read here with the artifact's tokenizer (the artifact's
            manifest read without its hashes, which the verification checks), so that a refusal writes nothing.

    Returns:
        (overrides, settings, companion, text): the tolerance overrides, the ParitySettings, the companion read
        (or None) and the QualityText of --quality-text (or None), as run_verification takes them.
    """
    from exporter.runtime.genai import INSTALL_HINT, genai_version
    from exporter.runtime.providers import check_parity_providers
    from exporter.runtime.registry import select_runtimes
    from exporter.tolerances.parity import parse_overrides
    from exporter.verify.checks.providers import companion_for, read_companion
    from exporter.verify.inputs import ParitySettings
    from exporter.verify.references.golden.writing import check_golden_destination
    from exporter.verify.reports import check_report_destination

    if len(options.tolerance_files) > 1:
        raise ToolkitError(
            f"--tolerances given {len(options.tolerance_files)} times; give one file (it may hold every kind)"
        )
    if planned is None:  # read by onnxruntime only after the reference is built; `run` refuses its --output itself
        check_text_path(folder, "artifact folder", TEXT_PATH_FIX)
    if options.fp16_companion is not None:
        check_text_path(options.fp16_companion, "--fp16-companion", TEXT_PATH_FIX)
    tolerance_file = options.tolerance_files[0] if options.tolerance_files else None
    overrides = parse_overrides(options.atol, options.rtol, options.peak, tolerance_file)
    settings = ParitySettings(
        decode_steps=options.decode_steps, sweep=options.sweep, long_context=options.long_context, probe=options.probe
    )
    check_parity_providers(providers)
    select_runtimes(list(runtimes) or None, providers)
    if genai and genai_version() is None:
        raise ConsumerError(f"--genai asks for the onnxruntime-genai check, but it is not installed ({INSTALL_HINT})")
    bundles = {
        Path(path).resolve(): flag
        for path, flag in ((options.golden_save, "--golden-save"), (golden, "--golden"))
        if path is not None
    }
    written: dict[Path, str] = {}  # each report path -> its flag
    if tolerance_file is not None:  # read, never written: a JSON report would replace it unasked
        written[Path(tolerance_file).resolve()] = "--tolerances"
    for option in ("report_json", "junit", "html", "golden_save"):
        path, flag = getattr(options, option), "--" + option.replace("_", "-")
        if path is None:
            continue
        resolved = Path(path).resolve()
        if resolved in written:
            raise ToolkitError(f"{flag} {path} is also the path of {written[resolved]}; give each report its own file")
        written[resolved] = flag
        check_outside_artifact(path, flag, folder)
        if option == "golden_save":
            check_golden_destination(path)
            continue
        bundle = next((b for b in bundles if b in resolved.parents), None)
        if bundle is not None:
            raise ToolkitError(
                f"{flag} {path} lies inside the golden bundle folder of {bundles[bundle]}, which it "
                "would change; write it elsewhere"
            )
        check_output_path(path, flag, folder=False)
        check_report_destination(path, REPORT_PARAMETERS[option])
    companion = None
    if options.fp16_companion is not None:
        if planned is None:
            companion = read_companion(options.fp16_companion)
        else:
            companion = companion_for(options.fp16_companion, *planned)
    text = None
    if quality_text is not None:
        from exporter.artifact.manifest import read_manifest
        from exporter.verify.inputs import read_quality_text

        text = read_quality_text(quality_text, read_manifest(folder, check_hashes=False), folder, settings)
    outcome.state.owed_reports = options.report_paths()
    return overrides, settings, companion, text


def finish_verification(report, options: VerifyOptions, result: dict, as_json: bool, text: str) -> None:
    """Write the reports, print the result and exit (1 on a parity failure). A report that cannot be written is
    an input error (exit 2), raised once the verdict is on stdout and the other reports hold it.

    Args:
        report: the VerifyReport.
        options: the verification's options, which name the report paths.
        result: the result as printed under --json.
        as_json: print `result` as JSON rather than `text`.
        text: the result for people.
    """
    from exporter.verify.reports import write_reports

    outcome.state.owed_reports = {}  # what is written now holds this run's verdict, which no error report may replace
    try:
        write_reports(report, **options.report_paths())
        unwritten = None
    except ToolkitError as exc:
        unwritten = exc
    outcome.emit(result, as_json, text)
    if unwritten is not None:
        raise unwritten
    if report.verdict == "undecided":  # not passed: exit 1 as a failure, saying what would decide it
        from exporter.tolerances.quality import QUALITY_CONFIDENCE

        undecided = dict.fromkeys(c.threshold.metric for q in report.quality for c in q.undecided)
        positions = max(q.metrics["positions"] for q in report.quality)
        more = "a longer --quality-text" if report.quality[0].text is not None else "--quality-text, a text read whole"
        click.echo(
            f"undecided: the {QUALITY_CONFIDENCE:.0%} interval of {', '.join(undecided)} straddles its limit at "
            f"{positions} positions; read more positions: give {more}",
            err=True,
        )
    sys.exit(0 if report.passed else outcome.EXIT_PARITY_FAILURE)


def run_verification(
    folder, providers, runtimes, genai, options: VerifyOptions, plan, model=None, golden=None, transformers_js=None
):
    """Run the engine with the CLI's options against `model` (run's export), else the artifact's reference: the
    --golden bundle, or the model rebuilt from its manifest (the only path that imports torch).

    Args:
        folder: the artifact folder, opened here with every hash checked.
        providers: the --provider names; none: every available one.
        runtimes: the --runtime names; none: onnxruntime.
        genai: --genai/--no-genai, or None when neither is given (verify_artifact's `genai`).
        options: the verification's options (the --golden-save folder among them).
        plan: what verification_plan returned for these options.
        model: the reference model; None: the artifact's own reference.
        golden: the --golden bundle folder, or None.
        transformers_js: --transformers-js/--no-transformers-js, or None when neither is given.

    Returns:
        The VerifyReport.
    """
    from exporter.artifact.folder import Artifact
    from exporter.artifact.manifest import unchanged_while_read
    from exporter.verify.engine import verify_artifact
    from exporter.verify.references.golden.reading import misplaced_bundle_hint
    from exporter.verify.references.model_source import reference_for

    overrides, settings, companion, text = plan
    with unchanged_while_read(folder):  # from the manifest on, as verify_artifact is from its own start
        try:
            artifact = Artifact.open(folder)  # once: it hashes every file, the weights included
        except ArtifactError as exc:
            raise ArtifactError(f"{exc}{misplaced_bundle_hint([folder], '--golden DIR', 'FOLDER')}") from None
        if model is None:
            model = reference_for(artifact.manifest, golden).model(folder, artifact.manifest)
        return verify_artifact(
            artifact,
            model,
            list(providers) or None,
            settings,
            genai,
            runtimes=list(runtimes) or None,
            transformers_js=transformers_js,
            golden=golden,
            golden_save=options.golden_save,
            overrides=overrides,
            fp16_companion=companion,
            quality_text=text,
        )
