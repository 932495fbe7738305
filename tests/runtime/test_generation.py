"""Generation: MiniMind's sampling rules, batching with left padding, streaming, stop ids, text."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from exporter.artifact import paths
from exporter.cli import main
from exporter.cli.outcome import signals_deferred
from exporter.errors import InputError, OutputPathError
from exporter.runtime.generation import SamplingConfig, generate, generate_greedy, process_logits, stream
from exporter.runtime.runner import OrtRunner
from exporter.runtime.settings import SessionSettings
from exporter.verify.references.torch_runner import reference_greedy


def minimind_processing(logits, input_ids, temperature, top_k, top_p, penalty):
    """MiniMind's generate() logits processing, as upstream writes it in torch (the oracle)."""
    logits = logits / temperature
    if penalty != 1.0:
        for i in range(input_ids.shape[0]):
            seen = torch.unique(input_ids[i])
            score = logits[i, seen]
            logits[i, seen] = torch.where(score > 0, score / penalty, score * penalty)
    if top_k > 0:
        logits[logits < torch.topk(logits, top_k)[0][..., -1, None]] = -float("inf")
    if top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        mask = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1) > top_p
        mask[..., 1:] = mask[..., :-1].clone()
        mask[..., 0] = 0
        logits[mask.scatter(1, sorted_indices, mask)] = -float("inf")
    return logits


@pytest.mark.parametrize(
    "temperature,top_k,top_p,penalty",
    [(0.85, 50, 0.85, 1.0), (1.0, 0, 0.5, 1.3), (0.5, 7, 1.0, 1.1), (1.3, 1, 0.9, 1.0), (1.0, 0, 1.0, 1.0)],
)
def test_logits_processing_matches_minimind(temperature, top_k, top_p, penalty):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 200)) * 3).astype(np.float32)
    input_ids = rng.integers(0, 200, (3, 15))
    seen = np.zeros((3, 200), dtype=bool)
    for row, ids in enumerate(input_ids):
        seen[row, ids] = True
    config = SamplingConfig(
        do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty
    )
    ours = process_logits(logits, seen, config)
    expected = minimind_processing(
        torch.from_numpy(logits.copy()), torch.from_numpy(input_ids), temperature, top_k, top_p, penalty
    ).numpy()
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(expected))
    np.testing.assert_allclose(ours[~np.isinf(ours)], expected[~np.isinf(expected)], rtol=1e-6)


def test_top_p_drops_only_what_follows_the_token_that_passes_it():
    # Four equal probabilities, exact in float32: the cumulative sum reaches 0.5 at the second token and passes
    # it at the third. MiniMind keeps the third (cumsum > top_p, shifted by one); >= would keep two.
    config = SamplingConfig(do_sample=True, top_p=0.5)
    ours = process_logits(np.zeros((1, 4), dtype=np.float32), np.zeros((1, 4), dtype=bool), config)
    expected = minimind_processing(torch.zeros(1, 4), torch.zeros((1, 1), dtype=torch.long), 1.0, 0, 0.5, 1.0)
    assert np.isfinite(ours).sum() == torch.isfinite(expected).sum().item() == 3


def test_repetition_penalty_makes_a_seen_negative_logit_less_likely():
    # Dividing -1.0 by 2 gave -0.5, which beat the unseen -1.2: the penalty chose the repeated token.
    logits = np.array([[-1.0, -1.2, -3.0]], dtype=np.float32)
    seen = np.array([[True, False, False]])
    out = process_logits(logits, seen, SamplingConfig(repetition_penalty=2.0))
    np.testing.assert_array_equal(out, np.array([[-2.0, -1.2, -3.0]], dtype=np.float32))
    assert out.argmax() == 1


def test_batched_prompts_of_different_lengths_equal_each_prompt_alone(runner, tiny_model):
    prompts = [[5, 9, 100, 3, 77, 41, 2, 8, 300], [17], [250, 251, 252, 253]]
    batched = generate(runner, prompts, 24)
    for prompt, result in zip(prompts, batched):
        alone = generate(runner, [prompt], 24)[0]
        assert result.new_ids == alone.new_ids == reference_greedy(tiny_model, prompt, 24, None).ids


def test_a_padded_row_counts_its_positions_from_its_first_real_token(gpt_artifact, gpt_model):
    """The teaching GPT's learned absolute positions see a row's positions shifted by its padding; MiniMind's
    RoPE is blind to a shift of all of them (relative), so the test above passes with the shift."""
    prompts = [[5, 9, 100, 3, 77, 41, 2, 8, 300], [17], [250, 251, 252, 253]]
    for prompt, result in zip(prompts, generate(OrtRunner(gpt_artifact), prompts, 12)):
        assert result.new_ids == reference_greedy(gpt_model, prompt, 12, None).ids


def test_sampling_is_seeded_and_reproducible(runner):
    config = SamplingConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, seed=7)
    first = generate(runner, [[1, 2, 3], [4, 5]], 30, config)
    again = generate(runner, [[1, 2, 3], [4, 5]], 30, config)
    other = generate(runner, [[1, 2, 3], [4, 5]], 30, SamplingConfig(do_sample=True, seed=8))
    assert [r.new_ids for r in first] == [r.new_ids for r in again]
    assert [r.new_ids for r in first] != [r.new_ids for r in other]
    greedy = generate(runner, [[1, 2, 3]], 30)[0].new_ids
    assert first[0].new_ids != greedy, "sampling at temperature 1 over 512 tokens should leave the argmax path"


def test_top_k_one_sampling_is_greedy(runner):
    sampled = generate(runner, [[3, 1, 4, 1, 5]], 20, SamplingConfig(do_sample=True, top_k=1, seed=3))
    assert sampled[0].new_ids == generate(runner, [[3, 1, 4, 1, 5]], 20)[0].new_ids


@torch.no_grad()
def test_repetition_penalty_covers_prompt_and_generated_ids_as_minimind_does(runner, tiny_model):
    """Greedy with a penalty against upstream's loop: the reference model, its processing over every id so far."""
    prompt = [3, 1, 4, 1, 5]
    ids = torch.tensor([prompt])
    for _ in range(40):
        logits = minimind_processing(tiny_model(ids).logits[:, -1], ids, 1.0, 0, 1.0, 2.0)
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    penalised = generate(runner, [prompt], 40, SamplingConfig(repetition_penalty=2.0))[0].new_ids
    assert penalised == ids[0, len(prompt) :].tolist()
    assert penalised != generate(runner, [prompt], 40)[0].new_ids


def test_stop_ids_end_each_row_and_are_kept(runner):
    free = generate(runner, [[1, 17, 230], [9, 9]], 20)
    stop = free[0].new_ids[4]
    stopped = generate(runner, [[1, 17, 230], [9, 9]], 20, stop_ids=[stop])
    assert stopped[0].new_ids == free[0].new_ids[: free[0].new_ids.index(stop) + 1]
    assert stopped[0].stopped
    assert stop not in free[1].new_ids  # so the other row runs on to max_new_tokens
    assert stopped[1].new_ids == free[1].new_ids and not stopped[1].stopped


class CountingRunner:
    """Wraps a runner to count model calls."""

    def __init__(self, inner):
        self.inner, self.manifest, self.calls = inner, inner.manifest, 0

    def start(self, *args):
        self.calls += 1
        return self.inner.start(*args)

    def step(self, *args):
        self.calls += 1
        return self.inner.step(*args)

    @property
    def cache(self):
        return self.inner.cache

    @cache.setter
    def cache(self, value):
        self.inner.cache = value


def test_what_a_generation_holds_follows_its_steps_not_its_limit():
    # A model of 2**31 - 1 positions (what its consumers allow) lets max_new_tokens reach billions; a row that stops
    # after a few steps must not have held a mask for them all (max_new_tokens 10**18 ran out of memory).
    from types import SimpleNamespace

    config = SimpleNamespace(vocab_size=8, max_position_embeddings=2**31 - 1)
    masks = []

    class StoppingRunner:
        manifest, cache = SimpleNamespace(config=config), None

        def start(self, ids, mask, positions):
            return np.eye(8, dtype=np.float32)[[1]]  # token 1, then 2, 3, ... up to the stop id 7

        def step(self, ids, mask, positions):
            masks.append(mask.base if mask.base is not None else mask)
            return np.eye(8, dtype=np.float32)[[int(ids[0, 0]) + 1]]

    [result] = generate(StoppingRunner(), [[1, 2, 3]], 2**31 - 10, stop_ids=[7])
    assert result.new_ids == [1, 2, 3, 4, 5, 6, 7] and result.stopped
    assert max(mask.nbytes for mask in masks) <= 8 * (3 + 2 * len(result.new_ids)), [m.shape for m in masks]


def test_stream_yields_each_token_as_it_is_produced(runner):
    counting = CountingRunner(runner)
    steps = stream(counting, [[1, 2, 3]], 10)
    assert counting.calls == 0
    assert len(next(steps)) == 1 and counting.calls == 1  # the prefill only
    next(steps)
    assert counting.calls == 2
    assert len(list(steps)) == 8


def test_the_prompt_runs_once_and_each_step_feeds_one_token_per_row_on_the_cache(runner):
    """Re-running the whole sequence each step gives the same tokens, slower and slower; no token test sees it.
    The padded row's positions start at its first real token, and its pad slot stays masked in every step."""
    calls = []

    class Recording(CountingRunner):
        def start(self, *args):
            calls.append(("start", *(a.tolist() for a in args)))
            return super().start(*args)

        def step(self, *args):
            calls.append(("step", *(a.tolist() for a in args)))
            return super().step(*args)

    tokens = list(stream(Recording(runner), [[1, 2, 3], [4, 5]], 4))
    assert calls[0] == ("start", [[1, 2, 3], [0, 4, 5]], [[1, 1, 1], [0, 1, 1]], [[0, 1, 2], [1, 0, 1]])
    assert len(calls) == 4 and all(call[0] == "step" for call in calls[1:])
    for step, (_, ids, mask, positions) in enumerate(calls[1:]):
        assert ids == [[tokens[step][0]], [tokens[step][1]]]
        assert mask == [[1, 1, 1] + [1] * (step + 1), [0, 1, 1] + [1] * (step + 1)]
        assert positions == [[3 + step], [2 + step]]


def test_no_new_tokens_runs_no_model_call(runner):
    counting = CountingRunner(runner)
    assert list(stream(counting, [[1, 2, 3]], 0)) == []
    assert generate(counting, [[1, 2, 3]], 0)[0].new_ids == [] and counting.calls == 0


def test_a_prompt_may_fill_every_position_but_not_one_more(runner, tiny_model):
    limit = runner.manifest.config.max_position_embeddings
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * ((limit - 4) // 8)
    new_ids = generate(runner, [prompt], limit - len(prompt))[0].new_ids
    assert new_ids == reference_greedy(tiny_model, prompt, limit - len(prompt), None).ids
    with pytest.raises(InputError, match="exceeds max_position_embeddings"):
        generate(runner, [prompt], limit - len(prompt) + 1)


def test_streams_interleaved_on_one_runner_each_keep_their_own_cache(runner):
    first, second = [[1, 2, 3], [4, 5]], [[100, 200, 300], [9]]
    expected = [[r.new_ids for r in generate(runner, prompts, 10)] for prompts in (first, second)]
    streams = [stream(runner, first, 10), stream(runner, second, 10)]
    produced = [[[], []], [[], []]]
    for _ in range(10):  # one step of each in turn: every step of one runs on the other's cache
        for rows, steps in zip(produced, streams):
            for row, token in zip(rows, next(steps)):
                row.append(token)
    assert produced == expected


@pytest.mark.parametrize("call", [generate, stream, lambda runner, prompts, n: generate_greedy(runner, prompts[0], n)])
def test_a_folder_in_place_of_the_runner_is_refused_with_the_fix(artifact_fp32, call):
    # an InputError with the fix, not AttributeError: 'PosixPath' object has no attribute 'manifest'
    with pytest.raises(
        InputError,
        match=r"^runner must be an OrtRunner, got PosixPath\(.*; make one with "
        r"OrtRunner\(folder\)",
    ):
        call(artifact_fp32, [[1, 2]], 3)


def test_generations_from_several_threads_on_one_runner_each_keep_their_own_cache(runner):
    # Each thread's steps run on its own cache: a step that swapped a shared cache in while another thread's step
    # swapped its own would give wrong tokens, with no error.
    import threading

    prompts = [[1, 42, 7], [5, 6], [9, 9, 9, 9], [3]] * 2
    expected = [generate(runner, [prompt], 30)[0].new_ids for prompt in prompts]
    produced = [None] * len(prompts)

    def run(row):
        produced[row] = generate(runner, [prompts[row]], 30)[0].new_ids

    threads = [threading.Thread(target=run, args=(row,)) for row in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert produced == expected


def test_a_sampled_row_draws_the_same_tokens_in_any_batch(runner):
    prompts = [[5, 9, 100, 3], [17], [250, 251, 252, 253, 7, 7], [40, 41]]
    sampling = SamplingConfig(do_sample=True, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=11)
    batched = generate(runner, prompts, 30, sampling)
    for prompt, result in zip(prompts, batched):
        assert result.new_ids == generate(runner, [prompt], 30, sampling)[0].new_ids
    twice = generate(
        runner,
        [prompts[0], prompts[0]],
        30,
        SamplingConfig(do_sample=True, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=(11, 12)),
    )
    assert twice[0].new_ids == batched[0].new_ids and twice[1].new_ids != twice[0].new_ids


def test_the_smallest_temperature_and_penalty_stay_finite_and_within_the_vocabulary(runner):
    greedy = generate(runner, [[1, 2, 3]], 8)[0].new_ids
    assert generate(runner, [[1, 2, 3]], 8, SamplingConfig(do_sample=True, temperature=1e-6))[0].new_ids == greedy
    penalised = generate(
        runner, [[1, 2, 3]], 8, SamplingConfig(do_sample=True, temperature=1e-6, repetition_penalty=1e-6)
    )
    assert all(0 <= i < runner.manifest.config.vocab_size for i in penalised[0].new_ids)


def test_the_largest_penalty_leaves_no_nan(recwarn):
    # A seen logit of exactly 0 under the largest penalty stays a number: a NaN would be blamed on the artifact.
    logits = np.array([[0.0, -1.0, -2.0, 3.0]], dtype=np.float32)
    seen = np.array([[True, True, True, True]])
    largest = float(np.finfo(np.float32).max)
    processed = process_logits(logits, seen, SamplingConfig(repetition_penalty=largest))
    assert not np.isnan(processed).any()
    assert processed[0, 0] == 0 and processed[0, 2] == -np.inf and 0 < processed[0, 3] < 1e-37
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_non_finite_logits_are_an_error_not_an_id():
    from exporter.errors import ToolkitError
    from exporter.runtime.generation import choose_tokens

    logits = np.zeros((2, 5))
    logits[1, 3] = np.nan
    rngs = [np.random.default_rng(0)] * 2
    with pytest.raises(ToolkitError, match="not finite"):
        choose_tokens(logits, SamplingConfig(do_sample=True), rngs)
    with pytest.raises(ToolkitError, match="not finite"):  # greedy too: argmax would choose the NaN's id
        choose_tokens(logits, SamplingConfig(), rngs)
    logits[1, 3] = np.inf  # an inf logit is the certain choice
    assert choose_tokens(logits, SamplingConfig(do_sample=True), rngs)[1] == 3
    assert choose_tokens(logits, SamplingConfig(), rngs)[1] == 3


def test_a_two_dimensional_integer_array_is_a_batch(runner):
    ids = np.array([[3, 1, 4], [1, 5, 9]], dtype=np.int32)
    assert [r.new_ids for r in generate(runner, ids, 6)] == [r.new_ids for r in generate(runner, ids.tolist(), 6)]


@pytest.mark.parametrize(
    "prompts,kwargs,message",
    [
        ([[1, 2], []], {}, "prompt 1: the prompt is empty"),
        ([[1, 600]], {}, "outside the vocabulary"),
        ([[1] * 200, [1]], {"max_new_tokens": 100}, "prompt 0: .*exceeds max_position_embeddings"),
        ([[1]], {"stop_ids": [9999]}, "stop ids"),
        ([[1]], {"stop_ids": 5}, r"stop_ids must be a list .*stop_ids=\[5\]"),
        ([[1]], {"stop_ids": np.array(5)}, "stop_ids must be a list"),
        (
            [[1]],
            {"stop_ids": None},
            r"stop_ids must be a list of token ids, got None; write e.g. stop_ids=\[2\], or \(\) "
            r"for none$",
        ),
        ([[1]], {"sampling": {"do_sample": True}}, "sampling must be a SamplingConfig"),
        ([{1, 2}], {}, "a prompt must be a list of token ids, got set"),
        ([[1, 2]], {"eos_token_id": 1000}, "eos_token_id 1000 is not a token id"),
        ([[1, 2]], {"eos_token_id": -5}, "eos_token_id -5 is not a token id"),
        ([[1.7, 2.2]], {}, "token ids must be integers, got 1.7"),
        ([[True, False]], {}, "token ids must be integers, got True"),
        (["123"], {}, "a prompt must be a list of token ids, got str"),
        ([1, 2, 3], {}, "got a list of ids; wrap one prompt"),
        ("1 2 3", {}, "prompts must be a list of prompts"),
        (np.array([1, 2, 3]), {}, "prompts must be a list of prompts"),
        ([[1, 2]], {"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ([[1], [2], [3]], {"sampling": SamplingConfig(do_sample=True, seed=(1, 2))}, "2 seeds for a batch of 3"),
    ],
)
def test_bad_generation_inputs_fail_before_any_model_call(runner, prompts, kwargs, message):
    counting = CountingRunner(runner)
    with pytest.raises(InputError, match=message):
        stream(counting, prompts, kwargs.pop("max_new_tokens", 5), **kwargs)
    assert counting.calls == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"do_sample": True, "temperature": 0.0}, r"`temperature` must lie in \[1e-06, 3.403e\+38\]"),
        ({"do_sample": True, "temperature": -1.0}, r"`temperature` must lie in"),
        ({"do_sample": True, "temperature": 1e-40}, r"`temperature` must lie in"),
        ({"do_sample": True, "temperature": 1e39}, r"`temperature` must lie in .*finite in float32"),
        ({"do_sample": True, "temperature": "x"}, r"`temperature` must be a number"),
        ({"top_p": "0.5"}, r"`top_p` must be a number"),
        ({"repetition_penalty": None}, r"`repetition_penalty` must be a number"),
        ({"top_p": 0.0}, r"`top_p` must lie in \(0, 1\]"),
        ({"top_p": 1.5}, r"`top_p` must lie in \(0, 1\]"),
        ({"top_k": -1}, r"`top_k` must be an integer >= 0"),
        ({"repetition_penalty": 0.0}, r"`repetition_penalty` must lie in \[1e-06, 3.403e\+38\]"),
        ({"repetition_penalty": 1e300}, r"`repetition_penalty` must lie in .*finite in float32"),
        ({"do_sample": True, "temperature": float("inf")}, r"`temperature` must lie in"),
        ({"repetition_penalty": float("nan")}, r"`repetition_penalty` must lie in"),
        ({"top_k": 2.5}, r"`top_k` must be an integer"),
        ({"seed": -1}, r"`seed` must be an integer >= 0"),
        ({"seed": (1, "2")}, r"`seed` must be an integer >= 0"),
        # it sampled: "no" is truthy
        ({"do_sample": "no"}, r"`do_sample` must be True or False, got 'no' \(str\)"),
        ({"do_sample": None}, r"`do_sample` must be True or False"),
    ],
)
def test_bad_sampling_settings_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        SamplingConfig(**kwargs)


def test_optimised_graphs_can_be_saved(artifact_fp32, tmp_path):
    OrtRunner(artifact_fp32, settings=SessionSettings(optimized_model_dir=tmp_path / "optimized"))
    saved = sorted(p.name for p in (tmp_path / "optimized").iterdir())
    assert "decode.optimized.onnx" in saved and "prefill.optimized.onnx" in saved


def test_a_failed_save_of_the_optimised_graphs_keeps_the_earlier_ones(artifact_fp32, tmp_path, monkeypatch):
    """onnxruntime writes the optimised graph while it makes the session: a full disk leaves the earlier save whole,
    not a truncated graph over it, and is not reported as a damaged artifact ("re-export the folder")."""
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    folder = tmp_path / "optimized"
    OrtRunner(artifact_fp32, settings=SessionSettings(optimized_model_dir=folder))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real = ort.InferenceSession

    def full_disk(model, options, **kwargs):
        if options.optimized_model_filepath:  # as onnxruntime leaves a write that ran out of space
            Path(options.optimized_model_filepath).write_bytes(b"")
            Path(options.optimized_model_filepath + ".data").write_bytes(b"\0" * 10)
            raise Fail("Failed to write external initializers to file")
        return real(model, options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", full_disk)
    with pytest.raises(
        OutputPathError,
        match=r"cannot save the optimised graph decode.optimized.onnx in .*"
        r"\(`optimized_model_dir`\)",
    ):
        OrtRunner(artifact_fp32, settings=SessionSettings(optimized_model_dir=folder))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # and no hidden folder left


def test_the_optimised_graphs_land_both_or_neither(artifact_fp32, tmp_path, monkeypatch):
    """decode.onnx's graph saved, then prefill.onnx's save failing: the folder keeps both earlier graphs (no new
    decode graph beside the earlier prefill graph), and a new folder is not left with the decode graph alone."""
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    real = ort.InferenceSession

    def prefill_on_a_full_disk(model, options, **kwargs):
        if options.optimized_model_filepath.endswith("prefill.optimized.onnx"):
            raise Fail("Failed to write external initializers to file")
        return real(model, options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", prefill_on_a_full_disk)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    saved = {
        name: name.encode()
        for name in ("decode.optimized.onnx", "decode.optimized.onnx.data", "prefill.optimized.onnx")
    }
    for name, data in saved.items():
        (earlier / name).write_bytes(data)
    for folder in (earlier, tmp_path / "new"):
        with pytest.raises(OutputPathError, match=r"^cannot save the optimised graph prefill.optimized.onnx in "):
            OrtRunner(artifact_fp32, settings=SessionSettings(optimized_model_dir=folder))
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == saved  # and no hidden folder left
    assert [p.name for p in tmp_path.iterdir()] == ["earlier"]


def test_a_second_save_of_the_optimised_graphs_into_one_folder_waits_for_the_first_ones_moves(artifact_fp32, tmp_path):
    """Two `generate --save-optimized D` at once: their moves into D interleaved, leaving one's graph beside the
    other's weights file. The later now waits for the earlier's moves (a lock on D) and replaces its files whole."""
    import subprocess

    folder = tmp_path / "optimized"
    folder.mkdir()
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""if True:
        import time
        from pathlib import Path
        from exporter.artifact.paths import folder_lock
        folder = Path({str(folder)!r})
        with folder_lock(folder):  # the other save's moves, slowed down: its weights file first, then its graph
            (folder / "decode.optimized.onnx.data").write_text("theirs")
            print("moving", flush=True)
            time.sleep(1)
            (folder / "decode.optimized.onnx").write_text("theirs")
        """,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert other.stdout.readline() == "moving\n"
    OrtRunner(artifact_fp32, settings=SessionSettings(optimized_model_dir=folder))
    assert other.wait() == 0
    assert (folder / "decode.optimized.onnx").read_bytes() != b"theirs"
    assert (folder / "decode.optimized.onnx.data").read_bytes() != b"theirs"


def test_a_failed_first_save_of_the_optimised_graphs_leaves_no_folder_made_for_it(artifact_fp32, tmp_path, monkeypatch):
    # --save-optimized new/optimized on a full disk left new/optimized/ behind, empty.
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    real = ort.InferenceSession

    def full_disk(model, options, **kwargs):
        if options.optimized_model_filepath:
            raise Fail("Failed to write external initializers to file")
        return real(model, options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", full_disk)
    with pytest.raises(OutputPathError, match=r"^cannot save the optimised graph "):
        OrtRunner(artifact_fp32, settings=SessionSettings(optimized_model_dir=tmp_path / "new" / "optimized"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_between_the_moves_of_the_optimised_graph_keeps_a_matched_pair(
    artifact_fp32, tmp_path, monkeypatch, signum
):
    """The saved graph and its weights file are moved in one after the other: a Ctrl-C landing between the two
    left the new weights file beside the earlier graph. The signal now takes effect after both moves."""
    folder = tmp_path / "optimized"
    folder.mkdir()
    graph, weights = folder / "decode.optimized.onnx", folder / "decode.optimized.onnx.data"
    graph.write_bytes(b"old graph")
    weights.write_bytes(b"old weights")
    real, moves = os.replace, []

    def replace_then_signal(source, destination):
        real(source, destination)
        moves.append(Path(destination).name)
        if len(moves) == 1:  # as a Ctrl-C in the terminal: to the process, not to a thread
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(os, "replace", replace_then_signal)
    # The deferral the CLI installs (begin_command), whether or not a command ran earlier in this process.
    monkeypatch.setattr(paths, "_uninterrupted", signals_deferred)
    # SIGTERM as the CLI routes it, SIGINT as at a terminal, were pytest started with `&` (ignoring it)
    handlers = {signum: signal.signal(signum, signal.default_int_handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(KeyboardInterrupt):
            OrtRunner(artifact_fp32, settings=SessionSettings(optimized_model_dir=folder))
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert moves[0] == weights.name  # the signal came after the first move, the weights file
    pair = (graph.read_bytes() == b"old graph", weights.read_bytes() == b"old weights")
    assert pair in ((True, True), (False, False)), f"mismatched pair on disk: graph old, weights old = {pair}"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_the_optimised_graphs_can_be_saved_from_a_thread(artifact_fp32, tmp_path):
    """Signal handlers can be set only in the main thread: the save's guard against interrupts must not fail
    (ValueError) in a session made from another thread (a server's worker)."""
    folder, errors = tmp_path / "optimized", []

    def load():
        try:
            OrtRunner(artifact_fp32, settings=SessionSettings(optimized_model_dir=folder))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    thread.join()
    assert not errors
    assert {"decode.optimized.onnx", "prefill.optimized.onnx"} <= {p.name for p in folder.iterdir()}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(509)]  # exactly the tiny vocabulary
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_text_in_and_out_through_a_tokenizer(artifact_fp32, tokenizer_file, runner):
    result = CliRunner().invoke(
        main,
        [
            "generate",
            str(artifact_fp32),
            "--prompt",
            "w5 w17 w230",
            "--tokenizer",
            str(tokenizer_file),
            "--max-new-tokens",
            "8",
            "--ignore-eos",
            "--json",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.stdout)
    assert row["prompt_ids"] == [8, 20, 233]
    assert row["new_ids"] == generate(runner, [[8, 20, 233]], 8)[0].new_ids
    words = row["text"].split()
    assert len(words) == 8 and all(w.startswith("w") or w.startswith("<") for w in words)


def test_prompt_text_without_the_tokenizers_library_is_a_one_line_error(artifact_fp32, tokenizer_file, monkeypatch):
    # A deployment installed without dependencies (README, "Golden bundles"): one line naming the library to
    # install, exit 2, not an internal error.
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # any import of it now fails
    result = CliRunner().invoke(
        main, ["generate", str(artifact_fp32), "--prompt", "w5", "--tokenizer", str(tokenizer_file), "-q"]
    )
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert "needs the tokenizers library" in line and "pip install tokenizers" in line, line


def test_streamed_text_is_printed_as_it_is_produced(artifact_fp32, tokenizer_file, monkeypatch):
    import sys

    import exporter.runtime.generation

    produced = exporter.runtime.generation.stream
    printed_at_step = []  # the words on stdout when each step is produced

    def watched(*args, **kwargs):
        for tokens in produced(*args, **kwargs):
            sys.stdout.flush()
            printed_at_step.append(len(sys.stdout.buffer.getvalue().decode().split()))
            yield tokens

    monkeypatch.setattr(exporter.runtime.generation, "stream", watched)
    result = CliRunner().invoke(
        main,
        [
            "generate",
            str(artifact_fp32),
            "--prompt",
            "w5 w17",
            "--tokenizer",
            str(tokenizer_file),
            "--max-new-tokens",
            "5",
            "--ignore-eos",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len(result.stdout.split()) == 5
    assert printed_at_step == [0, 1, 2, 3, 4]  # each step's word was on stdout before the next step was produced


@pytest.mark.parametrize("config_text", ["{bad", '{"chat_template": [{"name": "default", "template": "x"}]}'])
def test_generate_does_not_read_the_tokenizer_config_beside_its_tokenizer(
    artifact_fp32, tokenizer_file, tmp_path, config_text
):
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(config_text)  # the export would refuse it; generation needs none
    result = CliRunner().invoke(
        main,
        [
            "generate",
            str(artifact_fp32),
            "--prompt",
            "w5 w17",
            "--tokenizer",
            str(tmp_path / "tokenizer.json"),
            "--max-new-tokens",
            "3",
            "--json",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)[0]["new_ids"]) == 3


def test_generated_ids_the_tokenizer_lacks_are_named_once(artifact_fp32, runner, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    small = Tokenizer(models.WordLevel({f"w{i}": i for i in range(319)}, unk_token="w0"))  # the model has 512 ids
    small.pre_tokenizer = pre_tokenizers.Whitespace()
    small.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    small.save(str(tmp_path / "tokenizer.json"))
    new_ids = generate(runner, [small.encode("w5 w17").ids], 20)[0].new_ids
    missing = sorted({i for i in new_ids if i >= 319})
    assert missing, "the seeded model must emit ids past the tokenizer for this test to mean anything"
    warning = f"generated ids that are no tokens of the tokenizer, left out of the text: {', '.join(map(str, missing))}"
    command = [
        "generate",
        str(artifact_fp32),
        "--prompt",
        "w5 w17",
        "--tokenizer",
        str(tmp_path / "tokenizer.json"),
        "--max-new-tokens",
        "20",
        "--ignore-eos",
        "-q",
    ]
    for options in (["--json"], ["--prompt", "w5 w17", "--json"], []):  # a batch of two, and the live stream
        result = CliRunner().invoke(main, command + options)
        assert result.exit_code == 0, result.output
        assert result.stderr.count("left out of the text") == 1 and warning in result.stderr
    [row] = json.loads(CliRunner().invoke(main, command + ["--json"]).stdout)
    assert row["new_ids"] == new_ids and row["text"].split() == [f"w{i}" for i in new_ids if i < 319]


def test_text_that_encodes_to_no_tokens_is_refused_as_text(artifact_fp32, monkeypatch):
    # the artifact's byte-level BPE knows only lower-case ASCII letters and has no unknown token
    monkeypatch.setattr(
        "exporter.runtime.runner.OrtRunner.__init__", lambda *args, **kwargs: pytest.fail("model loaded")
    )
    for text in ("", "KALO"):
        result = CliRunner().invoke(main, ["generate", str(artifact_fp32), "--prompt", "kalo", "--prompt", text])
        assert result.exit_code == 2, result.output
        [line] = result.stderr.strip().splitlines()
        assert f"Invalid value for --prompt: {text!r} encodes to no tokens with this tokenizer" in line


def test_prompt_dash_reads_the_prompt_text_from_stdin(artifact_fp32):
    command = ["generate", str(artifact_fp32), "--max-new-tokens", "2", "--json", "-q"]
    given = CliRunner().invoke(main, [*command, "--prompt", "kalo mine"])
    piped = CliRunner().invoke(main, [*command, "--prompt", "-", "--prompt", "ruto"], input="kalo mine\n")
    assert given.exit_code == 0 and piped.exit_code == 0, piped.output
    assert [row["prompt_ids"] for row in json.loads(piped.stdout)] == [
        json.loads(given.stdout)[0]["prompt_ids"],
        json.loads(CliRunner().invoke(main, [*command, "--prompt", "ruto"]).stdout)[0]["prompt_ids"],
    ]  # its line end left out


def test_prompt_dash_drops_a_final_windows_line_end(artifact_fp32, tmp_path):
    # the artifact's tokenizer leaves "\r" out of every text; one without a pre-tokenizer reads "kalo\r" as unknown
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[unk]": 0, "kalo": 1}, unk_token="[unk]")).save(str(tmp_path / "tokenizer.json"))
    command = [
        "generate",
        str(artifact_fp32),
        "--tokenizer",
        str(tmp_path),
        "--prompt",
        "-",
        "--max-new-tokens",
        "0",
        "--json",
        "-q",
    ]
    for stdin, ids in (("kalo\r\n", [1]), ("kalo\r\n\r\n", [0])):  # one line end dropped, not every one
        result = CliRunner().invoke(main, command, input=stdin)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)[0]["prompt_ids"] == ids, repr(stdin)


def test_prompt_dash_with_stdin_closed_is_a_usage_error(artifact_fp32):
    # `export-onnx generate --prompt - <&-`: Python starts with sys.stdin None, a usage error, not an internal one
    import subprocess

    result = subprocess.run(
        [str(Path(sys.executable).parent / "export-onnx"), "generate", str(artifact_fp32), "--prompt", "-"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.close(0),
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: Invalid value for --prompt -: stdin is closed; pipe the prompt in (see 'export-onnx generate --help')"
    ], result.stderr


@pytest.mark.parametrize(
    "options, stdin, message",
    [
        (["--prompt", "-"], "", "Invalid value for --prompt - (stdin): '' encodes to no tokens with this tokenizer"),
        (
            ["--prompt", "-"],
            b"kalo \xff",
            "Invalid value for --prompt -: stdin is not UTF-8 text (invalid start byte at byte 5); pipe in UTF-8 text",
        ),
        (["--prompt", "-", "--prompt", "-"], "kalo", "--prompt - reads one prompt, all of stdin; give it once"),
    ],
    ids=["empty", "not UTF-8", "twice"],
)
def test_prompt_dash_refuses_what_stdin_cannot_give_in_one_line(artifact_fp32, monkeypatch, options, stdin, message):
    monkeypatch.setattr(
        "exporter.runtime.runner.OrtRunner.__init__", lambda *args, **kwargs: pytest.fail("model loaded")
    )
    result = CliRunner().invoke(main, ["generate", str(artifact_fp32), *options, "-q"], input=stdin)
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert message in line, line


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(artifact_fp32, tmp_path):
    from tokenizers import Tokenizer, models

    big = Tokenizer(models.WordLevel({f"t{i}": i for i in range(600)}, unk_token="t0"))
    big.save(str(tmp_path / "tokenizer.json"))
    result = CliRunner().invoke(
        main, ["generate", str(artifact_fp32), "--prompt", "t1", "--tokenizer", str(tmp_path / "tokenizer.json"), "-q"]
    )
    assert result.exit_code == 2
    assert "token ids in [0, 599]" in result.stderr and "vocab_size is 512" in result.stderr


def test_generate_checks_stop_and_eos_ids_before_loading_the_model(artifact_fp32, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("exporter.runtime.runner.OrtRunner.__init__", no_load)
    for option in (["--stop-id", "9999"], ["--sample", "--temperature", "0"]):
        result = CliRunner().invoke(main, ["generate", str(artifact_fp32), "--prompt-ids", "1,2", *option])
        assert result.exit_code == 2, result.output
        assert result.stderr.count("\n") == 1 and "loaded" not in result.stderr


def test_a_character_cut_by_the_end_of_the_stream_is_still_printed():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from exporter.artifact.tokenizer import TextStream, TextTokenizer

    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    a, e_first, e_second = tokenizer.encode("aé").ids  # one id per byte: "é" is two
    text = TextStream(TextTokenizer(tokenizer))
    assert text.push(a) == "a"
    assert text.push(e_first) == ""  # held back until the character is complete
    assert text.push(e_second) == "é"
    assert text.push(e_first) == "" and text.rest() == "\ufffd"


def test_decoded_text_keeps_the_spaces_at_its_ends(tiny_tokenizer):
    """Generated text continues the prompt: a byte-level token's leading space (and a trailing one) is part of
    it, in the streamed text and in --json's "text" alike; a join of prompt and text must not run words
    together."""
    from tokenizers import Tokenizer

    from exporter.artifact.tokenizer import TextStream, TextTokenizer

    loaded = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    ids = loaded.encode(" kalo lomi ").ids
    assert loaded.id_to_token(ids[0]).startswith("\u0120")  # the byte-level space, inside the first token
    assert TextTokenizer(loaded).decode(ids) == " kalo lomi "
    stream = TextStream(TextTokenizer(loaded))
    assert "".join(stream.push(i) for i in ids) + stream.rest() == " kalo lomi "


def test_step_refuses_a_mask_that_does_not_cover_cache_and_new_tokens(runner):
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    runner.start(ids, np.ones_like(ids), np.arange(3)[None])
    with pytest.raises(InputError, match=r"attention_mask has shape \(1, 3\), expected \(1, 4\)"):
        runner.step(np.array([[4]]), np.ones((1, 3), dtype=np.int64), np.array([[3]]))
    with pytest.raises(InputError, match="batch of 2 rows for a cache of 1"):
        runner.step(np.array([[4], [5]]), np.ones((2, 4), dtype=np.int64), np.array([[3], [3]]))
