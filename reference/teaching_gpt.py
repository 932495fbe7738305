"""The teaching GPT of the train-llm-from-scratch series (seed 003): the PyTorch reference.

Behaviour follows the original (docs/models.md, "Teaching GPT"): learned absolute position
embeddings added to token embeddings, pre-norm blocks with LayerNorm (with
bias), per-head key/query/value Linear layers without bias concatenated then
projected with bias, a ReLU MLP C -> 4C -> C with biases, a final LayerNorm
and an untied lm_head with bias. Parameter names are the original's, so its
`model_state_dict` loads one to one (its `pos_idxs` and per-head `tril`
buffers carry no information and are checked and dropped by the loader).

Added to the original, which has none of these:
- a KV cache (per layer (k, v), each (B, P+T, n_head, head_size)): a cached
  decode adds the position embedding of P+j, so it equals the full forward;
- position ids, so a left-padded row equals the same sequence alone, and an
  attention mask for the padding;
- MiniMind's loss convention (labels aligned with input_ids, shifted inside,
  -100 ignored); the original takes targets already shifted.
A sequence longer than context_length raises ContextLengthError instead of
indexing past the position table. Scores are divided by sqrt(head_size) and
softmaxed in float32 (the original multiplies by 1/sqrt(head_size) in the
model dtype: equal to rounding in float32).
"""

from __future__ import annotations

import torch
from torch import nn

from reference.layers import (
    CausalLMOutput,
    attend,
    check_length,
    default_position_ids,
    negative_past_the_table,
    shifted_cross_entropy,
)
from reference.teaching_gpt_config import TeachingGPTConfig


class Head(nn.Module):
    """One head's projections (the original's `attn.heads.{h}.key/query/value`)."""

    def __init__(self, head_size: int, n_embed: int):
        super().__init__()
        self.key = nn.Linear(n_embed, head_size, bias=False)
        self.query = nn.Linear(n_embed, head_size, bias=False)
        self.value = nn.Linear(n_embed, head_size, bias=False)


class MultiHeadAttention(nn.Module):
    def __init__(self, config: TeachingGPTConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList([Head(config.head_dim, config.n_embed) for _ in range(config.n_head)])
        self.proj = nn.Linear(config.n_embed, config.n_embed)

    def forward(self, x, past_key_value=None, attention_mask=None):
        b, t, _ = x.shape
        shape = (b, t, self.config.n_head, self.config.head_dim)
        q = torch.stack([head.query(x) for head in self.heads], dim=2).view(shape)  # (B, T, H, D)
        k = torch.stack([head.key(x) for head in self.heads], dim=2).view(shape)
        v = torch.stack([head.value(x) for head in self.heads], dim=2).view(shape)
        out, present = attend(q, k, v, past_key_value, attention_mask)  # heads concatenated in order
        return self.proj(out), present


class MLP(nn.Module):
    def __init__(self, config: TeachingGPTConfig):
        super().__init__()
        self.hidden = nn.Linear(config.n_embed, 4 * config.n_embed)
        self.relu = nn.ReLU()
        self.proj = nn.Linear(4 * config.n_embed, config.n_embed)

    def forward(self, x):
        return self.proj(self.relu(self.hidden(x)))


class Block(nn.Module):
    def __init__(self, config: TeachingGPTConfig):
        super().__init__()
        self.attn = MultiHeadAttention(config)
        self.mlp = MLP(config)
        self.ln1 = nn.LayerNorm(config.n_embed)
        self.ln2 = nn.LayerNorm(config.n_embed)

    def forward(self, x, past_key_value=None, attention_mask=None):
        attn_out, present = self.attn(self.ln1(x), past_key_value, attention_mask)
        x = x + attn_out
        return x + self.mlp(self.ln2(x)), present


class TeachingGPT(nn.Module):
    def __init__(self, config: TeachingGPTConfig | None = None):
        super().__init__()
        self.config = config or TeachingGPTConfig()
        cfg = self.config
        self.token_embed = nn.Embedding(cfg.vocab_size, cfg.n_embed)
        self.position_embed = nn.Embedding(cfg.context_length, cfg.n_embed)
        self.attn_blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_blocks)])
        self.layer_norm = nn.LayerNorm(cfg.n_embed)
        self.lm_head = nn.Linear(cfg.n_embed, cfg.vocab_size)

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
            past_key_values: per block (k, v), each (B, P, n_head, head_size); None: no cache.
            use_cache: return the presents as past_key_values.
            logits_to_keep: the last positions to compute logits for; 0: every position.
            labels: (B, T) targets of the shifted cross entropy (-100 ignored); None: no loss.
            position_ids: (B, T) positions of the new tokens; None: P .. P+T-1 for every row.

        Raises:
            ContextLengthError: P + T exceeds context_length.
        """
        # Past the position table; in an export ONNX Gather refuses such an index instead.
        check_length(input_ids, past_key_values, self.config.context_length, "context_length")
        if position_ids is None:
            position_ids = default_position_ids(input_ids, past_key_values)
        position_ids = negative_past_the_table(position_ids, self.config.context_length)
        x = self.token_embed(input_ids) + self.position_embed(position_ids)  # (B, T, C)
        presents = []
        for i, block in enumerate(self.attn_blocks):
            x, present = block(x, past_key_values[i] if past_key_values is not None else None, attention_mask)
            presents.append(present)
        logits = self.lm_head(self.layer_norm(x)[:, -logits_to_keep:, :])
        loss = shifted_cross_entropy(logits, labels) if labels is not None else None
        return CausalLMOutput(logits, presents if use_cache else None, loss, logits.new_zeros((), dtype=torch.float32))
