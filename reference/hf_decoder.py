"""The Hugging Face decoders (the model types of reference/hf_types.py): one PyTorch reference for all of them.

They share one layout: pre-norm blocks of grouped-query attention with RoPE and a SwiGLU feed-forward, RMSNorm,
an optional tied head. What tells them apart is data in HFDecoderConfig (biases, per-head q/k norms, head_dim,
fused q/k/v and gate/up projections, rope scaling, the share of each head rope turns), set from config.json by
reference.hf_decoder_config.translate_hf_config. Parameter names are Transformers' state-dict keys, so a
`save_pretrained` folder loads one to one.

Computed as Transformers' eager path computes it: RMSNorm in float32 cast back before the weight, rope
frequencies by Transformers' formulas in float32, cos/sin from the position ids (no table of
max_position_embeddings rows), attention scores and softmax in float32. The attention is reference.layers'
(`attend`), whose grouped matmul and division by sqrt(head_dim) differ from Transformers' repeat_kv and
multiplication by head_dim ** -0.5 by float32 rounding only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from reference.hf_decoder_config import HFDecoderConfig
from reference.layers import (
    CausalLMOutput,
    attend,
    check_length,
    default_position_ids,
    shifted_cross_entropy,
    widened,
)
from reference.minimind import RMSNorm, apply_rotary, rope_cos_sin


def _yarn_inv_freq(config: HFDecoderConfig) -> torch.Tensor:
    """Transformers' _compute_yarn_parameters: frequencies blended between interpolated (divided by factor) and
    original over the dimensions whose wavelengths fall between beta_fast and beta_slow rotations."""
    dim, base, yarn = config.rope_dim, config.rope_theta, config.rope_scaling
    orig = yarn.original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as Transformers: no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)
    extrapolation_weight = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def _llama3_inv_freq(inv_freq: torch.Tensor, config: HFDecoderConfig) -> torch.Tensor:
    """Transformers' _compute_llama3_parameters: long wavelengths divided by factor, short ones kept, a smooth
    blend between."""
    scaling = config.rope_scaling
    old_context = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old_context / scaling.low_freq_factor, old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(config: HFDecoderConfig) -> torch.Tensor:
    """(rope_dim/2,) float32 frequencies of the config's rope type, as Transformers' rope functions give them."""
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "yarn":
        return _yarn_inv_freq(config)
    dim = config.rope_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, config)


def rotate_leading(x, cos, sin):
    """Rope over the leading rope_dim dims of each head (cos/sin (B, T, rope_dim)), the rest passed on unturned, as
    Transformers' partial rotation (phi3's partial_rotary_factor)."""
    turned = cos.shape[-1]
    return torch.cat([apply_rotary(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: HFDecoderConfig):
        super().__init__()
        self.config = config
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        if config.fused_qkv:  # phi3: one projection, q's rows, then k's, then v's
            self.qkv_proj = nn.Linear(config.hidden_size, (h + 2 * kv) * d, bias=config.qkv_bias)
        else:
            self.q_proj = nn.Linear(config.hidden_size, h * d, bias=config.qkv_bias)
            self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=config.qkv_bias)
            self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:  # qwen3: over each head's head_dim, before the rotation
            self.q_norm = RMSNorm(d, config.rms_norm_eps, cast_before_weight=True)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, cast_before_weight=True)

    def forward(self, x, cos, sin, past_key_value=None, attention_mask=None):
        """Self-attention of one layer over its cache.

        Args:
            x: (B, T, hidden) the normalised input of the new tokens.
            cos: (B, T, rope_dim) the rotary cosines at the new tokens' positions.
            sin: (B, T, rope_dim) the rotary sines.
            past_key_value: (k, v) each (B, P, Hkv, D), or None.
            attention_mask: (B, P+T), 1 keep, 0 pad; None: no padding.

        Returns:
            The output (B, T, hidden) and the present (k, v), each (B, P+T, Hkv, D).
        """
        b, t, _ = x.shape
        cfg = self.config
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if cfg.fused_qkv:
            q, k, v = self.qkv_proj(x).split([h * d, kv * d, kv * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(b, t, h, d), k.view(b, t, kv, d), v.view(b, t, kv, d)  # (B, T, H, D), (B, T, Hkv, D) x2
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rotate = apply_rotary if cfg.rope_dim == d else rotate_leading
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # eager: scores and softmax in float32, as Transformers' eager attention
        out, present = attend(q, k, v, past_key_value, attention_mask, "eager")
        return self.o_proj(out), present


class FeedForward(nn.Module):
    def __init__(self, config: HFDecoderConfig):
        super().__init__()
        self.fused = config.fused_gate_up
        if self.fused:  # phi3: one projection, gate's rows, then up's
            self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        else:
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
            self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1) if self.fused else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: HFDecoderConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = FeedForward(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, cast_before_weight=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, cast_before_weight=True)

    def forward(self, x, cos, sin, past_key_value=None, attention_mask=None):
        """Pre-norm attention then feed-forward, each with a residual; returns (B, T, hidden) and the present."""
        attn_out, present = self.self_attn(self.input_layernorm(x), cos, sin, past_key_value, attention_mask)
        h = x + attn_out
        return h + self.mlp(self.post_attention_layernorm(h)), present


class HFDecoderModel(nn.Module):
    def __init__(self, config: HFDecoderConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, cast_before_weight=True)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, position_ids=None):
        """The decoder stack without the head: final-norm hidden states (B, T, hidden) and the presents.

        Raises:
            ContextLengthError: P + T exceeds max_position_embeddings.
        """
        check_length(input_ids, past_key_values, self.config.max_position_embeddings, "max_position_embeddings")
        if position_ids is None:
            position_ids = default_position_ids(input_ids, past_key_values)
        scaling = self.config.rope_scaling
        scale = scaling.attention_factor if scaling is not None else 1.0
        # Recomputed per call (head_dim/2 values), never a buffer a float16 cast could round.
        cos, sin = rope_cos_sin(
            rope_inv_freq(self.config).to(input_ids.device),
            position_ids,
            scale,
            widened(self.embed_tokens.weight).dtype,
        )
        h = self.embed_tokens(input_ids)
        presents = []
        for i, layer in enumerate(self.layers):
            h, present = layer(h, cos, sin, past_key_values[i] if past_key_values is not None else None, attention_mask)
            presents.append(present)
        return self.norm(h), presents


class HFDecoderForCausalLM(nn.Module):
    # HFDecoderModel.forward calls every layer alike (exporter/export/layer_template.py may trace three and grow them)
    uniform_layers = True

    def __init__(self, config: HFDecoderConfig | None = None):
        super().__init__()
        self.config = config or HFDecoderConfig()
        self.model = HFDecoderModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def exported_constants(self) -> dict[str, torch.Tensor]:
        """The tensors the forward computes from the config alone, which an export folds into initializers: the
        rotary inverse frequencies, scaled as the rope type scales them (float32 in any dtype). The weight audit
        holds such initializers to these."""
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
        """The shared forward contract (reference/byo.py), arguments as MiniMindForCausalLM.forward documents them;
        the aux loss is zero (no experts)."""
        hidden, presents = self.model(input_ids, attention_mask, past_key_values, position_ids)
        logits = self.lm_head(hidden[:, -logits_to_keep:, :])  # -0 keeps every position
        loss = shifted_cross_entropy(logits, labels) if labels is not None else None
        aux_loss = logits.new_zeros((), dtype=torch.float32)  # no experts
        return CausalLMOutput(logits, presents if use_cache else None, loss, aux_loss)
