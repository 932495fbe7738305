"""The mutation suite (issue 33): faults written into copies of tiny exported artifacts, each of which `verify`
must catch, and the layer localisation must name.

Each mutant edits a copy of an artifact in place: a weight in both graphs where they share it (the weights file
once, an inline initializer in each graph), or the nodes of the graph(s) that compute the faulty value; then the
manifest is re-signed (sizes and sha256 of the files changed), so that the folder still opens with every hash
checked and only the fault differs. The one table here is run by tests/verify/test_mutations.py (each mutant a
case, all of them caught) and by benchmarks/mutations.py (the table of what caught each, and the kill rate).

Artifacts (ARTIFACTS): minimind-3-tiny (4 heads of 16, 2 kv heads, 2 layers, q_norm and k_norm) in float32 and
float16, its MoE variant with YaRN (4 experts, top-1, dense dispatch) in float32, and the same model 7 layers deep
through the layer template (layers 3-6 grown clones of layer 2) in float32 and int4 (block 32, accuracy level 4);
the tests' session fixtures export them (tests/conftest.py). The int4 mutants edit quantized blocks, which only the
weight audit can judge: the faithfulness check holds ONNX Runtime to the reference holding those same blocks, and the
scheme's own loss (the quality profile) is larger than theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from helpers import (
    QUICK,
    edit_graphs,
    edit_initializers,
    edit_weights,
    quantized_blocks,
    read_initializer,
    scaled,
    swapped,
)
from onnx import helper, numpy_helper

from exporter.artifact.manifest import read_manifest
from exporter.artifact.quantization import GATHER_OP, QUANTIZED_OPS, block_inputs
from exporter.artifact.scopes import module_of
from exporter.verify.inputs import prompt_batch

# artifact kind -> (its fixture, its reference model's fixture), as tests/conftest.py names them
ARTIFACTS = {
    "float32": ("artifact_fp32", "tiny_model"),
    "float16": ("artifact_fp16", "tiny_model"),
    "moe float32": ("moe3_dense_artifact", "moe3_dense_model"),
    "deep float32": ("deep_artifact", "deep_model"),
    "deep int4": ("deep_int4", "deep_model"),
}
QUANTIZED_KINDS = {"deep int4"}  # judged by their quality profile, without localisation or probe

SETTINGS = QUICK  # 2 decode steps, 4 greedy tokens, no sweep, the probe on
# the same through the command line (which has no option for the greedy tokens: 32 there)
CLI_ARGS = (
    "--provider",
    "cpu",
    "--decode-steps",
    str(QUICK.decode_steps),
    "--no-sweep",
    "--no-long-context",
    "--probe",
    "--no-genai",
    "--no-transformers-js",
)
_PROJECTIONS = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
HEAD_DIM = 16  # minimind-3-tiny: hidden 64 over 4 attention heads
ROTARY_POSITION = 5  # a position of every prompt of the checks: the prefill batch's, the greedy prompt's


# ---------------------------------------------------------------- the edits


def _linear_node(folder: Path, module: str) -> onnx.NodeProto:
    graph = onnx.load(str(folder / "prefill.onnx"), load_external_data=False).graph
    return next(n for n in graph.node if n.op_type in ("MatMul", "Gemm") and module_of(n) == module)


def _input_axis(folder: Path, module: str) -> int:
    """The axis of the stored weight of Linear `module` that runs over its input features: a MatMul reads the
    weight transposed (in, out); a Gemm as it is (out, in) with transB, else transposed."""
    node = _linear_node(folder, module)
    if node.op_type == "MatMul":
        return 0
    return 1 if any(a.name == "transB" and a.i for a in node.attribute) else 0


def _one_head_of_o_proj(layer: int, head: int, factor: float, head_dim: int = HEAD_DIM):
    """o_proj's input columns of one attention head (torch's weight[:, head]) times `factor`."""

    def edit(folder: Path) -> None:
        module = f"model.layers.{layer}.self_attn.o_proj"
        index = [slice(None), slice(None)]
        index[_input_axis(folder, module)] = slice(head * head_dim, (head + 1) * head_dim)
        edit_weights(folder, {module: scaled(tuple(index), factor)})

    return edit


def _embedding_row(folder: Path) -> None:
    """A row of the (tied) embedding, of a token the prefill batch holds, each element off by ~1% (seeded): not a
    pure scale, which the first RMSNorm would undo."""
    batch = prompt_batch(read_manifest(folder), SETTINGS, np.random.default_rng(SETTINGS.seed))
    token = int(batch["input_ids"][1, 0])  # the unpadded row's first token

    def change(values):
        noise = np.random.default_rng(token).standard_normal(values.shape[1])
        values[token] = values[token] * (1 + 0.01 * noise).astype(values.dtype)
        return values

    edit_weights(folder, {"model.embed_tokens": change})


def _router_row(layer: int, expert: int, factor: float):
    """One expert's row of a router's weight (torch's weight[expert], the scores it adds to that expert) times
    `factor`; the weight is stored (experts, hidden) or transposed."""

    def edit(folder: Path) -> None:
        experts = read_manifest(folder).config.num_experts

        def change(values):
            axis = values.shape.index(experts)
            values[(slice(None),) * axis + (expert,)] *= factor
            return values

        edit_weights(folder, {f"model.layers.{layer}.mlp.gate": change})

    return edit


def _node_adding(graph: onnx.GraphProto, before: int, nodes: list[onnx.NodeProto], constants: list) -> None:
    """Insert `nodes` (in order) at position `before`, and `constants` as initializers: the graph stays sorted."""
    for offset, node in enumerate(nodes):
        graph.node.insert(before + offset, node)
    graph.initializer.extend(constants)


def _rotary_position_shifted(position: int):
    """The rotary tables see position `position` as position + 1, every other position unchanged: the positions
    fed to the cos/sin computation become p + (p == position). Affects exactly the tokens at that position, in
    every layer's queries and keys (the tables are computed once and shared)."""

    def change(graph: onnx.GraphProto) -> None:
        consumers = [n for n in graph.node if "position_ids" in n.input]
        assert len(consumers) == 1 and module_of(consumers[0]) == "model", [n.name for n in consumers]
        [first] = consumers
        names = ("mutant_at", "mutant_is_at", "mutant_shift", "mutant_position_ids")
        _node_adding(
            graph,
            list(graph.node).index(first),
            [
                helper.make_node("Equal", ["position_ids", names[0]], [names[1]]),
                helper.make_node("Cast", [names[1]], [names[2]], to=onnx.TensorProto.INT64),
                helper.make_node("Add", ["position_ids", names[2]], [names[3]]),
            ],
            [numpy_helper.from_array(np.array(position, np.int64), names[0])],
        )
        first.input[:] = [names[3] if i == "position_ids" else i for i in first.input]

    return lambda folder: edit_graphs(folder, change)


def causal_mask_leaks_one(graph: onnx.GraphProto) -> None:
    """The causal comparison key > query becomes key > query + 1: each query also sees the next token."""
    [greater] = [n for n in graph.node if n.op_type == "Greater" and "self_attn" in (module_of(n) or "")]
    query = greater.input[1]
    _node_adding(
        graph,
        list(graph.node).index(greater),
        [
            helper.make_node("CastLike", ["mutant_one", query], ["mutant_one_like"]),
            helper.make_node("Add", [query, "mutant_one_like"], ["mutant_query_plus_one"]),
        ],
        [numpy_helper.from_array(np.array(1, np.int64), "mutant_one")],
    )
    greater.input[1] = "mutant_query_plus_one"


def _new_token_first(layer: int):
    """decode.onnx writes layer `layer`'s new keys and values before the past instead of after it (prefill.onnx
    has no past, and is left as it is)."""

    def change(graph: onnx.GraphProto) -> None:
        pasts = {f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"}
        concats = [n for n in graph.node if n.op_type == "Concat" and n.input[0] in pasts]
        assert len(concats) in (0, 2), [n.name for n in concats]  # none in prefill.onnx
        for node in concats:
            node.input[:] = [node.input[1], node.input[0]]

    return lambda folder: edit_graphs(folder, change)


def _blocks_swapped(a: str, b: str):
    """The quantized blocks, scales and zero points of the nodes in modules `a` and `b` swapped."""

    def edit(folder: Path) -> None:
        prefill = onnx.load(str(folder / "prefill.onnx"), load_external_data=False)
        held = {module: [read_initializer(folder, n) for n in quantized_blocks(prefill, module)] for module in (a, b)}

        def pick(model):
            changes = {}
            for module, other in ((a, b), (b, a)):
                for name, values in zip(quantized_blocks(model, module), held[other]):
                    changes[name] = lambda _, values=values: values
            return changes

        edit_initializers(folder, pick)

    return edit


def _one_scale(module: str, factor: float):
    """The first block's scale of the quantized node in `module` times `factor`."""

    def change(values):
        values.reshape(-1)[0] *= factor
        return values

    return lambda folder: edit_initializers(folder, lambda model: {quantized_blocks(model, module)[1]: change})


def _scales_as_float8(folder: Path) -> None:
    """Every scale of every quantized node rounded to float8 e4m3 (to nearest) and back."""

    def change(values):
        return torch.from_numpy(values.astype(np.float32)).to(torch.float8_e4m3fn).float().numpy()

    edit_initializers(
        folder,
        lambda model: {block_inputs(n)[1]: change for n in model.graph.node if n.op_type in QUANTIZED_OPS},
    )


def _row_ids_swapped(first: int, second: int):
    """Two entries of the quantized embedding's row-id table swapped: id `first` reads row `second` and back."""

    def change(values):
        values[[first, second]] = values[[second, first]]
        return values

    def pick(model):
        producers = {out: node for node in model.graph.node for out in node.output}
        [lookup] = [n for n in model.graph.node if n.op_type == GATHER_OP]
        return {producers[lookup.input[1]].input[0]: change}

    return lambda folder: edit_initializers(folder, pick)


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Mutant:
    """A fault, the artifact it is written into, and what verification must say about it.

    first_layer: the first layer whose present must diverge (localisation's first_layer); None: the fault must be
        placed after the last layer's key/value path.
    fault_in: a fragment of localisation's `fault_in` that names the mutated layer's part.
    probe: the module (a prefix) in which the probe's first divergence must lie.
    parameters: for a weight mutant, the parameters the weight audit must name; parity on float32 must catch it
        too, as the issue asks faults to be caught by the outputs and not only by the audit.
    expert_choice: the MoE expert-choice check must fail (a token routed differently at no near-tie).
    cli: verified through `export-onnx verify` (CLI_ARGS), which must exit 1; else through verify_artifact.
    by: a check that must fail (one of Outcome.by), where the fault names no parameter.
    """

    name: str
    kind: str  # a key of ARTIFACTS
    edit: Callable[[Path], None]
    first_layer: int | None
    fault_in: str
    probe: str
    parameters: frozenset[str] = frozenset()
    expert_choice: bool = False
    cli: bool = False
    by: str = ""

    @property
    def weight(self) -> bool:
        return bool(self.parameters)


def _layer(i: int) -> str:
    return f"model.layers.{i}."


def _grown(fault: str) -> str:
    return f"{fault} (7 layers, grown)"


MUTANTS = [
    Mutant(
        "q_norm <-> k_norm swapped in layer 1",
        "float32",
        lambda f: edit_weights(f, swapped(f, "model.layers.1.self_attn.q_norm", "model.layers.1.self_attn.k_norm")),
        first_layer=1,
        fault_in="in layer 1's input norm or key/value path",
        probe=_layer(1) + "self_attn.q_norm",
        parameters=frozenset({"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"}),
        cli=True,
    ),
    Mutant(
        "input_layernorm of layers 0 <-> 1 swapped",
        "float32",
        lambda f: edit_weights(f, swapped(f, "model.layers.0.input_layernorm", "model.layers.1.input_layernorm")),
        first_layer=0,
        fault_in="in layer 0's input norm or key/value path",
        probe=_layer(0) + "input_layernorm",
        parameters=frozenset({"model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"}),
    ),
    Mutant(
        "one channel of layer 1's input_layernorm x 1.01",
        "float32",
        lambda f: edit_weights(f, {"model.layers.1.input_layernorm": scaled(5, 1.01)}),
        first_layer=1,
        fault_in="in layer 1's input norm or key/value path",
        probe=_layer(1) + "input_layernorm",
        parameters=frozenset({"model.layers.1.input_layernorm.weight"}),
    ),
    *(
        Mutant(
            f"one head of layer 0's o_proj x 1.05 ({dtype})",
            dtype,
            _one_head_of_o_proj(layer=0, head=2, factor=1.05),
            first_layer=1,
            fault_in="in layer 0's query path, attention, output projection or MLP",
            probe=_layer(0) + "self_attn.o_proj",
            parameters=frozenset({"model.layers.0.self_attn.o_proj.weight"}),
            cli=dtype == "float16",  # the float16 one through the command line
        )
        for dtype in ("float32", "float16")
    ),
    Mutant(
        f"rotary cos/sin of position {ROTARY_POSITION} are position {ROTARY_POSITION + 1}'s",
        "float32",
        _rotary_position_shifted(ROTARY_POSITION),
        first_layer=0,
        fault_in="in layer 0's input norm or key/value path",
        probe=_layer(0) + "self_attn",
    ),
    Mutant(
        "one embedding row off by ~1% per element",
        "float32",
        _embedding_row,
        first_layer=0,
        fault_in="in layer 0's input norm or key/value path, or in the token embedding",
        probe="model.embed_tokens",
        parameters=frozenset({"model.embed_tokens.weight"}),
    ),
    Mutant(
        "causal mask off by one (each query sees the next token)",
        "float32",
        lambda f: edit_graphs(f, causal_mask_leaks_one),
        first_layer=1,
        fault_in="in layer 0's query path, attention, output projection or MLP",
        probe=_layer(0) + "self_attn",
        cli=True,
    ),
    # x 1.5: two of the expert-choice check's (token, layer) choices differ, one at no near-tie; x 1.1 moves every
    # score but changes no choice on these inputs (then the weight audit and the score bound still catch it)
    Mutant(
        "router of layer 0: expert 1's row x 1.5",
        "moe float32",
        _router_row(layer=0, expert=1, factor=1.5),
        first_layer=1,
        fault_in="in layer 0's query path, attention, output projection or MLP",
        probe=_layer(0) + "mlp",
        parameters=frozenset({"model.layers.0.mlp.gate.weight"}),
        expert_choice=True,
    ),
    Mutant(
        "decode writes layer 1's new token before its past",
        "float32",
        _new_token_first(layer=1),
        first_layer=1,
        fault_in="in layer 1's input norm or key/value path",
        probe=_layer(1) + "self_attn",
        cli=True,
    ),
    # in the layers the template grew (3-6 of 7)
    Mutant(
        _grown("q_norm <-> k_norm swapped in layer 5"),
        "deep float32",
        lambda f: edit_weights(f, swapped(f, "model.layers.5.self_attn.q_norm", "model.layers.5.self_attn.k_norm")),
        first_layer=5,
        fault_in="in layer 5's input norm or key/value path",
        probe=_layer(5) + "self_attn.q_norm",
        parameters=frozenset({"model.layers.5.self_attn.q_norm.weight", "model.layers.5.self_attn.k_norm.weight"}),
    ),
    Mutant(
        _grown("one channel of layer 6's input_layernorm x 1.01"),
        "deep float32",
        lambda f: edit_weights(f, {"model.layers.6.input_layernorm": scaled(5, 1.01)}),
        first_layer=6,
        fault_in="in layer 6's input norm or key/value path",
        probe=_layer(6) + "input_layernorm",
        parameters=frozenset({"model.layers.6.input_layernorm.weight"}),
    ),
    Mutant(
        _grown("one head of layer 4's o_proj x 1.05"),
        "deep float32",
        _one_head_of_o_proj(layer=4, head=2, factor=1.05),
        first_layer=5,
        fault_in="in layer 4's query path, attention, output projection or MLP",
        probe=_layer(4) + "self_attn.o_proj",
        parameters=frozenset({"model.layers.4.self_attn.o_proj.weight"}),
    ),
    Mutant(
        _grown("decode writes layer 6's new token before its past"),
        "deep float32",
        _new_token_first(layer=6),
        first_layer=6,
        fault_in="in layer 6's input norm or key/value path",
        probe=_layer(6) + "self_attn",
    ),
    # int4 blocks (issue 45): each passed the audit that accepted any parameter of the right shape within a step
    Mutant(
        _grown("int4: k_proj blocks of layers 4 <-> 5 swapped"),
        "deep int4",
        _blocks_swapped("model.layers.4.self_attn.k_proj", "model.layers.5.self_attn.k_proj"),
        first_layer=None,
        fault_in="",
        probe="",
        parameters=frozenset({"model.layers.4.self_attn.k_proj.weight", "model.layers.5.self_attn.k_proj.weight"}),
    ),
    Mutant(
        _grown("int4: one block's scale of layer 5's down_proj x 1.05"),
        "deep int4",
        _one_scale("model.layers.5.mlp.down_proj", 1.05),
        first_layer=None,
        fault_in="",
        probe="",
        parameters=frozenset({"model.layers.5.mlp.down_proj.weight"}),
    ),
    Mutant(
        _grown("int4: every scale rounded to float8 e4m3"),
        "deep int4",
        _scales_as_float8,
        first_layer=None,
        fault_in="",
        probe="",
        parameters=frozenset(
            {f"model.layers.{i}.{m}.weight" for i in range(7) for m in _PROJECTIONS} | {"model.embed_tokens.weight"}
        ),
    ),
    # issue 46: generate then prints for id 10 what id 11 should
    Mutant(
        _grown("int4: the embedding's row ids 10 <-> 11 swapped"),
        "deep int4",
        _row_ids_swapped(10, 11),
        first_layer=None,
        fault_in="",
        probe="",
        by="weight audit",
    ),
]


# SmolLM2-135M-Instruct, the trained model (30 layers, 27 of them grown from the three traced; head_dim 64), in
# float32: mutants in grown layers of a real model. Run by `benchmarks/mutations.py --real` alone: its export and
# reference take minutes, past the default suite's budget.
REAL_KIND = "smollm2 float32"
REAL_MUTANTS = [
    Mutant(
        "SmolLM2: one channel of layer 20's input_layernorm x 1.01 (grown)",
        REAL_KIND,
        lambda f: edit_weights(f, {"model.layers.20.input_layernorm": scaled(5, 1.01)}),
        first_layer=20,
        fault_in="in layer 20's input norm or key/value path",
        probe=_layer(20) + "input_layernorm",
        parameters=frozenset({"model.layers.20.input_layernorm.weight"}),
    ),
    Mutant(
        "SmolLM2: one head of layer 25's o_proj x 1.05 (grown)",
        REAL_KIND,
        _one_head_of_o_proj(layer=25, head=2, factor=1.05, head_dim=64),
        first_layer=26,
        fault_in="in layer 25's query path, attention, output projection or MLP",
        probe=_layer(25) + "self_attn.o_proj",
        parameters=frozenset({"model.layers.25.self_attn.o_proj.weight"}),
    ),
    Mutant(
        "SmolLM2: decode writes layer 28's new token before its past (grown)",
        REAL_KIND,
        _new_token_first(layer=28),
        first_layer=28,
        fault_in="in layer 28's input norm or key/value path",
        probe=_layer(28) + "self_attn",
    ),
]

# ---------------------------------------------------------------- judging a report


@dataclass(frozen=True)
class Outcome:
    """What verification said of one mutant, read from its JSON report (`verify --json`, VerifyReport.to_dict()),
    the first provider's part.

    by: the checks that failed: "parity" (prefill and decode rows, greedy, sweep), "weight audit",
        "invariant: NAME", "expert choice", "health"; for a quantized artifact "quality" and "faithfulness".
    rows: the failing parity rows, by name.
    scale: the worst failing parity row's multiple of its tolerance (its needed.scale); None where no row failed.
    first_layer, where, fault_in: the layer-level localisation.
    probe: the module of the probe's first divergence (prefill.onnx's, else decode.onnx's); "" where none.
    audit_named: the parameters the weight audit's findings name.
    audit_multiple: the worst quantized weight's distance from its parameter, in multiples of its bound (half a step
        plus rounding); None where no finding measures one.
    referee_ratio: the worst failing row's error against the float64 referee, in multiples of the reference's own;
        None where no failing row was refereed (a MoE model's, say).
    flips: the expert choices that differ, those explained, and those at near-ties; None for a dense model.
    """

    mutant: str
    caught: bool
    by: tuple[str, ...]
    rows: tuple[str, ...]
    scale: float | None
    first_layer: int | None
    where: str
    fault_in: str
    probe: str
    audit_named: frozenset[str]
    flips: tuple[int, int, int] | None
    audit_multiple: float | None = None
    referee_ratio: float | None = None

    def to_dict(self) -> dict:
        return {
            "mutant": self.mutant,
            "caught": self.caught,
            "by": list(self.by),
            "rows": list(self.rows),
            "scale": self.scale,
            "first_layer": self.first_layer,
            "where": self.where,
            "fault_in": self.fault_in,
            "probe": self.probe,
            "audit_named": sorted(self.audit_named),
            "flips": list(self.flips) if self.flips is not None else None,
            "audit_multiple": self.audit_multiple,
            "referee_ratio": self.referee_ratio,
        }


def judge(mutant: Mutant, document: dict) -> Outcome:
    """The Outcome of `mutant` from its verification's JSON report."""
    if mutant.kind in QUANTIZED_KINDS:
        return _judge_quantized(mutant, document)
    provider = document["providers"][0]
    failing = [c for c in provider["comparisons"] if not c["passed"]]
    for case in provider["sweep"]:
        failing += [c for c in (case["logits"], case["kv"]) if not c["passed"]]
    greedy = provider["greedy"]["passed"]
    audit = document["weight_audit"]
    experts = provider["expert_choice"]
    by = ["parity"] * (bool(failing) or not greedy or not all(case["passed"] for case in provider["sweep"]))
    by += ["weight audit"] * (audit is not None and audit["passed"] is False)
    by += [f"invariant: {i['name']}" for i in document["invariants"] if not i["passed"]]
    by += ["expert choice"] * (experts is not None and experts["passed"] is False)
    by += ["health"] * (not provider["health"]["passed"])
    located = provider["localisation"]
    first = next((p["first"] for p in (located["probe"], located["decode_probe"]) if p and p["first"]), None)
    return Outcome(
        mutant.name,
        document["passed"] is False,
        tuple(by),
        tuple(c["name"] for c in failing) + ("greedy",) * (not greedy),
        max((c["needed"]["scale"] for c in failing), default=None),
        located["first_layer"],
        located["where"],
        located["fault_in"],
        first["module"] if first else "",
        frozenset(f["parameter"] for g in audit["graphs"] for f in g["findings"]) if audit else frozenset(),
        (experts["pairs"] - experts["agreeing"], experts["explained"], experts["near_ties"]) if experts else None,
        referee_ratio=max((c["referee"]["ratio"] for c in failing if c.get("referee")), default=None),
    )


def _audit_findings(document: dict) -> list[dict]:
    audit = document["weight_audit"]
    return [f for g in audit["graphs"] for f in g["findings"]] if audit else []


def _judge_quantized(mutant: Mutant, document: dict) -> Outcome:
    """A quantized artifact's Outcome: judged by the weight audit, its quality profile and the faithfulness check, with
    no parity rows, localisation or probe."""
    findings = _audit_findings(document)
    by = ["weight audit"] * (document["weight_audit"]["passed"] is False)
    by += ["quality"] * (not all(q["passed"] for q in document["quality"]))
    by += ["faithfulness"] * (document["faithfulness"]["passed"] is False)
    by += [f"invariant: {i['name']}" for i in document["invariants"] if not i["passed"]]
    multiples = [f["multiple"] for f in findings if f["multiple"] is not None]
    return Outcome(
        mutant.name,
        document["passed"] is False,
        tuple(by),
        (),
        None,
        None,
        "",
        "",
        "",
        frozenset(f["parameter"] for f in findings if f["parameter"]),
        None,
        max(multiples, default=None),
    )


def unmet(mutant: Mutant, outcome: Outcome) -> list[str]:
    """What verification failed to say of `mutant`: empty when it caught the fault and named its place."""
    problems = []
    if not outcome.caught:
        problems.append("not caught: verify passed")
    if mutant.weight and outcome.audit_named != mutant.parameters:
        problems.append(f"the weight audit named {sorted(outcome.audit_named)}, not {sorted(mutant.parameters)}")
    if mutant.by and mutant.by not in outcome.by:
        problems.append(f"{mutant.by} did not fail")
    if mutant.kind in QUANTIZED_KINDS:  # no parity rows, localisation or probe
        return problems
    if mutant.weight and mutant.kind != "float16" and "parity" not in outcome.by:
        problems.append("caught by the weight audit alone: no output comparison failed")
    if outcome.first_layer != mutant.first_layer or mutant.fault_in not in outcome.fault_in:
        problems.append(
            f"localised at layer {outcome.first_layer} ({outcome.fault_in!r}), not at layer {mutant.first_layer} "
            f"({mutant.fault_in!r})"
        )
    if not outcome.probe.startswith(mutant.probe):
        problems.append(f"the probe's first divergence lies in {outcome.probe!r}, not in {mutant.probe!r}")
    if mutant.expert_choice:
        differ, explained, near_ties = outcome.flips or (0, 0, 0)
        if "expert choice" not in outcome.by or differ == explained or near_ties:
            problems.append(
                f"expert choice: {differ} choices differ, {explained} explained, {near_ties} at near-ties; wanted a "
                "failure with a choice that differs at no near-tie"
            )
    return problems
