"""`export-onnx generate`: tokens from an artifact, through our runtime on ONNX Runtime or onnxruntime-genai's loop.

The command checks its options and reads its prompts (generate_input.py), loads the engine while the folder is held
unchanged, then streams a lone prompt's tokens or prints every row's at the end."""

from __future__ import annotations

from typing import NamedTuple

import click

from exporter.artifact.consumers import MINIMIND_SAMPLING
from exporter.cli.generate_input import check_engine_options, check_generate_options, read_prompts
from exporter.cli.options import PathOption, common_options, folder_argument
from exporter.cli.outcome import echo_result, emit, handle_errors, setup_logging
from exporter.errors import ConsumerError

ENGINES = ("ort", "genai")


class _Request(NamedTuple):
    """A generation as the runtime's check_request, stream and generate take it, after the config or runner."""

    batch: list
    max_new_tokens: int
    sampling: object  # a SamplingConfig
    eos_token_id: int | None
    stop_ids: tuple


@click.command("generate")
@folder_argument
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
    from exporter.artifact.folder import Artifact
    from exporter.artifact.manifest import unchanged_while_read
    from exporter.runtime.generation import SamplingConfig, check_request
    from exporter.runtime.providers import check_provider
    from exporter.runtime.runner import OrtRunner
    from exporter.runtime.settings import SessionSettings

    check_generate_options(folder, prompt_ids, prompts, chat, system, tokenizer, sample, ignore_eos, save_optimized)
    messages = chat_messages(chat, system) if chat else None
    check_engine_options(
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
        config = artifact.manifest.config
        batch, stop_ids, text_tokenizer, rendered = read_prompts(
            folder, artifact.manifest, prompt_ids, prompts, tokenizer, messages, stop_ids
        )
        sampling = SamplingConfig(
            do_sample=sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
        )
        request = _Request(batch, max_new_tokens, sampling, _eos_token_id(engine, config, ignore_eos), stop_ids)
        check_request(config, *request)  # before the sessions load
        if engine == "genai":
            generator = _genai_generator(artifact, threads)
            if messages is not None:  # the conversation as onnxruntime-genai's own tokenizer renders it
                request = request._replace(batch=[generator.chat_prompt(messages, rendered)])
                check_request(config, *request)
        else:
            runner = OrtRunner(artifact, provider, settings=settings)
    if engine == "genai":
        results = _generate_genai(generator, request, text_tokenizer, as_json)
    else:
        results = _generate_ort(runner, request, text_tokenizer, as_json)
    if results is not None:  # None: printed as it came
        _emit_results(results, engine, text_tokenizer, as_json)


def _eos_token_id(engine, config, ignore_eos) -> int | None:
    """The id that stops a row: for genai its own EOS (the model's, or for a model without one the id
    genai_config.json names); for ort the model's, unless --ignore-eos."""
    from exporter.artifact.consumers import genai_eos_token_id

    if engine == "genai":
        return genai_eos_token_id(config.eos_token_id, config.vocab_size)
    return None if ignore_eos else config.eos_token_id


def _genai_generator(artifact, threads):
    """The artifact loaded in onnxruntime-genai for --engine genai; where it cannot be, the reason and the way out."""
    from exporter.runtime.genai import GenaiGenerator

    try:
        return GenaiGenerator(artifact, threads)
    except ConsumerError as exc:
        raise ConsumerError(f"--engine genai: {exc}; or use --engine ort") from None


def _generate_genai(generator, request: _Request, text_tokenizer, as_json: bool) -> list | None:
    """onnxruntime-genai's loop on the one prompt: its tokens printed as they come (None), or under --json its
    Generation."""
    [prompt] = request.batch
    if not as_json:  # printed as it comes, one token at a time
        steps = generator.stream(prompt, request.max_new_tokens, request.sampling, request.stop_ids)
        _print_stream(([token] for token in steps), text_tokenizer)
        return None
    return [generator.generate(prompt, request.max_new_tokens, request.sampling, request.stop_ids)]


def _generate_ort(runner, request: _Request, text_tokenizer, as_json: bool) -> list | None:
    """Our runtime on ONNX Runtime: a lone prompt's tokens printed as they come (None), else every row's
    Generation."""
    from exporter.runtime.generation import generate, stream

    if len(request.batch) == 1 and not as_json:  # printed as it comes, one step at a time
        _print_stream(stream(runner, *request), text_tokenizer)
        return None
    return generate(runner, *request)


def _print_stream(steps, text_tokenizer) -> None:
    """A lone row's tokens (or text) printed as the stream gives them (it ends after a stop id)."""
    from exporter.artifact.tokenizer import TextStream

    text = TextStream(text_tokenizer) if text_tokenizer is not None else None
    try:
        for (token,) in steps:
            echo_result(text.push(token) if text else f"{token} ", nl=False)
    finally:  # the streamed line ends here, an interrupted one too: an error message gets a line of its own
        echo_result(text.rest() if text else "")


def _emit_results(results, engine, text_tokenizer, as_json: bool) -> None:
    """Every row's new tokens: as text where the prompts were text, else as ids; under --json one object a row."""
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
