"""The PyTorch reference behind the same named-feed interface as OrtRunner.

It calls the reference model through its own Python API (a list of (k, v)
per layer, MiniMind's loss), not through the export wrappers, so parity
compares the graphs with the model rather than with themselves.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import torch

from exporter.artifact.contract import KV_KINDS
from exporter.artifact.manifest import Manifest
from exporter.verify.checks.greedy import GreedyTrace
from reference.layers import TORCH_DTYPES


class TorchRunner:
    """The reference model behind OrtRunner's named-feed interface, in the artifact's dtype or in `dtype` (a copy
    of the model is cast where its parameters hold another; float64 for the referee, references.referee)."""

    def __init__(self, model: torch.nn.Module, manifest: Manifest, dtype: torch.dtype | None = None):
        self.manifest = manifest
        dtype = dtype or TORCH_DTYPES[manifest.dtype]
        same = next(model.parameters()).dtype == dtype
        self.model = (model if same else copy.deepcopy(model).to(dtype)).eval()

    name = "pytorch reference"

    @contextlib.contextmanager
    def in_float64(self):
        """This runner with its model's floating parameters and buffers cast to float64 in place, each restored to its
        own dtype afterwards, exactly (float64 holds every float32 and float16 value). The referee's run without a
        second copy of the model: its float64 weights take the place of the float32 (or float16) ones meanwhile, so
        that verify holds at most twice the float32 weights for the model at any time."""
        tensors = [t for t in (*self.model.parameters(), *self.model.buffers()) if t.is_floating_point()]
        kept = [(tensor, tensor.dtype) for tensor in tensors]
        try:
            for tensor, _ in kept:
                tensor.data = tensor.data.to(torch.float64)
            yield self
        finally:
            for tensor, dtype in kept:
                tensor.data = tensor.data.to(dtype)

    def _outputs(self, out) -> dict:
        cache = self.manifest.cache
        result = {"logits": out.logits.numpy()}
        for layer, (k, v) in enumerate(out.past_key_values):
            for kind, tensor in zip(KV_KINDS, (k, v)):
                result[cache.present(layer, kind)] = tensor.transpose(1, 2).numpy()  # (B, Hkv, L, D)
        if out.loss is not None:  # float32, or float64 for the referee
            result["loss"] = np.asarray(
                out.loss.item(), np.float64 if out.logits.dtype == torch.float64 else np.float32
            )
        return result

    @torch.no_grad()
    def prefill(self, feeds: dict) -> dict:
        labels = torch.from_numpy(feeds["labels"]) if "labels" in feeds else None
        out = self.model(
            torch.from_numpy(feeds["input_ids"]),
            attention_mask=torch.from_numpy(feeds["attention_mask"]),
            position_ids=torch.from_numpy(feeds["position_ids"]),
            use_cache=True,
            labels=labels,
        )
        return self._outputs(out)

    @torch.no_grad()
    def decode(self, feeds: dict) -> dict:
        cache = self.manifest.cache
        past = [
            tuple(torch.from_numpy(feeds[cache.past(layer, kind)]).transpose(1, 2) for kind in KV_KINDS)
            for layer in range(cache.num_layers)
        ]
        out = self.model(
            torch.from_numpy(feeds["input_ids"]),
            attention_mask=torch.from_numpy(feeds["attention_mask"]),
            past_key_values=past,
            position_ids=torch.from_numpy(feeds["position_ids"]),
            use_cache=True,
        )
        return self._outputs(out)

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> GreedyTrace:
        return reference_greedy(self.model, prompt_ids, max_new_tokens, eos_token_id)

    @torch.no_grad()
    def module_outputs(self, feeds: dict, graph: str = "prefill") -> dict:
        """Every submodule's output (its first tensor) for a call of `graph` ("prefill" or "decode", whose
        `feeds` hold the past) on `feeds`, by module path, and the call's presents, by output name; the probe
        matches them to values of that graph."""
        outputs: dict[str, np.ndarray] = {}

        def hook(path):
            def record(module, args, output):
                first = (
                    output
                    if isinstance(output, torch.Tensor)
                    else next((o for o in output if isinstance(o, torch.Tensor)), None)
                    if isinstance(output, tuple)
                    else None
                )
                if first is not None and first.is_floating_point():
                    outputs[path] = first.float().numpy()

            return record

        handles = [module.register_forward_hook(hook(path)) for path, module in self.model.named_modules() if path]
        try:
            if graph == "prefill":  # the loss's labels play no part in the modules
                result = self.prefill({name: feeds[name] for name in ("input_ids", "attention_mask", "position_ids")})
            else:
                result = self.decode(feeds)
        finally:
            for handle in handles:
                handle.remove()
        # a present is computed inside its attention module, before that module's output: the checkpoint
        # that the layer-level localisation reads, so the probe cannot point past it
        return {**outputs, **{name: value for name, value in result.items() if name.startswith("present.")}}


@torch.no_grad()
def reference_greedy(
    model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None
) -> GreedyTrace:
    """MiniMind-style greedy decoding with the model's own KV cache and default positions.

    Args:
        model: the PyTorch reference.
        prompt_ids: the prompt, one row of token ids.
        max_new_tokens: the most tokens to choose, at least 1.
        eos_token_id: the id that ends the run (included in the ids); None: it runs to max_new_tokens.

    Returns:
        The GreedyTrace: the new ids, and the float32 logits each was chosen from.
    """
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    new_ids: list[int] = []
    logits = []
    while True:
        token = int(out.logits[0, -1].argmax())
        new_ids.append(token)
        logits.append(out.logits[0, -1].float().numpy())
        if token == eos_token_id or len(new_ids) == max_new_tokens:
            return GreedyTrace(new_ids, np.stack(logits))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
