"""The two sides the weight audit matches: the reference's tensors (parameters, buffers and the tables of
`exported_constants()`) in every form an initializer may hold them, indexed by content, and the initializers' values,
read from the artifact's weights file mapped once.

Besides a parameter or buffer, an initializer may hold a table that the reference computes from its config alone and
the exporter folds into the graph: those the model lists in `exported_constants()` (minimind's rotary inverse
frequencies), as computed (the forward computes them in float32 whatever the model's dtype) or cast to the
artifact's dtype, wherever they are read. A table is not copied but computed again by the exporter's constant
folding, whose elementary functions are not torch's. Each library computes `pow` within an ulp of the exact value (a
relative error of at most ε = 2^-23, float32's machine epsilon), so the two copies of `base ** e` may differ by 2ε;
the reciprocal keeps that relative difference and rounds each side once more (ε/2 each), and YaRN's ramp multiplies
both by the same factor (its basic operations give identical results on identical inputs), rounding each side once
more: the copies lie at most 4ε apart, relative (TABLE_RTOL). Held in float16, two float32 values that close round
to float16 values at most one float16 ulp apart. A wrong base, dimension or scaling moves the frequencies by far
more.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from exporter.artifact.folder import Artifact

# A computed table's elements match within this relative difference of the reference's, and held in float16 within
# one float16 ulp more (this module's docstring derives it).
TABLE_RTOL = 4 * float(np.finfo(np.float32).eps)


@dataclass
class ReferenceTensor:
    """A parameter, buffer or computed table of the reference, under all its names."""

    names: list[str]  # the first is the one reported; tied tensors have several
    tensor: object  # torch.Tensor
    kind: str  # "parameter", "buffer" or "constant"

    @property
    def name(self) -> str:
        return self.names[0] + (f" (also {', '.join(self.names[1:])})" if len(self.names) > 1 else "")

    @property
    def owners(self) -> set[str] | None:
        """The modules holding it (None for a computed table, which any module may read)."""
        if self.kind == "constant":
            return None
        return {name.rpartition(".")[0] for name in self.names}

    @property
    def required(self) -> bool:
        return self.kind == "parameter" and self.tensor.numel() > 1


def reference_tensors(model) -> list[ReferenceTensor]:
    """The model's floating parameters and buffers, each tensor once under every name it has, then its
    exported_constants()."""
    found: dict[int, ReferenceTensor] = {}
    for kind, named in (
        ("parameter", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for name, tensor in named:
            if tensor is None or not tensor.is_floating_point():
                continue
            if id(tensor) in found:
                found[id(tensor)].names.append(name)
            else:
                found[id(tensor)] = ReferenceTensor([name], tensor.detach(), kind)
    constants = getattr(model, "exported_constants", None)
    tables = constants() if callable(constants) else {}
    return [*found.values(), *(ReferenceTensor([name], t.detach(), "constant") for name, t in tables.items())]


def _torch_dtype(np_dtype: np.dtype):
    import torch

    return {
        np.dtype(np.float32): torch.float32,
        np.dtype(np.float16): torch.float16,
        np.dtype(np.float64): torch.float64,
    }.get(np.dtype(np_dtype))


def forms(reference: ReferenceTensor, export_dtype, wanted: set[tuple[str, tuple]]) -> Iterator[tuple[np.ndarray, str]]:
    """The arrays an initializer holding `reference` may equal, each with how it came to be: cast to the export's
    dtype (a computed table also as computed), then to the initializer's dtype; as it is, and transposed when
    2-D. Only the (dtype, shape) pairs in `wanted` (those of the graph's initializers) are built."""
    shapes = {tuple(reference.tensor.shape)}
    if reference.tensor.ndim == 2:
        shapes.add(tuple(reference.tensor.shape[::-1]))
    seen = set()
    for dtype_name, shape in wanted:
        if shape not in shapes:
            continue
        target = _torch_dtype(np.dtype(dtype_name))
        if target is None:
            continue
        casts = [(reference.tensor.to(export_dtype), target.itemsize > export_dtype.itemsize)]
        if reference.kind == "constant":
            casts.append((reference.tensor, False))
        for cast, upcast in casts:
            value = cast.to(target)
            for transposed in (False, True) if reference.tensor.ndim == 2 else (False,):
                array = (value.t() if transposed else value).contiguous().cpu().numpy()
                if tuple(array.shape) != shape:
                    continue
                key = (dtype_name, shape, tensor_digest(array))
                if key not in seen:
                    seen.add(key)
                    yield array, ("transposed " if transposed else "") + ("upcast" if upcast else "")


def table_hits(array: np.ndarray, references: list[ReferenceTensor], export_dtype) -> list[tuple[ReferenceTensor, str]]:
    """The computed table `array` equals within TABLE_RTOL of each element (and one float16 ulp more when held in
    float16), as a hit; none otherwise."""
    wanted = {(array.dtype.name, tuple(array.shape))}
    for reference in references:
        if reference.kind != "constant":
            continue
        for form, how in forms(reference, export_dtype, wanted):
            expected = form.astype(np.float64)
            reach = TABLE_RTOL * np.abs(expected)
            if form.dtype.itemsize < 4:
                reach = reach + np.spacing(np.abs(form)).astype(np.float64)
            if np.all(np.abs(array.astype(np.float64) - expected) <= reach):
                return [(reference, how)]
    return []


class ReferenceIndex:
    """The reference tensors' forms by (dtype, shape, digest), shared by both graphs: the forms of one (dtype,
    shape) are built the first time an initializer of that dtype and shape asks for them."""

    def __init__(self, references: list[ReferenceTensor], export_dtype):
        self.references, self.export_dtype = references, export_dtype
        self._built: set[tuple] = set()
        self._forms: dict[tuple, list[tuple[ReferenceTensor, str]]] = {}

    def hits(self, array: np.ndarray, digest: bytes) -> list[tuple[ReferenceTensor, str]]:
        """The reference tensors `array` (whose digest is given) equals exactly, each with how it came to be."""
        key = (array.dtype.name, tuple(array.shape))
        if key not in self._built:
            self._built.add(key)
            for reference in self.references:
                for form, how in forms(reference, self.export_dtype, {key}):
                    self._forms.setdefault((*key, tensor_digest(form)), []).append((reference, how))
        return self._forms.get((*key, digest), [])


def tensor_digest(array: np.ndarray) -> bytes:
    return hashlib.blake2b(memoryview(np.ascontiguousarray(array)).cast("B"), digest_size=20).digest()


def read_initializer(artifact: Artifact, tensor: onnx.TensorProto, weights) -> tuple[np.ndarray | None, str]:
    """The initializer's values: inline from the graph, external from the artifact's weights file (mapped once,
    read only)."""
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor), ""
    info = {entry.key: entry.value for entry in tensor.external_data}
    if info.get("location") != artifact.manifest.weights_file:
        return None, f"points into {info.get('location')!r}, not the weights file {artifact.manifest.weights_file}"
    offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
    count = int(np.prod(tensor.dims, dtype=np.int64))
    if length != count * dtype.itemsize or offset < 0 or offset + length > len(weights()):
        return (
            None,
            f"points at bytes {offset}..{offset + length} of the weights file, not a {list(tensor.dims)} {dtype}",
        )
    return weights()[offset : offset + length].view(dtype).reshape(tuple(tensor.dims)), ""


class WeightsFile:
    """The artifact's weights file, mapped read-only at the first external tensor, and the digest of each tensor
    in it: both graphs point at the same bytes, which are hashed once."""

    def __init__(self, artifact: Artifact):
        self.path = artifact.path(artifact.manifest.weights_file)
        self._mapped = None
        self.digests: dict[tuple, bytes] = {}

    def __call__(self) -> np.ndarray:
        if self._mapped is None:
            self._mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mapped
