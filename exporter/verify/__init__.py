"""The verification engine: ONNX Runtime against the PyTorch reference, a golden bundle, or itself.

- inputs: seeded feeds and the sweep grid; metrics: pure comparisons; tolerances: profiles with their reasoning;
- references/: the PyTorch model as a runner (torch_runner) and recorded golden bundles (golden);
- checks/: prefill, decode steps, greedy and sweep (outputs), invariants, the weight audit (weights), health, MoE
  routing, providers;
- diagnosis/: debug graphs that expose every layer (probe) and the first layer that diverges (localise);
- results: frozen result objects; reports/: text, JSON, JUnit and HTML writers.

engine.verify_artifact runs them all. Only the PyTorch reference imports torch, and only when one is given.
"""
