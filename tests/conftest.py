"""Shared fixtures: tiny seeded models and artifacts exported once per test session.

A dynamo export costs 15-40 s even for a tiny model, so each artifact is
built once and shared; tests that modify an artifact work on a copy. The
float32 artifact carries a tiny tokenizer built here (nothing is downloaded).
"""

from __future__ import annotations

import itertools
import shutil

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from exporter.export import export_artifact
from reference import build_model, get_preset

TINY = "minimind-3-tiny"


@pytest.fixture(scope="session")
def tiny_config():
    return get_preset(TINY)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    return build_model(tiny_config, seed=0)


# MiniMind's special tokens, at MiniMind's ids: <|im_start|> = bos 1, <|im_end|> = eos 2.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE (MiniMind's kind) trained on made-up words; deterministic, reaches 512 tokens exactly.

    Its alphabet is the corpus's ASCII letters rather than all 256 bytes, so any id sequence the seeded
    model emits decodes to valid text (a lone byte of a multi-byte character decodes differently in each
    library).
    """
    syllables = ["ka", "lo", "mi", "ne", "ru", "to", "sa", "vi", "de", "po", "gu", "fe"]
    words = ["".join(p) for p in itertools.product(syllables, repeat=2)]
    words += ["".join(p) for p in itertools.product(syllables[:8], repeat=3)]
    corpus = [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)] * 3
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                                              show_progress=False))
    return tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory, tiny_config):
    """A folder holding only tokenizer.json (the export writes tokenizer_config.json), vocab = the model's."""
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer = build_tokenizer(tiny_config.vocab_size)
    assert tokenizer.get_vocab_size() == tiny_config.vocab_size
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _export(tmp_path_factory, model, dtype, tokenizer=None):
    folder = tmp_path_factory.mktemp(f"artifact-{dtype}") / TINY
    export_artifact(model, folder, dtype=dtype, source={"kind": "seeded", "preset": TINY, "seed": 0},
                    tokenizer=tokenizer)
    return folder


@pytest.fixture(scope="session")
def artifact_fp32(tmp_path_factory, tiny_model, tiny_tokenizer):
    return _export(tmp_path_factory, tiny_model, "float32", tiny_tokenizer)


@pytest.fixture(scope="session")
def artifact_fp16(tmp_path_factory, tiny_model):
    return _export(tmp_path_factory, tiny_model, "float16")


@pytest.fixture
def artifact_copy(artifact_fp32, tmp_path):
    """A private copy of the fp32 artifact that a test may damage."""
    return shutil.copytree(artifact_fp32, tmp_path / TINY)
