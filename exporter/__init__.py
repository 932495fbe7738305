"""Export decoder LLMs to ONNX (prefill + cached decode) and prove ONNX Runtime reproduces the reference.

The layers, lowest first, each importing only those listed before it (tests/test_layers.py checks every import):

- errors: the one error hierarchy of the library;
- artifact/: the artifact format (I/O contract, manifest, sidecar configs, node scopes, atomic writes, the export's
  destination and its swap into place);
- runtime/: ONNX Runtime, torch-free (sessions, runner, generation, onnxruntime-genai);
- tolerances: the tolerance profiles with their reasoning, which the export's checks and the verification share;
- export/ and verify/: siblings, neither importing the other; export/ is the torch side (export wrappers, tracing,
  graph passes, pre-export checks, shared weights, quantization, the pipeline), verify/ the verification engine
  (references, checks, diagnosis, results, reports);
- tuning/: an export made to a quality target, which both quantizes (export/) and measures (verify/);
- cli/: the `export-onnx` command and the pytest plugin, the only code that knows flags, prints and exits.

The reference models (the `reference` package, with reference.source: a model with the record of where its weights
came from) sit beside artifact/: they import only errors and artifact/, and export/ and verify/ build on them.

The public API below is what the README's Python section uses. Names resolve on first use, so that
`import exporter` alone imports neither torch nor onnxruntime.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "seeded_model": "reference.source",
    "checkpoint_model": "reference.source",
    "export_artifact": "exporter.export.pipeline",
    "QuantizationSettings": "exporter.artifact.quantization",
    "export_to_target": "exporter.tuning.search",
    "verify_artifact": "exporter.verify.engine",
    "ParitySettings": "exporter.verify.inputs",
    "VerifyReport": "exporter.verify.results",
    "Comparison": "exporter.verify.metrics",
    "Tolerance": "exporter.tolerances.parity",
    "aggregate": "exporter.verify.metrics",
    "compare": "exporter.verify.metrics",
    "TOLERANCES": "exporter.tolerances.parity",
    "OrtRunner": "exporter.runtime.runner",
    "SessionSettings": "exporter.runtime.settings",
    "SamplingConfig": "exporter.runtime.generation",
    "generate": "exporter.runtime.generation",
    "generate_greedy": "exporter.runtime.generation",
    "genai_greedy": "exporter.runtime.genai",
    "ToolkitError": "exporter.errors",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'exporter' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return __all__
