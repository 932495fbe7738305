"""Folders this toolkit did not write: Optimum's (`model.onnx` beside Transformers' `config.json`) and
onnxruntime-genai's model builder's (`model.onnx` beside `genai_config.json`), read as one graph serving as prefill
and as decode, and mapped onto the toolkit's contract so that the verification engine runs on them unchanged.

What each writer's graph takes and gives, as read here:

- inputs `input_ids` (int64), `attention_mask` (int32 or int64), `position_ids` (int64; the builder's graphs derive
  the positions from the mask and take none), and the past `past_key_values.N.key` / `.value`, (batch, kv heads,
  past, head dim), the head dimension fixed (Optimum) or symbolic (the builder);
- outputs `logits` and the presents `present.N.key` / `.value`; no loss;
- the builder names its past and present tensors in genai_config.json (`%d` for the layer), which is followed, and
  records there the model's sizes, which stand for the axes its graph leaves symbolic (the head dimension).

The model config (sizes, positions, tokens) comes from the Hugging Face folder the graph was exported from, whose
sizes must agree with the graph's.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from exporter.artifact.contract import KV_KINDS, cache_layout, decode_contract, prefill_contract
from exporter.artifact.folder import external_data_outside
from exporter.artifact.manifest import MANIFEST, Manifest
from exporter.artifact.paths import json_type, outside_folder, read_json_object
from exporter.artifact.quantization import GATHER_OP, QUANTIZED_OP, SCHEMES, Quantization
from exporter.errors import ArtifactError, InputError, first_line
from reference.errors import ConfigError
from reference.families import DecoderConfig, config_from_dict
from reference.hf_decoder_config import translate_hf_config

OPTIMUM = "Optimum"
BUILDER = "onnxruntime-genai model builder"
GENAI_CONFIG = "genai_config.json"
HF_CONFIG = "config.json"
GRAPH = "model.onnx"
# Optimum's names, and the builder's unless its genai_config.json says otherwise
PAST = "past_key_values.{layer}.{kind}"
PRESENT = "present.{layer}.{kind}"
# The attention operator that takes each row's length from the mask and its tokens to start at the row's first slot.
RIGHT_PADDED_ATTENTION = "GroupQueryAttention"
_ELEMENT_TYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT64: "int64",
}
EXPECTED = (
    "inputs input_ids, attention_mask, optionally position_ids, past_key_values.N.key/.value and outputs logits, "
    "present.N.key/.value (as Optimum's text-generation-with-past and onnxruntime-genai's builder write them)"
)
# The rank of each tensor of the contract; the past and present tensors are (batch, kv heads, length, head dim).
RANKS = {"input_ids": 2, "attention_mask": 2, "position_ids": 2, "logits": 3}
CACHE_RANK = 4
FLOATS = ("float32", "float16")
NO_DECODER_FIX = "pass a folder Optimum or onnxruntime-genai's builder wrote for a decoder"
# genai_config.json's model.decoder sizes, by the names a model config gives them
BUILDER_SIZES = {
    "head_size": "head_dim",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "num_hidden_layers": "num_hidden_layers",
}


@dataclass(frozen=True)
class ForeignGraph:
    """One foreign graph and how it maps onto the toolkit's contract.

    writer: OPTIMUM or BUILDER; file: the graph's file name in `folder`; past / present: its cache names, with
    `{layer}` and `{kind}` ("key", "value"); mask_dtype: what attention_mask it takes (int32 or int64);
    position_ids: whether it takes them; left_padding: whether a left-padded row is computed as the reference
    computes it (not by an attention that takes rows as right-padded); dtype: its cache's and logits' dtype;
    scheme: "int4" / "int8" for MatMulNBits weights, else None; quantization: that scheme as a manifest records it;
    layers: the cache's layers; kv_heads, head_dim and vocab_size: the graph's fixed sizes, else those its writer's
    config records, None where neither fixes them; declared: every size its writer's config records (the builder's
    genai_config.json), by a model config's names; opset: its default-domain opset.
    """

    folder: Path
    writer: str
    file: str
    past: str
    present: str
    mask_dtype: str
    position_ids: bool
    left_padding: bool
    dtype: str
    scheme: str | None
    quantization: Quantization | None
    layers: int
    kv_heads: int | None
    head_dim: int | None
    vocab_size: int | None
    declared: dict
    opset: int

    @property
    def contract_name(self) -> str:
        """The contract it follows, in words (what inspect shows)."""
        positions = "position_ids" if self.position_ids else "positions derived from the mask"
        padding = "left padding" if self.left_padding else "right padding only"
        precision = self.scheme or self.dtype
        return (
            f"one graph for prefill and decode; attention_mask {self.mask_dtype}; {positions}; {padding}; "
            f"past {self.past.format(layer='N', kind='key')}, present {self.present.format(layer='N', kind='key')}; "
            f"{precision}; no loss"
        )

    def to_dict(self) -> dict:
        return {
            "writer": self.writer,
            "graph": self.file,
            "contract": self.contract_name,
            "mask_dtype": self.mask_dtype,
            "position_ids": self.position_ids,
            "left_padding": self.left_padding,
            "dtype": self.dtype,
            "precision": self.scheme or self.dtype,
            "layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "opset": self.opset,
        }

    @property
    def sizes(self) -> dict[str, int]:
        """The model sizes the folder fixes, by a model config's names: what its writer's config records, and the
        graph's own axes."""
        fixed = {
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
        }
        return {**self.declared, **{name: size for name, size in fixed.items() if size is not None}}


def foreign_writer(folder: Path) -> str | None:
    """Who wrote `folder`, when it is a foreign folder (no manifest.json of ours, a config of one of the writers):
    BUILDER or OPTIMUM; None otherwise."""
    folder = Path(folder)
    if (folder / MANIFEST).exists() or not folder.is_dir():
        return None
    if (folder / GENAI_CONFIG).is_file():
        return BUILDER
    if (folder / HF_CONFIG).is_file() or (folder / GRAPH).is_file():
        return OPTIMUM
    return None


def _json(path: Path) -> dict:
    return read_json_object(
        path, ArtifactError, "onnxruntime-genai config", "export the folder again", repeated_keys=True
    )


def _object(value, name: str, path: Path) -> dict:
    """`value`, a field of the JSON file at `path`, when it is an object (or absent: {}); ArtifactError otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ArtifactError(f"{path}: {name} must be an object, got {json_type(value)}; export the folder again")
    return value


def _builder_config(folder: Path) -> tuple[str, str, str, dict[str, int]]:
    """The graph file, its past and present key patterns, and the model's sizes (BUILDER_SIZES and vocab_size), from
    genai_config.json."""
    path = folder / GENAI_CONFIG
    model = _object(_json(path).get("model"), "model", path)
    decoder = _object(model.get("decoder"), "model.decoder", path)
    inputs = _object(decoder.get("inputs"), "model.decoder.inputs", path)
    names = {**inputs, **_object(decoder.get("outputs"), "model.decoder.outputs", path)}
    file = decoder.get("filename", GRAPH)
    if not isinstance(file, str) or not file:
        raise ArtifactError(
            f"{path}: model.decoder.filename must be a file name, got {file!r:.40}; export the folder again"
        )
    if outside_folder(folder, file):
        raise ArtifactError(
            f"{path} names model.decoder.filename {file!r:.80}, which lies outside the folder; a folder names only "
            "files it holds: export it again"
        )

    def pattern(key: str, default: str) -> str:
        given = names.get(key)
        return given.replace("%d", "{layer}").replace(".key", ".{kind}") if isinstance(given, str) else default

    given = {f"model.decoder.{key}": (decoder.get(key), name) for key, name in BUILDER_SIZES.items()}
    given["model.vocab_size"] = (model.get("vocab_size"), "vocab_size")
    sizes = {}
    for key, (value, name) in given.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArtifactError(f"{path}: {key} must be a positive integer, got {value!r:.40}; export the folder again")
        sizes[name] = value
    return file, pattern("past_key_names", PAST), pattern("present_key_names", PRESENT), sizes


def _tensor(value: onnx.ValueInfoProto) -> tuple[str | None, list | None]:
    """Its element type (None: one the contract has not) and its axes, each a size or a name; None: no shape given."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return _ELEMENT_TYPES.get(tensor.elem_type), None
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor.shape.dim]
    return _ELEMENT_TYPES.get(tensor.elem_type), dims


def _io_problem(tensors: dict, cache: list[str]) -> str | None:
    """What in the graph's declared inputs and outputs (`tensors`, name -> _tensor) a decoder of the contract has
    not, beyond its names: a rank, an element type, cache tensors of other types or fixed sizes; None: nothing."""
    for name, (dtype, dims) in tensors.items():
        rank = CACHE_RANK if name in cache else RANKS[name]
        if dims is not None and len(dims) != rank:
            return f"{name} has {len(dims)} axes where a decoder's has {rank}"
        if (name in cache or name == "logits") and dtype not in FLOATS:
            return f"{name} is {dtype or 'of a type'} where a decoder's is float32 or float16"
    if tensors.get("position_ids", ("int64",))[0] != "int64":
        return f"position_ids is {tensors['position_ids'][0] or 'of a type'} where a decoder's is int64"
    dtypes = {tensors[name][0] for name in cache}
    if len(dtypes) > 1:
        return f"its past and present tensors mix {' and '.join(sorted(dtypes))}"
    for axis, what in ((1, "kv heads"), (3, "head dimension")):
        fixed = {
            tensors[name][1][axis] for name in cache if tensors[name][1] and isinstance(tensors[name][1][axis], int)
        }
        if len(fixed) > 1:
            return f"its past and present tensors give {what} {' and '.join(map(str, sorted(fixed)))}"
    return None


def _quantization(model: onnx.ModelProto) -> Quantization | None:
    """The MatMulNBits scheme of the graph's weights: the bits most of them carry; None without any."""
    nodes = [n for n in model.graph.node if n.op_type == QUANTIZED_OP]
    if not nodes:
        return None
    attributes = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    bits = Counter(a.get("bits", 4) for a in attributes).most_common(1)[0][0]
    scheme = next(name for name, b in SCHEMES.items() if b == bits)
    return Quantization(
        scheme=scheme,
        bits=bits,
        block_size=int(attributes[0].get("block_size", 0)),
        accuracy_level=int(attributes[0].get("accuracy_level", 0)),
        lm_head="same",
        embedding="same" if any(n.op_type == GATHER_OP for n in model.graph.node) else "float",
        matrices=len(nodes),
    )


def read_foreign(folder: Path) -> ForeignGraph:
    """The foreign graph of `folder`, its I/O mapped onto the toolkit's contract.

    Raises:
        ArtifactError: the folder is no foreign folder, holds no graph, or its graph follows no contract read here
            (the message names what was expected and what was found).
    """
    folder = Path(folder)
    writer = foreign_writer(folder)
    if writer is None:
        raise ArtifactError(
            f"{folder} is neither an artifact of this toolkit nor a folder written by Optimum or onnxruntime-genai's "
            f"builder (no {MANIFEST}, {GENAI_CONFIG} or {HF_CONFIG}); pass one of those"
        )
    file, past, present, declared = _builder_config(folder) if writer == BUILDER else (GRAPH, PAST, PRESENT, {})
    path = folder / file
    if not path.is_file():
        raise ArtifactError(
            f"{folder} holds no graph {file} ({writer} writes one beside its "
            f"{GENAI_CONFIG if writer == BUILDER else HF_CONFIG}); "
            "pass the folder it exported into, or export it again"
        )
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError) as exc:
        raise ArtifactError(f"{path} is no ONNX model ({first_line(exc, 200)}); export it again") from None
    outside = external_data_outside(model, folder)
    if outside is not None:
        raise ArtifactError(f"{path} names weights outside the folder ({outside:.80}); export it again")
    initializers = {t.name for t in model.graph.initializer}
    inputs = {v.name: _tensor(v) for v in model.graph.input if v.name not in initializers}
    outputs = {v.name: _tensor(v) for v in model.graph.output}
    layers = sum(1 for name in inputs if re.fullmatch(past.format(layer=r"\d+", kind="key").replace(".", r"\."), name))
    names = [past.format(layer=i, kind=k) for i in range(layers) for k in KV_KINDS]
    expected_inputs = {"input_ids", "attention_mask", *names}
    expected_outputs = {"logits", *(present.format(layer=i, kind=k) for i in range(layers) for k in KV_KINDS)}
    mask_dtype = inputs.get("attention_mask", (None,))[0]
    if (
        not layers
        or set(inputs) - {"position_ids"} != expected_inputs
        or set(outputs) != expected_outputs
        or mask_dtype not in ("int32", "int64")
        or inputs["input_ids"][0] != "int64"
    ):
        found = f"inputs {sorted(inputs)[:6]}, outputs {sorted(outputs)[:4]}, attention_mask {mask_dtype}"
        raise ArtifactError(f"{path} follows no contract this toolkit reads: expected {EXPECTED}; found {found}")
    presents = [present.format(layer=i, kind=k) for i in range(layers) for k in KV_KINDS]
    problem = _io_problem({**inputs, **outputs}, names + presents)
    if problem is not None:
        raise ArtifactError(
            f"{path} has a decoder's input and output names but is no decoder: {problem}; {NO_DECODER_FIX}"
        )
    dtype, cache_dims = inputs[names[0]]
    logits_dims = outputs["logits"][1]

    def fixed(dims: list | None, axis: int, name: str) -> int | None:
        return dims[axis] if dims and isinstance(dims[axis], int) else declared.get(name)

    quantization = _quantization(model)
    return ForeignGraph(
        folder=folder,
        writer=writer,
        file=file,
        past=past,
        present=present,
        mask_dtype=mask_dtype,
        position_ids="position_ids" in inputs,
        left_padding=not any(n.op_type == RIGHT_PADDED_ATTENTION for n in model.graph.node),
        dtype=dtype,
        scheme=quantization.scheme if quantization else None,
        quantization=quantization,
        layers=layers,
        kv_heads=fixed(cache_dims, 1, "num_key_value_heads"),
        head_dim=fixed(cache_dims, 3, "head_dim"),
        vocab_size=fixed(logits_dims, 2, "vocab_size"),
        declared=declared,
        opset=next((e.version for e in model.opset_import if e.domain in ("", "ai.onnx")), 0),
    )


def reference_config(folder: Path) -> DecoderConfig:
    """The model config of the Hugging Face folder a foreign graph was exported from (its config.json).

    Raises:
        InputError: no config.json there, or one this toolkit cannot read as a decoder's.
    """
    path = Path(folder) / HF_CONFIG
    if not path.is_file():
        raise InputError(f"{folder} holds no {HF_CONFIG}; pass the Hugging Face folder the graph was exported from")
    try:
        return config_from_dict("hf-decoder", translate_hf_config(_json(path)))
    except (ConfigError, ArtifactError) as exc:
        raise InputError(f"{path} cannot serve as the reference's config: {first_line(exc, 300)}") from None


def check_sizes(graph: ForeignGraph, config: DecoderConfig, reference: Path) -> None:
    """The sizes the foreign folder fixes (ForeignGraph.sizes) against the reference folder's config.

    Raises:
        InputError: naming each size that differs, with both values.
    """
    differ = [
        f"{name} {getattr(config, name)} where the folder has {size}"
        for name, size in graph.sizes.items()
        if getattr(config, name) != size
    ]
    if differ:
        raise InputError(
            f"the reference folder {reference} does not match {graph.folder}: its {HF_CONFIG} gives "
            f"{', '.join(differ)}; pass the Hugging Face folder the graph was exported from (`reference`)"
        )


def foreign_manifest(graph: ForeignGraph, config: DecoderConfig, reference: Path) -> Manifest:
    """The manifest the engine reads for a foreign graph: the toolkit's contract without the loss, both graphs
    being the one file, the cache in the graph's dtype (a quantized graph's too). Written nowhere:
    the folder stays as its writer left it."""
    dtype = graph.dtype
    prefill, decode = prefill_contract(config, dtype, with_loss=False), decode_contract(config, dtype)
    return Manifest(
        config=config,
        source={"kind": "foreign", "writer": graph.writer, "reference": str(reference)},
        dtype=dtype,
        opset=graph.opset,
        prefill=replace(prefill, file=graph.file),
        decode=replace(decode, file=graph.file),
        cache=cache_layout(config, dtype),
        weights_file="",
        initializers={},
        versions={},
        files={},
        quantization=graph.quantization,
    )
