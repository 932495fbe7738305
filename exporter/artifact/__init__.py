"""The artifact format: what an export folder holds and how it is read and written.

- folder: an artifact opened once (Artifact), its files checked and its graphs parsed once;
- contract: the graphs' I/O names, dtypes and dynamic axes, as data; axes: naming and linting them;
- manifest: manifest.json (config, contract, cache layout, file hashes) and its checks;
- quantization: the int4/int8 scheme a manifest records; scopes: the module each node computes (torch.onnx's
  name scopes in its metadata);
- consumers / tokenizer: the sidecar files onnxruntime-genai and Optimum read, and the tokenizer copied beside;
- chat: a conversation rendered with the tokenizer's chat template, as transformers renders it;
- foreign: folders Optimum or onnxruntime-genai's builder wrote, mapped onto the contract;
- paths: atomic writes, folder locks and JSON reads that every writer shares.
- destination: an export's output folder, refused before the export, built beside it and swapped in.

Imports nothing above it: no torch, no onnxruntime sessions.
"""
