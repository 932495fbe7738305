"""Making ONNX Runtime sessions on an artifact's graphs: the execution providers this toolkit runs on (and
whether CUDA can start here), session settings and options, the weights both graphs share, and reading a graph
checked against its manifest before onnxruntime loads it. `exporter.runtime.runner` runs the sessions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as _ort_errors

from exporter.artifact.contract import GraphContract
from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import Manifest
from exporter.artifact.paths import (
    TEXT_PATH_FIX,
    check_text_path,
    folder_lock,
    parents_removed_unless_done,
    uninterrupted,
)
from exporter.errors import (
    ArtifactError,
    InputError,
    OutputPathError,
    ProviderError,
    check_flag,
    first_line,
    is_integer,
)

log = logging.getLogger(__name__)

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
PROVIDER_ALIASES = {"cpu": CPU, "cuda": CUDA}
PARITY_PROVIDERS = (CPU, CUDA)


def provider_name(name: str) -> str:
    """The full name of `cpu`, `cuda`, or of any provider this build has, written short or in any case."""
    if not isinstance(name, str):  # else None, or a list where one name is taken, fails as "no attribute 'lower'"
        raise ProviderError(
            f"a provider is a name such as 'cpu' or 'cuda', got {name!r} ({type(name).__name__}); pass one (`provider`)"
        )
    for full in ort.get_available_providers():
        if name.lower() in (full.lower(), full.lower().removesuffix("executionprovider")):
            return full
    return PROVIDER_ALIASES.get(name.lower(), name)


def check_provider(name: str) -> str:
    """The full provider name, or ProviderError unless it is the CPU or CUDA provider and this build has it.

    Any other provider (onnxruntime's Azure provider, say) would run the graphs on the CPU
    provider behind it, untested and unverified under its own name.
    """
    full = provider_name(name)
    if full not in PARITY_PROVIDERS:
        raise ProviderError(
            f"this toolkit runs and verifies on {' and '.join(PARITY_PROVIDERS)}, not "
            f"{full or 'an empty name'}; pass cpu or cuda (`provider`)"
        )
    if full == CUDA and (unusable := cuda_unusable()) is not None:  # every build has the CPU provider
        raise ProviderError(f"{CUDA} cannot run here: {unusable}")
    return full


def check_quantized_provider(provider: str, manifest) -> None:
    """ProviderError when `provider` (a full name) has no MatMulNBits kernel of the artifact's bits: its session
    would run those nodes on the CPU provider behind it, copying activations back and forth, unverified under the
    provider's name. Nothing for a float artifact, nor on the CPU provider, which has the kernel for 4 and 8 bits."""
    quantization = manifest.quantization
    if quantization is None or provider == CPU:
        return
    bits = {quantization.bits, quantization.bits_for(quantization.lm_head) or quantization.bits}
    bits = sorted(bits | {m.bits for m in quantization.mix if m.bits is not None})
    for reason in filter(None, (matmul_nbits_unusable(provider, b) for b in bits)):
        raise ProviderError(
            f"{provider} cannot run this {quantization.scheme} artifact: {reason}; run it on the CPU (`provider`), "
            "or export it as float32 for this provider"
        )


@functools.cache
def matmul_nbits_unusable(provider: str, bits: int) -> str | None:
    """Why `provider` cannot run a float32 MatMulNBits node of `bits` bits itself, or None: one such node in a session
    that may not fall back to the CPU provider tells."""
    k = n = 32
    blob = k * bits // 8
    node = onnx.helper.make_node(
        "MatMulNBits", ["a", "b", "scales"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=k
    )
    graph = onnx.helper.make_graph(
        [node],
        "matmul_nbits_probe",
        [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1, k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, n])],
        [
            onnx.numpy_helper.from_array(np.zeros((n, 1, blob), np.uint8), "b"),
            onnx.numpy_helper.from_array(np.ones(n, np.float32), "scales"),
        ],
    )
    model = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)],
        ir_version=9,
    )
    options = plain_session_options()
    if provider != CPU:  # the provider alone, not the CPU provider behind it (onnxruntime refuses both at once)
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ort.InferenceSession(model.SerializeToString(), options, providers=[provider])
    except Exception as exc:  # noqa: BLE001 -- any failure to place the node there is the answer
        return f"no {bits}-bit MatMulNBits kernel on {provider} ({first_line(exc, 160)})"
    return None


def cuda_unusable() -> str | None:
    """Why the CUDA provider cannot run here, or None when it can."""
    return _cuda_start_failure(tuple(ort.get_available_providers()))


@functools.cache
def _cuda_start_failure(available: tuple[str, ...]) -> str | None:
    if CUDA not in available:
        return "not available in this onnxruntime build (install onnxruntime-gpu on a machine with a CUDA GPU)"
    # A build lists its providers whether or not a GPU, CUDA and cuDNN are there to start them, and a
    # session whose provider fails to start falls back to the CPU: one Identity node tells.
    identity = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "cuda_probe",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    model = onnx.helper.make_model(identity, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=9)
    options = plain_session_options()  # once the shared thread pool exists, a session with its own pool fails
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the build's own "not in available provider names"
            started = ort.InferenceSession(
                model.SerializeToString(), options, providers=[CUDA], enable_fallback=0
            ).get_providers()
    except Exception as exc:  # noqa: BLE001 -- any failure to start it is the answer, never a crash
        return f"could not start ({first_line(exc, 200)}); check the GPU, CUDA and cuDNN installation"
    if CUDA not in started:
        return "could not start (onnxruntime fell back to the CPU); check the GPU, CUDA and cuDNN installation"
    return None


def check_parity_providers(names) -> list[str]:
    """Providers to verify on, as full names without repeats, each checked; a str names one provider."""
    if isinstance(names, str):  # iterated, "cpu" would be the providers "c", "p" and "u"
        names = [names]
    if not isinstance(names, (list, tuple)):  # else 5 fails as "'int' object is not iterable"
        raise ProviderError(
            f"providers must be a provider name or a list of them, got {names!r:.80}; pass e.g. "
            "['cpu'], or None for every available one (`providers`)"
        )
    return list(dict.fromkeys(check_provider(name) for name in names))


def session_providers(full_name: str) -> list:
    """The providers list of a session on `full_name`: the CPU provider runs the ops another provider lacks.

    Every session is made with enable_fallback=0: onnxruntime's Python binding otherwise answers a failure to
    create or run one (any ValueError or RuntimeError, e.g. a message that is no UTF-8) by printing a banner to
    stdout, into --json's document, and retrying on the CPU alone: a CUDA verification would run on the CPU.

    CUDA runs with TF32 off: onnxruntime's CUDA provider turns it on by default, which rounds a float32
    MatMul's inputs to 11 significant bits, so a float32 artifact would neither compute in float32 nor
    match what its verification promises (float32 tolerances, which TF32's rounding alone can exceed, and
    MoE routers that choose the same experts as the reference).
    """
    return [full_name] if full_name == CPU else [(full_name, {"use_tf32": "0"}), CPU]


def available_parity_providers() -> tuple[list[str], dict[str, str]]:
    """Providers to verify on by default, and the skipped ones with the reason."""
    unusable = cuda_unusable()
    if unusable is None:
        return list(PARITY_PROVIDERS), {}
    return [CPU], {CUDA: unusable}


MAX_THREADS = 1024  # a bound for typos: onnxruntime takes a C int and would start every thread asked for


@dataclass(frozen=True)
class SessionSettings:
    """ONNX Runtime session options, with defaults chosen on the benchmark (README)."""

    intra_op_threads: int = 0  # 0: one per physical core
    optimization: str = "all"  # disable | basic | extended | all
    prepack_weights: bool = True  # for decode.onnx, the generation hot path; see session_options
    shared_thread_pool: bool = False  # see _use_global_thread_pool
    # save the optimised graphs here (inspection, faster reloads); a str becomes a Path
    optimized_model_dir: Path | None = None
    prompt_chunk: int = 128  # prompt tokens per decode.onnx call in OrtRunner.start; 0: all at once
    # The CPU provider has no float16 MatMul: it computes a float16 graph in float32. True (onnxruntime's default):
    # each session casts every float16 weight to a float32 copy once, at load, and keeps it (fast calls; twice the
    # float16 bytes per session). False: each call casts them again and returns the memory when it ends (no copy
    # between calls; the same products of the same float32 weights, unpacked: they differ by float32 rounding).
    float16_weights_cast_once: bool = True
    # Idle intra-op threads of decode.onnx's session spin, waiting for the next step (generation's hot path). False
    # where each call alternates with other compute in the process (verification runs PyTorch between the calls):
    # spinning threads would take the cores from it.
    decode_spins: bool = True

    def __post_init__(self):
        if self.optimization not in GRAPH_OPTIMIZATION:
            raise InputError(f"optimization must be one of {', '.join(GRAPH_OPTIMIZATION)}, got {self.optimization!r}")
        if not is_integer(self.intra_op_threads) or not 0 <= self.intra_op_threads <= MAX_THREADS:
            raise InputError(
                f"threads per session (`intra_op_threads`) must be an integer from 0 (one "
                f"per core) to {MAX_THREADS}, "
                f"got {self.intra_op_threads!r}"
            )
        if not is_integer(self.prompt_chunk) or self.prompt_chunk < 0:
            raise InputError(
                f"prompt_chunk must be an integer >= 0 (0 = the whole prompt in one call), got {self.prompt_chunk!r}"
            )
        for name in ("prepack_weights", "shared_thread_pool", "float16_weights_cast_once", "decode_spins"):
            check_flag(name, getattr(self, name))
        if self.optimized_model_dir is not None:
            if not isinstance(self.optimized_model_dir, (str, os.PathLike)):
                raise InputError(
                    f"optimized_model_dir must be a folder path (str or Path), got {self.optimized_model_dir!r}"
                )
            check_text_path(self.optimized_model_dir, "`optimized_model_dir`", TEXT_PATH_FIX, InputError)
            object.__setattr__(self, "optimized_model_dir", Path(self.optimized_model_dir))  # frozen dataclass


def checking_settings(manifest: Manifest) -> SessionSettings:
    """The settings of sessions that check the artifact of `manifest` (verification, the export's smoke run), which
    hold several sessions at once beside the PyTorch model: each session reads the weights in place from the one
    mapping and keeps no copy of its own, so that ONNX Runtime holds one copy of them however many sessions check.

    A float32 artifact's sessions are unprepacked (a prepacked decode.onnx would keep MLAS's packed copy beside the
    mapping; the two layouts differ by float32 rounding alone), and a float16 artifact's weights are cast in each
    call (SessionSettings.float16_weights_cast_once). A quantized artifact's get the defaults: MatMulNBits
    prepacked is the kernel that computes at its accuracy level, which unprepacked would not check.

    No session's idle threads spin: the checks run the reference between the calls (SessionSettings.decode_spins)."""
    if manifest.quantization is not None:
        return SessionSettings(decode_spins=False)
    return SessionSettings(
        prepack_weights=False, float16_weights_cast_once=manifest.dtype != "float16", decode_spins=False
    )


# onnxruntime's name of the optimiser pass that folds a Cast of a float16 initializer into a float32 initializer
FLOAT16_WEIGHT_FOLDING = "FuseFp16InitializerToFp32NodeTransformer"

GRAPH_OPTIMIZATION = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

_global_pool_threads: int | None = None


def _use_global_thread_pool(threads: int) -> None:
    """One intra-op pool for every session of the process (opt-in: SessionSettings(shared_thread_pool=True)).

    With a pool per session, the pool of the session that just ran keeps its
    threads spinning for a while, competing for the cores with the pool of the
    session called next: a decode step right after a prefill.onnx call is
    slower than one after another decode step. One shared pool has no idle
    spinner to fight, but once it exists ONNX Runtime refuses every session in
    the process that asks for a pool of its own, other libraries' included
    (Optimum's, for one). The default is therefore per-session pools with the
    prefill session's threads not spinning (session_options), which removes
    the same fight.
    """
    global _global_pool_threads
    if _global_pool_threads is None:
        ort.set_global_thread_pool_sizes(threads, 1)
        _global_pool_threads = threads
    elif _global_pool_threads != threads:
        log.warning(
            "the global thread pool already has %d threads; ignoring the request for %d", _global_pool_threads, threads
        )


def log_severity() -> int:
    """onnxruntime's own log: errors under debug logging (-v); otherwise nothing, since every failure it logs
    is raised too and reported in one line, which its multi-line copy would only repeat."""
    return 3 if log.isEnabledFor(logging.DEBUG) else 4


def plain_session_options() -> ort.SessionOptions:
    """Options for a helper session (a probe, a debug copy of a graph) that fits this process's threading.

    Once the global thread pool exists, ONNX Runtime refuses a session that asks for a pool of its own.
    """
    options = ort.SessionOptions()
    options.log_severity_level = log_severity()
    if _global_pool_threads is not None:
        options.use_per_session_threads = False
    return options


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


def session_options(
    settings: SessionSettings,
    graph_file: str,
    weights: SharedWeightMap | None,
    spin: bool = True,
    prepack: bool = False,
) -> ort.SessionOptions:
    """Options for one session.

    Args:
        settings: the session settings (optimisation level, threads, prepacking, where to save the optimised graph).
        graph_file: the graph's file name in the artifact (e.g. "decode.onnx"): picks its initializers from
            `weights` and names its saved optimised graph.
        weights: the shared mapping to read the weights from in place; None: the session reads them itself.
        spin: whether idle intra-op threads spin; False for a session whose threads would otherwise take the
            cores from the session called next.
        prepack: let MLAS prepack the weights (a copy of them in its own layout, made at load; of `weights` too,
            which stay mapped); False computes from the weights as they are.
    """
    options = ort.SessionOptions()
    if weights is not None:
        for name, value in zip(*weights.initializers(graph_file)):
            options.add_initializer(name, value)  # used in place; add_external_initializers would copy
    options.graph_optimization_level = GRAPH_OPTIMIZATION[settings.optimization]
    # A memory pattern is recorded per set of input shapes and reused only when the same
    # shapes come back; the cache grows by one position every decode step, so none ever
    # does, and recording them would only add to the peak memory and to every decode step's work.
    options.enable_mem_pattern = False
    options.log_severity_level = log_severity()
    if settings.shared_thread_pool:
        _use_global_thread_pool(settings.intra_op_threads)
        options.use_per_session_threads = False
    else:
        if _global_pool_threads is not None:
            raise InputError(
                "this process already runs onnxruntime's shared thread pool, which rules out "
                "per-session pools; choose shared_thread_pool=False before the first runner"
            )
        options.intra_op_num_threads = settings.intra_op_threads
        if not spin:  # idle threads that spin take the cores from the session called next
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if not settings.float16_weights_cast_once:
        # the pass that turns each Cast of a float16 weight into a float32 initializer; without the arena, the
        # casts' outputs are freed when the call ends instead of being kept for the next one
        options.add_session_config_entry("optimization.disable_specified_optimizers", FLOAT16_WEIGHT_FOLDING)
        options.enable_cpu_mem_arena = False
    if settings.optimized_model_dir is not None:  # written aside first, see optimized_graphs_saved
        stem = Path(graph_file).stem
        options.optimized_model_filepath = str(settings.optimized_model_dir / f"{stem}.optimized.onnx")
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", f"{stem}.optimized.onnx.data"
        )
    return options


def graph_session(
    model: bytes,
    folder: Path,
    graph_file: str,
    weights: SharedWeightMap,
    provider: str,
    settings: SessionSettings = SessionSettings(),
) -> ort.InferenceSession:
    """A session on a modified copy of one of an artifact's graphs, with this process's thread-pool rules.

    Args:
        model: the modified graph, serialised (e.g. a debug copy).
        folder: the artifact's folder, where the weights `weights` does not hold are read from.
        graph_file: the file name of the graph the copy was made from, whose initializers `weights` holds.
        weights: the artifact's shared weight mapping, used where onnxruntime takes the weights in place.
        provider: the provider to run on, checked (check_provider).
        settings: the session settings.
    """
    check_text_path(folder, "artifact folder", TEXT_PATH_FIX, ArtifactError)
    options = session_options(settings, graph_file, weights)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return _new_session(model, options, session_providers(check_provider(provider)))


def file_session(path: Path, provider: str, settings: SessionSettings = SessionSettings()) -> ort.InferenceSession:
    """A session on a graph file outside any artifact (a folder another exporter wrote), with this process's
    thread-pool rules; its weights are read by onnxruntime from beside it.

    Raises:
        ArtifactError: onnxruntime cannot load the graph.
        ProviderError: the provider is unknown or not available.
    """
    check_text_path(path.parent, "graph folder", TEXT_PATH_FIX, ArtifactError)
    options = session_options(settings, path.name, None, prepack=settings.prepack_weights)
    try:
        return _new_session(str(path), options, session_providers(check_provider(provider)))
    except _LOAD_ERRORS as exc:
        raise load_failure(path, exc) from None


@contextlib.contextmanager
def optimized_graphs_saved(folder: Path | None):
    """Yields the hidden folder in `folder` where the sessions made in the block save their optimised graphs (pass
    it to load_session), or None without `folder`. Its files (graphs and weights files) are moved into `folder`
    only once the block has made every session: a full disk, an interrupt, or a second graph that cannot be saved
    after the first was, leaves the files an earlier save wrote, never a truncated graph nor one graph of a new
    pair beside the other of an earlier one."""
    if folder is None:
        yield None
        return
    with parents_removed_unless_done(folder / "graph"):  # the folders made for the save (`folder` too), when it fails
        try:
            folder.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".optimized.partial-", dir=folder))
        except OSError as exc:
            raise _save_failed("graphs", folder, exc.strerror or str(exc)) from None
        try:
            yield staging
            try:
                # a Ctrl-C between moves would leave new weights beside an earlier graph; a second save into
                # `folder` moving its files meanwhile, one graph of each (its turn is waited for with Ctrl-C live)
                with folder_lock(folder), uninterrupted():
                    # the weights files before the graphs that name them
                    for name in sorted(os.listdir(staging), key=lambda name: (name.endswith(".onnx"), name)):
                        os.replace(staging / name, folder / name)
            except OSError as exc:
                raise _save_failed("graphs", folder, exc.strerror or str(exc)) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _new_session(
    model, options: ort.SessionOptions, providers: list, staging: Path | None = None
) -> ort.InferenceSession:
    """A session; where `options` asks for the optimised graph to be saved, onnxruntime writes it into `staging`
    (made by optimized_graphs_saved, which moves it into place), and a save that fails is named as such, not as a
    damaged artifact."""
    target = options.optimized_model_filepath and Path(options.optimized_model_filepath)
    if not target:
        return ort.InferenceSession(model, options, providers=providers, enable_fallback=0)
    options.optimized_model_filepath = str(staging / target.name)
    try:
        return ort.InferenceSession(model, options, providers=providers, enable_fallback=0)
    except _LOAD_ERRORS as exc:
        options.optimized_model_filepath = ""
        try:  # does it load without the save? Then the save failed, not the graph
            ort.InferenceSession(model, options, providers=providers, enable_fallback=0)
        except _LOAD_ERRORS:
            raise exc from None
        raise _save_failed(f"graph {target.name}", target.parent, first_line(exc, 200)) from None


def _save_failed(what: str, folder: Path, reason: str) -> OutputPathError:
    return OutputPathError(
        f"cannot save the optimised {what} in {folder} ({reason}); earlier "
        "files there are untouched: free space, or choose another folder (`optimized_model_dir`)"
    )


# UnicodeDecodeError: onnxruntime's refusal of a graph whose damaged bytes are a name it quotes, which the binding
# cannot turn into a str (a flipped byte in decode.onnx, say).
_LOAD_ERRORS = (
    _ort_errors.Fail,
    _ort_errors.InvalidArgument,
    _ort_errors.NoSuchFile,
    _ort_errors.InvalidProtobuf,
    _ort_errors.InvalidGraph,
    UnicodeDecodeError,
)


def load_session(
    artifact: Artifact,
    contract: GraphContract,
    options: ort.SessionOptions,
    providers: list[str],
    staging: Path | None = None,
) -> ort.InferenceSession:
    """A session on one of the artifact's graphs, which must be the graph its manifest describes.

    Args:
        artifact: the artifact holding the graph.
        contract: the manifest's description of the graph, checked against the file before onnxruntime reads it.
        options: the session options (session_options).
        providers: the session's providers list (session_providers).
        staging: where the optimised graph that `options` asks for is saved first (optimized_graphs_saved).

    Raises:
        ArtifactError: the graph is not the one the manifest describes, or onnxruntime cannot load it (or take
            the folder's path).
        OutputPathError: the optimised graph cannot be saved.
    """
    check_text_path(artifact.folder, "artifact folder", TEXT_PATH_FIX, ArtifactError)
    artifact.graph(contract)  # onnxruntime names neither a missing input nor another opset
    path = artifact.path(contract.file)
    try:
        return _new_session(str(path), options, providers, staging)
    except _LOAD_ERRORS as exc:
        raise load_failure(path, exc) from None


def load_failure(path: Path, exc: Exception) -> ArtifactError:
    """onnxruntime's refusal to load one of the artifact's graphs."""
    return ArtifactError(f"onnxruntime cannot load {path} ({first_line(exc, 200)}); re-export the folder")
