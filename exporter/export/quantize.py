"""Weight-only quantization of the exported float32 graphs, in memory, before their weights are written.

onnxruntime's own quantizer (`MatMulNBitsQuantizer` with its `DefaultWeightOnlyQuantConfig`: round to nearest,
asymmetric blocks) replaces each MatMul whose weight is a constant 2-D initializer by a MatMulNBits node reading
`bits`-bit blocks, a float32 scale per block and a zero point per block. Nothing else is touched: the embedding
is a Gather (it stays float), and a tied lm_head is a Gemm on the embedding table (it stays float with it). An
untied lm_head is a MatMul like any projection: it is quantized at the scheme's bits, at 8 bits, or excluded, as
`Quantization.lm_head` asks.

The quantizer is deterministic (the same weights give the same bytes), so prefill and decode, which hold the same
weights, get identical quantized initializers and still share one weights file by content
(exporter.export.weights); `quantize_graphs` checks that they do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging

import numpy as np
import onnx
from onnx import numpy_helper

from exporter.artifact.quantization import QUANTIZED_OP, Quantization
from exporter.errors import ExportFailed
from exporter.verify.diagnosis.probe import module_of

log = logging.getLogger(__name__)


def _constant_matmuls(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, onnx.TensorProto]]:
    """The MatMul nodes whose weight (second input) is a 2-D float32 initializer: what the quantizer replaces."""
    initializers = {t.name: t for t in model.graph.initializer}
    found = []
    for node in model.graph.node:
        tensor = initializers.get(node.input[1]) if node.op_type == "MatMul" and node.domain == "" else None
        if tensor is not None and len(tensor.dims) == 2 and tensor.data_type == onnx.TensorProto.FLOAT:
            found.append((node, tensor))
    return found


def _name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a name: the quantizer selects nodes by name, and names its new ones after them."""
    used = {node.name for node in model.graph.node if node.name}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{index}"
            while node.name in used:
                node.name += "_"
            used.add(node.name)


def _run_quantizer(model: onnx.ModelProto, bits: int, scheme: Quantization, include: list[str]) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if not include:
        return model
    # onnxruntime's quantizer takes a node listed in nodes_to_include *or* of a type in op_types_to_quantize: the
    # include list widens, never narrows. Every other MatMul is therefore excluded by name, which it honours first.
    exclude = [node.name for node in model.graph.node if node.op_type == "MatMul" and node.name not in include]
    config = DefaultWeightOnlyQuantConfig(
        block_size=scheme.block_size,
        is_symmetric=scheme.symmetric,
        accuracy_level=scheme.accuracy_level or None,
        bits=bits,
        op_types_to_quantize=("MatMul",),
    )
    quantizer = MatMulNBitsQuantizer(model, nodes_to_include=include, nodes_to_exclude=exclude, algo_config=config)
    noise = io.StringIO()
    with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
        quantizer.process()
    return quantizer.model.model


def _quantize_one(model: onnx.ModelProto, scheme: Quantization, vocab_size: int) -> tuple[onnx.ModelProto, dict]:
    """One graph quantized; with what stayed float and the bytes before and after."""
    _name_nodes(model)
    matmuls = _constant_matmuls(model)
    heads = [node.name for node, tensor in matmuls if tensor.dims[1] == vocab_size]
    body = [node.name for node, tensor in matmuls if tensor.dims[1] != vocab_size]
    float_bytes = sum(int(np.prod(t.dims)) * 4 for _, t in matmuls)
    tables = {t.name for t in model.graph.initializer if len(t.dims) == 2 and t.data_type == onnx.TensorProto.FLOAT}
    kept = [
        f"{module_of(n) or n.name} (a Gather: onnxruntime's quantizer takes MatMul weights only)"
        for n in model.graph.node
        if n.op_type == "Gather" and n.input[0] in tables
    ]
    if any(node.op_type == "Gemm" for node in model.graph.node):
        kept += ["lm_head (a Gemm on the tied embedding table, which stays float with the embedding)"]
    if heads and scheme.lm_head == "float":
        kept += ["lm_head (asked: lm_head float)"]
        float_bytes -= sum(int(np.prod(t.dims)) * 4 for n, t in matmuls if n.name in heads)
    head_bits = {"float": None, "int8": 8, "same": scheme.bits}[scheme.lm_head]
    if heads and head_bits is not None and head_bits != scheme.bits:
        model = _run_quantizer(model, head_bits, scheme, heads)
        heads = []
    model = _run_quantizer(model, scheme.bits, scheme, body + (heads if head_bits == scheme.bits else []))
    left = {node.name for node, _ in _constant_matmuls(model)}
    quantized = [n for n in model.graph.node if n.op_type == QUANTIZED_OP]
    initializers = {t.name: t for t in model.graph.initializer}
    quantized_bytes = sum(
        len(initializers[name].raw_data) or numpy_helper.to_array(initializers[name]).nbytes
        for node in quantized
        for name in node.input[1:]
        if name in initializers
    )
    unexpected = sorted(left & set(body))
    if unexpected:
        raise ExportFailed(f"onnxruntime's quantizer left {len(unexpected)} MatMul weight(s) float: {unexpected[:3]}")
    return model, {"kept_float": kept, "matrices": len(quantized), "float": float_bytes, "quantized": quantized_bytes}


def _quantized_keys(model: onnx.ModelProto) -> set[tuple]:
    initializers = {t.name: t for t in model.graph.initializer}
    keys = set()
    for node in model.graph.node:
        if node.op_type == QUANTIZED_OP:
            for name in node.input[1:]:
                tensor = initializers[name]
                data = tensor.raw_data or numpy_helper.to_array(tensor).tobytes()
                keys.add((tensor.data_type, tuple(tensor.dims), hashlib.sha256(data).hexdigest()))
    return keys


def quantize_graphs(
    prefill: onnx.ModelProto, decode: onnx.ModelProto, scheme: Quantization, vocab_size: int
) -> tuple[onnx.ModelProto, onnx.ModelProto, Quantization]:
    """Both graphs with their MatMul weights quantized as `scheme` asks, and the scheme with what was done
    (matrices, bytes, what stayed float).

    Raises:
        ExportFailed: the quantizer failed, left a projection float, or gave the two graphs different blocks.
    """
    try:
        prefill, done = _quantize_one(prefill, scheme, vocab_size)
        decode, done_decode = _quantize_one(decode, scheme, vocab_size)
    except ExportFailed:
        raise
    except Exception as exc:  # the quantizer's own errors, of any type
        raise ExportFailed(f"onnxruntime's quantizer failed: {type(exc).__name__}: {exc}") from exc
    if _quantized_keys(prefill) != _quantized_keys(decode) or done != done_decode:
        raise ExportFailed(
            "prefill and decode got different quantized weights, which they could no longer share; "
            "report this with the model's config"
        )
    log.info(
        "quantized %d weight matrices to %s (block %d): %.2f MB float32 -> %.2f MB",
        done["matrices"],
        scheme.scheme,
        scheme.block_size,
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
