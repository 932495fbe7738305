"""Bring your own decoder: export and verify a PyTorch decoder the toolkit did not define.

The exporter and the verifier need two things from a model:

1. `model.config`, exposing the sizes of the I/O contract. For your own model
   that is a `DecoderSpec` (num_hidden_layers, num_key_value_heads, head_dim,
   vocab_size, max_position_embeddings, eos/bos ids).
2. `model.forward(input_ids, attention_mask=None, past_key_values=None,
   use_cache=False, logits_to_keep=0, labels=None, position_ids=None)`
   returning a `CausalLMOutput`, with the cache a list of (k, v) per layer,
   each (B, L, num_key_value_heads, head_dim).

Most teaching decoders have no cache and no padding mask. Subclass
`DecoderAdapter`: it keeps your module as `self.model` (its weights untouched,
its state-dict keys under `model.`), and you write `forward` by calling your
submodules, with `reference.layers.attend` doing the cache, the causal mask and
the padding mask. `check_adapter` then proves, before any export, that the
adapter equals your original forward and that cached decoding equals the full
forward. README "Bring your own decoder" walks through the seed 001 demo model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from reference.configs import DecoderSpec
from reference.errors import ModelError


class DecoderAdapter(nn.Module):
    """Base class: your decoder as `self.model`, its sizes as `self.config`; override `forward`.

    uniform_layers: set it True in your subclass only if `forward` calls every layer of `self.model.layers` with the
    same arguments, chosen by nothing outside the layer's own module (no layer index, no per-layer mask, window or
    scale made by the parent). The export may then trace three layers and grow the graph to full depth
    (exporter/export/layer_template.py), which holds the layers' modules to each other but cannot see a choice your
    forward makes per layer. False (the default) traces every layer.
    """

    uniform_layers = False

    def __init__(self, model: nn.Module, spec: DecoderSpec):
        super().__init__()
        self.model = model
        self.config = spec

    def forward(
        self,
        input_ids,
        attention_mask=None,
        past_key_values=None,
        use_cache=False,
        logits_to_keep=0,
        labels=None,
        position_ids=None,
    ):
        """The shared forward contract, which a subclass implements with `reference.layers.attend`.

        Args:
            input_ids: (B, T) new token ids.
            attention_mask: (B, P+T), 1 for a token, 0 for left padding; None: no padding.
            past_key_values: per layer (k, v), each (B, P, num_key_value_heads, head_dim); None: no cache.
            use_cache: return the present (past plus the new positions) as past_key_values.
            logits_to_keep: the last positions to compute logits for; 0: every position.
            labels: (B, T) targets of the shifted cross entropy (-100 ignored); None: no loss.
            position_ids: (B, T) positions of the new tokens; None: P .. P+T-1 for every row.

        Returns:
            A reference.layers.CausalLMOutput.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement forward (see reference/byo.py)")

    def exported_constants(self) -> dict:
        """The tensors your forward computes from constants alone (no input, no parameter), such as rotary
        frequencies, by a name of your choosing: an export folds each into an initializer, and the weight audit
        of verify (exporter/verify/checks/weights/) matches every initializer to a parameter, a buffer or one
        of these. None by default; override it if your forward computes such a table."""
        return {}


def output_problems(out, config, batch: int, length: int, with_loss: bool = False, past_length: int = 0) -> list[str]:
    """How a forward's output breaks the contract sizes of `config`, each problem naming the field to fix.

    Args:
        out: what forward returned, called with use_cache=True (and labels, when `with_loss`).
        config: the model's config, with the contract's sizes.
        batch: the batch size it was called with.
        length: the new tokens per row it was called with.
        with_loss: labels were given, so a scalar loss is due.
        past_length: the cached positions it was called on.

    Returns:
        The problems; empty when the output keeps the contract.
    """
    logits, past = getattr(out, "logits", None), getattr(out, "past_key_values", None)
    if not isinstance(logits, torch.Tensor):
        return [
            f"forward returned a {type(out).__name__}, not a CausalLMOutput (logits, past_key_values, loss, aux_loss)"
        ]
    problems = []
    if with_loss:  # verification compares the graph's loss with this one
        loss = getattr(out, "loss", None)
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
            found = (
                "None"
                if loss is None
                else f"a {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
            problems.append(
                f"loss is {found} with labels given, not a scalar tensor: return the shifted cross "
                "entropy (reference.layers.shifted_cross_entropy), or export without the loss "
                "(with_loss=False, --no-loss)"
            )
    if tuple(logits.shape) != (batch, length, config.vocab_size):
        problems.append(
            f"logits have shape {tuple(logits.shape)}, not (batch, length, vocab_size) = "
            f"{(batch, length, config.vocab_size)}: set vocab_size to the model's"
        )
    if not isinstance(past, (list, tuple)):
        return problems + [
            f"past_key_values is {type(past).__name__} with use_cache=True; return the present (k, v) of every layer"
        ]
    if len(past) != config.num_hidden_layers:
        problems.append(
            f"past_key_values holds {len(past)} layers, but num_hidden_layers is "
            f"{config.num_hidden_layers}: set it to the model's"
        )
    want = (batch, past_length + length, config.num_key_value_heads, config.head_dim)
    new_only = (batch, length, *want[2:])
    for layer, pair in enumerate(past):
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in pair]
        if past_length and len(shapes) == 2 and all(shape == new_only for shape in shapes):
            problems.append(
                f"layer {layer}'s present (k, v) hold the {length} new positions only, not the "
                f"{past_length} past ones before them: return the past concatenated with the new keys "
                "and values along the length axis (reference.layers.attend does)"
            )
            break
        if len(shapes) != 2 or any(shape != want for shape in shapes):
            problems.append(
                f"layer {layer}'s (k, v) have shapes {shapes}, not (batch, length, num_key_value_heads, "
                f"head_dim) = {want} each: return them in that layout, or fix the config's sizes"
            )
            break  # one layer says it; the others are alike
    return problems


@dataclass(frozen=True)
class AdapterCheck:
    """How far the adapter is from the original model, and cached decoding from the full forward."""

    full_forward_max_abs: float  # adapter (no cache, no mask) vs the original forward
    cached_decode_max_abs: float  # adapter token by token through its cache vs adapter in one pass
    atol: float

    @property
    def passed(self) -> bool:
        return self.full_forward_max_abs <= self.atol and self.cached_decode_max_abs <= self.atol

    def __bool__(self) -> bool:
        return self.passed


@torch.no_grad()
def check_adapter(
    adapter: nn.Module, original_logits, input_ids: torch.Tensor, atol: float = 1e-5, with_loss: bool = True
) -> AdapterCheck:
    """Compare the adapter with the user's own forward, and its cached decoding with its full forward.

    Args:
        adapter: the DecoderAdapter; each module's training mode is put back afterwards.
        original_logits: the user's own forward, a function of input_ids returning (B, T, V) logits.
        input_ids: (B, T) token ids to compare on.
        atol: the largest absolute difference of logits either comparison may show.
        with_loss: the adapter must return a scalar loss for labels, as an export with the loss (the default)
            needs; pass False for an adapter exported with with_loss=False (--no-loss).

    Returns:
        The AdapterCheck; `passed` is the verdict.

    Raises:
        ModelError: the adapter breaks the contract's sizes, or original_logits returns no logits of the
            adapter's shape.
    """
    # Each module's own mode, put back below: a training loop may call this, and a new adapter is in
    # training mode (nn.Module's default) around a user's model in eval mode.
    modes = [(module, module.training) for module in adapter.modules()]
    adapter.eval()
    try:
        full = adapter(input_ids, use_cache=True, labels=input_ids if with_loss else None)
        problems = output_problems(full, adapter.config, *input_ids.shape, with_loss)
        if problems:
            raise ModelError(f"{type(adapter).__name__} breaks the contract (reference/byo.py): {'; '.join(problems)}")
        original = original_logits(input_ids)
        if not isinstance(original, torch.Tensor) or original.shape != full.logits.shape:
            found = (
                f"a tensor of shape {tuple(original.shape)}"
                if isinstance(original, torch.Tensor)
                else f"a {type(original).__name__}"
            )
            raise ModelError(
                f"original_logits returned {found}, not the logits {tuple(full.logits.shape)} "
                "(batch, length, vocab_size): pass a function of input_ids returning your model's "
                "logits, e.g. lambda ids: model(ids)[0]"
            )
        past, steps = None, []
        for t in range(input_ids.shape[1]):
            out = adapter(input_ids[:, t : t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            steps.append(out.logits)
    finally:
        for module, mode in modes:
            module.training = mode
    full_diff = (full.logits.double() - original.double()).abs().max().item()
    cached_diff = (torch.cat(steps, dim=1).double() - full.logits.double()).abs().max().item()
    return AdapterCheck(full_diff, cached_diff, atol)
