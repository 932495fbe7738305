"""ONNX Runtime inference over an artifact folder: sessions, feeds, greedy generation.

Everything about the graphs (names, cache layout, sizes) comes from the
manifest; nothing here is specific to one model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from exporter.contract import KV_KINDS
from exporter.errors import InputError, ProviderError
from exporter.manifest import Manifest, read_manifest
from reference.minimind import MiniMindConfig

log = logging.getLogger(__name__)

PROVIDER_ALIASES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
PARITY_PROVIDERS = ("CPUExecutionProvider", "CUDAExecutionProvider")


def provider_name(name: str) -> str:
    return PROVIDER_ALIASES.get(name.lower(), name)


def check_provider(name: str) -> str:
    """The full provider name, or ProviderError when this onnxruntime build lacks it."""
    full = provider_name(name)
    available = ort.get_available_providers()
    if full not in available:
        hint = " (install onnxruntime-gpu on a machine with a CUDA GPU)" if full == "CUDAExecutionProvider" else ""
        raise ProviderError(f"execution provider {full} is not available here{hint}; "
                            f"available: {', '.join(available)}")
    return full


def available_parity_providers() -> tuple[list[str], dict[str, str]]:
    """Providers to verify on by default, and the skipped ones with the reason."""
    available = ort.get_available_providers()
    chosen = [p for p in PARITY_PROVIDERS if p in available]
    skipped = {p: "not available in this onnxruntime build (needs onnxruntime-gpu and a CUDA GPU)"
               for p in PARITY_PROVIDERS if p not in available}
    return chosen, skipped


def position_ids_from_mask(attention_mask: np.ndarray, past_length: int = 0) -> np.ndarray:
    """Positions that skip left padding: the k-th real token of a row is at position k."""
    positions = np.cumsum(attention_mask, axis=1) - 1
    positions = np.where(attention_mask == 0, 1, positions)  # pad slots: any valid position
    return positions[:, past_length:].astype(np.int64)


def check_prompt(config: MiniMindConfig, prompt_ids, max_new_tokens: int) -> list[int]:
    """Validate one prompt before anything runs; return it as a list of ints."""
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise InputError("the prompt is empty; give at least one token id")
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise InputError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {config.vocab_size})")
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if len(ids) + max_new_tokens > config.max_position_embeddings:
        raise InputError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings ({config.max_position_embeddings}); shorten one of them")
    return ids


class OrtRunner:
    """Both graphs of an artifact folder in ONNX Runtime, called with named numpy feeds."""

    def __init__(self, folder: Path, provider: str = "cpu", check_hashes: bool = True,
                 manifest: Manifest | None = None, intra_op_threads: int = 0):
        self.folder = Path(folder)
        self.manifest = manifest or read_manifest(self.folder, check_hashes=check_hashes)
        self.provider = check_provider(provider)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = intra_op_threads
        options.log_severity_level = 3
        providers = [self.provider] if self.provider == "CPUExecutionProvider" else [self.provider,
                                                                                    "CPUExecutionProvider"]
        self.prefill_session = ort.InferenceSession(str(self.folder / self.manifest.prefill.file), options,
                                                    providers=providers)
        self.decode_session = ort.InferenceSession(str(self.folder / self.manifest.decode.file), options,
                                                   providers=providers)
        if self.provider not in self.decode_session.get_providers():
            # onnxruntime falls back to the CPU silently when CUDA libraries fail to load.
            raise ProviderError(f"{self.provider} could not be initialised (onnxruntime fell back to "
                                f"{self.decode_session.get_providers()}); check the CUDA and cuDNN installation")

    @property
    def name(self) -> str:
        return f"onnxruntime {self.provider}"

    def prefill(self, feeds: dict) -> dict:
        names = self.manifest.prefill.output_names
        return dict(zip(names, self.prefill_session.run(names, feeds)))

    def decode(self, feeds: dict) -> dict:
        names = self.manifest.decode.output_names
        return dict(zip(names, self.decode_session.run(names, feeds)))

    def empty_past(self, batch: int) -> dict:
        cache = self.manifest.cache
        shape = (batch, cache.num_key_value_heads, 0, cache.head_dim)
        return {cache.past(layer, kind): np.zeros(shape, dtype=cache.dtype)
                for layer in range(cache.num_layers) for kind in KV_KINDS}


def presents_as_past(manifest: Manifest, outputs: dict) -> dict:
    cache = manifest.cache
    return {cache.past(layer, kind): outputs[cache.present(layer, kind)]
            for layer in range(cache.num_layers) for kind in KV_KINDS}


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int] = field(default_factory=list)
    stopped_at_eos: bool = False

    def to_dict(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "new_ids": self.new_ids, "stopped_at_eos": self.stopped_at_eos}


def generate_greedy(runner, prompt_ids, max_new_tokens: int, eos_token_id: int | None = None) -> Generation:
    """Prefill the prompt, then decode one token at a time feeding present back as past."""
    manifest = runner.manifest
    ids = check_prompt(manifest.config, prompt_ids, max_new_tokens)
    result = Generation(ids)
    if max_new_tokens == 0:
        return result
    input_ids = np.array([ids], dtype=np.int64)
    mask = np.ones_like(input_ids)
    feeds = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
    if manifest.with_loss:
        feeds["labels"] = np.full_like(input_ids, -100)
    outputs = runner.prefill(feeds)
    while True:
        token = int(np.argmax(outputs["logits"][0, -1]))
        result.new_ids.append(token)
        if token == eos_token_id:
            result.stopped_at_eos = True
            return result
        if len(result.new_ids) == max_new_tokens:
            return result
        mask = np.ones((1, mask.shape[1] + 1), dtype=np.int64)
        feeds = {"input_ids": np.array([[token]], dtype=np.int64), "attention_mask": mask,
                 "position_ids": np.array([[mask.shape[1] - 1]], dtype=np.int64),
                 **presents_as_past(manifest, outputs)}
        outputs = runner.decode(feeds)
