"""ONNX Runtime inference over an artifact folder: both graphs' sessions (made by exporter.runtime.sessions) run with
their feeds, the cache kept between steps, and the prompt checks of generation.

Everything about the graphs (names, cache layout, sizes) comes from the
manifest; nothing here is specific to one model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path

import numpy as np
import onnxruntime
import onnxruntime.capi.onnxruntime_pybind11_state as _ort_errors

from exporter.artifact.contract import KV_KINDS, CacheLayout, GraphContract
from exporter.artifact.folder import Artifact, open_artifact
from exporter.artifact.manifest import Manifest, unchanged_while_read
from exporter.errors import GraphRunError, InputError, ProviderError, check_flag, first_line, first_of, is_integer
from exporter.runtime.binding import BindingDecode
from exporter.runtime.protocol import DEBUG_GRAPHS, ROUTER_PROBES, RuntimeLabel
from exporter.runtime.providers import (
    CUDA,
    available_parity_providers,
    check_parity_providers,
    check_provider,
    check_quantized_provider,
    session_providers,
)
from exporter.runtime.registry import Runtime, register_runtime
from exporter.runtime.sessions import load_session, optimized_graphs_saved
from exporter.runtime.settings import SessionSettings, checking_settings, session_options
from exporter.runtime.shared_weights import SharedWeightMap
from reference.families import DecoderConfig

log = logging.getLogger(__name__)


def position_ids_from_mask(attention_mask: np.ndarray, past_length: int = 0) -> np.ndarray:
    """Positions that skip left padding: the k-th real token of a row is at position k."""
    positions = np.cumsum(attention_mask, axis=1) - 1
    positions = np.where(attention_mask == 0, 1, positions)  # pad slots: any valid position
    return positions[:, past_length:].astype(np.int64)


def check_positions(config: DecoderConfig, needed: int, what: str, fix: str) -> None:
    """Refuse a run that needs more than max_position_embeddings positions, before it runs: the graphs would
    compute them, but the model was trained on, and its reference refuses, no more.

    Args:
        config: the model config, whose max_position_embeddings is the limit.
        needed: the positions the run needs: its largest position id plus one.
        what: the run, as the message names it ("prompt (5 tokens) + max_new_tokens (10)").
        fix: what to do, the message's last clause.

    Raises:
        InputError: `needed` exceeds the limit.
    """
    limit = config.max_position_embeddings
    if needed > limit:
        raise InputError(f"{what} needs {needed} positions, which exceeds max_position_embeddings ({limit}); {fix}")


def check_prompt(config: DecoderConfig, prompt_ids, max_new_tokens: int) -> list[int]:
    """Validate one prompt before anything runs; return it as a list of ints."""
    if not isinstance(prompt_ids, (list, tuple, np.ndarray)) or getattr(prompt_ids, "ndim", 1) != 1:
        raise InputError(
            f"a prompt must be a list of token ids, got {type(prompt_ids).__name__} "
            f"{str(prompt_ids)[:40]!r}; tokenize text first (or give a tokenizer)"
        )
    odd = [i for i in prompt_ids if not is_integer(i)]
    if odd:
        raise InputError(
            f"token ids must be integers, got {odd[0]!r} ({type(odd[0]).__name__}); convert the prompt to ints"
        )
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise InputError("the prompt is empty; give at least one token id")
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise InputError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {config.vocab_size})")
    if not is_integer(max_new_tokens) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    tokens = f"{len(ids)} token{'s' * (len(ids) != 1)}"
    check_positions(
        config,
        len(ids) + max_new_tokens,
        f"prompt ({tokens}) + max_new_tokens ({max_new_tokens})",
        "shorten one of them",
    )
    return ids


_RUN_ERRORS = (_ort_errors.Fail, _ort_errors.RuntimeException, _ort_errors.InvalidArgument)
# What a decode.onnx run can raise: the binding's C method (BindingDecode.step) raises a plain RuntimeError where
# session.run raises the above.
_STEP_ERRORS = (*_RUN_ERRORS, RuntimeError)


def check_feeds(contract: GraphContract, feeds: dict) -> None:
    """The feeds' names and dtypes against the graph's inputs, before a runtime refuses them in its own words
    (onnxruntime's refusal of a missing one is a bare ValueError)."""
    missing = [name for name in contract.input_names if name not in feeds]
    unknown = [name for name in feeds if name not in contract.input_names]
    if missing or unknown:
        found = "; ".join(
            f"{what} {first_of(names, 5)}" for what, names in (("missing", missing), ("not an input", unknown)) if names
        )
        hint = " (labels: this artifact has the loss; -100 masks a position)" if "labels" in missing else ""
        raise InputError(
            f"{contract.file} takes the inputs {first_of(contract.input_names, 4)}, got feeds with {found}{hint}"
        )
    # onnxruntime's refusal of another dtype (a float16 artifact's cache, int32 ids) would read as a damaged graph
    for spec in contract.inputs:
        value = feeds[spec.name]
        if isinstance(value, np.ndarray) and value.dtype != spec.dtype:
            raise InputError(
                f"{contract.file} takes {spec.name} as {spec.dtype}, got {value.dtype}; convert it "
                f"with .astype(np.{spec.dtype})"
            )


def _run_failure(graph_file: str, exc: Exception) -> GraphRunError:
    return GraphRunError(graph_file, first_line(exc, 400))


def _check_arrays(input_ids, attention_mask, position_ids) -> None:
    """start's and step's arrays of the type the graph takes; onnxruntime's own refusal (of int32 ids, say) would be
    reported as a damaged graph."""
    for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask), ("position_ids", position_ids)):
        if not isinstance(value, np.ndarray) or value.dtype != np.int64 or value.ndim != 2:
            got = (
                f"an array of {value.dtype} with shape {value.shape}"
                if isinstance(value, np.ndarray)
                else type(value).__name__
            )
            raise InputError(
                f"{name} must be a 2-D (batch, tokens) numpy array of int64, got {got}; "
                "convert it with np.asarray(..., dtype=np.int64)"
            )


def _check_shapes(input_ids, attention_mask, position_ids, past_length: int) -> None:
    batch, length = input_ids.shape
    if position_ids.shape != input_ids.shape:
        raise InputError(f"position_ids has shape {position_ids.shape}, expected {input_ids.shape}")
    if attention_mask.shape != (batch, past_length + length):
        raise InputError(
            f"attention_mask has shape {attention_mask.shape}, expected ({batch}, "
            f"{past_length + length}): the cached length {past_length} plus {length} new tokens"
        )


_INT64_MAX = np.iinfo(np.int64).max


def _check_values(config: DecoderConfig, input_ids, attention_mask, position_ids, what: str, fix: str) -> None:
    """The values start or step is given: ids in the vocabulary (onnxruntime's Gather would blame the graph), a mask
    of 0 and 1 and positions from 0 (others would run, to logits no reference computes), and check_positions.

    They run every step, so each array is read once, by one max over it as uint64 (a negative int64 lies above
    every bound)."""
    if attention_mask.view(np.uint64).max() > 1:  # never empty: start refuses an empty prompt
        bad = [int(v) for v in np.unique(attention_mask) if v not in (0, 1)]
        raise InputError(f"attention_mask holds {bad[:5]}; it takes 1 for a token and 0 for left padding, nothing else")
    if not input_ids.size:
        return
    vocab = config.vocab_size
    if input_ids.view(np.uint64).max() >= vocab:
        bad = sorted({int(i) for i in input_ids.ravel() if not 0 <= i < vocab})
        raise InputError(f"input_ids {bad[:5]} lie outside the vocabulary [0, {vocab})")
    last = int(position_ids.view(np.uint64).max())
    if last > _INT64_MAX:
        raise InputError(
            f"position_ids must be >= 0 (the k-th token of a row is at position k), got {int(position_ids.min())}"
        )
    # check_positions' own test, tried first so that its message is formatted only for a refusal
    if last >= config.max_position_embeddings:
        check_positions(config, last + 1, f"{what} (position_ids up to {last})", fix)


def _check_runner_arguments(artifact, check_hashes, settings) -> None:
    """OrtRunner's arguments of the types it takes, before any file is read."""
    if not isinstance(artifact, (Artifact, str, os.PathLike)):
        raise InputError(f"artifact must be an Artifact or an artifact folder's path (str or Path), got {artifact!r}")
    check_flag("check_hashes", check_hashes)
    if not isinstance(settings, SessionSettings):
        raise InputError(
            f"settings must be a SessionSettings, got {type(settings).__name__}; write e.g. "
            "SessionSettings(intra_op_threads=2)"
        )


class OrtRunner:
    """Both graphs of an artifact folder in ONNX Runtime.

    `prefill`/`decode` take and return named numpy arrays (parity checks, the loss).
    `start`/`step` serve generation. Both run decode.onnx, the prompt with an empty
    past (equal to prefill.onnx within float32 rounding, tested), and keep the KV
    cache between steps as onnxruntime's values bound with IO binding, never converted
    to numpy; on CUDA the cache never leaves the device.

    Memory: decode.onnx gets MLAS's prepacked weights, which are the one resident copy
    while generating. prefill.onnx reads the weights file in place through a shared
    read-only mapping and no prepacking, so it adds no copy of its own; its pages become
    resident only when prefill() runs. (A second prepacked session would double the
    weights: onnxruntime's Python API cannot share prepacked buffers.) A quantized
    artifact's prefill.onnx prepacks as decode.onnx does: MatMulNBits computes at its
    accuracy level only prepacked, and the copy is the quantized bytes. Given a map that
    other sessions keep resident (`weights`, a verification's), a prepacking session
    reads that map too and holds its prepacked copy alone.

    Args:
        artifact: an opened Artifact (not read again), or an artifact folder's path, opened here.
        provider: "cpu" or "cuda" (or onnxruntime's full provider name).
        check_hashes: check every file's sha256 when `artifact` is a path.
        settings: the sessions' settings (threads, optimisation, prompt chunk).
        weights: the artifact's weights file as another user of it mapped it (SharedWeightMap), so that all of them
            read one mapping: two mappings of a file are resident twice. None: a mapping of its own.
    """

    def __init__(
        self,
        artifact: Artifact | Path,
        provider: str = "cpu",
        check_hashes: bool = True,
        settings: SessionSettings = SessionSettings(),
        weights: SharedWeightMap | None = None,
    ):
        _check_runner_arguments(artifact, check_hashes, settings)
        folder = artifact.folder if isinstance(artifact, Artifact) else Path(artifact)
        # both graphs land, or neither; neither when an export swapped the folder while its files were read
        with optimized_graphs_saved(settings.optimized_model_dir) as staging, unchanged_while_read(folder):
            self.artifact = open_artifact(artifact, check_hashes=check_hashes)
            self.folder, self.manifest = self.artifact.folder, self.artifact.manifest
            self.provider = check_provider(provider)
            check_quantized_provider(self.provider, self.manifest)
            providers = session_providers(self.provider)
            self._weights = SharedWeightMap.of(self.artifact, weights)  # must outlive the sessions
            shared = weights is not None

            def options(graph: GraphContract, prepack: bool, spin: bool):
                # An unprepacked session reads the one mapping: no copy of the weights of its own. A map the caller
                # gave is kept resident by its other sessions: a prepacking session reads it too and holds only its
                # prepacked copy. Without one, a prepacking session loads the weights itself, and onnxruntime frees
                # what it prepacked, so that generating keeps one copy.
                mapped = self._weights if shared or not prepack else None
                return session_options(settings, graph.file, mapped, spin=spin, prepack=prepack)

            prefill, decode = self.manifest.prefill, self.manifest.decode
            self.cache_device = "cuda" if self.provider == CUDA else "cpu"
            past_of = _past_name_of_present(self.manifest.cache)
            presents = [name for name in decode.output_names if name in past_of]
            self._past_names = [past_of[name] for name in presents]
            self._decode = BindingDecode(
                load_session(
                    self.artifact,
                    decode,
                    options(decode, prepack=settings.prepack_weights, spin=settings.decode_spins),
                    providers,
                    staging,
                ),
                self._past_names,
                decode.output_names,
                self.manifest.cache,
                self.cache_device,
            )
            self.decode_session = self._decode.session
            # A quantized prefill.onnx prepacks too (its copy is the quantized bytes): unprepacked, MatMulNBits
            # computes in float32 whatever its accuracy level, which no consumer runs.
            prepack_prefill = settings.prepack_weights and self.manifest.quantization is not None
            self.prefill_session = load_session(
                self.artifact,
                prefill,
                options(prefill, prepack=prepack_prefill, spin=False),
                providers,
                staging,
            )
        if self.provider not in self.decode_session.get_providers():
            # onnxruntime falls back to the CPU silently when CUDA libraries fail to load.
            raise ProviderError(
                f"{self.provider} could not be initialised (onnxruntime fell back to "
                f"{self.decode_session.get_providers()}); check the CUDA and cuDNN installation"
            )
        # the verification's debug copies (exporter.verify.diagnosis.probe) and router probes run in ONNX Runtime on
        # this runner's provider
        self.capabilities = frozenset({DEBUG_GRAPHS, ROUTER_PROBES})
        self._prompt_chunk = settings.prompt_chunk
        # The KV cache that start/step left, in the order of self._past_names: a list of the binding's OrtValues. A
        # generation interleaved with another on this runner puts its own back before each step.
        self.cache = None
        # Held by each start/step and by a generation across its cache swap and step: threads sharing this runner
        # take turns, each on its own cache (unheld, one thread's step could run on another's cache: wrong tokens).
        self.lock = threading.RLock()

    @property
    def runtime(self) -> RuntimeLabel:
        return RuntimeLabel(f"onnxruntime {onnxruntime.__version__}", self.provider)

    def prefill(self, feeds: dict) -> dict:
        check_feeds(self.manifest.prefill, feeds)
        names = self.manifest.prefill.output_names
        try:
            return dict(zip(names, self.prefill_session.run(names, feeds)))
        except _RUN_ERRORS as exc:
            raise _run_failure(self.manifest.prefill.file, exc) from None

    def decode(self, feeds: dict) -> dict:
        check_feeds(self.manifest.decode, feeds)
        names = self.manifest.decode.output_names
        try:
            return dict(zip(names, self._decode.run(names, feeds)))
        except _STEP_ERRORS as exc:
            raise _run_failure(self.manifest.decode.file, exc) from None

    def empty_past(self, batch: int) -> dict:
        return empty_past(self.manifest.cache, batch)

    def cache_arrays(self) -> dict[str, np.ndarray]:
        """Numpy copies of the cache that start/step left, by past input name (inspection, tests)."""
        if self.cache is None:
            raise InputError("there is no cache yet: call start() with the prompt first")
        return dict(zip(self._past_names, self._decode.cache_arrays(self.cache)))

    def _run_decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Run decode.onnx on the cache; keep present as the next past; return the last position's logits."""
        try:
            logits, self.cache = self._decode.step(input_ids, attention_mask, position_ids, self.cache)
        except _STEP_ERRORS as exc:
            raise _run_failure(self.manifest.decode.file, exc) from None
        return logits

    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Run a (left-padded) prompt batch with an empty past; return next-token logits (B, V) float32.

        The prompt goes through decode.onnx `prompt_chunk` tokens at a time, each chunk on
        the cache of the ones before: the activations (and so the peak memory) scale with the
        chunk, not the prompt. The logits are the same as in one call: each row of a MatMul
        and each query's attention is computed as it would be there (tested).
        """
        with self.lock:
            return self._start(input_ids, attention_mask, position_ids)

    def _start(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        _check_arrays(input_ids, attention_mask, position_ids)
        _check_shapes(input_ids, attention_mask, position_ids, past_length=0)
        if 0 in input_ids.shape:
            raise InputError(
                f"start() needs at least one prompt of at least one token, got input_ids of shape {input_ids.shape}"
            )
        _check_values(self.manifest.config, input_ids, attention_mask, position_ids, "the prompt", "shorten the prompt")
        self.cache = self._decode.empty_cache(len(input_ids))
        length = input_ids.shape[1]
        chunk = self._prompt_chunk or length
        for begin in range(0, length, chunk):
            end = min(begin + chunk, length)
            logits = self._run_decode(input_ids[:, begin:end], attention_mask[:, :end], position_ids[:, begin:end])
        return logits

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Decode new tokens on top of the cache that start/step left; return next-token logits."""
        with self.lock:
            return self._step(input_ids, attention_mask, position_ids)

    def _step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        if self.cache is None:
            raise InputError("step() needs a cache: call start() with the prompt first")
        batch, cached = self._decode.cache_shape(self.cache)
        _check_arrays(input_ids, attention_mask, position_ids)
        if input_ids.shape[0] != batch:
            raise InputError(f"step() got a batch of {input_ids.shape[0]} rows for a cache of {batch}")
        _check_shapes(input_ids, attention_mask, position_ids, past_length=cached)
        _check_values(
            self.manifest.config,
            input_ids,
            attention_mask,
            position_ids,
            "this step",
            "the generation has used every position: start again with a shorter prompt",
        )
        return self._run_decode(input_ids, attention_mask, position_ids)


def empty_past(cache: CacheLayout, batch: int) -> dict:
    """A past of length 0 for decode.onnx, by past input name."""
    if not is_integer(batch) or batch < 1:  # numpy's errors, or an empty batch the graphs cannot run
        raise InputError(f"batch must be an integer >= 1, got {batch!r}")
    shape = (batch, cache.num_key_value_heads, 0, cache.head_dim)
    return {
        cache.past(layer, kind): np.zeros(shape, dtype=cache.dtype)
        for layer in range(cache.num_layers)
        for kind in KV_KINDS
    }


def _past_name_of_present(cache: CacheLayout) -> dict[str, str]:
    return {
        cache.present(layer, kind): cache.past(layer, kind) for layer in range(cache.num_layers) for kind in KV_KINDS
    }


def presents_as_past(manifest: Manifest, outputs: dict) -> dict:
    return {past: outputs[present] for present, past in _past_name_of_present(manifest.cache).items()}


def _targets(manifest: Manifest, providers: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """The providers to verify on (each able to run the artifact) and the skipped ones with the reason."""
    chosen, skipped = available_parity_providers() if providers is None else (check_parity_providers(providers), {})
    for provider in chosen:  # before any work: a provider without the kernel cannot run a quantized artifact
        check_quantized_provider(provider, manifest)
    return chosen, skipped


def _checking_runner(
    artifact: Artifact, provider: str, weights: SharedWeightMap | None = None, threads: int | None = None
) -> OrtRunner:
    settings = checking_settings(artifact.manifest)
    if threads is not None:
        settings = dataclasses.replace(settings, intra_op_threads=threads)
    return OrtRunner(artifact, provider, settings=settings, weights=weights)


register_runtime(
    Runtime(
        name="onnxruntime",
        install="pip install onnxruntime",
        version=lambda: onnxruntime.__version__,
        targets=_targets,
        runner=_checking_runner,
    )
)
