"""The artifact format: what an export folder holds and how it is read and written.

- contract: the graphs' I/O names, dtypes and dynamic axes, as data; axes: naming and linting them;
- manifest: manifest.json (config, contract, cache layout, file hashes) and its checks;
- consumers / tokenizer: the sidecar files onnxruntime-genai and Optimum read, and the tokenizer copied beside;
- paths: atomic writes, folder locks and JSON reads that every writer shares.

Imports nothing above it: no torch, no onnxruntime sessions.
"""
