"""Tracing: the reference model as torch.onnx exports it, once for both graphs.

One program is traced (decode.onnx's, with prefill.onnx's labels and loss added: traced_contract) on example inputs
whose sizes no axis can be specialised to, its axes tied to the contract's names; both graphs are then cut from it
(graph_passes.cut). A deep model whose layers repeat is traced a few layers deep and grown to its depth
(layer_template).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import re
import time
import warnings

import onnx
import onnx_ir as ir
import torch
from torch.export import Dim

from exporter.artifact.contract import TOTAL, GraphContract, cache_layout, decode_contract, prefill_contract
from exporter.errors import ExportFailed, first_line
from exporter.export import LIBRARY_LOGGERS
from exporter.export.graph_passes import cut
from exporter.export.graphs import DecodeGraph
from exporter.export.layer_template import LayerTemplate
from reference.families import family_of
from reference.layers import TORCH_DTYPES
from reference.quiet import quiet_loggers

log = logging.getLogger(__name__)

OPSET = 20
# Example sizes for tracing; none is 0 or 1, so no axis can be specialised to them.
EXAMPLE_BATCH, EXAMPLE_SEQUENCE, EXAMPLE_PAST = 2, 3, 4


def _dynamic_shapes(contract: GraphContract, argument_names: list[str]) -> dict:
    # One Dim object per contract axis name, so torch.export ties equal axes together.
    # The total length (past + sequence) is a sum of two dims, which Dim cannot
    # express, so it is left to torch.export to derive (Dim.AUTO).
    dims: dict[str, object] = {}
    shapes = {}
    specs = {spec.name: spec for spec in contract.inputs}

    def axes_of(spec):
        return {
            i: Dim.AUTO if axis == TOTAL else dims.setdefault(axis, Dim(axis))
            for i, axis in enumerate(spec.axes)
            if isinstance(axis, str)
        }

    for name in argument_names:
        if name == "past_key_values":
            shapes[name] = [axes_of(s) for s in contract.inputs if s.name.startswith("past_key_values.")]
        else:
            shapes[name] = axes_of(specs[name])
    return shapes


def example_inputs(config, dtype: torch.dtype, with_loss: bool, past: bool):
    """The tracing example: a prompt (`past` False), or new tokens on a cache; labels with_loss."""
    generator = torch.Generator().manual_seed(0)
    b, t, p = EXAMPLE_BATCH, EXAMPLE_SEQUENCE, EXAMPLE_PAST
    input_ids = torch.randint(0, config.vocab_size, (b, t), generator=generator)
    total = p + t if past else t
    mask = torch.ones(b, total, dtype=torch.int64)
    position_ids = torch.arange(total - t, total).expand(b, t).contiguous()
    args, names = [input_ids, mask, position_ids], ["input_ids", "attention_mask", "position_ids"]
    if past:
        cache = cache_layout(config, "")
        kv = [
            torch.randn(b, cache.num_key_value_heads, p, cache.head_dim, generator=generator).to(dtype)
            for _ in range(2 * cache.num_layers)
        ]
        args, names = [*args, kv], [*names, "past_key_values"]
    if with_loss:
        labels = input_ids.clone()
        labels[:, 0] = -100
        args, names = [*args, labels], [*names, "labels"]
    return tuple(args), names


def _torch_export(module, args, argument_names, contract: GraphContract) -> ir.Model:
    """The graph torch.onnx builds (optimised), its weights still in memory: the caller moves them out
    (SharedWeightsWriter.add) before anything serialises it, which would copy every one of them."""
    log.info("exporting %s with torch.onnx (dynamo)", contract.file)
    start = time.perf_counter()
    noise = io.StringIO()
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(noise),
            contextlib.redirect_stderr(noise),
            quiet_loggers(*LIBRARY_LOGGERS),
        ):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                opset_version=OPSET,
                optimize=True,
                verbose=False,
                input_names=contract.input_names,
                output_names=contract.output_names,
                dynamic_shapes=_dynamic_shapes(contract, argument_names),
            )
    except Exception as exc:  # torch.onnx raises many unrelated types; report them as one failure
        log.debug("torch.onnx output:\n%s", noise.getvalue())
        cause = _root_cause(exc)
        raise ExportFailed(
            f"torch.onnx could not export {contract.file}: {type(cause).__name__}: "
            f"{_ANSI.sub('', first_line(cause))}{_raising_line(cause)}"
        ) from exc
    log.info("exported %s in %.1f s", contract.file, time.perf_counter() - start)
    return program.model


def traced_contract(config, dtype: str, with_loss: bool) -> GraphContract:
    """The program traced once for both graphs: decode.onnx's inputs and outputs, and prefill.onnx's labels and
    loss with_loss."""
    decode = decode_contract(config, dtype)
    prefill = prefill_contract(config, dtype, with_loss)
    extra_inputs = [s for s in prefill.inputs if s.name not in decode.input_names]
    extra_outputs = [s for s in prefill.outputs if s.name not in decode.output_names]
    return GraphContract(
        f"{prefill.file} and {decode.file}", (*decode.inputs, *extra_inputs), (*decode.outputs, *extra_outputs)
    )


def _export_graph(model, template: LayerTemplate | None, dtype: str, with_loss: bool) -> ir.Model:
    """The program both graphs are cut from (traced_contract) as torch.onnx builds it, its weights in memory:
    traced three layers deep and grown to the model's depth where the model's layers repeat
    (exporter/export/layer_template.py), traced whole otherwise."""
    if template is not None:
        graph = template.expand(trace(template.short_model, dtype, with_loss))
        if graph is not None:
            return graph
    return trace(model, dtype, with_loss)


def trace(model, dtype: str, with_loss: bool) -> ir.Model:
    config = family_of(model.config).own_config(model.config)
    contract = traced_contract(config, dtype, with_loss)
    args, names = example_inputs(config, TORCH_DTYPES[dtype], with_loss, past=True)
    return _torch_export(DecodeGraph(model, with_loss), args, names, contract)


def traced_graphs(model, template, dtype: str, with_loss: bool, store, contracts) -> tuple:
    """(prefill.onnx, decode.onnx) cut from the one traced program, which `store` made a ModelProto (its weights
    moved to the shared file, or kept inline for quantization)."""
    traced = store(_export_graph(model, template, dtype, with_loss))
    prefill, decode = contracts
    return cut(_copy_proto(traced), prefill), cut(traced, decode)


def _copy_proto(model: onnx.ModelProto) -> onnx.ModelProto:
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    return copied


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch.onnx colours its messages for a terminal
_RAISING_CALL = re.compile(
    r'The following call raised this error:\n\s*File "([^"]+)", line (\d+), in (\S+)'
    r"(?:\n[ \t]+(\S.*))?"
)


def _raising_line(cause: BaseException) -> str:
    """Where in the model's code torch.export stopped, which torch names only far down its message (after
    the advice on its own APIs): for a branch on tensor values, the user's `if`."""
    call = _RAISING_CALL.search(str(cause))
    if call is None:
        return ""
    file, line, function, code = call.groups()
    return f", raised by {file}:{line} in {function}" + ("" if code is None else f": `{code.strip()}`")


def _root_cause(exc: BaseException) -> BaseException:
    """The error torch.onnx wraps. Its own first line only says which of its three steps failed
    ("Failed to export the model with torch.export. This is step 1/3 ... Next steps:"); the wrapped
    one names the model's problem: a data-dependent branch, an op without an ONNX translation, a
    forward that returned a tuple."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def copy_for_export(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The module tree, copied so that export can rewire it (share_tied_table, eval) without touching
    the caller's model; its weights are the caller's own tensors when they already have `dtype`.

    torch.export keeps references to the tensors it traced for the rest of the process, out of
    Python's reach (no gc referrer holds them). Weights copied for export would therefore stay
    resident beside the caller's model, a second copy of every weight for the rest of the process.
    """
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.dtype == dtype for t in tensors if t.is_floating_point()):
        return copy.deepcopy(model, memo={id(t): t for t in tensors}).eval()
    return copy.deepcopy(model).to(dtype).eval()
