"""Export decoder LLMs to ONNX (prefill + cached decode) and prove ONNX Runtime reproduces the reference.

The layers, each importing only those listed before it:

- errors: the one error hierarchy of the library;
- artifact/: the artifact format (I/O contract, manifest, sidecar configs, atomic writes);
- export/: the torch side (reference model source, export wrappers, shared weights, the pipeline);
- runtime/: ONNX Runtime, torch-free (sessions, runner, generation, onnxruntime-genai);
- verify/: the verification engine (references, checks, diagnosis, results, reports);
- cli/: the `export-onnx` command and the pytest plugin, the only code that knows flags, prints and exits.

The public API below is what the README's Python section uses. Names resolve on first use, so that
`import exporter` alone imports neither torch nor onnxruntime.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "seeded_model": "exporter.verify.references.model_source",
    "checkpoint_model": "exporter.verify.references.model_source",
    "export_artifact": "exporter.export.pipeline",
    "verify_artifact": "exporter.verify.engine",
    "ParitySettings": "exporter.verify.inputs",
    "VerifyReport": "exporter.verify.results",
    "Comparison": "exporter.verify.metrics",
    "Tolerance": "exporter.verify.metrics",
    "aggregate": "exporter.verify.metrics",
    "compare": "exporter.verify.metrics",
    "TOLERANCES": "exporter.verify.tolerances",
    "OrtRunner": "exporter.runtime.runner",
    "SessionSettings": "exporter.runtime.sessions",
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
