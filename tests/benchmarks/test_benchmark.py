"""The runtime benchmark script (benchmarks/runtime.py): its arithmetic, and one short run end to end.

The figures themselves are measured by the script, not asserted here; these tests keep the script
working as the runtime changes under it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import benchmark_script, edit_manifest

from exporter.runtime.providers import cuda_unusable

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "runtime.py"


@pytest.fixture(scope="module")
def benchmark():
    return benchmark_script("runtime")


def test_ratios_are_medians_of_same_round_ratios_with_their_quartiles(benchmark):
    # Per-round ratios 4, 1, 2, 5, 3: median 3, inclusive quartiles 2 and 4. The medians of the two
    # sides (60 / 30 = 2) would give another figure: the ratio is taken round by round.
    median, quartiles = benchmark.ratio_summary([40, 10, 60, 50, 90], [10, 10, 30, 10, 30])
    assert median == 3 and quartiles == [2, 4]
    assert benchmark.ratio_summary([3.0], [2.0]) == (1.5, [1.5, 1.5])


def test_bad_arguments_and_folders_are_refused_before_any_worker_starts(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )

    for args, fragment in (
        (["--rounds", "0"], "--rounds: must be 1 or more, got 0"),
        (["--threads", "-1"], "--threads: must be 0 or more, got -1"),
        # onnxruntime's bound: refused here, not by a worker's traceback and exit 1
        (["--threads", "1025"], "--threads: must be 1024 or less, got 1025"),
    ):
        out = run(*args)
        assert out.returncode == 2 and fragment in out.stderr, out.stderr[-2000:]
        out = run(*args, "--json")  # a usage error is a JSON object too
        error = json.loads(out.stdout)["error"]
        assert out.returncode == 2 and error["kind"] == "usage" and fragment.split(": ", 1)[1] in error["message"]
    out = run("--artifact", tmp_path / "typo", "--json")  # a typo is not exported to: only the default folder is
    assert out.returncode == 2 and not (tmp_path / "typo").exists(), out.stderr[-2000:]
    assert json.loads(out.stdout) == {
        "error": {
            "kind": "input",
            "message": f"{tmp_path / 'typo'} does not exist; pass an artifact folder written by 'export-onnx export'",
        },
        "exit_code": 2,
    }
    if cuda_unusable() is not None:  # a CUDA the benchmark cannot use is refused in one line, not by a worker
        out = run("--artifact", tmp_path / "typo", "--provider", "cuda")
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
        assert "CUDAExecutionProvider cannot run here" in out.stderr


COMMITTED_RESULTS = SCRIPT.parent / "RESULTS.md"


def _state(path: Path):
    """A file's bytes and modification time, or None where it is absent."""
    return (path.read_bytes(), path.stat().st_mtime_ns) if path.exists() else None


def test_a_short_run_on_a_tiny_artifact_reports_every_figure(artifact_fp32, tmp_path):
    committed = _state(COMMITTED_RESULTS)
    results = tmp_path / "RESULTS.md"
    command = [sys.executable, str(SCRIPT), "--artifact", str(artifact_fp32), "--rounds", "2", "--json"]
    out = subprocess.run([*command, "--results", str(results)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _state(COMMITTED_RESULTS) == committed  # a test run never replaces the committed results
    report = json.loads(out.stdout)
    assert report["results_file"] == str(results)
    _assert_results_file(results.read_text(), report)
    for side in ("onnxruntime", "pytorch"):
        figures = report[side]
        assert figures["prefill_128_ms"] > 0 and figures["peak_rss_mb"] > 0
        assert "prefill_512_ms" not in figures  # the tiny model has 256 positions: only the prompts that fit
        assert figures["decode_tokens_per_s"] > 0
    ratios, quartiles = report["ratios"], report["ratio_quartiles"]
    assert set(quartiles) >= {"prefill_128", "decode", "decode_step_to_floor"} and "prefill_512" not in quartiles
    for name, (q1, q3) in quartiles.items():
        assert q1 <= ratios[name] <= q3, name
    floor = report["floor"]
    assert "floor_note" not in report  # a dense model reads every weight each step
    assert floor["weight_mb"] == (artifact_fp32 / "weights.onnx.data").stat().st_size / 1e6
    assert floor["read_gb_per_s"] > 0 and floor["floor_step_ms"] > 0
    genai_installed = importlib.util.find_spec("onnxruntime_genai") is not None
    assert (report["onnxruntime_genai"] is not None) == genai_installed
    if genai_installed:
        genai = report["onnxruntime_genai"]
        # The tiny model's context (256) admits the 128-token prompt only, on every side.
        assert genai["prefill_128_ms"] > 0 and "prefill_512_ms" not in genai and genai["decode_tokens_per_s"] > 0
        assert {"prefill_128_ours_to_genai", "ours_to_genai"} <= set(quartiles)
    for sessions in (report["sessions"], report["sessions_shared_pool"]):
        assert sessions["loaded_peak_rss_mb"] <= sessions["peak_rss_with_prefill_graph_run_mb"]
        assert all(sessions[f"decode_step_{when}_ms"] > 0 for when in ("after_prefill", "after_pause", "in_a_row"))


def test_the_floor_is_flagged_where_a_step_reads_only_some_weights(benchmark):
    from reference import get_preset

    assert "not a lower bound" in benchmark.floor_note(get_preset("minimind-3-moe-tiny"))
    assert benchmark.floor_note(get_preset("minimind-3-tiny")) is None
    assert benchmark.floor_note(get_preset("teaching-gpt-tiny")) is None


def test_a_model_without_room_for_the_decode_run_is_refused_before_any_worker_starts(
    benchmark, artifact_fp32, monkeypatch
):
    # A model with fewer positions than the decode run needs is refused before the workers start, not by each
    # worker's warm-up.
    from exporter.errors import InputError

    monkeypatch.setattr(benchmark, "DECODE_STEPS", 300)  # the tiny model has 256 positions
    with pytest.raises(InputError, match="the decode run needs 317 positions .* the model has 256"):
        benchmark.ensure_artifact(artifact_fp32)


def test_pytorch_runs_in_the_artifacts_precision(benchmark, artifact_fp16, monkeypatch):
    import torch

    import reference

    original, built = reference.build_model, []

    def build_model(*args):
        built.append(original(*args))
        return built[-1]

    monkeypatch.setattr(reference, "build_model", build_model)
    benchmark.torch_tasks(artifact_fp16, 0, "cpu")  # 0: torch's threads untouched for later tests
    assert next(built[0].parameters()).dtype == torch.float16


def test_an_artifact_whose_reference_cannot_be_rebuilt_is_refused_before_any_worker_starts(
    byo_artifact, minimind2_artifact, tmp_path
):
    # Refused in one line before any worker starts, not by the PyTorch worker's traceback.
    gone = shutil.copytree(minimind2_artifact, tmp_path / "gone")
    edit_manifest(gone, lambda m: m["model"]["source"].update(path=str(tmp_path / "moved.pth")))
    # The way out it names is the benchmark's own, not verify's --golden DIR, which the benchmark does not have.
    for folder, fragment in (
        (
            byo_artifact,
            "the weights came from a custom source this toolkit cannot rebuild; "
            "benchmark an artifact export-onnx exported",
        ),
        (gone, f"its checkpoint {tmp_path / 'moved.pth'} is gone; restore it or re-export"),
    ):
        out = subprocess.run(
            [sys.executable, str(SCRIPT), "--artifact", str(folder), "--rounds", "1", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and fragment in out.stderr, out.stderr[-2000:]
        assert "--golden" not in out.stderr
        error = json.loads(out.stdout)
        assert error["exit_code"] == 2 and error["error"]["kind"] == "input" and fragment in error["error"]["message"]


def test_pytorch_runs_the_checkpoint_an_artifact_was_exported_from(
    benchmark, minimind2_artifact, minimind2_checkpoint, monkeypatch
):
    # The PyTorch side times the model the artifact's source records, not seeded random weights.
    import torch

    import reference.checkpoints

    original, loaded = reference.checkpoints.load_checkpoint, []

    def load_checkpoint(*args, **kwargs):
        loaded.append(original(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(reference.checkpoints, "load_checkpoint", load_checkpoint)
    benchmark.torch_tasks(minimind2_artifact, 0, "cpu")
    assert len(loaded) == 1
    weights = loaded[0][0].state_dict()
    for name, tensor in torch.load(minimind2_checkpoint).items():  # float16 values, exact in float32
        assert torch.equal(weights[name], tensor.float()), name


def test_an_interrupt_stops_the_workers_quietly_and_says_so_in_one_line(artifact_fp32):
    # Ctrl-C reaches the whole process group: one line, the JSON error under --json and 130, not a KeyboardInterrupt
    # traceback per worker.
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--artifact", str(artifact_fp32), "--rounds", "50", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # as at a terminal, were pytest started with `&`: Python keeps an ignored SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 120
    while len(workers := children.read_text().split()) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(workers) >= 3, "the workers did not start"
    time.sleep(2)  # the workers are importing and warming up
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and stderr.splitlines() == ["interrupted (SIGINT)"], stderr[-2000:]
    assert json.loads(stdout) == {"error": {"kind": "interrupted", "message": "interrupted (SIGINT)"}, "exit_code": 130}
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]  # stopped, not left behind


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="onnxruntime-genai not installed")
def test_genai_gets_the_thread_count_of_every_side(benchmark, artifact_fp32, monkeypatch):
    import exporter.runtime.genai
    from exporter.runtime.genai import GenaiGenerator

    asked = []

    class Recording(GenaiGenerator):
        def __init__(self, artifact, threads=0):
            asked.append(threads)
            super().__init__(artifact, threads)

    monkeypatch.setattr(exporter.runtime.genai, "GenaiGenerator", Recording)
    benchmark.genai_tasks(artifact_fp32, 1)
    assert asked == [1]
    # The overlay is one onnxruntime-genai accepts, and the model generates as with the file's own count.
    assert GenaiGenerator(artifact_fp32, threads=1).greedy([5, 6, 7], 4) == GenaiGenerator(artifact_fp32).greedy(
        [5, 6, 7], 4
    )


def test_every_ratio_is_taken_in_its_stated_direction(benchmark):
    # One round of made-up figures: each ratio > 1 means ours is better (faster, smaller); the floor
    # ratio is our decode step over the floor's step.
    figures = {
        "onnxruntime": {"prefill 128": [100.0], "decode": [60.0]},
        "pytorch": {"prefill 128": [150.0], "decode": [30.0]},
        "genai": {"prefill 128": [120.0], "decode": [50.0]},
        "bandwidth": {"bandwidth": [10.0]},
    }
    report = benchmark.summarise(
        figures, {"onnxruntime": 200.0, "pytorch": 300.0, "genai": 400.0, "bandwidth": 1.0}, 150_000_000
    )
    ratios = report["ratios"]
    assert report["floor"]["floor_step_ms"] == pytest.approx(15.0)  # 150 MB at 10 GB/s
    assert ratios["decode_step_to_floor"] == pytest.approx((1000 / 60) / 15.0)
    assert ratios["prefill_128"] == 1.5 and ratios["decode"] == 2.0 and ratios["peak_rss"] == 1.5
    assert ratios["prefill_128_ours_to_genai"] == 1.2 and ratios["ours_to_genai"] == 1.2


def test_a_usage_error_is_one_line_and_json_under_an_abbreviated_flag(tmp_path):
    # One line, as the CLI prints, not argparse's usage too; --js, which argparse takes for --json, gets a JSON error
    # object on a usage error as on a success.
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "0", "--js"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert out.stderr.startswith("error: argument --rounds: must be 1 or more, got 0 (see ")
    error = json.loads(out.stdout)["error"]
    assert error == {"kind": "usage", "message": "argument --rounds: must be 1 or more, got 0"}


def test_an_interrupt_before_any_worker_starts_is_one_line_too(benchmark, monkeypatch, capsys):
    # Ctrl-C during the imports main runs first is one line, 130 and the JSON error, not a KeyboardInterrupt
    # traceback; writing that error imports nothing the interrupted import left half done.
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(benchmark, "run", interrupted)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--json"])
    for name in ("onnx", "numpy", "exporter.verify.reports"):
        monkeypatch.setitem(sys.modules, name, None)  # as unusable as an import an interrupt cut short
    with pytest.raises(SystemExit) as stopped:
        benchmark.main()
    assert stopped.value.code == 130
    out, err = capsys.readouterr()
    assert err == "interrupted (SIGINT)\n"
    assert json.loads(out) == {"error": {"kind": "interrupted", "message": "interrupted (SIGINT)"}, "exit_code": 130}


def test_an_interrupt_during_a_one_shot_worker_stops_it_and_waits_for_it(benchmark, tmp_path, monkeypatch):
    # A Ctrl-C stops the sessions worker and waits for it: no zombie is left behind.
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(benchmark, "__file__", str(sleeper))  # the worker: a process still running
    started = []

    class Recording(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.pid)

    monkeypatch.setattr(subprocess, "Popen", Recording)

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            benchmark.run_worker(["--worker", "sessions"])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert len(started) == 1 and not Path(f"/proc/{started[0]}").exists()


def test_a_folder_that_is_no_artifact_or_a_damaged_one_is_refused_before_any_worker_starts(artifact_fp32, tmp_path):
    (tmp_path / "notes").mkdir()
    damaged = shutil.copytree(artifact_fp32, tmp_path / "damaged")
    weights = damaged / "weights.onnx.data"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\1")
    for folder, fragment in (
        (tmp_path / "notes", "has no manifest.json; it is not an artifact folder"),
        (damaged, "sha256 of weights.onnx.data does not match the manifest"),
    ):
        out = subprocess.run(
            [sys.executable, str(SCRIPT), "--artifact", str(folder), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and fragment in out.stderr, out.stderr[-2000:]
        error = json.loads(out.stdout)
        assert error["exit_code"] == 2 and error["error"]["kind"] == "input" and fragment in error["error"]["message"]


def test_a_worker_that_fails_stops_the_others_and_exits_1(artifact_copy, tmp_path):
    # A private copy: the workers left behind are found by its path, which no test running beside this one uses.
    # The PyTorch worker fails as it starts (a sitecustomize that only it runs into); README: exit 1, its error
    # on stderr, the other workers stopped, and under --json the error object with kind "worker".
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nif sys.argv[1:3] == ['--worker', 'torch']:\n    raise SystemExit('torch worker broken')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--artifact", str(artifact_copy), "--rounds", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 1 and "torch worker broken" in out.stderr, out.stderr[-2000:]
    assert out.stderr.endswith("error: benchmark worker pytorch failed to start (its error is above)\n")
    assert json.loads(out.stdout) == {
        "error": {"kind": "worker", "message": "benchmark worker pytorch failed to start (its error is above)"},
        "exit_code": 1,
    }
    left = [
        cmdline
        for cmdline in Path("/proc").glob("[0-9]*/cmdline")
        if str(artifact_copy).encode() in _read(cmdline) and b"--worker" in _read(cmdline)
    ]
    assert not left


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a process that ended meanwhile
        return b""


def _made_up_report(benchmark, rounds: int) -> dict:
    """A report as measure() builds it, from one round of made-up figures (no worker runs)."""
    figures = {
        "onnxruntime": {"prefill 128": [2.0], "decode": [6000.0]},
        "pytorch": {"prefill 128": [3.0], "decode": [15.0]},
        "bandwidth": {"bandwidth": [10.0]},
    }
    report = benchmark.summarise(figures, {"onnxruntime": 80.0, "pytorch": 260.0, "bandwidth": 1.0}, 600_000)
    sessions = {
        "loaded_peak_rss_mb": 77.0,
        "decode_step_after_prefill_ms": 0.2,
        "decode_step_in_a_row_ms": 0.2,
        "decode_step_after_pause_ms": 0.2,
        "peak_rss_with_prefill_graph_run_mb": 82.0,
    }
    report.update(
        artifact="a", provider="cpu", threads=0, rounds=rounds, sessions=sessions, sessions_shared_pool=sessions
    )
    return report


def test_the_table_keeps_its_columns_apart_and_counts_one_round_as_one(benchmark):
    # A wide ratio (400x) stays apart from its quartiles ("400.00x 400.00-400.00", not "400.00x400.00-400.00"), and
    # --rounds 1 reads "(1 round, in turns)".
    table = benchmark.format_table(_made_up_report(benchmark, rounds=1))
    decode = next(line for line in table.splitlines() if line.startswith("decode tokens/s"))
    assert decode.split()[-2:] == ["400.00x", "400.00-400.00"], decode
    assert "(1 round, in turns)" in table
    assert "(3 rounds, in turns)" in benchmark.format_table(_made_up_report(benchmark, rounds=3))


def test_a_prefill_length_the_model_has_no_room_for_is_said_to_be_skipped(benchmark, artifact_fp32, monkeypatch):
    # The tiny model (256 positions) has no 512-token row: the table and the JSON left it out without a word,
    # where the README and --help promise prefill at 128 and 512 tokens.
    monkeypatch.setattr(
        benchmark,
        "run_in_turns",
        lambda workers, rounds: (
            {
                "onnxruntime": {"prefill 128": [2.0], "decode": [6000.0]},
                "pytorch": {"prefill 128": [3.0], "decode": [15.0]},
                "bandwidth": {"bandwidth": [10.0]},
            },
            {"onnxruntime": 80.0, "pytorch": 260.0, "bandwidth": 1.0},
        ),
    )
    sessions = _made_up_report(benchmark, 1)["sessions"]
    monkeypatch.setattr(benchmark, "run_worker", lambda args: sessions)
    monkeypatch.setattr(benchmark.importlib.util, "find_spec", lambda name: None)  # no genai worker
    args = SimpleNamespace(artifact=artifact_fp32, threads=0, provider="cpu", rounds=1)
    report = benchmark.measure(args)
    assert report["prefill_skipped"] == "512 tokens: the model has 256 positions"
    assert "prefill skipped: 512 tokens: the model has 256 positions" in benchmark.format_table(report)


def test_cuda_check_stops_with_exit_4_where_a_core_import_fails(tmp_path):
    # With a Python whose onnxruntime does not import, `import exporter.cli` exits (SystemExit 2, its one-line
    # error): the script's import loop catches that too and stops with its own exit 4, not an exit 2 it does not
    # define. Without nvidia-smi, it says so in its own words, not bash's "command not found".
    fake = tmp_path / "fake" / "onnxruntime"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('simulated: onnxruntime is broken here')\n")
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        OUT=str(tmp_path / "out"),
        PYTHONPATH=os.pathsep.join([str(fake.parent), *sys.path]),
    )
    out = subprocess.run(
        ["bash", str(SCRIPT.parent / "cuda_check.sh")], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 4, out.stdout[-2000:] + out.stderr[-2000:]
    assert "CUDA_CHECK: core imports failed: onnxruntime," in out.stdout
    assert "import exporter.cli: FAILED" in out.stdout
    assert "command not found" not in out.stdout + out.stderr


def _assert_results_file(text: str, report: dict) -> None:
    """RESULTS.md holds the date, the machine, the versions, the command line and the figures of `report`."""
    import platform

    env = report["environment"]
    assert text.startswith("# Runtime benchmark results\n")
    assert f"| date | {env['date']} |" in text and env["date"].endswith("UTC")
    assert f"| CPU | {benchmark_cpu()} |" in text and env["cpu"] == benchmark_cpu()
    assert f"| cores | {os.cpu_count()} logical, " in text
    assert f"| python | {platform.python_version()} |" in text
    for name in ("torch", "onnxruntime", "numpy"):
        assert f"| {name} | {importlib.metadata.version(name)} |" in text, name
    genai = importlib.util.find_spec("onnxruntime_genai")
    assert (
        f"| onnxruntime-genai | {importlib.metadata.version('onnxruntime-genai') if genai else 'not installed'} |"
        in (text)
    )
    assert f"| command | `{env['command']}` |" in text and "runtime.py" in env["command"]
    ours, torch_, ratios = report["onnxruntime"], report["pytorch"], report["ratios"]
    genai_figures = report["onnxruntime_genai"]
    decode = (
        f"| decode tokens/s (128 steps) | {ours['decode_tokens_per_s']:.1f} | {torch_['decode_tokens_per_s']:.1f} |"
    )
    assert decode in text
    assert f"| prefill 128 tokens (ms) | {ours['prefill_128_ms']:.1f} |" in text
    assert f"| peak RSS (MB) | {ours['peak_rss_mb']:.1f} | {torch_['peak_rss_mb']:.1f} |" in text
    q1, q3 = report["ratio_quartiles"]["decode"]
    assert f"| ours / PyTorch, decode tokens/s | {ratios['decode']:.2f}x | {q1:.2f}–{q3:.2f} |" in text
    if genai_figures:
        q1, q3 = report["ratio_quartiles"]["ours_to_genai"]
        assert f"| ours / genai, decode tokens/s | {ratios['ours_to_genai']:.2f}x | {q1:.2f}–{q3:.2f} |" in text
    floor = report["floor"]
    assert f"| {floor['weight_mb']:.1f} | {floor['read_gb_per_s']:.1f} | {floor['floor_step_ms']:.2f} |" in text
    assert f"| ours decode step / weight-read floor | {ratios['decode_step_to_floor']:.2f}x |" in text


def benchmark_cpu() -> str:
    """The first processor's model name, family, model and stepping, read here apart from the script."""
    with open("/proc/cpuinfo") as f:
        block = f.read().split("\n\n")[0]
    fields = dict(
        (key.strip(), value.strip()) for key, _, value in (line.partition(":") for line in block.splitlines())
    )
    ids = ", ".join(f"{key} {fields[key]}" for key in ("cpu family", "model", "stepping"))
    return f"{fields['model name']} ({ids})"


def test_results_are_written_where_asked_and_not_at_all_with_no_results(
    benchmark, artifact_fp32, tmp_path, monkeypatch
):
    # The default path is the committed benchmarks/RESULTS.md: pointed at a temporary file here.
    default = tmp_path / "default" / "RESULTS.md"
    default.parent.mkdir()
    monkeypatch.setattr(benchmark, "DEFAULT_RESULTS", default)
    report = _made_up_report(benchmark, rounds=1)
    monkeypatch.setattr(benchmark, "measure", lambda args: dict(report))
    monkeypatch.setattr(benchmark, "ensure_artifact", lambda folder: None)

    def run(*args):
        monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--artifact", str(artifact_fp32), "--json", *args])
        benchmark.run()

    run("--no-results")
    assert not default.exists()
    elsewhere = tmp_path / "elsewhere.md"
    run("--results", str(elsewhere))
    assert not default.exists() and elsewhere.is_file()
    run()
    text = default.read_text()

    def figures(text):  # all but the lines that differ between two runs of one report: when, and how invoked
        return [line for line in text.splitlines() if not line.startswith(("| date |", "| command |"))]

    assert figures(text) == figures(elsewhere.read_text())
    assert "| command | `" in text and "--results" not in text.split("| command |")[1].splitlines()[0]
    assert "| rounds | 1 (in turns;" in text and "| provider, threads | cpu, each library default |" in text
    assert not list(default.parent.glob(".*.tmp"))  # written whole, then renamed into place


def test_a_results_path_that_cannot_be_written_is_refused_before_any_worker_starts(tmp_path):
    for path, fragment in (
        (tmp_path, "is a folder; give a file path"),
        (tmp_path / "missing" / "RESULTS.md", "does not exist; create it or write elsewhere"),
    ):
        out = subprocess.run(
            [sys.executable, str(SCRIPT), "--artifact", str(tmp_path / "typo"), "--results", str(path), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and fragment in out.stderr, out.stderr[-2000:]
        assert json.loads(out.stdout)["error"]["kind"] == "input"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--results", str(tmp_path / "r.md"), "--no-results"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "not allowed with argument" in out.stderr


def test_the_results_file_lists_every_figure_of_a_made_up_report(benchmark):
    report = _made_up_report(benchmark, rounds=3)
    report["environment"] = benchmark.environment([str(SCRIPT), "--rounds", "3"])
    text = benchmark.format_results(report)
    _assert_results_file(text, report)
    assert "| onnxruntime-genai | " in text and "| ours / genai, decode tokens/s | — | — |" in text  # no genai side
