"""Runs inside Optimum's own virtual environment (its release needs transformers < 4.58), never imported by the
test suite: ORTModelForCausalLM on artifact folders, as a user of Optimum loads them.

Reads one JSON request on stdin and writes one JSON answer on stdout:
  {"generate": [{"folder", "prompt", "max_new_tokens"}, ...], "texts": [{"folder", "text", "max_new_tokens"}, ...]}
  -> {"generate": [new token ids, ...], "texts": [{"ids", "new", "decoded"}, ...]}
Greedy decoding throughout; the model is loaded once per folder.
"""

import json
import sys

import torch
from optimum.onnxruntime import ORTModelForCausalLM
from transformers import AutoTokenizer


def main() -> None:
    request = json.load(sys.stdin)
    models = {}

    def model(folder):
        if folder not in models:
            models[folder] = ORTModelForCausalLM.from_pretrained(folder, file_name="decode.onnx", use_cache=True)
        return models[folder]

    generated = []
    for run in request.get("generate", []):
        prompt = run["prompt"]
        out = model(run["folder"]).generate(
            torch.tensor([prompt]), max_new_tokens=run["max_new_tokens"], do_sample=False
        )
        generated.append(out[0, len(prompt) :].tolist())
    texts = []
    for run in request.get("texts", []):
        tokenizer = AutoTokenizer.from_pretrained(run["folder"])
        inputs = tokenizer(run["text"], return_tensors="pt")
        out = model(run["folder"]).generate(**inputs, max_new_tokens=run["max_new_tokens"], do_sample=False)
        new = out[0, inputs.input_ids.shape[1] :]
        texts.append({"ids": inputs.input_ids[0].tolist(), "new": new.tolist(), "decoded": tokenizer.decode(new)})
    json.dump({"generate": generated, "texts": texts}, sys.stdout)


if __name__ == "__main__":
    main()
