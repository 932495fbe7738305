"""Generation's start/step for the runners whose prefill/decode take and return numpy arrays and keep the cache as
numpy (a foreign graph in ONNX Runtime, the Node runtimes), beside OrtRunner's, which keeps it in onnxruntime's
values."""

from __future__ import annotations

import numpy as np

from exporter.artifact.contract import KV_KINDS
from exporter.errors import InputError


class NumpySteps:
    """empty_past, start and step from the runner's `manifest` and `decode(feeds) -> outputs`, named as the
    manifest names them; start runs the prompt through decode on an empty past. The cache that start/step leave is
    `self.cache`, the presents as the next call's past by past name (None before start)."""

    cache: dict | None = None

    def empty_past(self, batch: int) -> dict:
        cache = self.manifest.cache
        shape = (batch, cache.num_key_value_heads, 0, cache.head_dim)
        empty = np.zeros(shape, dtype=cache.dtype)
        return {cache.past(layer, kind): empty for layer in range(cache.num_layers) for kind in KV_KINDS}

    def _keep_cache(self, outputs: dict) -> np.ndarray:
        cache = self.manifest.cache
        self.cache = {cache.past(i, k): outputs[cache.present(i, k)] for i in range(cache.num_layers) for k in KV_KINDS}
        return outputs["logits"][:, -1].astype(np.float32)

    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """The prompt batch on an empty past; the next-token logits (B, V) float32, the cache kept."""
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return self._keep_cache(self.decode({**feeds, **self.empty_past(len(input_ids))}))

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """New tokens on the cache start/step left; the next-token logits."""
        if self.cache is None:
            raise InputError("step() needs a cache: call start() with the prompt first")
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return self._keep_cache(self.decode({**feeds, **self.cache}))
