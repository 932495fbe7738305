"""export-onnx: export MiniMind to ONNX, verify it against PyTorch, run it.

A thin layer: parse options, call the library, print its result objects.
Exit codes: 0 success, 1 parity failure, 2 usage or input error, 3 internal error, 130/143 interrupted
(SIGINT/SIGTERM), 141 stdout closed early.
The commands are here; the options they share, with the checks of the verification's, are in options.py; how a
command ends (exit codes, one-line errors, signals, progress lines) is in outcome.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def _interrupted_while_starting(signum, frame):
    """A Ctrl-C while the command's modules import (onnxruntime's the longest): one line and 130, as later, not
    Python's traceback of the import it stopped. Under --json, stdout holds the error object.

    It leaves with os._exit: nothing started yet needs cleaning up, and an exception raised inside an extension's
    initialisation is not the caller's to handle. In onnx's (nanobind) it aborts the process (exit -6 and a
    traceback), in onnxruntime's (pybind11) it becomes `ImportError: initialization failed` (a second error line
    saying onnxruntime is not installed, exit 2), and an interpreter left with a half-initialised one can crash
    at exit (-11)."""
    message, code = f"interrupted ({signal.Signals(signum).name})", 128 + signum
    try:  # whatever fails here (a closed stdout), the exit stays this one
        from exporter.cli.document import error_document, json_requested

        print(message, file=sys.stderr)
        if json_requested():
            print(json.dumps(error_document("interrupted", message, code), indent=2))
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# Until this module is done (its imports, then its commands' definitions); then whatever was there before (a program
# importing this module keeps its own handling), and begin_command routes the signals for the command. One started
# ignoring a signal keeps ignoring it.
_BEFORE_IMPORTS = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
for _signum, _handler in _BEFORE_IMPORTS.items():
    if _handler is not signal.SIG_IGN:
        try:
            signal.signal(_signum, _interrupted_while_starting)
        except ValueError:  # imported from a thread other than the main one, which cannot set handlers
            break

import click  # after the handlers above, as every import below

from exporter.artifact.paths import (
    TEXT_PATH_FIX,
    check_output_path,
    check_outside_artifact,
    check_text_path,
    read_json_object,
)
from exporter.cli.document import error_document
from exporter.cli.options import (
    PathOption,
    VerifyOptions,
    common_options,
    export_options,
    finish_verification,
    genai_option,
    provider_option,
    run_verification,
    verification_plan,
    verify_options,
)
from exporter.cli.outcome import (
    EXIT_INPUT_ERROR,
    OneLineErrorGroup,
    begin_command,
    echo_result,
    emit,
    handle_errors,
    missing_dependency,
    setup_logging,
)
from exporter.errors import EXPORT_EXTRA, ConsumerError, InputError, ToolkitError, export_extra_error

try:
    import onnxruntime  # noqa: F401  every command runs it: a deployment set up with --no-deps may lack it
except ImportError as exc:
    missing_dependency(exc)
from exporter.artifact.consumers import MINIMIND_SAMPLING
from reference import DEFAULT_PRESET, get_preset

DEFAULT_ROOT = Path("artifacts")


def _model_and_source(preset, seed, checkpoint, config_path, with_tokenizer=False):
    """The model to export, with the manifest's record of where its weights came from (a SourcedModel), and with
    `with_tokenizer` the tokenizer a checkpoint brings."""
    from reference.source import checkpoint_model, seeded_model

    if checkpoint is None:
        if config_path is not None:
            raise ToolkitError("--config describes a --checkpoint's model; for seeded weights choose a --preset")
        return seeded_model(preset or DEFAULT_PRESET, seed)
    context = click.get_current_context(silent=True)
    if context is not None and context.get_parameter_source("seed") == click.core.ParameterSource.COMMANDLINE:
        raise ToolkitError("--seed seeds generated weights; a --checkpoint brings its own: drop --seed")
    if preset is not None and config_path is not None:
        raise ToolkitError("give --preset or --config for a checkpoint, not both")
    data = (
        None
        if config_path is None
        else read_json_object(config_path, ToolkitError, "--config", "pass a JSON object of config fields")
    )
    return checkpoint_model(checkpoint, preset, config_data=data, with_tokenizer=with_tokenizer)


def _planned_artifact(preset, seed, checkpoint, dtype) -> tuple:
    """(dtype, config, weights source) of the artifact `run` is about to export, what --fp16-companion is held
    to before the export; a checkpoint's config and source are known only once it has been read (None)."""
    from reference.source import seeded_source

    if checkpoint is not None:
        return dtype, None, None
    preset = preset or DEFAULT_PRESET
    return dtype, get_preset(preset), seeded_source(preset, seed)


def _output_folder(output, preset, checkpoint, dtype, activations=None) -> Path:
    """-o, or artifacts/<checkpoint name, or preset>[-<dtype>][-<activations>]: two checkpoints fitting one preset
    get folders of their own, and an int4 export for CUDA (float16 activations) does not replace one for the CPU."""
    if output is not None:
        return output
    if checkpoint is None:
        name = preset or DEFAULT_PRESET
    else:  # resolved: `--checkpoint .` is named after the current folder; a folder keeps its dots (MiniMind2-v1.5)
        resolved = Path(checkpoint).resolve()
        name = resolved.name if resolved.is_dir() else resolved.stem
        if not name:
            raise ToolkitError(
                f"--checkpoint {checkpoint} has no name to call the artifact folder after; pass --output DIR"
            )
    name = name.lower()
    suffixes = [d for d in (dtype, activations) if d not in (None, "float32")]
    return DEFAULT_ROOT / "-".join([name, *suffixes])


def _require_export_extra() -> None:
    """An export needs the `export` extra (PyTorch, torch.onnx's onnxscript, onnx-ir, safetensors); the base install
    holds only what inspect, generate and a golden replay need."""
    missing = export_extra_error()
    if missing is not None:
        raise ToolkitError(
            "exporting needs the export extra (PyTorch, onnxscript, onnx-ir, safetensors), which does not import "
            f"here ({missing}); install it: {EXPORT_EXTRA}"
        )


def _export_settings(block_size, accuracy_level, lm_head, embedding, activations, trace_all_layers) -> dict:
    """export_artifact's keyword arguments beyond the model, folder, dtype, loss and tokenizer."""
    from exporter.artifact.quantization import QuantizationSettings

    quantization = QuantizationSettings(block_size, accuracy_level, lm_head, embedding, activations)
    return {"quantization": quantization, "trace_all_layers": trace_all_layers}


def _export(
    preset,
    seed,
    output,
    dtype,
    no_loss,
    tokenizer=None,
    checkpoint=None,
    config_path=None,
    settings=None,
    no_tokenizer=False,
):
    """Export as the command line says: --tokenizer, else the checkpoint's own unless --no-tokenizer."""
    if tokenizer is not None and no_tokenizer:
        raise click.UsageError("give --tokenizer or --no-tokenizer, not both")
    _require_export_extra()
    from exporter.artifact.destination import check_destination
    from exporter.export.pipeline import export_artifact  # torch.onnx is slow to import; keep --help fast

    activations = settings["quantization"].activations if settings else None
    folder = _output_folder(output, preset, checkpoint, dtype, activations)
    check_destination(folder)  # cheap: before a --checkpoint (gigabytes, perhaps inside the folder) is read
    sourced = _model_and_source(preset, seed, checkpoint, config_path, tokenizer is None and not no_tokenizer)
    return sourced.model, export_artifact(
        sourced.model,
        folder,
        dtype=dtype,
        with_loss=not no_loss,
        source=sourced.source,
        tokenizer=tokenizer if tokenizer is not None else sourced.tokenizer,
        **(settings or {}),
    )


@click.group(
    cls=OneLineErrorGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.pass_context
def main(ctx):
    """Export MiniMind to ONNX (prefill + cached decode graphs) and prove that ONNX Runtime reproduces
    the PyTorch reference: logits, present KV and loss, on every available execution provider.

    With no command, runs `export-onnx run`: export the minimind-3 preset with seeded weights to
    artifacts/minimind-3, then verify it.

    Exit codes: 0 success, 1 parity failure, 2 usage or input error, 3 internal error, 130/143
    interrupted (SIGINT/SIGTERM), 141 stdout closed early (e.g. piped into head).
    """
    begin_command()
    if ctx.invoked_subcommand is None:
        ctx.invoke(run)


@main.command()
@export_options
@provider_option
@genai_option
@verify_options
@common_options
@handle_errors
def run(
    preset,
    checkpoint,
    config_path,
    seed,
    output,
    dtype,
    block_size,
    accuracy_level,
    lm_head,
    embedding,
    activations,
    trace_all_layers,
    no_loss,
    tokenizer,
    no_tokenizer,
    providers,
    runtimes,
    genai,
    as_json,
    quiet,
    verbose,
    **options,
):
    """Export a preset or a checkpoint, then verify the artifact against the reference (the default command)."""
    setup_logging(verbose, quiet)
    options = VerifyOptions(**options)
    from exporter.cli.export_report import format_export
    from exporter.verify.reports import format_verify

    # a bad verification option must not cost an export
    plan = verification_plan(
        _output_folder(output, preset, checkpoint, dtype, activations),
        providers,
        runtimes,
        genai,
        options,
        planned=_planned_artifact(preset, seed, checkpoint, dtype),
    )
    settings = _export_settings(block_size, accuracy_level, lm_head, embedding, activations, trace_all_layers)
    model, exported = _export(
        preset, seed, output, dtype, no_loss, tokenizer, checkpoint, config_path, settings, no_tokenizer
    )
    report = run_verification(exported.folder, providers, runtimes, genai, options, plan, model)
    finish_verification(
        report,
        options,
        {"export": exported.to_dict(), "verify": report.to_dict()},
        as_json,
        format_export(exported) + "\n\n" + format_verify(report),
    )


@main.command()
@export_options
@common_options
@handle_errors
def export(
    preset,
    checkpoint,
    config_path,
    seed,
    output,
    dtype,
    block_size,
    accuracy_level,
    lm_head,
    embedding,
    activations,
    trace_all_layers,
    no_loss,
    tokenizer,
    no_tokenizer,
    as_json,
    quiet,
    verbose,
):
    """Export prefill.onnx, decode.onnx, one shared weights file, manifest.json, and the configs that let
    onnxruntime-genai and Optimum load the folder as it is."""
    setup_logging(verbose, quiet)
    from exporter.cli.export_report import format_export

    settings = _export_settings(block_size, accuracy_level, lm_head, embedding, activations, trace_all_layers)
    _, exported = _export(
        preset, seed, output, dtype, no_loss, tokenizer, checkpoint, config_path, settings, no_tokenizer
    )
    emit(exported.to_dict(), as_json, format_export(exported))


@main.command()
@click.argument("folder", type=PathOption(), default=DEFAULT_ROOT / DEFAULT_PRESET)
@provider_option
@genai_option
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
def verify(folder, providers, runtimes, genai, golden, reference, quality_text, as_json, quiet, verbose, **options):
    """Verify an artifact FOLDER: against the PyTorch reference (prefill, a 64-step decode error curve,
    greedy tokens, the shape sweep), with reference-free invariants, fp16 health, a repeat run,
    providers against each other, and onnxruntime-genai's greedy tokens on the folder as it is.

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
        _verify_foreign(folder, writer, reference, providers, runtimes, genai, golden, quality_text, options, as_json)
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
    report = run_verification(folder, providers, runtimes, genai, options, plan, golden=golden)
    finish_verification(report, options, report.to_dict(), as_json, format_verify(report))


def _verify_foreign(
    folder, writer, reference, providers, runtimes, genai, golden, quality_text, options, as_json
) -> None:
    """verify of a folder another exporter wrote, against transformers' model of --reference."""
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
            ("--genai", genai),
            ("--runtime", [name for name in runtimes if name != DEFAULT_RUNTIME]),
        )
        if value
    ]
    if given:
        raise click.UsageError(f"{', '.join(given)} cannot serve a folder {writer} wrote; drop it")
    overrides, settings, *_ = verification_plan(folder, providers, (), genai, options)
    report = verify_foreign(folder, reference, list(providers) or None, settings, overrides, quality_text)
    finish_verification(report, options, report.to_dict(), as_json, format_verify(report))


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


STDIN = "-"  # --prompt -: the text piped in, as many CLIs read a file argument of "-"


def _stdin_text() -> str:
    """The prompt piped in, less the one line end (LF, or CRLF from Windows tools) that `echo` and text files put
    after it."""
    if sys.stdin is None:  # started with stdin closed (`<&-`)
        raise click.BadParameter("stdin is closed; pipe the prompt in", param_hint="--prompt -")
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise click.BadParameter(
            f"stdin is not UTF-8 text ({exc.reason} at byte {exc.start}); pipe in UTF-8 text", param_hint="--prompt -"
        ) from None
    return text.removesuffix("\r\n") if text.endswith("\r\n") else text.removesuffix("\n")


def _encode_prompt(tokenizer, text: str) -> list[int]:
    where = "--prompt"
    if text == STDIN:
        text, where = _stdin_text(), "--prompt - (stdin)"
    try:  # bytes that are no UTF-8 in the command line reach Python as lone surrogates, which no tokenizer takes
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise click.BadParameter(
            f"the text is not valid UTF-8 (at character {exc.start}); give UTF-8 text", param_hint=where
        ) from None
    ids = tokenizer.encode(text).ids
    if not ids:  # said here: the runtime's "the prompt is empty" would deny the text the user gave
        raise click.BadParameter(
            f"{text!r} encodes to no tokens with this tokenizer; give text that it covers", param_hint=where
        )
    return ids


def _check_generate_options(folder, prompt_ids, prompts, chat, system, tokenizer, sample, ignore_eos, save_optimized):
    """generate's option combinations, refused before anything is read."""
    if sum(map(bool, (prompt_ids, prompts, chat))) != 1:
        raise click.UsageError("give exactly one of --prompt-ids, --prompt and --chat")
    if system is not None and not chat:
        raise click.UsageError("--system opens a --chat conversation; add --chat, or drop --system")
    if chat and tokenizer is not None:
        raise click.UsageError("--chat reads the artifact's own tokenizer and chat template; drop --tokenizer")
    if chat and ignore_eos:
        raise click.UsageError("--chat ends the reply at the template's end-of-turn token; drop --ignore-eos")
    if tokenizer is not None and not prompts:
        raise click.UsageError("--tokenizer reads --prompt text; with --prompt-ids, drop it")
    if prompts.count(STDIN) > 1:
        raise click.UsageError("--prompt - reads one prompt, all of stdin; give it once")
    context = click.get_current_context()
    sampling_flags = [
        f"--{name.replace('_', '-')}"
        for name in ("temperature", "top_k", "top_p", "seed")
        if context.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    ]
    if sampling_flags and not sample:  # as transformers warns of: greedy decoding would ignore them
        one = len(sampling_flags) == 1
        raise click.UsageError(
            f"{', '.join(sampling_flags)} only shape{'s' if one else ''} sampling, and without "
            f"--sample the decoding is greedy; add --sample, or drop {'it' if one else 'them'}"
        )
    check_text_path(folder, "artifact folder", TEXT_PATH_FIX)
    if save_optimized is not None:
        check_text_path(save_optimized, "--save-optimized", TEXT_PATH_FIX)
        check_output_path(save_optimized, "--save-optimized", folder=True)
        check_outside_artifact(save_optimized, "--save-optimized", folder)


ENGINES = ("ort", "genai")


def _check_engine_options(engine, batch, repetition_penalty, ignore_eos, provider, prompt_chunk, save_optimized):
    """--engine genai refused, before anything is read, with each option onnxruntime-genai's loop cannot honour (it
    runs one prompt on the CPU, the prompt in one call, with sessions and an EOS of its own), and where
    onnxruntime-genai does not import."""
    if engine != "genai":
        return
    from exporter.runtime.genai import INSTALL_HINT, genai_version
    from exporter.runtime.sessions import CPU, provider_name

    refusals = (
        (batch > 1, f"a batch ({batch} prompts): it runs one prompt at a time", "give one --prompt-ids or --prompt"),
        (
            repetition_penalty != 1.0,
            f"--repetition-penalty {repetition_penalty}: it has no penalty held to MiniMind's rule",
            "drop --repetition-penalty",
        ),
        (ignore_eos, "--ignore-eos: it always stops at the model's eos", "drop --ignore-eos"),
        (provider_name(provider) != CPU, f"--provider {provider}: it runs on the CPU here", "drop --provider"),
        (prompt_chunk is not None, "--prompt-chunk: it runs the prompt in one call", "drop --prompt-chunk"),
        (save_optimized is not None, "--save-optimized: it saves no optimised graphs", "drop --save-optimized"),
    )
    for refused, what, fix in refusals:
        if refused:
            raise click.UsageError(f"--engine genai cannot honour {what}; {fix}, or use --engine ort")
    if genai_version() is None:
        raise ConsumerError(
            f"--engine genai needs onnxruntime-genai, which does not import here; {INSTALL_HINT}, or use --engine ort"
        )


def _genai_generator(artifact, threads):
    """The artifact loaded in onnxruntime-genai for --engine genai; where it cannot be, the reason and the way out."""
    from exporter.runtime.genai import GenaiGenerator

    try:
        return GenaiGenerator(artifact, threads)
    except ConsumerError as exc:
        raise ConsumerError(f"--engine genai: {exc}; or use --engine ort") from None


def _prompt_batch(folder, manifest, prompt_ids, prompts, tokenizer) -> tuple:
    """(the prompts as id lists, the tokenizer of --prompt text or None): text in, text out; ids in, ids out."""
    from exporter.artifact.tokenizer import TOKENIZER, load_tokenizer

    if not prompts:
        return [_parse_ids(text) for text in prompt_ids], None
    # the artifact's own: the one its manifest lists (and read_manifest has hashed), not any file there
    if tokenizer is None and TOKENIZER not in manifest.files:
        raise click.UsageError(
            f"--prompt needs a tokenizer: the artifact {folder} lists no {TOKENIZER}; pass "
            "--tokenizer PATH or re-export with --tokenizer"
        )
    text_tokenizer = load_tokenizer(tokenizer or folder, manifest.config.vocab_size)
    return [_encode_prompt(text_tokenizer, text) for text in prompts], text_tokenizer


def _chat_prompt(folder, manifest, messages) -> tuple:
    """(the conversation's prompt ids, its text, the artifact's tokenizer, the end-of-turn id or None): the
    artifact's chat template rendered as transformers renders it, encoded with its tokenizer.json."""
    from exporter.artifact.chat import chat_prompt_ids, read_chat_template
    from exporter.artifact.tokenizer import TOKENIZER, load_tokenizer

    if TOKENIZER not in manifest.files:
        raise click.UsageError(
            f"--chat needs the artifact's tokenizer: {folder} lists no {TOKENIZER}; re-export it with its tokenizer"
        )
    template = read_chat_template(folder, manifest.files)
    text_tokenizer = load_tokenizer(folder, manifest.config.vocab_size)
    rendered = template.render(messages)
    end_of_turn = template.end_of_turn_id(text_tokenizer)
    return chat_prompt_ids(text_tokenizer, rendered), rendered, text_tokenizer, end_of_turn


def _print_stream(steps, text_tokenizer) -> None:
    """A lone row's tokens (or text) printed as the stream gives them (it ends after a stop id)."""
    from exporter.artifact.tokenizer import TextStream

    text = TextStream(text_tokenizer) if text_tokenizer is not None else None
    try:
        for (token,) in steps:
            echo_result(text.push(token) if text else f"{token} ", nl=False)
    finally:  # the streamed line ends here, an interrupted one too: an error message gets a line of its own
        echo_result(text.rest() if text else "")


@main.command()
@click.argument("folder", type=PathOption(), default=DEFAULT_ROOT / DEFAULT_PRESET)
@click.option(
    "--prompt-ids",
    "prompt_ids",
    multiple=True,
    metavar="IDS",
    help="Prompt token ids, comma or space separated. Repeat for a batch (left-padded).",
)
@click.option(
    "--prompt",
    "prompts",
    multiple=True,
    metavar="TEXT",
    help="Prompt text (needs a tokenizer); - reads it from stdin. Repeat for a batch.",
)
@click.option(
    "--chat",
    "chat",
    multiple=True,
    metavar="TEXT",
    help="A turn of a conversation, rendered with the artifact's chat template. Repeated, the turns alternate "
    "user, assistant, user, ...: give an odd number; the model answers the last, and the reply ends at the "
    "template's end-of-turn token (tokenizer_config.json's eos_token).",
)
@click.option("--system", default=None, metavar="TEXT", help="With --chat: the system message, before the turns.")
@click.option(
    "--tokenizer",
    type=PathOption(),
    default=None,
    help="tokenizer.json, or a folder with it, for --prompt text [default: the artifact's own].",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=0),
    default=32,
    show_default=True,
    help="Most tokens to generate per prompt; generation stops earlier at eos or a --stop-id.",
)
@click.option("--sample", is_flag=True, help="Sample instead of greedy decoding (MiniMind's generate).")
@click.option(
    "--temperature", type=float, default=MINIMIND_SAMPLING["temperature"], show_default=True, help="With --sample."
)
@click.option(
    "--top-k", type=int, default=MINIMIND_SAMPLING["top_k"], show_default=True, help="With --sample; 0 disables."
)
@click.option(
    "--top-p", type=float, default=MINIMIND_SAMPLING["top_p"], show_default=True, help="With --sample; 1 disables."
)
@click.option(
    "--repetition-penalty",
    type=float,
    default=1.0,
    show_default=True,
    help="Divide the logits of ids already present by this (MiniMind's rule).",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed of the sampler; each row of a batch draws from its own generator with it, so a row "
    "samples as it would alone.",
)
@click.option("--stop-id", "stop_ids", type=int, multiple=True, help="Extra stop token id; repeatable.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the model's eos token.")
@click.option(
    "--provider",
    default="cpu",
    show_default=True,
    metavar="NAME",
    help="Execution provider to generate on (cpu, cuda, or a full name such as CUDAExecutionProvider).",
)
@click.option(
    "--threads",
    type=int,
    default=0,
    show_default=True,
    help="Intra-op threads of each ONNX Runtime session, 0 to 1024; 0 = one per core.",
)
@click.option(
    "--prompt-chunk",
    type=click.IntRange(min=0),
    default=None,
    help="Prompt tokens per decode.onnx call [default: 128]: peak memory grows with it; 0 = the whole prompt at once.",
)
@click.option(
    "--save-optimized",
    type=PathOption(),
    default=None,
    metavar="DIR",
    help="Also save the graphs as ONNX Runtime optimised them, into DIR.",
)
@click.option(
    "--engine",
    type=click.Choice(ENGINES),
    default="ort",
    show_default=True,
    help="ort: our runtime on ONNX Runtime. genai: onnxruntime-genai's own loop on the same folder (CPU, one "
    "prompt; no --repetition-penalty, --ignore-eos, --prompt-chunk or --save-optimized).",
)
@common_options
@handle_errors
def generate(
    folder,
    prompt_ids,
    prompts,
    chat,
    system,
    tokenizer,
    max_new_tokens,
    sample,
    temperature,
    top_k,
    top_p,
    repetition_penalty,
    seed,
    stop_ids,
    ignore_eos,
    provider,
    threads,
    prompt_chunk,
    save_optimized,
    engine,
    as_json,
    quiet,
    verbose,
):
    """Generate with ONNX Runtime, printing tokens as they are produced.

    Prompts are token ids (--prompt-ids), text (--prompt, with a tokenizer.json; --prompt - reads it from
    stdin), or a conversation (--chat, with --system) that the artifact's chat template renders as
    transformers' apply_chat_template does (with jinja2). Without --sample the decoding is greedy. --engine
    genai runs the same folder through onnxruntime-genai's generation loop instead (one prompt, on the CPU; its
    own sampler; a conversation rendered by its own tokenizer). Every prompt and option is checked before the
    model loads. FOLDER defaults to artifacts/minimind-3.
    """
    setup_logging(verbose, quiet)
    from exporter.artifact.chat import chat_messages
    from exporter.artifact.consumers import genai_eos_token_id
    from exporter.artifact.folder import Artifact
    from exporter.artifact.manifest import unchanged_while_read
    from exporter.runtime.generation import SamplingConfig, check_request, generate, stream
    from exporter.runtime.runner import OrtRunner
    from exporter.runtime.sessions import SessionSettings, check_provider

    _check_generate_options(folder, prompt_ids, prompts, chat, system, tokenizer, sample, ignore_eos, save_optimized)
    messages = chat_messages(chat, system) if chat else None
    _check_engine_options(
        engine,
        len(prompt_ids) + len(prompts) + bool(chat),
        repetition_penalty,
        ignore_eos,
        provider,
        prompt_chunk,
        save_optimized,
    )
    provider = check_provider(provider)
    settings = SessionSettings(
        intra_op_threads=threads,
        optimized_model_dir=save_optimized,
        **({} if prompt_chunk is None else {"prompt_chunk": prompt_chunk}),
    )
    with unchanged_while_read(folder):  # until the sessions hold what they need: an export may swap it after
        artifact = Artifact.open(folder)
        manifest, config = artifact.manifest, artifact.manifest.config
        if messages is None:
            batch, text_tokenizer = _prompt_batch(folder, manifest, prompt_ids, prompts, tokenizer)
        else:
            prompt, rendered, text_tokenizer, end_of_turn = _chat_prompt(folder, manifest, messages)
            batch, stop_ids = [prompt], (*stop_ids, *([] if end_of_turn is None else [end_of_turn]))
        sampling = SamplingConfig(
            do_sample=sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
        )
        if engine == "genai":  # its own EOS: the model's, or for a model without one the id genai_config.json names
            eos = genai_eos_token_id(config.eos_token_id, config.vocab_size)
        else:
            eos = None if ignore_eos else config.eos_token_id
        check_request(config, batch, max_new_tokens, sampling, eos, stop_ids)  # before the sessions load
        if engine == "genai":
            generator = _genai_generator(artifact, threads)
            if messages is not None:  # the conversation as onnxruntime-genai's own tokenizer renders it
                batch = [generator.chat_prompt(messages, rendered)]
                check_request(config, batch, max_new_tokens, sampling, eos, stop_ids)
        else:
            runner = OrtRunner(artifact, provider, settings=settings)
    if engine == "genai":
        [prompt] = batch
        if not as_json:  # printed as it comes, one token at a time
            steps = generator.stream(prompt, max_new_tokens, sampling, stop_ids)
            _print_stream(([token] for token in steps), text_tokenizer)
            return
        results = [generator.generate(prompt, max_new_tokens, sampling, stop_ids)]
    elif len(batch) == 1 and not as_json:  # printed as it comes, one step at a time
        _print_stream(stream(runner, batch, max_new_tokens, sampling, eos, stop_ids), text_tokenizer)
        return
    else:
        results = generate(runner, batch, max_new_tokens, sampling, eos, stop_ids)
    decoded = [text_tokenizer.decode(result.new_ids) if text_tokenizer else None for result in results]
    rows = [
        {**result.to_dict(), "engine": engine, **({"text": t} if t is not None else {})}
        for result, t in zip(results, decoded)
    ]
    emit(
        rows,
        as_json,
        "\n".join(t if t is not None else " ".join(map(str, result.new_ids)) for result, t in zip(results, decoded)),
    )


@main.command()
@click.argument("folder", type=PathOption(), default=DEFAULT_ROOT / DEFAULT_PRESET)
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


@main.command("install-node")
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


# At the end: the definitions above run for a tenth of a second too (click's types call gettext, which reads the disk).
for _signum, _handler in _BEFORE_IMPORTS.items():
    if signal.getsignal(_signum) is _interrupted_while_starting and _handler is not None:  # None: not Python's
        signal.signal(_signum, _handler)
