"""decode.onnx on the CPU through onnxruntime's C library itself, not its Python binding.

The binding makes a Python object for every value it binds or returns: a decode step of minimind-3 spent about
0.27 ms outside onnxruntime's run on them (README, "Benchmark"), against almost nothing in onnxruntime-genai's
C++ loop. Here the values stay C pointers: a step is one `Run` over two arrays of them, and the greedy loop of
`exporter.runtime._native_loop` (C, built at install where a compiler is found) runs many steps in one call.

The library is the `libonnxruntime.so` that the onnxruntime wheel ships beside its binding (the one
onnxruntime-genai loads), so it is the same onnxruntime version. Only entries of the C API's first block
(`ORT_API_VERSION` 1, which onnxruntime keeps unchanged in every release) are used, by their index in the
`OrtApi` table, since the wheel ships no header.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import onnxruntime

from exporter.artifact.contract import CacheLayout
from exporter.errors import first_line
from exporter.runtime.sessions import log_severity

P = ctypes.c_void_p

# Indices in the OrtApi table (onnxruntime_c_api.h, the block of version 1), with each entry's argument types.
_ENTRIES = {
    "GetErrorMessage": (2, [P], ctypes.c_char_p),
    "CreateEnv": (3, [ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(P)], P),
    "CreateSession": (7, [P, ctypes.c_char_p, P, ctypes.POINTER(P)], P),
    "Run": (9, [P, P, P, P, ctypes.c_size_t, P, ctypes.c_size_t, P], P),
    "CreateSessionOptions": (10, [ctypes.POINTER(P)], P),
    "DisableMemPattern": (17, [P], P),
    "SetSessionLogSeverityLevel": (22, [P, ctypes.c_int], P),
    "SetSessionGraphOptimizationLevel": (23, [P, ctypes.c_int], P),
    "SetIntraOpNumThreads": (24, [P, ctypes.c_int], P),
    "CreateTensorWithDataAsOrtValue": (
        49,
        [P, P, ctypes.c_size_t, P, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(P)],
        P,
    ),
    "GetTensorMutableData": (51, [P, ctypes.POINTER(P)], P),
    "GetTensorElementType": (60, [P, ctypes.POINTER(ctypes.c_int)], P),
    "GetDimensionsCount": (61, [P, ctypes.POINTER(ctypes.c_size_t)], P),
    "GetDimensions": (62, [P, P, ctypes.c_size_t], P),
    "GetTensorTypeAndShape": (65, [P, ctypes.POINTER(P)], P),
    "CreateCpuMemoryInfo": (69, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(P)], P),
    "ReleaseStatus": (93, [P], None),
    "ReleaseSession": (95, [P], None),
    "ReleaseValue": (96, [P], None),
    "ReleaseTensorTypeAndShapeInfo": (99, [P], None),
    "ReleaseSessionOptions": (100, [P], None),
}

# ONNXTensorElementDataType of the numpy dtypes a graph of this toolkit takes or gives
_ELEMENT_TYPES = {
    np.dtype(np.float32): 1,
    np.dtype(np.uint8): 2,
    np.dtype(np.int8): 3,
    np.dtype(np.int32): 6,
    np.dtype(np.int64): 7,
    np.dtype(np.bool_): 9,
    np.dtype(np.float16): 10,
    np.dtype(np.float64): 11,
}
_DTYPES = {code: dtype for dtype, code in _ELEMENT_TYPES.items()}
_OPTIMIZATION_LEVELS = {"disable": 0, "basic": 1, "extended": 2, "all": 99}
_ARENA_ALLOCATOR, _DEFAULT_MEMORY = 1, 0


class CApiError(Exception):
    """A call into onnxruntime's C library failed; the message is onnxruntime's."""


class _Api:
    """The C library's table of functions, each callable by name."""

    def __init__(self, library: Path):
        self.library = ctypes.CDLL(str(library))
        get_base = self.library.OrtGetApiBase
        get_base.restype = ctypes.POINTER(P * 2)  # OrtApiBase: GetApi, GetVersionString
        get_api = ctypes.CFUNCTYPE(P, ctypes.c_uint32)(get_base().contents[0])
        table = ctypes.cast(get_api(1), ctypes.POINTER(P))
        if not table:
            raise CApiError(f"{library} offers no C API of version 1")
        for name, (index, argtypes, restype) in _ENTRIES.items():
            setattr(self, name, ctypes.CFUNCTYPE(restype, *argtypes)(table[index]))
        self.table = ctypes.addressof(table.contents)
        self.env = P()
        # the environment's log level, onnxruntime's own messages: as the binding's sessions get (log_severity)
        self.check(self.CreateEnv(log_severity(), b"minimind-onnx", ctypes.byref(self.env)))
        self.cpu_memory = P()
        self.check(self.CreateCpuMemoryInfo(_ARENA_ALLOCATOR, _DEFAULT_MEMORY, ctypes.byref(self.cpu_memory)))

    def check(self, status) -> None:
        if status:
            message = self.GetErrorMessage(status).decode(errors="replace")
            self.ReleaseStatus(status)
            raise CApiError(message)

    def tensor(self, array: np.ndarray, shape) -> int:
        """An OrtValue over `array`'s memory (no copy); `shape`: a ctypes int64 array of its dimensions."""
        value = P()
        self.check(
            self.CreateTensorWithDataAsOrtValue(
                self.cpu_memory,
                array.ctypes.data,
                array.nbytes,
                shape,
                len(shape),
                _ELEMENT_TYPES[array.dtype],
                ctypes.byref(value),
            )
        )
        return value.value

    def array(self, value: int) -> np.ndarray:
        """A numpy copy of a tensor OrtValue."""
        info, count, code, data = P(), ctypes.c_size_t(), ctypes.c_int(), P()
        self.check(self.GetTensorTypeAndShape(value, ctypes.byref(info)))
        try:
            self.check(self.GetDimensionsCount(info, ctypes.byref(count)))
            dims = (ctypes.c_int64 * count.value)()
            self.check(self.GetDimensions(info, dims, count.value))
            self.check(self.GetTensorElementType(info, ctypes.byref(code)))
        finally:
            self.ReleaseTensorTypeAndShapeInfo(info)
        dtype, shape = _DTYPES[code.value], tuple(dims)
        result = np.empty(shape, dtype)
        if result.nbytes:
            self.check(self.GetTensorMutableData(value, ctypes.byref(data)))
            ctypes.memmove(result.ctypes.data, data.value, result.nbytes)
        return result


def library_path() -> Path | None:
    """The C library of the onnxruntime package imported here, or None where it ships none (not Linux)."""
    found = sorted((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so.*"))
    return found[-1] if found else None


@functools.cache
def api() -> _Api:
    """The process's one handle on the C library (one environment, as onnxruntime allows)."""
    library = library_path()
    if library is None:
        raise CApiError("the onnxruntime package ships no libonnxruntime.so here")
    return _Api(library)


def unavailable() -> str | None:
    """Why onnxruntime's C library cannot be driven here, or None when it can."""
    library = library_path()
    if library is None:
        return "no libonnxruntime.so in the onnxruntime package"
    try:
        api()
    except (OSError, AttributeError, CApiError) as exc:  # no such file or symbol, or the table refused
        return f"{library.name} does not load ({first_line(exc, 200)})"
    return None


def shape_of(array: np.ndarray):
    return (ctypes.c_int64 * array.ndim)(*array.shape)


class Cache:
    """The KV cache between decode steps: OrtValues owned here (released with this object), in the order of the
    session's past inputs, and the batch and length they hold."""

    __slots__ = ("values", "batch", "length", "_release")

    def __init__(self, values: list[int], batch: int, length: int):
        self.values, self.batch, self.length = values, batch, length
        self._release = api().ReleaseValue

    def __len__(self) -> int:
        return len(self.values)

    def arrays(self) -> list[np.ndarray]:
        """Numpy copies of the values (tests, inspection)."""
        return [api().array(value) for value in self.values]

    def __del__(self):
        for value in self.values:
            self._release(value)


class Session:
    """A CPU session on one graph, with the options of exporter.runtime.sessions.session_options for decode.onnx:
    prepacked weights, spinning threads, no memory patterns."""

    def __init__(self, path: Path, intra_op_threads: int, optimization: str, log_level: int):
        self.api = lib = api()
        options = P()
        lib.check(lib.CreateSessionOptions(ctypes.byref(options)))
        try:
            lib.check(lib.DisableMemPattern(options))  # see session_options
            lib.check(lib.SetSessionLogSeverityLevel(options, log_level))
            lib.check(lib.SetSessionGraphOptimizationLevel(options, _OPTIMIZATION_LEVELS[optimization]))
            lib.check(lib.SetIntraOpNumThreads(options, intra_op_threads))
            self.handle = P()
            lib.check(lib.CreateSession(lib.env, str(path).encode(), options, ctypes.byref(self.handle)))
        finally:
            lib.ReleaseSessionOptions(options)

    def _run_values(self, input_names: list[str], inputs: list[int], output_names: list[str]) -> list[int]:
        """Run on the OrtValues `inputs`; return the output OrtValues, which the caller releases."""
        names_in = (ctypes.c_char_p * len(input_names))(*(name.encode() for name in input_names))
        names_out = (ctypes.c_char_p * len(output_names))(*(name.encode() for name in output_names))
        values_in = (P * len(inputs))(*inputs)
        values_out = (P * len(output_names))()
        self.api.check(
            self.api.Run(self.handle, None, names_in, values_in, len(inputs), names_out, len(output_names), values_out)
        )
        return list(values_out)

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run on numpy arrays; return numpy copies of the outputs (as InferenceSession.run)."""
        lib = self.api
        arrays = [np.ascontiguousarray(value) for value in feeds.values()]  # kept alive until the run returns
        inputs = [lib.tensor(array, shape_of(array)) for array in arrays]
        try:
            outputs = self._run_values(list(feeds), inputs, output_names)
        finally:
            for value in inputs:
                lib.ReleaseValue(value)
        try:
            return [lib.array(value) for value in outputs]
        finally:
            for value in outputs:
                lib.ReleaseValue(value)

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle:
            self.api.ReleaseSession(handle)


class DecodeSession(Session):
    """decode.onnx's session for start/step and the greedy loop: its inputs are the three feeds and the pasts
    (`past_names`, the cache's order), its outputs the logits and the presents of those pasts (`present_names`)."""

    FEEDS = ("input_ids", "attention_mask", "position_ids")

    def __init__(
        self,
        path: Path,
        past_names: list[str],
        present_names: list[str],
        cache: CacheLayout,
        vocab_size: int,
        **options,
    ):
        super().__init__(path, **options)
        self._cache_count = len(past_names)
        self._heads, self._head_dim = cache.num_key_value_heads, cache.head_dim
        self._dtype = np.dtype(cache.dtype)  # of the pasts, the presents and the logits
        self.vocab = vocab_size
        self.input_names = (ctypes.c_char_p * (3 + len(past_names)))(*(n.encode() for n in (*self.FEEDS, *past_names)))
        self.output_names = (ctypes.c_char_p * (1 + len(present_names)))(
            *(n.encode() for n in ("logits", *present_names))
        )
        self._inputs = (P * len(self.input_names))()  # used under the runner's lock
        self._outputs = (P * len(self.output_names))()
        self._no_values = [None] * len(present_names)
        self._empty = np.zeros(0, self._dtype)  # the memory of every empty past (none is read)

    @staticmethod
    def cache_shape(cache: Cache) -> tuple[int, int]:
        return cache.batch, cache.length

    @staticmethod
    def cache_arrays(cache: Cache) -> list[np.ndarray]:
        return cache.arrays()

    def empty_cache(self, batch: int) -> Cache:
        shape = (ctypes.c_int64 * 4)(batch, self._heads, 0, self._head_dim)
        return Cache([self.api.tensor(self._empty, shape) for _ in range(self._cache_count)], batch, 0)

    def step(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, cache: Cache
    ) -> tuple[np.ndarray, Cache]:
        """Run new tokens on `cache`; return the last position's logits (float32 copy) and the new cache."""
        lib, inputs, outputs = self.api, self._inputs, self._outputs
        feeds = [np.ascontiguousarray(array) for array in (input_ids, attention_mask, position_ids)]
        inputs[:3] = [lib.tensor(array, shape_of(array)) for array in feeds]
        inputs[3:] = cache.values
        outputs[:] = [None, *self._no_values]
        status = lib.Run(
            self.handle, None, self.input_names, inputs, len(inputs), self.output_names, len(outputs), outputs
        )
        for value in inputs[:3]:
            lib.ReleaseValue(value)
        lib.check(status)
        logits_value, new = outputs[0], Cache(outputs[1:], cache.batch, cache.length + input_ids.shape[1])
        try:
            data = P()
            lib.check(lib.GetTensorMutableData(logits_value, ctypes.byref(data)))
            batch, length = input_ids.shape
            logits = (
                np.frombuffer(
                    (ctypes.c_char * (self._dtype.itemsize * batch * length * self.vocab)).from_address(data.value),
                    self._dtype,
                )
                .reshape(batch, length, self.vocab)[:, -1]
                .astype(np.float32)
            )
        finally:
            lib.ReleaseValue(logits_value)
        return logits, new

    def greedy(
        self, cache: Cache, mask: np.ndarray, position: int, token: int, steps: int, stops: np.ndarray
    ) -> tuple[list[int], bool, str, Cache]:
        """Up to `steps` greedy decode steps of one row in C (exporter.runtime._native_loop): run `token` at `position` on
        `cache`, choose the argmax, run it, and so on, ending after a stop id or at logits holding a NaN. `mask`:
        the row's contiguous int64 mask, covering the cache and every step. Returns the tokens chosen, whether a
        NaN ended the loop, onnxruntime's error ('' for none) and the cache after the last step run, which is
        `cache` advanced: its values are the new cache's or released."""
        from exporter.runtime import _native_loop

        values = (P * len(cache.values))(*cache.values)
        cache.values = []  # owned by `values` from here: the loop releases each past it replaces
        tokens = np.zeros(steps, np.int64)
        logits = np.zeros(self.vocab, np.float32)
        stops = np.ascontiguousarray(stops, np.int64)
        lib = self.api
        chosen, run, non_finite, error = _native_loop.greedy(
            lib.table,
            self.handle.value,
            lib.cpu_memory.value,
            ctypes.addressof(self.input_names),
            ctypes.addressof(self.output_names),
            len(values),
            ctypes.addressof(values),
            mask.ctypes.data,
            cache.length,
            position,
            token,
            steps,
            stops.ctypes.data,
            len(stops),
            tokens.ctypes.data,
            logits.ctypes.data,
            self.vocab,
        )
        return tokens[:chosen].tolist(), bool(non_finite), error, Cache(list(values), cache.batch, cache.length + run)


@functools.cache  # a failed import is otherwise searched for again on every call
def native_loop_available() -> bool:
    """Whether the C greedy loop was built at install (it needs a C compiler; without it, steps run from Python)."""
    try:
        from exporter import _native_loop  # noqa: F401
    except ImportError:
        return False
    return True
