"""Generation's start/step for a runner whose decode() takes and returns numpy arrays: the cache is the last call's
presents, kept as the next call's past."""

from __future__ import annotations

import numpy as np

from exporter.errors import InputError
from exporter.runtime.runner import empty_past, presents_as_past


class NumpySteps:
    """empty_past, and start/step over the runner's own `decode` (and its `manifest`), the cache held as numpy
    arrays by past input name. Each call runs the whole prompt or step at once."""

    cache: dict | None = None

    def empty_past(self, batch: int) -> dict:
        """A past of length 0 for decode.onnx, by past input name."""
        return empty_past(self.manifest.cache, batch)

    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """The prompt batch on an empty past; the next-token logits (B, V) float32, the cache kept."""
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return self._last_logits(self.decode({**feeds, **self.empty_past(len(input_ids))}))

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """New tokens on the cache start/step left; the next-token logits."""
        if self.cache is None:
            raise InputError("step() needs a cache: call start() with the prompt first")
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return self._last_logits(self.decode({**feeds, **self.cache}))

    def _last_logits(self, outputs: dict) -> np.ndarray:
        self.cache = presents_as_past(self.manifest, outputs)
        return outputs["logits"][:, -1].astype(np.float32)
