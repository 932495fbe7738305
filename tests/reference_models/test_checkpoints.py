"""Checkpoint loading: every format users hold, written here; safe unpickling; clear errors on keys and configs."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
import warnings
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from exporter.cli import main
from reference import CheckpointError, build_model, get_preset
from reference.checkpoints import load_checkpoint

MINIMIND_PRESETS = ["minimind-3-tiny", "minimind-3-moe-tiny", "minimind2-tiny", "minimind2-moe-tiny"]


def _half_state(model) -> dict:
    """What MiniMind's trainers save: every tensor in float16."""
    return {k: v.detach().half() for k, v in model.state_dict().items()}


def _gpt_checkpoint(model) -> dict:
    """The teaching GPT's training checkpoint: model_state_dict with its buffers, plus optimizer state."""
    cfg = model.config
    state = _half_state(model)
    state["pos_idxs"] = torch.arange(cfg.context_length)
    for block in range(cfg.n_blocks):
        for head in range(cfg.n_head):
            state[f"attn_blocks.{block}.attn.heads.{head}.tril"] = torch.ones(
                cfg.context_length, cfg.context_length
            ).tril()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3).state_dict()
    return {"model_state_dict": state, "optimizer_state_dict": optimizer, "epoch": 2, "loss": 3.25}


# The keys each generation's MiniMindConfig writes (upstream source), under upstream's names.
UPSTREAM_CONFIG_KEYS = {
    3: (
        "hidden_size",
        "num_hidden_layers",
        "use_moe",
        "dropout",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "flash_attn",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "intermediate_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "inference_rope_scaling",
        "rope_scaling",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "router_aux_loss_coef",
    ),
    2: (
        "dropout",
        "bos_token_id",
        "eos_token_id",
        "hidden_act",
        "hidden_size",
        "intermediate_size",
        "max_position_embeddings",
        "num_attention_heads",
        "num_hidden_layers",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "inference_rope_scaling",
        "rope_scaling",
        "flash_attn",
        "use_moe",
        "num_experts_per_tok",
        "n_routed_experts",
        "n_shared_experts",
        "scoring_func",
        "aux_loss_alpha",
        "seq_aux",
        "norm_topk_prob",
    ),
}
UPSTREAM_NAMES = {"n_routed_experts": "num_experts", "aux_loss_alpha": "router_aux_loss_coef"}


def _upstream_config_json(config) -> dict:
    """config.json as MiniMind's save_pretrained writes it: upstream's keys and names, Transformers' bookkeeping
    included (a private `_attn_implementation_autoset` as some releases write it)."""
    ours = {**config.to_dict(), "flash_attn": True, "head_dim": config.head_dim, "scoring_func": "softmax"}
    data = {key: ours[UPSTREAM_NAMES.get(key, key)] for key in UPSTREAM_CONFIG_KEYS[config.version]}
    data.update(
        architectures=["MiniMindForCausalLM"],
        auto_map={"AutoConfig": "model_minimind.MiniMindConfig"},
        model_type="minimind",
        torch_dtype="float16",
        transformers_version="4.57.1",
        _attn_implementation_autoset=True,
    )
    return data


def _write(kind: str, model, folder):
    """Write `model` as a checkpoint of the given kind; return the path to load."""
    state = _half_state(model)
    if kind == "pth":
        path = folder / "full_sft_64.pth"
        torch.save(state, path)
    elif kind == "safetensors":
        path = folder / "model.safetensors"
        save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, str(path))
    elif kind in ("hf-safetensors", "hf-bin"):
        path = folder / "hf"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(_upstream_config_json(model.config)))
        (path / "tokenizer.json").write_text("{}")
        if kind == "hf-safetensors":  # save_pretrained drops the tied duplicate
            save_file(
                {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, str(path / "model.safetensors")
            )
        else:
            torch.save(state, path / "pytorch_model.bin")
    elif kind == "hf-sharded":  # save_pretrained past max_shard_size: two shards and their index
        path = folder / "hf"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(_upstream_config_json(model.config)))
        names = [k for k in state if k != "lm_head.weight"]
        weight_map = {}
        for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
            shard = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({k: state[k].contiguous() for k in part}, str(path / shard))
            weight_map.update(dict.fromkeys(part, shard))
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _rounded(model):
    """The model as its float16 checkpoint holds it, back in float32: what loading must give exactly."""
    rounded = build_model(model.config)
    rounded.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    return rounded


@pytest.mark.parametrize("preset", MINIMIND_PRESETS)
@pytest.mark.parametrize("kind", ["pth", "safetensors", "hf-safetensors", "hf-bin", "hf-sharded"])
def test_minimind_checkpoints_load_exactly_in_every_format(preset, kind, tmp_path):
    model = build_model(get_preset(preset), seed=3)  # distinct norms: two swapped would not look loaded
    path = _write(kind, model, tmp_path)
    given = None if kind.startswith("hf") else get_preset(preset)  # .pth/.safetensors carry no config
    loaded, report = load_checkpoint(path, config=given)
    assert loaded.config == model.config
    assert report.config_source == ("config.json" if kind.startswith("hf") else "given")
    assert report.converted == {"float16": len(model.state_dict())}  # the tied lm_head counted as loaded
    assert next(loaded.parameters()).dtype == torch.float32
    expected = _rounded(model).state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


@pytest.mark.parametrize("preset", MINIMIND_PRESETS)
def test_family_generation_and_sizes_are_inferred_from_a_bare_pth(preset, tmp_path):
    config = get_preset(preset)
    path = _write("pth", build_model(config), tmp_path)
    loaded, report = load_checkpoint(path)
    inferred = loaded.config
    assert report.config_source == "inferred" and report.family == "minimind"
    for field in (
        "version",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "use_moe",
        "num_experts",
        "n_shared_experts",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "rms_norm_eps",
    ):
        assert getattr(inferred, field) == getattr(config, field), field
    assert inferred.max_position_embeddings == 32768  # not in the weights: the generation's default, and said
    assert report.assumed["max_position_embeddings"] == 32768
    if config.use_moe:  # the top-k the report says was assumed is the one the model routes with
        assert report.assumed["num_experts_per_tok"] == inferred.num_experts_per_tok == config.num_experts_per_tok
    if config.version == 3:  # head_dim is the q_norm width: heads and kv heads follow
        assert (inferred.num_attention_heads, inferred.num_key_value_heads) == (4, 2)
    else:  # MiniMind2 weights do not show the head count: assumed (8, as published), and said
        assert report.assumed["num_attention_heads"] == 8 and inferred.num_key_value_heads == 4
    # Supplying what the weights cannot show gives the config exactly.
    exact, report = load_checkpoint(path, config_data={"num_attention_heads": 4, "max_position_embeddings": 256})
    assert (
        exact.config == config
        and report.config_source == "given fields"
        and "num_attention_heads" not in report.assumed
    )
    # ... and so does the head size alone, from which the heads follow (not dropped for an assumed head count)
    by_size, report = load_checkpoint(path, config_data={"head_dim": config.head_dim, "max_position_embeddings": 256})
    assert by_size.config == config and "num_attention_heads" not in report.assumed
    for wrong in (config.head_dim * 2 if config.version == 3 else 7, "16"):  # q_norm's width / no divisor / a string
        with pytest.raises(CheckpointError, match="head_dim .* does not fit the checkpoint"):
            load_checkpoint(path, config_data={"head_dim": wrong})
    with pytest.raises(CheckpointError, match="head_dim .* does not fit the checkpoint"):
        load_checkpoint(path, config_data={"head_dim": config.head_dim, "num_attention_heads": 2})


@pytest.mark.parametrize("preset", ["minimind-3-tiny", "minimind2-tiny"])
def test_a_head_count_or_a_q_proj_that_fits_no_heads_is_named_not_a_python_error(preset, tmp_path):
    # --config num_attention_heads "4", 0 or 1000, or a q_proj cut to 10 rows: named, not "cannot infer the minimind
    # config from the checkpoint's tensors" with a TypeError, "(no tensor 'num_attention_heads')" or a
    # ZeroDivisionError.
    model = build_model(get_preset(preset))
    path = _write("pth", model, tmp_path)
    for heads, fragment in (
        ("4", "must be a positive integer, got '4'"),
        (0, "must be a positive integer, got 0"),
        (True, "must be a positive integer, got True"),
        (
            1000,
            r"1000 heads \(num_attention_heads\) do not divide the 64 rows of "
            r"model\.layers\.0\.self_attn\.q_proj\.weight",
        ),
    ):
        with pytest.raises(CheckpointError, match=fragment) as caught:
            load_checkpoint(path, config_data={"num_attention_heads": heads})
        assert "Error:" not in str(caught.value) and "no tensor" not in str(caught.value), caught.value
    # Beside a head_dim (a config.json's, as Transformers writes it) the head count is checked before anything is
    # divided by it: a CheckpointError, not TypeError or ZeroDivisionError.
    for heads in ("4", 0):
        with pytest.raises(CheckpointError, match=f"num_attention_heads must be a positive integer, got {heads!r}"):
            load_checkpoint(path, config_data={"hidden_size": 64, "num_attention_heads": heads, "head_dim": 16})
    state = torch.load(path)
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(10, 64)
    torch.save(state, path)
    shown = (
        r"q_proj\.weight has 10 rows, not a whole number of heads of q_norm's width 16"
        if model.config.version == 3
        else r"8 heads \(num_attention_heads, assumed.*\) do not divide the 10 rows of .*q_proj\.weight"
    )
    with pytest.raises(CheckpointError, match=shown) as caught:
        load_checkpoint(path)
    assert "Error:" not in str(caught.value), caught.value


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."])
def test_a_minimind_resume_checkpoint_of_a_wrapped_model_loads(prefix, tmp_path):
    # MiniMind's trainers wrap the compiled model in DDP and save {"model": ..., "optimizer": ..., "epoch": ...}
    # as *_resume.pth: every wrapper prefix is stripped, in any order, and the resume file's "model" is the state
    # dict.
    model = build_model(get_preset("minimind-3-tiny"), seed=4)
    path = tmp_path / "full_sft_64_resume.pth"
    weights = {prefix + k: v for k, v in _half_state(model).items()}
    torch.save(
        {
            "model": weights,
            "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4}]},
            "epoch": 1,
            "step": 200,
            "world_size": 2,
            "wandb_id": None,
        },
        path,
    )
    loaded, report = load_checkpoint(path, config=get_preset("minimind-3-tiny"))
    assert report.format == "pth (model)"
    expected = _rounded(model).state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_dict_of_more_than_a_few_non_tensors_says_there_are_more(tmp_path):
    path = tmp_path / "mixed.pth"
    torch.save({f"entry{i}": i for i in range(7)} | {"w": torch.zeros(1)}, path)
    with pytest.raises(
        CheckpointError,
        match=r"7 entries are not tensors \(entry0, entry1, entry2, entry3, "
        r"entry4, \.\.\.\); save model.state_dict\(\) itself",
    ):
        load_checkpoint(path)


def test_teaching_gpt_training_checkpoint_loads_and_drops_its_buffers(tmp_path):
    model = build_model(get_preset("teaching-gpt-tiny"), seed=1)
    path = tmp_path / "checkpoint_epoch2.pt"
    checkpoint = _gpt_checkpoint(model)
    checkpoint["model_state_dict"] = {f"_orig_mod.{k}": v for k, v in checkpoint["model_state_dict"].items()}
    torch.save(checkpoint, path)  # as saved from a torch.compile'd model
    loaded, report = load_checkpoint(path)
    assert loaded.config == model.config and report.family == "teaching-gpt"
    assert report.format == "pth (model_state_dict)"
    assert report.dropped[0] == "pos_idxs" and len(report.dropped) == 1 + 2 * 4
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, _rounded_gpt(model)(ids).logits)


def _rounded_gpt(model):
    rounded = build_model(model.config)
    rounded.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    return rounded


def test_teaching_gpt_buffers_that_the_reference_cannot_reproduce_are_refused(tmp_path):
    model = build_model(get_preset("teaching-gpt-tiny"))
    checkpoint = _gpt_checkpoint(model)
    checkpoint["model_state_dict"]["attn_blocks.1.attn.heads.2.tril"] = torch.ones(64, 64)  # not causal
    torch.save(checkpoint, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=r"attn_blocks.1.attn.heads.2.tril is not a lower-triangular"):
        load_checkpoint(tmp_path / "bad.pt")
    checkpoint = _gpt_checkpoint(model)
    checkpoint["model_state_dict"]["pos_idxs"] = torch.arange(1, 65)  # positions shifted by one
    torch.save(checkpoint, tmp_path / "shifted.pt")
    with pytest.raises(CheckpointError, match=r"buffer pos_idxs is not 0..63"):
        load_checkpoint(tmp_path / "shifted.pt")


def test_teaching_gpt_series_config_fields_are_read_and_its_training_keys_dropped(tmp_path):
    model = build_model(get_preset("teaching-gpt-tiny"))
    torch.save(_gpt_checkpoint(model), tmp_path / "checkpoint.pt")
    series = {
        "vocab_size": 512,
        "n_embed": 64,
        "n_head": 4,
        "N_BLOCKS": 2,
        "context_length": 64,
        "dropout": 0.1,
        "lr": 3e-4,
        "batch_size": 32,
        "device": "cuda",
    }  # the series' config file, training keys included
    loaded, report = load_checkpoint(tmp_path / "checkpoint.pt", config_data=series)
    assert loaded.config == model.config and report.config_source == "given fields"
    # its N_BLOCKS is read, not passed over
    with pytest.raises(CheckpointError, match="config field n_blocks is 3 but the checkpoint holds 2"):
        load_checkpoint(tmp_path / "checkpoint.pt", config_data={**series, "N_BLOCKS": 3})


def test_a_bfloat16_checkpoint_is_converted_and_counted(tmp_path):
    model = build_model(get_preset("minimind-3-tiny"))
    state = {k: v.detach().bfloat16() for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "bf16.pth")
    loaded, report = load_checkpoint(tmp_path / "bf16.pth", config=get_preset("minimind-3-tiny"))
    assert report.converted == {"bfloat16": len(state)} and next(loaded.parameters()).dtype == torch.float32


class _Payload:
    """A pickle that runs code when unpickled: it would create the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    "wrap",
    [
        lambda p: {"model.embed_tokens.weight": torch.zeros(2, 2), "x": p},
        lambda p: {"model_state_dict": {"a": torch.zeros(1)}, "optimizer": p},
        lambda p: p,
    ],
)
def test_a_malicious_pickle_is_refused_and_never_runs(wrap, tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "full_sft_512.pth"
    torch.save(wrap(_Payload(marker)), path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(CheckpointError, match=r"needs arbitrary Python objects.*posix.system.*refusing to run code"):
        load_checkpoint(path)
    result = CliRunner().invoke(main, ["export", "--checkpoint", str(path), "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "refusing to run code from a pickle" in result.stderr
    assert not marker.exists(), "the pickle's code ran"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_plain_pickle_is_refused_for_what_it_is_and_never_runs(protocol, tmp_path):
    # pickle.dump rather than torch.save (Python's default protocol is 4): refused as a plain pickle whatever its
    # protocol, not as a damaged file (torch's safe loader's view of 4 and 5). It never loads safely: its storages
    # unpickle through torch.storage._load_from_bytes, a torch.load without weights_only.
    marker = tmp_path / "pwned"
    path = tmp_path / "full_sft_512.pth"
    with open(path, "wb") as file:
        pickle.dump({"model.embed_tokens.weight": torch.zeros(2, 2), "x": _Payload(marker)}, file, protocol=protocol)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(
            CheckpointError,
            match=rf"is a plain Python pickle \(pickle.dump, protocol {protocol}\), "
            r"not a torch.save checkpoint, and needs arbitrary Python objects "
            r"to load \(it references posix.system, torch._utils.*nothing in "
            r"it was run",
        ):
            load_checkpoint(path)
        result = CliRunner().invoke(main, ["export", "--checkpoint", str(path), "-o", str(tmp_path / "out"), "-q"])
    assert not caught, [str(w.message) for w in caught]
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "plain Python pickle" in result.stderr and "posix.system" in result.stderr
    assert not marker.exists(), "the pickle's code ran"


def test_torch_files_of_other_pickle_protocols_load_or_are_refused_without_a_warning(tmp_path):
    # torch warns of every protocol but 2 before reading it (3) or failing on it (4).
    state = _half_state(build_model(get_preset("minimind-3-tiny")))
    torch.save(state, tmp_path / "p3.pth", pickle_protocol=3)
    torch.save(state, tmp_path / "p4.pth", pickle_protocol=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, _ = load_checkpoint(tmp_path / "p3.pth")
        with pytest.raises(
            CheckpointError,
            match="saved with a pickle_protocol above 3, which torch's weights-only "
            "loader cannot read; nothing in it was run",
        ):
            load_checkpoint(tmp_path / "p4.pth")
    assert not caught, [str(w.message) for w in caught]
    assert torch.equal(loaded.model.embed_tokens.weight, state["model.embed_tokens.weight"].float())


def test_missing_unexpected_and_misshaped_keys_are_listed_with_counts(tmp_path):
    config = get_preset("minimind-3-tiny")
    state = _half_state(build_model(config))
    for layer in range(2):
        del state[f"model.layers.{layer}.self_attn.q_norm.weight"]
        del state[f"model.layers.{layer}.mlp.up_proj.weight"]
    for i in range(7):
        state[f"model.extra.{i}"] = torch.zeros(1)
    state["model.norm.weight"] = torch.ones(65)
    torch.save(state, tmp_path / "broken.pth")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "broken.pth", config=config)
    message = str(info.value)
    assert "4 missing (model.layers.0.self_attn.q_norm.weight, model.layers.0.mlp.up_proj.weight" in message
    assert "7 unexpected (model.extra.0, model.extra.1, model.extra.2, model.extra.3, model.extra.4, ...)" in message
    assert "1 mis-shaped (model.norm.weight: checkpoint (65,) vs model (64,))" in message
    assert "\n" not in message


def test_sizes_that_do_not_fit_the_tensors_are_refused_before_a_model_is_allocated(tmp_path):
    # One stray key would size 3000 layers (100000 take 40 GB); a --config intermediate_size 10**12 256 TB.
    state = _half_state(build_model(get_preset("minimind-3-tiny")))
    torch.save({**state, "model.layers.2999.mlp.gate_proj.weight": torch.zeros(256, 64)}, tmp_path / "stray.pth")
    with pytest.raises(
        CheckpointError, match="model.layers.2999.mlp.gate_proj.weight has index 2999 but no key has index 2"
    ):
        load_checkpoint(tmp_path / "stray.pth")
    torch.save(state, tmp_path / "model.pth")
    with pytest.raises(
        CheckpointError,
        match=r"6 mis-shaped \(model.layers.0.mlp.gate_proj.weight: checkpoint "
        r"\(256, 64\) vs model \(1000000000000, 64\)",
    ):
        load_checkpoint(tmp_path / "model.pth", config_data={"intermediate_size": 10**12})


@pytest.mark.parametrize(
    "preset,given,message",
    [
        (
            "minimind-3-tiny",
            {"num_hidden_layers": 20000},
            "config field num_hidden_layers is 20000 but the checkpoint "
            r"holds 2 \(model.layers.0 to model.layers.1\); set it to 2 in --config, or leave it out to infer it",
        ),
        (
            "minimind-3-tiny",
            {"vocab_size": 10**12},
            "config field vocab_size is 1000000000000 but the checkpoint holds "
            r"512 \(model.embed_tokens.weight is \(512, 64\)\)",
        ),
        (
            "minimind2-moe-tiny",
            {"num_experts": 5000},
            "config field num_experts is 5000 but the checkpoint holds 4 "
            r"\(model.layers.0.mlp.experts.0 to model.layers.0.mlp.experts.3\)",
        ),
        (
            "teaching-gpt-tiny",
            {"n_blocks": 20000},
            "config field n_blocks is 20000 but the checkpoint holds 2 "
            r"\(attn_blocks.0 to attn_blocks.1\)",
        ),
    ],
)
def test_a_config_the_tensors_cannot_hold_is_refused_before_any_model_is_built(preset, given, message, tmp_path):
    # 20000 layers are refused before any model is built (even on the meta device that would take long)
    model = build_model(get_preset(preset))
    torch.save(_gpt_checkpoint(model) if preset.startswith("teaching") else _half_state(model), tmp_path / "m.pth")
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(tmp_path / "m.pth", config_data=given)
    assert time.perf_counter() - start < 5 and "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="pass the preset or config that matches the checkpoint, or none"):
        load_checkpoint(tmp_path / "m.pth", config=replace(get_preset(preset), **given))


def test_the_cli_refuses_a_layer_count_the_checkpoint_does_not_hold_in_one_line(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(
        {
            k: v.contiguous()
            for k, v in _half_state(build_model(get_preset("minimind-3-tiny"))).items()
            if k != "lm_head.weight"
        },
        str(folder / "model.safetensors"),
    )
    (tmp_path / "c.json").write_text(json.dumps({"num_hidden_layers": 20000}))
    start = time.perf_counter()
    result = CliRunner().invoke(
        main,
        [
            "export",
            "--checkpoint",
            str(folder),
            "--config",
            str(tmp_path / "c.json"),
            "-o",
            str(tmp_path / "out"),
            "-q",
        ],
    )
    assert time.perf_counter() - start < 5, "the model was built before the refusal"
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "num_hidden_layers is 20000 but the checkpoint holds 2" in result.stderr
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 7}))
    with pytest.raises(CheckpointError, match="num_hidden_layers is 7 .* correct it in its config.json to 2"):
        load_checkpoint(folder)


def test_a_preset_that_does_not_fit_the_checkpoint_is_an_error_not_a_reshape(minimind2_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match=r"4 missing \(model.layers.0.self_attn.q_norm.weight.*6 mis-shaped"):
        load_checkpoint(minimind2_checkpoint, config=get_preset("minimind-3-tiny"))
    result = CliRunner().invoke(
        main,
        [
            "export",
            "--checkpoint",
            str(minimind2_checkpoint),
            "--preset",
            "minimind-3-tiny",
            "-o",
            str(tmp_path / "out"),
            "-q",
        ],
    )
    assert result.exit_code == 2 and "does not fit the minimind config" in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="holds a minimind model but the given config is teaching-gpt"):
        load_checkpoint(minimind2_checkpoint, config=get_preset("teaching-gpt-tiny"))


def test_tied_and_untied_embeddings(tmp_path):
    state = _half_state(build_model(get_preset("minimind-3-tiny")))
    state["lm_head.weight"] = state["lm_head.weight"].clone() + 1
    torch.save(state, tmp_path / "untied.pth")
    with pytest.raises(CheckpointError, match="differ but the config ties them"):
        load_checkpoint(tmp_path / "untied.pth", config=get_preset("minimind-3-tiny"))
    loaded, _ = load_checkpoint(tmp_path / "untied.pth")  # inferred: an untied model
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.lm_head.weight, state["lm_head.weight"].float())


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda d: d / "nope.pth", "does not exist"),
        (lambda d: (d / "w.npz").write_bytes(b"x") and d / "w.npz", "unknown checkpoint type '.npz'"),
        (lambda d: (d / "t.pth").write_bytes(b"not a zip") and d / "t.pth", "not a readable torch checkpoint"),
        # A text file: what it is, not torch's legacy loader's "(KeyError: 101)" (it takes "h" for a pickle opcode).
        (
            lambda d: (d / "t.pth").write_bytes(b"hello\n") and d / "t.pth",
            r"t\.pth is not a readable torch checkpoint: "
            r"neither a zip archive, as torch\.save writes, nor a pickle \(damaged, or of another format\); "
            r"check the file$",
        ),
        # A torch.save file cut short read "(OSError: [Errno 22] Invalid argument)", or miniz's "This is an internal
        # miniz error. If you are seeing this error, there is a high likelihood tha" cut at 160 characters.
        (
            lambda d: (
                torch.save({"w": torch.zeros(4096)}, d / "cut.pth")
                or os.truncate(d / "cut.pth", 10000)
                or d / "cut.pth"
            ),
            r"cut\.pth is a truncated or damaged torch\.save file, .*\(OSError: \[Errno 22\] "
            r"Invalid argument\)",
        ),
        (
            lambda d: (
                torch.save({"w": torch.zeros(4096)}, d / "cut.pth") or os.truncate(d / "cut.pth", 2000) or d / "cut.pth"
            ),
            r"truncated or damaged torch\.save file, .*\(RuntimeError: PytorchStreamReader failed "
            r"reading zip archive: failed finding central directory\); copy",
        ),
        (
            lambda d: (d / "t.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}") and d / "t.safetensors",
            "not a readable safetensors file",
        ),
        (lambda d: d, "holds no model.safetensors"),
        (lambda d: torch.save([torch.zeros(1)], d / "list.pth") or d / "list.pth", "does not hold a state dict"),
        (
            lambda d: torch.save({"w": torch.zeros(1), "step": 3}, d / "mixed.pth") or d / "mixed.pth",
            r"1 entries are not tensors \(step\)",
        ),
        (
            lambda d: torch.save({"encoder.w": torch.zeros(1)}, d / "other.pth") or d / "other.pth",
            "no known model family has these keys",
        ),
    ],
)
def test_unreadable_checkpoints_give_one_clear_error(setup, message, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    path = setup(folder)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_cli_checkpoint_option_errors_are_one_line(minimind2_checkpoint, tmp_path):
    def error(*args):
        result = CliRunner().invoke(main, ["export", *map(str, args), "-q"])
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
        return result.stderr

    assert "for seeded weights choose a --preset" in error("--config", tmp_path / "c.json")
    assert "a --checkpoint brings its own: drop --seed" in error("--checkpoint", minimind2_checkpoint, "--seed", "3")
    (tmp_path / "c.json").write_text("[1]")
    assert "not a JSON object" in error("--checkpoint", minimind2_checkpoint, "--config", tmp_path / "c.json")
    assert "not both" in error(
        "--checkpoint", minimind2_checkpoint, "--config", tmp_path / "c.json", "--preset", "minimind2-tiny"
    )
    (tmp_path / "c.json").write_text(json.dumps({"hiden_size": 3}))
    assert "unknown config fields ['hiden_size']" in error(
        "--checkpoint", minimind2_checkpoint, "--config", tmp_path / "c.json"
    )


def test_a_config_json_head_dim_the_reference_cannot_honour_is_refused(tmp_path):
    model = build_model(get_preset("minimind-3-tiny"))
    path = _write("hf-safetensors", model, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "head_dim": 32}))  # hidden 64 / 4 heads = 16
    with pytest.raises(CheckpointError, match=r"head_dim \(32\) differs from hidden_size / num_attention_heads \(16\)"):
        load_checkpoint(path)


def test_config_data_that_is_no_dict_is_refused(tmp_path):
    """A path given as config_data is refused by name, not left to AttributeError ('str' object has no attribute
    'get')."""
    from reference import ConfigError

    torch.save(_half_state(build_model(get_preset("minimind-3-tiny"))), tmp_path / "model.pth")
    for data in ("config.json", [("hidden_size", 64)]):
        with pytest.raises(
            ConfigError,
            match=r"^config_data must be a dict of config fields, got (str|list) .*; "
            r"pass json.loads of the file's text",
        ):
            load_checkpoint(tmp_path / "model.pth", config_data=data)
    # a --config file's path given as config read "str is not the config of a known family ...; describe your own
    # decoder with reference.byo.DecoderSpec", advice for another mistake
    with pytest.raises(
        ConfigError,
        match=r"^config must be a preset's config, got str 'config.json'; pass the "
        r"fields of a --config file as config_data",
    ):
        load_checkpoint(tmp_path / "model.pth", config="config.json")


def test_a_preset_name_given_as_config_points_to_get_preset(tmp_path):
    """config="minimind-3-tiny" read "str is not the config of a known family (...); describe your own decoder
    with reference.byo.DecoderSpec": a preset's name is what a user passes there first."""
    from reference import ConfigError

    torch.save(_half_state(build_model(get_preset("minimind-3-tiny"))), tmp_path / "model.pth")
    with pytest.raises(
        ConfigError,
        match=r"^config must be a preset's config, got str 'minimind-3-tiny'; pass "
        r"reference\.get_preset\('minimind-3-tiny'\) for a preset$",
    ):
        load_checkpoint(tmp_path / "model.pth", config="minimind-3-tiny")


def test_a_checkpoint_that_is_no_path_or_a_config_given_twice_is_refused(tmp_path):
    """A path that is none is refused by name, not left to pathlib's TypeError; config with config_data is refused,
    not one of them ignored (the CLI refuses both)."""
    from reference import ConfigError
    from reference.source import checkpoint_model

    for path in (None, 5):
        with pytest.raises(CheckpointError, match=f"a checkpoint is a path .* got {path}$"):
            checkpoint_model(path)
    torch.save(build_model(get_preset("minimind-3-tiny")).state_dict(), tmp_path / "model.pth")
    with pytest.raises(ConfigError, match=r"give config \(a preset's config\) or config_data .*, not both"):
        checkpoint_model(tmp_path / "model.pth", preset="minimind-3-tiny", config_data={"dropout": 0.0})


def test_checkpoint_files_this_user_cannot_read_are_named(tmp_path, monkeypatch):
    """chmod 000 on config.json or model.safetensors: each named as unreadable, not a PermissionError nor "No such
    file or directory". Simulated, since the tests may run as root, whom permission bits do not stop."""
    import pathlib

    state = {k: v.clone() for k, v in build_model(get_preset("minimind-3-tiny")).state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")

    def deny(method: str, name: str) -> None:
        real = getattr(pathlib.Path, method)

        def refusing(path, *args, **kwargs):
            if path.name == name:
                raise PermissionError(13, "Permission denied")
            return real(path, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, method, refusing)

    real_open = os.open

    def refusing_open(path, *args, **kwargs):
        if os.path.basename(path) == "config.json":
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(CheckpointError, match=r"config.json is not a readable JSON file \(Permission denied\)"):
        load_checkpoint(tmp_path)
    monkeypatch.undo()
    deny("open", "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors cannot be read \(Permission denied\); let this"):
        load_checkpoint(tmp_path)
