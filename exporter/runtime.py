"""ONNX Runtime inference over an artifact folder: sessions, feeds, greedy generation.

Everything about the graphs (names, cache layout, sizes) comes from the
manifest; nothing here is specific to one model.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as _ort_errors
from google.protobuf.message import DecodeError

from exporter.contract import KV_KINDS, CacheLayout, GraphContract
from exporter.errors import ArtifactError, GraphRunError, InputError, ProviderError, first_line
from exporter.hugepages import back_with_huge_pages, private_anonymous_regions
from exporter.manifest import Manifest, read_manifest
from reference.families import DecoderConfig

log = logging.getLogger(__name__)

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
PROVIDER_ALIASES = {"cpu": CPU, "cuda": CUDA}
PARITY_PROVIDERS = (CPU, CUDA)


def provider_name(name: str) -> str:
    """The full name of `cpu`, `cuda`, or of any provider this build has, written short or in any case."""
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
        raise ProviderError(f"this toolkit runs and verifies on {' and '.join(PARITY_PROVIDERS)}, not {full}; "
                            "pass --provider cpu or --provider cuda")
    if full == CUDA and (unusable := cuda_unusable()) is not None:  # every build has the CPU provider
        raise ProviderError(f"{CUDA} cannot run here: {unusable}")
    return full


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
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "cuda_probe",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = onnx.helper.make_model(identity, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=9)
    options = ort.SessionOptions()
    options.log_severity_level = _log_severity()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the build's own "not in available provider names"
            started = ort.InferenceSession(model.SerializeToString(), options, providers=[CUDA],
                                           enable_fallback=0).get_providers()
    except Exception as exc:  # noqa: BLE001 -- any failure to start it is the answer, never a crash
        return f"could not start ({first_line(exc, 200)}); check the GPU, CUDA and cuDNN installation"
    if CUDA not in started:
        return "could not start (onnxruntime fell back to the CPU); check the GPU, CUDA and cuDNN installation"
    return None


def check_parity_providers(names) -> list[str]:
    """Providers to verify on, as full names without repeats, each checked; a str names one provider."""
    if isinstance(names, str):  # iterated, "cpu" would be the providers "c", "p" and "u"
        names = [names]
    return list(dict.fromkeys(check_provider(name) for name in names))


def session_providers(full_name: str) -> list:
    """The providers list of a session on `full_name`: the CPU provider runs the ops another provider lacks.

    Every session is made with enable_fallback=0: onnxruntime's Python binding otherwise answers a failure to
    create or run one (any ValueError or RuntimeError, e.g. a message that is no UTF-8) by printing a banner to
    stdout, into --json's document, and retrying on the CPU alone: a CUDA verification would run on the CPU.

    CUDA runs with TF32 off: onnxruntime's CUDA provider turns it on by default, which rounds a float32
    MatMul's inputs to 11 significant bits, so a float32 artifact would neither compute in float32 nor
    match what its verification promises (float32 tolerances: TF32 alone moved a tiny model's logits by
    about 4 float16 units of their peak, and MoE routers chose other experts).
    """
    return [full_name] if full_name == CPU else [(full_name, {"use_tf32": "0"}), CPU]


def available_parity_providers() -> tuple[list[str], dict[str, str]]:
    """Providers to verify on by default, and the skipped ones with the reason."""
    unusable = cuda_unusable()
    if unusable is None:
        return list(PARITY_PROVIDERS), {}
    return [CPU], {CUDA: unusable}


def position_ids_from_mask(attention_mask: np.ndarray, past_length: int = 0) -> np.ndarray:
    """Positions that skip left padding: the k-th real token of a row is at position k."""
    positions = np.cumsum(attention_mask, axis=1) - 1
    positions = np.where(attention_mask == 0, 1, positions)  # pad slots: any valid position
    return positions[:, past_length:].astype(np.int64)


def is_integer(value) -> bool:
    """A Python or numpy integer; bools are not token ids."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_prompt(config: DecoderConfig, prompt_ids, max_new_tokens: int) -> list[int]:
    """Validate one prompt before anything runs; return it as a list of ints."""
    if not isinstance(prompt_ids, (list, tuple, np.ndarray)) or getattr(prompt_ids, "ndim", 1) != 1:
        raise InputError(f"a prompt must be a list of token ids, got {type(prompt_ids).__name__} "
                         f"{str(prompt_ids)[:40]!r}; tokenize text first (or give a tokenizer)")
    odd = [i for i in prompt_ids if not is_integer(i)]
    if odd:
        raise InputError(f"token ids must be integers, got {odd[0]!r} ({type(odd[0]).__name__}); "
                         "convert the prompt to ints")
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise InputError("the prompt is empty; give at least one token id")
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise InputError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {config.vocab_size})")
    if not is_integer(max_new_tokens) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if len(ids) + max_new_tokens > config.max_position_embeddings:
        raise InputError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings ({config.max_position_embeddings}); shorten one of them")
    return ids


MAX_THREADS = 1024  # a bound for typos: onnxruntime takes a C int and would start every thread asked for


@dataclass(frozen=True)
class SessionSettings:
    """ONNX Runtime session options, with defaults measured on the benchmark (README)."""

    intra_op_threads: int = 0  # 0: one per physical core
    optimization: str = "all"  # disable | basic | extended | all
    prepack_weights: bool = True  # for decode.onnx, the generation hot path; see _session_options
    shared_thread_pool: bool = False  # see _use_global_thread_pool
    # save the optimised graphs here (inspection, faster reloads); a str becomes a Path
    optimized_model_dir: Path | None = None
    prompt_chunk: int = 128  # prompt tokens per decode.onnx call in OrtRunner.start; 0: all at once
    huge_pages: bool = True  # decode.onnx's prepacked weights in transparent huge pages (Linux); see OrtRunner

    def __post_init__(self):
        if self.optimization not in GRAPH_OPTIMIZATION:
            raise InputError(f"optimization must be one of {', '.join(GRAPH_OPTIMIZATION)}, "
                             f"got {self.optimization!r}")
        if not is_integer(self.intra_op_threads) or not 0 <= self.intra_op_threads <= MAX_THREADS:
            raise InputError(f"threads per session (intra_op_threads, --threads) must be an integer from 0 (one "
                             f"per core) to {MAX_THREADS}, "
                             f"got {self.intra_op_threads!r}")
        if not is_integer(self.prompt_chunk) or self.prompt_chunk < 0:
            raise InputError(f"prompt_chunk must be an integer >= 0 (0 = the whole prompt in one call), "
                             f"got {self.prompt_chunk!r}")
        for name in ("prepack_weights", "shared_thread_pool", "huge_pages"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # a string such as "no" or "false" would read as true
                raise InputError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
        if self.optimized_model_dir is not None:
            if not isinstance(self.optimized_model_dir, (str, os.PathLike)):
                raise InputError(f"optimized_model_dir must be a folder path (str or Path), "
                                 f"got {self.optimized_model_dir!r}")
            object.__setattr__(self, "optimized_model_dir", Path(self.optimized_model_dir))  # frozen dataclass


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
    session called next: a decode step right after a prefill.onnx call took
    44 ms against 27 ms after another decode step (minimind-3, 2 cores). One
    shared pool has no idle spinner to fight (17.9 against 17.6 ms), but once it
    exists ONNX Runtime refuses every session in the process that asks for a
    pool of its own, other libraries' included (Optimum's failed so). The
    default is therefore per-session pools with the prefill session's threads
    not spinning (_session_options), which removes the same fight.
    """
    global _global_pool_threads
    if _global_pool_threads is None:
        ort.set_global_thread_pool_sizes(threads, 1)
        _global_pool_threads = threads
    elif _global_pool_threads != threads:
        log.warning("the global thread pool already has %d threads; ignoring the request for %d",
                    _global_pool_threads, threads)


def _log_severity() -> int:
    """onnxruntime's own log: errors under debug logging (-v); otherwise nothing, since every failure it logs
    is raised too, and reported in one line (it printed a red multi-line copy of each before)."""
    return 3 if log.isEnabledFor(logging.DEBUG) else 4


def plain_session_options() -> ort.SessionOptions:
    """Options for a helper session (a probe, a debug copy of a graph) that fits this process's threading.

    Once the global thread pool exists, ONNX Runtime refuses a session that asks for a pool of its own.
    """
    options = ort.SessionOptions()
    options.log_severity_level = _log_severity()
    if _global_pool_threads is not None:
        options.use_per_session_threads = False
    return options


class SharedWeightMap:
    """The weights file mapped once; a session given these OrtValues reads the weights in place.

    Left to itself, each session maps each tensor on its own, so two sessions
    hold two mappings of every weight (twice the RSS). Read-only views of one
    mapping are used without a copy (`add_initializer`).
    """

    def __init__(self, folder: Path, manifest: Manifest):
        self._file = np.memmap(folder / manifest.weights_file, dtype=np.uint8, mode="r")
        self._values: dict[tuple[int, int], ort.OrtValue] = {}
        self._tables = manifest.initializers

    def initializers(self, graph_file: str) -> tuple[list[str], list[ort.OrtValue]]:
        names, values = [], []
        for entry in self._tables[graph_file]:
            key = (entry["offset"], entry["length"])
            if key not in self._values:
                dtype = np.dtype(entry["dtype"])
                view = np.frombuffer(self._file, dtype=dtype, count=entry["length"] // dtype.itemsize,
                                     offset=entry["offset"]).reshape(entry["shape"])
                self._values[key] = ort.OrtValue.ortvalue_from_numpy(view)
            names.append(entry["name"])
            values.append(self._values[key])
        return names, values


def _session_options(settings: SessionSettings, graph_file: str, weights: SharedWeightMap | None,
                     spin: bool = True) -> ort.SessionOptions:
    """Options for one session; `weights` given: read the weights in place from the shared mapping, unpacked."""
    options = ort.SessionOptions()
    if weights is not None:
        for name, value in zip(*weights.initializers(graph_file)):
            options.add_initializer(name, value)  # used in place; add_external_initializers would copy
    options.graph_optimization_level = GRAPH_OPTIMIZATION[settings.optimization]
    # A memory pattern is recorded per set of input shapes and reused only when the same
    # shapes come back; the cache grows by one position every decode step, so none ever
    # does. Recording them cost the peak RSS 69 MB (477 -> 408 MB, minimind-3, 512-token
    # prompts) and ~0.7% of the instructions of a decode step.
    options.enable_mem_pattern = False
    options.log_severity_level = _log_severity()
    if settings.shared_thread_pool:
        _use_global_thread_pool(settings.intra_op_threads)
        options.use_per_session_threads = False
    else:
        if _global_pool_threads is not None:
            raise InputError("this process already runs onnxruntime's shared thread pool, which rules out "
                             "per-session pools; choose shared_thread_pool=False before the first runner")
        options.intra_op_num_threads = settings.intra_op_threads
        if not spin:  # idle threads that spin take the cores from the session called next
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if weights is not None or not settings.prepack_weights:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if settings.optimized_model_dir is not None:
        settings.optimized_model_dir.mkdir(parents=True, exist_ok=True)
        stem = Path(graph_file).stem
        options.optimized_model_filepath = str(settings.optimized_model_dir / f"{stem}.optimized.onnx")
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         f"{stem}.optimized.onnx.data")
    return options


def graph_session(model: bytes, folder: Path, graph_file: str, weights: SharedWeightMap, provider: str,
                  settings: SessionSettings = SessionSettings()) -> ort.InferenceSession:
    """A session on a modified copy (serialised, e.g. a debug copy) of one of the graphs of the artifact in
    `folder`, with this process's thread-pool rules: the weights are shared through `weights` where onnxruntime
    takes them, and read from the artifact's weights file where it does not."""
    options = _session_options(settings, graph_file, weights)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(model, options, providers=session_providers(check_provider(provider)),
                                enable_fallback=0)


# UnicodeDecodeError: onnxruntime's refusal of a graph whose damaged bytes are a name it quotes, which the binding
# cannot turn into a str (a flipped byte in decode.onnx, found by flipping bytes of a tiny export).
_LOAD_ERRORS = (_ort_errors.Fail, _ort_errors.InvalidArgument, _ort_errors.NoSuchFile, _ort_errors.InvalidProtobuf,
                _ort_errors.InvalidGraph, UnicodeDecodeError)


_RUN_ERRORS = (_ort_errors.Fail, _ort_errors.RuntimeException, _ort_errors.InvalidArgument)
# The binding's C method (OrtRunner._run_decode) raises a plain RuntimeError where session.run raises the above.
_BINDING_RUN_ERRORS = (*_RUN_ERRORS, RuntimeError)


def _run_failure(graph_file: str, exc: Exception) -> GraphRunError:
    return GraphRunError(graph_file, first_line(exc, 400))


def _listed(names: list) -> str:
    return "[" + ", ".join(str(name) for name in names[:4]) + (", ...]" if len(names) > 4 else "]")


def read_graph(folder: Path, manifest: Manifest, contract: GraphContract) -> onnx.ModelProto:
    """One of the artifact's graphs without its weights, checked against its manifest: it parses, takes and gives
    the values the contract names, and imports the manifest's opset. What reads a graph before onnxruntime has
    loaded it goes through here, so that a damaged graph whose hashes were listed again is a one-line
    ArtifactError, not the parser's error or a missing input found later."""
    path = Path(folder) / contract.file
    try:
        model = onnx.load(str(path), load_external_data=False)
    except DecodeError as exc:
        raise ArtifactError(f"{path} is no ONNX model ({first_line(exc, 200)}); re-export the folder") from None
    initializers = {tensor.name for tensor in model.graph.initializer}
    inputs = [value.name for value in model.graph.input if value.name not in initializers]
    outputs = [value.name for value in model.graph.output]
    for kind, found, listed in (("inputs", inputs, contract.input_names), ("outputs", outputs, contract.output_names)):
        if sorted(found) != sorted(listed):
            raise ArtifactError(f"{path} has the {kind} {_listed(found)}, its manifest lists {_listed(listed)}; "
                                "re-export the folder")
    opsets = [entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")]
    if opsets != [manifest.opset]:
        raise ArtifactError(f"{path} imports the opset {_listed(opsets)}, its manifest says {manifest.opset}; "
                            "re-export the folder")
    return model


def _load_session(folder: Path, manifest: Manifest, contract: GraphContract, options: ort.SessionOptions,
                  providers: list[str]) -> ort.InferenceSession:
    """A session on one of the artifact's graphs, which must be the graph its manifest describes."""
    read_graph(folder, manifest, contract)  # onnxruntime names neither a missing input nor another opset
    try:
        return ort.InferenceSession(str(folder / contract.file), options, providers=providers, enable_fallback=0)
    except _LOAD_ERRORS as exc:
        raise ArtifactError(f"onnxruntime cannot load {folder / contract.file} "
                            f"({first_line(exc, 200)}); re-export the folder") from None


def _check_shapes(input_ids, attention_mask, position_ids, past_length: int) -> None:
    batch, length = input_ids.shape
    if position_ids.shape != input_ids.shape:
        raise InputError(f"position_ids has shape {position_ids.shape}, expected {input_ids.shape}")
    if attention_mask.shape != (batch, past_length + length):
        raise InputError(f"attention_mask has shape {attention_mask.shape}, expected ({batch}, "
                         f"{past_length + length}): the cached length {past_length} plus {length} new tokens")


class OrtRunner:
    """Both graphs of an artifact folder in ONNX Runtime.

    `prefill`/`decode` take and return named numpy arrays (parity checks, the loss).
    `start`/`step` serve generation. Both run decode.onnx, the prompt with an empty
    past (equal to prefill.onnx within float32 rounding, tested), and keep the KV
    cache as OrtValues bound with IO binding: never converted to numpy, on CUDA
    never leaving the device.

    Memory: decode.onnx gets MLAS's prepacked weights (decode ran 1.8x faster with
    them on 2 cores), which is the one resident copy while generating.
    prefill.onnx reads the weights file in place through a shared read-only
    mapping and no prepacking, so it adds no copy of its own; its pages become
    resident only when prefill() runs. A second prepacked session would double
    the weights (ONNX Runtime's Python API cannot share prepacked buffers).
    Measured for minimind-3 fp32 (255.6 MB of weights): 333 MB with both sessions
    loaded (254 MB prepacked, 19 MB of the tied table's file pages, which the
    embedding's Gather keeps mapped after lm_head's prepacking read them, 52 MB
    for the interpreter, numpy and onnxruntime), 377 MB peak while generating with
    512-token prompts read in chunks of 128, about 585 MB once prefill() has run too.

    Huge pages: on the CPU, the memory decode.onnx's session allocated while loading (the
    prepacked weights) is collapsed into 2 MiB pages (exporter.hugepages), which a decode
    step streams with 1/512 of the page walks. minimind-3: 222 MB collapsed in 0.4 s, RSS
    unchanged, decode about 2% faster (-1% to +3% in four runs in turns, README).
    `huge_page_bytes` says how much was collapsed.
    """

    def __init__(self, folder: Path, provider: str = "cpu", check_hashes: bool = True,
                 manifest: Manifest | None = None, settings: SessionSettings = SessionSettings()):
        self.folder = Path(folder)
        self.manifest = manifest or read_manifest(self.folder, check_hashes=check_hashes)
        self.provider = check_provider(provider)
        providers = session_providers(self.provider)
        self._weights = SharedWeightMap(self.folder, self.manifest)  # must outlive the sessions
        prefill, decode = self.manifest.prefill, self.manifest.decode
        on_cpu = self.provider == CPU
        before = private_anonymous_regions() if settings.huge_pages and on_cpu else None
        self.decode_session = _load_session(self.folder, self.manifest, decode,
                                            _session_options(settings, decode.file, None), providers)
        self.huge_page_bytes = back_with_huge_pages(before) if before is not None else 0
        log.debug("%s: %.1f MB of the session's memory in huge pages", decode.file, self.huge_page_bytes / 1e6)
        self.prefill_session = _load_session(self.folder, self.manifest, prefill,
                                             _session_options(settings, prefill.file, self._weights, spin=False),
                                             providers)
        if self.provider not in self.decode_session.get_providers():
            # onnxruntime falls back to the CPU silently when CUDA libraries fail to load.
            raise ProviderError(f"{self.provider} could not be initialised (onnxruntime fell back to "
                                f"{self.decode_session.get_providers()}); check the CUDA and cuDNN installation")
        self.cache_device = "cuda" if self.provider == CUDA else "cpu"
        self._prompt_chunk = settings.prompt_chunk
        # The KV cache that start/step left: onnxruntime's C OrtValues, in the order of self._past_names.
        # A generation interleaved with another on this runner puts its own back before each step.
        self.cache: list = []
        # Per step: one binding reused rather than rebuilt, each output's role looked up rather
        # than its cache names formatted again (60 us a step), and the binding's C object driven
        # directly: onnxruntime's Python wrappers check every value and build a device object
        # per call, 0.14 ms a step (tiny model: 0.59 ms a step through them, 0.45 ms this way).
        # The step's Python runs on caches that streaming the weights has just emptied, so each
        # call costs several times what it costs warm: minimind-3 spends about 0.45 ms a step
        # outside onnxruntime's run against 0.06 ms for the tiny model's, and the cache kept as a
        # list rather than a dict saved 0.05 ms of it.
        self._binding = self.decode_session.io_binding()._iobinding
        self._run_binding = self.decode_session._sess.run_with_iobinding
        outputs = self.manifest.decode.output_names
        past_of = _past_name_of_present(self.manifest.cache)
        self._logits_index = outputs.index("logits")
        self._present_indices = [i for i, name in enumerate(outputs) if name in past_of]
        self._past_names = [past_of[outputs[i]] for i in self._present_indices]
        # Every output is bound afresh each step: the previous presents are the cache bound as
        # inputs, and onnxruntime must allocate new ones rather than write into them.
        self._output_devices = [(name, ort.OrtDevice.make("cpu" if name == "logits" else self.cache_device, 0)
                                 ._get_c_device()) for name in outputs]

    @property
    def name(self) -> str:
        return f"onnxruntime {self.provider}"

    def prefill(self, feeds: dict) -> dict:
        names = self.manifest.prefill.output_names
        try:
            return dict(zip(names, self.prefill_session.run(names, feeds)))
        except _RUN_ERRORS as exc:
            raise _run_failure(self.manifest.prefill.file, exc) from None

    def decode(self, feeds: dict) -> dict:
        names = self.manifest.decode.output_names
        try:
            return dict(zip(names, self.decode_session.run(names, feeds)))
        except _RUN_ERRORS as exc:
            raise _run_failure(self.manifest.decode.file, exc) from None

    def empty_past(self, batch: int) -> dict:
        cache = self.manifest.cache
        shape = (batch, cache.num_key_value_heads, 0, cache.head_dim)
        return {cache.past(layer, kind): np.zeros(shape, dtype=cache.dtype)
                for layer in range(cache.num_layers) for kind in KV_KINDS}

    def _run_decode(self, feeds: dict) -> np.ndarray:
        """Run decode.onnx with IO binding; keep present as the next past; return the last position's logits.

        `feeds` (numpy) must stay alive until the run returns: the binding reads them in place.
        """
        binding = self._binding
        for name, value in feeds.items():
            binding.bind_input(name, value)
        for name, value in zip(self._past_names, self.cache):
            binding.bind_ortvalue_input(name, value)
        for name, device in self._output_devices:
            binding.bind_output(name, device)
        try:
            self._run_binding(binding, None)
        except _BINDING_RUN_ERRORS as exc:
            raise _run_failure(self.manifest.decode.file, exc) from None
        outputs = binding.get_outputs()
        self.cache = [outputs[i] for i in self._present_indices]
        logits = outputs[self._logits_index].numpy()
        # A decode step's logits are returned as they are; of a prompt chunk's, the last position is
        # copied so that the others are freed rather than kept alive by a view (3.3 MB at 128 tokens).
        return logits[:, -1].astype(np.float32, copy=logits.shape[1] > 1)

    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Run a (left-padded) prompt batch with an empty past; return next-token logits (B, V) float32.

        The prompt goes through decode.onnx `prompt_chunk` tokens at a time, each chunk on
        the cache of the ones before: the activations (and so the peak RSS) scale with the
        chunk, not the prompt. For minimind-3 with a 512-token prompt, chunks of 128 took the
        peak RSS from 412 to 377 MB at the same speed (590 against 586 ms) and bit-identical
        logits: each row of a MatMul and each query's attention is computed as it would be
        in one call.
        """
        _check_shapes(input_ids, attention_mask, position_ids, past_length=0)
        if 0 in input_ids.shape:
            raise InputError(f"start() needs at least one prompt of at least one token, got input_ids of shape "
                             f"{input_ids.shape}")
        # Allocated by onnxruntime on the cache's device, so that each C value owns its (empty) memory.
        empty = self.empty_past(len(input_ids))
        self.cache = [ort.OrtValue.ortvalue_from_shape_and_type(empty[name].shape, empty[name].dtype,
                                                                 self.cache_device)._ortvalue
                       for name in self._past_names]
        length = input_ids.shape[1]
        chunk = self._prompt_chunk or length
        for begin in range(0, length, chunk):
            end = min(begin + chunk, length)
            logits = self._run_decode({"input_ids": input_ids[:, begin:end],
                                       "attention_mask": attention_mask[:, :end],
                                       "position_ids": position_ids[:, begin:end]})
        return logits

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Decode new tokens on top of the cache that start/step left; return next-token logits."""
        if not self.cache:
            raise InputError("step() needs a cache: call start() with the prompt first")
        cached = self.cache[0].shape()
        if input_ids.shape[0] != cached[0]:
            raise InputError(f"step() got a batch of {input_ids.shape[0]} rows for a cache of {cached[0]}")
        _check_shapes(input_ids, attention_mask, position_ids, past_length=cached[2])
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return self._run_decode(feeds)


def _past_name_of_present(cache: CacheLayout) -> dict[str, str]:
    return {cache.present(layer, kind): cache.past(layer, kind)
            for layer in range(cache.num_layers) for kind in KV_KINDS}


def presents_as_past(manifest: Manifest, outputs: dict) -> dict:
    return {past: outputs[present] for present, past in _past_name_of_present(manifest.cache).items()}
