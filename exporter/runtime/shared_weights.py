"""The artifact's weights file mapped once, for every session on its graphs to read in place."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from exporter.artifact.folder import Artifact
from exporter.errors import InputError


class SharedWeightMap:
    """The weights file mapped once; a session given these OrtValues reads the weights in place.

    Left to itself, each session maps each tensor on its own, so two sessions
    hold two mappings of every weight (twice the RSS). Read-only views of one
    mapping are used without a copy (`add_initializer`).
    """

    def __init__(self, artifact: Artifact):
        path = artifact.path(artifact.manifest.weights_file)
        self.path = path
        # A model whose every tensor is small enough to stay inline (exporter.export.weights.INLINE_LIMIT_BYTES)
        # leaves the file empty, which mmap refuses; nothing is read from it then.
        self._file = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
        # by place and form: the export stores equal bytes once, which two initializers may read in two shapes
        self._values: dict[tuple, ort.OrtValue] = {}
        self._tables = artifact.manifest.initializers

    @classmethod
    def of(cls, artifact: Artifact, shared: SharedWeightMap | None) -> SharedWeightMap:
        """`shared`, a mapping of this artifact's weights file that another session reads, or a new one (None)."""
        if shared is None:
            return cls(artifact)
        if not isinstance(shared, SharedWeightMap) or shared.path != artifact.path(artifact.manifest.weights_file):
            raise InputError(
                f"weights must be a SharedWeightMap of {artifact.folder}'s own weights file, got {shared!r:.80}; "
                "pass SharedWeightMap(artifact) or None (`weights`)"
            )
        return shared

    def initializers(self, graph_file: str) -> tuple[list[str], list[ort.OrtValue]]:
        names, values = [], []
        for entry in self._tables[graph_file]:
            key = (entry["offset"], entry["length"], entry["dtype"], tuple(entry["shape"]))
            if key not in self._values:
                dtype = np.dtype(entry["dtype"])
                view = np.frombuffer(
                    self._file, dtype=dtype, count=entry["length"] // dtype.itemsize, offset=entry["offset"]
                ).reshape(entry["shape"])
                self._values[key] = ort.OrtValue.ortvalue_from_numpy(view)
            names.append(entry["name"])
            values.append(self._values[key])
        return names, values
