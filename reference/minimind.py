"""MiniMind, current generation ("minimind-3"): the PyTorch reference.

Behaviour follows ../shared/REFERENCE-MODELS.md section 1. Parameter names are
MiniMind's state-dict keys, so real checkpoints load one to one.

Two deliberate, numerically neutral departures from the upstream code, both so
the model exports without Python branches on tensor values:
- RoPE cos/sin are computed in float32 from position ids (`pos * inv_freq`, the
  same float ops the upstream table uses) instead of slicing a 32768-row table
  (25 MB of constants per graph); this also lets callers pass explicit position
  ids (left padding, the ONNX contract).
- The fused attention path is chosen when there is no cache and no mask
  (upstream also takes it for an all-ones mask, which needs a tensor test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from reference.minimind_config import MiniMindConfig

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise and scale in float32, then cast back to the input dtype.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).type_as(x)


def rope_inv_freq(config: MiniMindConfig) -> torch.Tensor:
    dim = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor):
    """cos/sin of shape (B, T, head_dim) for integer positions (B, T)."""
    freqs = position_ids[..., None].float() * inv_freq  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.cos(emb), torch.sin(emb)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x, cos, sin):
    # x: (B, T, H, D); cos/sin: (B, T, D), shared by every head.
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def repeat_kv(x, n_rep: int):
    """(B, L, Hkv, D) -> (B, L, Hkv * n_rep, D), each kv head repeated n_rep times in a row."""
    if n_rep == 1:
        return x
    b, length, h, d = x.shape
    return x[:, :, :, None, :].expand(b, length, h, n_rep, d).reshape(b, length, h * n_rep, d)


def attention_bias(attention_mask, query_len: int, key_len: int, device):
    """Additive float32 bias (B or 1, 1, T, L): causal aligned bottom-right, -1e9 on padded keys."""
    past_len = key_len - query_len
    q_pos = torch.arange(query_len, device=device)[:, None] + past_len
    k_pos = torch.arange(key_len, device=device)[None, :]
    bias = torch.zeros(query_len, key_len, device=device).masked_fill(k_pos > q_pos, float("-inf"))[None, None]
    if attention_mask is not None:
        bias = bias + (1.0 - attention_mask[:, None, None, :].float()) * -1e9
    return bias


def eager_attention(q, k, v, attention_mask):
    # q: (B, H, T, D); k, v: (B, H, L, D)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.float() + attention_bias(attention_mask, q.shape[-2], k.shape[-2], q.device)
    probs = F.softmax(scores, dim=-1).type_as(q)
    return probs @ v


def sdpa_attention(q, k, v, attention_mask):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.config = config
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, past_key_value=None, attention_mask=None):
        b, t, _ = x.shape
        cfg = self.config
        q = self.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=1)  # (B, P+T, Hkv, D)
            v = torch.cat([past_key_value[1], v], dim=1)
        present = (k, v)
        q = q.transpose(1, 2)  # (B, H, T, D)
        k = repeat_kv(k, cfg.n_rep).transpose(1, 2)  # (B, H, P+T, D)
        v = repeat_kv(v, cfg.n_rep).transpose(1, 2)
        fused = cfg.attn_implementation == "sdpa" and past_key_value is None and attention_mask is None and t > 1
        out = (sdpa_attention if fused else eager_attention)(q, k, v, attention_mask)
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.dropout(self.o_proj(out)), present


class FeedForward(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class MiniMindBlock(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x, cos, sin, past_key_value=None, attention_mask=None):
        attn_out, present = self.self_attn(self.input_layernorm(x), cos, sin, past_key_value, attention_mask)
        h = x + attn_out
        return h + self.mlp(self.post_attention_layernorm(h)), present


class MiniMindModel(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([MiniMindBlock(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            # Positions continue after the cache: P .. P+T-1.
            past_len = past_key_values[0][0].shape[1] if past_key_values is not None else 0
            position_ids = (torch.arange(t, device=input_ids.device) + past_len).expand(b, t)
        # Recomputed per call (D/2 values) rather than held as a buffer, so that
        # casting the model to float16 can never round the frequencies.
        cos, sin = rope_cos_sin(rope_inv_freq(self.config).to(input_ids.device), position_ids)
        h = self.dropout(self.embed_tokens(input_ids))
        presents = []
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values is not None else None
            h, present = layer(h, cos, sin, past, attention_mask)
            presents.append(present)
        return self.norm(h), presents


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # (B, T_kept, V)
    past_key_values: list | None  # per layer (k, v), each (B, P+T, Hkv, D)
    loss: torch.Tensor | None
    aux_loss: torch.Tensor


def shifted_cross_entropy(logits, labels):
    """Token t predicts token t+1; labels of -100 are ignored (MiniMind's training loss)."""
    x, y = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
    return F.cross_entropy(x.view(-1, x.size(-1)).float(), y.view(-1), ignore_index=-100)


class MiniMindForCausalLM(nn.Module):
    def __init__(self, config: MiniMindConfig | None = None):
        super().__init__()
        self.config = config or MiniMindConfig()
        self.model = MiniMindModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False,
                logits_to_keep=0, labels=None, position_ids=None) -> CausalLMOutput:
        hidden, presents = self.model(input_ids, attention_mask, past_key_values, position_ids)
        logits = self.lm_head(hidden[:, -logits_to_keep:, :])  # -0 keeps every position
        loss = shifted_cross_entropy(logits, labels) if labels is not None else None
        aux_loss = hidden.new_zeros((), dtype=torch.float32)  # dense: no router
        return CausalLMOutput(logits, presents if use_cache else None, loss, aux_loss)
