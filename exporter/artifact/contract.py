"""The I/O contract of the two graphs (docs/artifact-format.md, "I/O contract"), as data.

The exporter names inputs, outputs and dynamic axes from it, the axis lint
checks the saved graphs against it, and the manifest records it so that the
runtime and the verifier hard-code nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from reference.families import DecoderConfig

BATCH = "batch_size"
SEQUENCE = "sequence_length"
PAST = "past_sequence_length"
TOTAL = "total_sequence_length"

DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    axes: tuple  # a str is a symbolic axis, an int a fixed size

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "axes": list(self.axes)}

    @classmethod
    def from_dict(cls, data: dict) -> TensorSpec:
        return cls(data["name"], data["dtype"], tuple(data["axes"]))


@dataclass(frozen=True)
class GraphContract:
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> list[str]:
        return [spec.name for spec in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [spec.name for spec in self.outputs]

    def to_dict(self) -> dict:
        return {
            "file": self.file,
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
        }

    @classmethod
    def from_dict(cls, data: dict) -> GraphContract:
        return cls(
            data["file"],
            tuple(TensorSpec.from_dict(s) for s in data["inputs"]),
            tuple(TensorSpec.from_dict(s) for s in data["outputs"]),
        )


@dataclass(frozen=True)
class CacheLayout:
    """How past/present tensors are named and laid out; recorded in the manifest."""

    num_layers: int
    num_key_value_heads: int
    head_dim: int
    dtype: str
    past_name: str = "past_key_values.{layer}.{kind}"
    present_name: str = "present.{layer}.{kind}"
    axes: tuple = (BATCH, "num_key_value_heads", "sequence", "head_dim")

    def past(self, layer: int, kind: str) -> str:
        return self.past_name.format(layer=layer, kind=kind)

    def present(self, layer: int, kind: str) -> str:
        return self.present_name.format(layer=layer, kind=kind)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["axes"] = list(self.axes)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CacheLayout:
        return cls(**{**data, "axes": tuple(data["axes"])})


KV_KINDS = ("key", "value")


def cache_layout(config: DecoderConfig, dtype: str) -> CacheLayout:
    return CacheLayout(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype)


def _kv_specs(cache: CacheLayout, name_of, length_axis: str) -> list[TensorSpec]:
    return [
        TensorSpec(name_of(layer, kind), cache.dtype, (BATCH, cache.num_key_value_heads, length_axis, cache.head_dim))
        for layer in range(cache.num_layers)
        for kind in KV_KINDS
    ]


def prefill_contract(config: DecoderConfig, dtype: str, with_loss: bool) -> GraphContract:
    cache = cache_layout(config, dtype)
    tokens = (BATCH, SEQUENCE)
    inputs = [
        TensorSpec("input_ids", "int64", tokens),
        TensorSpec("attention_mask", "int64", tokens),
        TensorSpec("position_ids", "int64", tokens),
    ]
    outputs = [
        TensorSpec("logits", dtype, (BATCH, SEQUENCE, config.vocab_size)),
        *_kv_specs(cache, cache.present, SEQUENCE),
    ]
    if with_loss:
        inputs.append(TensorSpec("labels", "int64", tokens))
        outputs.append(TensorSpec("loss", "float32", ()))
    return GraphContract("prefill.onnx", tuple(inputs), tuple(outputs))


def decode_contract(config: DecoderConfig, dtype: str) -> GraphContract:
    cache = cache_layout(config, dtype)
    inputs = [
        TensorSpec("input_ids", "int64", (BATCH, SEQUENCE)),
        TensorSpec("attention_mask", "int64", (BATCH, TOTAL)),
        TensorSpec("position_ids", "int64", (BATCH, SEQUENCE)),
        *_kv_specs(cache, cache.past, PAST),
    ]
    outputs = [
        TensorSpec("logits", dtype, (BATCH, SEQUENCE, config.vocab_size)),
        *_kv_specs(cache, cache.present, TOTAL),
    ]
    return GraphContract("decode.onnx", tuple(inputs), tuple(outputs))
