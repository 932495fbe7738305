"""A foreign graph (exporter.artifact.foreign) behind OrtRunner's interface: prefill/decode on named feeds, and
start/step for generation, so that the verification's checks and the generation loop run on it unchanged.

The feeds are the toolkit's: the mask as int64 and the positions derived from it (position_ids_from_mask), which a
graph taking no position_ids derives itself and is not given; prefill's labels, which no foreign graph takes, are
dropped; prefill runs the one graph on an empty past. Outputs come back under the toolkit's names.
"""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime.capi.onnxruntime_pybind11_state as _ort_errors

from exporter.artifact.contract import KV_KINDS
from exporter.artifact.foreign import ForeignGraph
from exporter.artifact.manifest import Manifest
from exporter.errors import GraphRunError, InputError, first_line
from exporter.runtime.sessions import SessionSettings, check_provider, file_session

_RUN_ERRORS = (_ort_errors.Fail, _ort_errors.RuntimeException, _ort_errors.InvalidArgument)


class ForeignRunner:
    """One foreign graph in ONNX Runtime, serving as prefill.onnx and as decode.onnx.

    Args:
        graph: the foreign graph (read_foreign).
        manifest: its manifest for the engine (foreign_manifest), whose names the feeds and outputs carry.
        provider: "cpu" or "cuda".
        settings: the session's settings.
    """

    def __init__(
        self,
        graph: ForeignGraph,
        manifest: Manifest,
        provider: str = "cpu",
        settings: SessionSettings = SessionSettings(),
    ):
        self.graph, self.manifest = graph, manifest
        self.artifact = None  # no artifact folder: what needs one (debug copies, the weight audit) does not run
        self.provider = check_provider(provider)
        self.session = file_session(graph.folder / graph.file, self.provider, settings)
        cache = manifest.cache
        layers = range(cache.num_layers)
        self._past = {cache.past(i, k): graph.past.format(layer=i, kind=k) for i in layers for k in KV_KINDS}
        self._present = {graph.present.format(layer=i, kind=k): cache.present(i, k) for i in layers for k in KV_KINDS}
        self._outputs = ["logits", *self._present]
        self._mask_dtype = np.dtype(graph.mask_dtype)
        self.cache = None  # start/step's past, by the toolkit's past names
        self.lock = threading.RLock()

    @property
    def name(self) -> str:
        return f"onnxruntime {self.provider} ({self.graph.writer})"

    def _run(self, feeds: dict) -> dict:
        batch, tokens = feeds["input_ids"].shape
        past = feeds[next(iter(self._past))].shape[2]
        if not self.graph.left_padding and batch > 1 and tokens > 1 and past > 0:
            # GroupQueryAttention runs several tokens on a past for one row at a time only: each row's call alone
            rows = [self._run({name: value[row : row + 1] for name, value in feeds.items()}) for row in range(batch)]
            return {name: np.concatenate([row[name] for row in rows]) for name in rows[0]}
        given = {
            "input_ids": feeds["input_ids"],
            "attention_mask": np.asarray(feeds["attention_mask"]).astype(self._mask_dtype, copy=False),
            **({"position_ids": feeds["position_ids"]} if self.graph.position_ids else {}),
            **{theirs: feeds[ours] for ours, theirs in self._past.items()},
        }
        try:
            values = self.session.run(self._outputs, given)
        except _RUN_ERRORS as exc:
            raise GraphRunError(self.graph.file, first_line(exc, 400)) from None
        names = ["logits", *self._present.values()]
        return {name: value for name, value in zip(names, values)}

    def prefill(self, feeds: dict) -> dict:
        return self._run({**feeds, **self.empty_past(len(feeds["input_ids"]))})

    def decode(self, feeds: dict) -> dict:
        return self._run(feeds)

    def empty_past(self, batch: int) -> dict:
        cache = self.manifest.cache
        shape = (batch, cache.num_key_value_heads, 0, cache.head_dim)
        return {name: np.zeros(shape, dtype=cache.dtype) for name in self._past}

    def _last_logits(self, outputs: dict) -> np.ndarray:
        cache = self.manifest.cache
        self.cache = {cache.past(i, k): outputs[cache.present(i, k)] for i in range(cache.num_layers) for k in KV_KINDS}
        return outputs["logits"][:, -1].astype(np.float32)

    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """The prompt batch on an empty past; the next-token logits (B, V) float32, the cache kept."""
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return self._last_logits(self.prefill(feeds))

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """New tokens on the cache start/step left; the next-token logits."""
        if self.cache is None:
            raise InputError("step() needs a cache: call start() with the prompt first")
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return self._last_logits(self.decode({**feeds, **self.cache}))
