"""A conversation rendered into a prompt with an artifact's chat template, as transformers renders it.

The template is tokenizer_config.json's `chat_template` (copy_tokenizer moves a chat_template.jinja there). It is
rendered with jinja2 in the environment transformers' apply_chat_template compiles templates in
(transformers.utils.chat_template_utils): a sandbox whose templates cannot change the objects they are given, with
trim_blocks and lstrip_blocks, the loopcontrols extension and the `{% generation %}` tag, a `tojson` filter that
leaves HTML characters alone, and the globals raise_exception and strftime_now; the template sees the messages,
`add_generation_prompt` and the tokenizer's named special tokens (bos_token, eos_token, ...). The text is then
encoded without the tokenizer's post-processor (transformers' add_special_tokens=False): the template writes every
special token the model expects. One rendering serves the base install, which has no transformers; the tests hold
its ids to transformers' own.

A reply ends at the template's end-of-turn token: tokenizer_config.json's eos_token (ChatML's <|im_end|>), which a
model's config may name as its eos or not.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from exporter.artifact.paths import read_json_object
from exporter.artifact.tokenizer import SPECIAL_TOKEN_KEYS, TOKENIZER_CONFIG, TextTokenizer, token_content
from exporter.errors import InputError, TokenizerError, first_line

CHAT_EXTRA = "pip install 'export-onnx[chat]'"
ROLES = ("user", "assistant")  # the turns of a conversation alternate, the user's first


def chat_messages(turns: Sequence[str], system: str | None = None) -> list[dict]:
    """The messages of a conversation: `turns` alternate the user's and the assistant's, the user's first, and end
    with the user's for the model to answer (an odd number); `system`, when given, comes first.

    Raises:
        InputError: no turns, an even number of them, or a turn or `system` that is no string.
    """
    if isinstance(turns, str) or not turns or len(turns) % 2 == 0:
        count = "one string, not a list of them" if isinstance(turns, str) else f"{len(turns)} of them"
        raise InputError(
            f"`turns` must alternate the user's and the assistant's, the user's first and last (user, assistant, "
            f"user, ...), got {count}; give an odd number of turns"
        )
    for text in (*turns, *([] if system is None else [system])):
        if not isinstance(text, str):
            raise InputError(f"a turn (or `system`) must be a string, got {type(text).__name__}")
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": ROLES[i % 2], "content": text} for i, text in enumerate(turns)]


def _environment():
    """transformers' jinja2 environment for chat templates; TokenizerError naming the install where jinja2 is
    missing (the base install goes without it)."""
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise TokenizerError(
            f"a chat template is rendered with jinja2, which does not import here ({exc}); install it: {CHAT_EXTRA}"
        ) from None

    class GenerationTag(Extension):
        """{% generation %}...{% endgeneration %}, which marks the assistant's text for transformers' masks:
        rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment, jinja2.exceptions.TemplateError


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template with the special tokens it is rendered with.

    template: the jinja source; special_tokens: tokenizer_config.json's named special tokens (bos_token,
    eos_token, ...) as strings, the template's variables; source: where it was read, as messages name it."""

    template: str
    special_tokens: dict
    source: str

    @property
    def end_of_turn(self) -> str | None:
        """The token that ends the assistant's turn: the tokenizer's eos_token, or None where it names none."""
        return self.special_tokens.get("eos_token")

    def render(self, messages: list[dict]) -> str:
        """The conversation as text, followed by the header of the assistant's reply (add_generation_prompt).

        Raises:
            TokenizerError: jinja2 is missing, or the template does not compile.
            InputError: the template refuses the conversation (raise_exception: roles out of order, say).
        """
        environment, template_error = _environment()
        try:
            compiled = environment.from_string(self.template)
        except template_error as exc:
            raise TokenizerError(
                f"the chat template of {self.source} is no jinja template jinja2 compiles ({first_line(exc)}); "
                "correct it in tokenizer_config.json's chat_template or re-export the folder"
            ) from None
        try:
            return compiled.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except template_error as exc:
            raise InputError(
                f"the chat template of {self.source} refuses this conversation: {first_line(exc)}"
            ) from None

    def end_of_turn_id(self, tokenizer: TextTokenizer) -> int | None:
        """The id of end_of_turn in `tokenizer`, or None."""
        return None if self.end_of_turn is None else tokenizer.loaded.token_to_id(self.end_of_turn)


def chat_prompt_ids(tokenizer: TextTokenizer, rendered: str) -> list[int]:
    """The token ids of a rendered conversation (ChatTemplate.render's text), encoded without the tokenizer's
    post-processor."""
    return tokenizer.encode(rendered, add_special_tokens=False).ids


def read_chat_template(folder: Path, files) -> ChatTemplate:
    """The chat template of the artifact at `folder`, from the tokenizer_config.json its manifest lists (`files`,
    the manifest's file names: what was hashed, not any file there).

    Raises:
        TokenizerError: no tokenizer_config.json listed, one that cannot be read, or one without a chat template.
    """
    path = Path(folder) / TOKENIZER_CONFIG
    fix = "a chat needs an instruct model's template: re-export from a checkpoint that brings one, or prompt with text"
    if TOKENIZER_CONFIG not in files:
        raise TokenizerError(f"the artifact {folder} has no {TOKENIZER_CONFIG}, so no chat template; {fix}")
    config = read_json_object(path, TokenizerError, "tokenizer config", "re-export the folder", repeated_keys=True)
    template = config.get("chat_template")
    if not isinstance(template, str) or not template.strip():
        raise TokenizerError(f"the artifact {folder} has no chat template ({TOKENIZER_CONFIG}'s chat_template); {fix}")
    special = {key: token_content(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
    return ChatTemplate(template, {key: text for key, text in special.items() if isinstance(text, str)}, str(path))
