"""The runtime benchmark script (benchmarks/runtime.py): its arithmetic, and one short run end to end.

The figures themselves are measured by the script, not asserted here; these tests keep the script
working as the runtime changes under it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.runtime import cuda_unusable

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "runtime.py"


@pytest.fixture(scope="module")
def benchmark():
    spec = importlib.util.spec_from_file_location("benchmark_runtime", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ratios_are_medians_of_same_round_ratios_with_their_quartiles(benchmark):
    # Per-round ratios 4, 1, 2, 5, 3: median 3, inclusive quartiles 2 and 4. The medians of the two
    # sides (60 / 30 = 2) would give another figure: the ratio is taken round by round.
    median, quartiles = benchmark.ratio_summary([40, 10, 60, 50, 90], [10, 10, 30, 10, 30])
    assert median == 3 and quartiles == [2, 4]
    assert benchmark.ratio_summary([3.0], [2.0]) == (1.5, [1.5, 1.5])


def test_bad_arguments_and_folders_are_refused_before_any_worker_starts(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
    for args, fragment in ((["--rounds", "0"], "--rounds: must be 1 or more, got 0"),
                           (["--threads", "-1"], "--threads: must be 0 or more, got -1")):
        out = run(*args)
        assert out.returncode == 2 and fragment in out.stderr, out.stderr[-2000:]
    out = run("--artifact", tmp_path / "typo", "--json")  # a typo is not exported to: only the default folder is
    assert out.returncode == 2 and not (tmp_path / "typo").exists(), out.stderr[-2000:]
    assert json.loads(out.stdout) == {"error": {"message": f"{tmp_path / 'typo'} is not a folder; pass an artifact "
                                                           "folder written by 'export-onnx export'"}, "exit_code": 2}
    if cuda_unusable() is not None:  # a CUDA the benchmark cannot use is refused in one line, not by a worker
        out = run("--artifact", tmp_path / "typo", "--provider", "cuda")
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
        assert "CUDAExecutionProvider cannot run here" in out.stderr


def test_a_short_run_on_a_tiny_artifact_reports_every_figure(artifact_fp32):
    out = subprocess.run([sys.executable, str(SCRIPT), "--artifact", str(artifact_fp32), "--rounds", "2", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
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
        assert sessions["decode_step_after_prefill_ms"] > 0 and sessions["decode_step_in_a_row_ms"] > 0
