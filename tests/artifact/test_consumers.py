"""Consumer configs (genai_config.json, config.json, generation_config.json) and the tokenizer copy."""

from __future__ import annotations

import dataclasses
import json

import pytest

from exporter.artifact import consumers
from exporter.artifact.consumers import (
    FamilyTypes,
    ModelSizes,
    genai_config,
    hf_config,
    optimum_unsupported,
    write_consumer_files,
)
from exporter.artifact.manifest import read_manifest, sha256_file
from exporter.artifact.tokenizer import copy_tokenizer, find_tokenizer, minimal_tokenizer_config
from exporter.errors import TokenizerError
from exporter.export.pipeline import export_artifact
from reference import get_preset


def _json(folder, name):
    return json.loads((folder / name).read_text())


def test_genai_config_describes_the_decode_graph(artifact_fp32, tiny_config):
    config = _json(artifact_fp32, "genai_config.json")
    model, decoder = config["model"], config["model"]["decoder"]
    assert model["type"] == "qwen3"
    assert (model["context_length"], model["vocab_size"]) == (tiny_config.max_position_embeddings, 512)
    assert (model["bos_token_id"], model["eos_token_id"], model["pad_token_id"]) == (1, 2, 2)
    assert decoder["filename"] == "decode.onnx"
    assert (
        decoder["head_size"],
        decoder["hidden_size"],
        decoder["num_attention_heads"],
        decoder["num_key_value_heads"],
        decoder["num_hidden_layers"],
    ) == (16, 64, 4, 2, 2)
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert decoder["outputs"]["present_value_names"] == "present.%d.value"
    assert set(decoder["session_options"]) >= {"intra_op_num_threads", "inter_op_num_threads"}
    assert config["search"]["past_present_share_buffer"] is False  # the graph concatenates past and new keys


def test_hf_configs_carry_model_type_sizes_and_special_tokens(artifact_fp32, artifact_fp16):
    config = _json(artifact_fp32, "config.json")
    assert config["model_type"] == "qwen3" and config["torch_dtype"] == "float32"
    assert {
        k: config[k]
        for k in (
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "num_hidden_layers",
            "head_dim",
        )
    } == {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "head_dim": 16,
    }
    assert _json(artifact_fp32, "generation_config.json")["eos_token_id"] == 2
    assert _json(artifact_fp16, "config.json")["torch_dtype"] == "float16"


def test_every_written_file_is_in_the_manifest_with_its_hash(artifact_fp32, artifact_fp16):
    for folder in (artifact_fp32, artifact_fp16):
        files = read_manifest(folder).files  # also checks every hash
        for name in ("genai_config.json", "config.json", "generation_config.json"):
            assert files[name]["sha256"] == sha256_file(folder / name)
    assert "tokenizer.json" not in read_manifest(artifact_fp16).files  # exported without a tokenizer
    assert not (artifact_fp16 / "tokenizer.json").exists()


def test_tokenizer_is_copied_and_a_minimal_config_written(artifact_fp32, tiny_tokenizer):
    assert (artifact_fp32 / "tokenizer.json").read_bytes() == (tiny_tokenizer / "tokenizer.json").read_bytes()
    assert not (artifact_fp32 / "tokenizer.json").is_symlink()
    config = _json(artifact_fp32, "tokenizer_config.json")
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["model_input_names"] == ["input_ids", "attention_mask"]


def test_a_users_tokenizer_config_is_copied_and_names_the_pad_token(artifact_fp32, tiny_tokenizer, tmp_path):
    source = tmp_path / "tok"
    source.mkdir()
    (source / "tokenizer.json").write_bytes((tiny_tokenizer / "tokenizer.json").read_bytes())
    (source / "tokenizer_config.json").write_text(json.dumps({"pad_token": {"content": "<|endoftext|>"}}))
    out = tmp_path / "out"
    out.mkdir()
    names = write_consumer_files(out, read_manifest(artifact_fp32), find_tokenizer(source, 512))
    assert names == [
        "genai_config.json",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # the user's config, with the model_input_names Optimum's generate needs (it rejects token_type_ids)
    assert _json(out, "tokenizer_config.json") == {
        "pad_token": {"content": "<|endoftext|>"},
        "model_input_names": ["input_ids", "attention_mask"],
    }
    assert _json(out, "genai_config.json")["model"]["pad_token_id"] == 0
    assert _json(out, "config.json")["pad_token_id"] == 0


def test_a_tokenizer_config_naming_another_eos_than_the_models_is_copied_with_a_warning(
    artifact_fp32, tiny_tokenizer, tmp_path, caplog
):
    source = tmp_path / "tok"
    source.mkdir()
    (source / "tokenizer.json").write_bytes((tiny_tokenizer / "tokenizer.json").read_bytes())
    (source / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": {"content": "<|endoftext|>"}})
    )
    out = tmp_path / "out"
    out.mkdir()
    write_consumer_files(out, read_manifest(artifact_fp32), find_tokenizer(source, 512))
    assert _json(out, "tokenizer_config.json")["eos_token"] == {"content": "<|endoftext|>"}  # as the user wrote it
    assert _json(out, "genai_config.json")["model"]["eos_token_id"] == 2
    assert _json(out, "generation_config.json")["eos_token_id"] == 2
    # beside the byte symbols the tests' tokenizer lacks, warned of in a test of its own
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "byte symbols" not in r.msg]
    assert warnings == [
        "tokenizer_config.json names eos_token '<|endoftext|>' (id 0), but the model's eos_token_id "
        "is 2 ('<|im_end|>'): the consumers' configs and our runtime use 2, code reading the "
        "tokenizer's eos_token_id gets 0; name the model's token there if they should agree"
    ]


def test_a_family_without_consumer_types_gets_no_config(artifact_fp32, tmp_path, monkeypatch):
    reason = "no consumer runs this family"
    monkeypatch.setattr(consumers, "consumer_types", lambda manifest: FamilyTypes(None, None, reason, reason))
    assert write_consumer_files(tmp_path, read_manifest(artifact_fp32)) == []
    assert list(tmp_path.iterdir()) == []
    assert optimum_unsupported(read_manifest(artifact_fp32)) == reason


def test_optimum_is_refused_when_head_dim_is_not_hidden_over_heads(artifact_fp32, tmp_path):
    manifest = read_manifest(artifact_fp32)
    manifest = dataclasses.replace(manifest, cache=dataclasses.replace(manifest.cache, head_dim=32))
    assert "Optimum would build a wrong empty cache" in optimum_unsupported(manifest)
    assert write_consumer_files(tmp_path, manifest) == ["genai_config.json"]


def _tokenizer_json(tiny_tokenizer) -> dict:
    return json.loads((tiny_tokenizer / "tokenizer.json").read_text())


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_export(tiny_model, tiny_tokenizer, tmp_path):
    data = _tokenizer_json(tiny_tokenizer)
    data["added_tokens"].append(
        {
            "id": 600,
            "content": "<|extra|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    big = tmp_path / "big"
    big.mkdir()
    (big / "tokenizer.json").write_text(json.dumps(data))
    target = tmp_path / "out"
    with pytest.raises(TokenizerError, match=r"ids in \[0, 600\] \(513 tokens\).*vocab_size is 512"):
        export_artifact(tiny_model, target, tokenizer=big)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]  # nothing written


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "no tokenizer at"),
        ("{not json", "is not a readable JSON file"),
        ('{"model": {"type": "BPE"}}', "has no model.vocab"),
        ("[1, 2]", "holds a JSON array, not a JSON object"),
    ],
)
def test_bad_tokenizers_are_one_line_errors(tmp_path, content, fragment):
    if content is not None:
        (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError, match=fragment) as info:
        find_tokenizer(tmp_path, 512)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "config, fragment",
    [
        # transformers would add each as a new token, with an id past the model's vocabulary
        ({"bos_token": "<s>"}, "bos_token '<s>' is not a token of tokenizer.json"),
        ({"additional_special_tokens": ["<|im_end|>", "<tool>"]}, "additional_special_tokens '<tool>' is not a token"),
        (
            {"added_tokens_decoder": {"900": {"content": "<|im_end|>", "special": True}}},
            r"added_tokens_decoder\[900\] says '<\|im_end\|>', which tokenizer.json holds at id 2",
        ),
        ({"pad_token": 5}, "pad_token is 5, not a token string"),
        # each makes og.Tokenizer fail to load (test_genai.py measures it);
        # a list of chat templates is transformers' own
        ({"chat_template": [{"name": "default", "template": "{{ messages }}"}]}, "chat_template is a JSON array"),
        ({"tokenizer_class": None}, "tokenizer_class is a JSON null"),
        (
            {"model_max_length": "32k"},
            "model_max_length is a JSON string, but onnxruntime-genai reads only a JSON number",
        ),
        ({"clean_up_tokenization_spaces": None}, "clean_up_tokenization_spaces is a JSON null"),
    ],
)
def test_a_tokenizer_config_the_consumers_cannot_load_is_refused(tiny_tokenizer, tmp_path, config, fragment):
    (tmp_path / "tokenizer.json").write_bytes((tiny_tokenizer / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=fragment) as info:
        find_tokenizer(tmp_path, 512)
    assert "\n" not in str(info.value)


def test_a_tokenizer_config_with_the_types_genai_reads_is_accepted(tiny_tokenizer, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny_tokenizer / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages }}", "model_max_length": 1e30, "clean_up_tokenization_spaces": False})
    )
    assert find_tokenizer(tmp_path, 512).config is not None


def test_a_post_processor_adding_ids_past_the_vocabulary_is_refused(tiny_tokenizer, tmp_path):
    """A TemplateProcessing (or BertProcessing...) gives the tokens it adds ids of its own, outside model.vocab."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 900)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert tokenizer.encode("kalo").ids[0] == 900  # what every text would start with
    with pytest.raises(TokenizerError, match=r"ids in \[0, 900\] \(513 tokens\).*vocab_size is 512"):
        find_tokenizer(tmp_path, 512)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert find_tokenizer(tmp_path, 512).max_id == 511


def test_the_minimal_config_names_only_special_tokens(tiny_tokenizer, tmp_path, caplog):
    data = _tokenizer_json(tiny_tokenizer)
    for added in data["added_tokens"]:
        added["special"] = added["content"] != "<|im_end|>"  # the eos id (2) as an ordinary token
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    config = minimal_tokenizer_config(find_tokenizer(tmp_path, 512), 256, 1, 2, 2)
    assert config["bos_token"] == "<|im_start|>" and "eos_token" not in config and "pad_token" not in config
    assert "eos_token id 2 is '<|im_end|>' in this tokenizer, not one of its special tokens" in caplog.text


def test_a_unigram_vocabulary_counts_by_position(tmp_path):
    vocab = [["<unk>", 0.0], *[[f"t{i}", -1.0] for i in range(9)]]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": vocab}}))
    assert find_tokenizer(tmp_path, 10).max_id == 9
    with pytest.raises(TokenizerError, match="vocab_size is 9"):
        find_tokenizer(tmp_path / "tokenizer.json", 9)


def _word_level_tokenizer(folder, size):
    """A WordLevel tokenizer.json of `size` tokens w0, w1, ...: a kind onnxruntime-genai cannot read."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_a_tokenizer_genai_cannot_read_is_copied_with_a_warning(artifact_fp32, tmp_path, caplog):
    source = _word_level_tokenizer(tmp_path / "tok", 300)
    out = tmp_path / "out"
    out.mkdir()
    names = write_consumer_files(out, read_manifest(artifact_fp32), find_tokenizer(source, 512))
    assert "tokenizer.json" in names  # our runtime and Optimum read it as the tokenizers library does
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert (
        "tokenizer.json is a WordLevel model: onnxruntime-genai's og.Tokenizer cannot read it (it fails to "
        "load, encodes other ids or, for WordPiece and WordLevel, may crash); generate with token ids there, or "
        "text with export-onnx generate --prompt" in warnings
    )


def test_a_byte_level_bpe_lacking_byte_symbols_is_copied_with_a_warning(
    artifact_fp32, tiny_tokenizer, tmp_path, caplog
):
    # og.Tokenizer encodes a character needing a missing byte symbol as -1, which the graphs refuse: the tests'
    # tokenizer, trained on ASCII syllables, lacks "H" among 238 others.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path / "out"
    out.mkdir()
    write_consumer_files(out, read_manifest(artifact_fp32), find_tokenizer(tiny_tokenizer, 512))
    assert (
        "tokenizer.json lacks 238 of the 256 byte symbols of a byte-level BPE: onnxruntime-genai's og.Tokenizer "
        "encodes a character needing one as -1, which the graphs refuse; train it with "
        "initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), or generate there with token ids"
    ) in caplog.text
    caplog.clear()
    whole = Tokenizer(models.BPE())
    whole.pre_tokenizer, whole.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    whole.train_from_iterator(
        ["kalo mine ruto"],
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    (tmp_path / "whole").mkdir()
    whole.save(str(tmp_path / "whole" / "tokenizer.json"))
    write_consumer_files(out, read_manifest(artifact_fp32), find_tokenizer(tmp_path / "whole", 512))
    assert "byte symbols" not in caplog.text


def test_genai_stopping_at_a_real_token_of_a_model_without_eos_is_warned_of(
    gpt_artifact, tiny_tokenizer, tmp_path, caplog
):
    without_eos = read_manifest(gpt_artifact)  # the teaching GPT: no EOS, 512 ids
    out = tmp_path / "out"
    out.mkdir()
    tokenizer = find_tokenizer(tiny_tokenizer, 512)  # 512 tokens: the last id, 511, is one of them
    write_consumer_files(out, without_eos, tokenizer)
    assert _json(out, "genai_config.json")["model"]["eos_token_id"] == 511
    assert (
        f"the model has no eos_token_id, so genai_config.json makes onnxruntime-genai stop at the last id, 511, "
        f"but the tokenizer uses it for {tokenizer.tokens[511]!r}: genai would end a text at that token; give "
        "the model an eos_token_id"
    ) in caplog.text
    caplog.clear()
    write_consumer_files(out, without_eos, find_tokenizer(_word_level_tokenizer(tmp_path / "small", 300), 512))
    assert "no eos_token_id" not in caplog.text  # 511 is no token of a 300-token tokenizer: genai never sees it


def test_the_artifact_gets_the_tokenizer_files_as_they_were_checked(tiny_tokenizer, tmp_path):
    # The artifact holds the bytes that were checked, not the file read again after the export's work: an edit
    # meanwhile does not reach it unchecked. A tokenizer.json with CRLF line ends is copied byte for byte.
    source_folder = tmp_path / "tokenizer"
    source_folder.mkdir()
    checked = (tiny_tokenizer / "tokenizer.json").read_bytes().replace(b"\n", b"\r\n")
    (source_folder / "tokenizer.json").write_bytes(checked)
    (source_folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    source = find_tokenizer(source_folder, 512)
    (source_folder / "tokenizer.json").write_text("{}")
    (source_folder / "tokenizer_config.json").write_text('{"chat_template": ["changed since the check"]}')
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    copy_tokenizer(source, artifact, minimal_tokenizer_config(source, 64, 1, 2, 2))
    assert (artifact / "tokenizer.json").read_bytes() == checked
    assert json.loads((artifact / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_a_tokenizer_json_naming_no_model_type_is_read_by_its_kind(tiny_tokenizer, tmp_path):
    # Older files name no model "type"; `tokenizers` loads them, and the export warned "a None model" of a
    # byte-level BPE that onnxruntime-genai reads.
    data = json.loads((tiny_tokenizer / "tokenizer.json").read_text())
    del data["model"]["type"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert find_tokenizer(tmp_path, 512).genai_unreadable == ""


def test_hf_configs_carry_the_models_own_norm_eps_rope_theta_and_special_ids(artifact_fp32, artifact_fp16, tiny_config):
    config = _json(artifact_fp32, "config.json")
    for name in (
        "intermediate_size",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "hidden_act",
        "max_position_embeddings",
    ):
        assert config[name] == getattr(tiny_config, name), name
    assert (config["bos_token_id"], config["eos_token_id"]) == (tiny_config.bos_token_id, tiny_config.eos_token_id)
    generation = _json(artifact_fp32, "generation_config.json")
    assert (
        generation["bos_token_id"],
        generation["eos_token_id"],
        generation["max_length"],
        generation["do_sample"],
    ) == (tiny_config.bos_token_id, tiny_config.eos_token_id, tiny_config.max_position_embeddings, False)
    # Exported without a tokenizer to name a pad token: the pad is the EOS, in every config.
    assert (
        _json(artifact_fp16, "generation_config.json")["pad_token_id"],
        _json(artifact_fp16, "config.json")["pad_token_id"],
        _json(artifact_fp16, "genai_config.json")["model"]["pad_token_id"],
    ) == (2, 2, 2)


@pytest.mark.parametrize(
    "preset, genai_type, hf_type",
    [
        ("minimind-3-tiny", "qwen3", "qwen3"),
        ("minimind2-tiny", "llama", "llama"),
        ("minimind-3-moe-tiny", "decoder", "qwen3"),
        ("minimind2-moe-tiny", "decoder", "llama"),
        ("teaching-gpt-tiny", "decoder", "llama"),
    ],
)
def test_each_family_and_generation_is_typed_and_sized_by_its_own_config(artifact_fp32, preset, genai_type, hf_type):
    config = get_preset(preset)
    manifest = dataclasses.replace(read_manifest(artifact_fp32), config=config)
    sizes = ModelSizes.of(manifest)
    genai, hf = genai_config(manifest, sizes)["model"], hf_config(manifest, sizes)
    assert (genai["type"], hf["model_type"]) == (genai_type, hf_type)
    if preset.startswith("minimind"):  # the generations differ in rms_norm_eps (1e-6 / 1e-5)
        assert (hf["rms_norm_eps"], hf["rope_theta"]) == (config.rms_norm_eps, config.rope_theta)
        assert (genai["bos_token_id"], genai["eos_token_id"]) == (config.bos_token_id, config.eos_token_id)
    else:  # no special tokens: genai stops at the last id, a padding row, and is told of no BOS
        assert genai["eos_token_id"] == config.vocab_size - 1 and "bos_token_id" not in genai
        assert hf["eos_token_id"] is None


def test_a_users_model_input_names_are_kept_and_the_config_beside_a_tokenizer_file_is_read(tiny_tokenizer, tmp_path):
    """--tokenizer may name the tokenizer.json itself: the tokenizer_config.json beside it is the user's all the
    same, and the model_input_names it gives stay as given (the minimal config's fill only a gap)."""
    source = tmp_path / "tok"
    source.mkdir()
    (source / "tokenizer.json").write_bytes((tiny_tokenizer / "tokenizer.json").read_bytes())
    (source / "tokenizer_config.json").write_text(json.dumps({"model_input_names": ["input_ids"]}))
    found = find_tokenizer(source / "tokenizer.json", 512)
    assert found.config == source / "tokenizer_config.json"
    out = tmp_path / "out"
    out.mkdir()
    copy_tokenizer(found, out, minimal_tokenizer_config(found, 64, 1, 2, 2))
    assert _json(out, "tokenizer_config.json") == {"model_input_names": ["input_ids"]}


def test_a_post_processor_adding_ids_past_the_vocabulary_to_pairs_only_is_refused(tiny_tokenizer, tmp_path):
    """A pair template's own tokens are ids a consumer encoding two texts gets: they must fit too."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A <sep> $B:1", special_tokens=[("<sep>", 900)]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert 900 not in tokenizer.encode("kalo").ids and 900 in tokenizer.encode("kalo", "lomi").ids
    with pytest.raises(TokenizerError, match=r"ids in \[0, 900\] \(513 tokens\).*vocab_size is 512"):
        find_tokenizer(tmp_path, 512)
