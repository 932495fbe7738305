"""ONNX Runtime side, torch-free: sessions, the runner of the two graphs, generation, onnxruntime-genai.

- sessions: providers, session settings, the shared weights map and graph loading;
- runner: OrtRunner, prefill and cached decode over the artifact's contract;
- generation: greedy and sampled generation over an OrtRunner;
- binding: decode steps through onnxruntime's IO binding, the cache kept as OrtValues;
- genai: the same artifact through onnxruntime-genai;
- foreign: a foreign graph (artifact.foreign) behind OrtRunner's interface;
- numpy_steps: generation's start/step for the runners that keep the cache as numpy;
- node: the artifact in onnxruntime-web and onnxruntime-node, and transformers.js's generation, through one Node
  process (node_bridge.mjs).

A test proves that importing this package never imports torch.
"""
