"""Every family in eager PyTorch: published sizes, generation differences, MoE against upstream, YaRN, teaching GPT."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import upstream
from helpers import (
    assert_cached_decoding_equals_full_forward,
    assert_close,
    padded_batch_logits,
    random_ids,
)

from reference import (
    PRESETS,
    ConfigError,
    ContextLengthError,
    MiniMindConfig,
    TeachingGPTConfig,
    YarnScaling,
    build_model,
    get_preset,
)
from reference.families import FAMILIES, config_from_dict, family_of
from reference.hf_decoder_config import HFDecoderConfig
from reference.hf_types import HF_TYPES
from reference.minimind import RMSNorm, rope_inv_freq

PUBLISHED = {  # the published sizes (docs/models.md), tied embeddings counted once
    "minimind2-small": 25_829_888,
    "minimind2": 104_030_976,
    "minimind2-moe": 145_029_760,
    "minimind-3": 63_912_192,
    "minimind-3-moe": 198_416_640,
    "teaching-gpt-smoke": 13_356_928,  # seed 003's smoke config
}


@pytest.mark.parametrize("name,count", PUBLISHED.items())
def test_published_presets_have_exact_parameter_counts(name, count):
    config = get_preset(name)
    with torch.device("meta"):
        model = family_of(config).model_type()(config)
    assert sum(p.numel() for p in model.parameters()) == count


def test_published_sizes_follow_each_generations_rules():
    assert [get_preset(n).intermediate_size for n in ("minimind2-small", "minimind2-moe", "minimind2")] == [
        1408,
        1728,
        2048,
    ]
    small = get_preset("MiniMind2-small")  # the published spelling works
    assert (small.num_key_value_heads, small.rms_norm_eps, small.head_dim) == (2, 1e-5, 64)
    moe2, moe3 = get_preset("minimind2-moe"), get_preset("minimind-3-moe")
    assert (moe2.num_experts, moe2.n_shared_experts, moe2.num_experts_per_tok) == (4, 1, 2)
    assert (moe3.num_experts, moe3.n_shared_experts, moe3.num_experts_per_tok, moe3.norm_topk_prob) == (4, 0, 1, True)
    assert get_preset("minimind-3").intermediate_size == 2432 and get_preset("minimind-3").head_dim == 96


def test_minimind2_has_no_qk_norm_and_casts_before_the_weight():
    model = build_model(get_preset("minimind2-tiny"))
    keys = set(model.state_dict())
    assert not any("q_norm" in k or "k_norm" in k for k in keys)
    assert "model.layers.0.mlp.gate_proj.weight" in keys and model.lm_head.weight is model.model.embed_tokens.weight
    norm = model.model.norm
    norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).half()
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    half = norm.half()
    assert torch.equal(half(x), half.weight * normed.half())  # MiniMind2: cast, then scale (in fp16)
    three = build_model(get_preset("minimind-3-tiny")).model.norm.half()
    three.weight.data.copy_(half.weight.data)
    normed3 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(three(x), (three.weight.float() * normed3).half())  # minimind-3: scale in fp32, then cast
    # every norm of each generation, the blocks' input and post-attention norms (and minimind-3's q/k norms)
    # included, not only the final one
    for preset, eps, cast_first in (("minimind2-tiny", 1e-5, True), ("minimind-3-tiny", 1e-6, False)):
        norms = [
            (name, m) for name, m in build_model(get_preset(preset)).half().named_modules() if isinstance(m, RMSNorm)
        ]
        assert len(norms) > 2 * get_preset(preset).num_hidden_layers, preset
        for name, norm in norms:
            norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
            x = torch.randn(3, norm.weight.shape[0], generator=torch.Generator().manual_seed(1)).half()
            normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
            expected = norm.weight * normed.half() if cast_first else (norm.weight.float() * normed).half()
            assert torch.equal(norm(x), expected), (preset, name)


def test_moe_state_dict_keys_are_minimind_names():
    keys = set(build_model(get_preset("minimind2-moe-tiny")).state_dict())
    layer = "model.layers.1.mlp."
    assert {
        layer + "gate.weight",
        layer + "experts.3.down_proj.weight",
        layer + "shared_experts.0.up_proj.weight",
    } <= keys
    keys3 = set(build_model(get_preset("minimind-3-moe-tiny")).state_dict())
    assert layer + "gate.weight" in keys3 and not any("shared_experts" in k for k in keys3)


def test_every_registration_names_what_it_declares():
    for family in FAMILIES.values():
        loader = family.checkpoint_loader()
        assert loader is None or loader.family == family.name, family.name
        for name, config in family.presets.items():
            assert family_of(config) is family and get_preset(name) is config, name
            assert all(family.consumer_types(config)), name  # both consumers run every preset
    flags = {f.name for f in dataclasses.fields(HFDecoderConfig) if f.type == "bool"}
    for hf_type in HF_TYPES.values():
        assert set(hf_type.math) <= flags, hf_type.name
        assert FAMILIES["hf-decoder"].consumer_types(HFDecoderConfig(model_type=hf_type.name)) == (
            hf_type.genai,
            hf_type.optimum,
        )


def test_configs_round_trip_and_name_bad_fields():
    for family in FAMILIES.values():
        if family.model_class is None:
            continue
        for name, config in ((n, c) for n, c in PRESETS.items() if type(c) is family.config_class):
            assert config_from_dict(family.name, config.to_dict()) == config, name
    yarn = get_preset("minimind-3-yarn-tiny")
    assert MiniMindConfig.from_dict(yarn.to_dict()) == yarn  # the nested YaRN dataclass survives JSON
    for bad, field in (
        ({"version": 4}, "version"),
        ({"num_experts_per_tok": 5, "use_moe": True}, "num_experts_per_tok"),
        ({"moe_implementation": "magic"}, "moe_implementation"),
        ({"rope_scaling": YarnScaling()}, "rope_scaling"),
    ):
        with pytest.raises(ConfigError, match=field):
            MiniMindConfig(**bad)
    with pytest.raises(ConfigError, match="n_head"):
        TeachingGPTConfig(n_embed=100, n_head=3)
    with pytest.raises(ConfigError, match="unknown model family 'gpt-9'"):
        config_from_dict("gpt-9", {})


# ------------------------------------------------------------------ MoE: the exportable formulation equals upstream

MOE_CASES = [
    ("minimind-3-moe-tiny", "sparse"),
    ("minimind-3-moe-tiny", "dense"),
    ("minimind2-moe-tiny", "sparse"),
    ("minimind2-moe-tiny", "dense"),
]


def _upstream_moe(moe, x):
    return (upstream.minimind3_moe if moe.config.version == 3 else upstream.minimind2_moe)(moe, x)


@pytest.mark.parametrize("preset,implementation", MOE_CASES)
@torch.no_grad()
def test_moe_layer_equals_upstream_routing(preset, implementation):
    """Random inputs, on every layer's MoE, such that each (layer, expert) receives tokens in one and none in
    another, against the upstream eval-mode code."""
    config = dataclasses.replace(get_preset(preset), moe_implementation=implementation)
    model = build_model(config)
    receives = {(layer, e): False for layer in range(config.num_hidden_layers) for e in range(config.num_experts)}
    starved = dict(receives)
    for layer, block in enumerate(model.model.layers):
        # Single tokens starve most experts: with these seeds each expert of each layer misses one.
        for seed, shape in enumerate([(3, 7), (1, 1), (2, 1), (1, 3), (4, 16), (1, 1), (1, 1), (1, 1)]):
            x = torch.randn(*shape, config.hidden_size, generator=torch.Generator().manual_seed(seed))
            ours, _ = block.mlp(x)
            theirs, idx = _upstream_moe(block.mlp, x)
            chosen = set(idx.flatten().tolist())
            for e in range(config.num_experts):
                receives[layer, e] |= e in chosen
                starved[layer, e] |= e not in chosen
            # Same sums in the same order; the only freedom left is the matmul kernel's blocking over
            # a different number of rows (upstream runs each expert on its tokens only), which moves
            # float32 results by a few units in the last place.
            tolerance = 8 * torch.finfo(torch.float32).eps * theirs.abs().max()
            difference = (ours - theirs).abs().max()
            assert difference <= tolerance, f"layer {layer}, {shape}: {difference:.3g}"
            if implementation == "sparse" and config.version == 3:
                assert torch.equal(ours, theirs)  # same ops on the same rows: bit for bit
    assert all(receives.values()), f"(layer, expert) given no token: {[k for k, v in receives.items() if not v]}"
    assert all(starved.values()), f"(layer, expert) given tokens always: {[k for k, v in starved.items() if not v]}"


@torch.no_grad()
def test_dense_dispatch_adds_an_exact_zero_for_an_unchosen_expert_even_where_it_overflows():
    config = dataclasses.replace(get_preset("minimind-3-moe-tiny"), moe_implementation="dense")
    moe = build_model(config).model.layers[1].mlp.eval()
    moe.experts[0].down_proj.weight.fill_(float("inf"))  # its output: inf and NaN on every token
    x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(3))
    _, _, idx = moe.gate(x.view(-1, config.hidden_size))
    elsewhere = ~(idx == 0).any(dim=-1)  # the tokens that did not choose expert 0
    assert elsewhere.any() and not elsewhere.all()
    dense = moe(x)[0].view(-1, config.hidden_size)
    moe.config = dataclasses.replace(config, moe_implementation="sparse")  # upstream's way: chosen experts only
    sparse = moe(x)[0].view(-1, config.hidden_size)
    assert torch.isfinite(dense[elsewhere]).all()
    assert (dense[elsewhere] - sparse[elsewhere]).abs().max() <= 1e-6


@torch.no_grad()
def test_moe_training_aux_loss_equals_upstream():
    formulas = {
        "v3": upstream.minimind3_aux_loss,
        "v2": upstream.minimind2_aux_loss,
        "v2 per sequence": lambda scores, idx, config: upstream.minimind2_seq_aux_loss(scores, idx, config, 2, 5),
    }
    # Two experts per token where the formulas differ by the top-k: minimind-3 keeps the slots apart.
    for preset, changes, formula in (
        ("minimind-3-moe-tiny", {}, "v3"),
        ("minimind-3-moe-tiny", {"num_experts_per_tok": 2}, "v3"),
        ("minimind2-moe-tiny", {}, "v2 per sequence"),
        ("minimind2-moe-tiny", {"seq_aux": False}, "v2"),
    ):
        config = dataclasses.replace(get_preset(preset), **changes)
        moe = build_model(config).model.layers[1].mlp.train()
        x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(3))
        _, aux = moe(x)
        scores, _, idx = moe.gate(x.view(-1, config.hidden_size))
        expected = formulas[formula](scores, idx, config)
        assert aux.item() == pytest.approx(expected.item(), rel=1e-6) and aux.item() > 0, (preset, changes)
        moe.eval()
        assert moe(x)[1].item() == 0.0  # eval mode: no aux loss, as upstream


@pytest.mark.parametrize("preset", ["minimind-3-moe-tiny", "minimind2-moe-tiny"])
@torch.no_grad()
def test_moe_model_caches_like_its_full_forward(preset):
    model = build_model(get_preset(preset))
    ids = random_ids(512, 2, 9)
    full = model(ids).logits
    out = model(ids[:, :5], use_cache=True)
    steps = [out.logits]
    for t in range(5, 9):
        out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits)
    assert_close(torch.cat(steps, 1), full, atol=1e-5)


# ------------------------------------------------------------------ YaRN


def test_yarn_ramp_bounds_for_head_dim_96():
    # Upstream's YaRN defaults (beta_fast 32, beta_slow 1, original window 2048, theta 1e6) ramp from dimension
    # pair 8 to 21 at head_dim 96.
    dim, orig, base = 96, 2048, 1e6

    def inv_dim(beta):
        return (dim * math.log(orig / (beta * 2 * math.pi))) / (2 * math.log(base))

    assert (max(math.floor(inv_dim(32)), 0), min(math.ceil(inv_dim(1)), dim // 2 - 1)) == (8, 21)
    config = MiniMindConfig(inference_rope_scaling=True)
    assert config.rope_scaling == YarnScaling()  # upstream's fixed YaRN settings
    scaled, plain = rope_inv_freq(config), rope_inv_freq(MiniMindConfig())
    # ramp is 0 up to index low (8), 1 from high (21): untouched below, divided by the factor above.
    assert torch.equal(scaled[:9], plain[:9]) and torch.allclose(scaled[21:], plain[21:] / 16)
    assert (scaled[9:21] < plain[9:21]).all() and (scaled[9:21] > plain[9:21] / 16).all()


@torch.no_grad()
def test_yarn_model_equals_upstream_tables_beyond_the_original_window(monkeypatch):
    config = dataclasses.replace(
        get_preset("minimind-3-yarn-tiny"),
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16, attention_factor=1.25),
    )
    model = build_model(config)
    cos, sin = upstream.yarn_tables(
        config.head_dim, config.max_position_embeddings, config.rope_theta, 16, 4.0, 32.0, 1.0, 1.25
    )
    from reference.minimind import rope_cos_sin

    positions = torch.arange(40, 90)[None]  # all past the original 16 positions
    ours_cos, ours_sin = rope_cos_sin(rope_inv_freq(config), positions, 1.25)
    assert torch.equal(ours_cos[0], cos[40:90]) and torch.equal(ours_sin[0], sin[40:90])
    plain = build_model(dataclasses.replace(config, inference_rope_scaling=False, rope_scaling=None))
    ids = random_ids(512, 1, 60)
    assert (model(ids).logits - plain(ids).logits).abs().max() > 1e-2, "YaRN must change the model"
    # the model's own forward uses those tables, YaRN's attention factor included (not only rope_cos_sin given it)
    from reference import minimind

    rope, tables = minimind.rope_cos_sin, []
    monkeypatch.setattr(minimind, "rope_cos_sin", lambda *args: tables.append(rope(*args)) or tables[-1])
    model(ids)
    assert torch.equal(tables[0][0][0], cos[:60]) and torch.equal(tables[0][1][0], sin[:60])
    monkeypatch.undo()
    # Cached decoding far past the original window equals the full forward.
    out = model(ids[:, :50], use_cache=True)
    out = model(ids[:, 50:], past_key_values=out.past_key_values, use_cache=True)
    assert_close(out.logits, model(ids).logits[:, 50:], atol=1e-5)


# ------------------------------------------------------------------ the teaching GPT


@torch.no_grad()
def test_teaching_gpt_equals_the_original_forward():
    model = build_model(get_preset("teaching-gpt-tiny"))  # ln1, ln2 and the final norm told apart
    ids = random_ids(512, 2, 21)
    assert_close(model(ids).logits, upstream.teaching_gpt_forward(model, ids), atol=1e-5)
    assert model.lm_head.bias is not None and model.lm_head.weight is not model.token_embed.weight


def test_teaching_gpt_cached_decoding_equals_full_forward():
    model = build_model(get_preset("teaching-gpt-tiny"))
    assert_cached_decoding_equals_full_forward(model, random_ids(512, 2, 13), (2, 13, 4, 16))


def test_teaching_gpt_left_padded_row_equals_the_sequence_alone():
    model = build_model(get_preset("teaching-gpt-tiny"))
    pad = 4
    skipping, default, short, full = padded_batch_logits(model, 512, pad)
    assert_close(skipping[0, pad:], short, atol=1e-5)  # absolute positions must skip the padding
    assert_close(skipping[1], full, atol=1e-5)
    assert (default[0, pad:] - short).abs().max() > 1e-3  # default positions do not skip it: a different result


@torch.no_grad()
@pytest.mark.parametrize(
    "preset, limit", [("teaching-gpt-tiny", "context_length 64"), ("minimind2-tiny", "max_position_embeddings 64")]
)
def test_models_refuse_sequences_past_their_positions(preset, limit):
    config = get_preset(preset)
    if preset.startswith("minimind"):
        config = dataclasses.replace(config, max_position_embeddings=64)
    model = build_model(config)
    model(random_ids(512, 1, 64))  # exactly at the limit
    with pytest.raises(ContextLengthError, match=f"exceeds {limit}"):
        model(random_ids(512, 1, 65))
    out = model(random_ids(512, 1, 60), use_cache=True)
    model(random_ids(512, 1, 4), past_key_values=out.past_key_values)
    with pytest.raises(ContextLengthError, match=r"past 60 \+ new 5"):
        model(random_ids(512, 1, 5), past_key_values=out.past_key_values)
