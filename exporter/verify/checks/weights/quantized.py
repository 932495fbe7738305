"""The weight audit of a quantized artifact (manifest `quantization`): its blocks against their parameters.

Each MatMulNBits node holds a projection, and a GatherBlockQuantized node the token embedding, as blocks of
`bits`-bit integers, a scale and a zero point per block: it cannot equal its parameter bit for bit. Each node lies
in the module whose Linear (or embedding) it replaced (the export gives it the MatMul's scope,
exporter/export/quantize.py), and is held to that module's parameter as onnxruntime's quantizer makes blocks of it
(exporter/verify/checks/blocks.py derives each bound): its scales and zero points equal the quantizer's bit for bit,
and each dequantized weight, (q - zero_point) * scale, lies within half a step of the parameter, plus rounding.
Blocks made by HQQ (float zero points, which the manifest's algorithm must record for the module; the graph holds
them as integer zero points and the fractions it adds back) have their scales held bit for bit and their codes to
the nearest on the grid, the solver's zero point being re-derivable by no formula; the matrix that sums each block
of the input for those fractions must hold 0s and 1s as the blocks lie. Another layer's blocks in its place, a scale
× 1.05 or rounded to another format, a zero point off by one, fail; the finding names the parameter the blocks hold
instead where they are another's. Blocks of more bits than recorded would pass that test, so each node's bits and
block size (and whether it has zero points) are also held to the manifest's scheme (the lm_head to its `lm_head`
option, the embedding to its `embedding` option). The ids reach the quantized embedding through a Gather of a table
of row numbers (it fails on ids outside the table, as the float graph's Gather does): that integer table must hold 0
.. rows-1, or it would give one token another's row.

A smoothed projection (an int8 scheme's at accuracy level 4, when the manifest records smoothing) reads its input
divided by an initializer of divisors, one per input channel: its blocks are those of the parameter with each
column times its divisor (exporter.artifact.quantization.smoothed_weight, computed here bit for bit as the export
did), so a divisor changed without its blocks, or blocks without their divisors, fail as another block does. The
divisors must be positive and finite, one per input channel, and a node is smoothed exactly where the manifest's
scheme says (`Quantization.smooths`).

`dequantized_weights` gives the weights those blocks compute with, by module, for the checks that run them in float
math (exporter.verify.checks.faithfulness).
"""

from __future__ import annotations

import numpy as np
import onnx

from exporter.artifact.folder import Artifact
from exporter.artifact.quantization import (
    GATHER_OP,
    QUANTIZED_OPS,
    ZeroPointFractions,
    block_inputs,
    blocks_sum_matrix,
    smoothed_weight,
    smoothing_divisors,
    zero_point_fractions,
)
from exporter.artifact.scopes import module_of
from exporter.verify.checks.blocks import check_blocks, dequantize_blocks, fitted_zero_points, layout
from exporter.verify.checks.weights.results import WeightFinding
from exporter.verify.checks.weights.tensors import ReferenceIndex, ReferenceTensor, WeightsFile, read_initializer


def audit_scheme(
    manifest,
    node: onnx.NodeProto,
    file: str,
    initializers: dict,
    fractions: dict[str, ZeroPointFractions],
    divisors: dict[str, str],
) -> WeightFinding | None:
    """A quantized node's bits and block size against the scheme the manifest records: the embedding (the
    GatherBlockQuantized node) at the bits its `embedding` option gives, the lm_head (the MatMulNBits matrix of
    vocabulary width) at those of its `lm_head` option, every other matrix at the scheme's; None when they agree.
    Blocks of more bits than recorded still lie within their scales, so only this tells such an artifact from the
    one it claims to be. A module of the mix (an export made to a quality target) is held to the mix's bits. Its
    algorithm too: HQQ's blocks (float zero points, among `initializers` by name, or integer ones with the
    `fractions` the graph adds back, by node name) where the manifest records "hqq" for the module's bits,
    round-to-nearest's (integer zero points, or none) elsewhere. And its smoothing: a projection's input divided by
    `divisors` (by node name) where the scheme smooths its module, and nowhere else."""
    scheme, held = manifest.quantization, block_inputs(node)[0]
    if scheme is None:
        return WeightFinding(file, "scheme", "", held, f"{node.name} is quantized, but the manifest is float")
    if node.op_type == GATHER_OP:
        role, choice = "the embedding", ("embedding", scheme.embedding)
    elif _attribute(node, "N", 0) == manifest.config.vocab_size:
        role, choice = "the lm_head", ("lm_head", scheme.lm_head)
    else:
        role, choice = "a projection", None
    mixed = scheme.precision_of(module_of(node) or "")  # a quality target's mix overrides the scheme's bits
    if mixed is not None:
        role, choice = f"a projection the mix holds at {mixed.precision}", None
    expected = mixed.bits if mixed is not None else scheme.bits_for(choice[1]) if choice else scheme.bits
    bits, block = _attribute(node, "bits", 4), _attribute(node, "block_size", 0)
    symmetric = len(block_inputs(node)) < 3  # no zero points
    if symmetric != scheme.symmetric:
        return WeightFinding(
            file,
            "scheme",
            "",
            held,
            f"{node.name}, {role}, holds {'symmetric' if symmetric else 'asymmetric'} blocks, but the manifest records "
            f"{'symmetric' if scheme.symmetric else 'asymmetric'} ones",
        )
    if (bits, block) == (expected, scheme.block_size):
        smooths = choice is None and scheme.smooths(module_of(node) or "")  # a projection, the mix's or the scheme's
        if smooths != (node.name in divisors):
            return WeightFinding(
                file,
                "scheme",
                "",
                held,
                f"{node.name}, {role}, reads its input {'as it is' if smooths else 'divided by smoothing divisors'}, "
                f"but the manifest records {'smoothing for it' if smooths else 'no smoothing of it'}",
            )
        return _audit_algorithm(scheme, node, bits, file, initializers, node.name in fractions)
    asked = f" ({choice[0]} {choice[1]})" if choice else ""
    recorded = f"{expected}-bit blocks of {scheme.block_size}" if expected else "float weights"
    return WeightFinding(
        file,
        "scheme",
        "",
        held,
        f"{node.name}, {role}{asked}, holds {bits}-bit blocks of {block}, but the manifest records {scheme.scheme} "
        f"with {recorded} for it",
    )


def _audit_algorithm(
    scheme, node: onnx.NodeProto, bits: int, file: str, initializers: dict, fitted: bool
) -> WeightFinding | None:
    names = block_inputs(node)
    zero_points = initializers.get(names[2]) if len(names) > 2 else None
    float_types = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    held = "hqq" if fitted or (zero_points is not None and zero_points.data_type in float_types) else "rtn"
    recorded = scheme.algorithm_for(module_of(node) or "", bits)
    if held == recorded:
        return None
    zero = "fitted" if held == "hqq" else "integer or no"
    return WeightFinding(
        file,
        "scheme",
        "",
        names[0],
        f"{node.name} holds {held} blocks ({zero} zero points), but the manifest records {recorded} for its "
        f"{bits}-bit blocks",
    )


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def block_arrays(artifact, node, initializers: dict, weights, fractions: dict[str, ZeroPointFractions]):
    """A quantized node's blocks, scales and zero points (None where it has none) as arrays, its zero points the
    fitted floats where the graph adds their fractions back (blocks.fitted_zero_points); or, where one cannot be read,
    (its name, why) in place of the arrays."""
    names = block_inputs(node) + ([fractions[node.name].fractions] if node.name in fractions else [])
    arrays = []
    for name in names:
        array, problem = (
            read_initializer(artifact, initializers[name], weights) if name in initializers else (None, "missing")
        )
        if array is None:
            return name, problem
        arrays.append(array)
    if node.name in fractions:
        b, scales, integers, held = arrays
        return b, scales, fitted_zero_points(node, b, scales, integers, held)
    return (*arrays, None)[:3]


def read_divisors(artifact, node, initializers: dict, weights, divisors: dict[str, str]):
    """The smoothing divisors of a quantized node's input (by node name in `divisors`) as an array; None where it
    has none; or, where they cannot be read, (their name, why)."""
    name = divisors.get(node.name)
    if name is None:
        return None
    array, problem = read_initializer(artifact, initializers[name], weights)
    return (name, problem) if array is None else array


def _divisors_problem(node, divisor: np.ndarray) -> str | None:
    """Why `divisor` cannot divide `node`'s input channels, or None."""
    k = _attribute(node, "K", 0)
    if divisor.shape != (k,) or not np.all(np.isfinite(divisor) & (divisor > 0)):
        return f"hold no {k} positive finite divisors, one per input channel (shape {list(divisor.shape)})"
    return None


def audit_blocks(
    artifact,
    node,
    initializers,
    weights,
    index: ReferenceIndex,
    carried: set,
    named: set,
    file: str,
    fractions: dict,
    divisors: dict,
):
    """A quantized node's blocks against the parameter of the module it lies in (its scope), as onnxruntime's
    quantizer makes them (exporter/verify/checks/blocks.py), each column times its smoothing divisor where it has
    them (`divisors`, smoothing_divisors'); None when they are (it is then carried), else the finding, naming the
    parameter they hold instead where they are another's."""
    names = block_inputs(node)
    arrays = block_arrays(artifact, node, initializers, weights, fractions)
    divisor = read_divisors(artifact, node, initializers, weights, divisors)
    for unread in (arrays, divisor):
        if isinstance(unread, tuple) and len(unread) == 2:
            name, problem = unread
            return WeightFinding(file, "unreadable", "", name, f"initializer {name} of {node.name} {problem}")
    b, scales, zero_points = arrays
    module = module_of(node)
    if module is None:
        return WeightFinding(
            file,
            "unplaced",
            "",
            names[0],
            f"quantized matrix {names[0]} of {node.name} lies in no module (no scope metadata), so no parameter is "
            "due there; re-export the artifact with this version of the toolkit, which records it",
        )
    shape = layout(node, b)[:2]
    fitting = [r for r in index.references if r.kind == "parameter" and tuple(r.tensor.shape) == shape]
    due = next((r for r in fitting if module in r.owners), None)
    if due is None:
        return WeightFinding(
            file,
            "unmatched",
            "",
            names[0],
            f"quantized matrix {names[0]} {list(shape)} of {node.name} (in {module}) is no parameter of {module} "
            "of that shape",
        )

    if divisor is not None and (problem := _divisors_problem(node, divisor)):
        named.add(id(due))
        return WeightFinding(
            file,
            "differs",
            due.names[0],
            divisors[node.name],
            f"{due.name}: the smoothing divisors {divisors[node.name]} of {node.name} {problem}",
        )

    def values(reference: ReferenceTensor) -> np.ndarray:
        graph_values = _graph_values(reference, index.export_dtype)
        if divisor is None:
            return graph_values
        return smoothed_weight(graph_values.astype(divisor.dtype), divisor, divisor.dtype).astype(np.float32)

    checked = check_blocks(node, b, scales, zero_points, values(due))
    if checked.passed:
        carried.add(id(due))
        return None
    named.add(id(due))
    held = next(
        (r for r in fitting if r is not due and check_blocks(node, b, scales, zero_points, values(r)).passed),
        None,
    )
    if held is not None:
        named.add(id(held))
        return WeightFinding(
            file,
            "misplaced",
            due.names[0],
            names[0],
            f"{due.name}: the quantized blocks {names[0]} of {node.name} (in {module}) hold {held.name} instead",
            multiple=checked.worst,
        )
    return WeightFinding(
        file,
        "differs",
        due.names[0],
        names[0],
        f"{due.name} differs in the quantized blocks {names[0]} of {node.name}: {checked.describe()}",
        multiple=checked.worst,
    )


def _graph_values(reference: ReferenceTensor, export_dtype) -> np.ndarray:
    """A parameter as the float graph held it before quantization (cast to the export's dtype), as float32."""
    return reference.tensor.to(export_dtype).float().cpu().numpy()


def row_id_tables(graph: onnx.GraphProto, initializers: dict) -> list[tuple[onnx.NodeProto, str]]:
    """The row-id tables in front of GatherBlockQuantized nodes (exporter/export/quantize.py): (the node, the
    integer initializer that a Gather reads the ids through)."""
    producers = {out: node for node in graph.node for out in node.output}
    found = []
    for node in graph.node:
        if node.op_type != GATHER_OP:
            continue
        guard = producers.get(node.input[1])
        if guard is not None and guard.op_type == "Gather" and guard.input[0] in initializers:
            found.append((node, guard.input[0]))
    return found


def audit_row_ids(
    artifact, node: onnx.NodeProto, name: str, initializers: dict, weights, file: str
) -> WeightFinding | None:
    """The row-id table `name` in front of the quantized embedding `node` against what it must be, 0 .. rows-1 (it
    passes each id in the table through unchanged, and fails on the others); None when it is."""
    table, problem = read_initializer(artifact, initializers[name], weights)
    if table is None:
        return WeightFinding(file, "unreadable", "", name, f"row-id table {name} of {node.name} {problem}")
    rows = int(initializers[node.input[0]].dims[0])  # the quantized table's rows
    identity = np.arange(rows)
    if table.shape == (rows,) and np.array_equal(table, identity):
        return None
    if table.shape != (rows,):
        how = f"has shape {list(table.shape)}, not [{rows}]"
    else:
        wrong = np.flatnonzero(table != identity)
        how = f"{wrong.size} of {rows} entries differ, e.g. entry {wrong[0]} holds {table[wrong[0]]}"
    return WeightFinding(
        file,
        "differs",
        "",
        name,
        f"the row-id table {name} in front of the quantized embedding {node.name} must hold 0 .. {rows - 1}: {how}",
    )


def audit_blocks_sum(
    artifact, node: onnx.NodeProto, name: str, initializers: dict, weights, file: str
) -> WeightFinding | None:
    """The matrix `name` that sums each block of the HQQ `node`'s input for its zero points' fractions against what it
    must be: (K, blocks), 1 where row k lies in block k // block_size, else 0; None when it is."""
    table, problem = read_initializer(artifact, initializers[name], weights)
    if table is None:
        return WeightFinding(file, "unreadable", "", name, f"block-sum matrix {name} of {node.name} {problem}")
    k, block = _attribute(node, "K", 0), _attribute(node, "block_size", 1)
    expected = blocks_sum_matrix(k, block, np.float32)
    if table.shape == expected.shape and np.array_equal(table, expected):
        return None
    how = (
        f"has shape {list(table.shape)}, not {list(expected.shape)}"
        if table.shape != expected.shape
        else f"{int((table != expected).sum())} of {expected.size} entries differ"
    )
    return WeightFinding(
        file,
        "differs",
        "",
        name,
        f"the block-sum matrix {name} of {node.name} must sum each block of {block} inputs (0s and 1s): {how}",
    )


def dequantized_weights(artifact: Artifact) -> dict[str, np.ndarray]:
    """The weight each quantized node of `artifact`'s prefill graph computes with in float math (a smoothed node's
    blocks over its divisors, column by column), by the module it lies in ({"model.layers.0.self_attn.q_proj":
    (out, in) float32}; the embedding's (vocab, hidden)). Both graphs hold the same blocks (the invariants check
    it). A node in no module is left out: the weight audit fails it."""
    graph = artifact.graph(artifact.manifest.prefill).graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    weights = WeightsFile(artifact)
    fractions, divisors = zero_point_fractions(graph), smoothing_divisors(graph)
    found = {}
    for node in graph.node:
        module = module_of(node) if node.op_type in QUANTIZED_OPS else None
        if module is None:
            continue
        arrays = block_arrays(artifact, node, initializers, weights, fractions)
        divisor = read_divisors(artifact, node, initializers, weights, divisors)
        if len(arrays) == 3 and not isinstance(divisor, tuple):  # else unreadable: the weight audit fails it
            if divisor is not None and _divisors_problem(node, divisor):
                continue  # no weight: the weight audit fails it
            weight = dequantize_blocks(node, *arrays)
            found[module] = weight if divisor is None else weight / divisor.astype(np.float32)[None, :]
    return found
