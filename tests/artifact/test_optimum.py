"""Hugging Face Optimum's ORTModelForCausalLM loads an artifact folder as it is, and its greedy tokens equal our
runtime's.

Optimum's current release (optimum-onnx 0.1.0) needs transformers < 4.58, which the test extra's transformers
(the independent reference of Hugging Face folders) is not, so Optimum runs in a virtual environment of its own:
the interpreter named by EXPORT_ONNX_OPTIMUM_PYTHON, else one in the user's cache (~/.cache/export-onnx), built
on first use from OPTIMUM_REQUIREMENTS (a few minutes; later runs and checkouts reuse it).
tests/artifact/optimum_worker.py runs there, once for the whole module, on the folders the session's fixtures
exported.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import CONSUMER_PROMPTS, optimum_python

from exporter.artifact.manifest import read_manifest
from exporter.runtime.generation import generate_greedy
from exporter.runtime.runner import OrtRunner
from exporter.verify.references.torch_runner import reference_greedy

WORKER = Path(__file__).with_name("optimum_worker.py")
FAMILIES = ["moe3_dense_artifact", "moe2_artifact", "gpt_artifact", "byo_artifact", "minimind2_artifact"]
TEXT = "kalo mine ruto savi"


@pytest.fixture(scope="module")
def int4_artifacts(quantized, quantized_float16):
    """The tiny model at int4 with float32 activations (accuracy level 0) and with float16 ones (level 4)."""
    return {"int4": quantized["int4"], "int4-float16": quantized_float16}


@pytest.fixture(scope="module")
def optimum(request, int4_artifacts):
    """Optimum's answers for this module's folders: {"generate": {(fixture or int4 name, prompt index): ids},
    "text": {...}}."""
    python = optimum_python()
    runs = []
    folders = {name: request.getfixturevalue(name) for name in ["artifact_fp32", "artifact_fp16", *FAMILIES]}
    for name, folder in {**folders, **int4_artifacts}.items():
        vocab = read_manifest(folder).config.vocab_size
        tokens = 24 if name in FAMILIES else 40
        for index, prompt in enumerate(CONSUMER_PROMPTS):  # the seed 001 demo has 256 ids
            runs.append(
                (
                    (name, index),
                    {"folder": str(folder), "prompt": [t % vocab for t in prompt], "max_new_tokens": tokens},
                )
            )
    texts = [{"folder": str(request.getfixturevalue("artifact_fp32")), "text": TEXT, "max_new_tokens": 12}]
    document = json.dumps({"generate": [run for _, run in runs], "texts": texts})
    done = subprocess.run([str(python), str(WORKER)], input=document, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout)
    return {"generate": dict(zip((key for key, _ in runs), answer["generate"])), "text": answer["texts"][0]}


def _ours(folder, prompt, tokens):
    config = read_manifest(folder).config
    return generate_greedy(OrtRunner(folder), prompt, tokens, config.eos_token_id).new_ids


@pytest.mark.parametrize("artifact", ["artifact_fp32", "artifact_fp16"])
def test_optimum_tokens_equal_our_runtime_and_the_reference(request, optimum, tiny_model, artifact):
    folder = request.getfixturevalue(artifact)
    manifest = read_manifest(folder)
    for index, prompt in enumerate(CONSUMER_PROMPTS):
        ours = _ours(folder, prompt, 40)
        assert optimum["generate"][(artifact, index)] == ours  # Optimum keeps a final EOS, as we do
        assert len(set(ours)) > 5, "degenerate output makes token equality meaningless"
        if manifest.dtype == "float32":
            assert ours == reference_greedy(tiny_model, prompt, 40, manifest.config.eos_token_id).ids
    read_manifest(folder)  # Optimum left the folder as it was (every hash still matches)


def test_optimum_generates_text_with_the_artifacts_tokenizer(optimum, artifact_fp32):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(artifact_fp32 / "tokenizer.json"))
    ids = ours.encode(TEXT).ids
    assert optimum["text"]["ids"] == ids
    expected = _ours(artifact_fp32, ids, 12)
    assert optimum["text"]["new"] == expected
    assert optimum["text"]["decoded"] == ours.decode(expected)


@pytest.mark.parametrize("name", ["int4", "int4-float16"])
def test_optimum_tokens_equal_our_runtime_on_int4(optimum, int4_artifacts, name):
    folder = int4_artifacts[name]
    seen = set()
    for index, prompt in enumerate(CONSUMER_PROMPTS):
        ours = _ours(folder, prompt, 40)
        assert optimum["generate"][(name, index)] == ours
        seen |= set(ours)
    assert len(seen) > 5, "degenerate output makes token equality meaningless"


@pytest.mark.parametrize("artifact", FAMILIES)
def test_optimum_runs_every_family(request, optimum, artifact):
    """Optimum reads only the sizes from config.json; its tokens equal our runtime's for every family."""
    folder = request.getfixturevalue(artifact)
    vocab = read_manifest(folder).config.vocab_size
    seen = set()
    for index, prompt in enumerate(CONSUMER_PROMPTS):
        ours = _ours(folder, [t % vocab for t in prompt], 24)
        assert optimum["generate"][(artifact, index)] == ours
        seen |= set(ours)
    assert len(seen) > 3, "degenerate output makes token equality meaningless"
