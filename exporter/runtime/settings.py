"""Session settings and options: SessionSettings (a user's choices, checked), the settings of sessions that check
an artifact, and the onnxruntime.SessionOptions of one session under this process's thread-pool rules."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnxruntime as ort

from exporter.artifact.manifest import Manifest
from exporter.artifact.paths import TEXT_PATH_FIX, check_text_path
from exporter.errors import InputError, check_flag, is_integer

if TYPE_CHECKING:
    from exporter.runtime.shared_weights import SharedWeightMap

log = logging.getLogger(__name__)

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
