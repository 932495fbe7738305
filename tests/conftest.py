"""Shared fixtures: tiny seeded models and artifacts exported once per test session.

A dynamo export is the slow step even for a tiny model, so each artifact is
built once and shared; tests that modify an artifact work on a copy. The
float32 artifact carries a tiny tokenizer built here (nothing is downloaded).

The folders mirror the packages: artifact/, export/, runtime/, verify/, cli/ for exporter's layers, and
reference_models/ for reference/ (a folder named reference here, on sys.path as this one is, would shadow the
package as a namespace package in the subprocesses that inherit the path).
"""

from __future__ import annotations

import os

# Under pytest-xdist each worker has a core of its own: PyTorch's pool of one thread per core in every worker (and in
# the commands the tests start, which inherit the environment) would put two threads on each core, whose idle
# threads spin while the other worker's wait. Set before anything imports torch.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import dataclasses
import itertools
import shutil
from pathlib import Path

import onnxruntime as ort
import pytest
from helpers import replayed_export, shared_folder
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from exporter.artifact.quantization import QuantizationSettings
from exporter.export.pipeline import export_artifact
from reference import MiniMindConfig, build_model, get_preset

TINY = "minimind-3-tiny"
TINY_SOURCE = {"kind": "seeded", "preset": TINY, "seed": 0}


# Modules whose module-scoped fixtures are costly (an export, a verification, Optimum's or the builder's run): under
# pytest-xdist each runs whole on one worker, so that those fixtures are built once; every other test goes alone to
# whichever worker is free (pytest_xdist_make_scheduler). Grouped by module because xdist's own xdist_group marks
# reach its scheduler through the node id, which pytest 9 no longer lets a plugin change.
ONE_WORKER_MODULES = (
    "tests/artifact/test_optimum.py",
    "tests/runtime/test_genai.py",
    "tests/runtime/test_node.py",
    "tests/cli/test_base_install.py",
    "tests/cli/test_cli.py",
    "tests/cli/test_hf_folders.py",
    "tests/cli/test_gguf_export.py",
    "tests/cli/test_smollm2.py",
    "tests/tuning/test_search.py",
    "tests/verify/test_foreign.py",
    "tests/verify/test_localise.py",
)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleWhereCostly(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return ModuleWhereCostly(config, log)


@pytest.fixture(scope="session")
def tiny_config():
    return get_preset(TINY)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    return build_model(tiny_config, seed=0)


@pytest.fixture
def cpu_only(monkeypatch):
    """onnxruntime as a build without CUDA, so that the handling of an unavailable provider is tested on any
    machine, a GPU machine included."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])


# MiniMind's special tokens, at MiniMind's ids: <|im_start|> = bos 1, <|im_end|> = eos 2.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE (MiniMind's kind) trained on made-up words; deterministic, reaches 512 tokens exactly.

    Its alphabet is the corpus's ASCII letters rather than all 256 bytes, so any id sequence the seeded
    model emits decodes to valid text (a lone byte of a multi-byte character decodes differently in each
    library). Exports with it therefore warn of the 238 byte symbols it lacks (onnxruntime-genai encodes text
    needing one as -1); the tests give genai text of its own alphabet.
    """
    syllables = ["ka", "lo", "mi", "ne", "ru", "to", "sa", "vi", "de", "po", "gu", "fe"]
    words = ["".join(p) for p in itertools.product(syllables, repeat=2)]
    words += ["".join(p) for p in itertools.product(syllables[:8], repeat=3)]
    corpus = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)] * 3
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    )
    return tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory, tiny_config):
    """A folder holding only tokenizer.json (the export writes tokenizer_config.json), vocab = the model's."""

    def build(folder):  # shared by the workers, as the artifact that records it as its tokenizer's source
        tokenizer = build_tokenizer(tiny_config.vocab_size)
        assert tokenizer.get_vocab_size() == tiny_config.vocab_size
        tokenizer.save(str(folder / "tokenizer.json"))

    return shared_folder(tmp_path_factory, "tokenizer", build)


@pytest.fixture(scope="session")
def artifact_fp32(tmp_path_factory, tiny_model, tiny_tokenizer):
    return _export_once(tmp_path_factory, tiny_model, TINY, TINY_SOURCE, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def artifact_fp16(tmp_path_factory, tiny_model):
    return _export_once(tmp_path_factory, tiny_model, TINY, TINY_SOURCE, dtype="float16")


@pytest.fixture(scope="module")
def runner(artifact_fp32):
    """The fp32 artifact in ONNX Runtime, shared by a module's tests."""
    from exporter.runtime.runner import OrtRunner

    return OrtRunner(artifact_fp32)


@pytest.fixture
def artifact_copy(artifact_fp32, tmp_path):
    """A private copy of the fp32 artifact that a test may damage."""
    return shutil.copytree(artifact_fp32, tmp_path / TINY)


@pytest.fixture(scope="session")
def full(artifact_fp32, tiny_model, tmp_path_factory):
    """One default verification (64 steps, sweep on) with the probe, recording a golden bundle, shared by the engine,
    golden bundle and report tests: none may change it (the report tests alter copies made by dataclasses.replace)."""
    from exporter.verify.engine import verify_artifact
    from exporter.verify.inputs import ParitySettings

    bundle = tmp_path_factory.mktemp("golden")
    report = verify_artifact(
        artifact_fp32,
        tiny_model,
        ["cpu"],
        ParitySettings(probe=True),
        genai=False,
        transformers_js=False,
        golden_save=bundle,
    )
    return report, bundle


# ---------------------------------------------------------------- one export per family / variant
# Each costs one dynamo export (~30-45 s on 2 cores); every test of that family shares it.


def _load_example(name: str):
    """A module from examples/ (not an installed package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def byo_example():
    return _load_example("byo_seed001")


def moe3_yarn_model(dispatch: str):
    """minimind-3 MoE (4 experts, top-1) with YaRN on (original max 16 positions), so that one export proves
    both the MoE graph and rope scaling beyond the original window."""
    import dataclasses

    from reference import YarnScaling

    config = dataclasses.replace(
        get_preset("minimind-3-moe-tiny"),
        moe_implementation=dispatch,
        inference_rope_scaling=True,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16),
    )
    return build_model(config, seed=0)


# Each MoE dispatch is exported without an export more: MiniMind2 MoE with its default (sparse), minimind-3 MoE
# with the dense one in float32 and the sparse one in float16. The sparse float16 graph is the one that must avoid
# the kernels ONNX Runtime's CPU provider lacks for float16 (moe3_artifact_fp16), and the float16 tests' router
# near-ties are those of its weights.


@pytest.fixture(scope="session")
def moe3_model():
    """minimind-3 MoE + YaRN, sparse dispatch: the reference of the float16 export."""
    return moe3_yarn_model("sparse")


@pytest.fixture(scope="session")
def moe3_dense_model():
    """minimind-3 MoE + YaRN, dense dispatch: the reference of the float32 export."""
    return moe3_yarn_model("dense")


def _export_once(tmp_path_factory, model, name: str, source: dict, dtype: str = "float32", tokenizer=None):
    """`model` exported once per run (shared by the workers) to a folder named `name`."""

    def build(root):
        export_artifact(model, root / name, dtype=dtype, source=source, tokenizer=tokenizer)

    return shared_folder(tmp_path_factory, f"{name}-{dtype}", build) / name


# minimind-3-tiny 7 layers deep: traced three layers deep and grown by four clones (exporter/export/layer_template.py)
DEEP_LAYERS = 7


@pytest.fixture(scope="session")
def deep_model(tiny_config):
    return build_model(dataclasses.replace(tiny_config, num_hidden_layers=DEEP_LAYERS), seed=0)


@pytest.fixture(scope="session")
def deep_artifacts(tmp_path_factory, deep_model):
    """{"float32": folder, "int4": folder}: the deep model through the layer template, and quantized from those same
    graphs (block 32, accuracy level 4: the defaults)."""

    def build(root):
        export_artifact(deep_model, root / "float32", source={"kind": "in-memory"})
        with pytest.MonkeyPatch.context() as monkeypatch:
            replayed_export(monkeypatch, root / "float32")
            export_artifact(deep_model, root / "int4", dtype="int4", source={"kind": "in-memory"})

    root = shared_folder(tmp_path_factory, "deep", build)
    return {scheme: root / scheme for scheme in ("float32", "int4")}


@pytest.fixture(scope="session")
def deep_artifact(deep_artifacts):
    return deep_artifacts["float32"]


@pytest.fixture(scope="session")
def deep_int4(deep_artifacts):
    return deep_artifacts["int4"]


@pytest.fixture(scope="session")
def moe3_dense_artifact(tmp_path_factory, moe3_dense_model):
    return _export_once(tmp_path_factory, moe3_dense_model, "minimind-3-moe-yarn-tiny", {"kind": "in-memory"})


@pytest.fixture(scope="session")
def moe3_artifact_fp16(tmp_path_factory, moe3_model):
    """float16 too: ONNX Runtime's CPU provider lacks some float16 kernels (a scatter-add), which the graph must
    not need."""
    name = "minimind-3-moe-yarn-tiny-float16"
    return _export_once(tmp_path_factory, moe3_model, name, {"kind": "in-memory"}, dtype="float16")


@pytest.fixture(scope="session")
def moe2_model():
    """MiniMind2 MoE (4 routed + 1 shared expert, top-2), as the preset builds it: sparse dispatch."""
    return build_model(get_preset("minimind2-moe-tiny"), seed=0)


@pytest.fixture(scope="session")
def moe2_artifact(tmp_path_factory, moe2_model):
    return _export_once(tmp_path_factory, moe2_model, "minimind2-moe-tiny", {"kind": "in-memory"})


# minimind-3 (q/k norms, as Qwen3) at hidden size 256 with one attention head of 256: every norm weight, q_norm's
# and k_norm's included, holds 256 float32 values (1 KiB, INLINE_LIMIT_BYTES in exporter/export/weights.py), so the
# export stores them in the shared weights file, matched by content as real checkpoints' norms are; the tiny
# presets' norms stay inline. Two layers, a vocabulary of 512 and an FFN of 256 keep the export as cheap as theirs.
WIDE = MiniMindConfig(
    hidden_size=256,
    num_attention_heads=1,
    num_key_value_heads=1,
    num_hidden_layers=2,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=64,
)


@pytest.fixture(scope="session")
def wide_model():
    return build_model(WIDE, seed=0)


@pytest.fixture(scope="session")
def wide_artifact(tmp_path_factory, wide_model):
    return _export_once(tmp_path_factory, wide_model, "minimind-3-wide", {"kind": "in-memory"})


# Seed 9260: the consumer check's greedy tokens include 0, where onnxruntime-genai stops by default when a model
# has no EOS (the teaching GPT has none), and later its last id 511, where genai_config.json makes it stop. Few
# seeds give both, in that order.
GPT_SEED = 9260


@pytest.fixture(scope="session")
def gpt_model():
    return build_model(get_preset("teaching-gpt-tiny"), seed=GPT_SEED)


@pytest.fixture(scope="session")
def gpt_artifact(tmp_path_factory, gpt_model):
    source = {"kind": "seeded", "preset": "teaching-gpt-tiny", "seed": GPT_SEED}
    return _export_once(tmp_path_factory, gpt_model, "teaching-gpt-tiny", source)


@pytest.fixture(scope="session")
def byo_adapter(byo_example):
    return byo_example.SeedDemoAdapter(byo_example.demo_model(seed=0))


@pytest.fixture(scope="session")
def byo_artifact(tmp_path_factory, byo_adapter):
    return _export_once(tmp_path_factory, byo_adapter, "seed001-demo", {"kind": "custom", "model": "seed001-demo"})


@pytest.fixture(scope="session")
def minimind2_checkpoint(tmp_path_factory):
    """A MiniMind2 (dense) checkpoint as users hold them: a float16 .pth state dict without a config."""
    import torch

    def build(root):  # shared by the workers: minimind2_artifact's manifest records this path as its source
        model = build_model(get_preset("minimind2-tiny"), seed=0)
        torch.save({k: v.half() for k, v in model.state_dict().items()}, root / "full_sft_64.pth")

    return shared_folder(tmp_path_factory, "ckpt", build) / "full_sft_64.pth"


@pytest.fixture(scope="session")
def minimind2_artifact(tmp_path_factory, minimind2_checkpoint):
    """MiniMind2 dense, exported through the CLI from the float16 .pth with --config for what shapes cannot show."""
    import json

    from click.testing import CliRunner

    from exporter.cli import main

    def build(root):
        config = root / "config.json"
        config.write_text(json.dumps({"num_attention_heads": 4, "max_position_embeddings": 256}))
        args = ["export", "--checkpoint", str(minimind2_checkpoint), "--config", str(config)]
        result = CliRunner().invoke(main, [*args, "-o", str(root / "minimind2-tiny"), "-q", "--json"])
        assert result.exit_code == 0, result.output

    return shared_folder(tmp_path_factory, "minimind2", build) / "minimind2-tiny"


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory):
    """model_type -> a tiny Transformers folder of that type, written by transformers (tests/hf_folders.py)."""
    pytest.importorskip("transformers")
    from hf_folders import MODEL_TYPES, hf_folder

    def build(root):  # shared by the workers: an export records its folder's path as its source
        for model_type in MODEL_TYPES:
            hf_folder(model_type, root / model_type)

    root = shared_folder(tmp_path_factory, "hf", build)
    return {model_type: root / model_type for model_type in MODEL_TYPES}


TRAINED = Path(__file__).resolve().parent / "fixtures" / "minimind-3-stdlib"


@pytest.fixture(scope="session")
def trained_model():
    """The trained fixture (benchmarks/train_fixture.py) as its checkpoint loads: a SourcedModel (model, source)."""
    from reference.source import checkpoint_model

    return checkpoint_model(TRAINED)


@pytest.fixture(scope="session")
def trained_artifacts(tmp_path_factory, trained_model):
    """{"float32", "int8", "int4"}: the trained fixture with its tokenizer, exported once (one dynamo export per
    session) and quantized (block 32) from those same graphs."""
    model, source = trained_model.model, trained_model.source

    def build(root):
        export_artifact(model, root / "float32", dtype="float32", source=source, tokenizer=TRAINED)
        with pytest.MonkeyPatch.context() as monkeypatch:
            replayed_export(monkeypatch, root / "float32")
            for scheme in ("int8", "int4"):
                export_artifact(model, root / scheme, dtype=scheme, source=source, tokenizer=TRAINED)

    root = shared_folder(tmp_path_factory, "trained", build)
    return {scheme: root / scheme for scheme in ("float32", "int8", "int4")}


@pytest.fixture(scope="session")
def quantized(tmp_path_factory, tiny_model, artifact_fp32, tiny_tokenizer):
    """{"int4": folder, "int8": folder, "int4-level4": folder}: the tiny model quantized (block 32), exported once per
    session; "int4-level4" at MatMulNBits' accuracy level 4 (int8 activations on the CPU), the others at 0; "int4"
    carries the tiny tokenizer, the others none."""
    levels = {"int4": 0, "int8": 0, "int4-level4": 4}

    def build(root):
        with pytest.MonkeyPatch.context() as monkeypatch:
            replayed_export(monkeypatch, artifact_fp32)
            for name, level in levels.items():
                scheme = name.partition("-")[0]
                tokenizer = tiny_tokenizer if name == "int4" else None
                export_artifact(
                    tiny_model,
                    root / name / TINY,
                    dtype=scheme,
                    source=TINY_SOURCE,
                    tokenizer=tokenizer,
                    quantization=QuantizationSettings(accuracy_level=level),
                )

    root = shared_folder(tmp_path_factory, "quantized", build)
    return {name: root / name / TINY for name in levels}


@pytest.fixture(scope="session")
def quantized_float16(tmp_path_factory, tiny_model, artifact_fp16):
    """The tiny model at int4 (the defaults: block 32, accuracy level 4) with float16 activations and cache, as for
    CUDA, exported once per session from the float16 artifact's graphs."""

    def build(root):
        with pytest.MonkeyPatch.context() as monkeypatch:
            replayed_export(monkeypatch, artifact_fp16)
            export_artifact(
                tiny_model,
                root / TINY,
                dtype="int4",
                source=TINY_SOURCE,
                quantization=QuantizationSettings(activations="float16"),
            )

    return shared_folder(tmp_path_factory, "quantized-float16", build) / TINY
