"""Store the weights of several graphs once, in one external-data file.

The dynamo exporter folds weight transposes into new initializers whose names
differ between separately exported graphs, so tensors are matched by content
(dtype and bytes), not by name. Each distinct content is written once; every
initializer holding it points at the same offset, with its own shape: a tied
table quantized once is read as MatMulNBits' (vocab, blocks, bytes) and as
GatherBlockQuantized's (vocab, blocks x bytes).

Graphs are added one at a time, as each export finishes (SharedWeightsWriter):
a graph's weights go to the file and leave memory before the next graph is
traced, so the export never holds two graphs' weights, nor a serialised copy
of one (docs/design.md, "Memory of an export").
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

# Small constants (scalars, shape vectors) stay inline in the graph.
INLINE_LIMIT_BYTES = 1024
# Page-aligned offsets let ONNX Runtime memory-map tensors directly.
ALIGNMENT = 4096


@dataclass(frozen=True)
class SharedWeights:
    file: str
    bytes: int
    tensors: int  # distinct contents in the file
    # Per model (in the order given): its external initializers as
    # {"name", "offset", "length", "dtype", "shape"}, so a runtime can map the file
    # once and hand both sessions the same memory.
    initializers: list[list[dict]]


def _proto_bytes(tensor: onnx.TensorProto):
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.to_array(tensor).tobytes()


def _ir_bytes(tensor: ir.TensorProtocol):
    """The tensor's bytes as ONNX stores them (little-endian, C order), without a copy where its memory already
    is that: a parameter or a folded weight can be a gigabyte."""
    if sys.byteorder == "big":
        return tensor.tobytes()
    array = np.ascontiguousarray(tensor.numpy())  # a view of a torch parameter; copied only if strided
    return memoryview(array.reshape(-1).view(np.uint8))


class SharedWeightsWriter:
    """folder/file_name, written graph by graph: `add` moves a graph's large initializers into the file,
    deduplicated by content against every graph added before, and returns the graph holding references only.

    Use as a context manager; `result` describes the file once it is closed.
    """

    def __init__(self, folder: Path, file_name: str):
        self.file_name = file_name
        self._out = open(Path(folder) / file_name, "wb")
        self._offsets: dict[tuple, tuple[int, int]] = {}
        self._tables: list[list[dict]] = []
        self.result: SharedWeights | None = None

    def __enter__(self) -> SharedWeightsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._out.closed:
            return
        size = self._out.tell()
        self._out.close()
        self.result = SharedWeights(self.file_name, size, len(self._offsets), self._tables)

    def _place(self, dtype: int, data) -> tuple[int, int]:
        """(offset, length) of these bytes in the file, written at the next aligned offset unless already there."""
        key = (dtype, hashlib.sha256(data).digest())
        if key not in self._offsets:
            out = self._out
            offset = -out.tell() % ALIGNMENT + out.tell()
            out.write(b"\0" * (offset - out.tell()))
            out.write(data)
            self._offsets[key] = (offset, len(data) if isinstance(data, bytes) else data.nbytes)
        return self._offsets[key]

    def _entry(self, name: str, dtype: int, dims: tuple, offset: int, length: int) -> dict:
        np_dtype = helper.tensor_dtype_to_np_dtype(dtype).name
        return {"name": name, "offset": offset, "length": length, "dtype": np_dtype, "shape": list(dims)}

    def add(self, model: ir.Model | onnx.ModelProto) -> onnx.ModelProto:
        """Move `model`'s initializers of INLINE_LIMIT_BYTES or more into the file. An onnx_ir model (what
        torch.onnx builds) is serialised once its weights have left it, into a graph of references; a ModelProto
        is changed in place and returned."""
        table: list[dict] = []
        self._tables.append(table)
        if isinstance(model, onnx.ModelProto):
            for tensor in model.graph.initializer:
                data = _proto_bytes(tensor)
                if len(data) < INLINE_LIMIT_BYTES:
                    continue
                offset, length = self._place(tensor.data_type, data)
                _point_at(tensor, self.file_name, offset, length)
                table.append(self._entry(tensor.name, tensor.data_type, tuple(tensor.dims), offset, length))
            return model
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None or isinstance(tensor, ir.ExternalTensor) or tensor.nbytes < INLINE_LIMIT_BYTES:
                continue
            dims = tuple(tensor.shape.numpy())
            offset, length = self._place(tensor.dtype.value, _ir_bytes(tensor))
            value.const_value = ir.ExternalTensor(
                self.file_name, offset, length, tensor.dtype, shape=tensor.shape, name=value.name
            )
            table.append(self._entry(value.name, tensor.dtype.value, dims, offset, length))
        return ir.serde.serialize_model(model)


def _point_at(tensor: onnx.TensorProto, file_name: str, offset: int, length: int) -> None:
    tensor.ClearField("raw_data")
    for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        tensor.ClearField(field)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for k, v in (("location", file_name), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = k, v
