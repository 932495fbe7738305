"""Text in and out through a user-supplied tokenizer.json (the `tokenizers` library).

Without a tokenizer the toolkit works on token ids; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from exporter.errors import InputError

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: Path, vocab_size: int):
    """A `tokenizers.Tokenizer` from a tokenizer.json file, or from a folder holding one.

    A tokenizer with ids the model cannot embed is refused: text would encode
    to ids outside the vocabulary.
    """
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise InputError(f"no tokenizer at {file}; pass the path of a {TOKENIZER_FILE}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exception for any parse problem
        raise InputError(f"{file} is not a readable {TOKENIZER_FILE}: {str(exc).splitlines()[0]}") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= vocab_size:
        raise InputError(f"tokenizer {file} has ids up to {largest} ({size} tokens) but the model's vocabulary "
                         f"has {vocab_size}; use the tokenizer the model was trained with")
    return tokenizer


class TextStream:
    """Turns a growing list of ids into the text to print now.

    Decoding ids one by one breaks multi-byte characters and merges; decoding
    the whole sequence and printing what was added does not.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self.printed = text[len(self.printed):], text
        return delta
