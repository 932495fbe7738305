"""The upstream code paths, transcribed op for op, as oracles the reference must equal.

These are the formulations that cannot be exported (data-dependent `if`,
bincount through numpy) or that the reference rewrote (per-head attention with
a tril buffer). Tests compare them with the reference in eager mode only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def minimind3_moe(moe, x):
    """minimind-3 MOEFeedForward.forward in eval mode: loop over experts, `if mask.any()`, index_add_."""
    cfg = moe.config
    b, t, c = x.shape
    x_flat = x.view(-1, c)
    scores = F.softmax(F.linear(x_flat, moe.gate.weight), dim=-1)
    topk_weight, topk_idx = torch.topk(scores, k=cfg.num_experts_per_tok, dim=-1, sorted=False)
    if cfg.norm_topk_prob:
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
    y = torch.zeros_like(x_flat)
    for i, expert in enumerate(moe.experts):
        mask = topk_idx == i
        if mask.any():
            token_idx = mask.any(dim=-1).nonzero().flatten()
            weight = topk_weight[mask].view(-1, 1)
            y.index_add_(0, token_idx, (expert(x_flat[token_idx]) * weight).to(y.dtype))
    return y.view(b, t, c), topk_idx


@torch.no_grad()
def minimind2_moe(moe, x):
    """MiniMind2 MOEFeedForward.forward in eval mode: MoEGate, then moe_infer (argsort, numpy bincount)."""
    cfg = moe.config
    identity, orig_shape = x, x.shape
    b, t, h = x.shape
    flat_x = x.view(-1, h)
    scores = F.linear(flat_x, moe.gate.weight, None).softmax(dim=-1)
    topk_weight, topk_idx = torch.topk(scores, k=cfg.num_experts_per_tok, dim=-1, sorted=False)
    if cfg.num_experts_per_tok > 1 and cfg.norm_topk_prob:
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
    flat_expert_indices, flat_expert_weights = topk_idx.view(-1), topk_weight.view(-1, 1)
    expert_cache = torch.zeros_like(flat_x)
    idxs = flat_expert_indices.argsort()
    tokens_per_expert = flat_expert_indices.bincount().cpu().numpy().cumsum(0)
    token_idxs = idxs // cfg.num_experts_per_tok
    for i, end_idx in enumerate(tokens_per_expert):
        start_idx = 0 if i == 0 else tokens_per_expert[i - 1]
        if start_idx == end_idx:
            continue
        expert = moe.experts[i]
        exp_token_idx = token_idxs[start_idx:end_idx]
        expert_out = expert(flat_x[exp_token_idx]).to(expert_cache.dtype)
        expert_out.mul_(flat_expert_weights[idxs[start_idx:end_idx]])
        expert_cache.scatter_add_(0, exp_token_idx.view(-1, 1).repeat(1, flat_x.shape[-1]), expert_out)
    y = expert_cache.view(*orig_shape)
    for expert in moe.shared_experts:
        y = y + expert(identity)
    return y, topk_idx


def minimind3_aux_loss(scores, topk_idx, cfg):
    load = F.one_hot(topk_idx, cfg.num_experts).float().mean(0)
    return (load * scores.mean(0)).sum() * cfg.num_experts * cfg.router_aux_loss_coef


def minimind2_aux_loss(scores, topk_idx, cfg):
    """MiniMind2 MoEGate's aux loss with seq_aux=False."""
    mask_ce = F.one_hot(topk_idx.view(-1), num_classes=cfg.num_experts)
    ce = mask_ce.float().mean(0)
    pi = scores.mean(0)
    fi = ce * cfg.num_experts
    return (pi * fi).sum() * cfg.router_aux_loss_coef


def minimind2_seq_aux_loss(scores, topk_idx, cfg, bsz, seq_len):
    aux_topk = cfg.num_experts_per_tok
    topk_idx_for_aux_loss = topk_idx.view(bsz, -1)
    scores_for_seq_aux = scores.view(bsz, seq_len, -1)
    ce = torch.zeros(bsz, cfg.num_experts)
    ce.scatter_add_(1, topk_idx_for_aux_loss, torch.ones(bsz, seq_len * aux_topk)).div_(
        seq_len * aux_topk / cfg.num_experts
    )
    return (ce * scores_for_seq_aux.mean(dim=1)).sum(dim=1).mean() * cfg.router_aux_loss_coef


def yarn_tables(dim, end, base, orig_max, factor, beta_fast, beta_slow, attn_factor):
    """minimind-3 precompute_freqs_cis with rope_scaling: (end, dim) cos and sin tables."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    if end / orig_max > 1.0:

        def inv_dim(b):
            return (dim * math.log(orig_max / (b * 2 * math.pi))) / (2 * math.log(base))

        low, high = max(math.floor(inv_dim(beta_fast)), 0), min(math.ceil(inv_dim(beta_slow)), dim // 2 - 1)
        ramp = torch.clamp((torch.arange(dim // 2).float() - low) / max(high - low, 0.001), 0, 1)
        freqs = freqs * (1 - ramp + ramp / factor)
    t = torch.arange(end)
    freqs = torch.outer(t, freqs).float()
    return (
        torch.cat([torch.cos(freqs), torch.cos(freqs)], dim=-1) * attn_factor,
        torch.cat([torch.sin(freqs), torch.sin(freqs)], dim=-1) * attn_factor,
    )


@torch.no_grad()
def teaching_gpt_forward(model, idx):
    """The train-llm-from-scratch Transformer.forward (no cache): per-head attention with a tril mask. The
    activation and the norms are written out, not the model's modules called, so that swapping one is seen."""
    cfg = model.config
    t = idx.shape[1]
    tril = torch.tril(torch.ones(cfg.context_length, cfg.context_length))
    pos_idxs = torch.arange(cfg.context_length)
    x = model.token_embed(idx) + model.position_embed(pos_idxs[:t])

    def layer_norm(x, norm):  # the original's nn.LayerNorm(n_embed): eps 1e-5, weight and bias
        return F.layer_norm(x, (cfg.n_embed,), norm.weight, norm.bias, 1e-5)

    for block in model.attn_blocks:
        h = layer_norm(x, block.ln1)
        outs = []
        for head in block.attn.heads:
            k, q = head.key(h), head.query(h)
            weights = q @ k.transpose(-2, -1) * (1 / math.sqrt(head.key.out_features))
            weights = F.softmax(weights.masked_fill(tril[:t, :t] == 0, float("-inf")), dim=-1)
            outs.append(weights @ head.value(h))
        x = x + block.attn.proj(torch.cat(outs, dim=-1))
        x = x + block.mlp.proj(torch.relu(block.mlp.hidden(layer_norm(x, block.ln2))))
    return model.lm_head(layer_norm(x, model.layer_norm))


@torch.no_grad()
def minimind_forward(model, input_ids, attention_mask=None):
    """Dense MiniMind logits written from upstream's description of both generations, apart from the reference:
    its own RoPE tables and rotate_half, a loop over heads that picks each head's kv head by index, the
    causal mask as a boolean matrix. An oracle for the attention layout the reference's own tests share."""
    cfg, state = model.config, model.state_dict()
    b, t = input_ids.shape
    d, heads, n_rep = cfg.head_dim, cfg.num_attention_heads, cfg.num_attention_heads // cfg.num_key_value_heads

    def rms_norm(x, weight):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        return (weight * normed).to(x.dtype) if cfg.version == 3 else weight * normed.to(x.dtype)

    def rotate_half(x):
        return torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)

    freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)
    angles = torch.outer(torch.arange(t).float(), freqs)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None, :, None, :]  # (1, T, 1, D)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None, :, None, :]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = state["model.embed_tokens.weight"][input_ids]
    for layer in range(cfg.num_hidden_layers):
        w = {
            k.removeprefix(f"model.layers.{layer}."): v
            for k, v in state.items()
            if k.startswith(f"model.layers.{layer}.")
        }
        a = rms_norm(x, w["input_layernorm.weight"])
        q = (a @ w["self_attn.q_proj.weight"].T).view(b, t, heads, d)
        k = (a @ w["self_attn.k_proj.weight"].T).view(b, t, -1, d)
        v = (a @ w["self_attn.v_proj.weight"].T).view(b, t, -1, d)
        if cfg.version == 3:
            q, k = rms_norm(q, w["self_attn.q_norm.weight"]), rms_norm(k, w["self_attn.k_norm.weight"])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = torch.empty(b, t, heads, d)
        for head in range(heads):
            kv = head // n_rep  # each kv head serves n_rep consecutive q heads
            scores = (q[:, :, head] @ k[:, :, kv].transpose(1, 2)) / math.sqrt(d)  # (B, T, T)
            scores = scores.masked_fill(~causal, float("-inf"))
            if attention_mask is not None:
                scores = scores + (1.0 - attention_mask[:, None, :].float()) * -1e9
            out[:, :, head] = F.softmax(scores.float(), dim=-1) @ v[:, :, kv]
        x = x + out.reshape(b, t, heads * d) @ w["self_attn.o_proj.weight"].T
        m = rms_norm(x, w["post_attention_layernorm.weight"])
        x = (
            x
            + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        )
    return rms_norm(x, state["model.norm.weight"]) @ state["lm_head.weight"].T
