"""The hf-decoder family against transformers' own models of the same folders, and the translation of config.json."""

from __future__ import annotations

import copy
import inspect
import json
import logging

import pytest
import torch
from helpers import assert_close

from reference import CheckpointError, ConfigError, HFDecoderConfig
from reference.checkpoints import load_checkpoint
from reference.hf_decoder_config import MODEL_TYPES, translate_hf_config

transformers = pytest.importorskip("transformers")

# Tolerance of the toolkit's reference against transformers', both float32. They compute the same formulas with
# operations ordered differently (scores scaled before or after the matmul, kv heads grouped or repeated, the
# rope frequencies by the same formulas), so they differ by float32 rounding alone. A dot product of length K
# rounds to within K * eps of the sum of its terms' magnitudes (Higham's gamma_K); the longest accumulation
# here is intermediate_size (96), and errors are measured against the output's peak: 96 * eps * peak, about
# 1e-5 * peak. A bias, norm or rope term missed or misplaced moves outputs by a sizeable fraction of the peak.
EPS = torch.finfo(torch.float32).eps
ACCUMULATION = 96


def _close(actual, expected, where=None):
    actual, expected = (actual, expected) if where is None else (actual[where], expected[where])
    assert_close(actual, expected, atol=ACCUMULATION * EPS * expected.abs().max().item())


def _transformers_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _hf_cache(out):
    cache = getattr(out, "cache", None)
    cache = out.past_key_values if cache is None else cache
    return [(layer.keys, layer.values) for layer in cache.layers]  # each (B, Hkv, L, D)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@torch.no_grad()
def test_the_reference_computes_what_transformers_computes(hf_folders, model_type):
    """A left-padded prompt with labels (logits and presents at the real positions, the loss), then a cached
    decode step of two tokens on each side's own cache."""
    ours, report = load_checkpoint(hf_folders[model_type])
    theirs = _transformers_model(hf_folders[model_type])
    assert report.family == "hf-decoder" and ours.config.model_type == model_type
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    labels = torch.where(mask == 1, ids, -100)
    labels[0, 3] = -100  # predicted from a padded position, whose output no one reads (nor do the two agree on it)
    a = ours(ids, attention_mask=mask, position_ids=positions, labels=labels, use_cache=True)
    b = theirs(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels, use_cache=True)
    real = mask.bool()
    _close(a.logits, b.logits, real)
    _close(a.loss, b.loss)
    keys = real[:, None, :, None].expand(-1, ours.config.num_key_value_heads, -1, ours.config.head_dim)
    for (k, v), (hk, hv) in zip(a.past_key_values, _hf_cache(b)):
        _close(k.transpose(1, 2), hk, keys)
        _close(v.transpose(1, 2), hv, keys)

    step = torch.randint(0, 256, (2, 2), generator=generator)
    mask = torch.cat([mask, torch.ones_like(step)], 1)
    positions = positions[:, -1:] + torch.arange(1, 3)
    a = ours(step, attention_mask=mask, position_ids=positions, past_key_values=a.past_key_values, use_cache=True)
    past = transformers.DynamicCache()
    for layer, (hk, hv) in enumerate(_hf_cache(b)):
        past.update(hk, hv, layer)
    cache_arg = "cache" if "cache" in inspect.signature(theirs.forward).parameters else "past_key_values"
    b = theirs(input_ids=step, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_arg: past})
    _close(a.logits, b.logits)
    keys = mask.bool()[:, None, :, None].expand(-1, ours.config.num_key_value_heads, -1, ours.config.head_dim)
    for (k, v), (hk, hv) in zip(a.past_key_values, _hf_cache(b)):
        _close(k.transpose(1, 2), hk, keys)
        _close(v.transpose(1, 2), hv, keys)


def test_each_type_translates_to_its_math(hf_folders):
    configs = {t: load_checkpoint(folder)[0].config for t, folder in hf_folders.items()}
    llama, mistral, qwen2, qwen3 = (configs[t] for t in ("llama", "mistral", "qwen2", "qwen3"))
    assert (llama.head_dim, llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.tie_word_embeddings) == (
        32,
        True,
        True,
        True,
        False,
    )
    assert llama.rope_theta == 500000.0 and llama.rope_scaling.rope_type == "llama3"
    assert llama.rope_scaling.original_max_position_embeddings == 8192
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_word_embeddings, qwen2.rope_theta) == (True, False, True, 1e6)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.rope_scaling.rope_type) == (True, 32, "yarn")
    assert qwen3.rope_scaling.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert (mistral.rope_scaling.rope_type, mistral.rope_scaling.factor, mistral.head_dim) == ("linear", 2.0, 16)
    phi3 = configs["phi3"]
    assert (phi3.fused_qkv, phi3.fused_gate_up, phi3.head_dim, phi3.rope_dim, phi3.rope_scaling) == (
        True,
        True,
        16,
        12,
        None,
    )
    assert not any(c.fused_qkv or c.fused_gate_up or c.rope_dim != c.head_dim for c in (llama, mistral, qwen2, qwen3))
    for config in configs.values():  # the manifest's round trip
        assert HFDecoderConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_a_long_context_allocates_no_position_table(hf_folders):
    model, _ = load_checkpoint(hf_folders["qwen3"])
    assert model.config.max_position_embeddings == 131072
    assert all(131072 not in tensor.shape for tensor in model.state_dict().values())
    assert not list(model.buffers())


def _qwen3_json(hf_folders) -> dict:
    return json.loads((hf_folders["qwen3"] / "config.json").read_text())


def test_transformers_4_and_5_rope_fields_translate_alike(hf_folders):
    v5 = _qwen3_json(hf_folders)
    v4 = copy.deepcopy(v5)
    parameters = v4.pop("rope_parameters")
    v4["rope_theta"] = parameters.pop("rope_theta")
    v4["rope_scaling"] = {"type": parameters.pop("rope_type"), **parameters}
    assert translate_hf_config(v4) == translate_hf_config(v5)


def test_head_dim_takes_the_types_default(hf_folders):
    data = _qwen3_json(hf_folders)
    del data["head_dim"]
    assert translate_hf_config(data)["head_dim"] == 128  # Qwen3Config's default, not hidden / heads
    assert translate_hf_config({**data, "model_type": "qwen2"})["head_dim"] == 16


def test_fields_without_effect_are_logged_not_refused(hf_folders, caplog):
    data = {**_qwen3_json(hf_folders), "attention_dropout": 0.1, "router_jitter": 0.5}
    with caplog.at_level(logging.INFO, logger="reference.hf_decoder_config"):
        translate_hf_config(data)
    assert "ignored: router_jitter" in caplog.text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gemma"}, r"model_type 'gemma' is not supported; supported .*llama, mistral, qwen2, qwen3"),
        ({"hidden_act": "gelu"}, r"hidden_act must be 'silu', got 'gelu'"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_type 'dynamic' \(dynamic NTK"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, r"rope_type 'longrope'"),
        ({"num_experts": 8}, r"num_experts \(8\) describes a mixture of experts"),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 4096,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            r"sliding_window \(4096\) is shorter than max_position_embeddings \(131072\)",
        ),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor is 0.5"),
    ],
)
def test_what_changes_the_math_unsupported_is_refused_by_name(hf_folders, change, message):
    with pytest.raises(ConfigError, match=message):
        HFDecoderConfig.from_dict(translate_hf_config({**_qwen3_json(hf_folders), **change}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [4.0] * 6}},
            r"rope_type 'longrope' \(its frequencies switch from short to long factors",
        ),
        ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 6}}, r"rope_type 'su' \(phi3 reads it as longrope: "),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, r"'linear' \(phi3's config does not take it\)"),
        ({"rope_parameters": None, "partial_rotary_factor": 0.7}, r"partial_rotary_factor \(0.7\) must turn an even"),
    ],
)
def test_what_a_phi3_config_holds_that_the_reference_does_not_compute_is_refused(hf_folders, change, message):
    data = json.loads((hf_folders["phi3"] / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        HFDecoderConfig.from_dict(translate_hf_config({**data, **change}))


def test_a_sliding_window_that_never_applies_is_ignored(hf_folders):
    data = _qwen3_json(hf_folders)
    assert translate_hf_config({**data, "use_sliding_window": False, "sliding_window": 16})
    assert translate_hf_config({**data, "use_sliding_window": True, "sliding_window": 131072})
    qwen3_only = ("layer_types", "use_sliding_window", "max_window_layers")  # a mistral config has none of them
    mistral = {k: v for k, v in data.items() if k not in qwen3_only}
    mistral.update(model_type="mistral", sliding_window=4096, max_position_embeddings=4096)
    assert translate_hf_config(mistral)["max_position_embeddings"] == 4096
    with pytest.raises(ConfigError, match="sliding_window"):
        translate_hf_config({**mistral, "max_position_embeddings": 8192})


def test_sizes_that_disagree_with_the_tensors_are_refused(hf_folders, tmp_path):
    import shutil

    folder = shutil.copytree(hf_folders["qwen3"], tmp_path / "qwen3")
    data = _qwen3_json(hf_folders)
    (folder / "config.json").write_text(json.dumps({**data, "num_hidden_layers": 3, "layer_types": None}))
    with pytest.raises(CheckpointError, match=r"num_hidden_layers is 3 but the checkpoint holds 2"):
        load_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps({**data, "head_dim": 16}))
    with pytest.raises(CheckpointError, match=r"does not fit the hf-decoder config: .*mis-shaped"):
        load_checkpoint(folder)
