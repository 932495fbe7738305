"""GGUF checkpoints (reference/gguf.py): a tiny llama written here as llama.cpp writes one loads with the weights
written, its tokenizer with its special tokens and chat template; the GGUFs it cannot export are refused in one
line."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import build_tokenizer
from gguf_files import CHAT_TEMPLATE, write_llama_gguf
from helpers import assert_one_line_error, run_cli

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

# llama without biases or rope scaling, head_dim = hidden / heads: what llama.cpp's llama architecture holds
TINY_LLAMA = dict(attention_bias=False, mlp_bias=False, head_dim=16, rope_scaling=None, max_position_embeddings=256)


@pytest.fixture(scope="module")
def llama():
    from hf_folders import hf_model

    return hf_model("llama", **TINY_LLAMA)


@pytest.fixture(scope="module")
def tiny_gguf(llama, tmp_path_factory):
    return write_llama_gguf(llama, build_tokenizer(256), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_gguf_loads_the_weights_its_writer_stored(llama, tiny_gguf):
    from reference.checkpoints import load_checkpoint

    model, report = load_checkpoint(tiny_gguf)
    assert (report.family, report.format, report.config_source) == ("hf-decoder", "gguf", "gguf metadata")
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        "llama",
        2,
        4,
        2,
    )
    assert (config.head_dim, config.vocab_size, config.tie_word_embeddings) == (16, 256, False)
    written, loaded = llama.state_dict(), model.state_dict()
    assert set(written) == set(loaded)
    for key, tensor in written.items():  # float32 in the file: every value back exactly, q/k rows in their order
        assert torch.equal(loaded[key], tensor), key
    ids = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, llama(ids).logits, atol=1e-5, rtol=0)


def test_a_gguf_brings_its_tokenizer_special_tokens_and_chat_template(tiny_gguf):
    from exporter.artifact.tokenizer import checkpoint_tokenizer

    source = checkpoint_tokenizer(tiny_gguf, 256)
    expected = build_tokenizer(256)
    assert source.loaded.encode("kalo minetosa").ids == expected.encode("kalo minetosa").ids
    assert source.config_data["chat_template"] == CHAT_TEMPLATE
    assert source.config_data["eos_token"] == expected.id_to_token(2)
    assert source.config_data["tokenizer_class"] == "PreTrainedTokenizerFast"


def _metadata_only_gguf(path, architecture: str):
    """A GGUF of `architecture` holding the metadata a config is read from, and no tensors."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_layer_norm_eps(1e-5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("architecture", "fragment"),
    [("gpt2", "holds a gpt2 model, which this toolkit does not export"), ("nosuch", "not a GGUF transformers can")],
)
def test_a_gguf_of_another_architecture_is_refused_in_one_line(tmp_path, architecture, fragment):
    path = _metadata_only_gguf(tmp_path / f"{architecture}.gguf", architecture)
    result = run_cli("export", "--checkpoint", path, "-o", tmp_path / "out")
    assert_one_line_error(result, 2, fragment)
    assert "llama, mistral, qwen2, qwen3" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_damaged_gguf_is_refused_in_one_line(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(40))
    assert_one_line_error(run_cli("export", "--checkpoint", path, "-o", tmp_path / "out"), 2, "not a GGUF")


def test_without_the_gguf_extra_the_refusal_names_it(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    result = run_cli("export", "--checkpoint", tiny_gguf, "-o", tmp_path / "out")
    assert_one_line_error(result, 2, "pip install 'export-onnx[gguf]'")
