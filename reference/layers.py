"""Pieces every decoder family shares: the output type, the training loss, attention over a KV cache,
negative indices sent past a table, the torch dtype of each precision an artifact holds.

Attention math is one pure function chosen by name (`ATTENTION`), not one
class per backend. `attend` adds the cache: it appends the new keys/values to
the past, returns the present (B, P+T, Hkv, D), one entry per kv head, and
masks causally aligned bottom-right plus padded keys. Families and
bring-your-own adapters call it instead of re-implementing a cache.

Inside, attention runs heads-first (B, Hkv, L, D), the exported graphs' cache
layout: the transposes between MiniMind's (B, L, Hkv, D) and that layout then
meet in pairs in the graph and onnxruntime removes them, and each kv head
attends for its group of query heads instead of being repeated. The cache is
then copied once a step (the concat), not at every transpose and head repeat,
so a decode step's time barely grows with the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reference.errors import ContextLengthError

# The torch dtype of each artifact dtype: the reference runs in the artifact's precision, and the export casts to it.
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # (B, T_kept, V)
    past_key_values: list | None  # per layer (k, v), each (B, P+T, Hkv, D)
    loss: torch.Tensor | None
    aux_loss: torch.Tensor


def widened(x: torch.Tensor) -> torch.Tensor:
    """`x` in at least float32: float16 and bfloat16 widen to float32, float32 and float64 stay.

    The families compute norms, softmax, the loss and rotary angles in float32 whatever their dtype, as the exported
    graphs do; a model cast to float64 (verify's referee, exporter.verify.references.referee) then computes every op
    in float64, so that it measures the rounding of a float32 or float16 run rather than sharing part of it."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def shifted_cross_entropy(logits, labels):
    """Token t predicts token t+1; labels of -100 are ignored (MiniMind's training loss)."""
    x, y = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
    return F.cross_entropy(widened(x.view(-1, x.size(-1))), y.view(-1), ignore_index=-100)


def check_length(input_ids, past_key_values, limit: int, field: str) -> None:
    """Refuse a cache plus new tokens longer than the model's positions.

    Args:
        input_ids: (B, T) new token ids.
        past_key_values: per layer (k, v), each (B, P, Hkv, D), or None for no cache.
        limit: the most positions the model has.
        field: the config field that sets the limit, as the message names it.

    Raises:
        ContextLengthError: P + T exceeds `limit` (never while exporting: the runtime checks lengths).
    """
    past_len = past_key_values[0][0].shape[1] if past_key_values is not None else 0
    total = past_len + input_ids.shape[1]
    # A shape check, not a tensor-value branch; skipped while exporting, where the
    # runtime checks lengths before running.
    if not torch.compiler.is_exporting() and total > limit:
        raise ContextLengthError(
            f"sequence of {total} tokens (past {past_len} + new {input_ids.shape[1]}) "
            f"exceeds {field} {limit}; shorten the prompt or the generation"
        )


def negative_past_the_table(indices, table_size: int):
    """`indices` with each negative one replaced by `table_size`, one past the table's last row.

    ONNX Gather and GatherElements take a negative index from the table's end where torch refuses
    it; sent past the table instead, it fails in both, like any index past the table. Valid
    indices are unchanged.
    """
    return torch.where(indices < 0, table_size, indices)


def default_position_ids(input_ids, past_key_values):
    """Positions continue after the cache: P .. P+T-1 for every row."""
    b, t = input_ids.shape
    past_len = past_key_values[0][0].shape[1] if past_key_values is not None else 0
    return (torch.arange(t, device=input_ids.device) + past_len).expand(b, t)


def attention_bias(attention_mask, query_len: int, key_len: int, device):
    """Additive float32 bias (B or 1, 1, T, L): causal aligned bottom-right, -1e9 on padded keys.

    Args:
        attention_mask: (B, L), 1 keep, 0 pad; None: no padding (the bias is (1, 1, T, L)).
        query_len: T, the new tokens, which are the last T of the L keys.
        key_len: L, past plus new.
        device: where to build the bias.
    """
    past_len = key_len - query_len
    q_pos = torch.arange(query_len, device=device)[:, None] + past_len
    k_pos = torch.arange(key_len, device=device)[None, :]
    bias = torch.zeros(query_len, key_len, device=device).masked_fill(k_pos > q_pos, float("-inf"))[None, None]
    if attention_mask is not None:
        bias = bias + (1.0 - attention_mask[:, None, None, :].float()) * -1e9
    return bias


def eager_attention(q, k, v, attention_mask, dropout_p=0.0):
    """Attention written out: scores and softmax in float32 (in float64 for float64), causal aligned bottom-right,
    padded keys masked.

    Query head h attends with kv head h // (H / Hkv), as MiniMind's repeat_kv pairs them.

    Args:
        q: (B, H, T, D) queries.
        k: (B, Hkv, L, D) keys, past and new.
        v: (B, Hkv, L, D) values.
        attention_mask: (B, L), 1 keep, 0 pad; None: no padding.
        dropout_p: dropout on the probabilities (training only), as MiniMind's attn_dropout.

    Returns:
        (B, H, T, D).
    """
    b, heads, t, d = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    grouped = q.reshape(b, kv_heads, heads // kv_heads * t, d)
    scores = (grouped @ k.transpose(-2, -1)).view(b, heads, t, length) / math.sqrt(d)
    scores = widened(scores) + attention_bias(attention_mask, t, length, q.device)
    probs = F.softmax(scores, dim=-1).type_as(q)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return (probs.view(b, kv_heads, heads // kv_heads * t, length) @ v).view(b, heads, t, d)


def sdpa_attention(q, k, v, attention_mask, dropout_p=0.0):
    """torch's fused attention, causal aligned top-left: right only without a cache and without padding.

    Args:
        q: (B, H, T, D) queries.
        k: (B, Hkv, T, D) keys.
        v: (B, Hkv, T, D) values.
        attention_mask: ignored; the caller uses this path only without one (see attend).
        dropout_p: dropout on the attention probabilities (training only).

    Returns:
        (B, H, T, D).
    """
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=True)


ATTENTION = {"sdpa": sdpa_attention, "eager": eager_attention}


def attend(q, k, v, past_key_value=None, attention_mask=None, implementation: str = "eager", dropout_p: float = 0.0):
    """Causal attention over a cache.

    The fused path is used only without a cache and without a mask, where
    its top-left causal alignment is right.

    Args:
        q: (B, T, H, D) queries of the new tokens.
        k: (B, T, Hkv, D) keys of the new tokens.
        v: (B, T, Hkv, D) values of the new tokens.
        past_key_value: (k, v) each (B, P, Hkv, D), or None.
        attention_mask: (B, P+T), 1 keep, 0 pad; None: no padding.
        implementation: a key of ATTENTION ("eager" or "sdpa").
        dropout_p: dropout on the attention probabilities (give 0 outside training).

    Returns:
        The output (B, T, H * D) and the present (k, v), each (B, P+T, Hkv, D).
    """
    b, t, _, _ = q.shape
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, D)
    if past_key_value is not None:
        kh = torch.cat([past_key_value[0].transpose(1, 2), kh], dim=2)
        vh = torch.cat([past_key_value[1].transpose(1, 2), vh], dim=2)
    fused = implementation == "sdpa" and past_key_value is None and attention_mask is None and t > 1
    out = ATTENTION["sdpa" if fused else "eager"](q.transpose(1, 2), kh, vh, attention_mask, dropout_p)
    return out.transpose(1, 2).reshape(b, t, -1), (kh.transpose(1, 2), vh.transpose(1, 2))
