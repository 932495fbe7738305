"""Hugging Face Optimum's ORTModelForCausalLM loads an artifact folder as it is.

Optimum's current release (optimum-onnx 0.1.0) needs transformers < 4.58, so
this module runs only where `optimum.onnxruntime` imports; run it in its own
environment with the one-liner in the README ("Deploy with ...").
"""

from __future__ import annotations

import pytest
from helpers import CONSUMER_PROMPTS

from exporter.artifact.manifest import read_manifest
from exporter.runtime.generation import generate_greedy
from exporter.runtime.runner import OrtRunner
from exporter.verify.references.torch_runner import reference_greedy

try:
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import AutoTokenizer
except ImportError as exc:  # not installed, or a transformers >= 4.58 that breaks optimum at import
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    pytest.skip(
        f"optimum.onnxruntime does not import here ({type(exc).__name__}: {first_line}); its current "
        "release needs transformers<4.58: run this test in its own environment (README, 'Deploy with "
        "onnxruntime-genai / Optimum')",
        allow_module_level=True,
    )


def _load(folder):
    return ORTModelForCausalLM.from_pretrained(folder, file_name="decode.onnx", use_cache=True)


@pytest.mark.parametrize("artifact", ["artifact_fp32", "artifact_fp16"])
def test_optimum_tokens_equal_our_runtime_and_the_reference(request, tiny_model, artifact):
    folder = request.getfixturevalue(artifact)
    manifest = read_manifest(folder)
    eos = manifest.config.eos_token_id
    model = _load(folder)
    runner = OrtRunner(folder)
    for prompt in CONSUMER_PROMPTS:
        optimum = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt) :].tolist()
        ours = generate_greedy(runner, prompt, 40, eos).new_ids
        assert optimum == ours  # Optimum keeps a final EOS, as we do
        assert len(set(ours)) > 5, "degenerate output makes token equality meaningless"
        if manifest.dtype == "float32":
            assert ours == reference_greedy(tiny_model, prompt, 40, eos).ids
    read_manifest(folder)  # Optimum left the folder as it was (every hash still matches)


def test_optimum_generates_text_with_the_artifacts_tokenizer(artifact_fp32):
    from tokenizers import Tokenizer

    text = "kalo mine ruto savi"
    ours = Tokenizer.from_file(str(artifact_fp32 / "tokenizer.json"))
    tokenizer = AutoTokenizer.from_pretrained(artifact_fp32)
    inputs = tokenizer(text, return_tensors="pt")
    assert inputs.input_ids[0].tolist() == ours.encode(text).ids
    out = _load(artifact_fp32).generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs.input_ids.shape[1] :]
    manifest = read_manifest(artifact_fp32)
    expected = generate_greedy(
        OrtRunner(artifact_fp32), ours.encode(text).ids, 12, manifest.config.eos_token_id
    ).new_ids
    assert out.tolist() == expected
    assert tokenizer.decode(out) == ours.decode(expected)


@pytest.mark.parametrize(
    "artifact", ["moe3_dense_artifact", "moe2_artifact", "gpt_artifact", "byo_artifact", "minimind2_artifact"]
)
def test_optimum_runs_every_family(request, artifact):
    """Optimum reads only the sizes from config.json; its tokens equal our runtime's for every family."""
    folder = request.getfixturevalue(artifact)
    config = read_manifest(folder).config
    eos = config.eos_token_id
    model, runner = _load(folder), OrtRunner(folder)
    seen = set()
    for prompt in ([t % config.vocab_size for t in p] for p in CONSUMER_PROMPTS):  # the seed 001 demo has 256 ids
        optimum = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
        ours = generate_greedy(runner, prompt, 24, eos).new_ids
        assert optimum == ours
        seen |= set(ours)
    assert len(seen) > 3, "degenerate output makes token equality meaningless"
