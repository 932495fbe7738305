"""The PyTorch reference: sizes, seeding, cache, attention paths, padding and loss."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import pytest
import torch
import upstream
from helpers import (
    assert_cached_decoding_equals_full_forward,
    assert_close,
    padded_batch_logits,
    random_ids,
)

from reference import ConfigError, MiniMindConfig, MiniMindForCausalLM, build_model, get_preset
from reference.init import DEFAULT_STD, NORM_HALF_WIDTH, seeded_init_
from reference.minimind import Attention, RMSNorm, apply_rotary, rope_cos_sin, rope_inv_freq


def test_minimind3_has_exactly_the_published_parameter_count():
    with torch.device("meta"):
        model = MiniMindForCausalLM(get_preset("minimind-3"))
    # Tied lm_head/embedding counted once: the published 63.91M.
    assert sum(p.numel() for p in model.parameters()) == 63_912_192
    assert get_preset("minimind-3").intermediate_size == 2432
    assert get_preset("minimind-3").head_dim == 96


@pytest.mark.parametrize("preset", ["minimind-3-tiny", "minimind2-tiny"])
@torch.no_grad()
def test_dense_minimind_equals_a_forward_written_from_the_spec(preset):
    # Left padding on the first row: the mask's -1e9 and the causal mask together.
    config = get_preset(preset)
    model = build_model(config, seed=0)  # distinct norms: a norm applied in another's place would show
    ids = random_ids(config.vocab_size, 2, 12)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ours = model(ids, attention_mask=mask).logits
    spec = upstream.minimind_forward(model, ids, mask)
    real = mask.bool()
    # float32 through two layers, summed in other orders: a few units of the last place of logits ~1
    assert (ours - spec)[real].abs().max() <= 1e-5


def test_state_dict_keys_are_minimind_names(tiny_model):
    keys = set(tiny_model.state_dict())
    expected_layer = {
        f"model.layers.0.{name}.weight"
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "input_layernorm",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert expected_layer <= keys
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= keys
    assert not any("freq" in k for k in keys), "RoPE tables must not be in the state dict"
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight


def test_seeded_weights_are_reproducible_and_pinned(tiny_config):
    a, b = build_model(tiny_config, seed=0), build_model(tiny_config, seed=0)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    other = build_model(tiny_config, seed=1)
    assert not torch.equal(a.lm_head.weight, other.lm_head.weight)


def test_seeded_weights_derive_from_the_integer_stream_only(tiny_model):
    # Machine independence rests on PCG64's fixed integer stream: rebuild a few
    # weights from raw 64-bit draws with integer arithmetic (53 high bits ->
    # [0, 1) -> [-a, a)), independent of numpy's float samplers.
    name = "model.layers.1.mlp.down_proj.weight"
    digest = hashlib.sha256(f"0:{name}".encode()).digest()
    raw = np.random.PCG64(int.from_bytes(digest[:16], "little")).random_raw(5)
    half_width = DEFAULT_STD * math.sqrt(3.0)
    expected = [np.float32(-half_width + 2 * half_width * (int(r) >> 11) * 2.0**-53) for r in raw]
    actual = dict(tiny_model.named_parameters())[name].detach().flatten()[:5].numpy()
    assert actual.tolist() == expected
    # a norm weight: [0, 1) -> [1 - w, 1 + w)
    name = "model.layers.0.self_attn.k_norm.weight"
    digest = hashlib.sha256(f"0:{name}".encode()).digest()
    raw = np.random.PCG64(int.from_bytes(digest[:16], "little")).random_raw(5)
    expected = [np.float32(1 - NORM_HALF_WIDTH + 2 * NORM_HALF_WIDTH * (int(r) >> 11) * 2.0**-53) for r in raw]
    actual = dict(tiny_model.named_parameters())[name].detach().flatten()[:5].numpy()
    assert actual.tolist() == expected


@pytest.mark.parametrize("preset", ["minimind-3-tiny", "minimind2-moe-tiny", "teaching-gpt-tiny"])
def test_seeded_norm_weights_are_distinct_and_around_one(preset):
    """No two norms alike and none at one: a norm applied in another's place, or dropped, changes the outputs."""
    model = build_model(get_preset(preset), seed=0)
    norms = {
        name: module.weight.detach()
        for name, module in model.named_modules()
        if isinstance(module, (RMSNorm, torch.nn.LayerNorm))
    }
    assert len(norms) >= 5, sorted(norms)
    for name, weight in norms.items():
        assert ((weight - 1).abs() <= NORM_HALF_WIDTH).all() and len(weight.unique()) > len(weight) // 2, name
    assert len({tuple(w[:4].tolist()) for w in norms.values()}) == len(norms)


def test_cached_decoding_equals_full_forward_token_by_token_and_in_chunks(tiny_model, tiny_config):
    kv_shape = (2, 13, tiny_config.num_key_value_heads, tiny_config.head_dim)
    assert_cached_decoding_equals_full_forward(tiny_model, random_ids(tiny_config.vocab_size, 2, 13), kv_shape)


@torch.no_grad()
def test_explicit_attention_equals_fused(tiny_model, tiny_config):
    eager = MiniMindForCausalLM(dataclasses.replace(tiny_config, attn_implementation="eager")).eval()
    eager.load_state_dict(tiny_model.state_dict())
    ids = random_ids(tiny_config.vocab_size, 3, 17)
    assert_close(eager(ids).logits, tiny_model(ids).logits, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_training_drops_attention_probabilities_then_the_projection_as_upstream(tiny_config, implementation):
    # Upstream draws attn_dropout over the (B, H, T, L) probabilities, then resid_dropout over
    # o_proj's output; with one seed the by-hand computation must draw the same two masks.
    cfg = dataclasses.replace(tiny_config, dropout=0.5, attn_implementation=implementation)
    attention = seeded_init_(Attention(cfg)).train()  # q_norm and k_norm told apart
    b, t, heads, kv_heads, d = 2, 5, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = torch.randn(b, t, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), torch.arange(t)[None].expand(b, t))
    torch.manual_seed(7)
    out, _ = attention(x, cos, sin)

    q = apply_rotary(attention.q_norm(attention.q_proj(x).view(b, t, heads, d)), cos, sin).transpose(1, 2)
    k = apply_rotary(attention.k_norm(attention.k_proj(x).view(b, t, kv_heads, d)), cos, sin).transpose(1, 2)
    v = attention.v_proj(x).view(b, t, kv_heads, d).transpose(1, 2)
    k, v = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))
    causal = torch.full((t, t), float("-inf")).triu(1)
    torch.manual_seed(7)
    probs = torch.nn.functional.dropout(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d) + causal, -1), 0.5)
    expected = torch.nn.functional.dropout(attention.o_proj((probs @ v).transpose(1, 2).reshape(b, t, -1)), 0.5)
    assert_close(out, expected, atol=1e-5)


def test_left_padding_leaves_rows_unchanged(tiny_model, tiny_config):
    pad = 4
    skipping, default, short, full = padded_batch_logits(tiny_model, tiny_config.vocab_size, pad)
    assert_close(skipping[1], full, atol=1e-5)
    assert_close(skipping[0, pad:], short, atol=1e-5)
    # MiniMind's own default positions (not skipping padding) give the same
    # result too: RoPE scores depend only on relative positions (the rotation angles
    # differ, so the rounding does: 1.9e-6 measured at logits peaking at 3).
    assert_close(default[0, pad:], short, atol=1e-5)


@torch.no_grad()
def test_loss_equals_hand_computed_shifted_cross_entropy(tiny_model, tiny_config):
    ids = random_ids(tiny_config.vocab_size, 2, 9)
    labels = ids.clone()
    labels[0, 3] = labels[1, 0] = labels[1, 7] = -100
    out = tiny_model(ids, labels=labels)
    log_probs = torch.log_softmax(out.logits.double(), -1)
    terms = [-log_probs[b, t, labels[b, t + 1]] for b in range(2) for t in range(8) if labels[b, t + 1] != -100]
    assert len(terms) == 14
    assert_close(out.loss, torch.stack(terms).mean(), atol=1e-5)
    assert out.aux_loss.item() == 0.0


@torch.no_grad()
def test_loss_of_one_token_is_nan_like_pytorch(tiny_model, tiny_config):
    out = tiny_model(random_ids(tiny_config.vocab_size, 1, 1), labels=random_ids(tiny_config.vocab_size, 1, 1))
    assert torch.isnan(out.loss)


@torch.no_grad()
def test_logits_to_keep_keeps_the_last_positions(tiny_model, tiny_config):
    ids = random_ids(tiny_config.vocab_size, 1, 7)
    kept, full = tiny_model(ids, logits_to_keep=2).logits, tiny_model(ids).logits[:, -2:]
    # The kept rows reach lm_head as a GEMM of another shape, whose blocking (it depends on the thread
    # count) may sum the 64 products in another order: bit-equal at 2 threads here, up to 8.5 float32
    # units of the peak logit at 1 thread (20 prompts). Bound: one unit per product summed.
    assert_close(kept, full, atol=tiny_config.hidden_size * 2**-24 * full.abs().max().item())


def test_config_round_trips_and_rejects_bad_fields(tiny_config):
    assert MiniMindConfig.from_dict(tiny_config.to_dict()) == tiny_config
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        MiniMindConfig(num_attention_heads=8, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="hidden_size"):
        MiniMindConfig(hidden_size=-4)
    with pytest.raises(ConfigError, match="unknown config fields"):
        MiniMindConfig.from_dict({"hiden_size": 10})
    with pytest.raises(ConfigError, match="unknown preset 'minimind-9'"):
        get_preset("minimind-9")


def test_float16_model_keeps_rope_and_norms_in_float32(tiny_model, tiny_config, monkeypatch):
    import reference.minimind as minimind

    tables = []
    rope = minimind.rope_cos_sin
    monkeypatch.setattr(
        minimind, "rope_cos_sin", lambda inv_freq, *args: tables.append(inv_freq) or rope(inv_freq, *args)
    )
    half = build_model(tiny_config).half()
    ids = random_ids(tiny_config.vocab_size, 1, 12)
    with torch.no_grad():
        logits16 = half(ids).logits
        logits32 = tiny_model(ids).logits
    assert logits16.dtype == torch.float16
    # float16 rounding (eps ~1e-3) over two layers; logits here are O(1).
    assert_close(logits16.float(), logits32, atol=2e-2, rtol=1e-2)
    # Frequencies rounded to float16 (a buffer cast by .half()) move 12 positions' logits far less than the
    # bound above, yet an angle by ~1 rad near minimind-3's 32768 positions (0.178 off by 1.7e-4, times
    # 32768): the float16 model must rotate with the float32 frequencies.
    assert tables and all(f.dtype == torch.float32 and torch.equal(f, rope_inv_freq(tiny_config)) for f in tables)
