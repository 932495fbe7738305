"""export-onnx: export MiniMind to ONNX, verify it against PyTorch, run it.

A thin layer: parse options, call the library, print its result objects.
Exit codes: 0 success, 1 parity failure, 2 usage or input error, 3 internal error.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from exporter import LIBRARY_LOGGERS
from exporter.errors import ToolkitError, error_document, torch_import_error
from exporter.generation import MINIMIND_SAMPLING
from reference import DEFAULT_PRESET, PRESETS, get_preset
from reference.errors import ModelError

EXIT_PARITY_FAILURE = 1
EXIT_INPUT_ERROR = 2
EXIT_INTERNAL_ERROR = 3
DEFAULT_ROOT = Path("artifacts")


class ProgressHandler(logging.Handler):
    """Progress lines on stderr with the elapsed time, so stdout stays clean for --json."""

    def __init__(self):
        super().__init__()
        self.start = time.perf_counter()

    def emit(self, record):
        click.echo(f"[{time.perf_counter() - self.start:6.1f}s] {record.getMessage()}", err=True)
        if record.exc_info:  # --verbose: the traceback of a failure
            click.echo(logging.Formatter().formatException(record.exc_info), err=True)


@dataclass
class CommandState:
    """How far the running command got, which its error handling reads: the signal handler and the error exit
    (after click has left the command's context) reach it, so it is this module's, reset by main per command."""

    interrupted_by: str | None = None  # the signal that stopped this command, if one did
    # The report paths (by write_error_reports's keywords) a verification owes once its options were accepted: an
    # error then writes them as error reports, so that none an earlier run left passes for this one's verdict.
    owed_reports: dict[str, Path | None] = field(default_factory=dict)
    result_printed: bool = False  # stdout holds the result: under --json an error must not add a second document


_state = CommandState()


def _interrupt(signum, frame):
    """SIGINT and SIGTERM raise KeyboardInterrupt, so that cleanups run (an export's partial folder is
    removed); the signal is remembered because torch.export can turn the interrupt into an error of its own."""
    _state.interrupted_by = signal.Signals(signum).name
    for library in LIBRARY_LOGGERS:  # what torch.export logs about the interrupt it turns into an error
        logging.getLogger(library).setLevel(logging.CRITICAL)
    raise KeyboardInterrupt


_WRITES_ARTIFACT = ("run", "export")  # the commands whose interruption leaves the destination as it was


_PREFIX = {"usage": "error: ", "input": "error: ", "internal": "internal error: ", "interrupted": ""}


def _fail(kind: str, message: str, code: int, as_json: bool) -> None:
    click.echo(_PREFIX[kind] + message, err=True)
    error = error_document(kind, message, code)
    if _state.owed_reports:
        _write_error_reports(error)
    if as_json and not _state.result_printed:  # stdout stays parseable: an error object instead of a result
        try:
            click.echo(json.dumps(error, indent=2))
        except OSError:  # stdout itself failed (a full disk, a closed pipe): the line on stderr has said it all
            sys.stdout = open(os.devnull, "w")  # nor may the flush at exit raise again
    sys.exit(code)


def _write_error_reports(error: dict) -> None:
    from exporter.verify.reports import write_error_reports
    try:
        write_error_reports(error, **_state.owed_reports)
    except ToolkitError as exc:  # a second line: the first said why the verification stopped
        click.echo(f"error: {exc}", err=True)


def handle_errors(func):
    """Toolkit errors become a one-line message and exit code 2; anything unexpected exit code 3."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return func(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, (SystemExit, click.ClickException)):
                raise
            if isinstance(exc, BrokenPipeError):  # stdout closed by the reader (`| head`): stop quietly
                sys.stdout = open(os.devnull, "w")
                sys.exit(141)
            log = logging.getLogger(__name__)
            interrupted_by = _state.interrupted_by
            if isinstance(exc, KeyboardInterrupt) or interrupted_by is not None:
                code = 143 if interrupted_by == "SIGTERM" else 130
                signal_name = f" ({interrupted_by})" if interrupted_by else ""
                outcome = ("; an export leaves no partial artifact: the destination holds the earlier one or the "
                           "complete new one") if func.__name__ in _WRITES_ARTIFACT else ""
                _fail("interrupted", f"interrupted{signal_name}{outcome}", code, as_json)
            if isinstance(exc, (ToolkitError, ModelError)):
                log.debug("input error", exc_info=True)
                _fail("input", str(exc), EXIT_INPUT_ERROR, as_json)
            log.debug("internal error", exc_info=True)
            hint = "" if log.isEnabledFor(logging.DEBUG) else " (rerun with --verbose for the traceback)"
            _fail("internal", f"{type(exc).__name__}: {exc}{hint}", EXIT_INTERNAL_ERROR, as_json)

    return wrapper


class OneLineErrorGroup(click.Group):
    """Usage errors as one line ('error: ... (see --help)') instead of click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        as_json = "--json" in (sys.argv[1:] if args is None else args)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
            _fail("usage", f"{exc.format_message()}{where}", EXIT_INPUT_ERROR, as_json)
        except click.ClickException as exc:
            _fail("usage", exc.format_message(), exc.exit_code, as_json)
        except click.Abort:
            click.echo("aborted", err=True)
            sys.exit(130)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


def _setup_logging(verbose: bool, quiet: bool) -> None:
    root = logging.getLogger()
    root.handlers[:] = [ProgressHandler()]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    for library in LIBRARY_LOGGERS:
        logging.getLogger(library).setLevel(logging.WARNING)


def _emit(result, as_json: bool, text: str) -> None:
    from exporter.verify.reports import json_text
    click.echo(json_text(result) if as_json else text)
    _state.result_printed = True


def common_options(func):
    func = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")(func)
    func = click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr.")(func)
    func = click.option("-v", "--verbose", is_flag=True, help="Debug logging, with tracebacks of failures.")(func)
    return func


def export_options(func):
    """The export's options, shared by `export` and `run`; --help lists them in this order."""
    options = [
        click.option("--preset", type=click.Choice(list(PRESETS), case_sensitive=False), default=None,
                     help=f"Model configuration [default: {DEFAULT_PRESET}]. Weights are seeded, or read from "
                          "--checkpoint, which must then fit the preset exactly."),
        click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
                     help="Weights to export: a MiniMind .pth state dict or *_resume.pth, a .safetensors file, "
                          "a Transformers folder (config.json + model.safetensors, sharded safetensors or "
                          "pytorch_model.bin), or a teaching-GPT {'model_state_dict': ...} file (.pt/.bin/.ckpt "
                          "are read as .pth). "
                          "Family and sizes are inferred from it unless --preset or --config is given."),
        click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
                     help="JSON file of config fields for a --checkpoint that carries none (toolkit or "
                          "upstream names); fields it lacks are inferred from the checkpoint."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Seed of the deterministic weight initialisation."),
        click.option("--output", "-o", type=click.Path(path_type=Path), default=None,
                     help="Artifact folder [default: artifacts/<preset>, or for a --checkpoint "
                          "artifacts/<its file name without suffix, or its folder name>, lowercased; -float16 "
                          "appended for --dtype float16]. An earlier artifact there is replaced only once the new "
                          "one is complete."),
        click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32",
                     show_default=True, help="Precision of the weights and activations."),
        click.option("--no-loss", is_flag=True,
                     help="Drop the labels input and loss output of prefill.onnx (inference-only)."),
        click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
                     help="tokenizer.json, or a folder with it (and tokenizer_config.json), to copy into the "
                          "artifact for text generation; its ids must fit the model's vocabulary."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def provider_option(func):
    return click.option("--provider", "providers", multiple=True, metavar="NAME",
                        help="Execution provider to verify on (cpu, cuda, or a full name); repeatable. "
                             "Default: every available one, the others reported as skipped.")(func)


def genai_option(func):
    return click.option("--genai/--no-genai", "genai", default=None,
                        help="Also load the folder in onnxruntime-genai and compare its greedy tokens with the "
                             "reference. Default: when onnxruntime-genai is installed and the family runs in it.")(func)


def _read_config_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # invalid JSON, not UTF-8 text, or nested too deep
        raise ToolkitError(f"--config {path} is not a readable JSON file ({exc}); pass a JSON object of config fields")
    if not isinstance(data, dict):
        raise ToolkitError(f"--config {path} holds a {type(data).__name__}, not a JSON object of config fields")
    return data


def _model_and_source(preset, seed, checkpoint, config_path):
    """The model to export, with the manifest's record of where its weights came from (a SourcedModel)."""
    from exporter.model_source import checkpoint_model, seeded_model
    if checkpoint is None:
        if config_path is not None:
            raise ToolkitError("--config describes a --checkpoint's model; for seeded weights choose a --preset")
        return seeded_model(preset or DEFAULT_PRESET, seed)
    context = click.get_current_context(silent=True)
    if context is not None and context.get_parameter_source("seed") == click.core.ParameterSource.COMMANDLINE:
        raise ToolkitError("--seed seeds generated weights; a --checkpoint brings its own: drop --seed")
    if preset is not None and config_path is not None:
        raise ToolkitError("give --preset or --config for a checkpoint, not both")
    data = _read_config_file(config_path) if config_path is not None else None
    return checkpoint_model(checkpoint, preset, config_data=data)


def _planned_artifact(preset, seed, checkpoint, dtype) -> tuple:
    """(dtype, config, weights source) of the artifact `run` is about to export, what --fp16-companion is held
    to before the export; a checkpoint's config and source are known only once it has been read (None)."""
    from exporter.model_source import seeded_source
    if checkpoint is not None:
        return dtype, None, None
    preset = preset or DEFAULT_PRESET
    return dtype, get_preset(preset), seeded_source(preset, seed)


def _check_outside_artifact(path, flag: str, folder) -> None:
    """A path this command writes must not lie in the artifact folder it reads (it would change it)."""
    artifact, resolved = Path(folder).resolve(), Path(path).resolve()
    if resolved == artifact or artifact in resolved.parents:
        raise ToolkitError(f"{flag} {path} lies inside the artifact folder {folder}, which it would change; "
                           "write it elsewhere")


def _output_folder(output, preset, checkpoint, dtype) -> Path:
    """-o, or artifacts/<checkpoint name, or preset>[-<dtype>]: two checkpoints fitting one preset get folders of
    their own."""
    if output is not None:
        return output
    if checkpoint is None:
        name = preset or DEFAULT_PRESET
    else:  # resolved: `--checkpoint .` is named after the current folder; a folder keeps its dots (MiniMind2-v1.5)
        resolved = Path(checkpoint).resolve()
        name = resolved.name if resolved.is_dir() else resolved.stem
        if not name:
            raise ToolkitError(f"--checkpoint {checkpoint} has no name to call the artifact folder after; "
                               "pass --output DIR")
    name = name.lower()
    return DEFAULT_ROOT / (name if dtype == "float32" else f"{name}-{dtype}")


def _require_torch(purpose: str) -> None:
    """The reference model and the export need PyTorch; a deployment may hold only onnxruntime, which
    inspect, generate and a golden replay are enough for."""
    missing = torch_import_error()
    if missing is not None:
        raise ToolkitError(f"{purpose} needs PyTorch, which does not import here ({missing}); install it "
                           "(pip install torch==2.13.0)")


def _export(preset, seed, output, dtype, no_loss, tokenizer=None, checkpoint=None, config_path=None):
    _require_torch("exporting")
    from exporter.export import export_artifact  # torch.onnx is slow to import; keep --help fast
    sourced = _model_and_source(preset, seed, checkpoint, config_path)
    folder = _output_folder(output, preset, checkpoint, dtype)
    return sourced.model, export_artifact(sourced.model, folder, dtype=dtype, with_loss=not no_loss,
                                          source=sourced.source, tokenizer=tokenizer)


def verify_options(func):
    """The verification engine's options, shared by `verify` and `run`."""
    options = [
        click.option("--decode-steps", type=click.IntRange(min=1), default=64, show_default=True,
                     help="Stateful single-token decode steps (each feeding ONNX Runtime's own present back as "
                          "past), then one 3-token step; cut to what the model's context leaves after the prompt."),
        click.option("--sweep/--no-sweep", default=True, show_default=True,
                     help="Shape sweep: batch {1,2,3} x new tokens {1,2,7,64} x past {0,1,17}, ragged padding."),
        click.option("--probe", is_flag=True, help="Node-level localisation: debug copies of prefill.onnx (on the "
                                                   "prefill batch) and decode.onnx (on the first failing decode "
                                                   "call, fed the reference's past) exposing intermediate values "
                                                   "name the first value that diverges from the reference's module "
                                                   "outputs and presents (the model's, or those a golden bundle "
                                                   "recorded), and the operator that computed it."),
        click.option("--atol", multiple=True, metavar="KIND=V", help="Override a tolerance term for logits, kv or "
                                                                     "loss (repeatable), e.g. --atol logits=1e-3."),
        click.option("--rtol", multiple=True, metavar="KIND=V", help="Override rtol, e.g. --rtol kv=1e-3."),
        click.option("--peak", multiple=True, metavar="KIND=V",
                     help="Override the peak term, a multiple of the reference's max |value| added to the bound, "
                          "e.g. --peak logits=0."),
        click.option("--tolerances", "tolerance_file", type=click.Path(path_type=Path), default=None, metavar="FILE",
                     help='JSON or .toml file of overrides: {"logits": {"atol": 1e-3, "rtol": 1e-3}}.'),
        click.option("--report-json", type=click.Path(path_type=Path), default=None, metavar="PATH",
                     help="Write the full JSON report here."),
        click.option("--junit", type=click.Path(path_type=Path), default=None, metavar="PATH",
                     help="Write a JUnit XML report here (for CI systems)."),
        click.option("--html", type=click.Path(path_type=Path), default=None, metavar="PATH",
                     help="Write a self-contained HTML report with plots here."),
        click.option("--golden-save", type=click.Path(path_type=Path), default=None, metavar="DIR",
                     help="Record the reference's inputs and outputs as a golden bundle in DIR, with the "
                          "tolerance overrides of this run, which its replay applies."),
        click.option("--fp16-companion", type=click.Path(path_type=Path), default=None, metavar="DIR",
                     help="A float16 export of the same model: the precision leg of the CUDA attribution."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@dataclass(frozen=True)
class VerifyOptions:
    """The values of verify_options, as click passes them (keyword names = the options' parameter names)."""

    decode_steps: int
    sweep: bool
    probe: bool
    atol: tuple[str, ...]
    rtol: tuple[str, ...]
    peak: tuple[str, ...]
    tolerance_file: Path | None
    report_json: Path | None
    junit: Path | None
    html: Path | None
    golden_save: Path | None
    fp16_companion: Path | None

    def report_paths(self) -> dict:
        """The reports to write, by write_reports's (and write_error_reports's) keywords."""
        return {"json_path": self.report_json, "junit_path": self.junit, "html_path": self.html}


def _verify_plan(folder: Path, providers, genai: bool | None, options: VerifyOptions, golden: Path | None = None,
                 planned: tuple | None = None):
    """The verification's options, each checked before anything runs (for `run`, before the export, with
    --fp16-companion held to the `planned` artifact, see _planned_artifact; the engine checks it again after)."""
    from exporter.errors import ConsumerError
    from exporter.genai import INSTALL_HINT, genai_version
    from exporter.paths import check_output_path
    from exporter.sessions import check_parity_providers
    from exporter.verify.golden import check_golden_destination
    from exporter.verify.inputs import ParitySettings
    from exporter.verify.providers import companion_for, read_companion
    from exporter.verify.tolerances import parse_overrides
    overrides = parse_overrides(options.atol, options.rtol, options.peak, options.tolerance_file)
    settings = ParitySettings(decode_steps=options.decode_steps, sweep=options.sweep, probe=options.probe)
    check_parity_providers(providers)
    if genai and genai_version() is None:
        raise ConsumerError(f"--genai asks for the onnxruntime-genai check, but it is not installed ({INSTALL_HINT})")
    bundles = {Path(path).resolve(): flag for path, flag in ((options.golden_save, "--golden-save"),
                                                             (golden, "--golden")) if path is not None}
    written: dict[Path, str] = {}  # each report path -> its flag
    for option in ("report_json", "junit", "html", "golden_save"):
        path, flag = getattr(options, option), "--" + option.replace("_", "-")
        if path is None:
            continue
        resolved = Path(path).resolve()
        if resolved in written:
            raise ToolkitError(f"{flag} {path} is also the path of {written[resolved]}; give each report its own file")
        written[resolved] = flag
        _check_outside_artifact(path, flag, folder)
        if option == "golden_save":
            check_golden_destination(path)
            continue
        bundle = next((b for b in bundles if b in resolved.parents), None)
        if bundle is not None:
            raise ToolkitError(f"{flag} {path} lies inside the golden bundle folder of {bundles[bundle]}, which it "
                               "would change; write it elsewhere")
        check_output_path(path, flag, folder=False)
    if options.fp16_companion is not None:
        if planned is None:
            read_companion(options.fp16_companion)
        else:
            companion_for(options.fp16_companion, *planned)
    _state.owed_reports = options.report_paths()
    return overrides, settings


def _finish(report, options: VerifyOptions, result: dict, as_json: bool, text: str) -> None:
    """Write the reports, print the result and exit (1 on a parity failure). A report that cannot be written is
    an input error (exit 2), raised once the verdict is on stdout and the other reports hold it."""
    from exporter.verify.reports import write_reports
    _state.owed_reports = {}  # what is written now holds this run's verdict, which no error report may replace
    try:
        write_reports(report, **options.report_paths())
        unwritten = None
    except ToolkitError as exc:
        unwritten = exc
    _emit(result, as_json, text)
    if unwritten is not None:
        raise unwritten
    sys.exit(0 if report.passed else EXIT_PARITY_FAILURE)


def _verify(folder, providers, genai, options: VerifyOptions, plan, model=None, golden=None):
    """Run the engine with the CLI's options against `model` (run's export), else the artifact's reference: the
    --golden bundle, or the model rebuilt from its manifest (the only path that imports torch)."""
    from exporter.manifest import read_manifest
    from exporter.model_source import reference_for
    from exporter.verify.engine import verify_artifact
    overrides, settings = plan
    manifest = read_manifest(folder)  # once: it hashes every file, the weights included
    if model is None:
        model = reference_for(folder, manifest, golden).model(folder, manifest)
    return verify_artifact(folder, model, list(providers) or None, settings, genai, golden=golden,
                           golden_save=options.golden_save, overrides=overrides,
                           fp16_companion=options.fp16_companion, manifest=manifest)


@click.group(cls=OneLineErrorGroup, invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def main(ctx):
    """Export MiniMind to ONNX (prefill + cached decode graphs) and prove that ONNX Runtime reproduces
    the PyTorch reference: logits, present KV and loss, on every available execution provider.

    With no command, runs `export-onnx run`: export the minimind-3 preset with seeded weights to
    artifacts/minimind-3, then verify it.

    Exit codes: 0 success, 1 parity failure, 2 usage or input error, 3 internal error, 130/143
    interrupted (SIGINT/SIGTERM), 141 stdout closed early (e.g. piped into head).
    """
    global _state
    _state = CommandState()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    if ctx.invoked_subcommand is None:
        ctx.invoke(run)


@main.command()
@export_options
@provider_option
@genai_option
@verify_options
@common_options
@handle_errors
def run(preset, checkpoint, config_path, seed, output, dtype, no_loss, tokenizer, providers, genai, as_json, quiet,
        verbose, **options):
    """Export a preset or a checkpoint, then verify the artifact against the reference (the default command)."""
    _setup_logging(verbose, quiet)
    options = VerifyOptions(**options)
    from exporter.report import format_export
    from exporter.verify.reports import format_verify
    # a bad verification option must not cost an export
    plan = _verify_plan(_output_folder(output, preset, checkpoint, dtype), providers, genai, options,
                        planned=_planned_artifact(preset, seed, checkpoint, dtype))
    model, exported = _export(preset, seed, output, dtype, no_loss, tokenizer, checkpoint, config_path)
    report = _verify(exported.folder, providers, genai, options, plan, model)
    _finish(report, options, {"export": exported.to_dict(), "verify": report.to_dict()}, as_json,
            format_export(exported) + "\n\n" + format_verify(report))


@main.command()
@export_options
@common_options
@handle_errors
def export(preset, checkpoint, config_path, seed, output, dtype, no_loss, tokenizer, as_json, quiet, verbose):
    """Export prefill.onnx, decode.onnx, one shared weights file, manifest.json, and the configs that let
    onnxruntime-genai and Optimum load the folder as it is."""
    _setup_logging(verbose, quiet)
    from exporter.report import format_export
    _, exported = _export(preset, seed, output, dtype, no_loss, tokenizer, checkpoint, config_path)
    _emit(exported.to_dict(), as_json, format_export(exported))


@main.command()
@click.argument("folder", type=click.Path(path_type=Path), default=DEFAULT_ROOT / DEFAULT_PRESET)
@provider_option
@genai_option
@verify_options
@click.option("--golden", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Compare with a golden bundle instead of the PyTorch model (needs no torch), judged with "
                   "the tolerance overrides it was recorded with; --atol, --rtol, --peak and --tolerances "
                   "replace its terms one by one.")
@common_options
@handle_errors
def verify(folder, providers, genai, golden, as_json, quiet, verbose, **options):
    """Verify an artifact FOLDER: against the PyTorch reference (prefill, a 64-step decode error curve,
    greedy tokens, the shape sweep), with reference-free invariants, fp16 health, a repeat run,
    providers against each other, and onnxruntime-genai's greedy tokens on the folder as it is.

    The reference is rebuilt from the manifest (the config with the weight seed, or the checkpoint file it
    was exported from, which must be unchanged), or replayed from a golden bundle (--golden). Exits 1 when
    any check fails, 2 on bad input (e.g. a bundle of another artifact). FOLDER defaults to
    artifacts/minimind-3.
    """
    _setup_logging(verbose, quiet)
    from exporter.verify.reports import format_verify
    options = VerifyOptions(**options)
    if golden is not None:
        context = click.get_current_context()
        flags = {"decode_steps": "--decode-steps", "sweep": "--sweep/--no-sweep", "golden_save": "--golden-save"}
        given = [flag for name, flag in flags.items()
                 if context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--golden replays the checks recorded in the bundle, with its settings; "
                                   f"drop {', '.join(given)}")
    report = _verify(folder, providers, genai, options, _verify_plan(folder, providers, genai, options, golden),
                     golden=golden)
    _finish(report, options, report.to_dict(), as_json, format_verify(report))


def _parse_ids(text: str) -> list[int]:
    parts = text.split(",")
    try:
        if len(parts) > 1 and not all(part.strip() for part in parts):
            raise ValueError  # "1,,2": a lost id, not a separator
        tokens = [token for part in parts for token in part.split()]
        if not all(token.isascii() and token.lstrip("-").isdigit() for token in tokens):
            raise ValueError  # int() also reads "1_000" and non-ASCII digits
        return [int(token) for token in tokens]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of integers; write e.g. --prompt-ids 1,42,7") from None


def _encode_prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text).ids
    if not ids:  # said here: the runtime's "the prompt is empty" would deny the text the user gave
        raise click.BadParameter(f"{text!r} encodes to no tokens with this tokenizer; give text that it covers",
                                 param_hint="--prompt")
    return ids


@main.command()
@click.argument("folder", type=click.Path(path_type=Path), default=DEFAULT_ROOT / DEFAULT_PRESET)
@click.option("--prompt-ids", "prompt_ids", multiple=True, metavar="IDS",
              help="Prompt token ids, comma or space separated. Repeat for a batch (left-padded).")
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
              help="Prompt text (needs a tokenizer). Repeat for a batch.")
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
              help="tokenizer.json, or a folder with it, for --prompt text [default: the artifact's own].")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=32, show_default=True,
              help="Most tokens to generate per prompt; generation stops earlier at eos or a --stop-id.")
@click.option("--sample", is_flag=True, help="Sample instead of greedy decoding (MiniMind's generate).")
@click.option("--temperature", type=float, default=MINIMIND_SAMPLING["temperature"], show_default=True,
              help="With --sample.")
@click.option("--top-k", type=int, default=MINIMIND_SAMPLING["top_k"], show_default=True,
              help="With --sample; 0 disables.")
@click.option("--top-p", type=float, default=MINIMIND_SAMPLING["top_p"], show_default=True,
              help="With --sample; 1 disables.")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="Divide the logits of ids already present by this (MiniMind's rule).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the sampler; each row of a batch draws from its own generator with it, so a row "
                   "samples as it would alone.")
@click.option("--stop-id", "stop_ids", type=int, multiple=True, help="Extra stop token id; repeatable.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the model's eos token.")
@click.option("--provider", default="cpu", show_default=True, help="Execution provider (cpu or cuda).")
@click.option("--threads", type=int, default=0, show_default=True,
              help="Intra-op threads of each ONNX Runtime session, 0 to 1024; 0 = one per core.")
@click.option("--prompt-chunk", type=click.IntRange(min=0), default=None,
              help="Prompt tokens per decode.onnx call [default: 128]: peak memory grows with it; "
                   "0 = the whole prompt at once.")
@click.option("--save-optimized", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Also save the graphs as ONNX Runtime optimised them, into DIR.")
@common_options
@handle_errors
def generate(folder, prompt_ids, prompts, tokenizer, max_new_tokens, sample, temperature, top_k, top_p,
             repetition_penalty, seed, stop_ids, ignore_eos, provider, threads, prompt_chunk, save_optimized,
             as_json, quiet, verbose):
    """Generate with ONNX Runtime, printing tokens as they are produced.

    Prompts are token ids (--prompt-ids) or text (--prompt, with a tokenizer.json). Without
    --sample the decoding is greedy. Every prompt and option is checked before the model loads.
    FOLDER defaults to artifacts/minimind-3.
    """
    _setup_logging(verbose, quiet)
    from exporter.generation import Generation, SamplingConfig, check_request, stream
    from exporter.manifest import read_manifest
    from exporter.runtime import OrtRunner
    from exporter.sessions import SessionSettings, check_provider
    from exporter.tokenizer import TOKENIZER, TextStream, load_tokenizer
    if bool(prompt_ids) == bool(prompts):
        raise click.UsageError("give exactly one of --prompt-ids and --prompt")
    if tokenizer is not None and not prompts:
        raise click.UsageError("--tokenizer reads --prompt text; with --prompt-ids, drop it")
    context = click.get_current_context()
    sampling_flags = [f"--{name.replace('_', '-')}" for name in ("temperature", "top_k", "top_p", "seed")
                      if context.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if sampling_flags and not sample:  # as transformers warns of: greedy decoding would ignore them
        raise click.UsageError(f"{', '.join(sampling_flags)} only shape sampling, and without --sample the "
                               "decoding is greedy; add --sample, or drop them")
    if save_optimized is not None:
        from exporter.paths import check_output_path
        check_output_path(save_optimized, "--save-optimized", folder=True)
        _check_outside_artifact(save_optimized, "--save-optimized", folder)
    provider = check_provider(provider)
    settings = SessionSettings(intra_op_threads=threads, optimized_model_dir=save_optimized,
                               **({} if prompt_chunk is None else {"prompt_chunk": prompt_chunk}))
    manifest = read_manifest(folder)
    config = manifest.config
    text_tokenizer = None
    if prompts:  # text in, text out; ids in, ids out
        # the artifact's own: the one its manifest lists (and read_manifest has hashed), not any file there
        if tokenizer is None and TOKENIZER not in manifest.files:
            raise click.UsageError(f"--prompt needs a tokenizer: the artifact {folder} lists no {TOKENIZER}; pass "
                                   "--tokenizer PATH or re-export with --tokenizer")
        text_tokenizer = load_tokenizer(tokenizer or folder, config.vocab_size)
    batch = ([_encode_prompt(text_tokenizer, text) for text in prompts] if prompts
             else [_parse_ids(text) for text in prompt_ids])
    sampling = SamplingConfig(do_sample=sample, temperature=temperature, top_k=top_k, top_p=top_p,
                              repetition_penalty=repetition_penalty, seed=seed)
    eos = None if ignore_eos else config.eos_token_id
    _, stops = check_request(config, batch, max_new_tokens, sampling, eos, stop_ids)  # before the sessions load
    runner = OrtRunner(folder, provider, manifest=manifest, settings=settings)
    steps = stream(runner, batch, max_new_tokens, sampling, eos, stop_ids)
    results = [Generation(prompt) for prompt in batch]
    live = len(batch) == 1 and not as_json
    text = TextStream(text_tokenizer) if text_tokenizer is not None else None
    try:
        for tokens in steps:
            for result, token in zip(results, tokens):
                result.add(token, stops)
            if live and tokens[0] is not None:
                click.echo(text.push(tokens[0]) if text else f"{tokens[0]} ", nl=False)
    finally:
        if live:  # the streamed line ends here, an interrupted one too: an error message gets a line of its own
            click.echo(text.rest() if text else "")
    if live:
        return
    decoded = [text_tokenizer.decode(result.new_ids) if text_tokenizer else None for result in results]
    rows = [{**result.to_dict(), **({"text": t} if t is not None else {})} for result, t in zip(results, decoded)]
    _emit(rows, as_json, "\n".join(t if t is not None else " ".join(map(str, result.new_ids))
                                   for result, t in zip(results, decoded)))


@main.command()
@click.argument("folder", type=click.Path(path_type=Path), default=DEFAULT_ROOT / DEFAULT_PRESET)
@common_options
@handle_errors
def inspect(folder, as_json, quiet, verbose):
    """Show an artifact's I/O contract, file sizes, hashes, the versions that wrote it, and each file's state.

    A damaged folder (a file missing, or not the size or sha256 its manifest lists) is shown too, then
    exits 2; an unreadable manifest is a one-line error. FOLDER defaults to artifacts/minimind-3.
    """
    _setup_logging(verbose, quiet)
    from exporter.manifest import file_status, load_manifest
    from exporter.report import format_inspect
    manifest = load_manifest(folder)
    status = file_status(folder, manifest)
    result = {**manifest.to_dict(), "file_status": status}
    damaged = {name: state for name, state in status.items() if state != "ok"}
    if damaged:  # shown all the same: inspect is what a user reaches for when something is wrong
        message = (f"{folder} is damaged: " + "; ".join(f"{name}: {state}" for name, state in damaged.items())
                   + "; re-export the folder")
        click.echo(f"error: {message}", err=True)
        result.update(error_document("input", message, EXIT_INPUT_ERROR))
    _emit(result, as_json, format_inspect(manifest, str(folder), status))
    if damaged:
        sys.exit(EXIT_INPUT_ERROR)


if __name__ == "__main__":  # python -m exporter.cli, where the console script is not on PATH
    main()
