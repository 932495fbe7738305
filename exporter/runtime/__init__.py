"""Running an artifact, torch-free: ONNX Runtime's sessions and runner, generation, onnxruntime-genai, and the other
runtimes a verification runs it in.

- protocol: the Runner protocol the verification and generation use, its label in reports, its capabilities;
- registry: the runtimes by name, each registered once by its module;
- providers: the execution providers (CPU and CUDA), whether each can run here, a session's providers list;
- settings: SessionSettings, the settings of the sessions that check an artifact, one session's options;
- shared_weights: the artifact's weights file mapped once, read in place by every session;
- sessions: sessions on an artifact's graphs (checked against the manifest), a modified copy or a graph file;
- runner: OrtRunner, prefill and cached decode over the artifact's contract (the onnxruntime runtime);
- openvino_runner: the artifact's graphs compiled by OpenVINO (the openvino runtime);
- steps: start/step over a runner's decode with the cache held as numpy arrays;
- generation: greedy and sampled generation over a runner;
- binding: decode steps through onnxruntime's IO binding, the cache kept as OrtValues;
- genai: the same artifact through onnxruntime-genai;
- foreign: a foreign graph (artifact.foreign) behind the Runner protocol;
- node: the artifact in onnxruntime-web and onnxruntime-node, and transformers.js's generation, through one Node
  process (node_bridge.mjs);
- chromium: the artifact in onnxruntime-web in headless Chromium, on a page (chromium_page.mjs) of a local server.

A test proves that importing this package never imports torch.
"""
