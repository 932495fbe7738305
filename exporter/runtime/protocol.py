"""What the verification engine and generation need of a runner: the Runner protocol, the label its rows carry in
the reports, and the optional capabilities a runner may lack.

A runner runs an artifact's two graphs in one runtime and configuration (ONNX Runtime on one execution provider,
OpenVINO at one inference precision). The engine runs every check it can on any Runner; the checks that need a
capability a runner lacks are reported as not checked, with the reason (`missing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import Manifest

# Capabilities beyond running the two graphs, each with what it gives, which names it where a runner lacks it.
DEBUG_GRAPHS = "debug graphs"
ROUTER_PROBES = "router probes"
CAPABILITIES = {
    DEBUG_GRAPHS: "copies of the graphs that expose every intermediate value, run in ONNX Runtime on the runner's "
    "provider",
    ROUTER_PROBES: "copies of the graphs that expose the MoE routers' choices, run in ONNX Runtime on the runner's "
    "provider",
}


@dataclass(frozen=True)
class RuntimeLabel:
    """What a runner's rows in a report say of where their numbers come from.

    `known_cause` is set by a runner whose configuration makes it differ from the reference by design (OpenVINO's
    default inference precision, bf16 on CPUs that have it): its rows are reported with that cause and do not
    enter the verdict, which the same runtime's row at its honest settings carries. `notes` are what a user of
    the runtime should know of its results that is no difference by itself (a MatMulNBits accuracy_level it
    ignores)."""

    name: str  # the runtime and its version, e.g. "onnxruntime 1.32.0"
    configuration: str  # what it ran with, in words (the provider, or the runtime's settings)
    known_cause: str = ""
    notes: tuple[str, ...] = field(default=())

    def attributes(self, passed: bool) -> bool:
        """Whether a row of this runner that `passed` or not is attributed to its known cause: it failed, and its
        configuration makes it differ by design."""
        return not passed and bool(self.known_cause)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "configuration": self.configuration,
            "known_cause": self.known_cause,
            "notes": list(self.notes),
        }


@runtime_checkable
class Runner(Protocol):
    """Both graphs of an artifact in one runtime, as the verification engine and generation use them.

    prefill/decode take and return named numpy arrays, as the manifest's contract names them; start/step serve
    generation (exporter.runtime.generation), which keeps `cache` between steps and takes `lock` where a runner
    has one."""

    manifest: Manifest  # the graphs' contract, the model config, the cache layout
    artifact: Artifact | None  # the artifact folder; None for a graph that is no artifact (a foreign one)
    provider: str  # the row's name in the reports (an execution provider's, "openvino f32")
    runtime: RuntimeLabel
    capabilities: frozenset[str]  # of CAPABILITIES
    cache: object  # the cache start/step left, in the runner's own form; None before start

    def prefill(self, feeds: dict) -> dict:
        """prefill.onnx on named feeds; its outputs by name."""

    def decode(self, feeds: dict) -> dict:
        """decode.onnx on named feeds (the past among them); its outputs by name."""

    def empty_past(self, batch: int) -> dict:
        """A past of length 0 for `decode`, by past input name."""

    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """A (left-padded) prompt batch on an empty past; the next-token logits (B, V) float32, the cache kept."""

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """New tokens on the cache start/step left; the next-token logits."""


def missing(runner: Runner, capability: str) -> str:
    """Why a check needing `capability` does not run on `runner`; "" when the runner has it."""
    if capability in runner.capabilities:
        return ""
    return f"needs {capability} ({CAPABILITIES[capability]}), which {runner.runtime.name} does not give"
