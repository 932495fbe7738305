"""RecordedReference sits where the PyTorch reference would: on the first pass
it calls the backing reference and records every call; afterwards (other
providers, or a bundle loaded from disk) it replays the recording, checking
that the token inputs are the ones recorded. Decode calls store only the new
positions of each present (the reference's present is its past with the new
positions appended), so a bundle holds each cache entry once. For MoE models
each call, and each call of a greedy run, also keeps its routers' scores and
chosen experts, so that expert choice and the routing explanation of a failing
call or of a greedy run that differs replay too (a v4 bundle recorded before
greedy runs kept them replays without that explanation). Every saved bundle also
holds the reference's module outputs (TorchRunner.module_outputs) for the prefill
batch and for the decode call the probe examines (the decode check's first failing
call, its first call when none fails), so that a replay's node-level probe names
the diverging operator in either graph as a live one does (a v4 bundle recorded
before they were kept replays without the probe, one recorded before the decode
call's were kept without the probe of decode.onnx).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from exporter.verify.checks.greedy import GreedyTrace
from exporter.verify.checks.routers import record_reference_routing
from exporter.verify.references.golden.bundle import GoldenMismatch

TOKEN_FEEDS = ("input_ids", "attention_mask", "position_ids", "labels")


def _tokens(feeds: dict) -> dict:
    return {k: np.asarray(feeds[k]) for k in TOKEN_FEEDS if k in feeds}


def _same_tokens(recorded: dict, tokens: dict) -> bool:
    return recorded.keys() == tokens.keys() and all(np.array_equal(recorded[k], tokens[k]) for k in tokens)


class RecordedReference:
    """A reference that records its backing's calls, or replays a recording (a bundle loaded from disk).

    Args:
        backing: the live reference to call and record (a TorchRunner); None replays the recording alone, and a
            call it does not hold is a GoldenMismatch.
        calls: the recorded calls, in order: (kind, token feeds, stored outputs), a decode call's presents
            holding only their new positions.
        greedy: the recorded greedy runs, by (prompt, max_new_tokens, eos).
        source: the name reports give the reference; "" takes the backing's.
        routing: per recorded call, {layer: (router scores, chosen expert ids)}; None: no routers recorded.
        module_outputs: per graph ("prefill", "decode"), the token feeds of one call and the reference's module
            outputs on it, for the probe.
    """

    def __init__(
        self,
        backing=None,
        calls: list | None = None,
        greedy: dict | None = None,
        source: str = "",
        routing: list | None = None,
        module_outputs: dict[str, tuple[dict, dict]] | None = None,
    ):
        self.backing = backing
        self.calls: list[tuple[str, dict, dict]] = calls or []  # (kind, token feeds, stored outputs)
        self.routing: list[dict] = routing or [{} for _ in self.calls]  # per call: {layer: (scores, ids)}
        self.greedy_traces: dict[tuple, GreedyTrace] = greedy or {}
        # graph -> (token feeds, {module path or present name: output}) of one call of that graph; a graph is
        # absent until asked for, and in a bundle recorded before its module outputs were kept
        self.recorded_module_outputs = module_outputs or {}
        self.cursor = 0
        self.name = source or getattr(backing, "name", "recorded reference")

    def rewind(self) -> None:
        """Replay from the first call (the next provider runs the same calls in the same order)."""
        self.cursor = 0

    def _call(self, kind: str, feeds: dict) -> dict:
        tokens = _tokens(feeds)
        if self.cursor < len(self.calls):
            recorded_kind, recorded_tokens, outputs = self.calls[self.cursor]
            if recorded_kind != kind or not _same_tokens(recorded_tokens, tokens):
                raise GoldenMismatch(
                    f"call {self.cursor} ({kind}) does not match the recording: the bundle was "
                    "recorded with other inputs; re-record it with `golden_save`"
                )
        elif self.backing is None:
            raise GoldenMismatch(
                f"the bundle holds {len(self.calls)} calls and this verification needs more; "
                "re-record it with `golden_save`"
            )
        else:
            with record_reference_routing(self.backing.model) as routed:
                full = getattr(self.backing, kind)(feeds)
            outputs = {name: self._stored(kind, name, value, feeds) for name, value in full.items()}
            self.calls.append((kind, tokens, outputs))
            self.routing.append({layer: calls[-1] for layer, calls in routed.items()})
        self.cursor += 1
        return {name: self._restored(kind, name, value, feeds) for name, value in outputs.items()}

    @staticmethod
    def _stored(kind: str, name: str, value, feeds: dict):
        past = feeds.get(name.replace("present.", "past_key_values.", 1)) if kind == "decode" else None
        # a copy: a view of the new positions would keep the whole present alive, past included, for every call
        return np.asarray(value)[:, :, past.shape[2] :].copy() if past is not None else np.asarray(value)

    @staticmethod
    def _restored(kind: str, name: str, value, feeds: dict):
        past = feeds.get(name.replace("present.", "past_key_values.", 1)) if kind == "decode" else None
        return np.concatenate([past, value], axis=2) if past is not None else value

    def last_routing(self) -> dict:
        """{layer: (router scores (N, E), chosen expert ids (N, k))} of the last call; empty without routers."""
        return self.routing[self.cursor - 1]

    def prefill(self, feeds: dict) -> dict:
        return self._call("prefill", feeds)

    def decode(self, feeds: dict) -> dict:
        return self._call("decode", feeds)

    def greedy(self, prompt: list[int], max_new_tokens: int, eos: int | None) -> GreedyTrace:
        key = (tuple(prompt), max_new_tokens, eos)
        if key not in self.greedy_traces:
            if self.backing is None:
                raise GoldenMismatch("the bundle holds no greedy run for this prompt; re-record it with `golden_save`")
            with record_reference_routing(self.backing.model) as routed:
                trace = self.backing.greedy(prompt, max_new_tokens, eos)
            calls = len(next(iter(routed.values()), []))
            self.greedy_traces[key] = replace(
                trace, routing=[{layer: routed[layer][call] for layer in routed} for call in range(calls)]
            )
        return self.greedy_traces[key]

    def module_outputs(self, feeds: dict, graph: str = "prefill") -> dict | None:
        """Every reference module's output and the presents for a call of `graph` ("prefill" or "decode") on
        `feeds`, which the probe matches to the graph's values: the backing's, recorded (one call per graph, the
        latest asked for); replayed for the recorded token feeds. None without a backing when none were recorded
        for that graph (a bundle recorded before they were kept), or for a decode call other than the recorded
        one (a replay whose first failing decode call is another)."""
        tokens = _tokens(feeds)
        recorded = self.recorded_module_outputs.get(graph)
        if recorded is not None and _same_tokens(recorded[0], tokens):
            return recorded[1]
        if self.backing is None:
            if recorded is None or graph == "decode":
                return None
            raise GoldenMismatch(
                "the bundle's module outputs were recorded for other inputs than this prefill; "
                "re-record it with `golden_save`"
            )
        self.recorded_module_outputs[graph] = (tokens, self.backing.module_outputs(feeds, graph))
        return self.recorded_module_outputs[graph][1]
