"""MiniMind, both generations: the PyTorch reference.

`version=3` is minimind-3: q/k norms, RMSNorm eps 1e-6, 4 kv heads, FFN width
64 * ceil(pi h / 64), and MoE layers with top-1 routing. `version=2` is MiniMind2:
no q/k norms, RMSNorm eps 1e-5 cast back before the weight, 2 kv heads, FFN width
64 * ceil(int(8h/3) / 64), and MoE layers with top-2 routing plus a shared expert
(docs/models.md tabulates both). Fields left None take their generation's
default. Parameter names are MiniMind's state-dict keys, so real checkpoints
load one to one.

Deliberate departures from the upstream code, all but one numerically neutral,
all so the model exports without Python branches on tensor values:
- RoPE cos/sin are computed in float32 from position ids (`pos * inv_freq`, the
  float ops of the upstream table, YaRN included) instead of slicing a
  32768-row table; callers can pass explicit position ids (left padding). A
  sequence past max_position_embeddings raises ContextLengthError, where the
  upstream slice of that table comes up short. Not neutral in float16: upstream's
  `.half()` rounds its table to float16 and rotates in float16, while here cos/sin
  stay float32 and the rotation is rounded to float16 once, a difference of float16
  rounding in q and k (the exported graphs do as the reference).
- The fused attention path is chosen when there is no cache and no mask
  (upstream also takes it for an all-ones mask, which needs a tensor test).
- MoE routing: upstream loops over experts with `if mask.any()` / bincount, so
  the set of experts that run depends on the data. Here every expert's
  contribution is added in expert order through a weight that is zero for
  tokens that did not choose it ("dense"), or the tokens of each expert are
  gathered by index without any Python test ("sparse"). Adding an exact zero
  changes nothing, so both give upstream's sums in upstream's order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from reference.layers import (
    CausalLMOutput,
    attend,
    check_length,
    default_position_ids,
    shifted_cross_entropy,
    widened,
)
from reference.minimind_config import MiniMindConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, cast_before_weight: bool = False):
        super().__init__()
        self.eps = eps
        self.cast_before_weight = cast_before_weight  # MiniMind2's order
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in at least float32; minimind-3 scales in float32 then casts, MiniMind2 casts then scales.
        x32 = widened(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_before_weight:
            return self.weight * normed.type_as(x)
        return (self.weight * normed).type_as(x)


def rope_inv_freq(config: MiniMindConfig) -> torch.Tensor:
    """(D/2,) float32 frequencies, YaRN-scaled when rope_scaling applies."""
    dim, base = config.head_dim, config.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    yarn = config.rope_scaling
    if yarn is not None and config.max_position_embeddings / yarn.original_max_position_embeddings > 1.0:
        orig = yarn.original_max_position_embeddings

        def inv_dim(beta):
            return (dim * math.log(orig / (beta * 2 * math.pi))) / (2 * math.log(base))

        low, high = max(math.floor(inv_dim(yarn.beta_fast)), 0), min(math.ceil(inv_dim(yarn.beta_slow)), dim // 2 - 1)
        ramp = torch.clamp((torch.arange(dim // 2).float() - low) / max(high - low, 0.001), 0, 1)
        freqs = freqs * (1 - ramp + ramp / yarn.factor)
    return freqs


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, scale: float = 1.0, dtype=torch.float32):
    """cos/sin of shape (B, T, head_dim) for integer positions (B, T), times YaRN's attention factor, computed in
    `dtype` (float32, as the graphs compute them; float64 for a model cast to float64)."""
    freqs = position_ids[..., None].to(dtype) * inv_freq.to(dtype)  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.cos(emb) * scale, torch.sin(emb) * scale


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x, cos, sin):
    # x: (B, T, H, D); cos/sin: (B, T, D), shared by every head.
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.config = config
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)
        if config.version == 3:  # Qwen3-style per-head norms; MiniMind2 has none
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, past_key_value=None, attention_mask=None):
        """Self-attention of one layer over its cache.

        Args:
            x: (B, T, hidden) the normalised input of the new tokens.
            cos: the rotary cosines at the new tokens' positions (rope_cos_sin).
            sin: the rotary sines at the same positions.
            past_key_value: (k, v) each (B, P, Hkv, D), or None.
            attention_mask: (B, P+T), 1 keep, 0 pad; None: no padding.

        Returns:
            The output (B, T, hidden) and the present (k, v), each (B, P+T, Hkv, D).
        """
        b, t, _ = x.shape
        cfg = self.config
        q = self.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.version == 3:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out, present = attend(
            q, k, v, past_key_value, attention_mask, cfg.attn_implementation, cfg.dropout if self.training else 0.0
        )
        return self.dropout(self.o_proj(out)), present


class FeedForward(nn.Module):
    def __init__(self, config: MiniMindConfig, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        # Training only: MiniMind2's feed-forward ends in dropout, minimind-3's has none.
        self.dropout = nn.Dropout(config.dropout) if config.version == 2 else nn.Identity()

    def forward(self, x):
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Router(nn.Module):
    """The MoE gate (key `mlp.gate.weight`, (E, hidden)): softmax scores, top-k experts and their weights."""

    is_moe_router = True  # parity records its choices (exporter/verify/checks/routers.py)

    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        # minimind-3 renormalises any top-k; MiniMind2 only when it picks more than one expert.
        self.normalize = config.norm_topk_prob and (config.version == 3 or self.top_k > 1)
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, x):
        # x: (N, C) -> scores (N, E), top-k weights (N, k), top-k expert ids (N, k)
        scores = F.softmax(F.linear(x, self.weight), dim=-1)
        weight, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.normalize:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weight, idx


def dense_dispatch(x, experts, weight, idx):
    """Every expert on every token, weighted by a (N, E) matrix that is zero off each token's top-k.

    Args:
        x: (N, hidden) the tokens.
        experts: the routed experts, E of them.
        weight: (N, k) each token's routing weights.
        idx: (N, k) each token's chosen expert ids.

    Returns:
        (N, hidden) the weighted sum of the chosen experts' outputs.
    """
    dense = torch.zeros(x.shape[0], len(experts), dtype=weight.dtype, device=x.device).scatter(1, idx, weight)
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        # An expert a token did not choose contributes an exact zero, even where its output overflowed
        # (float16): multiplied by the zero weight, inf would become NaN.
        y = y + torch.where(dense[:, e : e + 1] != 0, expert(x) * dense[:, e : e + 1], 0)
    return y


def sparse_dispatch(x, experts, weight, idx):
    """Each expert on its own tokens only, gathered by index (data-dependent sizes, no Python `if`).

    A token picks an expert at most once, so its output is copied to the token's
    row (zeros elsewhere) and added: the sums of upstream's index_add_, without
    the scatter-add that ONNX Runtime's CPU provider lacks for float16.

    Args:
        x: (N, hidden) the tokens.
        experts: the routed experts, E of them.
        weight: (N, k) each token's routing weights.
        idx: (N, k) each token's chosen expert ids, distinct per token.

    Returns:
        (N, hidden) the weighted sum of the chosen experts' outputs.
    """
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        hit = idx == e  # (N, k)
        token_idx = hit.any(dim=-1).nonzero().flatten()  # (n_e,), possibly empty
        token_weight = (weight * hit).sum(dim=-1)[token_idx, None]  # (n_e, 1)
        y = y + torch.zeros_like(x).index_copy(0, token_idx, expert(x[token_idx]) * token_weight)
    return y


MOE_DISPATCH = {"dense": dense_dispatch, "sparse": sparse_dispatch}


class MoEFeedForward(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.config = config
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            [FeedForward(config, config.moe_intermediate_size) for _ in range(config.num_experts)]
        )
        if config.n_shared_experts:
            self.shared_experts = nn.ModuleList([FeedForward(config) for _ in range(config.n_shared_experts)])

    def forward(self, x):
        b, t, c = x.shape
        flat = x.reshape(-1, c)
        scores, weight, idx = self.gate(flat)
        y = MOE_DISPATCH[self.config.moe_implementation](flat, self.experts, weight, idx).view(b, t, c)
        for expert in getattr(self, "shared_experts", []):
            y = y + expert(x)
        aux = self.aux_loss(scores, idx, b) if self.training else x.new_zeros((), dtype=torch.float32)
        return y, aux

    def aux_loss(self, scores, idx, batch: int):
        """Load-balancing loss as upstream computes it while training (0 in eval mode)."""
        cfg = self.config
        e, coef = cfg.num_experts, cfg.router_aux_loss_coef
        if not cfg.seq_aux:
            # minimind-3 averages each top-k slot's choices apart, (k, E), and sums the slots; MiniMind2
            # averages all N*k choices together, (E,): k times less for the same routing.
            hits = F.one_hot(idx, e).float()
            load = hits.mean(0) if cfg.version == 3 else hits.reshape(-1, e).mean(0)
            return (load * scores.float().mean(0)).sum() * e * coef
        per_seq = idx.view(batch, -1)  # (B, T*k)
        load = (
            torch.zeros(batch, e, device=scores.device)
            .scatter_add_(1, per_seq, torch.ones(per_seq.shape, device=scores.device))
            .div_(per_seq.shape[1] / e)
        )
        return (load * scores.float().view(batch, -1, e).mean(1)).sum(1).mean() * coef


class MiniMindBlock(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        cast_first = config.version == 2
        self.config = config
        self.self_attn = Attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, cast_first)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, cast_first)
        self.mlp = MoEFeedForward(config) if config.use_moe else FeedForward(config)

    def forward(self, x, cos, sin, past_key_value=None, attention_mask=None):
        """One pre-norm decoder layer: attention, then the feed-forward (dense or MoE), each with a residual.

        Args:
            x: (B, T, hidden) the new tokens' hidden states.
            cos: the rotary cosines at the new tokens' positions.
            sin: the rotary sines at the same positions.
            past_key_value: (k, v) each (B, P, Hkv, D), or None.
            attention_mask: (B, P+T), 1 keep, 0 pad; None: no padding.

        Returns:
            The hidden states (B, T, hidden), the present (k, v), and the MoE aux loss (None for a dense layer).
        """
        attn_out, present = self.self_attn(self.input_layernorm(x), cos, sin, past_key_value, attention_mask)
        h = x + attn_out
        x = self.post_attention_layernorm(h)
        mlp_out, aux = self.mlp(x) if self.config.use_moe else (self.mlp(x), None)  # MoE adds its aux loss
        return h + mlp_out, present, aux


class MiniMindModel(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([MiniMindBlock(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.version == 2)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, position_ids=None):
        """The decoder stack without the head.

        Args:
            input_ids: (B, T) new token ids.
            attention_mask: (B, P+T), 1 keep, 0 pad; None: no padding.
            past_key_values: per layer (k, v), each (B, P, Hkv, D); None: no cache.
            position_ids: (B, T) the new tokens' positions; None: P .. P+T-1 for every row.

        Returns:
            The final-norm hidden states (B, T, hidden), the presents per layer, and the summed MoE aux loss.

        Raises:
            ContextLengthError: P + T exceeds max_position_embeddings.
        """
        # The rotary tables would hold at any position, but upstream's end at max_position_embeddings.
        check_length(input_ids, past_key_values, self.config.max_position_embeddings, "max_position_embeddings")
        if position_ids is None:
            position_ids = default_position_ids(input_ids, past_key_values)
        # Recomputed per call (D/2 values) rather than held as a buffer, so that
        # casting the model to float16 can never round the frequencies.
        scale = self.config.rope_scaling.attention_factor if self.config.rope_scaling is not None else 1.0
        cos, sin = rope_cos_sin(
            rope_inv_freq(self.config).to(input_ids.device),
            position_ids,
            scale,
            widened(self.embed_tokens.weight).dtype,
        )
        h = self.dropout(self.embed_tokens(input_ids))
        presents, aux_loss = [], h.new_zeros((), dtype=torch.float32)
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values is not None else None
            h, present, aux = layer(h, cos, sin, past, attention_mask)
            presents.append(present)
            aux_loss = aux_loss + aux if aux is not None else aux_loss
        return self.norm(h), presents, aux_loss


class MiniMindForCausalLM(nn.Module):
    # MiniMindModel.forward calls every layer alike (exporter/export/layer_template.py may trace three and grow them)
    uniform_layers = True

    def __init__(self, config: MiniMindConfig | None = None):
        super().__init__()
        self.config = config or MiniMindConfig()
        self.model = MiniMindModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight

    def exported_constants(self) -> dict[str, torch.Tensor]:
        """The tensors the forward computes from the config alone, which an export folds into initializers: the
        rotary inverse frequencies (float32 in any dtype). The weight audit holds such initializers to these."""
        return {"rotary inverse frequencies": rope_inv_freq(self.config)}

    def forward(
        self,
        input_ids,
        attention_mask=None,
        past_key_values=None,
        use_cache=False,
        logits_to_keep=0,
        labels=None,
        position_ids=None,
    ) -> CausalLMOutput:
        """The shared forward contract (reference/byo.py).

        Args:
            input_ids: (B, T) new token ids.
            attention_mask: (B, P+T), 1 for a token, 0 for left padding; None: no padding.
            past_key_values: per layer (k, v), each (B, P, Hkv, D); None: no cache.
            use_cache: return the presents as past_key_values.
            logits_to_keep: the last positions to compute logits for; 0: every position.
            labels: (B, T) targets of the shifted cross entropy (-100 ignored); None: no loss.
            position_ids: (B, T) positions of the new tokens; None: P .. P+T-1 for every row.

        Raises:
            ContextLengthError: P + T exceeds max_position_embeddings.
        """
        hidden, presents, aux_loss = self.model(input_ids, attention_mask, past_key_values, position_ids)
        logits = self.lm_head(hidden[:, -logits_to_keep:, :])  # -0 keeps every position
        loss = shifted_cross_entropy(logits, labels) if labels is not None else None
        return CausalLMOutput(logits, presents if use_cache else None, loss, aux_loss)
