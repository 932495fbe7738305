"""export-onnx: export MiniMind to ONNX, verify it against PyTorch, run it.

A thin layer: parse options, call the library, print its result objects.
Exit codes: 0 success, 1 parity failure, 2 usage or input error, 3 internal error.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from pathlib import Path

import click

from exporter.errors import ToolkitError
from reference import DEFAULT_PRESET, PRESETS, build_model, get_preset
from reference.errors import ConfigError

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


def handle_errors(func):
    """Toolkit errors become a one-line message and exit code 2; anything unexpected exit code 3."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (ToolkitError, ConfigError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_INPUT_ERROR)
        except KeyboardInterrupt:
            click.echo("interrupted; an earlier artifact at the destination is untouched", err=True)
            sys.exit(130)
        except click.ClickException:
            raise
        except Exception as exc:
            logging.getLogger(__name__).debug("internal error", exc_info=True)
            click.echo(f"internal error: {type(exc).__name__}: {exc} (rerun with --verbose for the traceback)",
                       err=True)
            sys.exit(EXIT_INTERNAL_ERROR)

    return wrapper


class OneLineErrorGroup(click.Group):
    """Usage errors as one line ('error: ... (see --help)') instead of click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
            click.echo(f"error: {exc.format_message()}{where}", err=True)
            sys.exit(EXIT_INPUT_ERROR)
        except click.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
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
    for noisy in ("torch", "onnx_ir", "onnxscript"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _emit(result, as_json: bool, text: str) -> None:
    click.echo(json.dumps(result, indent=2) if as_json else text)


def common_options(func):
    func = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")(func)
    func = click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr.")(func)
    func = click.option("-v", "--verbose", is_flag=True, help="Debug logging, with tracebacks of failures.")(func)
    return func


def export_options(func):
    func = click.option("--preset", type=click.Choice(list(PRESETS)), default=DEFAULT_PRESET, show_default=True,
                        help="Model configuration to export (weights are seeded).")(func)
    func = click.option("--seed", type=int, default=0, show_default=True,
                        help="Seed of the deterministic weight initialisation.")(func)
    func = click.option("--output", "-o", type=click.Path(path_type=Path), default=None,
                        help="Artifact folder [default: artifacts/<preset>]. An earlier artifact there is "
                             "replaced only once the new one is complete.")(func)
    func = click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32",
                        show_default=True, help="Precision of the weights and activations.")(func)
    func = click.option("--no-loss", is_flag=True,
                        help="Drop the labels input and loss output of prefill.onnx (inference-only).")(func)
    func = click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
                        help="tokenizer.json, or a folder with it (and tokenizer_config.json), to copy into the "
                             "artifact for text generation; its ids must fit the model's vocabulary.")(func)
    return func


def provider_option(func):
    return click.option("--provider", "providers", multiple=True, metavar="NAME",
                        help="Execution provider to verify on (cpu, cuda, or a full name); repeatable. "
                             "Default: every available one, the others reported as skipped.")(func)


def genai_option(func):
    return click.option("--genai/--no-genai", "genai", default=None,
                        help="Also load the folder in onnxruntime-genai and compare its greedy tokens with the "
                             "reference. Default: when onnxruntime-genai is installed and the family runs in it.")(func)


def _export(preset, seed, output, dtype, no_loss, tokenizer):
    from exporter.export import export_artifact  # torch.onnx is slow to import; keep --help fast
    model = build_model(get_preset(preset), seed)
    folder = output or DEFAULT_ROOT / (preset if dtype == "float32" else f"{preset}-{dtype}")
    source = {"kind": "seeded", "preset": preset, "seed": seed}
    return model, export_artifact(model, folder, dtype=dtype, with_loss=not no_loss, source=source,
                                  tokenizer=tokenizer)


def _verify(folder, providers, genai, model=None):
    from exporter.manifest import read_manifest
    from exporter.parity import verify_artifact
    if model is None:
        manifest = read_manifest(folder)
        if manifest.source.get("kind") != "seeded":
            raise ToolkitError(f"{folder} was exported from weights this command cannot rebuild "
                               f"({manifest.source}); verify it from Python with verify_artifact(folder, model)")
        model = build_model(manifest.config, manifest.source["seed"])
    return verify_artifact(folder, model, list(providers) or None, genai=genai)


@click.group(cls=OneLineErrorGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def main(ctx):
    """Export MiniMind to ONNX (prefill + cached decode graphs) and prove that ONNX Runtime reproduces
    the PyTorch reference: logits, present KV and loss, on every available execution provider.

    With no command, runs `export-onnx run`: export the minimind-3 preset with seeded weights to
    artifacts/minimind-3, then verify it.

    Exit codes: 0 success, 1 parity failure, 2 usage or input error, 3 internal error.
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(run)


@main.command()
@export_options
@provider_option
@genai_option
@common_options
@handle_errors
def run(preset, seed, output, dtype, no_loss, tokenizer, providers, genai, as_json, quiet, verbose):
    """Export a preset, then verify the artifact against the reference (the default command)."""
    from exporter.report import format_export, format_verify
    _setup_logging(verbose, quiet)
    model, exported = _export(preset, seed, output, dtype, no_loss, tokenizer)
    report = _verify(exported.folder, providers, genai, model)
    _emit({"export": exported.to_dict(), "verify": report.to_dict()}, as_json,
          format_export(exported) + "\n\n" + format_verify(report))
    sys.exit(0 if report.passed else EXIT_PARITY_FAILURE)


@main.command()
@export_options
@common_options
@handle_errors
def export(preset, seed, output, dtype, no_loss, tokenizer, as_json, quiet, verbose):
    """Export prefill.onnx, decode.onnx, one shared weights file, manifest.json, and the configs that let
    onnxruntime-genai and Optimum load the folder as it is."""
    from exporter.report import format_export
    _setup_logging(verbose, quiet)
    _, exported = _export(preset, seed, output, dtype, no_loss, tokenizer)
    _emit(exported.to_dict(), as_json, format_export(exported))


@main.command()
@click.argument("folder", type=click.Path(path_type=Path), default=DEFAULT_ROOT / DEFAULT_PRESET)
@provider_option
@genai_option
@common_options
@handle_errors
def verify(folder, providers, genai, as_json, quiet, verbose):
    """Compare an artifact FOLDER with the PyTorch reference (prefill, 17 decode steps, greedy tokens),
    and onnxruntime-genai's greedy tokens on the folder as it is with the reference's.

    The reference is rebuilt from the manifest (config and weight seed). Exits 1 when any check fails.
    """
    from exporter.report import format_verify
    _setup_logging(verbose, quiet)
    report = _verify(folder, providers, genai)
    _emit(report.to_dict(), as_json, format_verify(report))
    sys.exit(0 if report.passed else EXIT_PARITY_FAILURE)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of integers; write e.g. --prompt-ids 1,42,7") from None


@main.command()
@click.argument("folder", type=click.Path(path_type=Path), default=DEFAULT_ROOT / DEFAULT_PRESET)
@click.option("--prompt-ids", default=None, help="Prompt token ids, comma or space separated.")
@click.option("--prompt", default=None,
              help="Prompt text (the artifact must hold a tokenizer; see export --tokenizer).")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--provider", default="cpu", show_default=True, help="Execution provider (cpu or cuda).")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the model's eos token.")
@common_options
@handle_errors
def generate(folder, prompt_ids, prompt, max_new_tokens, provider, ignore_eos, as_json, quiet, verbose):
    """Generate greedily with ONNX Runtime from prompt token ids or text."""
    from exporter.manifest import read_manifest
    from exporter.runtime import OrtRunner, check_prompt, generate_greedy
    from exporter.tokenizer import load_tokenizer
    _setup_logging(verbose, quiet)
    if (prompt_ids is None) == (prompt is None):
        raise click.UsageError("give exactly one of --prompt-ids and --prompt")
    manifest = read_manifest(folder)
    tokenizer = None if prompt is None else load_tokenizer(folder)
    ids = _parse_ids(prompt_ids) if tokenizer is None else tokenizer.encode(prompt).ids
    check_prompt(manifest.config, ids, max_new_tokens)  # before the sessions load
    runner = OrtRunner(folder, provider, manifest=manifest)
    eos = None if ignore_eos else manifest.config.eos_token_id
    result = generate_greedy(runner, ids, max_new_tokens, eos)
    if tokenizer is None:
        _emit(result.to_dict(), as_json, " ".join(map(str, result.new_ids)))
    else:
        text = tokenizer.decode(result.new_ids)
        _emit({**result.to_dict(), "text": text}, as_json, text)


@main.command()
@click.argument("folder", type=click.Path(path_type=Path), default=DEFAULT_ROOT / DEFAULT_PRESET)
@common_options
@handle_errors
def inspect(folder, as_json, quiet, verbose):
    """Show an artifact's I/O contract, file sizes, hashes and the versions that wrote it."""
    from exporter.manifest import read_manifest
    from exporter.report import format_inspect
    _setup_logging(verbose, quiet)
    manifest = read_manifest(folder)
    _emit(manifest.to_dict(), as_json, format_inspect(manifest, str(folder)))
