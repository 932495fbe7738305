"""Export wrappers: the reference model seen through the ONNX I/O contract.

The reference keeps MiniMind's Python API (a list of (k, v) per layer, each
(B, L, Hkv, D)). The graphs follow the contract Optimum and onnxruntime-genai expect (docs/artifact-format.md):
flat named past/present tensors laid out (B, Hkv, L, D). That plumbing lives
here, not in the model.

Both graphs send a negative input id past the embedding table, for every
family: the model's Gather then fails on it as torch's embedding does, where
ONNX Gather would take the table's last rows (an id of -1 would give the
logits of the last id).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reference.layers import negative_past_the_table

IGNORE_INDEX = -100


def masked_shifted_loss(logits, labels):
    """MiniMind's shifted cross entropy, written without empty tensors.

    `logits[:, :-1]` is empty at sequence length 1, and ONNX Runtime fails in a
    Reshape on it where PyTorch returns NaN. Shifting the labels left and
    padding with IGNORE_INDEX keeps every tensor non-empty; the mean over
    non-ignored targets is then sum / count, which is 0 / 0 = NaN exactly when
    PyTorch's mean is NaN.

    A target outside [0, vocab) other than IGNORE_INDEX makes the gather fail, as
    PyTorch's cross entropy refuses it, instead of picking a logit from the end.
    """
    b = labels.shape[0]
    pad = torch.full((b, 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    targets = torch.cat([labels[:, 1:], pad], dim=1)  # (B, T)
    keep = targets != IGNORE_INDEX
    logits32 = logits.float()
    log_z = torch.logsumexp(logits32, dim=-1)  # (B, T)
    index = negative_past_the_table(torch.where(keep, targets, 0), logits.shape[-1])
    picked = torch.gather(logits32, -1, index[..., None])[..., 0]
    nll = torch.where(keep, log_z - picked, 0.0)
    return nll.sum() / keep.sum().float()


class _TiedLMHead(nn.Module):
    """lm_head reading the embedding's own (vocab, hidden) table: a 2-D Gemm with transB."""

    def __init__(self, table: nn.Parameter):
        super().__init__()
        self.table = table

    def forward(self, hidden):
        flat = F.linear(hidden.reshape(-1, hidden.shape[-1]), self.table)  # exported as Gemm(transB=1)
        return flat.reshape(*hidden.shape[:-1], flat.shape[-1])


def share_tied_table(model: nn.Module) -> None:
    """Let lm_head read a tied embedding table as it is (in place; export copies only).

    Exported as is, lm_head is MatMul(hidden, Transpose(table)), and ONNX Runtime
    folds the Transpose into a second, session-private copy of the whole table.
    A Gemm with transB reads (and prepacks) the table as stored, and the
    embedding's Gather copies contiguous rows of it.
    """
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    # Only a table actually shared by an nn.Embedding and a bias-free nn.Linear (MiniMind's tie); other
    # families and bring-your-own decoders export their modules as they are.
    tied = (
        isinstance(embed, nn.Embedding)
        and isinstance(head, nn.Linear)
        and head.bias is None
        and head.weight is embed.weight
    )
    if tied:
        model.lm_head = _TiedLMHead(embed.weight)


def _flatten_presents(presents):
    flat = []
    for k, v in presents:
        flat += [k.transpose(1, 2), v.transpose(1, 2)]  # (B, Hkv, L, D)
    return flat


class DecodeGraph(nn.Module):
    """input_ids, attention_mask, position_ids, past_key_values.*[, labels] -> logits, present.*[, loss].

    The one program both graphs are cut from (exporter/export/tracing.py): decode.onnx without the loss, and
    prefill.onnx with an empty past in place of the past inputs.
    """

    def __init__(self, model: nn.Module, with_loss: bool):
        super().__init__()
        self.model = model
        self.with_loss = with_loss

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, labels=None):
        """New tokens on the cache.

        Args:
            input_ids: (B, T) new token ids; a negative id fails in the embedding's Gather.
            attention_mask: (B, P + T), past and new positions: 1 for a token, 0 for left padding.
            position_ids: (B, T), the new tokens' positions.
            past_key_values: the flat past, key then value of each layer in turn, each (B, Hkv, P, D).
            labels: (B, T) targets for the shifted loss (IGNORE_INDEX masks a position); used only with_loss.

        Returns:
            (logits, present key and value of each layer as (B, Hkv, P + T, D)[, loss]).
        """
        pairs = [
            (past_key_values[2 * i].transpose(1, 2), past_key_values[2 * i + 1].transpose(1, 2))
            for i in range(len(past_key_values) // 2)
        ]
        input_ids = negative_past_the_table(input_ids, self.model.config.vocab_size)
        out = self.model(
            input_ids, attention_mask=attention_mask, past_key_values=pairs, position_ids=position_ids, use_cache=True
        )
        outputs = [out.logits, *_flatten_presents(out.past_key_values)]
        if self.with_loss:
            outputs.append(masked_shifted_loss(out.logits, labels))
        return tuple(outputs)
