"""export-onnx export --checkpoint FILE.gguf, on a tiny llama GGUF written here: an hf-decoder artifact whose
manifest records the file, with its tokenizer and chat template; verify's references (the toolkit's, rebuilt from
the file, and transformers', loading it with gguf_file=) read it again. A checkpoint folder's tokenizer comes along
too, and --no-tokenizer / --tokenizer choose otherwise."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import build_tokenizer
from gguf_files import CHAT_TEMPLATE, write_llama_gguf
from helpers import assert_one_line_error, replayed_export, run_cli

from exporter.artifact.manifest import read_manifest, sha256_file

pytest.importorskip("transformers")
pytest.importorskip("gguf")

TINY_LLAMA = dict(attention_bias=False, mlp_bias=False, head_dim=16, rope_scaling=None, max_position_embeddings=256)
PROMPT = [5, 17, 99, 3]


@pytest.fixture(scope="module")
def llama():
    from hf_folders import hf_model

    return hf_model("llama", **TINY_LLAMA)


@pytest.fixture(scope="module")
def exported(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-export")
    path = write_llama_gguf(llama, build_tokenizer(256), root / "tiny.gguf")
    result = run_cli("export", "--checkpoint", path, "-o", root / "artifact", "-q")
    assert result.exit_code == 0, result.output
    return path, root / "artifact"


def test_the_manifest_records_the_gguf_and_verify_rebuilds_its_references(exported, llama):
    from exporter.verify.references.model_source import rebuild_reference, reference_for
    from exporter.verify.references.transformers_reference import TransformersRunner, transformers_skip_reason

    path, folder = exported
    manifest = read_manifest(folder)
    assert manifest.family == "hf-decoder"
    source = manifest.source
    assert (source["kind"], source["path"], source["format"]) == ("checkpoint", str(path.resolve()), "gguf")
    assert source["sha256"] == sha256_file(path)
    assert reference_for(manifest).kind == "rebuilt"
    rebuilt = rebuild_reference(folder, manifest)
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in llama.state_dict().items())
    assert transformers_skip_reason(manifest) == ""
    greedy = TransformersRunner(path, manifest).greedy(PROMPT, 6, None)
    result = run_cli("generate", folder, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["new_ids"] == greedy.ids


def test_the_gguf_tokenizer_and_chat_template_are_in_the_artifact(exported):
    from transformers import AutoTokenizer

    _, folder = exported
    manifest = read_manifest(folder)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest.files)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(folder)  # as Optimum and transformers.js read the folder
    assert loaded.encode("kalo mine") == build_tokenizer(256).encode("kalo mine").ids
    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|user|>hi"
    result = run_cli("generate", folder, "--prompt", "kalo mine", "--max-new-tokens", "3", "--json")
    assert result.exit_code == 0, result.output


def test_a_changed_gguf_is_no_reference_any_more(exported, tmp_path):
    from exporter.verify.references.model_source import rebuild_problem

    path, folder = exported
    copy = tmp_path / "tiny.gguf"
    shutil.copy(path, copy)
    manifest = read_manifest(folder)
    moved = dataclasses.replace(manifest, source={**manifest.source, "path": str(copy)})
    assert rebuild_problem(moved) is None
    with open(copy, "ab") as f:
        f.write(b"\0")
    assert rebuild_problem(moved).detail == "changed since the export"


def _folder_with_tokenizer(llama, folder):
    """The tiny llama as transformers 5 saves a model with its tokenizer: tokenizer.json, a tokenizer_config.json
    naming TokenizersBackend, chat_template.jinja."""
    llama.save_pretrained(folder)
    tokenizer = build_tokenizer(256)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "TokenizersBackend", "eos_token": tokenizer.id_to_token(2)}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def test_a_folders_tokenizer_comes_along_unless_told_otherwise(exported, llama, tmp_path, monkeypatch):
    replayed_export(monkeypatch, exported[1])  # the same model's graphs: no torch export
    checkpoint = _folder_with_tokenizer(llama, tmp_path / "llama")
    assert run_cli("export", "--checkpoint", checkpoint, "-o", tmp_path / "with", "-q").exit_code == 0
    config = json.loads((tmp_path / "with" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE  # chat_template.jinja, moved where every consumer reads it
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # transformers 4 knows no TokenizersBackend
    assert not (tmp_path / "with" / "chat_template.jinja").exists()

    result = run_cli("export", "--checkpoint", checkpoint, "-o", tmp_path / "without", "-q", "--no-tokenizer")
    assert result.exit_code == 0, result.output
    assert "tokenizer.json" not in read_manifest(tmp_path / "without").files

    given = tmp_path / "given"
    given.mkdir()
    shutil.copy(checkpoint / "tokenizer.json", given / "tokenizer.json")
    result = run_cli("export", "--checkpoint", checkpoint, "-o", tmp_path / "given-out", "-q", "--tokenizer", given)
    assert result.exit_code == 0, result.output
    assert "chat_template" not in json.loads((tmp_path / "given-out" / "tokenizer_config.json").read_text())

    both = run_cli("export", "--checkpoint", checkpoint, "--tokenizer", given, "--no-tokenizer")
    assert_one_line_error(both, 2, "--tokenizer or --no-tokenizer")


def test_a_folders_tokenizer_that_does_not_fit_is_refused_in_one_line(llama, tmp_path):
    checkpoint = _folder_with_tokenizer(llama, tmp_path / "llama")
    config = {"eos_token": "no such token"}
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    result = run_cli("export", "--checkpoint", checkpoint, "-o", tmp_path / "out")
    assert_one_line_error(result, 2, "'no such token' is not a token")
