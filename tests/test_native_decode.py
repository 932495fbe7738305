"""decode.onnx through onnxruntime's C library (exporter.runtime.capi) and the greedy loop in C, against the Python
binding's path on the same artifact."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from exporter.errors import GraphRunError, InputError
from exporter.runtime import capi
from exporter.runtime.generation import NonFiniteLogits, SamplingConfig, generate, generate_greedy, stream
from exporter.runtime.runner import OrtRunner, binding_reason, position_ids_from_mask
from exporter.runtime.sessions import CPU, CUDA, SessionSettings
from exporter.verify.references.torch_runner import reference_greedy

# The tests of the C loop itself; an install without a C compiler has none (the test below says whether one should)
needs_c_loop = pytest.mark.skipif(
    not capi.native_loop_available(),
    reason="exporter.runtime._native_loop was not built at install (no C compiler, or its build failed)",
)

PROMPTS = np.array([[0, 0, 5, 9, 100, 3], [7, 8, 9, 10, 11, 12]], dtype=np.int64)


def test_runners_take_the_c_library_by_default(runner, binding_runner):
    assert runner.native_decode
    assert not binding_runner.native_decode and not binding_runner.greedy_in_c


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler here: the install skips exporter.runtime._native_loop, and steps run from Python",
)
def test_the_install_built_the_c_loop_where_a_compiler_is_found(runner):
    assert capi.native_loop_available() and runner.greedy_in_c


def test_start_step_and_decode_equal_the_bindings(runner, binding_runner):
    """The same onnxruntime build, graph and options behind both: logits and cache bit for bit, over a left-padded
    batch, a chunked prompt and two steps, and decode() on numpy feeds."""
    mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int64)
    positions = position_ids_from_mask(mask)
    np.testing.assert_array_equal(
        runner.start(PROMPTS, mask, positions), binding_runner.start(PROMPTS, mask, positions)
    )
    for step in range(2):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        feeds = (np.array([[4 + step], [6]], np.int64), mask, positions[:, -1:] + 1 + step)
        np.testing.assert_array_equal(runner.step(*feeds), binding_runner.step(*feeds))
    theirs = binding_runner.cache_arrays()
    for name, value in runner.cache_arrays().items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)
    feeds = {
        "input_ids": PROMPTS[:1],
        "attention_mask": np.ones((1, 6), np.int64),
        "position_ids": np.arange(6)[None],
        **binding_runner.empty_past(1),
    }
    ours, binding = runner.decode(feeds), binding_runner.decode(feeds)
    assert list(ours) == list(binding)
    for name in ours:
        assert ours[name].dtype == binding[name].dtype, name
        np.testing.assert_array_equal(ours[name], binding[name], err_msg=name)


@needs_c_loop
def test_the_c_loop_chooses_the_tokens_step_chooses_and_continues_its_cache(runner):
    prompt = np.array([[1, 17, 230, 4, 99]], np.int64)
    mask = np.ones((1, 5 + 40), np.int64)
    logits = runner.start(prompt, mask[:, :5], np.arange(5)[None])
    first = int(logits.argmax())
    expected, token = [], first
    for step in range(12):
        logits = runner.step(np.array([[token]]), mask[:, : 6 + step], np.array([[5 + step]]))
        token = int(logits.argmax())
        expected.append(token)
    runner.start(prompt, mask[:, :5], np.arange(5)[None])
    assert runner.greedy_steps(first, mask, 5) == (expected[:5], False)
    assert runner.cache.length == 10
    assert runner.greedy_steps(expected[4], mask, 7) == (expected[5:], False)  # on the cache the first call left
    logits = runner.step(np.array([[expected[-1]]]), mask[:, :18], np.array([[17]]))  # step() goes on from it
    assert runner.cache.length == 18 and logits.shape == (1, 512)
    runner.start(prompt, mask[:, :5], np.arange(5)[None])
    stop = expected[3]
    assert runner.greedy_steps(first, mask, 12, stop_ids=[stop]) == (expected[: expected.index(stop) + 1], False)
    assert runner.greedy_steps(first, mask, 0) == ([], False)


@needs_c_loop
def test_generate_runs_one_greedy_row_in_c_with_streams_tokens(runner, tiny_model, monkeypatch):
    """Past several chunks of the C loop (GREEDY_CHUNK), with an eos inside the third, equal to the reference
    and to stream's steps from Python; the step() path is not taken."""
    prompt = [1, 17, 230, 4, 99]
    reference = reference_greedy(tiny_model, prompt, 90, None).ids
    streamed = [tokens[0] for tokens in stream(runner, [prompt], 90)]
    assert streamed == reference
    eos = reference[70]
    calls = []
    monkeypatch.setattr(runner, "step", lambda *args: calls.append(args))
    assert generate_greedy(runner, prompt, 90).new_ids == reference
    result = generate(runner, [prompt], 90, SamplingConfig(top_k=3), eos_token_id=eos)[0]
    assert result.stopped and result.new_ids == reference[: reference.index(eos) + 1]
    assert generate_greedy(runner, prompt, 1).new_ids == reference[:1]
    assert generate_greedy(runner, prompt, 0).new_ids == []
    assert not calls


def test_without_the_built_loop_generation_steps_from_python(artifact_fp32, tiny_model, monkeypatch):
    """An install without a C compiler has no exporter.runtime._native_loop: the same tokens, one step() at a time."""
    monkeypatch.setattr(capi, "native_loop_available", lambda: False)
    runner = OrtRunner(artifact_fp32)
    assert runner.native_decode and not runner.greedy_in_c
    with pytest.raises(InputError, match="greedy_steps needs the C decode loop"):
        runner.greedy_steps(1, np.ones((1, 8), np.int64), 2)
    assert generate_greedy(runner, [1, 17, 230], 20).new_ids == reference_greedy(tiny_model, [1, 17, 230], 20, None).ids


def test_a_float16_artifact_decodes_in_the_c_library_and_steps_from_python(artifact_fp16):
    """The loop chooses among float32 logits; a float16 artifact's decode steps run one by one, still through
    the C library, to the binding's tokens."""
    ours = OrtRunner(artifact_fp16)
    binding = OrtRunner(artifact_fp16, settings=SessionSettings(native_decode=False))
    assert ours.native_decode and not ours.greedy_in_c
    assert generate_greedy(ours, [1, 17, 230], 12).new_ids == generate_greedy(binding, [1, 17, 230], 12).new_ids


@needs_c_loop
def test_greedy_steps_refuses_what_it_cannot_run(runner, binding_runner):
    config = runner.manifest.config
    with pytest.raises(InputError, match="greedy_steps needs the C decode loop"):
        binding_runner.greedy_steps(1, np.ones((1, 8), np.int64), 2)
    runner.start(PROMPTS, np.ones_like(PROMPTS), position_ids_from_mask(np.ones_like(PROMPTS)))
    with pytest.raises(InputError, match=r"runs one row, the cache holds 2; use step\(\)"):
        runner.greedy_steps(1, np.ones((1, 10), np.int64), 2)
    runner.start(PROMPTS[:1], np.ones((1, 6), np.int64), np.arange(6)[None])
    cache = runner.cache
    for token, steps, mask, message in (
        (512, 2, np.ones((1, 10), np.int64), r"token 512 lies outside the vocabulary \[0, 512\)"),
        (True, 2, np.ones((1, 10), np.int64), "token True lies outside"),
        (1, -1, np.ones((1, 10), np.int64), "steps must be an integer >= 0, got -1"),
        (1, 2, np.ones((1, 7), np.int64), r"must be a \(1, n\) int64 array with n >= 8 .* got int64 \(1, 7\)"),
        (1, 2, np.ones((1, 10), np.int32), r"got int32 \(1, 10\)"),
        (1, 2, [1] * 10, "got list"),
        (1, 2, np.array([[1, 1, 1, 1, 1, 1, 1, 0]]), "0 or 1 for the cached positions and 1 for each step"),
        (1, 2, np.array([[1, 1, 1, 2, 1, 1, 1, 1]]), "0 or 1 for the cached positions"),
        (
            1,
            config.max_position_embeddings,
            np.ones((1, 6 + config.max_position_embeddings), np.int64),
            rf"these steps \(position_ids up to {config.max_position_embeddings + 5}\) needs .* exceeds "
            rf"max_position_embeddings \({config.max_position_embeddings}\)",
        ),
    ):
        with pytest.raises(InputError, match=message):
            runner.greedy_steps(token, mask, steps)
        assert runner.cache is cache


@needs_c_loop
def test_a_c_loop_that_fails_to_run_is_a_graph_run_error_in_one_line(runner):
    runner.start(PROMPTS[:1], np.ones((1, 6), np.int64), np.arange(6)[None])
    layout = runner.manifest.cache
    wrong = np.zeros((1, layout.num_key_value_heads, 6, layout.head_dim + 1), np.float32)
    runner.cache = capi.Cache([capi.api().tensor(wrong, capi.shape_of(wrong)) for _ in range(len(runner.cache))], 1, 6)
    with pytest.raises(GraphRunError, match=r"onnxruntime failed running decode.onnx \(.*\); .*re-export") as info:
        runner.greedy_steps(4, np.ones((1, 10), np.int64), 3)
    assert "\n" not in str(info.value)
    assert runner.cache.length == 6 and len(runner.cache) == 2 * layout.num_layers  # the values it ran on, kept
    runner.cache = None  # its values read `wrong`


@needs_c_loop
def test_logits_holding_a_nan_end_the_c_loop_and_generate_raises(runner, monkeypatch):
    """As choose_tokens refuses a NaN (numpy's argmax would choose it): a cache of NaNs gives NaN logits."""
    layout = runner.manifest.cache
    nans = np.full((1, layout.num_key_value_heads, 3, layout.head_dim), np.nan, np.float32)
    runner.start(PROMPTS[:1, :3], np.ones((1, 3), np.int64), np.arange(3)[None])
    runner.cache = capi.Cache([capi.api().tensor(nans, capi.shape_of(nans)) for _ in range(len(runner.cache))], 1, 3)
    assert runner.greedy_steps(4, np.ones((1, 8), np.int64), 5) == ([], True)
    assert runner.cache.length == 4  # the step that ran
    start = runner.start

    def start_then_poison(*args):
        logits = start(*args)
        runner.cache = capi.Cache(
            [capi.api().tensor(nans, capi.shape_of(nans)) for _ in range(len(runner.cache))], 1, 3
        )
        return logits

    monkeypatch.setattr(runner, "start", start_then_poison)
    with pytest.raises(NonFiniteLogits):
        generate_greedy(runner, [1, 2, 3], 5)
    runner.cache = None  # its values read `nans`


@pytest.mark.parametrize(
    "settings,provider,reason",
    [
        (SessionSettings(), CPU, None),
        (SessionSettings(native_decode=False), CPU, "native_decode=False"),
        (SessionSettings(), CUDA, "the CUDA provider"),
        (SessionSettings(prepack_weights=False), CPU, "prepack_weights=False"),
        (SessionSettings(shared_thread_pool=True), CPU, "shared_thread_pool=True"),
        (SessionSettings(optimized_model_dir="x"), CPU, "optimized_model_dir"),
    ],
)
def test_the_settings_the_c_session_does_not_take_go_through_the_binding(settings, provider, reason):
    assert binding_reason(settings, provider) == reason


def test_a_runner_without_the_c_library_goes_through_the_binding(artifact_fp32, tiny_model, monkeypatch):
    monkeypatch.setattr(capi, "library_path", lambda: None)
    assert binding_reason(SessionSettings(), CPU) == "no libonnxruntime.so in the onnxruntime package"
    runner = OrtRunner(artifact_fp32)
    assert not runner.native_decode
    assert generate_greedy(runner, [1, 17, 230], 5).new_ids == reference_greedy(tiny_model, [1, 17, 230], 5, None).ids


def test_a_c_library_that_does_not_load_sends_the_runner_through_the_binding(monkeypatch):
    def fails():
        raise OSError("libonnxruntime.so.1.32.0: cannot open shared object file")

    monkeypatch.setattr(capi, "api", fails)
    reason = binding_reason(SessionSettings(), CPU)
    assert reason.startswith("libonnxruntime.so.") and reason.endswith(
        " does not load (libonnxruntime.so.1.32.0: cannot open shared object file)"
    )


def test_the_c_session_gets_the_threads_and_optimisation_asked(artifact_fp32, monkeypatch):
    """The C API has no getters for session options: what the runner asks for is what the session is made with."""
    made = []
    real = capi.DecodeSession

    def record(*args, **kwargs):
        made.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(capi, "DecodeSession", record)
    OrtRunner(artifact_fp32, settings=SessionSettings(intra_op_threads=1, optimization="basic"))
    assert made[0]["intra_op_threads"] == 1 and made[0]["optimization"] == "basic"


@pytest.mark.parametrize("native", [True, False])
def test_a_graph_onnxruntime_cannot_load_is_an_artifact_error_in_one_line(artifact_copy, native):
    """A node of an operator onnxruntime has no kernel for (the graph still parses, with its inputs and outputs):
    onnxruntime's refusal, from the C library as from the binding, named as the artifact's."""
    import onnx
    from helpers import edit_manifest

    from exporter.artifact.manifest import sha256_file
    from exporter.errors import ArtifactError

    path = artifact_copy / "decode.onnx"
    model = onnx.load(str(path), load_external_data=False)
    model.graph.node[0].op_type = "NoSuchOperator"
    onnx.save(model, str(path))
    edit_manifest(
        artifact_copy, lambda m: m["files"]["decode.onnx"].update(sha256=sha256_file(path), bytes=path.stat().st_size)
    )
    with pytest.raises(ArtifactError, match=r"onnxruntime cannot load .*decode.onnx \(.*\); re-export") as info:
        OrtRunner(artifact_copy, check_hashes=False, settings=SessionSettings(native_decode=native))
    assert "\n" not in str(info.value)
