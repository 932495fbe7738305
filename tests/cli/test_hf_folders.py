"""export-onnx on Hugging Face folders: export, then verify against the toolkit's reference and transformers'; and
the folders it refuses, each with one line and nothing written."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import pytest
from helpers import assert_one_line_error, edit_graphs, edit_json, replayed_export, run_cli
from onnx import numpy_helper

from exporter import verify_artifact
from exporter.verify.checks.referee import REFEREE_LIMIT

pytest.importorskip("transformers")

# Three exports cover every difference between the types' math (each export costs one dynamo trace):
# qwen3 has the q/k norms, yarn, head_dim 32 != hidden / heads and a tied head; llama the biases of every
# projection and of the MLP, llama3 rope, an untied head and sharded weights; phi3 the fused qkv_proj and
# gate_up_proj and rope over part of each head. qwen2's and mistral's math is a subset of theirs, held to
# transformers in tests/reference_models/test_hf_decoder.py.
EXPORTED = ("qwen3", "llama", "phi3")


@pytest.fixture(scope="module", params=EXPORTED)
def exported(request, hf_folders, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf-export") / request.param
    result = run_cli("export", "--checkpoint", hf_folders[request.param], "-o", folder, "-q")
    assert result.exit_code == 0, result.output
    return request.param, folder


def test_an_exported_folder_verifies_against_the_reference_and_transformers(exported, tmp_path, monkeypatch):
    import weakref

    from exporter.runtime.runner import OrtRunner
    from exporter.verify.references.transformers_reference import TransformersRunner

    # transformers' model is released once its calls are recorded: no ONNX Runtime call sees it alive, so that the
    # mapping ONNX Runtime reads and transformers' copy of the weights are never resident together
    loaded, alive_at_onnx_calls = [], []
    load = TransformersRunner.__init__

    def recording_load(self, *args):
        load(self, *args)
        loaded.append(weakref.ref(self.model))

    def watched(call):
        def run(self, feeds):
            alive_at_onnx_calls.append(any(model() is not None for model in loaded))
            return call(self, feeds)

        return run

    monkeypatch.setattr(TransformersRunner, "__init__", recording_load)
    monkeypatch.setattr(OrtRunner, "prefill", watched(OrtRunner.prefill))
    monkeypatch.setattr(OrtRunner, "decode", watched(OrtRunner.decode))
    model_type, folder = exported
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["model"]["family"] == "hf-decoder"
    assert manifest["model"]["config"]["model_type"] == model_type
    assert manifest["model"]["source"]["kind"] == "checkpoint"
    report = tmp_path / "report.json"
    result = run_cli(
        "verify",
        folder,
        "--decode-steps",
        "2",
        "--no-sweep",
        "--no-genai",
        "--no-transformers-js",
        "--report-json",
        report,
        "-q",
    )
    assert result.exit_code == 0, result.output
    assert len(loaded) == 1 and alive_at_onnx_calls and not any(alive_at_onnx_calls)
    assert "independent reference: ONNX Runtime (CPUExecutionProvider) against transformers" in result.stdout
    assert "independent reference: the pytorch reference against transformers" in result.stdout
    data = json.loads(report.read_text())
    assert data["passed"] and data["reference"] == "pytorch model"
    onnx_side, reference_side = data["independent_references"]
    assert (onnx_side["provider"], reference_side["provider"]) == ("CPUExecutionProvider", None)
    for independent in (onnx_side, reference_side):
        assert independent["reference"].startswith("transformers ") and independent["passed"]
        names = [c["name"] for c in independent["comparisons"]]
        assert names[:3] == ["prefill logits", "prefill present (all layers)", "prefill loss"]
        assert any(name.startswith("decode logits") for name in names)
        assert all(c["max_abs"] <= c["tolerance"]["peak"] or c["passed"] for c in independent["comparisons"])


def test_an_exported_folder_runs_in_onnxruntime_genai_as_its_own_type(exported):
    # The type's registration names its onnxruntime-genai model.type; genai runs the folder as it is, greedy tokens
    # equal to ours (genai leaves out the EOS it stops at)
    pytest.importorskip("onnxruntime_genai")
    from exporter.runtime.genai import genai_greedy, genai_model_type
    from exporter.runtime.generation import generate_greedy
    from exporter.runtime.runner import OrtRunner
    from reference.hf_types import HF_TYPES

    model_type, folder = exported
    assert genai_model_type(folder) == HF_TYPES[model_type].genai
    runner = OrtRunner(folder)
    eos = runner.manifest.config.eos_token_id
    ours = generate_greedy(runner, [200, 201, 202, 203], 16, eos).new_ids
    assert len(set(ours)) > 3, "degenerate output makes token equality meaningless"
    assert genai_greedy(folder, [200, 201, 202, 203], 16) == (ours[:-1] if ours[-1] == eos else ours)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_an_exported_folder_quantizes_and_is_judged_by_its_quality_profile(
    exported, hf_folders, scheme, monkeypatch, tmp_path
):
    # The model type's own float32 graphs (replayed, not exported again) quantized weight-only, generated from, and
    # verified against the float32 reference with the quality profile of the scheme.
    model_type, folder = exported
    replayed_export(monkeypatch, folder)
    out = tmp_path / scheme
    result = run_cli("export", "--checkpoint", hf_folders[model_type], "--dtype", scheme, "-o", out, "-q", "--json")
    assert result.exit_code == 0, result.output
    quantization = json.loads(result.stdout)["quantization"]
    assert (quantization["scheme"], quantization["lm_head"], quantization["embedding"]) == (scheme, "int8", "int8")
    # every projection at the scheme's bits; the head, tied (qwen3's) or not (llama's), and the embedding at 8 bits,
    # the defaults; a tied table is one set of blocks, read by both
    prefill = onnx.load(str(out / "prefill.onnx"), load_external_data=False)
    vocab = json.loads((folder / "manifest.json").read_text())["model"]["config"]["vocab_size"]
    offsets = {t.name: {e.key: e.value for e in t.external_data}.get("offset") for t in prefill.graph.initializer}
    bits, tables = {}, {}
    for node in prefill.graph.node:
        attributes = {a.name: a.i for a in node.attribute}
        if node.op_type == "MatMulNBits":
            role = "head" if attributes["N"] == vocab else "body"
            bits.setdefault(role, set()).add(attributes["bits"])
            tables[role] = offsets[node.input[1]]
        elif node.op_type == "GatherBlockQuantized":
            bits["embedding"], tables["embedding"] = {attributes["bits"]}, offsets[node.input[0]]
    assert bits == {"body": {int(scheme[3:])}, "head": {8}, "embedding": {8}}, bits
    assert (tables["head"] == tables["embedding"]) == (model_type == "qwen3"), tables
    result = run_cli("generate", out, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json")
    assert result.exit_code == 0 and len(json.loads(result.stdout)[0]["new_ids"]) == 4, result.output
    report = tmp_path / "report.json"
    result = run_cli(
        "verify",
        out,
        "--decode-steps",
        "4",
        "--no-sweep",
        "--no-genai",
        "--no-transformers-js",
        "--report-json",
        report,
        "-q",
    )
    data = json.loads(report.read_text())
    [quality] = data["quality"]
    assert result.exit_code == 0 and data["passed"] and quality["scheme"] == scheme, result.output


def _copy(hf_folders, model_type, tmp_path):
    return shutil.copytree(hf_folders[model_type], tmp_path / f"bad-{model_type}")


def _refused(folder, tmp_path, fragment):
    out = tmp_path / "out"
    assert_one_line_error(run_cli("export", "--checkpoint", folder, "-o", out, "-q"), 2, fragment)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [folder.name]


@pytest.mark.parametrize(
    ("replace", "fragment"),
    [
        (lambda path: None, "holds no config.json, which a model folder's sizes are read from"),
        (lambda path: path.symlink_to(path.parent / "gone.json"), "not a readable JSON file (No such file"),
        (lambda path: path.mkdir(), "config.json is not a readable JSON file (Is a directory)"),
        (lambda path: os.mkfifo(path), "config.json is a FIFO"),
    ],
    ids=["deleted", "dangling-link", "folder", "fifo"],
)
def test_a_folder_without_a_usable_config_json_is_refused_not_guessed(hf_folders, tmp_path, replace, fragment):
    # llama's weights fit MiniMind's sizes guessed from the tensors: read without config.json, it exported
    folder = _copy(hf_folders, "llama", tmp_path)
    (folder / "config.json").unlink()
    replace(folder / "config.json")
    _refused(folder, tmp_path, fragment)


def test_a_folder_without_weights_is_refused(hf_folders, tmp_path):
    folder = _copy(hf_folders, "qwen3", tmp_path)
    (folder / "model.safetensors").unlink()
    _refused(folder, tmp_path, "holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def test_a_shard_missing_from_the_index_is_refused(hf_folders, tmp_path):
    folder = _copy(hf_folders, "llama", tmp_path)
    (folder / "model-00002-of-00014.safetensors").unlink()
    _refused(folder, tmp_path, "names 1 shard file(s) missing")


@pytest.mark.parametrize(
    ("model_type", "changes", "fragment"),
    [
        ("llama", {"num_hidden_layers": 3}, "num_hidden_layers is 3 but the checkpoint holds 2"),
        ("qwen3", {"num_hidden_layers": 3}, "layer_types has 2 entries but num_hidden_layers is 3"),
        ("qwen3", {"intermediate_size": 128}, "does not fit the hf-decoder config"),
        ("qwen3", {"model_type": "gemma"}, "model_type 'gemma' is not supported"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
        ("qwen3", {"num_experts": 4}, "num_experts (4) describes a mixture of experts"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ("mistral", {"sliding_window": 1024}, "sliding_window (1024) is shorter than max_position_embeddings (4096)"),
    ],
)
def test_a_config_the_reference_cannot_honour_is_refused(hf_folders, tmp_path, model_type, changes, fragment):
    folder = _copy(hf_folders, model_type, tmp_path)
    edit_json(folder / "config.json", **changes)
    _refused(folder, tmp_path, fragment)


def _plain_rope(graph, scaled: np.ndarray, plain: np.ndarray) -> list[str]:
    """Every initializer of `graph` holding the scaled rotary frequencies replaced by plain rope's; their names."""
    replaced = []
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:  # the frequencies are small: inline
            continue
        values = numpy_helper.to_array(tensor)
        if values.size == scaled.size and np.allclose(values.ravel(), scaled, rtol=1e-6, atol=0):
            tensor.CopyFrom(numpy_helper.from_array(plain.reshape(values.shape).astype(values.dtype), tensor.name))
            replaced.append(tensor.name)
    return replaced


# the exported types whose tiny folder scales its rope (phi3's longrope is refused; its fixture has none)
ROPE_SCALED = ("qwen3", "llama")


@pytest.mark.parametrize("exported", ROPE_SCALED, indirect=True)
def test_a_dropped_rope_scaling_fails_at_long_positions(exported, tmp_path):
    # The rope scaling's frequencies swapped for plain rope's in both graphs: the turns of the low frequencies differ
    # by O(1) only near original_max_position_embeddings, which the long-context check reaches.
    from exporter.artifact.folder import open_artifact
    from exporter.verify.inputs import ParitySettings
    from reference.hf_decoder import rope_inv_freq
    from reference.source import checkpoint_model

    model_type, folder = exported
    folder = shutil.copytree(folder, tmp_path / model_type)
    config = open_artifact(folder).manifest.config
    assert config.rope_scaling is not None, f"the {model_type} fixture scales no rope"
    scaled = rope_inv_freq(config).numpy()
    dim = config.head_dim
    plain = 1.0 / config.rope_theta ** (np.arange(0, dim, 2) / dim)
    replaced = []
    edit_graphs(folder, lambda graph: replaced.extend(_plain_rope(graph, scaled, plain)))
    assert len(replaced) == 2, replaced  # one table in each graph
    model = checkpoint_model(json.loads((folder / "manifest.json").read_text())["model"]["source"]["path"]).model
    settings = ParitySettings(decode_steps=2, greedy_tokens=4, sweep=False)
    report = verify_artifact(folder, model, ["cpu"], settings, genai=False, transformers_js=False)
    cases = report.reports[0].long_context
    crossing = next(case for case in cases if case.why.startswith("original_max_position_embeddings"))
    assert not report.passed and not crossing.passed
    # the cache holds the keys turned by their absolute positions: there the fault is plain, where the logits, which
    # depend on the short distances between a few tokens, move less
    assert crossing.kv.referee is not None and crossing.kv.referee.ratio > 100 * REFEREE_LIMIT
