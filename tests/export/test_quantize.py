"""--dtype int4 / int8: weight-only quantization of the exported graphs: MatMulNBits projections and lm_head (tied
or not), the token embedding as GatherBlockQuantized, both graphs sharing one weights file."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import TINY_SOURCE
from helpers import (
    CONSUMER_PROMPTS,
    config_entry,
    edit_initializers,
    edit_manifest,
    quantized_blocks,
    read_initializer,
    replayed_export,
    shared_folder,
)
from onnx import helper, numpy_helper

from exporter.artifact.folder import Artifact
from exporter.artifact.quantization import (
    QUANTIZED_OPS,
    ModulePrecision,
    QuantizationSettings,
    block_inputs,
    zero_point_fractions,
)
from exporter.artifact.scopes import module_of
from exporter.errors import ArtifactError, GraphRunError, InputError
from exporter.export.pipeline import export_artifact
from exporter.runtime.genai import genai_greedy
from exporter.runtime.generation import generate_greedy
from exporter.runtime.runner import OrtRunner
from exporter.verify.checks.invariants import identical_weights

EPS = float(np.finfo(np.float32).eps)
# int4 exports of the tiny (tied) model under other lm_head / embedding choices than the defaults (int8, int8)
CHOICES = {"same": ("same", "same"), "split": ("int8", "same"), "float": ("float", "float")}


@pytest.fixture(scope="session")
def choices(tmp_path_factory, tiny_model, artifact_fp32):
    """{name: folder} of CHOICES, and "default": the int4 export with the default choices."""

    def build(root):
        with pytest.MonkeyPatch.context() as monkeypatch:
            replayed_export(monkeypatch, artifact_fp32)
            for name, (lm_head, embedding) in CHOICES.items():
                export_artifact(
                    tiny_model,
                    root / name,
                    dtype="int4",
                    source=TINY_SOURCE,
                    quantization=QuantizationSettings(lm_head=lm_head, embedding=embedding),
                )

    root = shared_folder(tmp_path_factory, "quantized-choices", build)
    return {name: root / name for name in CHOICES}


def _folder(name, quantized, choices):
    return quantized["int4"] if name == "default" else choices[name]


def _attributes(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _quantized_nodes(folder, graph="prefill.onnx"):
    """(op type, bits, rows) of each quantized node: rows N of a MatMulNBits node, the table's rows of a
    GatherBlockQuantized node."""
    model = onnx.load(str(folder / graph), load_external_data=False)
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    found = []
    for node in model.graph.node:
        attributes = _attributes(node)
        if node.op_type == "MatMulNBits":
            found.append(("MatMulNBits", attributes["bits"], attributes["N"]))
        elif node.op_type == "GatherBlockQuantized":
            found.append(("GatherBlockQuantized", attributes["bits"], dims[node.input[0]][0]))
    return sorted(found)


def _block_bytes(k: int, n: int, bits: int, block: int = 32, scale_bytes: int = 4) -> int:
    """Bytes of a (K, N) weight in MatMulNBits' layout (onnxruntime's contrib operator spec): N x ceil(K / block)
    blocks of block x bits / 8 bytes, a scale per block (float32, or float16 in a float16 graph), and the blocks'
    zero points packed per row."""
    blocks = math.ceil(k / block)
    return n * blocks * block * bits // 8 + n * blocks * scale_bytes + n * math.ceil(blocks * bits / 8)


def _projections(model) -> list[tuple[int, int]]:
    """(in, out) of every Linear inside the decoder layers (the lm_head is not one of them)."""
    return [
        tuple(m.weight.shape[::-1])
        for name, m in model.named_modules()
        if name.startswith("model.layers.") and hasattr(m, "weight") and m.weight.ndim == 2
    ]


def _held(folder) -> tuple[int, list]:
    """Bytes of the distinct tensors (by content) that both graphs' quantized nodes read: blocks, scales and zero
    points; and the shapes of every float (vocabulary, hidden) table or transposed copy left in either graph."""
    contents, tables = {}, []
    for graph in ("prefill.onnx", "decode.onnx"):
        model = onnx.load(str(folder / graph))
        arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
                held = node.input[1:4] if node.op_type == "MatMulNBits" else [node.input[0], *node.input[2:4]]
                contents.update({arrays[name].tobytes(): arrays[name].nbytes for name in held if name})
        tables += [a.shape for a in arrays.values() if a.dtype.kind == "f" and a.shape in ((512, 64), (64, 512))]
    return sum(contents.values()), tables


# ----------------------------------------------------------------------------- what the graphs hold


@pytest.mark.parametrize(("scheme", "bits", "block"), [("int4", 4, 32), ("int8", 8, 16)])
def test_default_export_quantizes_projections_lm_head_and_embedding_once(quantized, tiny_model, scheme, bits, block):
    folder = quantized[scheme]
    manifest = json.loads((folder / "manifest.json").read_text())
    q = manifest["quantization"]
    assert manifest["dtype"] == "float32" and manifest["cache"]["dtype"] == "float32"
    assert (q["scheme"], q["bits"], q["block_size"], q["lm_head"], q["embedding"]) == (
        scheme,
        bits,
        block,
        "int8",
        "int8",
    )
    vocab, hidden = tiny_model.model.embed_tokens.weight.shape
    projections = _projections(tiny_model)
    assert len(projections) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    # the tied table is the lm_head's 8-bit MatMulNBits and the embedding's 8-bit GatherBlockQuantized, stored once
    expected = sorted(
        [("MatMulNBits", bits, n) for _, n in projections]
        + [("MatMulNBits", 8, vocab), ("GatherBlockQuantized", 8, vocab)]
    )
    assert _quantized_nodes(folder) == _quantized_nodes(folder, "decode.onnx") == expected
    table = _block_bytes(hidden, vocab, 8, block)
    assert q["quantized_bytes"] == sum(_block_bytes(k, n, bits, block) for k, n in projections) + table
    assert q["float_bytes"] == 4 * (sum(k * n for k, n in projections) + vocab * hidden)
    assert q["matrices"] == 15 and q["kept_float"] == []
    assert _held(folder) == (q["quantized_bytes"], [])  # the tied table once, and no float copy of it left
    assert identical_weights(Artifact.open(folder)).passed


def test_float16_activations_keep_the_scales_the_cache_and_the_logits_in_float16(quantized_float16, tiny_model):
    folder = quantized_float16
    manifest = json.loads((folder / "manifest.json").read_text())
    q = manifest["quantization"]
    assert manifest["dtype"] == "float16" and manifest["cache"]["dtype"] == "float16"
    assert (q["scheme"], q["accuracy_level"], q["lm_head"], q["embedding"]) == ("int4", 4, "int8", "int8")
    vocab, hidden = tiny_model.model.embed_tokens.weight.shape
    projections = _projections(tiny_model)
    for graph in ("prefill.onnx", "decode.onnx"):
        model = onnx.load(str(folder / graph), load_external_data=False)
        initializers = {t.name: t for t in model.graph.initializer}
        scales = [
            initializers[n.input[2]] for n in model.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")
        ]
        assert len(scales) == 16 and {t.data_type for t in scales} == {onnx.TensorProto.FLOAT16}, graph
        floats = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
        assert floats["logits"] == onnx.TensorProto.FLOAT16
        assert {t for name, t in floats.items() if "past" in name or "present" in name} == {onnx.TensorProto.FLOAT16}
    # the same blocks as at float32 activations, each scale in 2 bytes instead of 4
    table = _block_bytes(hidden, vocab, 8, scale_bytes=2)
    assert q["quantized_bytes"] == sum(_block_bytes(k, n, 4, scale_bytes=2) for k, n in projections) + table
    assert q["float_bytes"] == 2 * (sum(k * n for k, n in projections) + vocab * hidden)
    assert _held(folder) == (q["quantized_bytes"], [])
    assert identical_weights(Artifact.open(folder)).passed


def test_each_lm_head_and_embedding_choice_gives_its_nodes_and_bytes(choices, tiny_model):
    vocab, hidden = tiny_model.model.embed_tokens.weight.shape
    projections = _projections(tiny_model)
    body = sum(_block_bytes(k, n, 4) for k, n in projections)
    nodes = sorted(("MatMulNBits", 4, n) for _, n in projections)
    cases = {
        # one 4-bit table read by both
        "same": ([("MatMulNBits", 4, vocab), ("GatherBlockQuantized", 4, vocab)], _block_bytes(hidden, vocab, 4)),
        # two tables: the lm_head at 8 bits, the embedding at 4
        "split": (
            [("MatMulNBits", 8, vocab), ("GatherBlockQuantized", 4, vocab)],
            _block_bytes(hidden, vocab, 8) + _block_bytes(hidden, vocab, 4),
        ),
        "float": ([], 0),
    }
    for name, (table_nodes, table_bytes) in cases.items():
        folder = choices[name]
        q = json.loads((folder / "manifest.json").read_text())["quantization"]
        assert (q["lm_head"], q["embedding"]) == CHOICES[name]
        assert _quantized_nodes(folder) == sorted(nodes + table_nodes), name
        assert _held(folder) == (q["quantized_bytes"], [(vocab, hidden)] * 2 * (name == "float")), name
        assert q["quantized_bytes"] == body + table_bytes, name
    kept = json.loads((choices["float"] / "manifest.json").read_text())["quantization"]["kept_float"]
    assert kept == ["lm_head (asked: lm_head float)", "model.embed_tokens (asked: embedding float)"]
    graph = onnx.load(str(choices["float"] / "decode.onnx"), load_external_data=False)
    assert {"Gemm", "Gather"} <= {n.op_type for n in graph.graph.node}  # the float graph's tied head and lookup


@pytest.mark.parametrize("name", ["default", "same"])
def test_a_tied_table_at_one_bits_is_stored_once_for_both_readers(name, quantized, choices):
    folder = _folder(name, quantized, choices)
    for graph in ("prefill.onnx", "decode.onnx"):
        model = onnx.load(str(folder / graph), load_external_data=False)
        where = {t.name: {e.key: e.value for e in t.external_data}.get("offset") for t in model.graph.initializer}
        (head,) = [n for n in model.graph.node if n.op_type == "MatMulNBits" and _attributes(n)["N"] == 512]
        (lookup,) = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
        # blocks, scales, zero points: the same bytes in the file, read in MatMulNBits' and in the lookup's shapes
        assert [where[i] for i in head.input[1:4]] == [where[lookup.input[0]], *map(where.get, lookup.input[2:4])]


# ----------------------------------------------------------------------------- what onnxruntime computes


def _run_with(folder, extra_outputs: list[str], feeds: dict) -> list[np.ndarray]:
    """prefill.onnx run by onnxruntime with `extra_outputs` (intermediate values) made graph outputs."""
    model = onnx.load(str(folder / "prefill.onnx"))
    model.graph.output.extend(
        helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in extra_outputs
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["logits", *extra_outputs], feeds)


def _feeds(ids: np.ndarray) -> dict:
    b, t = ids.shape
    positions = np.broadcast_to(np.arange(t), (b, t)).copy()
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": positions, "labels": ids}


def _initializer(folder, name):
    model = onnx.load(str(folder / "prefill.onnx"))
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


@pytest.mark.parametrize(("name", "bits"), [("default", 8), ("same", 4)])
def test_the_quantized_tied_head_gives_the_float_logits_within_half_a_step_per_weight(
    name, bits, quantized, choices, tiny_model
):
    # Each weight lies within half its block's step of the float weight (round to nearest, a zero point inside the
    # block's range), so a logit h . w lies within sum_i |h_i| step_i / 2 of h . w_float, plus float32's rounding
    # of the H-term sums (H eps of sum |h_i w_i| bounds it).
    folder = _folder(name, quantized, choices)
    model = onnx.load(str(folder / "prefill.onnx"), load_external_data=False)
    (head,) = [n for n in model.graph.node if n.op_type == "MatMulNBits" and _attributes(n)["N"] == 512]
    assert _attributes(head)["bits"] == bits
    ids = np.array([[1, 17, 230, 4, 99, 511]])
    logits, hidden = _run_with(folder, [head.input[0]], _feeds(ids))
    table = tiny_model.model.embed_tokens.weight.detach().double().numpy()  # (vocab, hidden), the head's weight
    steps = np.repeat(_initializer(folder, head.input[2]).reshape(table.shape[0], -1), 32, axis=1).astype(np.float64)
    h = hidden.reshape(-1, table.shape[1]).astype(np.float64)
    error = np.abs(logits.reshape(h.shape[0], -1) - h @ table.T)
    bound = np.abs(h) @ steps.T / 2 + table.shape[1] * EPS * (np.abs(h) @ np.abs(table).T)
    assert (error <= bound).all(), float((error / bound).max())
    assert error.max() > 0  # the head is no longer the float table


@pytest.mark.parametrize(("name", "bits"), [("default", 8), ("same", 4)])
def test_the_quantized_embedding_rows_lie_within_half_a_step_of_the_float_rows(
    name, bits, quantized, choices, tiny_model
):
    folder = _folder(name, quantized, choices)
    model = onnx.load(str(folder / "prefill.onnx"), load_external_data=False)
    (lookup,) = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    assert _attributes(lookup)["bits"] == bits
    table = tiny_model.model.embed_tokens.weight.detach().double().numpy()
    ids = np.arange(table.shape[0]).reshape(2, -1)  # every row once, at positions the model has
    _, rows = _run_with(folder, [lookup.output[0]], _feeds(ids))
    steps = np.repeat(_initializer(folder, lookup.input[2]), 32, axis=1).astype(np.float64)
    # half a step (rounding to nearest within the block's range), plus float32's rounding of q / step + zero point
    # (2^bits eps in steps) and of the dequantized product (eps relative)
    bound = steps * (0.5 + 2**bits * EPS) + EPS * np.abs(table)
    error = np.abs(rows.reshape(table.shape) - table)
    assert (error <= bound).all(), float((error / bound).max())
    assert error.max() > 0


def test_ids_outside_the_vocabulary_still_fail_in_the_quantized_lookup(quantized):
    # GatherBlockQuantized gives a row of zeros for an id outside its table; the Gather of row numbers before it
    # fails as the float graph's Gather does, for a negative id (sent past the table) and one past the table
    runner = OrtRunner(quantized["int4"])
    for bad in (-1, 512):
        ids = np.array([[3, bad]])
        with pytest.raises(GraphRunError, match=r"prefill.onnx \(.*Gather.*\); check the inputs \(an id or label"):
            runner.prefill(_feeds(ids))
        one = np.ones((1, 1), np.int64)
        with pytest.raises(GraphRunError, match=r"decode.onnx \(.*Gather"):
            runner.decode(
                {"input_ids": bad * one, "attention_mask": one, "position_ids": 0 * one, **runner.empty_past(1)}
            )


@pytest.mark.parametrize("activations", ["float32", "float16"])
def test_onnxruntime_genai_runs_the_quantized_artifact_as_our_runtime_does(activations, tiny_model, request):
    folder = (
        request.getfixturevalue("quantized")["int4"]
        if activations == "float32"
        else request.getfixturevalue("quantized_float16")
    )
    eos = tiny_model.config.eos_token_id
    prompt = CONSUMER_PROMPTS[0]
    ours = generate_greedy(OrtRunner(folder), prompt, 16, eos).new_ids
    genai = genai_greedy(folder, prompt, 16)
    assert len(ours) >= 8 and genai == (ours[:-1] if ours and ours[-1] == eos else ours)


# ----------------------------------------------------------------------------- refusals and the audit


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"dtype": "int3"}, "dtype 'int3' is not supported"),
        ({"dtype": "int4", "block_size": 48}, "not a power of two"),
        ({"dtype": "int4", "block_size": 8}, "not a power of two >= 16"),
        ({"dtype": "int4", "block_size": 128}, "does not divide the model's hidden size 64"),
        ({"dtype": "int8", "accuracy_level": 7}, "accuracy_level 7"),
        ({"dtype": "int8", "lm_head": "int2"}, r"lm_head 'int2' is none of float, int8, same .*\(`lm_head`\)"),
        ({"dtype": "int4", "embedding": "int4"}, r"embedding 'int4' is none of float, int8, same .*\(`embedding`\)"),
        ({"dtype": "int4", "activations": "bfloat16"}, r"activations 'bfloat16' is none of float32, float16"),
        (
            {"dtype": "float32", "activations": "float16"},
            r"applies to int4/int8 exports only; a float32 export computes in float32: drop `activations`",
        ),
        ({"dtype": "float32", "block_size": 24}, r"block_size 24 applies to int4/int8 exports only; .*`block_size`"),
        ({"dtype": "float16", "accuracy_level": 9}, r"accuracy_level 9 applies to int4/int8 exports only"),
        ({"dtype": "float32", "lm_head": "float"}, r"lm_head 'float' applies to int4/int8 exports only"),
        ({"dtype": "float16", "embedding": "int8"}, r"embedding 'int8' applies to int4/int8 exports only"),
        ({"dtype": "float32", "algorithm": "hqq"}, r"algorithm 'hqq' applies to int4/int8 exports only"),
        ({"dtype": "int4", "algorithm": "gptq"}, r"algorithm 'gptq' is none of rtn, hqq \(`algorithm`\)"),
        ({"dtype": "int8", "algorithm": "hqq"}, r"algorithm hqq makes 4-bit blocks, and an int8 export has none"),
        ({"dtype": "int4", "smoothing": 0.5}, r"smoothing applies to int8 at accuracy level 4 only \(at 4 bits"),
        (
            {"dtype": "int8", "accuracy_level": 0, "smoothing": 0.5},
            r"\(at accuracy level 0 the inputs are not rounded to int8\)",
        ),
        ({"dtype": "int8", "smoothing": 1.5}, r"smoothing alpha 1.5 is not a number in \(0, 1\]"),
        ({"dtype": "int8", "smoothing": "yes"}, r"smoothing alpha 'yes' is not a number in \(0, 1\]"),
        ({"dtype": "float32", "smoothing": 0.5}, r"smoothing 0.5 applies to int4/int8 exports only"),
    ],
)
def test_bad_quantization_refused_before_anything_is_written(tiny_model, tmp_path, arguments, fragment):
    settings = dict(arguments)
    dtype = settings.pop("dtype")
    with pytest.raises(InputError, match=fragment):
        export_artifact(tiny_model, tmp_path / "out", dtype=dtype, quantization=QuantizationSettings(**settings))
    assert not any(tmp_path.iterdir())


def test_quantization_settings_of_another_type_refused(tiny_model, tmp_path):
    with pytest.raises(InputError, match=r"quantization must be a QuantizationSettings .* got dict \(`quantization`\)"):
        export_artifact(tiny_model, tmp_path / "out", dtype="int4", quantization={"block_size": 32})
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["default", *CHOICES])
def test_dequantized_blocks_lie_within_a_scale(name, quantized, choices, tiny_model):
    from exporter.verify.checks.weights.audit import audit_weights

    folder = _folder(name, quantized, choices)
    audit = audit_weights(Artifact.open(folder), tiny_model)
    assert audit.passed, [f.describe() for f in audit.findings]
    assert all(g.quantized == len(_quantized_nodes(folder)) and g.carried == g.parameters for g in audit.graphs)


def test_blocks_of_other_bits_than_the_manifest_records_fail_the_audit(quantized, tiny_model, tmp_path):
    # An int8 artifact whose manifest says int4: its 8-bit blocks still lie within their scales of the parameters,
    # so only the scheme check tells it from the int4 artifact it claims to be.
    # Its lm_head and embedding are at 8 bits under either scheme (their default, int8): the 14 projections differ.
    from exporter.verify.checks.weights.audit import audit_weights

    folder = shutil.copytree(quantized["int8"], tmp_path / "labelled-int4")
    edit_manifest(folder, lambda manifest: manifest["quantization"].update(scheme="int4", bits=4))
    audit = audit_weights(Artifact.open(folder), tiny_model)
    findings = [f for f in audit.findings if f.problem == "scheme"]
    assert not audit.passed and len(findings) == len(audit.findings) == 28, [f.describe() for f in audit.findings]
    expected = "a projection, holds 8-bit blocks of 16, but the manifest records int4 with 4-bit blocks of 16"
    assert expected in findings[0].detail, findings[0].detail


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda q: q.update(embedding="same"),
            "the embedding (embedding same), holds 8-bit blocks of 32, but the manifest records int4 with 4-bit "
            "blocks of 32 for it",
        ),
        (  # a manifest written before the field: its embedding was float
            lambda q: q.pop("embedding"),
            "the embedding (embedding float), holds 8-bit blocks of 32, but the manifest records int4 with float "
            "weights for it",
        ),
        (
            lambda q: q.update(lm_head="float"),
            "the lm_head (lm_head float), holds 8-bit blocks of 32, but the manifest records int4 with float weights",
        ),
    ],
)
def test_an_embedding_or_lm_head_other_than_recorded_fails_the_audit(quantized, tiny_model, tmp_path, change, expected):
    from exporter.verify.checks.weights.audit import audit_weights

    folder = shutil.copytree(quantized["int4"], tmp_path / "relabelled")
    edit_manifest(folder, lambda manifest: change(manifest["quantization"]))
    audit = audit_weights(Artifact.open(folder), tiny_model)
    assert not audit.passed and len(audit.findings) == 2  # one node in each graph
    assert all(f.problem == "scheme" and expected in f.detail for f in audit.findings), audit.findings[0].detail


def test_a_manifest_without_the_embedding_field_reads_as_a_float_embedding(choices, tiny_model, tmp_path):
    from exporter.verify.checks.weights.audit import audit_weights

    folder = shutil.copytree(choices["float"], tmp_path / "older")
    edit_manifest(folder, lambda manifest: manifest["quantization"].pop("embedding"))
    artifact = Artifact.open(folder)
    assert artifact.manifest.quantization.embedding == "float"
    assert audit_weights(artifact, tiny_model).passed
    edit_manifest(folder, lambda manifest: manifest["quantization"].update(embedding="int3"))
    with pytest.raises(ArtifactError, match=r"quantization embedding 'int3' is none of float, int8, same"):
        Artifact.open(folder)


def test_a_moe_export_quantizes_every_expert_and_keeps_its_routers_float(moe3_model, tmp_path):
    """torch.onnx writes an expert's Linear on its tokens as a Gemm, which the quantizer does not take: each is
    rewritten as a MatMul and quantized. A router stays float (its scores pick the experts) and the manifest says so;
    the weight audit finds every expert's blocks within their scales of its parameters."""
    from exporter.artifact.scopes import ROUTER_SCOPE, module_of
    from exporter.verify.checks.weights.audit import audit_weights

    folder = export_artifact(moe3_model, tmp_path / "moe-int4", dtype="int4", source={"kind": "in-memory"}).folder
    config, artifact = moe3_model.config, Artifact.open(folder)
    for graph in ("prefill.onnx", "decode.onnx"):
        model = onnx.load(str(folder / graph), load_external_data=False)
        floats = {t.name for t in model.graph.initializer if len(t.dims) == 2 and t.data_type == onnx.TensorProto.FLOAT}
        float_gemms = [module_of(n) for n in model.graph.node if n.op_type == "Gemm" and n.input[1] in floats]
        assert len(float_gemms) == config.num_hidden_layers and all(ROUTER_SCOPE.search(m) for m in float_gemms)
        experts = [n for n in model.graph.node if n.op_type == "MatMulNBits" and ".experts." in n.input[1]]
        assert len(experts) == config.num_hidden_layers * config.num_experts * 3, graph
    kept = artifact.manifest.quantization.kept_float
    assert len(kept) == config.num_hidden_layers and all("a MoE router" in k for k in kept), kept
    audit = audit_weights(artifact, moe3_model)
    assert audit.passed, [f.describe() for f in audit.findings]
    ids = np.array([[5, 9, 100, 3]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None], "labels": ids}
    assert np.isfinite(OrtRunner(artifact).prefill(feeds)["logits"]).all()


def test_at_accuracy_level_4_the_runner_computes_prefill_as_decode_in_int8(quantized):
    """MatMulNBits computes in int8 (level 4) only in a prepacked session, and in float32 otherwise: the runner's
    prefill.onnx prepacks a quantized artifact as its decode.onnx does, so both graphs compute what every consumer
    runs, and agree on the same prompt within float32's rounding (unprepacked, prefill differed from decode by the
    activations' int8 rounding)."""
    from exporter.runtime.providers import CPU
    from exporter.tolerances.parity import profile_for
    from exporter.verify.metrics import compare_outputs

    runner = OrtRunner(quantized["int4-level4"])
    assert config_entry(runner.prefill_session, "session.disable_prepacking") is None
    ids = np.array([[5, 9, 100, 3, 77, 12]], dtype=np.int64)
    mask = np.ones_like(ids)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.arange(ids.shape[1])[None]}
    prefill = runner.prefill({**feeds, "labels": ids})
    decode = runner.decode({**feeds, **runner.empty_past(1)})
    for row in compare_outputs("prefill vs decode", prefill, decode, profile_for("float32", CPU), mask):
        assert row.passed, row


def test_a_mix_holds_its_modules_at_their_own_bits_and_levels(tiny_model, artifact_fp32, tmp_path, monkeypatch):
    from exporter.verify.checks.weights.audit import audit_weights

    replayed_export(monkeypatch, artifact_fp32)
    kept, raised = "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"
    mix = (ModulePrecision(kept, None), ModulePrecision(raised, 8, 0))
    result = export_artifact(
        tiny_model, tmp_path / "mix", dtype="int4", source=TINY_SOURCE, quantization=QuantizationSettings(mix=mix)
    )
    quantization = result.manifest.quantization
    assert quantization.mix == mix and quantization.levels == {0, 4}
    assert f"{kept} (the quality target's mix)" in quantization.kept_float
    graph = onnx.load(str(tmp_path / "mix" / "decode.onnx"), load_external_data=False).graph
    nodes = {module_of(n): _attributes(n) for n in graph.node if n.op_type == "MatMulNBits"}
    assert kept not in nodes and (nodes[raised]["bits"], nodes[raised].get("accuracy_level", 0)) == (8, 0)
    others = {(a["bits"], a["accuracy_level"]) for m, a in nodes.items() if m not in (raised, "lm_head")}
    assert others == {(4, 4)}
    audit = audit_weights(Artifact.open(tmp_path / "mix"), tiny_model)
    assert audit.passed, [f.describe() for f in audit.findings]
    # the manifest recording the raised module at 4 bits: its 8-bit blocks fail the audit
    edit_manifest(tmp_path / "mix", lambda m: m["quantization"]["mix"][1].update(bits=4))
    findings = audit_weights(Artifact.open(tmp_path / "mix"), tiny_model).findings
    assert findings and all(f.problem == "scheme" and "mix holds at int4" in f.detail for f in findings), findings


def test_a_mix_naming_no_projection_is_refused(tiny_model, artifact_fp32, tmp_path, monkeypatch):
    replayed_export(monkeypatch, artifact_fp32)
    mix = (ModulePrecision("model.layers.0.mlp.missing_proj", 8),)
    with pytest.raises(InputError, match=r"'model.layers.0.mlp.missing_proj'; name Linear modules .*\(`mix`\)"):
        export_artifact(tiny_model, tmp_path / "out", dtype="int4", quantization=QuantizationSettings(mix=mix))
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- HQQ


@pytest.fixture(scope="session")
def hqq(tmp_path_factory, tiny_model, artifact_fp32):
    """The tiny model at int4 with its 4-bit blocks made by onnxruntime's HQQ, at accuracy level 0 as
    quantized["int4"] (round to nearest), from the same float graphs."""

    def build(root):
        with pytest.MonkeyPatch.context() as monkeypatch:
            replayed_export(monkeypatch, artifact_fp32)
            settings = QuantizationSettings(accuracy_level=0, algorithm="hqq")
            export_artifact(tiny_model, root / "hqq", dtype="int4", source=TINY_SOURCE, quantization=settings)

    return shared_folder(tmp_path_factory, "quantized-hqq", build) / "hqq"


def _zero_points(folder):
    """{module: (bits, zero points)} of the quantized nodes of prefill.onnx."""
    model = onnx.load(str(folder / "prefill.onnx"), load_external_data=False)
    return {
        module_of(n): (_attributes(n)["bits"], read_initializer(folder, block_inputs(n)[2]))
        for n in model.graph.node
        if n.op_type in QUANTIZED_OPS
    }


def test_hqq_makes_other_blocks_than_round_to_nearest_and_the_audit_holds_them(hqq, quantized, tiny_model):
    from exporter.verify.checks.weights.audit import audit_weights

    assert Artifact.open(hqq).manifest.quantization.algorithm == "hqq"
    assert Artifact.open(quantized["int4"]).manifest.quantization.algorithm == "rtn"
    ours, rtn = _zero_points(hqq), _zero_points(quantized["int4"])
    assert ours.keys() == rtn.keys()
    graph = onnx.load(str(hqq / "prefill.onnx"), load_external_data=False).graph
    fractions = zero_point_fractions(graph)
    nodes = {module_of(n): n for n in graph.node if n.op_type in QUANTIZED_OPS}
    for module, (bits, zero_points) in ours.items():
        if bits == 4:  # the solver's float zero points, held as integers (packed as RTN's) and their fractions
            assert zero_points.dtype == np.uint8 and zero_points.size == rtn[module][1].size, module
            held = read_initializer(hqq, fractions[nodes[module].name].fractions)
            assert held.dtype == np.float32 and held.size == 2 * zero_points.size and held.any(), module
        else:  # the int8 lm_head and embedding stay round-to-nearest: the same bytes, no fractions
            assert np.array_equal(zero_points, rtn[module][1]) and nodes[module].name not in fractions, module
    # the manifest's bytes: RTN's layout (integer zero points the same size), plus the fractions and block sums
    added = {name for f in fractions.values() for name in (f.fractions, f.blocks_sum)}
    extra = sum(read_initializer(hqq, name).nbytes for name in added)
    bytes_of = {f: Artifact.open(f).manifest.quantization.quantized_bytes for f in (hqq, quantized["int4"])}
    assert bytes_of[hqq] == bytes_of[quantized["int4"]] + extra and extra > 0
    ids = np.asarray(CONSUMER_PROMPTS[0], dtype=np.int64)[None]
    mask = np.ones_like(ids)
    logits = [OrtRunner(folder).start(ids, mask, np.arange(ids.shape[1])[None]) for folder in (hqq, quantized["int4"])]
    assert not np.array_equal(*logits)
    audit = audit_weights(Artifact.open(hqq), tiny_model)
    assert audit.passed, [f.describe() for f in audit.findings]
    assert all(g.quantized == len(_quantized_nodes(hqq)) and g.carried == g.parameters for g in audit.graphs)


def test_an_hqq_artifact_computes_what_its_blocks_hold_and_passes_verify(hqq, tiny_model):
    """The integer zero points and the fractions added back compute the HQQ blocks' weights: ONNX Runtime in float
    math matches the reference holding the dequantized weights (faithfulness), and the whole verification passes."""
    from exporter import verify_artifact
    from exporter.verify.inputs import ParitySettings

    settings = ParitySettings(decode_steps=8, sweep=False)
    report = verify_artifact(hqq, tiny_model, ["cpu"], settings, genai=False, transformers_js=False)
    assert report.faithfulness is not None and report.faithfulness.passed, report.faithfulness
    assert report.passed, [q.verdict for q in report.quality]


def test_the_audit_derives_hqq_scales_bit_for_bit():
    # onnxruntime's own HQQ on a matrix with a constant block (no range: its scale is 1) and a last block padded
    torch = pytest.importorskip("torch")
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    from exporter.verify.checks.blocks import hqq_scales

    values = np.random.default_rng(0).standard_normal((8, 80)).astype(np.float32) * 0.02
    values[3, :32] = 0.5
    quantizer = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=32, bits=4))
    _, scales, _ = quantizer.quantize_internal(torch.from_numpy(values), bits=4, group_size=32)
    expected, _ = hqq_scales(values, 4, 32, np.dtype(np.float32))
    assert expected[3, 0] == 1 and expected.shape == (8, 3)
    assert np.array_equal(scales.numpy().reshape(8, 3).view(np.uint32), expected.view(np.uint32))


def _scaled_first(values):
    values.reshape(-1)[0] *= np.float32(1.05)
    return values


def _one_entry_cleared(values):
    values[np.nonzero(values)[0][0], np.nonzero(values)[1][0]] = 0
    return values


@pytest.mark.parametrize(
    ("which", "change", "expected"),
    [  # which initializer of quantized_blocks: 1 scales, 2 integer zero points, 3 fractions, 4 block sums
        (2, lambda zero_points: zero_points ^ np.uint8(1), "dequantized weights lie beyond half a step"),
        (3, lambda fractions: fractions * np.float32(-3), "dequantized weights lie beyond half a step"),
        (1, _scaled_first, "scales are not the quantizer's"),
        (4, _one_entry_cleared, "must sum each block of 32 inputs (0s and 1s): 1 of"),
    ],
)
def test_an_hqq_block_off_by_a_step_or_a_scale_fails_the_audit(hqq, tiny_model, tmp_path, which, change, expected):
    from exporter.verify.checks.weights.audit import audit_weights

    folder = shutil.copytree(hqq, tmp_path / "mutated")
    module = "model.layers.1.mlp.down_proj"
    edit_initializers(folder, lambda model: {quantized_blocks(model, module)[which]: change})
    findings = audit_weights(Artifact.open(folder), tiny_model).findings
    named = module if which < 4 else "blocks_sum"  # the block-sum matrix is shared by the nodes reading one input
    assert len(findings) == 2 and all(named in f.detail and expected in f.detail for f in findings), findings


def test_hqq_blocks_under_a_manifest_recording_round_to_nearest_fail_the_audit(hqq, tiny_model, tmp_path):
    from exporter.verify.checks.weights.audit import audit_weights

    folder = shutil.copytree(hqq, tmp_path / "relabelled")
    edit_manifest(folder, lambda manifest: manifest["quantization"].update(algorithm="rtn"))
    findings = audit_weights(Artifact.open(folder), tiny_model).findings
    fours = sum(bits == 4 for bits, _ in _zero_points(hqq).values())
    assert len(findings) == 2 * fours and all(f.problem == "scheme" for f in findings), [f.detail for f in findings]
    assert "holds hqq blocks (fitted zero points), but the manifest records rtn for its 4-bit" in findings[0].detail


def test_the_quality_search_rounds_a_module_as_the_hqq_artifact_holds_it(hqq, tiny_model):
    # the search ranks modules by the weights the artifact will compute with: HQQ's, where the scheme asks for it
    from exporter.tuning.sensitivity import rounded_blocks
    from exporter.verify.checks.weights.quantized import dequantized_weights

    scheme = Artifact.open(hqq).manifest.quantization
    held = dequantized_weights(Artifact.open(hqq))
    module = "model.layers.1.mlp.down_proj"
    weight = tiny_model.get_submodule(module).weight.detach().float().numpy()
    assert np.array_equal(rounded_blocks(weight, 4, scheme, "hqq").weight(), held[module])
    assert not np.array_equal(rounded_blocks(weight, 4, scheme).weight(), held[module])  # round-to-nearest's differ
    # what the search keeps of each rung between mixes: the blocks, half a byte per weight, not a float copy
    blocks = rounded_blocks(weight, 4, scheme, "hqq")
    assert blocks.packed.nbytes == weight.size // 2 and np.array_equal(blocks.weight(), held[module])
