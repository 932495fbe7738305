"""The verification engine: ONNX Runtime against the PyTorch reference, a golden bundle, or itself.

Modules follow the data flow: inputs (seeded feeds) -> checks / invariants / health / probe / routing (MoE
expert choices) -> metrics (pure comparisons) -> results (frozen objects) -> reports (text, JSON, JUnit,
HTML). engine.verify_artifact runs them all. Only checks against the PyTorch model import torch, and only
when one is given.
"""
