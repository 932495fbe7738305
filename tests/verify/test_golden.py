"""Golden bundles: recorded with the model, replayed without torch, and refused when damaged, half saved,
of another format, or recorded from another artifact, dtype or token inputs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_one_line_error, perturb_weight, run_cli

from exporter.artifact.manifest import read_manifest, sha256_file
from exporter.errors import OutputPathError, ToolkitError
from exporter.tolerances.parity import Overrides
from exporter.verify.engine import verify_artifact
from exporter.verify.inputs import ParitySettings
from exporter.verify.references.golden.bundle import GoldenMismatch, recording_digest
from exporter.verify.references.golden.reading import load_bundle
from exporter.verify.references.golden.recording import RecordedReference
from exporter.verify.references.golden.writing import check_golden_destination, save_bundle
from exporter.verify.reports import format_verify


def test_golden_bundle_replays_without_torch_and_rejects_other_artifacts(full, artifact_fp32, artifact_copy):
    report, bundle = full
    code = textwrap.dedent(f"""
        import sys, json
        for blocked in ("torch", "onnxscript", "tokenizers", "safetensors", "onnxruntime_genai"):
            sys.modules[blocked] = None  # any import of it now fails: a replay needs none of them
        from exporter.verify.engine import verify_artifact
        golden = verify_artifact(
            {str(artifact_fp32)!r}, None, ["cpu"], golden={str(bundle)!r}, genai=False, transformers_js=False
        )
        alone = verify_artifact({str(artifact_fp32)!r}, None, ["cpu"])
        print(json.dumps([golden.passed, golden.reference, len(golden.reports[0].curve), len(golden.reports[0].sweep),
                          [[c.name, c.max_abs] for c in golden.reports[0].comparisons], alone.passed,
                          alone.reference, len(alone.invariants), len(alone.reports)]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    passed, reference, steps, sweep, rows, alone_passed, alone_reference, invariants, providers = json.loads(
        out.stdout.strip().splitlines()[-1]
    )
    assert passed and reference.startswith("golden bundle") and steps == 65 and sweep == 36
    # the same rows (the loss and the presents included) with the same numbers as against the model
    assert rows == [[c.name, c.max_abs] for c in report.reports[0].comparisons]
    assert alone_passed and alone_reference == "none" and invariants == 6 and providers == 0
    perturb_weight(artifact_copy, "model.layers.0.mlp.down_proj", 0.01)
    with pytest.raises(GoldenMismatch, match="weights.onnx.data"):
        verify_artifact(artifact_copy, None, ["cpu"], golden=bundle)


def test_a_damaged_or_half_saved_bundle_is_refused_as_damaged(full, artifact_fp32, tmp_path):
    manifest = read_manifest(artifact_fp32)

    def damaged(edit_arrays=None, edit_meta=None, rehash=True, edit_file=None):
        folder = tmp_path / f"bundle{len(list(tmp_path.iterdir()))}"
        shutil.copytree(full[1], folder)
        arrays = dict(np.load(folder / "arrays.npz"))
        if edit_arrays:
            edit_arrays(arrays)
            with open(folder / "arrays.npz", "wb") as f:
                np.savez(f, **arrays)
        if edit_file:
            edit_file(folder / "arrays.npz")
        meta = json.loads((folder / "golden.json").read_text())
        if rehash:
            meta["arrays_sha256"] = sha256_file(folder / "arrays.npz")
        if edit_meta:
            edit_meta(meta)
        if rehash:  # as a careful forger would: both hashes match, so what is checked is the content
            meta["recording_sha256"] = recording_digest(meta)
        (folder / "golden.json").write_text(json.dumps(meta))
        with pytest.raises(ToolkitError) as caught:
            load_bundle(folder, manifest)
        assert "is damaged" in str(caught.value)
        assert "re-record it with `golden_save`" in str(caught.value)
        return str(caught.value)

    def shift(arrays):
        arrays["0/out/logits"] = arrays["0/out/logits"] + 1

    # a save interrupted between its two files, or a value edited since: the arrays' hash differs
    assert "sha256 differs" in damaged(shift, rehash=False)
    # an edited greedy id, valid but not what the reference chose
    assert "greedy runs, settings or overrides in golden.json changed" in damaged(
        edit_meta=lambda m: m["greedy"][0]["ids"].__setitem__(5, 7), rehash=False
    )
    # the tolerance overrides the recording was judged with, which a replay applies: edited, left out or unreadable
    assert "overrides in golden.json changed" in damaged(
        edit_meta=lambda m: m.update(overrides={"logits.peak": 1}), rehash=False
    )
    assert "golden.json records no tolerance overrides, which a v4 bundle holds" in damaged(
        edit_meta=lambda m: m.pop("overrides"), rehash=False
    )
    assert "golden.json overrides logits.atol: 'loose' is not a number" in damaged(
        edit_meta=lambda m: m.update(overrides={"logits.atol": "loose"})
    )
    assert "golden.json overrides: 'logits' is no tolerance term" in damaged(
        edit_meta=lambda m: m.update(overrides={"logits": 1e-3})
    )
    assert "logits has shape" in damaged(lambda a: a.update({"0/out/logits": a["0/out/logits"][:, :, :7]}))
    assert "holds the outputs" in damaged(
        lambda a: a.pop("0/out/present.0.key"), lambda m: m["calls"][0]["outputs"].remove("present.0.key")
    )
    assert "settings must be integers" in damaged(edit_meta=lambda m: m["settings"].update(seed=-1))
    assert "outside the vocabulary" in damaged(edit_meta=lambda m: m["greedy"][0].update(ids=["1", "2"]))
    vocab = manifest.config.vocab_size  # one past the last id; a greedy run of no new tokens
    assert f"outside the vocabulary [0, {vocab})" in damaged(
        edit_meta=lambda m: m["greedy"][0]["ids"].__setitem__(0, vocab)
    )
    assert "or 0 new tokens" in damaged(edit_meta=lambda m: m["greedy"][0].update(max_new_tokens=0))
    # the module outputs a replay's probe reads: a value edited, a present cut or lost, a value of integers, the
    # token feeds cut or lost
    present, head, positions = "modules/out/present.1.key", "modules/out/lm_head", "modules/feed/position_ids"
    assert "sha256 differs" in damaged(lambda a: a.update({head: a[head] + 1}), rehash=False)
    assert "module outputs: present.1.key has shape" in damaged(lambda a: a.update({present: a[present][:, :, :5]}))
    assert "lack the presents ['present.1.key']" in damaged(lambda a: a.pop(present))
    assert "['lm_head'] hold no floating-point values" in damaged(lambda a: a.update({head: a[head].astype(int)}))
    assert "token feeds have shapes" in damaged(lambda a: a.update({positions: a[positions][:, :5]}))
    assert "KeyError: 'input_ids'" in damaged(lambda a: a.pop("modules/feed/input_ids"))

    # arrays.npz that is no archive at all: refused on its hash, or (hash forged) as no archive, never with numpy's
    # advice to load it unpickled
    garbage = damaged(edit_meta=None, rehash=False, edit_file=lambda f: f.write_bytes(b"PK not an archive"))
    assert "sha256 differs" in garbage and "pickle" not in garbage
    forged = damaged(edit_file=lambda f: f.write_bytes(b"\x80\x04 pickled"))
    assert "arrays.npz is no npz (zip) archive" in forged and "pickle" not in forged

    bundle = load_bundle(full[1], manifest)
    blocked = tmp_path / "blocked"
    (blocked / "arrays.npz").mkdir(parents=True)  # the swap into place fails
    with pytest.raises(OutputPathError, match="cannot write the golden bundle"):
        save_bundle(bundle.reference, blocked, manifest, bundle.settings, bundle.overrides, bundle.versions)
    assert [p.name for p in blocked.iterdir()] == ["arrays.npz"]  # no partial file left


def test_golden_save_over_another_artifacts_bundle_is_refused_and_over_its_own_re_records(
    full, artifact_fp32, artifact_fp16
):
    # --golden-save DIR never replaces a bundle recorded from another artifact.
    _, bundle = full
    before = (bundle / "golden.json").read_bytes()
    assert_one_line_error(
        run_cli("verify", artifact_fp16, "--golden-save", bundle, "-q"),
        2,
        f"--golden-save {bundle} holds a golden bundle recorded from another model "
        "(differs in dtype: bundle float32, artifact float16), which this save would replace; "
        "remove it or choose another folder",
    )
    assert (bundle / "golden.json").read_bytes() == before
    check_golden_destination(bundle, read_manifest(artifact_fp32))  # the bundle's own artifact: re-recorded


def test_an_interrupted_first_golden_save_leaves_a_folder_the_next_save_accepts(artifact_fp32, tmp_path, monkeypatch):
    folder = tmp_path / "golden"
    folder.mkdir()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("exporter.verify.references.golden.writing.np.savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_bundle(RecordedReference(), folder, read_manifest(artifact_fp32), ParitySettings(), Overrides(), {})
    assert list(folder.iterdir()) == []
    check_golden_destination(folder)  # an empty folder, not one that "holds no golden bundle"
    # the folders it made for the bundle are removed again: they stayed behind, empty
    with pytest.raises(KeyboardInterrupt):
        save_bundle(
            RecordedReference(),
            tmp_path / "new" / "golden",
            read_manifest(artifact_fp32),
            ParitySettings(),
            Overrides(),
            {},
        )
    assert list(tmp_path.iterdir()) == [folder]


def test_a_golden_save_interrupted_between_its_two_swaps_leaves_the_older_bundle_whole(
    full, artifact_fp32, tmp_path, monkeypatch
):
    """The new arrays swapped in, then a Ctrl-C before the index: the older bundle stays whole and readable, not
    refused as damaged ("sha256 differs")."""
    manifest = read_manifest(artifact_fp32)
    folder = shutil.copytree(full[1], tmp_path / "golden")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    replace = os.replace

    def ctrl_c_before_the_index(source, destination):
        if Path(destination).name == "golden.json":
            raise KeyboardInterrupt
        replace(source, destination)

    monkeypatch.setattr("exporter.verify.references.golden.writing.os.replace", ctrl_c_before_the_index)
    with pytest.raises(KeyboardInterrupt):
        save_bundle(RecordedReference(), folder, manifest, ParitySettings(), Overrides(), {})
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # and no hidden file left
    load_bundle(folder, manifest)


def test_a_second_golden_save_into_one_folder_waits_for_the_first(full, artifact_fp32, tmp_path):
    """Two saves into one bundle folder: their swaps interleaved could pair one's index with the other's arrays."""
    manifest = read_manifest(artifact_fp32)
    folder = shutil.copytree(full[1], tmp_path / "golden")
    bundle = load_bundle(folder, manifest)
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""if True:
        import time
        from pathlib import Path
        from exporter.artifact.paths import folder_lock
        with folder_lock(Path({str(folder)!r})):
            print("saving", flush=True)
            time.sleep(1)  # the other save, slowed down: it swaps in its index last
            Path({str(folder / "golden.json")!r}).write_text("theirs")
        """,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert other.stdout.readline() == "saving\n"
    save_bundle(bundle.reference, folder, manifest, bundle.settings, bundle.overrides, bundle.versions)
    assert other.wait() == 0
    load_bundle(folder, manifest)  # this save's index and arrays, together


def test_a_bundle_of_another_format_version_is_refused(full, artifact_fp32, tmp_path):
    # Version 3 recorded no overrides and other prefill labels; a later version is a later toolkit's.
    manifest = read_manifest(artifact_fp32)
    old = shutil.copytree(full[1], tmp_path / "v3")
    meta = json.loads((old / "golden.json").read_text())
    assert meta["format_version"] == 4 and meta["overrides"] == {}
    for version, way_out in (
        (3, "re-record it"),
        (5, "a later version of this toolkit wrote it: upgrade the toolkit, or re-record it"),
    ):
        meta["format_version"] = version
        (old / "golden.json").write_text(json.dumps(meta))
        with pytest.raises(
            ToolkitError,
            match=f"is format 'minimind-onnx-golden' v{version}, expected "
            f"'minimind-onnx-golden' v4; {way_out} with `golden_save`",
        ):
            load_bundle(old, manifest)


def test_a_golden_replay_runs_with_the_settings_it_was_recorded_with(artifact_fp32, tiny_model, tmp_path):
    # Recorded with another seed and without the sweep; replayed with the default settings given, which the
    # bundle's replace (the default seed draws other prompts, which the recording does not hold).
    recorded = ParitySettings(seed=7, decode_steps=1, greedy_tokens=3, sweep=False)
    bundle = tmp_path / "bundle"
    assert verify_artifact(
        artifact_fp32, tiny_model, ["cpu"], recorded, genai=False, transformers_js=False, golden_save=bundle
    ).passed
    replay = verify_artifact(artifact_fp32, None, ["cpu"], golden=bundle, genai=False, transformers_js=False)
    assert replay.passed, format_verify(replay)
    assert {k: replay.settings[k] for k in ("seed", "decode_steps", "greedy_tokens", "sweep")} == {
        "seed": 7,
        "decode_steps": 1,
        "greedy_tokens": 3,
        "sweep": False,
    }
    assert replay.reports[0].sweep == [] and len(replay.reports[0].curve) == 2


def test_a_replay_fed_other_tokens_than_recorded_is_a_mismatch_not_a_failure():
    """The module's promise: replayed outputs are only handed out for the token inputs they were recorded with;
    other inputs (a toolkit that draws its prompts differently, say) must not read as a parity failure."""
    from exporter.verify.references.golden.recording import RecordedReference

    ids = np.array([[5, 9, 100]])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(3)[None]}
    recorded = RecordedReference(None, [("prefill", feeds, {"logits": np.zeros((1, 3, 4), np.float32)})])
    assert recorded.prefill(feeds)["logits"].shape == (1, 3, 4)
    for changed in ({"input_ids": ids + 1}, {"attention_mask": np.array([[0, 1, 1]])}):
        recorded.rewind()
        with pytest.raises(GoldenMismatch, match="call 0 \\(prefill\\) does not match the recording"):
            recorded.prefill({**feeds, **changed})
    labelled = RecordedReference(None, [("prefill", {**feeds, "labels": ids}, {"logits": np.zeros((1, 3, 4))})])
    with pytest.raises(GoldenMismatch, match="call 0 \\(prefill\\) does not match the recording"):
        labelled.prefill(feeds)  # recorded with labels (the loss), replayed without: other inputs
    recorded.rewind()
    with pytest.raises(GoldenMismatch, match="call 0 \\(decode\\) does not match"):
        recorded.decode(feeds)
    assert recorded.module_outputs(feeds) is None  # none recorded: the probe says so
    norm = {"model.norm": np.ones((1, 3, 4), np.float32)}
    probed = RecordedReference(None, module_outputs={"prefill": (feeds, norm)})
    assert probed.module_outputs(feeds)["model.norm"].shape == (1, 3, 4)
    with pytest.raises(GoldenMismatch, match="module outputs were recorded for other inputs"):
        probed.module_outputs({**feeds, "input_ids": ids + 1})
    # a bundle keeps one decode call's: another decode call (a replay failing at another step) is not probed
    step = {"input_ids": ids[:, :1], "attention_mask": np.ones((1, 4), np.int64), "position_ids": np.array([[3]])}
    assert probed.module_outputs(step, "decode") is None
    probed.recorded_module_outputs["decode"] = (step, {"model.norm": np.ones((1, 1, 4), np.float32)})
    assert probed.module_outputs(step, "decode")["model.norm"].shape == (1, 1, 4)
    assert probed.module_outputs({**step, "input_ids": ids[:, 1:2]}, "decode") is None


def test_a_recorded_decode_call_holds_its_new_positions_alone():
    """A decode call's presents are recorded as their new positions in arrays of their own: a view of them would
    keep each call's whole present alive, and with a text read whole the memory grows with its length squared."""
    import torch

    from exporter.verify.references.golden.recording import RecordedReference

    class Backing:
        model = torch.nn.Module()

        def decode(self, feeds):
            past = feeds["past_key_values.0.key"]
            new = np.ones((1, 2, 1, 8), np.float32)
            return {"logits": np.zeros((1, 1, 4), np.float32), "present.0.key": np.concatenate([past, new], axis=2)}

    past = np.zeros((1, 2, 100, 8), np.float32)
    ids = np.array([[7]])
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, 101), np.int64), "position_ids": np.array([[100]])}
    recorded = RecordedReference(Backing())
    assert recorded.decode({**feeds, "past_key_values.0.key": past})["present.0.key"].shape == (1, 2, 101, 8)
    [(_, _, stored)] = recorded.calls
    present = stored["present.0.key"]
    assert present.shape == (1, 2, 1, 8) and present.base is None and present.nbytes == 64


def test_golden_bundle_of_another_dtype_is_a_mismatch_not_a_failure(full, artifact_fp16, artifact_fp32, tmp_path):
    with pytest.raises(GoldenMismatch, match="another model \\(differs in dtype: bundle float32, artifact float16\\)"):
        verify_artifact(artifact_fp16, None, ["cpu"], golden=full[1])
    # another config of the same dtype: the dtype is not named (it read "bundle float32, artifact float32")
    other = shutil.copytree(full[1], tmp_path / "other")
    meta = json.loads((other / "golden.json").read_text())
    meta["artifact"]["config"]["rms_norm_eps"] = 1e-5
    (other / "golden.json").write_text(json.dumps(meta))
    with pytest.raises(GoldenMismatch) as caught:
        load_bundle(other, read_manifest(artifact_fp32))
    assert "belongs to another model (differs in rms_norm_eps); " in str(caught.value)
    # a bundle of another family differed in some 25 fields, every one listed; the first five and a count now
    meta["artifact"]["config"] = {f"field_{i:02d}": i for i in range(8)}
    (other / "golden.json").write_text(json.dumps(meta))
    with pytest.raises(GoldenMismatch) as caught:
        load_bundle(other, read_manifest(artifact_fp32))
    assert re.search(
        r"\(differs in [34]\d config fields, among them attn_implementation, bos_token_id, dropout, "
        r"eos_token_id, field_00\); verify against",
        str(caught.value),
    ), caught.value
    manifest = read_manifest(artifact_fp32)  # a graph re-exported alone (its weights unchanged) is another export
    for graph in (manifest.prefill.file, manifest.decode.file):
        meta = json.loads((full[1] / "golden.json").read_text())
        meta["artifact"]["sha256"][graph] = "0" * 64
        (other / "golden.json").write_text(json.dumps(meta))
        with pytest.raises(GoldenMismatch, match=f"was recorded from another export: {graph} differ"):
            load_bundle(other, manifest)
