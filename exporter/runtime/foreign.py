"""A foreign graph (exporter.artifact.foreign) behind the Runner protocol (exporter.runtime.protocol): prefill/decode
on named feeds, and start/step for generation, so that the verification's checks and the generation loop run on it
unchanged.

The feeds are the toolkit's: the mask as int64 and the positions derived from it (position_ids_from_mask), which a
graph taking no position_ids derives itself and is not given; prefill's labels, which no foreign graph takes, are
dropped; prefill runs the one graph on an empty past. Outputs come back under the toolkit's names, each of the shape
the contract gives it: a graph whose names are a decoder's while its outputs are not is refused at its first run.
"""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as _ort_errors

from exporter.artifact.contract import KV_KINDS
from exporter.artifact.foreign import NO_DECODER_FIX, ForeignGraph
from exporter.artifact.manifest import Manifest
from exporter.errors import ArtifactError, GraphRunError, first_line
from exporter.runtime.protocol import RuntimeLabel
from exporter.runtime.providers import check_provider
from exporter.runtime.sessions import file_session
from exporter.runtime.settings import SessionSettings
from exporter.runtime.steps import NumpySteps

_RUN_ERRORS = (_ort_errors.Fail, _ort_errors.RuntimeException, _ort_errors.InvalidArgument)


class ForeignRunner(NumpySteps):
    """One foreign graph in ONNX Runtime, serving as prefill.onnx and as decode.onnx (a Runner, without its
    capabilities: the verification's debug copies and router probes are made of the toolkit's graphs).

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
        self.capabilities = frozenset()
        self.cache = None  # start/step's past, by the toolkit's past names
        self.lock = threading.RLock()

    @property
    def runtime(self) -> RuntimeLabel:
        return RuntimeLabel(f"onnxruntime {ort.__version__}", f"{self.provider}, the graph {self.graph.writer} wrote")

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
        outputs = {name: value for name, value in zip(names, values)}
        self._check_shapes(outputs, batch, past, tokens)
        return outputs

    def _check_shapes(self, outputs: dict, batch: int, past: int, tokens: int) -> None:
        """ArtifactError naming the first output whose shape is not the contract's for these feeds and the reference
        config's sizes: logits (batch, tokens, vocab), presents (batch, kv heads, past + tokens, head dim)."""
        cache = self.manifest.cache
        due = {"logits": (batch, tokens, self.manifest.config.vocab_size)}
        kv = (batch, cache.num_key_value_heads, past + tokens, cache.head_dim)
        due.update((ours, kv) for ours in self._present.values())
        theirs = {"logits": "logits", **{ours: theirs for theirs, ours in self._present.items()}}
        for name, value in outputs.items():
            if tuple(value.shape) != due[name]:
                axes = "batch, tokens, vocab" if name == "logits" else "batch, kv heads, past + tokens, head dim"
                raise ArtifactError(
                    f"{self.graph.folder / self.graph.file} has a decoder's input and output names but is no decoder: "
                    f"it returned {theirs[name]} of shape {tuple(value.shape)} where ({axes}) is {due[name]} for "
                    f"these feeds and the reference's sizes; {NO_DECODER_FIX}"
                )

    def prefill(self, feeds: dict) -> dict:
        return self._run({**feeds, **self.empty_past(len(feeds["input_ids"]))})

    def decode(self, feeds: dict) -> dict:
        return self._run(feeds)
