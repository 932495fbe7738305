"""The exported artifact: files, manifest, shared weights, symbolic axes, atomic replacement."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime.capi.onnxruntime_pybind11_state as ort_errors
import pytest
import torch
from helpers import replayed_export

from exporter import TOLERANCES, compare
from exporter.artifact import destination as destination_module
from exporter.artifact.axes import lint_axes
from exporter.artifact.contract import BATCH, PAST, SEQUENCE, TOTAL, GraphContract
from exporter.artifact.manifest import read_manifest, sha256_file
from exporter.artifact.scopes import SCOPES_KEY, module_of
from exporter.errors import ExportFailed, GraphRunError, InputError, OutputPathError, TokenizerError
from exporter.export import checks, graph_passes, tracing
from exporter.export import pipeline as export_module
from exporter.export.pipeline import export_artifact
from exporter.export.weights import INLINE_LIMIT_BYTES
from exporter.runtime import runner as runtime
from exporter.runtime.runner import OrtRunner, presents_as_past
from exporter.runtime.settings import SessionSettings
from exporter.verify.references.torch_runner import TorchRunner
from reference import build_model, get_preset
from reference.minimind import RMSNorm


def _load(folder: Path, name: str) -> onnx.ModelProto:
    return onnx.load(str(folder / name), load_external_data=False)


def _external(model: onnx.ModelProto) -> dict:
    """initializer name -> (location, offset, length) for tensors stored outside the graph."""
    result = {}
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in tensor.external_data}
            result[tensor.name] = (info["location"], int(info["offset"]), int(info["length"]))
    return result


def test_artifact_folder_holds_two_graphs_one_weights_file_and_a_manifest(artifact_fp32):
    names = sorted(p.name for p in artifact_fp32.iterdir())
    assert names == [
        "config.json",
        "decode.onnx",
        "genai_config.json",
        "generation_config.json",
        "manifest.json",
        "prefill.onnx",
        "tokenizer.json",
        "tokenizer_config.json",
        "weights.onnx.data",
    ]
    manifest = json.loads((artifact_fp32 / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(set(names) - {"manifest.json"})
    for name, entry in manifest["files"].items():
        assert sha256_file(artifact_fp32 / name) == entry["sha256"]
    assert set(manifest["versions"]) == {"torch", "onnx", "onnxruntime"}
    assert manifest["opset"] == 20 and manifest["dtype"] == "float32"
    assert manifest["model"]["source"] == {"kind": "seeded", "preset": "minimind-3-tiny", "seed": 0}
    assert manifest["cache"]["axes"] == [BATCH, "num_key_value_heads", "sequence", "head_dim"]


def test_weights_are_stored_once_and_shared_by_both_graphs(artifact_fp32, tiny_model):
    prefill, decode = _external(_load(artifact_fp32, "prefill.onnx")), _external(_load(artifact_fp32, "decode.onnx"))
    assert {loc for loc, _, _ in [*prefill.values(), *decode.values()]} == {"weights.onnx.data"}
    # Every large weight of the decode graph points at bytes the prefill graph also uses.
    assert {(o, n) for _, o, n in decode.values()} == {(o, n) for _, o, n in prefill.values()}
    distinct = {(o, n) for _, o, n in prefill.values()}
    stored = sum(n for _, n in distinct)
    params = sum(p.numel() * 4 for p in tiny_model.parameters() if p.numel() * 4 >= INLINE_LIMIT_BYTES)
    assert stored == params  # the tied embedding/lm_head and every matrix exactly once
    assert (artifact_fp32 / "weights.onnx.data").stat().st_size < stored + 4096 * len(distinct)


@pytest.mark.parametrize("graph", ["prefill.onnx", "decode.onnx"])
def test_nodes_keep_their_module_scopes_and_nothing_of_the_trace(artifact_fp32, graph):
    """Each node keeps the name scopes that place it in its module; the metadata torch.onnx also writes (stack traces
    with this machine's paths, the namespace and class hierarchy that repeat the scopes) is dropped."""
    nodes = _load(artifact_fp32, graph).graph.node
    keys = {p.key for node in nodes for p in node.metadata_props}
    assert SCOPES_KEY in keys
    assert not keys & {
        "pkg.torch.onnx.stack_trace",
        "pkg.torch.onnx.fx_node",
        "namespace",
        "pkg.torch.onnx.class_hierarchy",
    }
    assert "model.layers.1.self_attn.q_proj" in {module_of(node) for node in nodes}


def test_shared_weights_are_matched_by_content_at_page_aligned_offsets(tmp_path):
    """SharedWeightsWriter on two hand-made graphs: the same bytes under other names, or in another shape, are
    stored once, other bytes apart, each at a 4096-byte offset (ONNX Runtime maps them), and every reference reads
    back its own tensor; a tensor under 1 KiB stays inline."""
    from onnx import helper, numpy_helper

    from exporter.export.weights import ALIGNMENT, SharedWeightsWriter

    rng = np.random.default_rng(0)
    shared, other = rng.standard_normal((3, 100)).astype(np.float32), rng.standard_normal(700).astype(np.float32)
    small = np.arange(8, dtype=np.float32)

    def graph(tensors: dict) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(value, name) for name, value in tensors.items()]
        return helper.make_model(helper.make_graph([], "g", [], [], initializer=inits))

    second = {"folded_0": shared, "b.weight": other, "rows": shared.reshape(6, 50)}
    models = [graph({"a.weight": shared, "norm": small}), graph(second)]
    with SharedWeightsWriter(tmp_path, "w.data") as writer:
        for model in models:
            writer.add(model)
    result = writer.result
    assert result.tensors == 2 and [len(table) for table in result.initializers] == [1, 3]
    offsets = {e["name"]: e["offset"] for table in result.initializers for e in table}
    assert offsets["a.weight"] == offsets["folded_0"] == offsets["rows"] != offsets["b.weight"]
    assert all(offset % ALIGNMENT == 0 for offset in offsets.values())
    assert result.bytes == (tmp_path / "w.data").stat().st_size < 2 * ALIGNMENT + other.nbytes
    for model, expected in zip(models, [{"a.weight": shared, "norm": small}, second]):
        onnx.load_external_data_for_model(model, str(tmp_path))
        for tensor in model.graph.initializer:
            np.testing.assert_array_equal(numpy_helper.to_array(tensor), expected[tensor.name])
    assert next(t for t in models[0].graph.initializer if t.name == "norm").data_location == onnx.TensorProto.DEFAULT


@pytest.mark.parametrize("graph", ["prefill.onnx", "decode.onnx"])
def test_every_declared_axis_stays_symbolic(artifact_fp32, graph):
    manifest = read_manifest(artifact_fp32)
    contract = manifest.prefill if graph == "prefill.onnx" else manifest.decode
    model = _load(artifact_fp32, graph)
    assert lint_axes(model, contract) == []
    dims = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*model.graph.input, *model.graph.output]
    }
    if graph == "decode.onnx":
        assert dims["attention_mask"] == [BATCH, TOTAL]
        assert dims["past_key_values.0.key"] == [BATCH, 2, PAST, 16]
        assert dims["present.1.value"] == [BATCH, 2, TOTAL, 16]
    else:
        assert dims["logits"] == [BATCH, SEQUENCE, 512]
        assert dims["loss"] == []


def test_axis_lint_catches_a_baked_dimension(artifact_fp32):
    manifest = read_manifest(artifact_fp32)
    model = _load(artifact_fp32, "decode.onnx")
    dim = model.graph.input[3].type.tensor_type.shape.dim[2]  # past_key_values.0.key, past axis
    dim.dim_value = 4  # what torch.export leaves when an axis is specialised to the example
    problems = lint_axes(model, manifest.decode)
    assert problems == ["decode.onnx: past_key_values.0.key axis 2 (past_sequence_length) was baked to 4"]


def test_axis_lint_names_every_way_a_graph_departs_from_its_contract(artifact_fp32):
    """Each damage a torch.export change could leave, found and named; name_axes renames exporter-chosen
    symbols to the contract's, after which the graph passes."""
    from exporter.artifact.axes import name_axes

    manifest = read_manifest(artifact_fp32)
    original = _load(artifact_fp32, "decode.onnx")

    def problems(damage) -> list[str]:
        model = copy.deepcopy(original)
        values = {v.name: v for v in [*model.graph.input, *model.graph.output]}
        damage(model, {name: v.type.tensor_type.shape.dim for name, v in values.items()}, values)
        return lint_axes(model, manifest.decode)

    def merge(model, dims, values):  # attention_mask's total length and the past length as one symbol
        dims["attention_mask"][1].dim_param = dims["past_key_values.0.key"][2].dim_param

    cases = {
        "rank": (
            lambda m, dims, v: dims["past_key_values.0.key"].pop(),
            "decode.onnx: past_key_values.0.key has rank 3, expected 4",
        ),
        "fixed": (
            lambda m, dims, v: dims["past_key_values.0.key"][1].__setattr__("dim_value", 3),
            "decode.onnx: past_key_values.0.key axis 1 is 3, expected 2",
        ),
        "missing": (
            lambda m, dims, v: m.graph.input.remove(v["past_key_values.0.key"]),
            "decode.onnx: missing past_key_values.0.key",
        ),
        "extra": (
            lambda m, dims, v: m.graph.output.append(
                onnx.helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, [1])
            ),
            "decode.onnx: unexpected input/output extra",
        ),
        "merged": (
            merge,
            f"decode.onnx: past_key_values.0.key axis 2: symbol {PAST!r} stands for both {TOTAL} and {PAST}",
        ),
    }
    for case, (damage, expected) in cases.items():
        assert expected in problems(damage), case
    renamed = copy.deepcopy(original)
    for value in [*renamed.graph.input, *renamed.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == PAST:
                dim.dim_param = "s53"  # a symbol torch.export chose
    assert lint_axes(renamed, manifest.decode) == [f"decode.onnx: axis named 's53', expected {PAST!r}"]
    assert name_axes(renamed, manifest.decode) == [] and lint_axes(renamed, manifest.decode) == []


@pytest.mark.parametrize("artifact", ["artifact_fp32", "artifact_fp16"])
def test_every_graph_value_has_the_dtype_its_manifest_lists(artifact, request):
    """The axis lint checks names and axes, not dtypes: a contract (hence a manifest) listing float32 logits for
    a float16 graph would be read by every consumer that allocates from it."""
    folder = request.getfixturevalue(artifact)
    manifest = read_manifest(folder)
    for contract in (manifest.prefill, manifest.decode):
        model = _load(folder, contract.file)
        found = {
            v.name: onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name
            for v in [*model.graph.input, *model.graph.output]
        }
        assert found == {spec.name: spec.dtype for spec in (*contract.inputs, *contract.outputs)}, contract.file


def test_float16_artifact_has_float16_logits_and_cache(artifact_fp16, artifact_fp32):
    manifest = read_manifest(artifact_fp16)
    model = _load(artifact_fp16, "decode.onnx")
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    assert types["logits"] == types["past_key_values.0.key"] == types["present.0.value"] == onnx.TensorProto.FLOAT16
    assert manifest.dtype == "float16" and manifest.cache.dtype == "float16"
    stored16 = sum(n for _, n in {(o, n) for _, o, n in _external(model).values()})
    stored32 = sum(n for _, n in {(o, n) for _, o, n in _external(_load(artifact_fp32, "decode.onnx")).values()})
    assert stored16 * 2 == stored32


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_onnxruntime_fuses_every_rms_norm(artifact_fp32, artifact_fp16, tiny_model, dtype, tmp_path):
    """torch writes rsqrt as Sqrt then Reciprocal; onnxruntime fuses an RMSNorm only in its division form."""
    folder = artifact_fp32 if dtype == "float32" else artifact_fp16
    norms = sum(isinstance(module, RMSNorm) for module in tiny_model.modules())
    OrtRunner(folder, settings=SessionSettings(optimized_model_dir=tmp_path))  # loading writes both, optimised
    for graph in ("prefill", "decode"):
        assert not [n for n in _load(folder, f"{graph}.onnx").graph.node if n.op_type == "Reciprocal"]
        optimised = Counter(n.op_type for n in _load(tmp_path, f"{graph}.optimized.onnx").graph.node)
        assert optimised["SimplifiedLayerNormalization"] == norms, (graph, optimised)
        assert optimised["Pow"] == optimised["ReduceMean"] == 0, (graph, optimised)


def _tree(folder: Path) -> dict:
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())}


def test_interrupted_export_leaves_the_earlier_artifact_untouched(artifact_copy, tiny_model, monkeypatch):
    before = _tree(artifact_copy)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tracing, "_torch_export", interrupt)  # Ctrl-C during the long torch export
    with pytest.raises(KeyboardInterrupt):
        export_artifact(tiny_model, artifact_copy)
    assert _tree(artifact_copy) == before
    assert [p.name for p in artifact_copy.parent.iterdir()] == [artifact_copy.name]


@pytest.mark.parametrize(
    "failure", [KeyboardInterrupt, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))], ids=["interrupt", "full disk"]
)
def test_a_failed_export_removes_the_parent_folders_it_made(tmp_path, tiny_model, monkeypatch, failure):
    """`-o a/b/c` makes the missing a/b; an export that does not land removes them. Only the folders this export
    made go, and only while empty: one that something else wrote into meanwhile stays."""

    def fail(*args, **kwargs):
        (tmp_path / "kept" / "b" / "other.txt").write_text("written by another program meanwhile")
        raise failure

    monkeypatch.setattr(tracing, "_torch_export", fail)
    (tmp_path / "kept").mkdir()
    with pytest.raises((KeyboardInterrupt, OutputPathError)):
        export_artifact(tiny_model, tmp_path / "kept" / "b" / "c" / "d" / "art")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["kept", "kept/b", "kept/b/other.txt"]


def test_an_interrupt_between_the_two_renames_of_the_swap_puts_the_earlier_artifact_back(tmp_path, monkeypatch):
    folder, built = tmp_path / "art", tmp_path / ".art.partial-x"
    folder.mkdir()
    (folder / "manifest.json").write_text("earlier")
    built.mkdir()
    (built / "manifest.json").write_text("new")
    rename = os.rename

    def rename_then_ctrl_c(source, destination):  # Ctrl-C arriving as the first rename returns
        rename(source, destination)
        monkeypatch.setattr(destination_module.os, "rename", rename)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(destination_module.os, "rename", rename_then_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            destination_module.move_into_place(built, folder)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (folder / "manifest.json").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".art.partial-x", "art"]


@pytest.mark.parametrize("moment", ["before the check", "after the check"])
def test_an_export_overtaken_by_another_to_the_same_folder_says_so_and_keeps_the_others(tmp_path, monkeypatch, moment):
    """Two exports to one folder swapping in at the same moment: the one that loses the race says another export
    overtook it and keeps the other's artifact, not "Directory not empty ... free space" or "No such file or
    directory"."""
    folder, built = tmp_path / "art", tmp_path / ".art.partial-x"
    built.mkdir()
    (built / "manifest.json").write_text("mine")
    if moment == "after the check":  # this one saw the earlier artifact; the other moved it aside, then landed
        folder.mkdir()
        (folder / "manifest.json").write_text("earlier")
    rename = os.rename

    def the_other_lands_first(source, destination):
        monkeypatch.setattr(destination_module.os, "rename", rename)
        if folder.exists():
            shutil.rmtree(folder)  # moved aside by the other's swap, which has not landed yet
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(folder))
        folder.mkdir()
        (folder / "manifest.json").write_text("theirs")
        rename(source, destination)

    monkeypatch.setattr(destination_module.os, "rename", the_other_lands_first)
    with pytest.raises(
        OutputPathError,
        match="another process replaced .* while this export was moving its result there .* this one was not kept",
    ):
        destination_module.move_into_place(built, folder)
    assert not folder.exists() or (folder / "manifest.json").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".art.partial-x"] + (["art"] if folder.exists() else [])


def test_a_second_export_to_the_same_folder_waits_for_the_first_ones_swap(tmp_path, tiny_model, monkeypatch):
    """Two exports to one folder swapping at the same moment: the later now waits for the earlier's swap (a lock
    on the parent folder) and replaces its artifact whole, rather than one of them failing half-way."""
    folder = tmp_path / "art"
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""if True:
        import sys, time
        from pathlib import Path
        from exporter.artifact.paths import folder_lock
        with folder_lock(Path({str(tmp_path)!r})):
            print("swapping", flush=True)
            time.sleep(1)  # the other export's swap, slowed down
            Path({str(folder)!r}).mkdir()
            Path({str(folder / "manifest.json")!r}).write_text("theirs")
        """,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert other.stdout.readline() == "swapping\n"

    def build(model, config, dtype, with_loss, source, tokenizer, built, quantization, trace_all_layers, divisors):
        # written while the other export swaps its folder in
        (built / "manifest.json").write_text("mine")
        return types.SimpleNamespace(files={})

    monkeypatch.setattr(export_module, "_build", build)
    export_artifact(tiny_model, folder)
    assert other.wait() == 0
    assert (folder / "manifest.json").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_export_refuses_a_file_or_a_foreign_folder_as_output(tmp_path, tiny_model):
    target = tmp_path / "taken"
    target.write_text("keep me")
    with pytest.raises(OutputPathError, match="is a file"):
        export_artifact(tiny_model, target)
    assert target.read_text() == "keep me"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(OutputPathError, match="holds no manifest.json"):
        export_artifact(tiny_model, foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_export_refuses_a_folder_under_a_file_before_exporting(tmp_path, tiny_model, monkeypatch):
    """Refused before the export, not by mkdir after it (FileExistsError or NotADirectoryError, deep in the swap)."""
    (tmp_path / "taken").write_text("keep me")
    monkeypatch.setattr(tracing, "_torch_export", lambda *a: pytest.fail("the export ran"))
    with pytest.raises(
        OutputPathError, match=r"lies under .*taken, which is a file; choose another path \(`folder`\)$"
    ):
        export_artifact(tiny_model, tmp_path / "taken" / "sub" / "art")
    assert (tmp_path / "taken").read_text() == "keep me"


def test_export_refuses_a_mount_point_before_exporting(tmp_path, tiny_model, monkeypatch):
    # A mount point cannot be replaced by a rename: an empty tmpfs at the destination is refused before any work, not
    # after a whole export with "cannot replace ... (Device or resource busy)".
    mount = tmp_path / "mnt"
    mount.mkdir()
    monkeypatch.setattr(destination_module.os.path, "ismount", lambda path: Path(path) == mount)
    monkeypatch.setattr(tracing, "_torch_export", lambda *a: pytest.fail("the export ran"))
    with pytest.raises(
        OutputPathError,
        match=r"is a mount point, and the export is built beside its destination "
        r"and then swapped in.*export into a folder inside it",
    ):
        export_artifact(tiny_model, mount)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt"]


def test_a_full_disk_during_the_export_is_a_one_line_error_naming_the_folder(
    artifact_copy, artifact_fp32, tiny_model, monkeypatch
):
    # An input error naming the folder, not an internal error (exit 3) naming no path.
    replayed_export(monkeypatch, artifact_fp32)  # skip the slow torch export: reuse the graphs

    def disk_full(writer, model):  # as a write() fails: no file name in the error
        writer._out.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export_module.SharedWeightsWriter, "add", disk_full)
    before = _tree(artifact_copy)
    with pytest.raises(
        OutputPathError,
        match=rf"^cannot write the export for {re.escape(str(artifact_copy))}: "
        r"No space left on device; .*earlier artifact there is untouched",
    ):
        export_artifact(tiny_model, artifact_copy)
    assert _tree(artifact_copy) == before
    assert [p.name for p in artifact_copy.parent.iterdir()] == [artifact_copy.name], "temporary folder left behind"


def test_a_folder_name_too_long_for_the_hidden_sibling_is_a_one_line_error(tmp_path, tiny_model):
    # A valid 245-character name: its sibling .NAME.partial-XXXXXXXX is not, an output path error, not an internal
    # one.
    folder = tmp_path / ("n" * 245)
    with pytest.raises(
        OutputPathError,
        match=r"cannot write the export for .*n{245}: File name too long \(.*"
        r"\.n{245}\.partial-.*\); .*choose a shorter or other output "
        r"folder \(`folder`\)",
    ):
        export_artifact(tiny_model, folder)
    assert list(tmp_path.iterdir()) == []


def test_export_rejects_an_unknown_dtype(tmp_path, tiny_model):
    # an input error (exit 2), not ExportFailed, which says torch.onnx or a post-export check failed
    with pytest.raises(InputError, match="dtype 'bfloat16' is not supported; choose one of float32, float16"):
        export_artifact(tiny_model, tmp_path / "x", dtype="bfloat16")
    assert not (tmp_path / "x").exists()


def test_export_refuses_positions_its_consumers_cannot_load(tmp_path):
    # onnxruntime-genai reads the context length as a 32-bit integer: a model of 10**12 positions is refused by the
    # export, with the fix, not left to verify's consumer check
    from reference import HFDecoderConfig, build_model

    sizes = dict(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    model = build_model(HFDecoderConfig(**sizes, num_key_value_heads=2, head_dim=8, max_position_embeddings=10**12))
    with pytest.raises(InputError, match=r"max_position_embeddings \(1000000000000\) exceeds 2147483647, the most"):
        export_artifact(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_refuses_arguments_of_the_wrong_type_by_name(tmp_path, tiny_model):
    """Each argument is refused by name with the fix, not left to AttributeError or pathlib's TypeError, nor read
    as true (with_loss="no"); a seed must be an integer (a numpy one included) before anything is built; and
    seeded_model's result passed as the model is told to pass its model and source, not to build one."""
    from reference.source import seeded_model

    for model, kind in ((None, "NoneType"), ("minimind-3-tiny", "str"), (torch.nn.Linear(2, 2), "Linear")):
        with pytest.raises(
            InputError,
            match=f"model must be a reference model or a reference.byo adapter .*, got "
            f"{kind}; build one with reference.source.seeded_model",
        ):
            export_artifact(model, tmp_path / "x")
    with pytest.raises(InputError, match=r"folder must be a path \(str or Path\), got None \(`folder`\)"):
        export_artifact(tiny_model, None)
    with pytest.raises(InputError, match=r"with_loss must be True or False, got 'no' \(str\)"):
        export_artifact(tiny_model, tmp_path / "x", with_loss="no")
    with pytest.raises(TokenizerError, match="a tokenizer is the path .* got 5"):
        export_artifact(tiny_model, tmp_path / "x", tokenizer=5)
    for seed in ("x", 1.5, None, True, np.float64(3), np.bool_(True)):
        with pytest.raises(InputError, match="seed must be an integer, got"):
            seeded_model("minimind-3-tiny", seed)
    sourced = seeded_model("minimind-3-tiny", np.int64(3))
    assert type(sourced.source["seed"]) is int and sourced.source["seed"] == 3  # JSON for the manifest
    with pytest.raises(
        InputError,
        match=re.escape(
            "model is a SourcedModel (what seeded_model and checkpoint_model "
            "return); pass its model and its source: export_artifact("
            "sourced.model, folder, source=sourced.source)"
        ),
    ):
        export_artifact(sourced, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "failure, message",
    [
        (lambda: ExportFailed("smoke run: injected failure"), "injected"),
        # as OrtRunner reports onnxruntime's failures: a kernel this build lacks for the dtype, an index past a table
        (
            lambda: runtime._run_failure(
                "prefill.onnx",
                ort_errors.RuntimeException(
                    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : "
                    "Non-zero status code returned while running ScatterND node: "
                    "MLFloat16 is not supported\nmore"
                ),
            ),
            r"smoke run: onnxruntime could not run the exported graphs "
            r"\(.*ScatterND node: MLFloat16 is not supported\)$",
        ),
        (
            lambda: runtime._run_failure(
                "decode.onnx",
                ort_errors.InvalidArgument(
                    "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : "
                    "Non-zero status code returned while running Gather node"
                ),
            ),
            r"smoke run: onnxruntime could not run the exported graphs \(.*Gather node\)$",
        ),
    ],
    ids=["export error", "onnxruntime runtime exception", "onnxruntime invalid argument"],
)
def test_a_failure_after_the_graphs_are_built_leaves_the_earlier_artifact_untouched(
    artifact_copy, artifact_fp32, tiny_model, monkeypatch, failure, message
):
    """One clear error, the old artifact kept, no temporary folder left."""
    replayed_export(monkeypatch, artifact_fp32)  # skip the slow torch export: reuse the graphs

    def smoke_run(folder, manifest):
        raise failure()

    monkeypatch.setattr(export_module, "smoke_run", smoke_run)
    before = _tree(artifact_copy)
    with pytest.raises(ExportFailed, match=message):
        export_artifact(tiny_model, artifact_copy)
    assert _tree(artifact_copy) == before
    assert [p.name for p in artifact_copy.parent.iterdir()] == [artifact_copy.name], "temporary folder left behind"


@pytest.mark.parametrize(
    "dtype, passes",
    [("float16", True), ("float32", False)],
    ids=["float16 two ulps apart passes", "float32 0.01 apart fails"],
)
def test_the_smoke_run_judges_decode_against_prefill_at_the_dtypes_resolution(
    artifact_fp32, artifact_fp16, monkeypatch, dtype, passes
):
    """Two float16 roundings apart is a correct export (a fixed 1e-3 would fail one); 0.01 in float32 is not."""
    folder = artifact_fp32 if dtype == "float32" else artifact_fp16
    decode = OrtRunner.decode

    def nudged(self, feeds):
        out = decode(self, feeds)
        logits = out["logits"]
        if dtype == "float16":  # two steps of float16's spacing at each value
            out["logits"] = np.nextafter(np.nextafter(logits, np.float16(np.inf)), np.float16(np.inf))
        else:
            out["logits"] = logits + np.float32(0.01)
        return out

    monkeypatch.setattr(OrtRunner, "decode", nudged)
    if passes:
        checks.smoke_run(folder, read_manifest(folder))
    else:
        with pytest.raises(ExportFailed, match="decode with past length 0 disagrees with prefill"):
            checks.smoke_run(folder, read_manifest(folder))


def test_a_graph_is_not_cut_where_it_would_read_an_input_its_contract_lacks(artifact_fp32):
    """Both graphs are cut from one traced program: a kept output computed from an input the graph's contract lacks
    (the loss without labels) is one line naming that input, not a graph that fails to load."""
    prefill = read_manifest(artifact_fp32).prefill
    model = onnx.load(str(artifact_fp32 / prefill.file), load_external_data=False)
    cut = graph_passes.cut(copy.deepcopy(model), prefill)
    assert [o.name for o in cut.graph.output] == list(prefill.output_names)
    assert [i.name for i in cut.graph.input] == list(prefill.input_names)
    inputs = tuple(spec for spec in prefill.inputs if spec.name != "labels")
    without_labels = GraphContract(prefill.file, inputs, prefill.outputs)
    with pytest.raises(ExportFailed, match="prefill.onnx cannot be cut from the traced program: it would read labels$"):
        graph_passes.cut(copy.deepcopy(model), without_labels)


@pytest.mark.parametrize("failure", ["other logits", "refused"])
def test_a_forward_that_treats_an_empty_cache_otherwise_is_refused_before_tracing(tmp_path, monkeypatch, failure):
    """prefill.onnx is the cached program on an empty cache: a forward whose empty cache is not no cache (logits
    shifted by one, far past any tolerance; or an error) would export a prefill.onnx other than its own."""
    model = build_model(get_preset("minimind-3-tiny"))
    forward = type(model).forward

    class EmptyCacheOtherwise(type(model)):
        def forward(self, input_ids, attention_mask=None, past_key_values=None, **kwargs):
            if past_key_values is not None and past_key_values[0][0].shape[1] == 0:
                if failure == "refused":
                    raise ValueError("an empty cache")
                out = forward(self, input_ids, attention_mask=attention_mask, **kwargs)
                out.logits = out.logits + 1
                return out
            return forward(self, input_ids, attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)

    model.__class__ = EmptyCacheOtherwise
    monkeypatch.setattr(tracing, "_torch_export", lambda *args: pytest.fail("traced before the refusal"))
    match = "gives other logits than without a cache" if failure == "other logits" else "failed on an empty cache"
    with pytest.raises(ExportFailed, match=match):
        export_artifact(model, tmp_path / "art")
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize(
    "graph, match",
    [
        ("prefill", r"prefill gave non-finite logits \(NaN or Inf\) for batch 1"),
        ("decode", r"decode gave non-finite logits at position {last}, the last"),
    ],
)
def test_the_smoke_run_refuses_non_finite_logits(artifact_fp32, monkeypatch, graph, match):
    """Weights holding NaN (or a float16 overflow) give NaN logits: the export fails rather than writing them.
    The decode graph gives NaN only at the last position, which the other smoke calls do not reach."""
    manifest = read_manifest(artifact_fp32)
    last = manifest.config.max_position_embeddings - 1
    run = getattr(OrtRunner, graph)

    def broken(self, feeds):
        out = run(self, feeds)
        if graph == "prefill" or feeds["position_ids"].max() == last:
            out["logits"] = np.full_like(out["logits"], np.nan)
        return out

    monkeypatch.setattr(OrtRunner, graph, broken)
    with pytest.raises(ExportFailed, match=match.format(last=last)) as info:
        checks.smoke_run(artifact_fp32, manifest)
    assert "export float32" not in str(info.value)  # it is a float32 export


@pytest.mark.parametrize(
    "dtype, value, match",
    [
        (
            "float32",
            float("nan"),
            "weight model.layers.1.mlp.down_proj.weight holds NaN or Inf, .*; check the checkpoint",
        ),
        ("float32", float("inf"), "weight model.layers.1.mlp.down_proj.weight holds NaN or Inf"),
        (
            "float16",
            1e6,
            r"weight model.layers.1.mlp.down_proj.weight holds values beyond float16's range \(\|x\| > 65504\), "
            r'.*; export float32 \(`dtype="float32"`\)',
        ),
    ],
)
def test_weights_that_are_not_finite_are_refused_before_the_export(
    tiny_model, tmp_path, monkeypatch, dtype, value, match
):
    # Refused before the export, not by the smoke run after both graphs are built; the fix suggests float32 only
    # to a float16 export.
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = value
    monkeypatch.setattr(tracing, "_torch_export", lambda *args: pytest.fail("exported before the refusal"))
    with pytest.raises(InputError, match=match) as info:
        export_artifact(model, tmp_path / "art", dtype=dtype)
    assert dtype == "float16" or "float32" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_holding_nan_is_refused_by_the_cli_before_the_export(tiny_model, tmp_path, monkeypatch):
    from helpers import run_cli

    state = {name: tensor.clone() for name, tensor in tiny_model.state_dict().items()}
    state["model.norm.weight"][3] = float("nan")
    torch.save(state, tmp_path / "nan.pth")
    monkeypatch.setattr(tracing, "_torch_export", lambda *args: pytest.fail("exported before the refusal"))
    result = run_cli(
        "export", "--checkpoint", tmp_path / "nan.pth", "--preset", "minimind-3-tiny", "-o", tmp_path / "a"
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1] == (
        "error: weight model.norm.weight holds NaN or Inf, which every output the graphs compute from it would "
        "hold; check the checkpoint (a diverged training run, or a damaged file)"
    )


def test_the_export_copy_shares_the_callers_weights_only_when_no_conversion_is_needed(tiny_model):
    # torch.export keeps references to what it traced, so weights copied for a float32 export
    # stayed resident beside the caller's (minimind-3-moe: `run` 6.75 GB peak RSS, now 5.97 GB).
    same = tracing.copy_for_export(tiny_model, torch.float32)
    assert same is not tiny_model and same.model is not tiny_model.model
    assert same.model.embed_tokens.weight is tiny_model.model.embed_tokens.weight
    converted = tracing.copy_for_export(tiny_model, torch.float16)
    assert converted.model.embed_tokens.weight.dtype == torch.float16
    assert tiny_model.model.embed_tokens.weight.dtype == torch.float32


def test_exporting_leaves_the_callers_model_as_it_was(tiny_model, tiny_config, artifact_fp32, artifact_fp16):
    # Both session artifacts were exported from tiny_model: float32 on its own tensors, float16 on a copy.
    assert isinstance(tiny_model.lm_head, torch.nn.Linear)  # not rewired by share_tied_table
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight
    fresh = build_model(tiny_config, seed=0).state_dict()
    for name, value in tiny_model.state_dict().items():
        assert value.dtype == fresh[name].dtype and torch.equal(value, fresh[name]), name


def test_an_id_or_label_outside_the_vocabulary_fails_in_both_graphs_as_in_the_reference(runner, tiny_model, capfd):
    # ONNX Gather counts a negative index from the table's end: id -1 gave the logits of id 511 and label -1
    # a finite loss, where the reference raises IndexError. Valid ids and labels keep their results.
    reference = TorchRunner(tiny_model, runner.manifest)
    ids = np.array([[5, 9, 511, 0]])
    labels = np.array([[-1, 9, -100, 511]])  # the first label is no target (the loss shifts), in torch too
    valid = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.arange(4)[None],
        "labels": labels,
    }
    prefill = runner.prefill(valid)
    step = {
        "input_ids": np.array([[511]]),
        "attention_mask": np.ones((1, 5), np.int64),
        "position_ids": np.array([[4]]),
        **presents_as_past(runner.manifest, prefill),
    }
    for graph, feeds, outputs in (("prefill", valid, ("logits", "loss")), ("decode", step, ("logits",))):
        onnx_out, torch_out = getattr(runner, graph)(feeds), getattr(reference, graph)(feeds)
        for name in outputs:
            assert compare(graph, name, onnx_out[name], torch_out[name], TOLERANCES["float32"][name]).passed
    invalid = [
        ("prefill", {**valid, "input_ids": np.array([[5, 9, -1, 0]])}),
        ("prefill", {**valid, "labels": np.array([[-100, 9, -1, 511]])}),
        ("prefill", {**valid, "labels": np.array([[-100, 9, 512, 511]])}),
        ("decode", {**step, "input_ids": np.array([[-1]])}),
    ]
    for graph, feeds in invalid:
        with pytest.raises(IndexError):
            getattr(reference, graph)(feeds)
        with pytest.raises(GraphRunError, match=rf"onnxruntime failed running {graph}.onnx \(.*Gather") as info:
            getattr(runner, graph)(feeds)
        # one line that keeps onnxruntime's reason, which it puts last (after the kernel's C++ signature)
        assert "\n" not in str(info.value) and re.search("out of (range|data bounds)", str(info.value), re.I)
    assert "onnxruntime" not in capfd.readouterr().err  # its own red log copy of each failure is not printed
    # generation's path refuses them before they run, each step too (test_runtime fails a step inside onnxruntime)
    with pytest.raises(InputError, match=r"input_ids \[-1\] lie outside the vocabulary \[0, 512\)"):
        runner.start(np.array([[5, -1]]), np.ones((1, 2), np.int64), np.arange(2)[None])
    runner.start(np.array([[5]]), np.ones((1, 1), np.int64), np.zeros((1, 1), np.int64))
    with pytest.raises(InputError, match=r"input_ids \[512\] lie outside the vocabulary \[0, 512\)"):
        runner.step(np.array([[512]]), np.ones((1, 2), np.int64), np.ones((1, 1), np.int64))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_what_a_killed_export_left_is_cleared_and_the_artifact_it_moved_aside_put_back(tmp_path):
    # SIGKILL or SIGHUP between the swap's two renames leaves the earlier artifact in .art.old-* and no art: the next
    # export to that folder puts it back and clears what the dead one left.
    folder, dead, running = tmp_path / "art", _dead_pid(), os.getpid()
    moved_aside = tmp_path / f".art.old-{dead}-abc" / "art"
    moved_aside.mkdir(parents=True)
    (moved_aside / "manifest.json").write_text("earlier")
    (tmp_path / f".art.partial-{dead}-def").mkdir()
    (tmp_path / f".art.partial-{running}-ghi").mkdir()  # an export still running: not ours to remove
    (tmp_path / f".artx.partial-{dead}-jkl").mkdir()  # beside another destination
    destination_module.clear_interrupted(folder)
    assert (folder / "manifest.json").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f".art.partial-{running}-ghi",
        f".artx.partial-{dead}-jkl",
        "art",
    ]


def _killed_in_the_swap(artifact_fp32, folder: Path) -> Path:
    """What an export killed between the swap's two renames leaves: the earlier artifact (a copy of artifact_fp32)
    moved aside into .NAME.old-PID-*, its own complete build in .NAME.partial-PID-*, and no `folder`."""
    dead = _dead_pid()
    aside = shutil.copytree(artifact_fp32, folder.parent / f".{folder.name}.old-{dead}-abc" / folder.name)
    shutil.copytree(artifact_fp32, folder.parent / f".{folder.name}.partial-{dead}-def")
    return aside


def test_an_export_interrupted_after_a_killed_swap_keeps_the_earlier_artifact(artifact_fp32, tiny_model, tmp_path):
    # The folder made again (empty) after the kill: the next export removed .art.old-* before building, and a
    # Ctrl-C during its build left the folder empty, the only complete copy of the earlier artifact deleted.
    folder = tmp_path / "art"
    _killed_in_the_swap(artifact_fp32, folder)
    folder.mkdir()

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export_module, "_build", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            export_artifact(tiny_model, folder)
    assert read_manifest(folder) == read_manifest(artifact_fp32)  # put back, every hash checked
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_an_earlier_artifact_moved_aside_is_removed_only_once_a_new_one_is_in_place(
    artifact_fp32, tiny_model, tmp_path, monkeypatch
):
    # The folder holds another artifact since the kill: the one moved aside is kept while an export builds, and
    # removed only once that export's artifact is in place.
    folder = tmp_path / "art"
    aside = _killed_in_the_swap(artifact_fp32, folder)
    shutil.copytree(artifact_fp32, folder)
    (folder / "config.json").unlink()  # damaged: the copy moved aside may be the only complete one
    build = export_module._build

    def build_then_check(*args, **kwargs):
        assert read_manifest(aside) == read_manifest(artifact_fp32)  # still there while the new one is built
        return build(*args, **kwargs)

    monkeypatch.setattr(export_module, "_build", build_then_check)
    replayed_export(monkeypatch, artifact_fp32)  # skip the slow torch export: reuse the graphs
    export_artifact(tiny_model, folder)
    read_manifest(folder)
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_an_export_removes_the_build_folder_a_killed_export_left(artifact_copy, artifact_fp32, tiny_model, monkeypatch):
    replayed_export(monkeypatch, artifact_fp32)  # skip the slow torch export: reuse the graphs
    left = artifact_copy.parent / f".{artifact_copy.name}.partial-{_dead_pid()}-x"
    left.mkdir()
    (left / "prefill.onnx").write_bytes(b"half")
    export_artifact(tiny_model, artifact_copy)
    assert [p.name for p in artifact_copy.parent.iterdir()] == [artifact_copy.name]


def test_present_key_and_value_are_the_reference_layers_key_and_value(runner, tiny_model):
    """By name, not by position: present.L.key must hold layer L's keys and .value its values, read straight
    from the reference model. A consumer (onnxruntime-genai, Optimum) reads them by these names; the toolkit's
    own loop feeds present.L.x back as past_key_values.L.x, so names swapped consistently would pass it."""
    ids = np.array([[5, 9, 100, 3]], dtype=np.int64)
    mask, positions = np.ones_like(ids), np.arange(4)[None]
    onnx_out = runner.prefill({"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": ids})
    with torch.no_grad():
        reference = tiny_model(
            torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            position_ids=torch.from_numpy(positions),
            use_cache=True,
        ).past_key_values
    for layer, pair in enumerate(reference):
        for kind, tensor in zip(("key", "value"), pair):
            expected = tensor.transpose(1, 2).numpy()  # (B, L, Hkv, D) -> the contract's (B, Hkv, L, D)
            np.testing.assert_allclose(
                onnx_out[f"present.{layer}.{kind}"], expected, atol=1e-4, err_msg=f"present.{layer}.{kind}"
            )


@pytest.mark.parametrize("graph", ["prefill.onnx", "decode.onnx"])
def test_the_tied_lm_head_reads_the_embedding_table_as_stored(artifact_fp32, graph):
    """lm_head as Gemm(transB=1) on the embedding's own table: exported as MatMul(Transpose(table)), the
    outputs are the same but onnxruntime folds the Transpose into a second, session-private copy of the table
    (20 MB for minimind-3)."""
    model = _load(artifact_fp32, graph)
    initializers = {tensor.name for tensor in model.graph.initializer}
    [table] = {node.input[0] for node in model.graph.node if node.op_type == "Gather" and node.input[0] in initializers}
    users = [node for node in model.graph.node if table in node.input]
    assert sorted(node.op_type for node in users) == ["Gather", "Gemm"], [n.op_type for n in users]
    [gemm] = [node for node in users if node.op_type == "Gemm"]
    assert gemm.input[1] == table and {(a.name, a.i) for a in gemm.attribute} >= {("transB", 1)}


def test_the_reference_runs_in_the_artifacts_dtype_on_a_copy(tiny_model, artifact_fp16, artifact_fp32):
    # A float16 artifact judged against the float32 model would pass its float16 tolerances on the precision
    # alone: the reference must compute in float16 too, and leave the caller's float32 model as it was.
    ids = np.array([[5, 9, 42]])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(3)[None], "labels": ids}
    half = TorchRunner(tiny_model, read_manifest(artifact_fp16, check_hashes=False))
    assert half.model is not tiny_model and next(half.model.parameters()).dtype == torch.float16
    assert next(tiny_model.parameters()).dtype == torch.float32
    out = half.prefill(feeds)
    assert out["logits"].dtype == np.float16 and out["present.0.key"].dtype == np.float16
    same = TorchRunner(tiny_model, read_manifest(artifact_fp32, check_hashes=False))
    assert same.model is tiny_model  # already float32: no copy
    full = same.prefill(feeds)
    assert full["logits"].dtype == np.float32 and not np.array_equal(out["logits"].astype(np.float32), full["logits"])


def test_the_parity_tolerances_are_the_cpu_profiles_per_kind():
    # exporter.parity.TOLERANCES, which the tests judge with: each kind its own bound (the loss's is 100x tighter
    # than the logits' in float32), from the CPU profile of its dtype
    from exporter.runtime.providers import CPU
    from exporter.tolerances.parity import profile_for

    assert set(TOLERANCES) == {"float32", "float16"}
    for dtype, tolerances in TOLERANCES.items():
        profile = profile_for(dtype, CPU)
        assert tolerances == {"logits": profile.logits, "kv": profile.kv, "loss": profile.loss}, dtype
