"""The verification engine: ONNX Runtime against the PyTorch reference, a golden bundle, or itself.

- inputs: seeded feeds and the sweep grid; metrics: pure comparisons (judged by exporter.tolerances' profiles);
- references/: the reference rebuilt from the manifest's source (model_source), the PyTorch model as a runner
  (torch_runner), recorded golden bundles (golden/), Transformers' model of a Hugging Face folder;
- checks/: prefill, decode steps and sweep (outputs), each call's outputs judged (calls), greedy generation
  (greedy), invariants, the weight audit (weights/), health, MoE routing (routers, routing,
  routing_explainer), providers;
- diagnosis/: debug graphs that expose every layer (probe), the first layer that diverges (localise), both as
  each provider's run asks for them (diagnose);
- results: frozen result objects; reports/: text, JSON, JUnit and HTML writers;
- plan: verify_artifact's arguments checked and the runners and reference chosen, before any work;
- engine: verify_artifact, which runs them all; foreign: verify_foreign, the same checks on a folder another
  exporter wrote;
- consumers: the consumer checks, onnxruntime-genai's and transformers.js's greedy tokens on the folder as it is
  against the reference's, and why either does not run.

Only the PyTorch reference imports torch, and only when one is given. Nothing here imports export/, its sibling.
"""
