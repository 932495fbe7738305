"""onnxruntime-genai as a consumer of an artifact folder: its own generation loop over decode.onnx.

The folder is loaded as it is (genai_config.json beside the graph), on the
CPU. onnxruntime-genai stops at EOS and leaves the EOS token out of its
sequence (`greedy` returns that sequence); our runtime and the reference keep
it. `stream` and `generate` read each token as genai picks it, the EOS
included, so that they end as our runtime's generation does. A model without
an EOS still stops in genai, at the id consumers.genai_eos_token_id names.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from exporter.artifact.consumers import GENAI_CONFIG, genai_eos_token_id, genai_unsupported
from exporter.artifact.folder import Artifact, open_artifact
from exporter.artifact.paths import TEXT_PATH_FIX, check_text_path, read_json_bounded
from exporter.errors import ArtifactError, ConsumerError, InputError, first_line
from exporter.runtime.generation import Generation, SamplingConfig, check_request
from exporter.runtime.runner import check_prompt

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install onnxruntime-genai"


def genai_version() -> str | None:
    """The installed onnxruntime-genai version, or None when it cannot be imported."""
    try:
        import onnxruntime_genai
    except ImportError:
        return None
    return onnxruntime_genai.__version__


def _import_genai():
    try:
        import onnxruntime_genai
    except ImportError:
        raise ConsumerError(f"onnxruntime-genai is not installed; {INSTALL_HINT}") from None
    return onnxruntime_genai


def genai_model_type(folder: Path) -> str:
    """The model type genai_config.json names; ArtifactError, in one line, when the file is no JSON that names
    one (an edit listed again in the manifest: its hash alone cannot tell)."""
    path = Path(folder) / GENAI_CONFIG
    try:
        return read_json_bounded(path)["model"]["type"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as exc:  # not JSON, or JSON without model.type
        raise ArtifactError(
            f"{path} is not onnxruntime-genai's config ({type(exc).__name__}: {first_line(exc)}); "
            "undo the edit or re-export the folder"
        ) from None


class GenaiGenerator:
    """An artifact folder loaded once in onnxruntime-genai (CPU); `greedy` and `greedy_search` may be called many
    times."""

    def __init__(self, artifact: Artifact | Path, threads: int = 0):
        """`artifact`: an opened Artifact, or an artifact folder's path, opened here (every hash checked);
        `threads`: intra-op threads for its session, 0 for what genai_config.json asks (one per physical core)."""
        og = _import_genai()
        artifact = open_artifact(artifact)
        self.folder, self.manifest = artifact.folder, artifact.manifest
        folder = self.folder
        reason = genai_unsupported(self.manifest)
        if reason:
            raise ConsumerError(f"{folder} cannot run in onnxruntime-genai: {reason}")
        if GENAI_CONFIG not in self.manifest.files:  # listed, so hashed: what the export wrote
            raise ConsumerError(
                f"{folder} has no {GENAI_CONFIG}; re-export it with this toolkit to run it in onnxruntime-genai"
            )
        self.model_type = genai_model_type(self.folder)
        check_text_path(folder, "artifact folder", TEXT_PATH_FIX, ArtifactError)
        try:
            config = og.Config(str(self.folder))
            config.clear_providers()  # the CPU
            if threads:  # over genai_config.json's own count, without rewriting the hashed file
                options = {"intra_op_num_threads": threads}
                config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
            self.model = og.Model(config)
        except Exception as exc:  # onnxruntime-genai raises RuntimeError with the runtime's message
            raise ConsumerError(f"onnxruntime-genai could not load {folder}: {first_line(exc)}") from exc
        self._og = og

    @property
    def eos_token_id(self) -> int:
        """The id onnxruntime-genai stops at (genai_config.json's): the model's EOS, or the last id for a model
        without one."""
        config = self.manifest.config
        return genai_eos_token_id(config.eos_token_id, config.vocab_size)

    def search(self, max_length: int, sampling: SamplingConfig = SamplingConfig(), stop_at_eos: bool = True):
        """A new onnxruntime-genai Generator on this model, for sequences of up to `max_length` tokens, prompt
        included: greedy, or sampled by genai's own sampler with `sampling`'s temperature, top-k, top-p and
        seed; the caller appends the prompt and steps it. Without `stop_at_eos` it never picks EOS and runs to
        max_length (a benchmark times a fixed number of steps)."""
        check_genai_sampling(sampling)
        options = {"do_sample": False, "num_beams": 1, "max_length": max_length}
        if sampling.do_sample:
            options.update(
                do_sample=True,
                temperature=float(sampling.temperature),
                # genai reads a top_k of 0 as "keep all" too; the vocabulary says it without relying on that
                top_k=int(sampling.top_k) or self.manifest.config.vocab_size,
                top_p=float(sampling.top_p),
                random_seed=int(sampling.seeds(1)[0]),
            )
        if not stop_at_eos:
            options["min_length"] = max_length  # below min_length genai masks EOS out of the choice
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(**options)
        return self._og.Generator(self.model, params)

    def greedy_search(self, max_length: int, stop_at_eos: bool = True):
        """`search` without sampling."""
        return self.search(max_length, stop_at_eos=stop_at_eos)

    def stream(
        self, prompt_ids, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(), stop_ids=()
    ) -> Iterator[int]:
        """An iterator yielding each new token as genai picks it. It ends after genai's EOS (`eos_token_id`) or
        a stop id, either yielded, or after `max_new_tokens`. Everything is checked here, before anything runs."""
        prompt, stops = self._check(prompt_ids, max_new_tokens, sampling, stop_ids)
        return self._steps(prompt, max_new_tokens, sampling, stops)

    def generate(
        self, prompt_ids, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(), stop_ids=()
    ) -> Generation:
        """Generate to the end (as `stream` does): the row as our runtime's `generate` gives it, the stop id
        included."""
        prompt, stops = self._check(prompt_ids, max_new_tokens, sampling, stop_ids)
        result = Generation(prompt)
        for token in self._steps(prompt, max_new_tokens, sampling, stops):
            result.add(token, stops)
        return result

    def _check(self, prompt_ids, max_new_tokens, sampling, stop_ids) -> tuple[list[int], set[int]]:
        check_genai_sampling(sampling)
        [prompt], stops = check_request(
            self.manifest.config, [prompt_ids], max_new_tokens, sampling, self.eos_token_id, stop_ids
        )
        return prompt, stops

    def _steps(self, prompt: list[int], max_new_tokens: int, sampling, stops: set[int]) -> Iterator[int]:
        if max_new_tokens == 0:
            return
        generator = self.search(len(prompt) + max_new_tokens, sampling)
        generator.append_tokens(prompt)
        for _ in range(max_new_tokens):
            generator.generate_next_token()
            # the token just picked, which get_sequence leaves out where it is genai's EOS
            token = int(generator.get_next_tokens()[0])
            yield token
            if token in stops or generator.is_done():
                return

    def chat_prompt(self, messages: list[dict], rendered: str | None = None) -> list[int]:
        """The prompt ids of a conversation (exporter.artifact.chat.chat_messages) as onnxruntime-genai makes them:
        its tokenizer renders the folder's chat template (tokenizer_config.json's) with the assistant's header
        after it, then encodes the text. Its renderer is its own, not jinja2 (as of 0.18.0 it keeps the line ends
        and indentation that transformers' trim_blocks and lstrip_blocks drop): where its text differs from
        `rendered` (the conversation as transformers renders it), a warning shows where.

        Raises:
            ConsumerError: onnxruntime-genai cannot load the tokenizer or render the template.
        """
        try:
            tokenizer = self._og.Tokenizer(self.model)
            text = tokenizer.apply_chat_template(json.dumps(messages), add_generation_prompt=True)
            ids = [int(token) for token in tokenizer.encode(text)]
        except Exception as exc:  # onnxruntime-genai raises RuntimeError with its tokenizer's message
            raise ConsumerError(
                f"onnxruntime-genai could not render the chat template of {self.folder}: {first_line(exc)}"
            ) from None
        if rendered is not None and text != rendered:
            at = next((i for i, (a, b) in enumerate(zip(text, rendered)) if a != b), min(len(text), len(rendered)))
            log.warning(
                "onnxruntime-genai renders the chat template of %s otherwise than transformers: from character %d, "
                "%r where transformers has %r",
                self.folder,
                at,
                text[at : at + 24],
                rendered[at : at + 24],
            )
        return ids

    def greedy(self, prompt_ids, max_new_tokens: int) -> list[int]:
        """New token ids, greedy; stops at EOS, which onnxruntime-genai leaves out."""
        ids = check_prompt(self.manifest.config, prompt_ids, max_new_tokens)
        if max_new_tokens == 0:
            return []
        generator = self.greedy_search(len(ids) + max_new_tokens)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        return [int(token) for token in generator.get_sequence(0)[len(ids) :]]


def check_genai_sampling(sampling: SamplingConfig) -> None:
    """InputError for what onnxruntime-genai's search cannot do as our runtime does: MiniMind's repetition
    penalty (genai has a penalty of its own, not held to that rule here) and a seed per row (genai runs one
    row)."""
    if not isinstance(sampling, SamplingConfig):
        raise InputError(
            f"sampling must be a SamplingConfig, got {type(sampling).__name__}; "
            "write e.g. SamplingConfig(do_sample=True, top_p=0.9)"
        )
    if sampling.repetition_penalty != 1.0:
        raise InputError(
            f"`repetition_penalty` {sampling.repetition_penalty} is applied by our runtime "
            "only (onnxruntime-genai's penalty is not held to MiniMind's rule); use 1, or generate with OrtRunner"
        )
    if isinstance(sampling.seed, (tuple, list)) and len(sampling.seed) != 1:
        raise InputError(f"onnxruntime-genai generates one prompt at a time: give one seed, not {len(sampling.seed)}")


def genai_greedy(folder: Path, prompt_ids, max_new_tokens: int) -> list[int]:
    """Greedy new tokens from onnxruntime-genai for one prompt (EOS, where reached, is left out)."""
    return GenaiGenerator(folder).greedy(prompt_ids, max_new_tokens)
