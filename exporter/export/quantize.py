"""Weight-only quantization of the exported float graphs, in memory, before their weights are written.

onnxruntime's own quantizer (`MatMulNBitsQuantizer` with its `DefaultWeightOnlyQuantConfig`: round to nearest,
asymmetric blocks; or, for the 4-bit matrices whose algorithm is "hqq", its `HQQWeightOnlyQuantConfig`, whose zero
points are floats the solver fits) replaces each MatMul whose weight is a constant 2-D initializer by a MatMulNBits
node reading `bits`-bit blocks, a scale per block (in the graph's float type: float32, or float16 for CUDA) and a
zero point per block. The lm_head is quantized at the scheme's bits, at 8 bits, or left float, as
`Quantization.lm_head` asks. A Linear that torch.onnx wrote as a Gemm (a tied lm_head on the embedding table,
exporter.export.graphs; a MoE expert on its tokens) is first rewritten as a MatMul on a transposed copy of its
weight, the form the quantizer takes; a MoE router stays float.

The token embedding is quantized at the bits `Quantization.embedding` asks (or left float) as onnxruntime's
GatherBlockQuantized, whose uint8 layout is MatMulNBits': its rows are the blocks the quantizer's own
`qbits_block_quant` makes of the transposed table, as for an lm_head. The quantizer's Gather path is not used: it
writes int4 tensors, which need opset 21 (the artifact is opset 20), and takes no 8 bits. A tied table at the
lm_head's bits therefore gets the lm_head's bytes, which the weights file stores once for both
(exporter.export.weights matches by content). GatherBlockQuantized gives zeros for an id outside the table, where
the float graph's Gather fails (exporter.export.graphs: ids are sent past the table so that Gather fails on them),
so the ids first go through a Gather of the table's row numbers: it passes every id in [0, vocab) unchanged and
fails on the others as the float graph does.

An int8 scheme at accuracy level 4 smooths its projections' inputs (exporter.artifact.quantization, at
SMOOTHING_BITS): each such MatMul first reads Div(x, divisors), and its weight's rows (input channels) are multiplied
by them (smoothed_weight) before the quantizer makes its blocks; the divisors come from exporter.export.smoothing.

The quantizer is deterministic (the same weights give the same bytes), so prefill and decode, which hold the same
weights, get identical quantized initializers and still share one weights file by content; `quantize_graphs`
checks that they do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

from exporter.artifact.quantization import (
    DEFAULT_ALGORITHM,
    GATHER_OP,
    QUANTIZED_OP,
    QUANTIZED_OPS,
    Quantization,
    block_inputs,
    blocks_sum_matrix,
    held_inputs,
    smoothed_weight,
    smoothing_divisors,
    zero_point_fractions,
)
from exporter.artifact.scopes import ROUTER_SCOPE, module_of
from exporter.errors import ExportFailed, InputError

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
TOKEN_IDS = "input_ids"  # the graph input the token embedding reads (exporter.artifact.contract)


GRAPH_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)  # what an exported graph computes in


def _float_matrix(tensor: onnx.TensorProto | None) -> bool:
    return tensor is not None and len(tensor.dims) == 2 and tensor.data_type in GRAPH_FLOAT_TYPES


def _float_bytes(tensor: onnx.TensorProto) -> int:
    return int(np.prod(tensor.dims)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _constant_matmuls(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, onnx.TensorProto]]:
    """The MatMul nodes whose weight (second input) is a 2-D float initializer: what the quantizer replaces."""
    initializers = {t.name: t for t in model.graph.initializer}
    found = []
    for node in model.graph.node:
        tensor = initializers.get(node.input[1]) if node.op_type == "MatMul" and node.domain == "" else None
        if _float_matrix(tensor):
            found.append((node, tensor))
    return found


def quantizable_modules(model, vocab_size: int) -> list[str]:
    """The Linear modules whose weights the export quantizes at the scheme's bits, in the model's order: every
    Linear but the lm_head (of vocabulary width; `lm_head` sets its bits) and a MoE router (kept float)."""
    import torch

    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and module.out_features != vocab_size
        and ROUTER_SCOPE.search(name) is None
    ]


def _smooth(model: onnx.ModelProto, matmuls: list, divisors: dict[str, np.ndarray]) -> None:
    """Each MatMul of `matmuls` ((node, weight)) made to read Div(x, its module's `divisors`), its weight's rows
    times them (the module's docstring); the divisors in its weight's float type."""
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    added = {}
    for node, tensor in matmuls:
        module = module_of(node)
        if readers[tensor.name] != 1:
            raise ExportFailed(f"the weight {tensor.name} of {module} is read by more than its MatMul; cannot smooth")
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        divisor = np.asarray(divisors[module], dtype)
        if divisor.shape != (tensor.dims[0],) or not np.all(np.isfinite(divisor) & (divisor > 0)):
            raise ExportFailed(f"the smoothing divisors of {module} are not {tensor.dims[0]} positive finite numbers")
        weight = numpy_helper.to_array(tensor)  # (K, N): its rows are the input channels
        tensor.CopyFrom(numpy_helper.from_array(smoothed_weight(weight.T, divisor, dtype).T, tensor.name))
        name = f"{module}.input_divisors"
        model.graph.initializer.append(numpy_helper.from_array(divisor, name))
        div = helper.make_node("Div", [node.input[0], name], [f"{node.name}_smoothed"], name=f"{node.name}_smooth")
        div.metadata_props.extend(node.metadata_props)
        node.input[0] = div.output[0]
        added[node.name] = div
    nodes = [new for node in model.graph.node for new in ([added[node.name]] if node.name in added else []) + [node]]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a name: the quantizer selects nodes by name, and names its new ones after them."""
    used = {node.name for node in model.graph.node if node.name}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{index}"
            while node.name in used:
                node.name += "_"
            used.add(node.name)


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _linear_gemms(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, onnx.TensorProto]]:
    """The Gemm(x, W, transB=1) nodes (no bias, alpha 1) on a 2-D float initializer: a Linear on a 2-D input as
    torch.onnx writes it (a tied lm_head, exporter.export.graphs; a MoE expert or router on its tokens)."""
    initializers = {t.name: t for t in model.graph.initializer}
    found = []
    for node in model.graph.node:
        weight = initializers.get(node.input[1]) if node.op_type == "Gemm" and len(node.input) == 2 else None
        attributes = _attributes(node)
        plain = attributes.get("transB") == 1 and not attributes.get("transA") and attributes.get("alpha", 1.0) == 1
        if _float_matrix(weight) and plain:
            found.append((node, weight))
    return found


def _is_router(node: onnx.NodeProto) -> bool:
    return ROUTER_SCOPE.search(module_of(node) or "") is not None


def _gemms_as_matmuls(
    model: onnx.ModelProto, gemms: list[tuple[onnx.NodeProto, onnx.TensorProto]], vocab_size: int, head: bool
) -> dict[str, str]:
    """Rewrite each of the Linear `gemms` (_linear_gemms) as MatMul(x, W^T) on a transposed copy of W, under the
    Gemm's name, the form the quantizer takes; returns {transposed copy: W}. Not rewritten: a MoE router (its scores
    pick the experts, which a rounded weight could flip; llama.cpp keeps routers float too), and the tied lm_head
    unless `head` (it is to be quantized): a float head keeps the Gemm, which reads the table the embedding shares,
    without a second copy."""
    copies: dict[str, str] = {}
    for node, weight in gemms:
        if _is_router(node) or (weight.dims[0] == vocab_size and not head):
            continue
        name = f"{weight.name}_transposed"
        if name not in copies:
            transposed = np.ascontiguousarray(numpy_helper.to_array(weight).T)
            model.graph.initializer.append(numpy_helper.from_array(transposed, name))
            copies[name] = weight.name
        matmul = helper.make_node("MatMul", [node.input[0], name], list(node.output), name=node.name)
        matmul.metadata_props.extend(node.metadata_props)
        _replace_node(model, node, [matmul])
    return copies


def _replace_node(model: onnx.ModelProto, node: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
    """`new` in `node`'s place, in order (the graph's nodes stay topologically sorted)."""
    index = list(model.graph.node).index(node)
    model.graph.node.remove(node)
    for offset, replacement in enumerate(new):
        model.graph.node.insert(index + offset, replacement)


def _reads(model: onnx.ModelProto, value: str, graph_input: str) -> bool:
    """Whether `value` is `graph_input` or computed from it."""
    producers = {out: node for node in model.graph.node for out in node.output}
    seen, pending = set(), [value]
    while pending:
        name = pending.pop()
        if name == graph_input:
            return True
        if name in seen or name not in producers:
            continue
        seen.add(name)
        pending.extend(producers[name].input)
    return False


def _table_gathers(model: onnx.ModelProto, vocab_size: int) -> tuple[list, list]:
    """The Gathers on a 2-D float initializer: (the token embedding's, as (node, table): a vocab_size-row table read
    at ids computed from input_ids; every other one, e.g. a learned position table)."""
    initializers = {t.name: t for t in model.graph.initializer}
    tokens, others = [], []
    for node in model.graph.node:
        table = initializers.get(node.input[0]) if node.op_type == "Gather" and node.domain == "" else None
        if not _float_matrix(table):
            continue
        token = (
            table.dims[0] == vocab_size
            and not _attributes(node).get("axis")
            and _reads(model, node.input[1], TOKEN_IDS)
        )
        (tokens if token else others).append((node, table))
    return tokens, others


def _run_quantizer(
    model: onnx.ModelProto,
    bits: int,
    scheme: Quantization,
    include: list[str],
    accuracy_level: int | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
) -> onnx.ModelProto:
    """`model` with the MatMuls named in `include` quantized at `bits` by `algorithm` (ALGORITHMS), accuracy level
    `accuracy_level` (None: the scheme's)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    if not include:
        return model
    level = scheme.accuracy_level if accuracy_level is None else accuracy_level
    # onnxruntime's quantizer takes a node listed in nodes_to_include *or* of a type in op_types_to_quantize: the
    # include list widens, never narrows. Every other MatMul is therefore excluded by name, which it honours first.
    exclude = [node.name for node in model.graph.node if node.op_type == "MatMul" and node.name not in include]
    if algorithm == "hqq":
        # asymmetric always (a float zero point per block); it writes no accuracy_level, given below
        config = HQQWeightOnlyQuantConfig(block_size=scheme.block_size, bits=bits, op_types_to_quantize=("MatMul",))
    else:
        config = DefaultWeightOnlyQuantConfig(
            block_size=scheme.block_size,
            is_symmetric=scheme.symmetric,
            accuracy_level=level or None,
            bits=bits,
            op_types_to_quantize=("MatMul",),
        )
    # The quantizer drops each MatMul's scope metadata; its MatMulNBits writes the MatMul's output, by which the
    # scope is given back: the weight audit places each block in its module by it
    # (exporter/verify/checks/weights/quantized.py).
    scopes = {node.output[0]: list(node.metadata_props) for node in model.graph.node if node.name in include}
    quantizer = MatMulNBitsQuantizer(model, nodes_to_include=include, nodes_to_exclude=exclude, algo_config=config)
    noise = io.StringIO()
    with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
        quantizer.process()
    quantized = quantizer.model.model
    for node in quantized.graph.node:
        if node.op_type != QUANTIZED_OP or node.output[0] not in scopes:
            continue
        if not node.metadata_props:
            node.metadata_props.extend(scopes[node.output[0]])
        if algorithm == "hqq" and level:
            node.attribute.append(helper.make_attribute("accuracy_level", level))
    if algorithm == "hqq":
        _integer_zero_points(quantized, set(scopes))
    return quantized


def _integer_zero_points(model: onnx.ModelProto, outputs: set[str]) -> None:
    """Rewrite each HQQ MatMulNBits (float zero points) writing one of `outputs` as onnxruntime's CPU kernels run
    fast: MatMulNBits on the zero points rounded to integers, plus what the rounding left, added back exactly.

    A block's weights are (q - z)·s = (q - round(z))·s + (round(z) - z)·s: the second term is one number per block,
    so it adds to the output the sum of the block's inputs times that number. The graph computes it as
    Add(MatMulNBits(x), MatMul(MatMul(x, blocks_sum), fractions)): `blocks_sum` the (K, blocks) 0/1 matrix that sums
    each block of x (one per input and block size), `fractions` the (blocks, N) float matrix of (round(z) - z)·s
    (exporter.artifact.quantization.zero_point_fractions finds them). onnxruntime's CPU MatMulNBits has fast kernels
    for integer zero points only; float ones fall back to dequantizing every block at every call."""
    initializers = {t.name: t for t in model.graph.initializer}
    sums: dict[tuple[str, int, int], str] = {}  # (input, K, block) -> its block sums
    rewritten = []
    for node in model.graph.node:
        zero_points = initializers.get(node.input[3]) if node.op_type == QUANTIZED_OP and len(node.input) > 3 else None
        if node.output[0] not in outputs or zero_points is None or zero_points.data_type not in GRAPH_FLOAT_TYPES:
            rewritten.append(node)
            continue
        attributes = _attributes(node)
        n, k, bits, block = attributes["N"], attributes["K"], attributes["bits"], attributes["block_size"]
        float_type = helper.tensor_dtype_to_np_dtype(zero_points.data_type)
        scales = numpy_helper.to_array(initializers[node.input[2]])
        packed, fractions = split_zero_points(numpy_helper.to_array(zero_points), scales, n, bits, float_type)
        integer_name, fractions_name = f"{zero_points.name}_integer", f"{zero_points.name}_fractions"
        model.graph.initializer.extend(
            [numpy_helper.from_array(packed, integer_name), numpy_helper.from_array(fractions, fractions_name)]
        )
        key = (node.input[0], k, block)
        if key not in sums:
            ones = f"blocks_sum_{k}_{block}"
            if ones not in initializers:
                initializers[ones] = numpy_helper.from_array(blocks_sum_matrix(k, block, float_type), ones)
                model.graph.initializer.append(initializers[ones])
            sums[key] = f"{node.name}_blocks_sum"
            rewritten.append(helper.make_node("MatMul", [node.input[0], ones], [sums[key]], name=sums[key]))
        output = node.output[0]
        node.input[3], node.output[0] = integer_name, f"{output}_integer_zero_points"
        correction = helper.make_node(
            "MatMul", [sums[key], fractions_name], [f"{output}_fractions"], name=f"{node.name}_fractions"
        )
        add = helper.make_node(
            "Add", [node.output[0], correction.output[0]], [output], name=f"{node.name}_add_fractions"
        )
        for new in (correction, add):
            new.metadata_props.extend(node.metadata_props)
        rewritten += [node, correction, add]
    del model.graph.node[:]
    model.graph.node.extend(rewritten)


def split_zero_points(
    zero_points: np.ndarray, scales: np.ndarray, n: int, bits: int, float_type
) -> tuple[np.ndarray, np.ndarray]:
    """HQQ's float `zero_points` (N x blocks,) as the graph holds them (_integer_zero_points): rounded to integers in
    [0, 2^bits - 1], in MatMulNBits' packed layout (per row, 4-bit ones two to a byte, the even block's in the low
    nibble, the row padded to whole bytes; 8-bit ones a byte each; flat), and the fractions (round(z) - z) · scale
    that the rounding left, (blocks, N) in `float_type`."""
    zero = np.asarray(zero_points, np.float64).reshape(n, -1)
    rounded = np.clip(np.rint(zero), 0, 2**bits - 1)
    fractions = np.ascontiguousarray(((rounded - zero) * np.asarray(scales, np.float64).reshape(n, -1)).T)
    integers = rounded.astype(np.uint8)
    if bits == 8:
        return integers.reshape(-1), fractions.astype(float_type)
    padded = np.zeros((n, integers.shape[1] + integers.shape[1] % 2), np.uint8)
    padded[:, : integers.shape[1]] = integers
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1), fractions.astype(float_type)


def matrix_blocks(weight: np.ndarray, bits: int, scheme: Quantization) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The MatMulNBits blocks, scales and zero points onnxruntime's quantizer makes of a Linear's `weight` (out, in)
    at `bits` with `scheme`'s block size and symmetry: its blocks run along `in`, the reduced axis."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=scheme.block_size, is_symmetric=scheme.symmetric, bits=bits)
    return DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(weight.T))


def hqq_matrix_blocks(weight: np.ndarray, bits: int, scheme: Quantization) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The MatMulNBits blocks, float32 scales and float32 zero points onnxruntime's HQQ (`HQQWeightOnlyQuantizer`,
    as `_run_quantizer` runs it) makes of a Linear's `weight` (out, in) at `bits` with `scheme`'s block size: (out,
    blocks x block x bits / 8), (out x blocks,) each."""
    import torch
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    quantizer = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=scheme.block_size, bits=bits))
    matrix = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
    codes, scales, zero_points = quantizer.quantize_internal(matrix, bits=bits, group_size=scheme.block_size)
    q = codes.numpy().astype(np.uint8).reshape(weight.shape[0], -1, scheme.block_size)
    packed = q if bits == 8 else q[..., 0::2] | (q[..., 1::2] << 4)  # MatMulNBits: the even code in the low nibble
    return packed.reshape(weight.shape[0], -1), scales.numpy().reshape(-1), zero_points.numpy().reshape(-1)


def _quantize_embedding(
    model: onnx.ModelProto, node: onnx.NodeProto, table: onnx.TensorProto, bits: int, scheme: Quantization
) -> None:
    """Replace the token embedding's Gather by GatherBlockQuantized on `bits`-bit rows of `table`, behind the Gather
    of row numbers that fails on ids outside the table (the module's docstring)."""
    # MatMulNBits blocks of the (hidden, vocab) matrix: per vocab row, its blocks along the hidden axis
    packed, scales, zero_points = matrix_blocks(numpy_helper.to_array(table), bits, scheme)
    rows = table.dims[0]
    prefix = f"{table.name}_rows_Q{bits}"
    tensors = [
        numpy_helper.from_array(packed.reshape(rows, -1), prefix),
        numpy_helper.from_array(np.arange(rows, dtype=np.int64), f"{table.name}_row_ids"),
        numpy_helper.from_array(scales, f"{prefix}_scales"),
    ]
    if not scheme.symmetric:
        tensors.append(numpy_helper.from_array(zero_points, f"{prefix}_zero_points"))
    data, row_ids, *quantization = (t.name for t in tensors)
    checked = f"{node.output[0]}_checked_ids"
    guard = helper.make_node("Gather", [row_ids, node.input[1]], [checked], name=f"{node.name}_ids_in_table", axis=0)
    lookup = helper.make_node(
        GATHER_OP,
        [data, checked, *quantization],
        list(node.output),
        name=f"{node.name}_Q{bits}",
        domain=MS_DOMAIN,
        bits=bits,
        block_size=scheme.block_size,
        gather_axis=0,
        quantize_axis=1,
    )
    for new in (guard, lookup):
        new.metadata_props.extend(node.metadata_props)
    _replace_node(model, node, [guard, lookup])
    model.graph.initializer.extend(tensors)
    if not any(entry.domain == MS_DOMAIN for entry in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


def _drop_unread_initializers(model: onnx.ModelProto) -> None:
    """Drop the initializers no node reads any more: a tied table once both its readers are quantized."""
    read = {name for node in model.graph.node for name in node.input}
    kept = [t for t in model.graph.initializer if t.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def _digest(tensor: onnx.TensorProto) -> str:
    return hashlib.sha256(tensor.raw_data or numpy_helper.to_array(tensor).tobytes()).hexdigest()


def _quantize_one(
    model: onnx.ModelProto, scheme: Quantization, vocab_size: int, divisors: dict[str, np.ndarray]
) -> tuple[onnx.ModelProto, dict]:
    """One graph quantized, the inputs of the projections `scheme` smooths divided by `divisors` (by module); with
    what stayed float, the matrices quantized and their bytes before and after."""
    _name_nodes(model)
    head_bits = scheme.bits_for(scheme.lm_head)
    embedding_bits = scheme.bits_for(scheme.embedding)
    gemms = _linear_gemms(model)
    tied = any(weight.dims[0] == vocab_size for _, weight in gemms)
    routers = [node for node, _ in gemms if _is_router(node)]  # left as they are by the rewrite below
    copies = _gemms_as_matmuls(model, gemms, vocab_size, head=head_bits is not None)
    matmuls = _constant_matmuls(model)
    heads = [node.name for node, tensor in matmuls if tensor.dims[1] == vocab_size]
    body = [node.name for node, tensor in matmuls if tensor.dims[1] != vocab_size]
    # the body's MatMuls by the (bits, accuracy level, algorithm) the scheme or its mix gives their module; bits
    # None: float
    groups: dict[tuple[int | None, int, str], list[str]] = {}
    for node, _ in matmuls:
        if node.name in body:
            module = module_of(node) or ""
            entry = scheme.precision_of(module)
            bits, level = (scheme.bits, scheme.accuracy_level) if entry is None else (entry.bits, entry.accuracy_level)
            algorithm = scheme.algorithm_for(module, bits) if bits is not None else DEFAULT_ALGORITHM
            groups.setdefault((bits, level, algorithm), []).append(node.name)
    unmatched = sorted({m.module for m in scheme.mix} - {module_of(n) for n, _ in matmuls if n.name in body})
    if unmatched:
        raise InputError(
            f"the mix names {len(unmatched)} module(s) whose weights are no projection of this model's graphs, e.g. "
            f"{unmatched[0]!r}; name Linear modules other than the lm_head and a MoE router (`mix`)"
        )
    smoothed = {module_of(n) for n, _ in matmuls if n.name in body and scheme.smooths(module_of(n) or "")}
    if smoothed - set(divisors):
        raise ExportFailed(f"no smoothing divisors were measured for {sorted(smoothed - set(divisors))[0]}")
    _smooth(model, [(n, t) for n, t in matmuls if module_of(n) in smoothed], divisors)
    mixed_float = {name for (bits, _, _), names in groups.items() if bits is None for name in names}
    body = [name for name in body if name not in mixed_float]
    tokens, others = _table_gathers(model, vocab_size)
    # float bytes of each quantized source matrix, by name: a tied table quantized for both counts once
    sources = {copies.get(t.name, t.name): _float_bytes(t) for n, t in matmuls if n.name in body}
    kept = [
        f"{module_of(n) or n.name} (a Gather not on the token ids: only the token embedding is quantized)"
        for n, _ in others
    ]
    kept += [f"{module_of(node)} (a MoE router: its scores pick the experts)" for node in routers]
    kept += [f"{module_of(n)} (the quality target's mix)" for n, _ in matmuls if n.name in mixed_float]
    if head_bits is None:
        kept += ["lm_head (asked: lm_head float)"] if heads or tied else []
    else:
        sources.update({copies.get(t.name, t.name): _float_bytes(t) for n, t in matmuls if n.name in heads})
    if embedding_bits is None:
        kept += [f"{module_of(n) or n.name} (asked: embedding float)" for n, _ in tokens]
    else:
        sources.update({t.name: _float_bytes(t) for _, t in tokens})
        for node, table in tokens:
            _quantize_embedding(model, node, table, embedding_bits, scheme)
    if heads and head_bits is not None and head_bits != scheme.bits:
        model = _run_quantizer(model, head_bits, scheme, heads)
    head_group = (scheme.bits, scheme.accuracy_level, scheme.algorithm_for("lm_head", scheme.bits))
    groups.setdefault(head_group, []).extend(heads if head_bits == scheme.bits else [])
    for (bits, level, algorithm), names in groups.items():
        if bits is not None:
            model = _run_quantizer(model, bits, scheme, names, level, algorithm)
    _drop_unread_initializers(model)
    left = {node.name for node, _ in _constant_matmuls(model)}
    unexpected = sorted(left & set(body + (heads if head_bits is not None else [])))
    if unexpected:
        raise ExportFailed(f"onnxruntime's quantizer left {len(unexpected)} MatMul weight(s) float: {unexpected[:3]}")
    initializers = {t.name: t for t in model.graph.initializer}
    quantized = [n for n in model.graph.node if n.op_type in QUANTIZED_OPS]
    # by content: a tied table at one bits is the same blocks for both nodes, stored once
    blocks = {_digest(initializers[name]): initializers[name] for names in _held(model).values() for name in names}
    matrices = {_digest(initializers[block_inputs(n)[0]]) for n in quantized}
    quantized_bytes = sum(len(t.raw_data) or numpy_helper.to_array(t).nbytes for t in blocks.values())
    return model, {
        "kept_float": kept,
        "matrices": len(matrices),
        "float": sum(sources.values()),
        "quantized": quantized_bytes,
    }


def _held(model: onnx.ModelProto) -> dict[str, list[str]]:
    """By quantized node name, the initializers that hold its matrix: blocks, scales, zero points and, for an HQQ
    node, its zero points' fractions and the block-sum matrix; for a smoothed one, its input's divisors."""
    fractions, divisors = zero_point_fractions(model.graph), smoothing_divisors(model.graph)
    return {
        node.name: held_inputs(node, fractions, divisors) for node in model.graph.node if node.op_type in QUANTIZED_OPS
    }


def _quantized_keys(model: onnx.ModelProto) -> set[tuple]:
    initializers = {t.name: t for t in model.graph.initializer}
    return {
        (initializers[name].data_type, tuple(initializers[name].dims), _digest(initializers[name]))
        for names in _held(model).values()
        for name in names
    }


def quantize_graphs(
    prefill: onnx.ModelProto,
    decode: onnx.ModelProto,
    scheme: Quantization,
    vocab_size: int,
    divisors: dict[str, np.ndarray] | None = None,
) -> tuple[onnx.ModelProto, onnx.ModelProto, Quantization]:
    """Both graphs with their MatMul weights (and the token embedding, unless kept float) quantized as `scheme`
    asks, the inputs of the projections it smooths divided by `divisors` ({module: (in,) positive}, from
    exporter.export.smoothing), and the scheme with what was done (matrices, bytes, what stayed float).

    Raises:
        ExportFailed: the quantizer failed, left a projection float, or gave the two graphs different blocks.
    """
    try:
        prefill, done = _quantize_one(prefill, scheme, vocab_size, divisors or {})
        decode, done_decode = _quantize_one(decode, scheme, vocab_size, divisors or {})
    except (ExportFailed, InputError):
        raise
    except Exception as exc:  # the quantizer's own errors, of any type
        raise ExportFailed(f"onnxruntime's quantizer failed: {type(exc).__name__}: {exc}") from exc
    if _quantized_keys(prefill) != _quantized_keys(decode) or done != done_decode:
        raise ExportFailed(
            "prefill and decode got different quantized weights, which they could no longer share; "
            "report this with the model's config"
        )
    log.info(
        "quantized %d weight matrices to %s (block %d; lm_head %s, embedding %s%s): %.2f MB float -> %.2f MB",
        done["matrices"],
        scheme.scheme,
        scheme.block_size,
        scheme.lm_head,
        scheme.embedding,
        f"; {len(scheme.mix)} module(s) at the mix's precisions" if scheme.mix else "",
        done["float"] / 1e6,
        done["quantized"] / 1e6,
    )
    return (
        prefill,
        decode,
        dataclasses.replace(
            scheme,
            kept_float=tuple(done["kept_float"]),
            matrices=done["matrices"],
            float_bytes=done["float"],
            quantized_bytes=done["quantized"],
        ),
    )
