"""Export MiniMind to ONNX, run it in ONNX Runtime, and prove parity with the PyTorch reference.

Modules follow the data: contract (I/O names and axes) -> graphs (export
wrappers) -> export (pipeline, weights, axes, manifest) -> sessions / runtime / generation
(ONNX Runtime) -> model_source / reference_runner / verify (the verification engine; parity
re-exports its API under the older import path) -> report / cli (the commands; the options
they share; outcome: how a command ends, its exit code, error line and signals).
"""

LIBRARY_LOGGERS = ("torch", "onnx_ir", "onnxscript")  # torch.onnx and its optimiser: their info lines drown ours
