"""The export, torch side: the reference model wrapped as prefill and decode graphs, written as an artifact.

- model_source: the reference model from a preset (seeded) or a checkpoint, with the record that rebuilds it;
- graphs: the export wrappers that flatten the cache into named inputs and outputs;
- weights: one weights file shared by both graphs, by content;
- pipeline: torch.onnx export, passes, checks and the atomic write of the folder.
"""

# torch.onnx and its optimiser: their info lines drown ours, so the export and the CLI quiet them.
LIBRARY_LOGGERS = ("torch", "onnx_ir", "onnxscript")
