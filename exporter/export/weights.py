"""Store the weights of several graphs once, in one external-data file.

The dynamo exporter folds weight transposes into new initializers whose names
differ between separately exported graphs, so tensors are matched by content
(dtype, shape, bytes), not by name. Each distinct tensor is written once; every
graph's initializer points at the same offset.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import helper, numpy_helper

# Small constants (scalars, shape vectors) stay inline in the graph.
INLINE_LIMIT_BYTES = 1024
# Page-aligned offsets let ONNX Runtime memory-map tensors directly.
ALIGNMENT = 4096


@dataclass(frozen=True)
class SharedWeights:
    file: str
    bytes: int
    tensors: int  # distinct tensors in the file
    # Per model (in the order given): its external initializers as
    # {"name", "offset", "length", "dtype", "shape"}, so a runtime can map the file
    # once and hand both sessions the same memory.
    initializers: list[list[dict]]


def _raw_bytes(tensor: onnx.TensorProto) -> bytes:
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.to_array(tensor).tobytes()


def write_shared_weights(models: list[onnx.ModelProto], folder: Path, file_name: str) -> SharedWeights:
    """Move every large initializer of `models` into folder/file_name, deduplicated by content."""
    offsets: dict[tuple, tuple[int, int]] = {}
    tables: list[list[dict]] = []
    with open(folder / file_name, "wb") as out:
        for model in models:
            table = []
            tables.append(table)
            for tensor in model.graph.initializer:
                data = _raw_bytes(tensor)
                if len(data) < INLINE_LIMIT_BYTES:
                    continue
                key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(data).digest())
                if key not in offsets:
                    offset = -out.tell() % ALIGNMENT + out.tell()
                    out.write(b"\0" * (offset - out.tell()))
                    out.write(data)
                    offsets[key] = (offset, len(data))
                offset, length = offsets[key]
                tensor.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    tensor.ClearField(field)
                tensor.data_location = onnx.TensorProto.EXTERNAL
                del tensor.external_data[:]
                for k, v in (("location", file_name), ("offset", str(offset)), ("length", str(length))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = k, v
                table.append(
                    {
                        "name": tensor.name,
                        "offset": offset,
                        "length": length,
                        "dtype": helper.tensor_dtype_to_np_dtype(tensor.data_type).name,
                        "shape": list(tensor.dims),
                    }
                )
        size = out.tell()
    return SharedWeights(file_name, size, len(offsets), tables)
