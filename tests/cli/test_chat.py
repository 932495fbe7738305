"""`export-onnx generate --chat`: a conversation rendered with the artifact's chat template gives the ids
transformers' apply_chat_template gives, the reply ends at the template's end-of-turn token, onnxruntime-genai's
engine renders and answers alike, and what cannot be a chat is refused in one line."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from helpers import assert_one_line_error, edit_manifest, run_cli

from exporter.artifact.chat import chat_messages, chat_prompt_ids, read_chat_template
from exporter.artifact.manifest import file_entries, read_manifest
from exporter.artifact.tokenizer import TOKENIZER_CONFIG, load_tokenizer

# ChatML over the tiny tokenizer's alphabet (its letters and the space; no newline, which it cannot encode), with
# indented block tags: trim_blocks and lstrip_blocks decide which spaces reach the text, and a space is a token.
TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {% if message['role'] == 'system' %}
<|im_start|>sade {{ message['content'] }}<|im_end|>{% elif message['role'] not in ['user', 'assistant'] %}
{{ raise_exception('no role ' + message['role']) }}
    {% else %}
<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|>{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant {% endif %}"""
# The same ChatML on one line, which onnxruntime-genai's own renderer (no trim_blocks or lstrip_blocks) renders alike.
ONE_LINE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}<|im_start|>sade "
    "{{ message['content'] }}<|im_end|>{% else %}<|im_start|>{{ message['role'] }} {{ message['content'] }}"
    "<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
CONVERSATIONS = [
    (["kalo mine"], None),
    (["kalo mine", "ruto savi", "depo gufe"], "sami tone"),
]


def with_chat_template(folder, template: str, **config) -> None:
    """The artifact's tokenizer_config.json given `template` (and `config`'s fields), the manifest re-signed."""
    path = folder / TOKENIZER_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template, **config}))
    edit_manifest(folder, lambda data: data["files"].update(file_entries(folder, [TOKENIZER_CONFIG])))


@pytest.fixture(scope="module")
def chat_artifact(artifact_fp32, tmp_path_factory):
    folder = shutil.copytree(artifact_fp32, tmp_path_factory.mktemp("chat") / "tiny")
    with_chat_template(folder, TEMPLATE)
    return folder


def chat(folder, *options, engine: str = "ort") -> dict:
    result = run_cli("generate", folder, "--engine", engine, "--json", "-q", *options)
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.stdout)
    return row


def chat_options(turns, system) -> list[str]:
    return [option for turn in turns for option in ("--chat", turn)] + (["--system", system] if system else [])


@pytest.mark.parametrize(("turns", "system"), CONVERSATIONS)
def test_a_chat_renders_as_transformers_apply_chat_template(chat_artifact, turns, system):
    transformers = pytest.importorskip("transformers")
    messages = chat_messages(turns, system)
    assert [m["role"] for m in messages] == ["system"] * bool(system) + ["user", "assistant", "user"][: len(turns)]
    reference = transformers.AutoTokenizer.from_pretrained(chat_artifact)
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    manifest = read_manifest(chat_artifact)
    template = read_chat_template(chat_artifact, manifest.files)
    assert template.render(messages) == text
    # trim_blocks and lstrip_blocks leave no line ends or indentation of the template in the text
    assert "\n" not in text and "  " not in text and text.startswith("<|im_start|><|im_start|>")
    assert chat_prompt_ids(load_tokenizer(chat_artifact, manifest.config.vocab_size), text) == list(ids)
    row = chat(chat_artifact, *chat_options(turns, system), "--max-new-tokens", "4")
    assert row["prompt_ids"] == list(ids) and len(row["new_ids"]) == 4


def test_a_reply_ends_at_the_end_of_turn_token_on_both_engines(chat_artifact, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    turns, system = CONVERSATIONS[1]
    options = [*chat_options(turns, system), "--max-new-tokens", "24"]
    free = chat(chat_artifact, *options)
    assert not free["stopped"] and len(set(free["new_ids"])) > 5, "degenerate output makes the stop meaningless"
    # a token the model answers with, made the template's end of turn: tokenizer_config.json's eos_token
    end = free["new_ids"][6]
    folder = shutil.copytree(chat_artifact, tmp_path / "tiny")
    manifest = read_manifest(folder)
    with_chat_template(
        folder, ONE_LINE, eos_token=load_tokenizer(folder, manifest.config.vocab_size).loaded.id_to_token(end)
    )
    assert end != manifest.config.eos_token_id  # the model's own eos is another token
    rows = {engine: chat(folder, *options, engine=engine) for engine in ("ort", "genai")}
    assert rows["ort"]["new_ids"] == free["new_ids"][: free["new_ids"].index(end) + 1]
    assert rows["ort"]["stopped"] is True and rows["ort"]["prompt_ids"] == free["prompt_ids"]
    assert rows["genai"] == {**rows["ort"], "engine": "genai"}  # genai's own rendering, tokenizer and loop
    streamed = run_cli("generate", folder, "--engine", "genai", "-q", *options)
    assert streamed.exit_code == 0 and streamed.stdout == rows["ort"]["text"] + "\n", streamed.output


def test_genai_renders_by_its_own_rules_and_a_difference_is_shown(chat_artifact, caplog):
    pytest.importorskip("onnxruntime_genai")
    from exporter.runtime.genai import GenaiGenerator

    messages = chat_messages(["kalo mine"])
    rendered = read_chat_template(chat_artifact, read_manifest(chat_artifact).files).render(messages)
    GenaiGenerator(chat_artifact).chat_prompt(messages, rendered)
    # genai honours neither trim_blocks and lstrip_blocks nor {%- : the line end after {{ bos_token }} and the
    # indentation of the block tags reach its text
    [warning] = [r.getMessage() for r in caplog.records if "renders the chat template" in r.getMessage()]
    expected = "from character 12, '\\n    \\n<|im_start|>user k' where transformers has '<|im_start|>user kalo mi'"
    assert expected in warning, warning


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["--chat", "kalo", "--prompt", "kalo"], "give exactly one of --prompt-ids, --prompt and --chat"),
        (["--chat", "kalo", "--prompt-ids", "1,2"], "give exactly one of --prompt-ids, --prompt and --chat"),
        (["--chat", "kalo", "--chat", "mine"], "--chat must alternate the user's and the assistant's"),
        (["--prompt", "kalo", "--system", "sade"], "--system opens a --chat conversation"),
        (["--chat", "kalo", "--tokenizer", "tokenizer.json"], "drop --tokenizer"),
        (["--chat", "kalo", "--ignore-eos"], "drop --ignore-eos"),
    ],
)
def test_what_cannot_be_a_chat_is_refused_in_one_line(chat_artifact, options, fragment):
    assert_one_line_error(run_cli("generate", chat_artifact, *options), 2, fragment)


def test_a_model_without_a_chat_template_is_refused_in_one_line(artifact_fp32):
    result = run_cli("generate", artifact_fp32, "--chat", "kalo")
    assert_one_line_error(result, 2, "has no chat template (tokenizer_config.json's chat_template)")


def test_a_template_that_refuses_the_conversation_or_no_jinja2_is_one_line(artifact_copy, monkeypatch):
    with_chat_template(artifact_copy, "{{ raise_exception('roles must alternate user/assistant') }}")
    result = run_cli("generate", artifact_copy, "--chat", "kalo")
    assert_one_line_error(result, 2, "refuses this conversation: roles must alternate user/assistant")
    monkeypatch.setitem(sys.modules, "jinja2", None)  # the base install, which goes without it
    result = run_cli("generate", artifact_copy, "--chat", "kalo")
    assert_one_line_error(result, 2, "rendered with jinja2, which does not import here")
    assert "pip install 'export-onnx[chat]'" in result.stderr
