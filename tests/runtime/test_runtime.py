"""The ONNX Runtime generation loop and the artifact checks it relies on."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import config_entry

from exporter.artifact.folder import Artifact
from exporter.errors import ArtifactError, GraphRunError, InputError, ProviderError
from exporter.runtime.generation import generate_greedy
from exporter.runtime.providers import CPU, CUDA, available_parity_providers, check_provider, cuda_unusable
from exporter.runtime.runner import OrtRunner
from exporter.verify.references.torch_runner import reference_greedy


def test_greedy_generation_equals_the_reference(runner, tiny_model):
    prompt = [1, 17, 230, 4, 99]
    result = generate_greedy(runner, prompt, 40)
    assert result.new_ids == reference_greedy(tiny_model, prompt, 40, None).ids
    assert len(set(result.new_ids)) > 5, "degenerate model output makes token equality meaningless"


def test_one_token_prompt_generates(runner, tiny_model):
    assert generate_greedy(runner, [7], 5).new_ids == reference_greedy(tiny_model, [7], 5, None).ids


def test_generation_stops_at_eos(runner):
    tokens = generate_greedy(runner, [1, 17, 230], 20).new_ids
    eos = tokens[6]  # pretend the 7th generated token is the eos id
    result = generate_greedy(runner, [1, 17, 230], 20, eos_token_id=eos)
    assert result.stopped and result.new_ids == tokens[: tokens.index(eos) + 1]


@pytest.mark.parametrize(
    "prompt,max_new,message",
    [
        ([], 4, "prompt is empty"),
        ([3, 512], 4, r"outside the vocabulary \[0, 512\)"),
        ([3, -1], 4, "outside the vocabulary"),
        (
            [3] * 250,
            7,
            r"^prompt \(250 tokens\) \+ max_new_tokens \(7\) needs 257 positions, which exceeds "
            r"max_position_embeddings \(256\)",
        ),
        ([3], 256, r"^prompt \(1 token\) \+ max_new_tokens \(256\) needs 257 positions"),  # read "(1 tokens)"
    ],
)
def test_bad_prompts_are_refused_before_running(runner, prompt, max_new, message):
    with pytest.raises(InputError, match=message):
        generate_greedy(runner, prompt, max_new)


def test_requesting_an_absent_cuda_provider_is_an_error(artifact_fp32, cpu_only):
    with pytest.raises(ProviderError, match="CUDAExecutionProvider cannot run here: not available in this"):
        OrtRunner(artifact_fp32, "cuda")


def test_an_empty_provider_name_is_named_as_empty():
    # `--artifact-provider=` said "... not ; pass cpu or cuda"
    with pytest.raises(ProviderError, match="not an empty name; pass cpu or cuda"):
        check_provider("")


def test_a_listed_cuda_provider_that_cannot_start_is_skipped_or_refused(monkeypatch):
    # onnxruntime-gpu without a working GPU, CUDA or cuDNN lists the provider, and its sessions fall back to
    # the CPU: the default providers must skip it with the reason, and asking for it must be refused.
    if cuda_unusable() is None:
        pytest.skip("CUDAExecutionProvider starts here: there is no failure to start to see")
    listed = [CUDA, *ort.get_available_providers()]
    monkeypatch.setattr(ort, "get_available_providers", lambda: listed)
    chosen, skipped = available_parity_providers()
    assert chosen == [CPU] and skipped[CUDA].startswith("could not start")
    with pytest.raises(ProviderError, match="cannot run here: could not start .*check the GPU, CUDA and cuDNN"):
        check_provider("cuda")


def test_the_cuda_probe_fits_a_shared_thread_pool():
    # The probe session takes the shared pool once a runner has made it: one asking for a pool of its own would be
    # refused by onnxruntime, and a working CUDA reported as one that "could not start ... check the GPU, CUDA and
    # cuDNN".
    # A fresh process, since the shared pool is process-wide; CUDA listed, as onnxruntime-gpu lists it.
    import subprocess
    import sys

    script = (
        "import onnxruntime as ort; from exporter.runtime import providers, settings; "
        "settings._use_global_thread_pool(1); listed = [providers.CUDA, *ort.get_available_providers()]; "
        "ort.get_available_providers = lambda: listed; print(providers.cuda_unusable())"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "thread" not in out.stdout, out.stdout  # None where CUDA starts; else a failure of CUDA's own


def test_a_graph_that_fails_to_run_is_an_artifact_error_in_one_line(runner):
    # what a damaged graph that still loads gives (a Range of step 0, say); here an id outside the vocabulary
    ids = np.ones((1, 3), np.int64)
    with pytest.raises(GraphRunError, match=r"onnxruntime failed running prefill.onnx \(.*\); .*re-export") as info:
        runner.prefill(
            {"input_ids": ids * 9999, "attention_mask": ids, "position_ids": np.arange(3)[None], "labels": ids}
        )
    assert "\n" not in str(info.value) and isinstance(info.value, ArtifactError)


def test_feeds_that_miss_an_input_or_name_another_are_refused_in_one_line(runner):
    """prefill() without labels on an artifact with the loss raised onnxruntime's bare ValueError."""
    ids = np.ones((1, 3), np.int64)
    feeds = {"input_ids": ids, "attention_mask": ids, "position_ids": np.arange(3)[None]}
    with pytest.raises(
        InputError,
        match=r"^prefill.onnx takes the inputs input_ids, attention_mask, position_ids, "
        r"labels, got feeds with missing labels \(labels: this artifact has the "
        r"loss; -100 masks a position\)$",
    ):
        runner.prefill(feeds)
    with pytest.raises(
        InputError,
        match=r"^decode.onnx takes the inputs .*, got feeds with missing "
        r"past_key_values\.0\.key, .*; not an input labels$",
    ):
        runner.decode({**feeds, "labels": ids})
    assert runner.prefill({**feeds, "labels": ids})["logits"].shape[:2] == (1, 3)


def test_feeds_of_another_dtype_are_refused_as_inputs_not_blamed_on_the_graph(runner):
    """A float16 cache (another artifact's empty_past) or int32 ids: onnxruntime's refusal read "the graph is
    damaged: re-export the folder"."""
    ids = np.ones((1, 3), np.int64)
    feeds = {"input_ids": ids, "attention_mask": ids, "position_ids": np.arange(3)[None]}
    past = {name: value.astype(np.float16) for name, value in runner.empty_past(1).items()}
    with pytest.raises(InputError, match=r"^decode.onnx takes past_key_values\.0\.key as float32, got float16; "):
        runner.decode({**feeds, **past})
    with pytest.raises(InputError, match=r"^prefill.onnx takes input_ids as int64, got int32; "):
        runner.prefill({**feeds, "input_ids": ids.astype(np.int32), "labels": ids})


def wrong_cache(runner, wrong: np.ndarray):
    """A cache of `wrong` in every slot, as the runner keeps it (`wrong` must outlive it: the values read it)."""
    return [ort.OrtValue.ortvalue_from_numpy(wrong)._ortvalue for _ in runner.cache]


def test_a_decode_step_that_fails_to_run_is_an_artifact_error_in_one_line(runner):
    # generation's path (IO binding) raises other exceptions than session.run; the stand-in for the damage is a
    # cache of another head size (start and step refuse bad ids, masks and positions, see below)
    runner.start(np.ones((1, 3), np.int64), np.ones((1, 3), np.int64), np.arange(3)[None])
    cache = runner.manifest.cache
    wrong = np.zeros((1, cache.num_key_value_heads, 3, cache.head_dim + 1), np.float32)
    runner.cache = wrong_cache(runner, wrong)
    with pytest.raises(GraphRunError, match=r"onnxruntime failed running decode.onnx \(.*\); .*re-export") as info:
        runner.step(np.array([[4]]), np.ones((1, 4), np.int64), np.array([[3]]))
    assert "\n" not in str(info.value)
    runner.cache = None  # its values read `wrong`


def test_start_and_step_refuse_positions_past_max_position_embeddings_before_running(runner):
    """generate refused a prompt past the positions; start and step ran it, to logits the reference refuses."""
    limit = runner.manifest.config.max_position_embeddings
    full = np.ones((1, limit + 1), np.int64)
    with pytest.raises(
        InputError,
        match=rf"the prompt \(position_ids up to {limit}\) needs {limit + 1} positions, "
        rf"which exceeds max_position_embeddings \({limit}\); shorten",
    ) as info:
        runner.start(full, full, np.arange(limit + 1)[None])
    assert "\n" not in str(info.value)
    runner.start(full[:, :limit], full[:, :limit], np.arange(limit)[None])  # every position: allowed
    cache = runner.cache
    with pytest.raises(
        InputError,
        match=rf"this step \(position_ids up to {limit}\) needs {limit + 1} positions, "
        rf"which exceeds max_position_embeddings \({limit}\)",
    ):
        runner.step(np.array([[4]]), full, np.array([[limit]]))
    assert runner.cache is cache


def test_start_and_step_refuse_arrays_the_graph_does_not_take_as_input_errors(runner, artifact_fp32):
    """int32 ids, lists, 1-D arrays or ids outside the vocabulary are input errors naming the array, refused before
    onnxruntime runs (whose refusal would read as a damaged graph: re-export the folder); check_hashes="no" is
    refused, not read as True."""
    ids, mask, positions = np.ones((1, 3), np.int64), np.ones((1, 3), np.int64), np.arange(3)[None]
    for bad, got in (
        (ids.astype(np.int32), "an array of int32 with shape (1, 3)"),
        ([[1, 1, 1]], "list"),
        (ids[0], "an array of int64 with shape (3,)"),
        (None, "NoneType"),
    ):
        with pytest.raises(
            InputError,
            match=re.escape(f"input_ids must be a 2-D (batch, tokens) numpy array of int64, got {got}; convert it"),
        ):
            runner.start(bad, mask, positions)
    with pytest.raises(InputError, match=r"position_ids must be .* got an array of float64"):
        runner.start(ids, mask, positions.astype(float))
    with pytest.raises(InputError, match=r"input_ids \[512, 9999\] lie outside the vocabulary \[0, 512\)"):
        runner.start(np.array([[9999, 512, 9999]]), mask, positions)
    runner.start(ids, mask, positions)
    with pytest.raises(InputError, match="input_ids must be a 2-D .* got list"):
        runner.step([[4]], np.ones((1, 4), np.int64), np.array([[3]]))
    with pytest.raises(InputError, match="attention_mask must be a 2-D .* got an array of int32"):
        runner.step(np.array([[4]]), np.ones((1, 4), np.int32), np.array([[3]]))
    for provider in (None, 5, ["cpu"]):  # AttributeError: no attribute 'lower'
        with pytest.raises(ProviderError, match=r"a provider is a name such as 'cpu' or 'cuda', got .*\(`provider`\)$"):
            OrtRunner(artifact_fp32, provider)
    with pytest.raises(InputError, match="settings must be a SessionSettings, got dict"):
        OrtRunner(artifact_fp32, settings={"intra_op_threads": 1})
    with pytest.raises(InputError, match="artifact must be an Artifact or an artifact folder's path"):
        OrtRunner(None)
    for flag in ("no", 0, None):
        with pytest.raises(InputError, match=rf"^check_hashes must be True or False, got {flag!r} "):
            OrtRunner(artifact_fp32, check_hashes=flag)


def test_start_and_step_refuse_ids_masks_and_positions_out_of_range_before_running(runner):
    """step ran an id outside the vocabulary into onnxruntime's Gather (reported as a damaged graph); start and
    step ran negative positions and mask values other than 0 and 1, to logits no reference computes."""
    ids, mask, positions = np.ones((1, 3), np.int64), np.ones((1, 3), np.int64), np.arange(3)[None]
    with pytest.raises(
        InputError,
        match=r"^position_ids must be >= 0 \(the k-th token of a row is at position k\), "
        r"got -1$",
    ):
        runner.start(ids, mask, positions - 1)
    with pytest.raises(
        InputError,
        match=r"^attention_mask holds \[2\]; it takes 1 for a token and 0 for left "
        r"padding, nothing else$",
    ):
        runner.start(ids, mask * 2, positions)
    runner.start(ids, mask, positions)
    cache = runner.cache
    new_mask = np.ones((1, 4), np.int64)
    for token in (512, -1):
        with pytest.raises(InputError, match=rf"^input_ids \[{token}\] lie outside the vocabulary \[0, 512\)$"):
            runner.step(np.array([[token]]), new_mask, np.array([[3]]))
    with pytest.raises(InputError, match=r"^attention_mask holds \[-1\]; "):
        runner.step(np.array([[4]]), np.array([[1, -1, 1, 1]]), np.array([[3]]))
    with pytest.raises(InputError, match=r"^position_ids must be >= 0 .*, got -5$"):
        runner.step(np.array([[4]]), new_mask, np.array([[-5]]))
    assert runner.cache is cache
    assert runner.step(np.array([[4]]), new_mask, np.array([[3]])).shape == (1, 512)


def test_empty_past_refuses_a_batch_that_is_no_positive_integer(runner):
    """numpy's errors before (negative dimensions, 'str' object cannot be interpreted as an integer)."""
    for batch in (0, -1, "2", 2.5, True, None):
        with pytest.raises(InputError, match=rf"^batch must be an integer >= 1, got {re.escape(repr(batch))}$"):
            runner.empty_past(batch)
    assert runner.empty_past(np.int64(2))["past_key_values.0.key"].shape[0] == 2


def test_an_opened_artifact_is_used_as_it_is_not_read_again(artifact_fp32, monkeypatch):
    """An Artifact handed to the runner is the one it runs: neither manifest.json nor any file is read again."""
    from exporter.artifact import manifest as manifest_module
    from exporter.artifact.folder import Artifact

    artifact = Artifact.open(artifact_fp32)
    monkeypatch.setattr(manifest_module, "load_manifest", lambda folder: pytest.fail("manifest.json read again"))
    monkeypatch.setattr(manifest_module, "sha256_file", lambda path: pytest.fail(f"{path} hashed again"))
    runner = OrtRunner(artifact)
    assert runner.artifact is artifact and runner.manifest is artifact.manifest
    assert runner.folder == artifact_fp32


def test_a_folder_an_export_swaps_while_the_runner_loads_it_is_an_error_saying_so(artifact_copy, monkeypatch):
    """An export landing between the manifest's read and the sessions' (a server loading while an admin re-exports):
    the runner loaded the prefill weights of one artifact and the decode graph of the other, and generated from
    the mix without a word (verify reported the mix as a parity failure)."""
    from helpers import swapped_in_first

    import exporter.runtime.runner

    monkeypatch.setattr(
        exporter.runtime.runner, "load_session", swapped_in_first(exporter.runtime.runner.load_session, artifact_copy)
    )
    with pytest.raises(
        ArtifactError,
        match=rf"^{re.escape(str(artifact_copy))} was replaced while it was read "
        r"\(an export into it meanwhile\?\).*run again once the export is done$",
    ):
        OrtRunner(artifact_copy)
    OrtRunner(artifact_copy)  # the folder as it is now, read whole


def test_folder_without_manifest_is_refused(tmp_path):
    with pytest.raises(ArtifactError, match="has no manifest.json"):
        OrtRunner(tmp_path)


def test_missing_file_is_refused(artifact_copy):
    (artifact_copy / "weights.onnx.data").unlink()
    with pytest.raises(ArtifactError, match="lacks 1 file.*weights.onnx.data"):
        OrtRunner(artifact_copy)


def test_every_modified_file_is_refused(artifact_copy):
    files = json.loads((artifact_copy / "manifest.json").read_text())["files"]
    assert {"prefill.onnx", "decode.onnx", "weights.onnx.data", "genai_config.json", "tokenizer.json"} <= set(files)
    for name in files:
        original = (artifact_copy / name).read_bytes()
        changed = bytearray(original)
        changed[len(changed) // 2] ^= 1
        (artifact_copy / name).write_bytes(bytes(changed))
        with pytest.raises(ArtifactError, match=f"sha256 of {name} does not match"):
            OrtRunner(artifact_copy)
        (artifact_copy / name).write_bytes(original)


def test_the_hash_covers_every_byte_of_a_file_larger_than_one_read(tmp_path):
    # The tiny artifact's files are all smaller than the 1 MiB blocks sha256_file reads, so the test above
    # cannot see a hash that stops after the first block; a real weights file is hundreds of MB.
    import hashlib

    from exporter.artifact.manifest import sha256_file

    data = bytearray(np.random.default_rng(0).bytes(3 * (1 << 20) + 17))
    path = tmp_path / "weights.onnx.data"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    data[-1] ^= 1  # past the first read
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_unreadable_manifest_is_refused(artifact_copy):
    (artifact_copy / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="unreadable"):
        OrtRunner(artifact_copy)
    data = {"format": "something-else", "format_version": 1}
    (artifact_copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="re-export"):
        OrtRunner(artifact_copy)


def test_prefill_session_reads_the_weights_in_place(runner):
    weights = runner._weights
    table = runner.manifest.initializers["prefill.onnx"]
    assert len(weights._values) == len({(e["offset"], e["length"], e["dtype"], tuple(e["shape"])) for e in table})
    base = weights._file.ctypes.data
    for (offset, *_), value in weights._values.items():
        assert value.data_ptr() == base + offset  # a view into the one mapping, not a copy
    assert runner.prefill_session.get_session_options().get_session_config_entry("session.disable_prepacking") == "1"


def test_generation_runs_the_prompt_through_decode_like_prefill(runner):
    ids = np.array([[5, 9, 100, 3], [7, 7, 8, 9]], dtype=np.int64)
    mask = np.ones_like(ids)
    started = runner.start(ids, mask, np.tile(np.arange(4), (2, 1)))
    prefilled = runner.prefill(
        {"input_ids": ids, "attention_mask": mask, "position_ids": np.tile(np.arange(4), (2, 1)), "labels": ids}
    )
    np.testing.assert_array_equal(started, prefilled["logits"][:, -1])  # as decode(past 0) == prefill


def test_a_prompt_read_in_chunks_gives_the_logits_and_cache_of_one_call(artifact_fp32):
    """Chunks of 3 (a last one of 2) on a left-padded batch, against the whole prompt in one call."""
    from exporter.runtime.runner import position_ids_from_mask
    from exporter.runtime.settings import SessionSettings

    whole = OrtRunner(artifact_fp32, settings=SessionSettings(prompt_chunk=0))
    chunked = OrtRunner(artifact_fp32, settings=SessionSettings(prompt_chunk=3))
    ids = np.array([[0, 0, 0, 5, 9, 100, 3, 8, 2, 40, 41], [7, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]], dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    positions = position_ids_from_mask(mask)
    np.testing.assert_array_equal(chunked.start(ids, mask, positions), whole.start(ids, mask, positions))
    assert len(whole.cache) == 2 * whole.manifest.cache.num_layers
    chunked_arrays = chunked.cache_arrays()
    for name, value in whole.cache_arrays().items():
        np.testing.assert_array_equal(chunked_arrays[name], value, err_msg=name)
    step = (
        np.array([[4], [6]], dtype=np.int64),
        np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1),
        positions[:, -1:] + 1,
    )
    np.testing.assert_array_equal(chunked.step(*step), whole.step(*step))


def test_the_runner_leaves_other_sessions_of_the_process_working(artifact_fp32, tiny_model, runner):
    """Per-session pools by default: a plain onnxruntime session (another library's, e.g. Optimum's) still
    loads beside our runners. The shared pool is opt-in; once it exists onnxruntime refuses per-session pools,
    so that is checked in a fresh process."""
    import subprocess
    import sys

    import onnxruntime as ort

    ort.InferenceSession(str(artifact_fp32 / "decode.onnx"))
    script = (
        "import sys; from exporter.runtime.runner import OrtRunner, SessionSettings; "
        "from exporter.errors import InputError; from exporter.runtime.generation import generate_greedy; "
        "r = OrtRunner(sys.argv[1], settings=SessionSettings(shared_thread_pool=True, intra_op_threads=1)); "
        "print(generate_greedy(r, [3, 4], 6).new_ids)\n"
        "try:\n    OrtRunner(sys.argv[1])\nexcept InputError as e:\n    print(e)"
    )
    out = subprocess.run([sys.executable, "-c", script, str(artifact_fp32)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    tokens, refusal = out.stdout.strip().splitlines()
    assert tokens == str(reference_greedy(tiny_model, [3, 4], 6, None).ids)
    assert "shared thread pool" in refusal


def test_bad_session_settings_are_refused():
    from exporter.runtime.settings import SessionSettings

    with pytest.raises(InputError, match="optimization must be one of"):
        SessionSettings(optimization="max")
    for threads in (-2, 1025, 2.0):
        with pytest.raises(
            InputError,
            match=r"\(`intra_op_threads`\) must be an integer from 0 \(one per "
            r"core\) to 1024, got",
        ):
            SessionSettings(intra_op_threads=threads)
    for chunk in (-1, 1.5):
        with pytest.raises(InputError, match="prompt_chunk must be an integer >= 0"):
            SessionSettings(prompt_chunk=chunk)


def test_session_flags_must_be_bools_and_the_folder_a_path(artifact_fp32, tmp_path):
    """A string flag such as "no" is truthy: refused, not read as True; a str folder is a path (no AttributeError at
    load)."""
    from exporter.runtime.settings import SessionSettings

    for name in ("prepack_weights", "shared_thread_pool", "float16_weights_cast_once"):
        for value in ("no", "false", "False", 0, None):
            with pytest.raises(InputError, match=f"{name} must be True or False, got"):
                SessionSettings(**{name: value})
    with pytest.raises(InputError, match="optimized_model_dir must be a folder path"):
        SessionSettings(optimized_model_dir=3)
    settings = SessionSettings(optimized_model_dir=str(tmp_path / "optimized"))
    assert settings.optimized_model_dir == tmp_path / "optimized"
    OrtRunner(artifact_fp32, settings=settings)
    assert (tmp_path / "optimized" / "decode.optimized.onnx").is_file()


@pytest.mark.parametrize("prompt_chunk", [0, 128])
def test_an_empty_prompt_is_refused_by_start(artifact_fp32, prompt_chunk):
    """An InputError, whatever the prompt_chunk: not UnboundLocalError (no chunk runs), nor range()'s step-zero
    ValueError with prompt_chunk=0."""
    from exporter.runtime.settings import SessionSettings

    runner = OrtRunner(artifact_fp32, settings=SessionSettings(prompt_chunk=prompt_chunk))
    empty = np.zeros((1, 0), dtype=np.int64)
    with pytest.raises(InputError, match=r"at least one prompt of at least one token, got input_ids of shape \(1, 0\)"):
        runner.start(empty, empty, empty)


def test_a_manifest_of_another_format_or_a_later_version_is_refused(artifact_copy):
    """A reader of v1 cannot know what a later format changed: it refuses it by name, not reads it as v1."""
    from helpers import edit_manifest

    for version in (2, 0):
        edit_manifest(artifact_copy, lambda manifest: manifest.update(format_version=version))
        with pytest.raises(
            ArtifactError,
            match=rf"'minimind-onnx-artifact' v{version}, expected "
            r"'minimind-onnx-artifact' v1; re-export",
        ):
            OrtRunner(artifact_copy)
    edit_manifest(artifact_copy, lambda manifest: manifest.update(format_version=1, format="other-artifact"))
    with pytest.raises(ArtifactError, match=r"format is 'other-artifact' v1, expected 'minimind-onnx-artifact'"):
        OrtRunner(artifact_copy)  # another tool's manifest of the same version number, otherwise complete


@pytest.mark.parametrize(
    "source, message",
    [({"preset": "minimind-3-tiny", "seed": 0}, "model.source.kind is None"), ({"kind": 5}, "model.source.kind is 5")],
)
def test_a_model_source_without_a_kind_is_refused(artifact_copy, source, message):
    """verify reads model.source.kind first, to know whether it can rebuild the model."""
    from helpers import edit_manifest

    from exporter.artifact.manifest import load_manifest

    edit_manifest(artifact_copy, lambda manifest: manifest["model"].update(source=source))
    with pytest.raises(ArtifactError, match=rf"inconsistent: {message}, expected str"):
        load_manifest(artifact_copy)


def test_a_weights_table_entry_running_past_the_end_of_the_weights_file_is_refused(artifact_copy):
    """Each entry must end within the file (offset + length <= bytes), not merely start within it: the runner
    maps the entries itself, and one past the end would read beyond the mapping."""
    from helpers import edit_manifest

    from exporter.artifact.manifest import load_manifest

    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    end = max(e["offset"] + e["length"] for e in manifest["weights"]["initializers"]["prefill.onnx"])
    edit_manifest(artifact_copy, lambda m: m["files"]["weights.onnx.data"].update(bytes=end - 1))
    with pytest.raises(ArtifactError, match="weights.initializers of .* does not lie within weights.onnx.data"):
        load_manifest(artifact_copy)


@pytest.mark.parametrize("name", ["decode.onnx", "prefill.onnx", "weights.onnx.data"])
def test_a_manifest_whose_files_leave_out_a_graph_or_the_weights_is_refused(artifact_copy, name):
    """Unlisted, the file would be read unchecked by any hash (or, the weights, fail with a KeyError)."""
    from helpers import edit_manifest

    from exporter.artifact.manifest import load_manifest

    edit_manifest(artifact_copy, lambda manifest: manifest["files"].pop(name))
    with pytest.raises(ArtifactError, match=rf"inconsistent: {re.escape(name)} not listed in files"):
        load_manifest(artifact_copy)


@pytest.mark.parametrize("kind", ["input", "output"])
def test_a_graph_with_a_renamed_input_or_output_is_not_the_graph_its_manifest_describes(artifact_fp32, tmp_path, kind):
    """Same number of inputs and outputs, one name changed: feeding by name would fail later, or a consumer would
    read the wrong tensor."""
    import onnx

    from exporter.artifact.folder import graph_state
    from exporter.artifact.manifest import read_manifest

    manifest = read_manifest(artifact_fp32)
    model = onnx.load(str(artifact_fp32 / "decode.onnx"), load_external_data=False)
    value = (model.graph.input if kind == "input" else model.graph.output)[0]
    for node in model.graph.node:  # keep the graph well formed: its users follow the new name
        for names in (node.input, node.output):
            for i, used in enumerate(names):
                if used == value.name:
                    names[i] = "renamed"
    value.name = "renamed"
    onnx.save(model, str(tmp_path / "decode.onnx"))
    state = graph_state(tmp_path / "decode.onnx", manifest, manifest.decode)
    assert state.startswith(f"has the {kind}s [") and "renamed" in state, state
    assert graph_state(artifact_fp32 / "decode.onnx", manifest, manifest.decode) == "ok"


def test_session_settings_reach_both_sessions(artifact_fp32):
    """Threads, optimisation level and prepacking as asked; the prefill session's threads do not spin (they
    took the cores from the decode step after it), decode's do; defaults: decode prepacks, prefill never does
    (it reads the shared mapping in place)."""
    from exporter.runtime.settings import SessionSettings

    spin, prepack = "session.intra_op.allow_spinning", "session.disable_prepacking"
    default = OrtRunner(artifact_fp32)
    assert config_entry(default.decode_session, prepack) is None
    assert config_entry(default.prefill_session, prepack) == "1"
    runner = OrtRunner(
        artifact_fp32, settings=SessionSettings(intra_op_threads=1, optimization="basic", prepack_weights=False)
    )
    for session in (runner.decode_session, runner.prefill_session):
        options = session.get_session_options()
        assert options.intra_op_num_threads == 1
        assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        assert not options.enable_mem_pattern  # never reused as the cache grows; it cost 69 MB of peak RSS
        assert config_entry(session, prepack) == "1"
    assert config_entry(runner.prefill_session, spin) == "0"
    assert config_entry(runner.decode_session, spin) is None


def _float32_elements(graph: Path) -> int:
    model = onnx.load(graph, load_external_data=False)
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)


def test_checking_sessions_of_a_float16_artifact_keep_no_float32_copy_of_its_weights(artifact_fp16, tmp_path):
    """The CPU provider computes a float16 graph in float32. By default each session folds a float32 copy of every
    weight into its graph at load; the sessions that check an artifact (checking_settings, several at once) cast in
    each call instead, which the graphs onnxruntime optimised show, and compute the same values: both run the same
    float32 products of the same weights, in another order, and differ by float32 rounding carried through the
    graph's float16 activations, which the float16 profile (float16 against the float32 reference) bounds."""
    from exporter.runtime.settings import SessionSettings, checking_settings
    from exporter.tolerances.parity import profile_for
    from exporter.verify.metrics import compare_outputs

    artifact = Artifact.open(artifact_fp16)
    weights = sum(int(np.prod(e["shape"])) for e in artifact.manifest.initializers["prefill.onnx"])
    ids = np.array([[5, 9, 100, 3]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None]}
    outputs = {}
    for name, settings in (("once", SessionSettings()), ("per call", checking_settings(artifact.manifest))):
        saved = tmp_path / name
        runner = OrtRunner(artifact, settings=dataclasses.replace(settings, optimized_model_dir=saved))
        outputs[name] = (runner.prefill({**feeds, "labels": ids}), runner.decode({**feeds, **runner.empty_past(1)}))
        folded = [_float32_elements(saved / f"{graph}.optimized.onnx") for graph in ("prefill", "decode")]
        if name == "once":
            assert min(folded) >= weights * 0.9, (folded, weights)
        else:
            assert max(folded) < weights * 0.01, (folded, weights)
    for call, (once, per_call) in enumerate(zip(outputs["once"], outputs["per call"])):
        for row in compare_outputs(f"call {call}", per_call, once, profile_for("float16"), np.ones_like(ids)):
            assert row.passed, row


def test_the_prefill_session_computes_with_the_shared_weights_it_is_given(artifact_fp32, tmp_path):
    """Given a SharedWeightMap, the session takes its weights from it (one mapping for the process), not from
    the graph's own external data: a map of zeroed weights gives zero logits where the file gives others."""
    import shutil

    from exporter.artifact.manifest import read_manifest
    from exporter.runtime.sessions import load_session
    from exporter.runtime.settings import SessionSettings, session_options
    from exporter.runtime.shared_weights import SharedWeightMap

    manifest = read_manifest(artifact_fp32)
    zeroed = shutil.copytree(artifact_fp32, tmp_path / "zeroed")
    (zeroed / "weights.onnx.data").write_bytes(bytes((zeroed / "weights.onnx.data").stat().st_size))
    ids = np.array([[5, 9, 100, 3]], dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None], "labels": ids}
    logits = {}
    for name, folder in (("file", artifact_fp32), ("zeroed", zeroed)):
        weights = SharedWeightMap(Artifact(folder, manifest))
        session = load_session(
            Artifact(artifact_fp32, manifest),
            manifest.prefill,
            session_options(SessionSettings(), "prefill.onnx", weights, spin=False),
            [CPU],
        )
        logits[name] = session.run(["logits"], feed)[0]
    assert np.abs(logits["file"]).max() > 0.01
    np.testing.assert_array_equal(logits["zeroed"], 0)


def test_a_weights_file_left_empty_maps_to_no_initializers(artifact_fp32, tmp_path):
    """A model whose every tensor stays inline in the graphs leaves weights.onnx.data empty (found by the property
    run: its smallest drawn config); mmap refuses an empty file, so the map must not ask for one."""
    import dataclasses
    import shutil

    from exporter.artifact.manifest import read_manifest
    from exporter.runtime.shared_weights import SharedWeightMap

    manifest = read_manifest(artifact_fp32)
    folder = shutil.copytree(artifact_fp32, tmp_path / "inline")
    (folder / manifest.weights_file).write_bytes(b"")
    inline = dataclasses.replace(manifest, initializers={file: [] for file in manifest.initializers})
    assert SharedWeightMap(Artifact(folder, inline)).initializers("prefill.onnx") == ([], [])


def _mappings_of(path) -> int:
    """How many mappings of the file this process holds (Linux's /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(str(path)))


def test_runners_given_one_weight_map_map_the_file_once(artifact_fp32):
    """Every session of a verification reads one SharedWeightMap, the prepacking decode.onnx's too: a mapping of the
    weights file is resident once per mapping, so each map of its own would add the weights' size to the process
    again. A runner without one maps the file itself (and its decode.onnx loads what it prepacks on its own)."""
    from exporter.runtime.shared_weights import SharedWeightMap

    artifact = Artifact.open(artifact_fp32)
    path = artifact.path(artifact.manifest.weights_file).resolve()
    shared = SharedWeightMap(artifact)
    before = _mappings_of(path)
    given = OrtRunner(artifact, weights=shared)
    added_given = _mappings_of(path) - before
    own = OrtRunner(artifact)
    added_own = _mappings_of(path) - before - added_given
    assert added_given == 0 and added_own >= 1, (added_given, added_own)
    assert config_entry(given.decode_session, "session.disable_prepacking") is None  # prepacked from the map
    ids = np.array([[5, 9, 100, 3]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None], "labels": ids}
    np.testing.assert_array_equal(given.prefill(feeds)["logits"], own.prefill(feeds)["logits"])
    step = {name: feeds[name] for name in ("input_ids", "attention_mask", "position_ids")} | own.empty_past(1)
    np.testing.assert_array_equal(given.decode(step)["logits"], own.decode(step)["logits"])  # both prepacked


def test_a_float32_artifact_is_checked_unprepacked_and_agrees_with_its_prepacked_decode(artifact_fp32):
    """Verification reads a float32 artifact's weights in place in every session (checking_settings), where
    generate and the consumers prepack decode.onnx: MLAS's two layouts of the same weights run the same float32
    products in another order, so their outputs differ by float32 rounding alone, which the float32 profile (ONNX
    Runtime against the float32 reference) bounds; a wrong packed layout would be off by the weights' scale."""
    from exporter.runtime.runner import presents_as_past
    from exporter.runtime.settings import checking_settings
    from exporter.runtime.shared_weights import SharedWeightMap
    from exporter.tolerances.parity import profile_for
    from exporter.verify.metrics import compare_outputs

    artifact = Artifact.open(artifact_fp32)
    shared = SharedWeightMap(artifact)
    checking = OrtRunner(artifact, settings=checking_settings(artifact.manifest), weights=shared)
    assert config_entry(checking.decode_session, "session.disable_prepacking") == "1"
    prepacked = OrtRunner(artifact, weights=shared)
    assert config_entry(prepacked.decode_session, "session.disable_prepacking") is None
    ids = np.array([[5, 9, 100, 3], [7, 1, 2, 8]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(4), (2, 1))}
    past = presents_as_past(artifact.manifest, checking.prefill({**feeds, "labels": ids}))
    step = {
        "input_ids": ids[:, :2],
        "attention_mask": np.ones((2, 6), np.int64),
        "position_ids": feeds["position_ids"][:, :2] + 4,
    }
    rows = compare_outputs(
        "decode",
        checking.decode({**step, **past}),
        prepacked.decode({**step, **past}),
        profile_for("float32"),
        step["attention_mask"],
    )
    assert rows and all(row.passed for row in rows), rows


def test_a_weight_map_of_another_artifact_is_refused(artifact_fp32, tmp_path):
    import shutil

    from exporter.runtime.shared_weights import SharedWeightMap

    other = Artifact.open(shutil.copytree(artifact_fp32, tmp_path / "copy"))
    with pytest.raises(InputError, match=r"weights must be a SharedWeightMap of .*\(`weights`\)"):
        OrtRunner(Artifact.open(artifact_fp32), weights=SharedWeightMap(other))
