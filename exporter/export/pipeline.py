"""Export a reference model as prefill.onnx + decode.onnx into an artifact folder.

The folder is built in a temporary sibling, checked (onnx.checker, the axis
lint, a smoke run in ONNX Runtime) and only then moved into place, so a failed
or interrupted export never touches an earlier artifact at the destination.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import glob
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import torch
from onnx import helper, numpy_helper
from torch.export import Dim

from exporter.artifact.axes import name_axes
from exporter.artifact.consumers import check_context_length, write_consumer_files
from exporter.artifact.contract import DTYPES, TOTAL, GraphContract, cache_layout, decode_contract, prefill_contract
from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import MANIFEST, Manifest, file_entries, listed_files, source_problem
from exporter.artifact.paths import check_output_path, check_text_path, folder_lock, parents_removed_unless_done
from exporter.artifact.quantization import (
    SCHEMES,
    Quantization,
    activations_dtype,
    requested_scheme,
)
from exporter.artifact.tokenizer import TokenizerSource, export_tokenizer
from exporter.errors import ExportFailed, GraphRunError, InputError, OutputPathError, check_flag, first_line, first_of
from exporter.export import LIBRARY_LOGGERS
from exporter.export.graphs import DecodeGraph, share_tied_table
from exporter.export.layer_template import LayerTemplate
from exporter.export.quantize import quantize_graphs
from exporter.export.weights import SharedWeightsWriter
from exporter.runtime.runner import OrtRunner, position_ids_from_mask
from exporter.runtime.sessions import checking_settings
from exporter.tolerances import profile_for
from reference.families import family_of
from reference.layers import TORCH_DTYPES
from reference.quiet import quiet_loggers
from reference.source import SourcedModel

log = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.onnx.data"
OPSET = 20
# Example sizes for tracing; none is 0 or 1, so no axis can be specialised to them.
EXAMPLE_BATCH, EXAMPLE_SEQUENCE, EXAMPLE_PAST = 2, 3, 4


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    manifest: Manifest
    seconds: float
    bytes: int  # all files of the artifact

    def to_dict(self) -> dict:
        return {
            "folder": str(self.folder),
            "dtype": self.manifest.precision,
            **({"quantization": q.to_dict()} if (q := self.manifest.quantization) is not None else {}),
            "seconds": round(self.seconds, 2),
            "bytes": self.bytes,
            "files": self.manifest.files,
        }


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


def _example_inputs(config, dtype: torch.dtype, with_loss: bool, past: bool):
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
        graph = template.expand(_trace(template.short_model, dtype, with_loss))
        if graph is not None:
            return graph
    return _trace(model, dtype, with_loss)


def _trace(model, dtype: str, with_loss: bool) -> ir.Model:
    config = family_of(model.config).own_config(model.config)
    contract = traced_contract(config, dtype, with_loss)
    args, names = _example_inputs(config, TORCH_DTYPES[dtype], with_loss, past=True)
    return _torch_export(DecodeGraph(model, with_loss), args, names, contract)


def _traced_graphs(model, template, dtype: str, with_loss: bool, store, contracts) -> tuple:
    """(prefill.onnx, decode.onnx) cut from the one traced program, which `store` made a ModelProto (its weights
    moved to the shared file, or kept inline for quantization)."""
    traced = store(_export_graph(model, template, dtype, with_loss))
    prefill, decode = contracts
    return _cut(_copy_proto(traced), prefill), _cut(traced, decode)


def _cut(model: onnx.ModelProto, contract: GraphContract) -> onnx.ModelProto:
    """The graph of `contract` cut from the traced program `model`, in place: only the contract's outputs and what
    computes them; a past input the contract lacks (prefill.onnx) becomes an empty (B, Hkv, 0, D) tensor, B read
    from input_ids, so that the graph computes the program on an empty cache."""
    graph = model.graph
    outputs = {o.name: o for o in graph.output}
    inputs = {i.name: i for i in graph.input}
    del graph.output[:]
    graph.output.extend(outputs[name] for name in contract.output_names)
    empty_nodes = []
    shapes: dict[tuple, str] = {}
    for name, value in inputs.items():
        if name in contract.input_names:
            continue
        if not name.startswith("past_key_values."):
            # labels, which the loss reads, and torch.export may read for the batch and sequence sizes it shares
            # with input_ids (both (batch, sequence) by the contract): those sizes are read from input_ids
            for node in graph.node:
                if node.op_type == "Shape" and node.input[0] == name:
                    node.input[0] = "input_ids"
            continue
        tensor = value.type.tensor_type
        _, heads, _, head_dim = (d.dim_value for d in tensor.shape.dim)
        key = (tensor.elem_type, heads, head_dim)
        if key not in shapes:
            shapes[key] = f"empty_past_{len(shapes)}"
            batch, sizes = f"{shapes[key]}_batch", f"{shapes[key]}_shape"
            empty_nodes += [
                helper.make_node("Shape", ["input_ids"], [batch], start=0, end=1),
                helper.make_node("Concat", [batch, f"{sizes}_rest"], [sizes], axis=0),
            ]
            graph.initializer.append(
                numpy_helper.from_array(np.array([heads, 0, head_dim], dtype=np.int64), f"{sizes}_rest")
            )
            zero = helper.make_tensor("value", tensor.elem_type, [1], [0])
            empty_nodes.append(helper.make_node("ConstantOfShape", [sizes], [shapes[key]], value=zero))
        empty_nodes.append(helper.make_node("Identity", [shapes[key]], [name]))
    nodes = empty_nodes + list(graph.node)
    needed = set(contract.output_names)
    kept = []
    for node in reversed(nodes):  # nodes are in topological order: a node's consumers come after it
        if any(out in needed for out in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    del graph.input[:]
    graph.input.extend(inputs[name] for name in contract.input_names)
    used = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(used)
    kept_info = [v for v in graph.value_info if v.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    missing = sorted(
        needed
        - {i.name for i in graph.input}
        - {t.name for t in graph.initializer}
        - {o for n in graph.node for o in n.output}
    )
    if missing:
        raise ExportFailed(
            f"{contract.file} cannot be cut from the traced program: it would read {', '.join(missing[:5])}"
        )
    return model


def _copy_proto(model: onnx.ModelProto) -> onnx.ModelProto:
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    return copied


def _table_of(model: onnx.ModelProto, entries: dict[str, dict]) -> list[dict]:
    """The shared file's entries ({initializer name: entry}) that `model`'s initializers point at, in its order."""
    return [entries[t.name] for t in model.graph.initializer if t.name in entries]


def _finish(model: onnx.ModelProto, contract: GraphContract) -> onnx.ModelProto:
    """The exported graph (its weights already references into the shared file) made ours: trace metadata
    stripped, RMSNorms in their fusable form, the contract's axis names set and linted."""
    _strip_trace_metadata(model)
    _rsqrt_as_division(model)
    problems = name_axes(model, contract)
    if problems:
        raise ExportFailed(f"{contract.file} breaks the I/O contract: {'; '.join(problems[:5])}")
    return model


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


def _strip_trace_metadata(model: onnx.ModelProto) -> None:
    # Stack traces carry this machine's absolute paths; the module namespace is kept.
    for node in model.graph.node:
        kept = [p for p in node.metadata_props if p.key not in ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node")]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)


def _rsqrt_as_division(model: onnx.ModelProto) -> None:
    """Rewrite x * Reciprocal(Sqrt(v)) as x / Sqrt(v), in place.

    torch exports rsqrt as Sqrt then Reciprocal, and ONNX Runtime fuses an RMSNorm into one
    SimplifiedLayerNormalization only in its division form; unfused, each norm stays six nodes.
    Every consumer running on onnxruntime gains a smaller optimised graph that runs faster.
    x * (1/s) rounds twice where x / s rounds once: a difference of an ulp or so.
    """
    graph = model.graph
    producer = {name: node for node in graph.node for name in node.output}
    users: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    outputs = {value.name for value in graph.output}
    dropped = set()
    for node in graph.node:
        root = producer.get(node.input[0]) if node.op_type == "Reciprocal" and node.domain == "" else None
        if root is None or root.op_type != "Sqrt" or node.output[0] in outputs:
            continue
        inverse = node.output[0]
        muls = users.get(inverse, [])
        if not muls or any(m.op_type != "Mul" or list(m.input).count(inverse) != 1 for m in muls):
            continue
        for mul in muls:
            numerator = mul.input[1] if mul.input[0] == inverse else mul.input[0]
            mul.op_type = "Div"
            del mul.input[:]
            mul.input.extend([numerator, root.output[0]])
        dropped.add(inverse)
    kept = [node for node in graph.node if not (node.op_type == "Reciprocal" and node.output[0] in dropped)]
    del graph.node[:]
    graph.node.extend(kept)
    kept_info = [value for value in graph.value_info if value.name not in dropped]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    log.debug("%d reciprocal square roots rewritten as divisions", len(dropped))


def _smoke_run(folder: Path, manifest: Manifest) -> None:
    """Run both graphs at sizes other than the tracing example, including 1-token and past-0 cases."""
    # The files just written, not hashed again; unprepacked whatever the precision, so that both sessions read the
    # one mapping of the weights (a prepacked decode.onnx holds a copy of its own, beside the model the export
    # still holds).
    settings = dataclasses.replace(checking_settings(manifest), prepack_weights=False)
    runner = OrtRunner(Artifact(folder, manifest), "cpu", settings=settings)
    tolerance = profile_for(manifest.dtype).logits
    vocab = manifest.config.vocab_size
    rng = np.random.default_rng(0)
    for batch, length in ((1, 1), (3, min(5, manifest.config.max_position_embeddings))):
        ids = rng.integers(0, vocab, (batch, length), dtype=np.int64)
        mask = np.ones_like(ids)
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
        if manifest.with_loss:
            feeds["labels"] = ids
        out = runner.prefill(feeds)
        if out["logits"].shape != (batch, length, vocab):
            raise ExportFailed(
                f"smoke run: prefill gave logits of shape {out['logits'].shape} for batch {batch}, "
                f"length {length}; expected {(batch, length, vocab)}"
            )
        if not np.isfinite(out["logits"]).all():
            # the weights were finite in this dtype (_check_finite_weights): the activations overflowed
            fix = "check the checkpoint, or export float32" if manifest.dtype == "float16" else "check the checkpoint"
            raise ExportFailed(
                f"smoke run: prefill gave non-finite logits (NaN or Inf) for batch {batch}, length "
                f"{length}: the activations overflow {manifest.dtype}; {fix}"
            )
        decode_feeds = {
            "input_ids": ids[:, :1],
            "attention_mask": np.ones((batch, 1), np.int64),
            "position_ids": np.zeros((batch, 1), np.int64),
            **runner.empty_past(batch),
        }
        step = runner.decode(decode_feeds)
        # The verification's own rule for this pair (its "decode(past 0) == prefill" invariant): a fixed
        # 1e-3 would sit below float16's resolution (an ulp is 7.8e-3 at logits of 8) and fail a correct export.
        first, expected = step["logits"][:, 0].astype(np.float32), out["logits"][:, 0].astype(np.float32)
        if not np.all(np.abs(first - expected) <= tolerance.allowed(expected)):
            raise ExportFailed(
                "smoke run: decode with past length 0 disagrees with prefill on the first token "
                f"(max abs {np.abs(first - expected).max():.3g})"
            )
    # The last position the manifest promises: a learned position table or a precomputed RoPE table
    # shorter than max_position_embeddings exports fine at the example's positions and fails only there.
    last = manifest.config.max_position_embeddings - 1
    feeds = {
        "input_ids": np.zeros((1, 1), np.int64),
        "attention_mask": np.ones((1, 1), np.int64),
        "position_ids": np.full((1, 1), last, np.int64),
        **runner.empty_past(1),
    }
    try:
        logits = runner.decode(feeds)["logits"]
    except GraphRunError as exc:
        raise ExportFailed(
            f"smoke run: the graphs fail at position {last}, the last of max_position_embeddings "
            f"{last + 1} ({exc.detail}); set max_position_embeddings to the positions the model "
            "has"
        ) from exc
    if not np.isfinite(logits).all():
        raise ExportFailed(
            f"smoke run: decode gave non-finite logits at position {last}, the last of "
            f"max_position_embeddings {last + 1}; set it to the positions the model has"
        )


def _check_forward(model: torch.nn.Module, config, args, with_loss: bool, dtype: str) -> None:
    """One eager prefill of the tracing example and one cached step after it, their outputs held to the
    config's sizes. A wrong layer count or cache layout otherwise surfaces from the graph lint as outputs out
    of place ("loss has rank 4", "unexpected input/output div_2"), which names neither the field nor the fix;
    a present without the past, as an axis-name clash after both traces; a forward giving no loss for labels,
    as a KeyError when verifying the export's loss against it. Then the prefill again on an empty cache
    (_check_empty_past): prefill.onnx is cut from the cached program."""
    from reference.byo import output_problems

    input_ids, attention_mask, position_ids = args[:3]
    labels = args[3] if with_loss else None
    try:
        prompt = out = model(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, labels=labels
        )
    except Exception as exc:  # the user's own forward: any type
        raise ExportFailed(
            f"the model's forward failed on a {tuple(input_ids.shape)} example: {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    problems = output_problems(out, config, *input_ids.shape, with_loss)
    if not problems:  # one cached step on that prefill's present: the decode graph's forward
        batch, length = input_ids.shape
        try:
            out = model(
                input_ids[:, -1:],
                attention_mask=torch.ones(batch, length + 1, dtype=attention_mask.dtype),
                position_ids=position_ids[:, -1:] + 1,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        except Exception as exc:
            raise ExportFailed(
                f"the model's forward failed on one cached step after a {tuple(input_ids.shape)} "
                f"example: {type(exc).__name__}: {first_line(exc)}"
            ) from exc
        problems = output_problems(out, config, batch, 1, past_length=length)
    if problems:
        raise ExportFailed(f"the model's forward breaks the contract (reference/byo.py): {'; '.join(problems)}")
    _check_empty_past(model, config, args, prompt, dtype)


def _check_empty_past(model: torch.nn.Module, config, args, prompt, dtype: str) -> None:
    """The prompt's logits on an empty cache (past length 0, in the dtype of the cache the forward returned)
    against `prompt`'s, the forward's without a cache: prefill.onnx computes the former. The two run the same
    products, the cached one concatenating empty tensors, so they differ by the dtype's rounding at most, which the
    parity profile's logits bound (the verification's own rule for decode with past 0 against prefill); a model
    that treats an empty cache otherwise (another mask, another position offset) differs at the logits' own
    scale."""
    input_ids, attention_mask, position_ids = args[:3]
    cache = cache_layout(config, "")
    kept = prompt.past_key_values[0][0].dtype
    empty = torch.zeros(input_ids.shape[0], 0, cache.num_key_value_heads, cache.head_dim, dtype=kept)
    try:
        out = model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=[(empty, empty) for _ in range(cache.num_layers)],
            use_cache=True,
        )
    except Exception as exc:
        raise ExportFailed(
            f"the model's forward failed on an empty cache (past length 0): {type(exc).__name__}: {first_line(exc)}; "
            "prefill.onnx computes the prompt on one, so the forward must accept it (reference/byo.py)"
        ) from exc
    expected = prompt.logits.float().numpy()
    difference = np.abs(out.logits.float().numpy() - expected)
    if not np.all(difference <= profile_for(dtype).logits.allowed(expected)):
        raise ExportFailed(
            f"the model's forward on an empty cache (past length 0) gives other logits than without a cache "
            f"(max abs difference {difference.max():.3g}); prefill.onnx computes the prompt on one, so the forward "
            "must treat an empty cache as none (reference/byo.py)"
        )


def _check_source(source) -> None:
    """The source as manifest.json must record it: readable back (the reader's own rule) and JSON."""
    problem = source_problem(source)
    if problem is None:
        try:
            json.dumps(source)
        except (TypeError, ValueError) as exc:  # a Path: the export would fail after all its work
            problem = f"model.source cannot be written as JSON ({exc})"
    if problem:
        raise InputError(
            f'source is {source!r:.80}: {problem}; pass a dict of JSON values with a "kind", e.g. '
            '{"kind": "custom", "model": "my-decoder"}'
        )


def _check_arguments(model, folder, with_loss) -> None:
    """export_artifact's own arguments, refused here rather than left to fail as AttributeError or pathlib's
    TypeError, or to read "no" as True."""
    if isinstance(model, SourcedModel):
        raise InputError(
            "model is a SourcedModel (what seeded_model and checkpoint_model return); pass its model and "
            "its source: export_artifact(sourced.model, folder, source=sourced.source)"
        )
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise InputError(
            f"model must be a reference model or a reference.byo adapter (a torch.nn.Module with a "
            f".config), got {type(model).__name__}; build one with reference.source.seeded_model"
            "(preset).model or checkpoint_model(path).model"
        )
    if not isinstance(folder, (str, os.PathLike)):
        raise InputError(f"folder must be a path (str or Path), got {folder!r:.80} (`folder`)")
    check_flag("with_loss", with_loss)


def _copy_for_export(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
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


def _check_finite_weights(model: torch.nn.Module, exported: torch.nn.Module, dtype: str) -> None:
    """InputError naming the first weight that holds NaN or Inf in `model`, or that `exported` (its copy in the
    export's dtype) holds beyond that dtype's range: the graphs would compute NaN, which only the smoke run after
    both exports would find. Parameters only: a buffer may hold -inf by design (a causal mask)."""
    originals = dict(model.named_parameters())
    for name, weight in exported.named_parameters():
        if not weight.is_floating_point() or bool(torch.isfinite(weight).all()):
            continue
        original = originals.get(name, weight)
        if original.dtype != weight.dtype and bool(torch.isfinite(original).all()):
            limit = torch.finfo(weight.dtype).max
            raise InputError(
                f"weight {name} holds values beyond {dtype}'s range (|x| > {limit:g}), which become Inf in a "
                f'{dtype} export; export float32 (`dtype="float32"`), or scale the weights'
            )
        raise InputError(
            f"weight {name} holds NaN or Inf, which every output the graphs compute from it would hold; check "
            "the checkpoint (a diverged training run, or a damaged file)"
        )


def _prepare_destination(folder: Path) -> None:
    """Refuse a destination that cannot be written, or whose replacement would lose what this toolkit did not
    write: before the export runs, so that nothing is spent on an export that cannot land."""
    # onnx.checker takes the path of the graphs it checks, as UTF-8: the export would be spent before it failed
    check_text_path(folder, "output folder", "choose an output folder whose path is UTF-8 (`folder`)", OutputPathError)
    try:
        check_output_path(folder, "output folder", folder=True)
    except OutputPathError as exc:  # named as this function's other refusals name it
        raise OutputPathError(f"{exc} (`folder`)") from None
    if folder.is_symlink():  # the swap into place would replace the link, not what it points to
        raise OutputPathError(
            f"output folder {folder} is a symbolic link; pass the folder it points to "
            f"({folder.resolve()}) or another output folder (`folder`)"
        )
    if os.path.ismount(folder):  # the rename of the built folder onto it fails with "Device or resource busy"
        raise OutputPathError(
            f"output folder {folder} is a mount point, and the export is built beside its "
            "destination and then swapped in, which a mount point cannot be; export into a "
            f"folder inside it (e.g. {folder / 'artifact'})"
        )
    artifact = next((parent for parent in folder.parents if listed_files(parent) is not None), None)
    if artifact is not None:  # as --report-json and --save-optimized are: the outer one would hold an unlisted folder
        raise OutputPathError(
            f"output folder {folder} lies inside the artifact folder {artifact}, which it would "
            "change; choose another output folder (`folder`)"
        )
    if not folder.is_dir():
        return
    cwd, real = Path.cwd().resolve(), folder.resolve()
    if real == cwd or real in cwd.parents:
        raise OutputPathError(
            f"output folder {folder} holds the current directory, which replacing it would "
            "delete; run from elsewhere or choose another output folder (`folder`)"
        )
    if not any(folder.iterdir()):
        return
    listed = listed_files(folder)
    if listed is None:
        raise OutputPathError(
            f"output folder {folder} is not empty and holds no {MANIFEST} of this toolkit; "
            "refusing to overwrite files it did not write: choose another output folder "
            "(`folder`) or empty it"
        )
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if p.name not in listed)
    if foreign:
        them = "them" if len(foreign) > 1 else "it"
        raise OutputPathError(
            f"output folder {folder} holds {first_of(foreign, 5)}, which its artifact does "
            f"not list and replacing it would delete {them}; move {them} out or choose another "
            "output folder (`folder`)"
        )


def check_destination(folder) -> None:
    """The refusals of an output folder that export_artifact makes first, for a caller to make before building
    the model: reading a checkpoint can take minutes."""
    _prepare_destination(Path(os.path.abspath(folder)))


def _hidden_sibling(folder: Path, kind: str) -> Path:
    """A new hidden folder beside `folder`, named for this process, so that a later export can tell whether the
    export that made it is still running."""
    return Path(tempfile.mkdtemp(prefix=f".{folder.name}.{kind}-{os.getpid()}-", dir=folder.parent))


def _process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: running, as far as this one can tell
        pass
    return True


def _clear_interrupted(folder: Path) -> list[Path]:
    """Clear the hidden folders that an export stopped where no cleanup could run (SIGKILL, SIGHUP, a power cut)
    left beside `folder`; those of a running export are left alone. One killed between the two renames of the swap
    had moved the earlier artifact aside, into .NAME.old-*: that artifact is put back first where `folder` is
    missing or an empty folder (made since). Returns the .NAME.old-* folders that still hold something (an earlier
    artifact whose place another has taken), which the caller removes only once its new artifact is in place: what
    may be the only complete copy is never deleted before another is."""
    pattern = re.compile(rf"\.{re.escape(folder.name)}\.(partial|old)-(\d+)-[^/]+")
    kept = []
    for leftover in sorted(folder.parent.glob(f".{glob.escape(folder.name)}.*-*")):
        match = pattern.fullmatch(leftover.name)
        if match is None or _process_running(int(match[2])):
            continue
        if match[1] == "old" and (leftover / folder.name).is_dir():
            if _vacant(folder):
                if os.path.lexists(folder):
                    folder.rmdir()
                os.rename(leftover / folder.name, folder)
                log.warning("put back %s, which an interrupted export moved aside to %s", folder.name, leftover.name)
            else:
                kept.append(leftover)
                continue
        _remove_leftover(leftover, folder)
    return kept


def _vacant(folder: Path) -> bool:
    """Nothing at `folder`, or an empty folder (no link): where an artifact moved aside can be put back."""
    if not os.path.lexists(folder):
        return True
    return folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir())


def _remove_leftover(leftover: Path, folder: Path) -> None:
    shutil.rmtree(leftover, ignore_errors=True)
    if not leftover.exists():
        log.warning("removed %s, left beside %s by an interrupted export", leftover.name, folder.name)


def _move_into_place(built: Path, folder: Path) -> None:
    """Swap the finished folder in; an earlier artifact is removed only after the new one is in place."""
    old = None
    if folder.exists():
        old = _hidden_sibling(folder, "old")
    try:
        if old is not None:
            try:
                os.rename(folder, old / folder.name)
            except FileNotFoundError:  # gone since the line above: moved aside by another export's swap
                raise _overtaken(folder) from None
            except OSError as exc:
                raise OutputPathError(
                    f"cannot replace {folder} ({exc.strerror}); the earlier artifact is "
                    "untouched, the new one was not kept"
                ) from None
        try:
            os.rename(built, folder)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):  # another export's folder landed there meanwhile
                raise _overtaken(folder) from None
            raise
    except BaseException:
        # One handler for both renames: a Ctrl-C can land just after the first, between the two.
        if old is not None:
            if (old / folder.name).exists() and not folder.exists():
                os.rename(old / folder.name, folder)
            shutil.rmtree(old, ignore_errors=True)  # empty, or the earlier artifact once the new one is in place
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _overtaken(folder: Path) -> OutputPathError:
    """Two exports to one folder, swapping their results in at the same moment: the other one's stays."""
    return OutputPathError(
        f"another process replaced {folder} while this export was moving its result there (two "
        "exports to one folder?): the folder holds the other's artifact, and this one was not "
        "kept; export again once the other is done, or into another folder (`folder`)"
    )


def _write_failed(folder: Path, exc: OSError) -> OutputPathError:
    where = f" ({exc.filename})" if exc.filename else ""
    return OutputPathError(
        f"cannot write the export for {folder}: {exc.strerror or first_line(exc)}{where}; it is "
        f"built in a hidden folder beside it, .{folder.name}.partial-*, removed again, and an "
        "earlier artifact there is untouched: free space, or choose a shorter or other output "
        "folder (`folder`)"
    )


def _build(
    model: torch.nn.Module,
    config,
    dtype: str,
    with_loss: bool,
    source: dict,
    tokenizer_source,
    built: Path,
    quantization: Quantization | None = None,
    trace_all_layers: bool = False,
) -> Manifest:
    """Both graphs, the weights file they share, the consumers' files and the manifest, written into the empty
    folder `built` and checked there (onnx.checker, a smoke run in onnxruntime)."""
    prefill = prefill_contract(config, dtype, with_loss)
    decode = decode_contract(config, dtype)
    # Each graph's weights go to the shared file as soon as it is exported: the decode export never runs beside
    # the prefill graph's weights, and no graph is ever serialised with its weights inside. A quantized export
    # holds both graphs with their float weights instead, until quantize_graphs has replaced their matrices by
    # blocks: both graphs' blocks are then stored once.
    with torch.no_grad(), SharedWeightsWriter(built, WEIGHTS_FILE) as weights:
        store = ir.serde.serialize_model if quantization is not None else weights.add
        args, _ = _example_inputs(config, TORCH_DTYPES[dtype], with_loss, past=False)
        _check_forward(model, config, args, with_loss, dtype)
        template = None if trace_all_layers else LayerTemplate.for_model(model)
        graphs = _traced_graphs(model, template, dtype, with_loss, store, (prefill, decode))
        prefill_model, decode_model = (_finish(graph, contract) for graph, contract in zip(graphs, (prefill, decode)))
        if quantization is not None:
            prefill_model, decode_model, quantization = quantize_graphs(
                prefill_model, decode_model, quantization, config.vocab_size
            )
            prefill_model, decode_model = weights.add(prefill_model), weights.add(decode_model)
    shared = weights.result
    # the file's entries of every graph added (the traced program, or each quantized graph), read back per graph: a
    # name stands for one content in both graphs, which were cut from one program
    entries = {entry["name"]: entry for table in shared.initializers for entry in table}
    log.info("wrote %s: %d tensors, %.1f MB, shared by both graphs", WEIGHTS_FILE, shared.tensors, shared.bytes / 1e6)
    for contract, proto in ((prefill, prefill_model), (decode, decode_model)):
        onnx.save_model(proto, built / contract.file)
        try:
            onnx.checker.check_model(str(built / contract.file), full_check=True)
        except Exception as exc:
            raise ExportFailed(f"onnx.checker rejected {contract.file}: {first_line(exc)}") from exc
    manifest = Manifest(
        config=config,
        source=source,
        dtype=dtype,
        opset=OPSET,
        prefill=prefill,
        decode=decode,
        cache=cache_layout(config, dtype),
        weights_file=WEIGHTS_FILE,
        initializers={prefill.file: _table_of(prefill_model, entries), decode.file: _table_of(decode_model, entries)},
        versions={"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        files={},
        quantization=quantization,
    )
    files = [prefill.file, decode.file, WEIGHTS_FILE, *write_consumer_files(built, manifest, tokenizer_source)]
    manifest = dataclasses.replace(manifest, files=file_entries(built, files))
    manifest.write(built)  # before the smoke run: OrtRunner checks a manifest it is given against the folder's
    log.info("smoke-testing the graphs in onnxruntime")
    try:
        _smoke_run(built, manifest)
    except GraphRunError as exc:  # e.g. an op this build lacks for a dtype
        raise ExportFailed(f"smoke run: onnxruntime could not run the exported graphs ({exc.detail})") from exc
    return manifest


def export_artifact(
    model: torch.nn.Module,
    folder: Path,
    dtype: str = "float32",
    with_loss: bool = True,
    source: dict | None = None,
    tokenizer: Path | TokenizerSource | None = None,
    *,
    block_size: int | None = None,
    accuracy_level: int | None = None,
    lm_head: str | None = None,
    embedding: str | None = None,
    activations: str | None = None,
    trace_all_layers: bool = False,
) -> ExportResult:
    """Export `model` as an artifact folder.

    The folder is built in a hidden sibling, checked, and only then swapped in: a failed or interrupted
    export leaves an earlier artifact at `folder` untouched.

    Args:
        model: a reference model of a known family (reference/families.py) or a bring-your-own adapter
            (reference/byo.py): `model.config` gives the contract's sizes, `model.forward` the shared
            signature with a list-of-(k, v) cache. It is copied for export, never changed.
        folder: the output folder (str or Path): absent, empty, or an artifact of this toolkit holding only
            the files its manifest lists.
        dtype: the graphs' float type, one of DTYPES ("float32", "float16"), or a weight-only quantization scheme
            ("int4", "int8": MatMul weights in onnxruntime's MatMulNBits blocks, the token embedding in its
            GatherBlockQuantized rows, activations and cache as `activations` says).
        with_loss: give prefill.onnx a `labels` input and a `loss` output.
        source: where the weights came from, as manifest.json records it: a dict of JSON values with a
            "kind"; None: {"kind": "in-memory"}.
        tokenizer: a tokenizer.json, or a folder holding one and optionally tokenizer_config.json and
            chat_template.jinja, or a TokenizerSource already read (a checkpoint's own: SourcedModel.tokenizer);
            checked against the model's vocabulary and copied into the artifact, for text generation in every
            consumer.
        block_size: for "int4"/"int8", the weights per scale: a power of two >= 16 dividing the hidden size (None:
            32). A float dtype takes none of block_size, accuracy_level, lm_head and embedding.
        accuracy_level: for "int4"/"int8", MatMulNBits' accuracy_level (0: float32 math; 4, the default: int8
            math on the CPU).
        lm_head: for "int4"/"int8", the lm_head's weights, tied or not: "int8" (default), "float", or "same" (the
            scheme's bits). The vocabulary-wide projection is the most sensitive one: its error moves every logit.
        embedding: for "int4"/"int8", the token embedding's weights, as onnxruntime's GatherBlockQuantized: "int8"
            (default), "float", or "same". Its rows are read once per token, so their bits cost no compute and 8 bits
            cost little size, while a float table (vocabulary x hidden size) can outweigh the quantized rest of a
            model with a large vocabulary; onnxruntime-genai's builder keeps an untied embedding float and
            llama.cpp's Q4_K_M keeps a tied one at 6 bits, both above the 4 bits of the projections. A tied table at
            the same bits as the lm_head is stored once, read by both.
        activations: for "int4"/"int8", what the graphs compute in and the cache holds: "float32" (None, the
            default: for the CPU, whose MatMulNBits kernels compute in float32 or int8) or "float16" (for CUDA: half
            the bytes of every activation and of the cache, the scales in float16 too). A float dtype computes in
            itself: give None.
        trace_all_layers: trace every layer with torch.onnx. By default a model whose layers repeat is traced three
            layers deep and its graph grown to its depth (exporter/export/layer_template.py), which takes a fraction
            of the time and gives the same graph.

    Returns:
        The ExportResult: the folder as given, the manifest, the time taken and the artifact's bytes.

    Raises:
        InputError: an argument is not what it must be.
        OutputPathError: the folder cannot be written or replaced.
        ExportFailed: torch.onnx or a post-export check failed.
    """
    if dtype not in DTYPES and dtype not in SCHEMES:
        raise InputError(f"dtype {dtype!r} is not supported; choose one of {', '.join([*DTYPES, *SCHEMES])}")
    _check_arguments(model, folder, with_loss)
    check_flag("trace_all_layers", trace_all_layers)
    # Before any export work: the manifest needs both, and both would otherwise fail only after the graphs are built.
    config = family_of(model.config).own_config(model.config)
    check_context_length(config.max_position_embeddings)
    quantization = requested_scheme(dtype, config.hidden_size, block_size, accuracy_level, lm_head, embedding)
    dtype = activations_dtype(dtype, activations)  # what the graphs compute in
    source = {"kind": "in-memory"} if source is None else source
    _check_source(source)
    shown, folder = Path(folder), Path(os.path.abspath(folder))  # absolute: `-o .` has a name and a parent
    _prepare_destination(folder)
    tokenizer_source = export_tokenizer(tokenizer, config.vocab_size)
    start = time.perf_counter()
    exported = _copy_for_export(model, TORCH_DTYPES[dtype])
    _check_finite_weights(model, exported, dtype)  # before the exports, which take the time
    model = exported
    share_tied_table(model)

    with parents_removed_unless_done(folder):
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            moved_aside = _clear_interrupted(folder)
            built = _hidden_sibling(folder, "partial")
        except OSError as exc:
            raise _write_failed(folder, exc) from None
        umask = os.umask(0)
        os.umask(umask)
        try:
            built.chmod(0o777 & ~umask)  # mkdtemp makes it private; the artifact should not be
            manifest = _build(
                model, config, dtype, with_loss, source, tokenizer_source, built, quantization, trace_all_layers
            )
            with folder_lock(folder.parent):  # a second export to this folder swaps its result in before or after
                _move_into_place(built, folder)
            for leftover in moved_aside:  # earlier artifacts, once this one is in place
                _remove_leftover(leftover, folder)
        except OSError as exc:  # a full disk, a name too long for the hidden sibling: the user's to fix
            raise _write_failed(folder, exc) from None
        finally:
            shutil.rmtree(built, ignore_errors=True)
    total = sum(entry["bytes"] for entry in manifest.files.values())
    return ExportResult(shown, manifest, time.perf_counter() - start, total)
