"""A user's tokenizer in an artifact: checked against the model, copied beside the graphs, loaded for text.

The export copies `tokenizer.json` (Hugging Face `tokenizers` format) and
`tokenizer_config.json` when there is one, or writes a minimal one: both
onnxruntime-genai and transformers need that file beside tokenizer.json.
A chat template travels inside tokenizer_config.json (`chat_template`), the one
place onnxruntime-genai, transformers.js and transformers all read it; a
`chat_template.jinja` beside the source's tokenizer.json (transformers 5 writes
one) is moved in there. A checkpoint brings its own tokenizer
(`checkpoint_tokenizer`): a Transformers folder's files, or the tokenizer
transformers converts from a GGUF's metadata.
Validation reads the JSON directly for the ids and loads the file with the
`tokenizers` library, as every consumer will; that loaded tokenizer turns
text into ids and back (`load_tokenizer`, `TextStream`). Text in and out reads
tokenizer.json only: the checks of tokenizer_config.json are the export's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from exporter.artifact.paths import json_type, read_json_file, read_json_object
from exporter.errors import TokenizerError, first_line

log = logging.getLogger(__name__)

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
# The most bytes of a tokenizer.json read: the vocabularies of published tokenizers take tens of MiB of JSON, far
# more than a settings file (JSON_FILE_LIMIT); a file past this is no tokenizer, and is refused before it fills memory.
TOKENIZER_FILE_LIMIT = 256 << 20
# transformers' generic class for a tokenizer.json; onnxruntime-genai tokenises like `tokenizers` with it.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# transformers 5's name for that class, which its save_pretrained writes: transformers 4 (Optimum's) knows only the
# name above, which transformers 5 still maps to the same class, so a copied config gets that one.
TRANSFORMERS5_TOKENIZER_CLASS = "TokenizersBackend"


def token_content(token):
    """A special token's text as tokenizer_config.json writes the token: a string, or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


@dataclass(frozen=True)
class TokenizerSource:
    """A validated tokenizer.json (and its tokenizer_config.json, if any) to copy into an artifact."""

    tokenizer: Path
    config: Path | None
    tokens: dict[int, str]  # id -> token: the model vocabulary, the added tokens and the post-processor's
    loaded: object = field(compare=False, repr=False)  # the `tokenizers.Tokenizer` read from `tokenizer`
    special: frozenset[int] = frozenset()  # ids of the added tokens marked special
    genai_unreadable: str = ""  # why onnxruntime-genai's tokenizer cannot read it like `tokenizers`, or ""
    missing_byte_symbols: int = 0  # of the 256 a byte-level BPE needs to encode any text
    # Each file is read once: what was checked is what the artifact gets, even if the file changes meanwhile.
    content: bytes = field(default=b"", compare=False, repr=False)  # tokenizer.json as read
    config_data: dict | None = field(default=None, compare=False, repr=False)  # tokenizer_config.json as read
    chat_template: str | None = field(default=None, compare=False, repr=False)  # chat_template.jinja as read

    @property
    def max_id(self) -> int:
        return max(self.tokens)

    def token_id(self, token) -> int | None:
        """The id of a special token as tokenizer_config.json writes it (a string or {"content": ...})."""
        content = token_content(token)
        return next((i for i, t in self.tokens.items() if t == content), None)

    def pad_token_id(self) -> int | None:
        return None if self.config_data is None else self.token_id(self.config_data.get("pad_token"))

    def disagreements(self, model_ids: dict[str, int | None]) -> list[str]:
        """Where tokenizer_config.json names a special token (`bos_token`, `eos_token`, ...) at another id than
        the model's in `model_ids`: generation stops at the model's id (genai_config.json,
        generation_config.json, our runtime), while code that reads the tokenizer's id gets the other."""
        config = self.config_data or {}
        found = []
        for name, model_id in model_ids.items():
            token_id = self.token_id(config.get(name))
            if model_id is not None and token_id is not None and token_id != model_id:
                found.append(
                    f"{self.config.name} names {name} {self.tokens[token_id]!r} (id {token_id}), but the "
                    f"model's {name}_id is {model_id} ({self.tokens.get(model_id, 'not a token')!r}): the "
                    f"consumers' configs and our runtime use {model_id}, code reading the tokenizer's "
                    f"{name}_id gets {token_id}; name the model's token there if they should agree"
                )
        return found


def _tokens(path: Path, data: dict) -> dict[int, str]:
    """The ids tokenizer.json lists: its model's vocabulary plus the added (special) tokens."""
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    try:
        if isinstance(vocab, dict):  # BPE, WordLevel, WordPiece: token -> id
            tokens = {int(i): str(t) for t, i in vocab.items()}
        elif isinstance(vocab, list):  # Unigram: [token, score] in id order
            tokens = {i: str(entry[0]) for i, entry in enumerate(vocab)}
        else:
            raise TokenizerError(
                f"{path} has no model.vocab; expected a Hugging Face tokenizers file "
                "(tokenizer.json, as written by Tokenizer.save or save_pretrained)"
            )
        for added in data.get("added_tokens") or []:
            tokens[int(added["id"])] = str(added["content"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise TokenizerError(
            f"{path} has a malformed vocabulary or added_tokens ({type(exc).__name__}: {exc}); "
            "pass a tokenizer.json written by the tokenizers library"
        ) from None
    if not tokens:
        raise TokenizerError(f"{path} has an empty vocabulary")
    return tokens


def _post_processor_tokens(loaded) -> dict[int, str]:
    """The tokens a post-processor (TemplateProcessing, BertProcessing, ...) adds around every text: it gives
    them ids of its own, which need not be in the vocabulary. They are all an empty text (or pair) encodes to."""
    tokens = {}
    for encoding in (loaded.encode(""), loaded.encode("", "")):
        tokens.update(zip(encoding.ids, encoding.tokens))
    return tokens


def _genai_unreadable(data: dict, loaded) -> str:
    """Why onnxruntime-genai's og.Tokenizer cannot read this tokenizer.json as `tokenizers` does, or ''.

    With onnxruntime-genai 0.18.0 and tokenizers trained in `tokenizers`, only a byte-level BPE (MiniMind's,
    GPT-2's, Qwen's kind: a ByteLevel pre-tokenizer, alone or in a Sequence) encodes and decodes alike.
    Unigram, and BPE over Metaspace, fail to load; BPE over a Whitespace pre-tokenizer loads but encodes
    unknown ids (-1) and decodes without spaces; WordPiece and WordLevel load unreliably and misread (genai's
    loader reads memory it never wrote, which can crash the process)."""
    kind = type(loaded.model).__name__  # older files name no model "type"; `tokenizers` knows it all the same
    if kind != "BPE":
        return f"a {kind} model"
    pre_tokenizer = data.get("pre_tokenizer") or {}
    steps = pre_tokenizer.get("pretokenizers", [pre_tokenizer]) if isinstance(pre_tokenizer, dict) else []
    if not any(isinstance(step, dict) and step.get("type") == "ByteLevel" for step in steps):
        return "a BPE model without a ByteLevel pre-tokenizer"
    return ""


def _missing_byte_symbols(loaded) -> int:
    """How many of the 256 byte symbols (ByteLevel's alphabet) a byte-level BPE's vocabulary lacks: one trained
    without `initial_alphabet=pre_tokenizers.ByteLevel.alphabet()` holds only its corpus's bytes. A character
    needing a missing one is left out by `tokenizers` and encoded as -1 by onnxruntime-genai (as of 0.18.0),
    which the graphs refuse."""
    from tokenizers import pre_tokenizers  # importable: `loaded` was read with it

    vocabulary = loaded.get_vocab(with_added_tokens=False)
    return sum(symbol not in vocabulary for symbol in pre_tokenizers.ByteLevel.alphabet())


def _read_tokenizer(path: Path, vocab_size: int) -> TokenizerSource:
    """A tokenizer.json (or a folder holding one), read and checked to fit the model's vocabulary."""
    if not isinstance(path, (str, os.PathLike)):  # Path(5) raised pathlib's TypeError
        raise TokenizerError(
            f"a tokenizer is the path (str or Path) of a {TOKENIZER} or a folder holding one, got {path!r:.80}"
        )
    path = Path(path)
    tokenizer = path / TOKENIZER if path.is_dir() else path
    if not tokenizer.is_file():
        raise TokenizerError(f"no tokenizer at {tokenizer}; pass a {TOKENIZER} file or a folder that holds one")
    # a key given twice is read as the tokenizers library and transformers read it (the last value), not refused
    content, data = read_json_file(
        tokenizer,
        TokenizerError,
        "tokenizer",
        "pass a tokenizer.json written by the tokenizers library",
        repeated_keys=True,
        limit=TOKENIZER_FILE_LIMIT,
    )
    config = tokenizer.parent / TOKENIZER_CONFIG
    return _checked_source(tokenizer, content, data, config if config.is_file() else None, vocab_size)


def _checked_source(tokenizer: Path, content: bytes, data: dict, config: Path | None, vocab_size: int):
    """The TokenizerSource of tokenizer.json's bytes and the object they hold, its ids held to the vocabulary.

    Args:
        tokenizer: where the bytes came from, as messages name it (a tokenizer.json, or a GGUF).
        content: tokenizer.json's bytes.
        data: the JSON object they hold.
        config: where its tokenizer_config.json comes from, or None.
        vocab_size: the model's vocabulary, which every id must lie in.
    """
    tokens = _tokens(tokenizer, data)
    loaded = _load(tokenizer, content)
    tokens = {**_post_processor_tokens(loaded), **tokens}
    special = frozenset(int(a["id"]) for a in data.get("added_tokens") or [] if a.get("special"))
    unreadable = _genai_unreadable(data, loaded)
    source = TokenizerSource(
        tokenizer,
        config,
        tokens,
        loaded,
        special,
        unreadable,
        0 if unreadable else _missing_byte_symbols(loaded),
        content,
    )
    if min(tokens) < 0 or source.max_id >= vocab_size:
        raise TokenizerError(
            f"tokenizer {tokenizer} has token ids in [{min(tokens)}, {source.max_id}] "
            f"({len(tokens)} tokens) but the model's vocab_size is {vocab_size}: its ids must lie "
            f"in [0, {vocab_size}); pass the tokenizer the model was trained with"
        )
    return source


def find_tokenizer(path: Path, vocab_size: int) -> TokenizerSource:
    """The tokenizer an export copies: a tokenizer.json (or a folder holding one) whose ids fit the model, and
    the tokenizer_config.json and chat_template.jinja beside it, when there are, checked as the consumers will
    read them."""
    source = _read_tokenizer(path, vocab_size)
    template = source.tokenizer.parent / CHAT_TEMPLATE
    if template.is_file():
        try:
            source = dataclasses.replace(source, chat_template=template.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(
                f"chat template {template} is not a readable UTF-8 file ({first_line(exc)}); correct it or leave it out"
            ) from None
    if source.config is None:
        return source
    config = read_json_object(
        source.config,
        TokenizerError,
        "tokenizer config",
        "correct it or leave the tokenizer_config.json out",
        repeated_keys=True,
    )
    return _with_config(source, config, vocab_size)


def _with_config(source: TokenizerSource, config: dict, vocab_size: int) -> TokenizerSource:
    source = dataclasses.replace(source, config_data=config)
    _check_config(source, config, vocab_size)
    return source


def export_tokenizer(tokenizer, vocab_size: int) -> TokenizerSource | None:
    """An export's tokenizer argument as a checked TokenizerSource: None; a path (find_tokenizer); or a source
    already read (a checkpoint's), its ids held to `vocab_size` again, as the model it goes with may be another."""
    if tokenizer is None:
        return None
    if not isinstance(tokenizer, TokenizerSource):
        return find_tokenizer(tokenizer, vocab_size)
    if tokenizer.max_id >= vocab_size:
        raise TokenizerError(
            f"tokenizer {tokenizer.tokenizer} has token ids up to {tokenizer.max_id} but the model's vocab_size is "
            f"{vocab_size}; pass the tokenizer the model was trained with"
        )
    return tokenizer


def gguf_tokenizer(path: Path, vocab_size: int) -> TokenizerSource:
    """The tokenizer transformers converts from a GGUF's metadata, with its special tokens and chat template,
    checked as find_tokenizer checks files (messages name the GGUF for both files)."""
    from reference.gguf import read_gguf_tokenizer

    text, config = read_gguf_tokenizer(path)
    content = text.encode("utf-8")
    source = _checked_source(path, content, json.loads(text), path, vocab_size)
    return _with_config(source, {"tokenizer_class": TOKENIZER_CLASS, **config}, vocab_size)


def checkpoint_tokenizer(checkpoint: Path, vocab_size: int) -> TokenizerSource | None:
    """The tokenizer a checkpoint brings, checked as find_tokenizer checks one: a folder's tokenizer.json (with
    its tokenizer_config.json and chat_template.jinja), a GGUF's own; None for a checkpoint without one."""
    from reference.gguf import is_gguf

    checkpoint = Path(checkpoint)
    if is_gguf(checkpoint):
        return gguf_tokenizer(checkpoint, vocab_size)
    if checkpoint.is_dir() and (checkpoint / TOKENIZER).is_file():
        return find_tokenizer(checkpoint, vocab_size)
    return None


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")

# Fields onnxruntime-genai's tokenizer reads with one JSON type only: given any other (null included), og.Tokenizer
# fails to load with a bare JSON type error, though the model loads. Measured with onnxruntime-genai 0.18.0
# (transformers also accepts a list of named chat templates, which genai does not).
GENAI_CONFIG_TYPES = {
    "tokenizer_class": "string",
    "chat_template": "string",
    "model_max_length": "number",
    "clean_up_tokenization_spaces": "boolean",
}


def _check_config(source: TokenizerSource, config: dict, vocab_size: int) -> None:
    """The special tokens a tokenizer_config.json names must be tokens of tokenizer.json: transformers adds any
    other one as a new token, with an id past the model's vocabulary. The fields onnxruntime-genai reads must
    have the type it reads."""
    for key, expected in GENAI_CONFIG_TYPES.items():
        if key in config and json_type(config[key]) != expected:
            raise TokenizerError(
                f"{source.config}: {key} is a JSON {json_type(config[key])}, but onnxruntime-genai "
                f"reads only a JSON {expected} there (its tokenizer would fail to load); correct it "
                "or leave the tokenizer_config.json out"
            )
    named = [(key, config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key) is not None]
    extra = config.get("additional_special_tokens") or []
    named += [("additional_special_tokens", token) for token in (extra if isinstance(extra, list) else [extra])]
    decoder = config.get("added_tokens_decoder") or {}
    named += [
        (f"added_tokens_decoder[{key}]", token)
        for key, token in (decoder.items() if isinstance(decoder, dict) else [("?", decoder)])
    ]
    for key, token in named:
        content = token_content(token)
        if not isinstance(content, str):
            raise TokenizerError(
                f'{source.config}: {key} is {token!r}, not a token string (or a {{"content": '
                "...} object); correct it or leave the tokenizer_config.json out"
            )
        token_id = source.token_id(content)
        if token_id is None:
            raise TokenizerError(
                f"{source.config}: {key} {content!r} is not a token of {source.tokenizer.name}, so "
                f"consumers would add it with an id past the model's vocabulary ({vocab_size}); "
                "name a token the tokenizer has"
            )
        if key.startswith("added_tokens_decoder") and key[len("added_tokens_decoder[") : -1] != str(token_id):
            raise TokenizerError(
                f"{source.config}: {key} says {content!r}, which {source.tokenizer.name} holds at id "
                f"{token_id}; correct the id or leave the tokenizer_config.json out"
            )


def minimal_tokenizer_config(
    source: TokenizerSource, context_length: int, bos_token_id: int, eos_token_id: int, pad_token_id: int
) -> dict:
    """What transformers and onnxruntime-genai need to load tokenizer.json, with the model's special tokens.

    Each id is named (as bos_token, eos_token, pad_token) only when it is one of the tokenizer's special tokens:
    an ordinary one would vanish from every decoded text, so it is left out with a warning.

    Args:
        source: the validated tokenizer.
        context_length: the model's positions, as model_max_length.
        bos_token_id: the model's BOS id, or None.
        eos_token_id: the model's EOS id, or None.
        pad_token_id: the model's pad id, or None.

    Returns:
        The tokenizer_config.json object.
    """
    # model_input_names: without it transformers also returns token_type_ids, which generate() rejects.
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "model_max_length": context_length,
        "model_input_names": ["input_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False,
    }
    for name, token_id in (("bos_token", bos_token_id), ("eos_token", eos_token_id), ("pad_token", pad_token_id)):
        # Only a special token: named here, an ordinary one ('#', say) would vanish from every decoded text.
        if token_id in source.special:
            config[name] = source.tokens[token_id]
        elif token_id in source.tokens:
            log.warning(
                "the model's %s id %d is %r in this tokenizer, not one of its special tokens: left out of %s",
                name,
                token_id,
                source.tokens[token_id],
                TOKENIZER_CONFIG,
            )
    return config


def copy_tokenizer(source: TokenizerSource, folder: Path, minimal_config: dict) -> list[str]:
    """Copy tokenizer.json and tokenizer_config.json (or write `minimal_config`) into folder; return the names.

    A copied config gains the minimal one's model_input_names when it has none, for the same reason, and
    TOKENIZER_CLASS for transformers 5's name of it. A chat_template.jinja goes into the config's
    `chat_template`, in its place, as transformers prefers the file to the config's field."""
    folder = Path(folder)
    (folder / TOKENIZER).write_bytes(source.content)  # a copy: onnxruntime rejects links out of the folder
    config = minimal_config
    if source.config_data is not None:
        config = {**source.config_data}
        config.setdefault("model_input_names", minimal_config["model_input_names"])
        if config.get("tokenizer_class") == TRANSFORMERS5_TOKENIZER_CLASS:
            config["tokenizer_class"] = TOKENIZER_CLASS
    if source.chat_template is not None:
        config = {**config, "chat_template": source.chat_template}
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [TOKENIZER, TOKENIZER_CONFIG]


def load_tokenizer(path: Path, vocab_size: int) -> TextTokenizer:
    """The tokenizer.json, or a folder (an artifact) holding one, for text in and out, checked to fit the model.
    A tokenizer_config.json beside it is not read: generation never uses it."""
    return TextTokenizer(_read_tokenizer(path, vocab_size).loaded)


def _load(path: Path, content: bytes):
    try:  # a dependency of the package, but a deployment that replays golden bundles may lack it
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise TokenizerError(
            f"reading {path} needs the tokenizers library, which does not import here ({exc}); "
            "install it (pip install tokenizers), or pass token ids (`prompt_ids`)"
        ) from None
    try:
        return Tokenizer.from_str(content.decode("utf-8"))
    except Exception as exc:  # the Rust side raises plain Exception for any parse problem
        raise TokenizerError(f"{path} is not a readable {TOKENIZER}: {first_line(exc)}") from None


class TextTokenizer:
    """A `tokenizers.Tokenizer` for text in and out that says which ids its text leaves out.

    `tokenizers` (and transformers over it) decodes an id that is no token of the tokenizer to nothing, silently;
    a model's vocabulary may be larger than its tokenizer's, so generated ids can be such ids. `decode` warns,
    naming each such id once."""

    def __init__(self, loaded):
        self.loaded = loaded
        self._unknown_reported: set[int] = set()

    def encode(self, text: str, add_special_tokens: bool = True):
        """The `tokenizers.Encoding` of text (`.ids`); without `add_special_tokens`, without the tokens the
        post-processor adds around it."""
        return self.loaded.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        unknown = sorted({i for i in ids if self.loaded.id_to_token(i) is None} - self._unknown_reported)
        if unknown:
            self._unknown_reported.update(unknown)
            log.warning(
                "generated ids that are no tokens of the tokenizer, left out of the text: %s",
                ", ".join(map(str, unknown)),
            )
        return self.loaded.decode(ids)


class TextStream:
    """Turns a growing list of ids into the text to print now.

    Decoding ids one by one breaks multi-byte characters and merges; decoding
    the whole sequence and printing what it added does not.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.loaded.decode(self.ids)  # quietly: `rest` names the ids left out, once
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        return self._advance(text)

    def rest(self) -> str:
        """At the end of the stream: what is still held back (an incomplete character, as the decoder shows it).
        Here the tokenizer warns of ids it left out of the text."""
        return self._advance(self.tokenizer.decode(self.ids))

    def _advance(self, text: str) -> str:
        delta, self.printed = text[len(self.printed) :], text
        return delta
