"""The export, torch side: the reference model wrapped as prefill and decode graphs, written as an artifact.

- graphs: the export wrappers that flatten the cache into named inputs and outputs;
- layer_template: a deep model traced a few layers deep, its graph grown to its depth;
- weights: one weights file shared by both graphs, by content;
- tracing: the model traced with torch.onnx once for both graphs (example inputs, dynamic shapes);
- graph_passes: the graphs cut from the traced program and rewritten (trace metadata, RMSNorm's form, axis names);
- checks: what an export refuses before tracing (arguments, source, weights, the eager forward), and the smoke run;
- smoothing: the int8 projections' input maxima measured on calibration ids, and the divisors that smooth them;
- quantize: int4/int8 weight-only quantization of the written graphs;
- pipeline: export_artifact, the orchestration: checks, tracing, passes, quantization and the folder's files, built
  beside the destination and swapped in (exporter.artifact.destination).

The model comes from reference.source (a preset's seeded model or a checkpoint's, with its source record); the
export's checks judge by exporter.tolerances. Nothing here imports verify/, its sibling.
"""

# torch.onnx and its optimiser: their info lines drown ours, so the export and the CLI quiet them.
LIBRARY_LOGGERS = ("torch", "onnx_ir", "onnxscript")
