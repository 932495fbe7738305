"""OpenVINO (pip install openvino): an artifact's prefill.onnx and decode.onnx compiled by OpenVINO's ONNX frontend,
the weights file read as the graphs' external data, behind the Runner protocol.

Each configuration is a row of the verification's report:

- "f32": INFERENCE_PRECISION_HINT=f32 and DYNAMIC_QUANTIZATION_GROUP_SIZE=0, so that the graphs compute in their
  own precision and no activation is quantized: judged by the profiles of ONNX Runtime's CPU provider.
- "default": OpenVINO's defaults, as a user who sets nothing gets them. On CPUs with bf16 units it computes float32
  graphs in bf16, and it may quantize the activations of int4/int8 weights' MatMuls in groups: where the row
  differs, those are its known cause, and the f32 row carries the verdict.

OpenVINO ignores MatMulNBits' accuracy_level: it never quantizes activations to int8 as ONNX Runtime's CPU provider
does at level 4, so a level-4 artifact answers differently there than in ONNX Runtime; the rows say so.

openvino is imported by the runner alone: without it installed, this module registers the runtime, which then
reports itself not installed.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np

from exporter.artifact.contract import GraphContract
from exporter.artifact.folder import Artifact, open_artifact
from exporter.artifact.manifest import Manifest
from exporter.errors import ConsumerError, first_line
from exporter.runtime.protocol import RuntimeLabel
from exporter.runtime.registry import Runtime, register_runtime
from exporter.runtime.runner import check_feeds
from exporter.runtime.steps import NumpySteps

NAME = "openvino"
INSTALL = "pip install openvino"
DEVICE = "CPU"
F32, DEFAULT = "f32", "default"
# The properties each configuration compiles the graphs with.
CONFIGURATIONS = {
    F32: {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
    DEFAULT: {},
}
# MatMulNBits' accuracy levels whose math is float32, which OpenVINO's matches: 0 (unset) and 1.
_FLOAT_LEVELS = (0, 1)


def openvino_version() -> str | None:
    """The installed openvino's version; None where it is not installed or does not import."""
    try:
        import openvino  # noqa: F401  a broken install is no runtime either
    except ImportError:
        return None
    return importlib.metadata.version("openvino")


class OpenVinoRunner(NumpySteps):
    """Both graphs of an artifact compiled by OpenVINO for its CPU device, in one configuration.

    Args:
        artifact: an opened Artifact (not read again), or an artifact folder's path, opened here with every hash
            checked.
        configuration: "f32" (the honest settings) or "default" (OpenVINO's own).
        threads: the inference threads (INFERENCE_NUM_THREADS), whatever the configuration; None: OpenVINO's count
            (one per core).

    Raises:
        ConsumerError: openvino is not installed, or cannot compile or run a graph.
    """

    def __init__(self, artifact: Artifact, configuration: str = F32, threads: int | None = None):
        if configuration not in CONFIGURATIONS:
            raise ConsumerError(f"OpenVINO configurations are {', '.join(CONFIGURATIONS)}, not {configuration!r}")
        if openvino_version() is None:
            raise ConsumerError(f"openvino is not installed here: {INSTALL}")
        import openvino as ov

        self.artifact = open_artifact(artifact)
        self.manifest = self.artifact.manifest
        self.provider = f"{NAME} {configuration}"
        self.capabilities = frozenset()
        self.cache = None
        core = ov.Core()
        properties = CONFIGURATIONS[configuration]
        threading = {} if threads is None else {"INFERENCE_NUM_THREADS": str(threads)}
        self._graphs = {
            contract.file: _Compiled(core, self.artifact, contract, {**properties, **threading})
            for contract in (self.manifest.prefill, self.manifest.decode)
        }
        compiled = self._graphs[self.manifest.decode.file].model
        precision = compiled_precision(compiled)
        group = int(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE"))
        device = core.get_property(DEVICE, "FULL_DEVICE_NAME")
        settings = ", ".join(f"{k}={v}" for k, v in properties.items()) or (
            f"defaults: inference precision {precision}, dynamic quantization group size {group}"
        )
        settings += "".join(f", {k}={v}" for k, v in threading.items())
        self.runtime = RuntimeLabel(
            f"{NAME} {openvino_version()}",
            f"{DEVICE} ({device}), {settings}",
            known_cause=default_cause(self.manifest, precision, group) if configuration == DEFAULT else "",
            notes=accuracy_level_notes(self.manifest),
        )

    def prefill(self, feeds: dict) -> dict:
        return self._graphs[self.manifest.prefill.file].run(feeds)

    def decode(self, feeds: dict) -> dict:
        return self._graphs[self.manifest.decode.file].run(feeds)


class _Compiled:
    """One graph compiled by OpenVINO, run on named numpy feeds."""

    def __init__(self, core, artifact: Artifact, contract: GraphContract, properties: dict):
        self.contract = contract
        try:
            self.model = core.compile_model(str(artifact.path(contract.file)), DEVICE, properties)
        except RuntimeError as exc:
            raise ConsumerError(f"OpenVINO cannot compile {contract.file}: {first_line(exc, 300)}") from None
        self._request = self.model.create_infer_request()
        # by the contract's names: an output port may carry several tensor names, any one of which get_any_name gives
        self._ports = [(name, self.model.output(name)) for name in contract.output_names]

    def run(self, feeds: dict) -> dict:
        check_feeds(self.contract, feeds)
        try:
            results = self._request.infer(feeds)  # the outputs are copies, not the request's buffers
        except RuntimeError as exc:
            raise ConsumerError(f"OpenVINO failed running {self.contract.file}: {first_line(exc, 300)}") from None
        return {name: np.asarray(results[port]) for name, port in self._ports}


def compiled_precision(compiled) -> str:
    """The precision a compiled model computes in, as OpenVINO names it ("f32", "bf16", "f16"): a hint the device
    cannot follow reads as the precision it uses instead."""
    return compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()


def default_cause(manifest: Manifest, precision: str, group: int) -> str:
    """What makes OpenVINO's defaults differ from the reference by design, "" when nothing does: the inference
    precision `precision` where it is no float32, and for a quantized artifact the dynamic quantization of
    activations in groups of `group` (0: none)."""
    causes = []
    if precision != F32:
        causes.append(f"OpenVINO's default inference precision {precision}")
    if manifest.quantization is not None and group:
        causes.append(
            f"OpenVINO's default dynamic quantization of activations in groups of {group} (on CPUs with int8 "
            "dot-product units)"
        )
    return "; ".join(causes)


def accuracy_level_notes(manifest: Manifest) -> tuple[str, ...]:
    """What the rows of a quantized artifact say of the accuracy_level OpenVINO ignores; none where its level's math
    is float32 as OpenVINO's is."""
    quantization = manifest.quantization
    levels = [] if quantization is None else sorted(quantization.levels - set(_FLOAT_LEVELS))
    if not levels:
        return ()
    return (
        f"OpenVINO ignores this artifact's MatMulNBits accuracy_level {', '.join(map(str, levels))}: it computes "
        "with float activations as at level 0, where ONNX Runtime's CPU provider computes at the artifact's level "
        "(int8 activations at level 4), so its answers differ from ONNX Runtime's by that",
    )


def _targets(manifest: Manifest, providers: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """Both configurations: the honest one judged, the defaults reported as what users get."""
    return [F32, DEFAULT], {}


def _runner(artifact: Artifact, configuration: str, weights=None, threads: int | None = None) -> OpenVinoRunner:
    return OpenVinoRunner(artifact, configuration, threads)  # OpenVINO reads the weights file itself


register_runtime(Runtime(name=NAME, install=INSTALL, version=openvino_version, targets=_targets, runner=_runner))
