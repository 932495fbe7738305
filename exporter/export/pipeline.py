"""Export a reference model as prefill.onnx + decode.onnx into an artifact folder: the orchestration.

The model is checked (checks), traced once (tracing), both graphs cut from the program and rewritten
(graph_passes), quantized where asked (quantize), their weights written once (weights), and the folder built in a
hidden sibling, checked (onnx.checker, the axis lint, a smoke run in ONNX Runtime) and only then swapped into place
(exporter.artifact.destination), so a failed or interrupted export never touches an earlier artifact at the
destination.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import torch

from exporter.artifact.consumers import check_context_length, write_consumer_files
from exporter.artifact.contract import DTYPES, cache_layout, decode_contract, prefill_contract
from exporter.artifact.destination import built_in_place, check_destination
from exporter.artifact.manifest import Manifest, file_entries
from exporter.artifact.quantization import (
    SCHEMES,
    Quantization,
    QuantizationSettings,
    activations_dtype,
    requested_scheme,
)
from exporter.artifact.tokenizer import TokenizerSource, export_tokenizer
from exporter.errors import ExportFailed, GraphRunError, InputError, check_flag, first_line
from exporter.export import tracing
from exporter.export.checks import check_arguments, check_finite_weights, check_forward, check_source, smoke_run
from exporter.export.graph_passes import finish
from exporter.export.graphs import share_tied_table
from exporter.export.layer_template import LayerTemplate
from exporter.export.quantize import quantizable_modules, quantize_graphs
from exporter.export.smoothing import Calibration, calibration_rows, measured_divisors
from exporter.export.tracing import OPSET, copy_for_export, example_inputs
from exporter.export.weights import SharedWeightsWriter
from reference.families import family_of
from reference.layers import TORCH_DTYPES

log = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.onnx.data"


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


def _table_of(model: onnx.ModelProto, entries: dict[str, dict]) -> list[dict]:
    """The shared file's entries ({initializer name: entry}) that `model`'s initializers point at, in its order."""
    return [entries[t.name] for t in model.graph.initializer if t.name in entries]


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
    divisors: dict | None = None,
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
        args, _ = example_inputs(config, TORCH_DTYPES[dtype], with_loss, past=False)
        check_forward(model, config, args, with_loss, dtype)
        template = None if trace_all_layers else LayerTemplate.for_model(model)
        graphs = tracing.traced_graphs(model, template, dtype, with_loss, store, (prefill, decode))
        prefill_model, decode_model = (finish(graph, contract) for graph, contract in zip(graphs, (prefill, decode)))
        if quantization is not None:
            prefill_model, decode_model, quantization = quantize_graphs(
                prefill_model, decode_model, quantization, config.vocab_size, divisors
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
        smoke_run(built, manifest)
    except GraphRunError as exc:  # e.g. an op this build lacks for a dtype
        raise ExportFailed(f"smoke run: onnxruntime could not run the exported graphs ({exc.detail})") from exc
    return manifest


def _calibration(scheme: Quantization | None, calibration, tokenizer_source, config) -> Calibration | None:
    """What an export that smooths its projections' inputs measures them on (export_artifact's `calibration`, read
    and tokenized now, before the export's work); None for an export that smooths none, or InputError."""
    if calibration is not None and not isinstance(calibration, (str, os.PathLike, Calibration)):
        raise InputError(f"calibration must be a path or a Calibration, got {type(calibration).__name__}")
    if scheme is None or scheme.smoothing is None:
        if calibration is not None:
            raise InputError(
                "`calibration` is what an int8 export smoothing its projections' inputs measures them on, and this "
                "export smooths none: drop `calibration`, or export int8 at accuracy level 4 (`dtype`, "
                "`quantization`)"
            )
        return None
    if isinstance(calibration, Calibration):
        rows = np.asarray(calibration.rows)
        if rows.ndim != 2 or rows.dtype.kind not in "iu" or rows.size == 0 or rows.min() < 0:
            raise InputError(
                "calibration.rows must be a non-empty (windows, length) array of token ids (`calibration`)"
            )
        if rows.max() >= config.vocab_size:
            raise InputError(
                f"calibration.rows holds token id {rows.max()}, beyond the vocabulary of {config.vocab_size} "
                "(`calibration`)"
            )
        return calibration
    return calibration_rows(tokenizer_source, calibration, config.vocab_size, config.max_position_embeddings)


def export_artifact(
    model: torch.nn.Module,
    folder: Path,
    dtype: str = "float32",
    with_loss: bool = True,
    source: dict | None = None,
    tokenizer: Path | TokenizerSource | None = None,
    *,
    quantization: QuantizationSettings | None = None,
    calibration: Path | Calibration | None = None,
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
            GatherBlockQuantized rows, activations and cache as `quantization.activations` says).
        with_loss: give prefill.onnx a `labels` input and a `loss` output.
        source: where the weights came from, as manifest.json records it: a dict of JSON values with a
            "kind"; None: {"kind": "in-memory"}.
        tokenizer: a tokenizer.json, or a folder holding one and optionally tokenizer_config.json and
            chat_template.jinja, or a TokenizerSource already read (a checkpoint's own: SourcedModel.tokenizer);
            checked against the model's vocabulary and copied into the artifact, for text generation in every
            consumer.
        quantization: for "int4"/"int8", the block size, accuracy level, lm_head and embedding bits, and what the
            graphs compute in (QuantizationSettings; None: the defaults). A float dtype takes none of them set.
        calibration: what an int8 export that smooths its projections' inputs (QuantizationSettings.smoothing)
            measures them on: a UTF-8 text file tokenized with `tokenizer`, or a Calibration (token ids); None: the
            built-in text, or seeded random ids without a tokenizer (exporter.export.smoothing). Read by no other
            export.
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
    check_arguments(model, folder, with_loss)
    check_flag("trace_all_layers", trace_all_layers)
    settings = QuantizationSettings() if quantization is None else quantization
    if not isinstance(settings, QuantizationSettings):
        raise InputError(
            f"quantization must be a QuantizationSettings (exporter.artifact.quantization) or None, got "
            f"{type(settings).__name__} (`quantization`)"
        )
    # Before any export work: the manifest needs both, and both would otherwise fail only after the graphs are built.
    config = family_of(model.config).own_config(model.config)
    check_context_length(config.max_position_embeddings)
    scheme = requested_scheme(dtype, config.hidden_size, settings)
    dtype = activations_dtype(dtype, settings.activations)  # what the graphs compute in
    source = {"kind": "in-memory"} if source is None else source
    check_source(source)
    shown, folder = Path(folder), Path(os.path.abspath(folder))  # absolute: `-o .` has a name and a parent
    check_destination(folder)
    tokenizer_source = export_tokenizer(tokenizer, config.vocab_size)
    calibration = _calibration(scheme, calibration, tokenizer_source, config)
    start = time.perf_counter()
    exported = copy_for_export(model, TORCH_DTYPES[dtype])
    check_finite_weights(model, exported, dtype)  # before the exports, which take the time
    model = exported
    share_tied_table(model)
    divisors = None
    if calibration is not None:
        modules = [name for name in quantizable_modules(model, config.vocab_size) if scheme.smooths(name)]
        log.info("smoothing %d projections' inputs: measuring them on %s", len(modules), calibration.source)
        divisors = measured_divisors(model, modules, calibration, scheme.smoothing.alpha)
        scheme = dataclasses.replace(
            scheme, smoothing=dataclasses.replace(scheme.smoothing, calibration=calibration.source)
        )
    with built_in_place(folder) as built:
        manifest = _build(
            model, config, dtype, with_loss, source, tokenizer_source, built, scheme, trace_all_layers, divisors
        )
    total = sum(entry["bytes"] for entry in manifest.files.values())
    return ExportResult(shown, manifest, time.perf_counter() - start, total)
