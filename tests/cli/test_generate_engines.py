"""`export-onnx generate --engine ort|genai`: onnxruntime-genai's loop on the same artifact gives our runtime's
tokens, in the same JSON, and every option it cannot honour is refused in one line before anything loads."""

from __future__ import annotations

import json

import onnxruntime_genai as og
import pytest
from helpers import CONSUMER_PROMPTS, assert_one_line_error, edit_manifest, run_cli

import exporter.runtime.genai as exporter_genai
from exporter.artifact import consumers
from exporter.artifact.consumers import FamilyTypes
from exporter.artifact.manifest import sha256_file
from exporter.runtime.genai import GenaiGenerator
from exporter.runtime.generation import SamplingConfig


def generate(folder, engine: str, *options) -> list[dict]:
    result = run_cli("generate", folder, "--engine", engine, "--json", "-q", *options)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def streamed(folder, engine: str, *options) -> str:
    result = run_cli("generate", folder, "--engine", engine, "-q", *options)
    assert result.exit_code == 0, result.output
    return result.stdout


def without_engine(rows: list[dict]) -> list[dict]:
    return [{key: value for key, value in row.items() if key != "engine"} for row in rows]


@pytest.mark.parametrize("prompt", CONSUMER_PROMPTS)
def test_genai_engine_gives_the_ort_engines_greedy_tokens_in_the_same_json(artifact_fp32, prompt):
    ids = ",".join(map(str, prompt))
    ours = generate(artifact_fp32, "ort", "--prompt-ids", ids, "--max-new-tokens", "40")
    genai = generate(artifact_fp32, "genai", "--prompt-ids", ids, "--max-new-tokens", "40")
    assert [row["engine"] for row in ours] == ["ort"] and [row["engine"] for row in genai] == ["genai"]
    assert without_engine(genai) == without_engine(ours)
    [row] = ours
    assert row["prompt_ids"] == prompt and len(row["new_ids"]) == 40 and row["stopped"] is False
    assert len(set(row["new_ids"])) > 5, "degenerate output makes token equality meaningless"
    # Streamed, one token at a time as genai picks it: the same line.
    assert streamed(artifact_fp32, "genai", "--prompt-ids", ids, "--max-new-tokens", "40") == streamed(
        artifact_fp32, "ort", "--prompt-ids", ids, "--max-new-tokens", "40"
    )


def test_genai_engine_equals_the_default_engine_on_text_and_stop_ids(artifact_fp32):
    text = "kalo mine ruto savi"
    plain = run_cli("generate", artifact_fp32, "--prompt", text, "--max-new-tokens", "12", "--json", "-q")
    assert plain.exit_code == 0, plain.output
    [default] = json.loads(plain.stdout)
    assert default["engine"] == "ort"  # the default engine, named in its JSON
    [genai] = generate(artifact_fp32, "genai", "--prompt", text, "--max-new-tokens", "12")
    assert genai == {**default, "engine": "genai"} and genai["text"]
    assert streamed(artifact_fp32, "genai", "--prompt", text, "--max-new-tokens", "12") == genai["text"] + "\n"
    # A --stop-id ends both where it is first generated, kept in new_ids, and the row says it stopped.
    stop = default["new_ids"][4]
    rows = {
        engine: generate(artifact_fp32, engine, "--prompt", text, "--max-new-tokens", "12", "--stop-id", str(stop))
        for engine in ("ort", "genai")
    }
    assert without_engine(rows["genai"]) == without_engine(rows["ort"])
    [row] = rows["genai"]
    assert row["new_ids"] == default["new_ids"][: default["new_ids"].index(stop) + 1] and row["stopped"] is True


def test_genai_engine_ends_at_the_models_eos_and_keeps_it_as_the_ort_engine_does(artifact_copy):
    # genai leaves its EOS out of the sequence it returns; the engine reports the token genai picked, so that both
    # engines' rows end alike.
    [free] = generate(artifact_copy, "ort", "--prompt-ids", "1,17,230", "--max-new-tokens", "16", "--ignore-eos")
    eos = free["new_ids"][5]  # a token the model emits, made its eos for both engines
    path = artifact_copy / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["eos_token_id"] = eos
    path.write_text(json.dumps(config))

    def relisted(manifest):
        manifest["model"]["config"]["eos_token_id"] = eos
        manifest["files"]["genai_config.json"].update(sha256=sha256_file(path), bytes=path.stat().st_size)

    edit_manifest(artifact_copy, relisted)
    ours = generate(artifact_copy, "ort", "--prompt-ids", "1,17,230", "--max-new-tokens", "16")
    genai = generate(artifact_copy, "genai", "--prompt-ids", "1,17,230", "--max-new-tokens", "16")
    assert without_engine(genai) == without_engine(ours)
    assert genai[0]["new_ids"] == free["new_ids"][: free["new_ids"].index(eos) + 1] and genai[0]["stopped"] is True
    # genai's own sequence, which the engine does not report, lacks it
    assert GenaiGenerator(artifact_copy).greedy([1, 17, 230], 16) == genai[0]["new_ids"][:-1]


def test_genai_engine_samples_with_the_options_given(artifact_fp32):
    """Each sampling option reaches genai's sampler: the command's tokens are those of genai's own Generator with
    the same search options written out, a seed repeats its sample, and top-k 1 is greedy."""
    options = {"temperature": 1.5, "top_k": 0, "top_p": 0.95, "seed": 5}
    flags = [arg for name, value in options.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
    ids = ["--prompt-ids", "1,42,7", "--max-new-tokens", "16"]
    [sampled] = generate(artifact_fp32, "genai", *ids, "--sample", *flags)
    model = GenaiGenerator(artifact_fp32).model
    params = og.GeneratorParams(model)
    # top_k 0 (keep every token) is the whole vocabulary
    params.set_search_options(do_sample=True, temperature=1.5, top_k=512, top_p=0.95, random_seed=5, max_length=19)
    run = og.Generator(model, params)
    run.append_tokens([1, 42, 7])
    expected = []
    while not run.is_done():
        run.generate_next_token()
        expected.append(int(run.get_next_tokens()[0]))
    assert sampled["new_ids"] == expected and len(expected) == 16
    in_python = GenaiGenerator(artifact_fp32).generate([1, 42, 7], 16, SamplingConfig(do_sample=True, **options))
    assert in_python.new_ids == expected
    [again] = generate(artifact_fp32, "genai", *ids, "--sample", *flags)
    assert again == sampled
    others = {tuple(generate(artifact_fp32, "genai", *ids, "--sample", "--seed", str(s))[0]["new_ids"]) for s in (1, 2)}
    [greedy] = generate(artifact_fp32, "genai", *ids)
    assert len(others | {tuple(greedy["new_ids"]), tuple(sampled["new_ids"])}) > 2
    [top1] = generate(artifact_fp32, "genai", *ids, "--sample", "--top-k", "1", "--seed", "9")
    assert top1["new_ids"] == greedy["new_ids"]


def test_genai_engine_honours_threads_and_no_new_tokens(artifact_fp32):
    [threaded] = generate(artifact_fp32, "genai", "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--threads", "1")
    [default] = generate(artifact_fp32, "genai", "--prompt-ids", "5,6,7", "--max-new-tokens", "6")
    assert threaded == default and len(default["new_ids"]) == 6
    [none] = generate(artifact_fp32, "genai", "--prompt-ids", "5,6,7", "--max-new-tokens", "0")
    assert none == {"prompt_ids": [5, 6, 7], "new_ids": [], "stopped": False, "engine": "genai"}


@pytest.mark.parametrize(
    "options, fragment",
    [
        (
            ["--prompt-ids", "5,6", "--prompt-ids", "7"],
            "--engine genai cannot honour a batch (2 prompts): it runs one prompt at a time; give one --prompt-ids "
            "or --prompt, or use --engine ort",
        ),
        (
            ["--prompt-ids", "5,6", "--repetition-penalty", "1.3"],
            "--engine genai cannot honour --repetition-penalty 1.3: it has no penalty held to MiniMind's rule; "
            "drop --repetition-penalty, or use --engine ort",
        ),
        (
            ["--prompt-ids", "5,6", "--ignore-eos"],
            "--engine genai cannot honour --ignore-eos: it always stops at the model's eos; drop --ignore-eos, "
            "or use --engine ort",
        ),
        (
            ["--prompt-ids", "5,6", "--provider", "cuda"],
            "--engine genai cannot honour --provider cuda: it runs on the CPU here; drop --provider, "
            "or use --engine ort",
        ),
        (
            ["--prompt-ids", "5,6", "--prompt-chunk", "8"],
            "--engine genai cannot honour --prompt-chunk: it runs the prompt in one call; drop --prompt-chunk, "
            "or use --engine ort",
        ),
        (
            ["--prompt-ids", "5,6", "--save-optimized", "{tmp}/optimised"],
            "--engine genai cannot honour --save-optimized: it saves no optimised graphs; drop --save-optimized, "
            "or use --engine ort",
        ),
    ],
)
def test_genai_engine_refuses_what_it_cannot_honour_in_one_line_before_loading(
    artifact_fp32, tmp_path, monkeypatch, options, fragment
):
    monkeypatch.setattr(exporter_genai, "GenaiGenerator", lambda *a, **k: pytest.fail("refused only after loading"))
    options = [option.format(tmp=tmp_path) for option in options]
    result = run_cli("generate", artifact_fp32, "--engine", "genai", *options)
    assert_one_line_error(result, 2, fragment)
    under_json = run_cli("generate", artifact_fp32, "--engine", "genai", "--json", *options)
    assert under_json.exit_code == 2 and fragment in json.loads(under_json.stdout)["error"]["message"]
    assert not (tmp_path / "optimised").exists()
    # The same options run with the ort engine (cuda where this machine has it aside).
    if "cuda" not in options:
        assert run_cli("generate", artifact_fp32, *options, "--max-new-tokens", "2", "-q").exit_code == 0


def test_genai_engine_without_onnxruntime_genai_is_refused_naming_the_install(artifact_fp32, monkeypatch):
    monkeypatch.setattr(exporter_genai, "genai_version", lambda: None)
    result = run_cli("generate", artifact_fp32, "--engine", "genai", "--prompt-ids", "5,6")
    assert_one_line_error(
        result,
        2,
        "--engine genai needs onnxruntime-genai, which does not import here; pip install onnxruntime-genai, "
        "or use --engine ort",
    )
    assert run_cli("generate", artifact_fp32, "--prompt-ids", "5,6", "-q").exit_code == 0  # ort needs no genai


def test_genai_engine_on_an_artifact_genai_cannot_run_is_refused_with_the_reason(artifact_copy, monkeypatch):
    with monkeypatch.context() as patch:  # a family onnxruntime-genai cannot run
        patch.setattr(
            consumers, "consumer_types", lambda manifest: FamilyTypes(None, "qwen3", genai_unsupported="reason X")
        )
        result = run_cli("generate", artifact_copy, "--engine", "genai", "--prompt-ids", "5,6")
        assert_one_line_error(result, 2, "cannot run in onnxruntime-genai: reason X; or use --engine ort")
    edit_manifest(artifact_copy, lambda manifest: manifest["files"].pop("genai_config.json"))  # an older export
    result = run_cli("generate", artifact_copy, "--engine", "genai", "--prompt-ids", "5,6")
    assert_one_line_error(result, 2, "has no genai_config.json; re-export it")
    assert "or use --engine ort" in result.stderr


def test_an_unknown_engine_is_a_usage_error(artifact_fp32):
    result = run_cli("generate", artifact_fp32, "--engine", "vllm", "--prompt-ids", "5,6")
    assert_one_line_error(result, 2, "'vllm' is not one of 'ort', 'genai'")


def test_genai_generator_refuses_what_genai_cannot_do_as_our_runtime_does(artifact_fp32):
    from exporter.errors import InputError

    generator = GenaiGenerator(artifact_fp32)
    with pytest.raises(InputError, match=r"`repetition_penalty` 1.3 is applied by our runtime"):
        generator.generate([5, 6], 4, SamplingConfig(repetition_penalty=1.3))
    with pytest.raises(InputError, match="one prompt at a time: give one seed, not 2"):
        generator.stream([5, 6], 4, SamplingConfig(do_sample=True, seed=(1, 2)))
    with pytest.raises(InputError, match=r"stop ids \(`stop_ids`\) \[512\] are not token ids"):
        generator.stream([5, 6], 4, stop_ids=[512])
    assert generator.generate([5, 6], 3, SamplingConfig(do_sample=True, seed=(4,))).new_ids == (
        generator.generate([5, 6], 3, SamplingConfig(do_sample=True, seed=4)).new_ids
    )
