"""onnxruntime-genai loads a freshly exported artifact as it is and generates what we and the reference do."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import onnxruntime_genai as og
import pytest
from click.testing import CliRunner
from helpers import CONSUMER_PROMPTS, edit_manifest, relist_json
from tokenizers import Tokenizer

import exporter.runtime.genai as exporter_genai
from exporter import ParitySettings, verify_artifact
from exporter.artifact import consumers
from exporter.artifact.consumers import MINIMIND_SAMPLING, FamilyTypes
from exporter.artifact.manifest import read_manifest, sha256_file
from exporter.artifact.tokenizer import GENAI_CONFIG_TYPES, find_tokenizer
from exporter.cli import main
from exporter.errors import ArtifactError, ConsumerError
from exporter.runtime.genai import GenaiGenerator, genai_greedy
from exporter.runtime.generation import generate_greedy
from exporter.runtime.runner import OrtRunner
from exporter.tolerances.parity import profile_for
from exporter.verify import consumers as verify_consumers
from exporter.verify import engine
from exporter.verify.checks.greedy import judge_greedy
from exporter.verify.consumers import genai_skip_reason
from exporter.verify.references.torch_runner import TorchRunner, reference_greedy


def without_final_eos(ids: list[int], eos: int) -> list[int]:
    """What onnxruntime-genai returns for a sequence that ended at EOS: the EOS left out."""
    return ids[:-1] if ids and ids[-1] == eos else ids


@pytest.fixture(scope="module")
def generator(artifact_fp32):
    return GenaiGenerator(artifact_fp32)


@pytest.mark.parametrize("prompt", CONSUMER_PROMPTS)
def test_genai_tokens_equal_our_runtime_and_the_reference(artifact_fp32, tiny_model, generator, prompt):
    eos = tiny_model.config.eos_token_id
    genai = generator.greedy(prompt, 40)
    ours = generate_greedy(OrtRunner(artifact_fp32), prompt, 40, eos).new_ids
    reference = reference_greedy(tiny_model, prompt, 40, eos).ids
    assert ours == reference
    assert genai == without_final_eos(reference, eos)
    assert len(genai) == 40 and len(set(genai)) > 5, "degenerate output makes token equality meaningless"
    assert genai_greedy(artifact_fp32, prompt, 40) == genai  # the one-call form, loading the folder anew


def test_genai_samples_as_minimind_when_asked_and_is_greedy_otherwise(artifact_fp32, generator):
    # genai_config.json's search defaults (top_k 1 made do_sample greedy); generation_config.json says the same
    search = json.loads((artifact_fp32 / "genai_config.json").read_text())["search"]
    generation = json.loads((artifact_fp32 / "generation_config.json").read_text())
    assert search["do_sample"] is False and generation["do_sample"] is False
    # MiniMind's eval script samples at temperature 0.85 and top_p 0.85, with transformers' top_k of 50 (README,
    # "Sampling"); written out here, since the configs are built from MINIMIND_SAMPLING itself
    minimind = {"temperature": 0.85, "top_k": 50, "top_p": 0.85}
    assert {k: search[k] for k in minimind} == {k: generation[k] for k in minimind} == MINIMIND_SAMPLING == minimind
    model = og.Model(str(artifact_fp32))

    def sampled(seed):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=True, random_seed=seed, max_length=30)
        run = og.Generator(model, params)
        run.append_tokens([5, 6, 7])
        while not run.is_done():
            run.generate_next_token()
        return tuple(run.get_sequence(0))

    assert len({sampled(seed) for seed in range(4)}) > 1


def test_genai_runs_the_float16_artifact(artifact_fp16, tiny_model):
    manifest = read_manifest(artifact_fp16)
    eos = manifest.config.eos_token_id
    generator = GenaiGenerator(artifact_fp16)
    reference16 = TorchRunner(tiny_model, manifest)
    for prompt in CONSUMER_PROMPTS:
        genai = generator.greedy(prompt, 40)
        assert genai == without_final_eos(generate_greedy(OrtRunner(artifact_fp16), prompt, 40, eos).new_ids, eos)
        # Against the float16 reference with our own greedy rule: identical, or a divergence at a near-tie.
        trace = reference16.greedy(prompt, 40, eos)
        result = judge_greedy(trace, genai, profile_for("float16"), without_final_eos(trace.ids, eos))
        assert result.passed, result.note


def test_genai_stops_at_eos_and_leaves_it_out(artifact_copy, tiny_model):
    """With the EOS set to a token the model emits, genai stops there; our runtime keeps the EOS."""
    prompt = CONSUMER_PROMPTS[0]
    free_run = reference_greedy(tiny_model, prompt, 40, None).ids
    eos = free_run[10]
    stop = free_run.index(eos)
    trace = reference_greedy(tiny_model, prompt, 40, eos)  # the reference keeps the EOS, and stops there
    assert trace.ids == free_run[: stop + 1] and trace.logits.shape == (stop + 1, tiny_model.config.vocab_size)
    assert trace.ids == trace.logits.argmax(-1).tolist()  # each row is the logits its token was chosen from
    # a user's edit, listed as the export would
    relist_json(artifact_copy, "genai_config.json", lambda config: config["model"].update(eos_token_id=eos))
    ours = generate_greedy(OrtRunner(artifact_copy), prompt, 40, eos).new_ids
    assert ours == free_run[: stop + 1] and ours[-1] == eos
    generator = GenaiGenerator(artifact_copy)
    assert generator.greedy(prompt, 40) == free_run[:stop]
    # Without stop_at_eos (the benchmark's fixed-length runs) it never picks the EOS and runs to max_length.
    run = generator.greedy_search(len(prompt) + 40, stop_at_eos=False)
    run.append_tokens(prompt)
    while not run.is_done():
        run.generate_next_token()
    new_ids = [int(token) for token in run.get_sequence(0)[len(prompt) :]]
    assert len(new_ids) == 40 and new_ids[:stop] == free_run[:stop] and eos not in new_ids


def test_text_generation_agrees_across_genai_tokenizers_and_our_cli(artifact_fp32, generator):
    text = "kalo mine ruto savi"
    ours = Tokenizer.from_file(str(artifact_fp32 / "tokenizer.json"))
    genai_tokenizer = og.Tokenizer(generator.model)
    ids = ours.encode(text).ids
    assert [int(i) for i in genai_tokenizer.encode(text)] == ids and len(ids) > 1
    new_ids = generator.greedy(ids, 12)
    assert genai_tokenizer.decode(new_ids) == ours.decode(new_ids)
    result = CliRunner().invoke(
        main, ["generate", str(artifact_fp32), "--prompt", text, "--max-new-tokens", "12", "--json", "-q"]
    )
    assert result.exit_code == 0, result.output
    [data] = json.loads(result.stdout)
    assert data["prompt_ids"] == ids and data["new_ids"] == new_ids
    assert data["text"] == ours.decode(new_ids)


def test_genai_tokenizer_reads_the_config_fields_the_export_checks_with_one_type_only(artifact_copy):
    """GENAI_CONFIG_TYPES is measured: a value of another JSON type (null included) fails og.Tokenizer, though
    og.Model loads; the export refuses such a tokenizer_config.json (test_consumers.py)."""
    path = artifact_copy / "tokenizer_config.json"
    written = json.loads(path.read_text())
    other_type = {"string": 1, "number": "1", "boolean": None}
    for key, json_type in GENAI_CONFIG_TYPES.items():
        for value in (None, other_type[json_type]):
            path.write_text(json.dumps({**written, key: value}))
            model = og.Model(str(artifact_copy))
            with pytest.raises(RuntimeError, match="type must be"):
                og.Tokenizer(model)
    path.write_text(json.dumps({**written, "chat_template": "{{ messages }}", "model_max_length": 1e30}))
    assert list(og.Tokenizer(og.Model(str(artifact_copy))).encode("kalo")) == [48]


# The consumer check does not depend on the decode steps or the sweep.
FAST = ParitySettings(decode_steps=2, sweep=False)


def test_verify_runs_the_genai_check_when_it_can(artifact_fp32, tiny_model):
    report = verify_artifact(artifact_fp32, tiny_model, ["cpu"], FAST, transformers_js=False)
    assert report.passed and report.consumers_skipped == {"transformers.js": "turned off"}
    (consumer,) = report.consumers
    assert consumer.consumer == f"onnxruntime-genai {og.__version__}" and consumer.model_type == "qwen3"
    assert consumer.greedy.passed and consumer.greedy.note == "32 tokens identical"
    assert report.to_dict()["consumers"][0]["passed"] is True


def test_verify_fails_when_genai_generates_other_tokens(artifact_copy, tiny_model, monkeypatch):
    class Wrong(GenaiGenerator):
        def greedy(self, prompt_ids, max_new_tokens):
            tokens = super().greedy(prompt_ids, max_new_tokens)
            return tokens[:5] + [(tokens[5] + 1) % 512] + tokens[6:]

    monkeypatch.setattr(verify_consumers, "GenaiGenerator", Wrong)
    report = verify_artifact(artifact_copy, tiny_model, ["cpu"], FAST, transformers_js=False)
    assert all(r.passed for r in report.reports) and not report.passed
    assert report.consumers[0].greedy.match_length == 5 and "not a tie" in report.consumers[0].greedy.note


def test_verify_reports_why_the_genai_check_did_not_run(artifact_copy, tiny_model, monkeypatch):
    off = verify_artifact(artifact_copy, tiny_model, ["cpu"], FAST, genai=False, transformers_js=False)
    assert off.consumers_skipped == {"onnxruntime-genai": "turned off", "transformers.js": "turned off"}
    assert not off.consumers
    with monkeypatch.context() as patch:  # a family onnxruntime-genai cannot run
        patch.setattr(
            consumers, "consumer_types", lambda manifest: FamilyTypes(None, "qwen3", genai_unsupported="reason X")
        )
        report = verify_artifact(artifact_copy, tiny_model, ["cpu"], FAST, transformers_js=False)
        assert report.consumers_skipped["onnxruntime-genai"] == "reason X"
        with pytest.raises(ConsumerError, match="cannot run in onnxruntime-genai: reason X"):
            GenaiGenerator(artifact_copy)
    monkeypatch.setattr(verify_consumers, "genai_version", lambda: None)
    report = verify_artifact(artifact_copy, tiny_model, ["cpu"], FAST, transformers_js=False)
    assert report.passed and "pip install onnxruntime-genai" in report.consumers_skipped["onnxruntime-genai"]
    monkeypatch.setattr(engine, "OrtRunner", lambda *args, **kwargs: pytest.fail("refused only after work began"))
    with pytest.raises(ConsumerError, match="not installed"):
        verify_artifact(artifact_copy, tiny_model, ["cpu"], FAST, genai=True)


def test_an_edited_genai_config_is_refused_by_its_hash(artifact_copy):
    config = json.loads((artifact_copy / "genai_config.json").read_text())
    config["search"]["max_length"] = 7
    (artifact_copy / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="genai_config.json"):
        GenaiGenerator(artifact_copy)


@pytest.mark.parametrize(
    ("name", "change", "difference"),
    [
        (
            "genai_config.json",
            lambda c: c["model"].update(eos_token_id=5),
            "genai_config.json: model.eos_token_id is 5, the manifest's config gives 2",
        ),
        (
            "genai_config.json",
            lambda c: c["model"]["decoder"].pop("num_key_value_heads"),
            "model.decoder.num_key_value_heads is absent, the manifest's config gives 2",
        ),
        (
            "config.json",
            lambda c: c.update(num_hidden_layers=3),
            "num_hidden_layers is 3, the manifest's config gives 2",
        ),
        ("generation_config.json", lambda c: c.update(eos_token_id=2.0), "eos_token_id is 2.0, the manifest's config"),
        ("generation_config.json", lambda c: c.update(pad_token_id=512), "pad_token_id is 512, the manifest's"),
    ],
)
def test_a_consumer_config_giving_other_ids_or_sizes_is_damage_though_listed_again(
    artifact_copy, tiny_model, name, change, difference
):
    # genai_config.json with eos_token_id 5 (the model's is 2), its hash listed again in the manifest, passed
    # verify: onnxruntime-genai then stopped at another token than the model's, which the graphs' checks cannot see.
    relist_json(artifact_copy, name, change)
    with pytest.raises(ArtifactError, match=re.escape(difference)):
        verify_artifact(artifact_copy, tiny_model, ["cpu"], FAST, genai=False, transformers_js=False)
    result = CliRunner().invoke(main, ["verify", str(artifact_copy), "--no-genai", "--no-transformers-js", "-q"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "disagree with its manifest" in result.stderr and difference in result.stderr
    result = CliRunner().invoke(main, ["inspect", str(artifact_copy), "--json"])
    assert result.exit_code == 2 and difference.split(": ")[-1] in json.loads(result.stdout)["file_status"][name]


def test_a_folder_without_genai_config_is_a_clear_error(artifact_copy, tmp_path):
    old = shutil.copytree(artifact_copy, tmp_path / "old")
    (old / "genai_config.json").unlink()
    edit_manifest(old, lambda manifest: manifest["files"].pop("genai_config.json"))  # as an earlier toolkit wrote it
    with pytest.raises(ConsumerError, match="has no genai_config.json; re-export"):
        GenaiGenerator(old)
    result = CliRunner().invoke(main, ["verify", str(old), "--provider", "cpu", "--genai", "-q"])
    assert result.exit_code == 2 and "genai_config.json" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _trained(model, pre_tokenizer, decoder, trainer):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizer, decoder
    words = [a + b for a in ("ka", "lo", "mi", "ne") for b in ("ru", "to", "sa", "vi")]
    tokenizer.train_from_iterator([" ".join(words)] * 3, trainer)
    return tokenizer


def _tokenizer_kinds():
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>"], show_progress=False)
    return {
        "byte-level BPE": _trained(
            models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), bpe
        ),
        "BPE over Whitespace": _trained(models.BPE(unk_token="<unk>"), pre_tokenizers.Whitespace(), None, bpe),
        "BPE over Metaspace": _trained(
            models.BPE(unk_token="<unk>"), pre_tokenizers.Metaspace(), decoders.Metaspace(), bpe
        ),
        "WordPiece": _trained(
            models.WordPiece(unk_token="<unk>"),
            pre_tokenizers.Whitespace(),
            decoders.WordPiece(),
            trainers.WordPieceTrainer(vocab_size=100, special_tokens=["<unk>"], show_progress=False),
        ),
        "Unigram": _trained(
            models.Unigram(),
            pre_tokenizers.Metaspace(),
            decoders.Metaspace(),
            trainers.UnigramTrainer(vocab_size=60, special_tokens=["<unk>"], unk_token="<unk>", show_progress=False),
        ),
        "WordLevel": _trained(
            models.WordLevel(unk_token="<unk>"),
            pre_tokenizers.Whitespace(),
            None,
            trainers.WordLevelTrainer(special_tokens=["<unk>"], show_progress=False),
        ),
    }


# genai's loader reads memory it never wrote for some of these kinds: its error quotes a line of garbage
# ("Cannot know how to parse line: 8027948229128645729"), the same file loads on another try, and one CI run
# died of a segmentation fault inside og.Tokenizer. So each read happens in a process of its own.
_GENAI_READ = """
import json, sys
import onnxruntime_genai as og
folder, text, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
try:
    tokenizer = og.Tokenizer(og.Model(folder))
except RuntimeError:
    sys.exit(3)
print(json.dumps([[int(i) for i in tokenizer.encode(text)], tokenizer.decode(ids)]))
"""


def _genai_reads_alike(folder, tokenizer: Tokenizer, text: str) -> bool:
    """Whether og.Tokenizer encodes `text` and decodes its ids as `tokenizers` does; failing to load, or
    crashing, is reading it otherwise."""
    ids = tokenizer.encode(text).ids
    child = subprocess.run(
        [sys.executable, "-c", _GENAI_READ, str(folder), text, json.dumps(ids)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return child.returncode == 0 and json.loads(child.stdout) == [ids, tokenizer.decode(ids)]


@pytest.mark.parametrize(
    "kind", ["byte-level BPE", "BPE over Whitespace", "BPE over Metaspace", "WordPiece", "Unigram", "WordLevel"]
)
def test_the_tokenizer_kinds_the_export_warns_of_are_those_genai_misreads(artifact_copy, kind):
    """The export's warning (tokenizer.genai_unreadable) is measured: og.Tokenizer fails to load every kind it
    names, or encodes other ids than the tokenizers library; the kind it does not name reads alike."""
    tokenizer = _tokenizer_kinds()[kind]
    tokenizer.save(str(artifact_copy / "tokenizer.json"))
    (artifact_copy / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    warned = find_tokenizer(artifact_copy, 512).genai_unreadable
    assert _genai_reads_alike(artifact_copy, tokenizer, "kalo mine ruto") == (warned == ""), (kind, warned)


def test_the_missing_byte_symbols_the_export_warns_of_are_encoded_as_minus_one_by_genai(artifact_copy):
    """The export's warning (tokenizer.missing_byte_symbols) is measured: genai encodes "H", which the tests'
    tokenizer lacks, as -1; with all 256 byte symbols it encodes the text as `tokenizers` does."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    assert find_tokenizer(artifact_copy, 512).missing_byte_symbols > 0
    assert -1 in list(og.Tokenizer(og.Model(str(artifact_copy))).encode("Hkalo"))
    whole = _trained(
        models.BPE(),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    whole.save(str(artifact_copy / "tokenizer.json"))
    (artifact_copy / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    assert find_tokenizer(artifact_copy, 512).missing_byte_symbols == 0
    assert [int(i) for i in og.Tokenizer(og.Model(str(artifact_copy))).encode("Hkalo")] == whole.encode("Hkalo").ids


def test_verify_checks_the_listed_genai_config_before_any_work(artifact_copy, tiny_model, monkeypatch):
    # Both are refused before any check runs, not after every check in GenaiGenerator (the verdict lost, or an
    # internal JSONDecodeError).
    monkeypatch.setattr(engine, "OrtRunner", lambda *args, **kwargs: pytest.fail("refused only after work began"))
    path = artifact_copy / "genai_config.json"
    edit_manifest(artifact_copy, lambda manifest: manifest["files"].pop("genai_config.json"))
    assert path.is_file()
    with pytest.raises(ConsumerError, match="manifest lists no genai_config.json"):
        verify_artifact(artifact_copy, tiny_model, ["cpu"], FAST, genai=True)
    assert genai_skip_reason(artifact_copy, read_manifest(artifact_copy)).startswith(
        "the folder's manifest lists no genai_config.json"
    )  # what a run without --genai reports, then passes
    path.write_text('{"model": ')
    edit_manifest(
        artifact_copy,
        lambda manifest: manifest["files"].update(
            {"genai_config.json": {"sha256": sha256_file(path), "bytes": path.stat().st_size}}
        ),
    )
    with pytest.raises(ArtifactError, match=r"genai_config.json is not onnxruntime-genai's config \(JSONDecodeError"):
        verify_artifact(artifact_copy, tiny_model, ["cpu"], FAST)
    result = CliRunner().invoke(main, ["verify", str(artifact_copy), "--provider", "cpu", "-q"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "undo the edit or re-export the folder" in result.stderr
    with pytest.raises(ArtifactError, match="JSONDecodeError"):
        GenaiGenerator(artifact_copy)


@pytest.mark.parametrize(
    "text, error", [('{"model": {}}', "KeyError"), ('["model"]', "TypeError"), ('{"model": "qwen3"}', "TypeError")]
)
def test_a_genai_config_that_names_no_model_type_is_one_artifact_error(tmp_path, text, error):
    # JSON, but without model.type: one ArtifactError, as for malformed JSON, not a KeyError or TypeError
    (tmp_path / "genai_config.json").write_text(text)
    with pytest.raises(ArtifactError, match=rf"genai_config.json is not onnxruntime-genai's config \({error}") as info:
        exporter_genai.genai_model_type(tmp_path)
    assert "\n" not in str(info.value) and "undo the edit or re-export the folder" in str(info.value)


def test_a_thread_count_reaches_genai_as_an_overlay_and_the_cpu_is_the_only_provider(artifact_fp32, monkeypatch):
    # The count only changes speed, so the tokens cannot show it: record what the generator asks of genai's Config.
    calls = []

    class Config:
        def __init__(self, path):
            self.real = og.Config(path)

        def clear_providers(self):
            calls.append("clear_providers")
            self.real.clear_providers()

        def overlay(self, text):
            calls.append(json.loads(text))
            self.real.overlay(text)

    recording = SimpleNamespace(
        Config=Config,
        Model=lambda config: og.Model(config.real),
        GeneratorParams=og.GeneratorParams,
        Generator=og.Generator,
    )
    monkeypatch.setattr(exporter_genai, "_import_genai", lambda: recording)
    threaded = GenaiGenerator(artifact_fp32, threads=1)
    assert calls == ["clear_providers", {"model": {"decoder": {"session_options": {"intra_op_num_threads": 1}}}}]
    calls.clear()
    default = GenaiGenerator(artifact_fp32)  # 0: genai_config.json's own count, no overlay
    assert calls == ["clear_providers"]
    assert threaded.greedy([5, 6, 7], 4) == default.greedy([5, 6, 7], 4) and len(default.greedy([5, 6, 7], 4)) == 4


def test_no_new_tokens_asked_is_no_tokens(generator):
    assert generator.greedy([5, 6, 7], 0) == []
    assert len(generator.greedy([5, 6, 7], 1)) == 1
