"""Tiny Hugging Face decoder folders written by transformers itself (save_pretrained), one per model type, each
exercising what the others do not: built in code, seeded, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

from reference.hf_types import HF_TYPES

# hidden 64, 2 layers, 4 query heads over 2 kv heads, vocab 256; each type's own fields, chosen to exercise what the
# others do not, are its registration's `tiny` (reference/hf_types.py). Saved (save_folder) as sharded safetensors
# (llama), pytorch_model.bin (mistral), the config.json of transformers 4 (qwen2: rope_theta and rope_scaling at the
# top level), else a single model.safetensors.
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
)
CASES = {name: hf_type.tiny for name, hf_type in HF_TYPES.items()}
MODEL_TYPES = tuple(CASES)


def hf_model(model_type: str, seed: int = 0, **changes):
    """Transformers' model of the case, every weight drawn again (seeded): matrices and biases uniform with std
    ~0.1, norm weights uniform in [0.5, 1.5]. Transformers initialises biases at zero and norms at one, and then
    no comparison could tell a bias or a norm left out or applied in the wrong place. `changes` replace fields of
    the case's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **CASES[model_type], **changes})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is yielded once
            draw = torch.rand(param.shape, generator=generator)
            param.copy_(draw + 0.5 if "norm" in name else (draw - 0.5) * 0.35)  # U(-a, a) with std a / sqrt(3)
    return model.eval()


def save_folder(model, model_type: str, folder: Path) -> Path:
    """save_pretrained in the case's format: llama sharded, mistral as pytorch_model.bin (transformers 5 writes
    safetensors only, so the state dict is saved as older releases wrote it), qwen2 with a transformers 4
    config.json."""
    import json

    if model_type == "llama":
        model.save_pretrained(folder, max_shard_size="40KB")
        assert (folder / "model.safetensors.index.json").is_file()
    else:
        model.save_pretrained(folder)
    if model_type == "mistral":
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    if model_type == "qwen2":
        config = json.loads((folder / "config.json").read_text())
        parameters = config.pop("rope_parameters")
        config.update(rope_theta=parameters["rope_theta"], rope_scaling=None, transformers_version="4.57.1")
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def hf_folder(model_type: str, folder: Path, seed: int = 0) -> Path:
    """A folder of the case's model (hf_model) as save_folder writes it; returns the folder."""
    return save_folder(hf_model(model_type, seed), model_type, folder)
