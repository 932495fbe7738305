"""Sidecar configs that let onnxruntime-genai and Hugging Face Optimum load an artifact folder as it is.

- genai_config.json: onnxruntime-genai (`onnxruntime_genai.Model(folder)`) drives decode.onnx;
- config.json + generation_config.json: Optimum
  (`ORTModelForCausalLM.from_pretrained(folder, file_name="decode.onnx", use_cache=True)`).

Both consumers only run the graph; the model type tells them which defaults
to assume (input names, tokenizer handling), not how to compute. A family
therefore supplies just two names, in FAMILY_TYPES; everything else comes
from the manifest. What each consumer needs was measured (../shared/ECOSYSTEM.md).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from exporter.contract import KV_KINDS
from exporter.manifest import Manifest
from exporter.tokenizer import TokenizerSource, copy_tokenizer, minimal_tokenizer_config

log = logging.getLogger(__name__)

GENAI_CONFIG = "genai_config.json"
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class FamilyTypes:
    """How a model family presents itself to each consumer; None where it cannot run there (with why)."""

    genai: str | None  # onnxruntime-genai model.type
    hf: str | None  # Hugging Face config.json model_type
    genai_unsupported: str = ""
    hf_unsupported: str = ""


# Keyed by the manifest's model.family. MiniMind-3 is a Qwen3-style decoder (q/k norm, GQA, RoPE, SwiGLU);
# qwen3 ran its graph unmodified in both consumers with tokens equal to a plain ONNX Runtime loop.
FAMILY_TYPES: dict[str, FamilyTypes] = {
    "minimind": FamilyTypes(genai="qwen3", hf="qwen3"),
}

# Config fields that keep their meaning under the same name in a Hugging Face config.json.
_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta",
              "tie_word_embeddings", "hidden_act")


@dataclass(frozen=True)
class ModelSizes:
    """What both consumers read about a model, gathered from the manifest once."""

    family: str
    vocab_size: int
    context_length: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    head_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int

    @classmethod
    def of(cls, manifest: Manifest, pad_token_id: int | None = None) -> ModelSizes:
        config, cache = manifest.config, manifest.cache
        return cls(family=family_of(manifest), vocab_size=config.vocab_size,
                   context_length=config.max_position_embeddings, hidden_size=config.hidden_size,
                   num_attention_heads=config.num_attention_heads, num_key_value_heads=cache.num_key_value_heads,
                   num_hidden_layers=cache.num_layers, head_size=cache.head_dim,
                   bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                   pad_token_id=config.eos_token_id if pad_token_id is None else pad_token_id)


def family_of(manifest: Manifest) -> str:
    return manifest.to_dict()["model"]["family"]


def family_types(family: str) -> FamilyTypes:
    types = FAMILY_TYPES.get(family)
    if types is None:
        reason = f"model family {family!r} has no consumer types in exporter.consumers.FAMILY_TYPES"
        return FamilyTypes(None, None, reason, reason)
    return types


def genai_unsupported(manifest: Manifest) -> str:
    """Why onnxruntime-genai cannot run this artifact, or '' when it can."""
    types = family_types(family_of(manifest))
    return "" if types.genai else types.genai_unsupported


def optimum_unsupported(manifest: Manifest) -> str:
    """Why Optimum cannot run this artifact, or '' when it can."""
    types = family_types(family_of(manifest))
    if types.hf is None:
        return types.hf_unsupported
    config = manifest.config
    if manifest.cache.head_dim * config.num_attention_heads != config.hidden_size:
        # Optimum sizes the empty first-step cache as hidden_size / num_attention_heads, ignoring head_dim.
        return (f"head_dim {manifest.cache.head_dim} != hidden_size / num_attention_heads "
                f"({config.hidden_size} / {config.num_attention_heads}); Optimum would build a wrong empty cache")
    return ""


def genai_config(manifest: Manifest, sizes: ModelSizes) -> dict:
    """onnxruntime-genai's config for decode.onnx (past length 0 serves as the prompt step)."""
    cache = manifest.cache
    names = {kind: (cache.past_name.format(layer="%d", kind=kind), cache.present_name.format(layer="%d", kind=kind))
             for kind in KV_KINDS}
    decoder = {
        "filename": manifest.decode.file,
        # 0 threads: ONNX Runtime's default (one per physical core).
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": [],
                            "intra_op_num_threads": 0, "inter_op_num_threads": 1},
        "head_size": sizes.head_size, "hidden_size": sizes.hidden_size,
        "num_attention_heads": sizes.num_attention_heads, "num_key_value_heads": sizes.num_key_value_heads,
        "num_hidden_layers": sizes.num_hidden_layers,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": names["key"][0], "past_value_names": names["value"][0]},
        "outputs": {"logits": "logits", "present_key_names": names["key"][1],
                    "present_value_names": names["value"][1]},
    }
    return {
        "model": {"type": family_types(sizes.family).genai, "context_length": sizes.context_length,
                  "vocab_size": sizes.vocab_size, "bos_token_id": sizes.bos_token_id,
                  "eos_token_id": sizes.eos_token_id, "pad_token_id": sizes.pad_token_id, "decoder": decoder},
        # The graph concatenates past and new keys, so past and present cannot share one buffer.
        "search": {"max_length": sizes.context_length, "past_present_share_buffer": False, "do_sample": False,
                   "num_beams": 1, "num_return_sequences": 1, "min_length": 0, "top_k": 1, "top_p": 1.0,
                   "temperature": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0, "early_stopping": True,
                   "no_repeat_ngram_size": 0, "diversity_penalty": 0.0},
    }


def hf_config(manifest: Manifest, sizes: ModelSizes) -> dict:
    """A Hugging Face config.json: what Optimum reads to build its cache and stop at EOS."""
    config = manifest.config.to_dict()
    return {"model_type": family_types(sizes.family).hf,
            **{name: config[name] for name in _HF_FIELDS if name in config},
            "head_dim": sizes.head_size, "bos_token_id": sizes.bos_token_id, "eos_token_id": sizes.eos_token_id,
            "pad_token_id": sizes.pad_token_id, "torch_dtype": manifest.dtype, "use_cache": True}


def generation_config(sizes: ModelSizes) -> dict:
    return {"bos_token_id": sizes.bos_token_id, "eos_token_id": sizes.eos_token_id,
            "pad_token_id": sizes.pad_token_id, "do_sample": False, "max_length": sizes.context_length}


def write_consumer_files(folder: Path, manifest: Manifest, tokenizer: TokenizerSource | None = None) -> list[str]:
    """Write the configs of every consumer this family runs in, and copy the tokenizer; return the names."""
    sizes = ModelSizes.of(manifest, tokenizer.pad_token_id() if tokenizer else None)
    documents = {}
    if genai_unsupported(manifest):
        log.warning("no %s: onnxruntime-genai cannot run this artifact (%s)", GENAI_CONFIG, genai_unsupported(manifest))
    else:
        documents[GENAI_CONFIG] = genai_config(manifest, sizes)
    if optimum_unsupported(manifest):
        log.warning("no %s: Optimum cannot run this artifact (%s)", HF_CONFIG, optimum_unsupported(manifest))
    else:
        documents[HF_CONFIG] = hf_config(manifest, sizes)
        documents[GENERATION_CONFIG] = generation_config(sizes)
    for name, document in documents.items():
        (Path(folder) / name).write_text(json.dumps(document, indent=2) + "\n")
    names = list(documents)
    if tokenizer is not None:
        minimal = minimal_tokenizer_config(tokenizer, sizes.context_length, sizes.bos_token_id,
                                           sizes.eos_token_id, sizes.pad_token_id)
        names += copy_tokenizer(tokenizer, folder, minimal)
    return names
