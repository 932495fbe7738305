"""What `generate` is given: its option combinations, refused before anything is read, and its prompts (token ids,
text, or a conversation rendered with the artifact's chat template) read into token ids."""

from __future__ import annotations

import sys

import click

from exporter.artifact.paths import TEXT_PATH_FIX, check_output_path, check_outside_artifact, check_text_path
from exporter.errors import ConsumerError

STDIN = "-"  # --prompt -: the text piped in, as many CLIs read a file argument of "-"


def check_generate_options(folder, prompt_ids, prompts, chat, system, tokenizer, sample, ignore_eos, save_optimized):
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


def check_engine_options(engine, batch, repetition_penalty, ignore_eos, provider, prompt_chunk, save_optimized):
    """--engine genai refused, before anything is read, with each option onnxruntime-genai's loop cannot honour (it
    runs one prompt on the CPU, the prompt in one call, with sessions and an EOS of its own), and where
    onnxruntime-genai does not import."""
    if engine != "genai":
        return
    from exporter.runtime.genai import INSTALL_HINT, genai_version
    from exporter.runtime.providers import CPU, provider_name

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


def read_prompts(folder, manifest, prompt_ids, prompts, tokenizer, messages, stop_ids) -> tuple:
    """(the prompts as id lists, the stop ids, the tokenizer of the prompts' text or None, the conversation as
    rendered or None): --prompt-ids or --prompt text, else the --chat conversation, whose template's end-of-turn id
    joins the stop ids."""
    if messages is None:
        batch, text_tokenizer = _prompt_batch(folder, manifest, prompt_ids, prompts, tokenizer)
        return batch, stop_ids, text_tokenizer, None
    prompt, rendered, text_tokenizer, end_of_turn = _chat_prompt(folder, manifest, messages)
    return [prompt], (*stop_ids, *([] if end_of_turn is None else [end_of_turn])), text_tokenizer, rendered
