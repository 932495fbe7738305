"""The float64 referee's runs (exporter.verify.checks.referee says what they judge and how).

A Float64Referee runs a reference model in float64, cast from the weights the judged computations use (the
artifact's dtype: a float16 artifact's referee holds float16-rounded weights, exactly, so it measures the rounding
of the computation and not of the weights), along a chain of calls: the token inputs of a prefill or of an empty
cache's first decode, then of each decode call on the cache the chain built. It runs only for a call whose
comparison fails its fixed profile, and it remembers the last chain it ran, so the decode steps of one check extend
one chain instead of re-running it from the start.

Memory: the toolkit's reference is cast in place for each refereed call and back (TorchRunner.in_float64), so the
model is resident once, at twice the float32 weights' size during that call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import numpy as np

from exporter.artifact.contract import KV_KINDS
from exporter.artifact.manifest import Manifest
from exporter.runtime.runner import presents_as_past

# One call of a chain: ("prefill" or "decode", its token feeds: input_ids, attention_mask, position_ids, labels).
Call = tuple[str, dict]


def _same_call(a: Call, b: Call) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])


class Float64Referee:
    """The float64 outputs of a chain of calls.

    Args:
        float64: opens the float64 runner (prefill(feeds), decode(feeds) -> outputs by name) for the calls of one
            truth(): a context manager that gives it (TorchRunner.in_float64, or one that builds a float64 copy
            once and gives it every time).
        manifest: the artifact's manifest (the cache's names and sizes).
    """

    def __init__(self, float64: Callable[[], AbstractContextManager], manifest: Manifest):
        self._float64, self.manifest = float64, manifest
        self._chain: tuple[Call, ...] = ()
        self._outputs: dict | None = None

    def _empty_past(self, batch: int) -> dict:
        cache = self.manifest.cache
        shape = (batch, cache.num_key_value_heads, 0, cache.head_dim)
        return {cache.past(layer, kind): np.zeros(shape) for layer in range(cache.num_layers) for kind in KV_KINDS}

    def truth(self, chain: Sequence[Call]) -> dict:
        """The float64 outputs of the chain's last call, each decode call fed the chain's own float64 presents."""
        chain = tuple(chain)
        known = len(self._chain)
        resumed = known <= len(chain) and all(_same_call(a, b) for a, b in zip(chain, self._chain))
        outputs, start = (self._outputs, known) if resumed and known else (None, 0)
        if start == len(chain):
            return outputs
        with self._float64() as runner:
            for graph, feeds in chain[start:]:
                if graph == "prefill":
                    outputs = runner.prefill(feeds)
                    continue
                past = (
                    self._empty_past(len(feeds["input_ids"]))
                    if outputs is None
                    else presents_as_past(self.manifest, outputs)
                )
                outputs = runner.decode({**feeds, **past})
        self._chain, self._outputs = chain, outputs
        return outputs
