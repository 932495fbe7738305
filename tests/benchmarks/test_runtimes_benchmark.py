"""The runtimes benchmark script (benchmarks/runtimes.py): one short measurement of a tiny artifact, and its
arithmetic. The figures are the script's to measure; these tests keep it working as the runners change under it."""

from __future__ import annotations

import pytest
from helpers import benchmark_script

from exporter.artifact.manifest import read_manifest
from exporter.runtime import registry
from exporter.runtime.node import NODE, TRANSFORMERS_JS, node_unavailable


@pytest.fixture(scope="module")
def benchmark():
    return benchmark_script("runtimes")


def test_each_runner_is_timed_against_onnxruntime_and_the_bound(benchmark, artifact_fp32, monkeypatch):
    absent = registry.Runtime("absent", "pip install absent", lambda: None, None, None)
    monkeypatch.setitem(registry._RUNTIMES, "absent", absent)
    entry = benchmark.measure_artifact(artifact_fp32, threads=1, steps=4, rounds=2, names=[NODE, "absent"])
    rows = entry["rows"]
    assert rows["absent"] == {"skipped": "not installed: pip install absent"}
    assert "openvino f32" not in rows  # a runtime not asked for is no row
    anchor, generate = rows[benchmark.ANCHOR], rows[benchmark.GENERATE]
    assert anchor["to_onnxruntime"] == 1 and anchor["to_onnxruntime_quartiles"] == [1, 1]
    assert generate["tokens_per_s"] > 0 and generate["configuration"].startswith("onnxruntime ")
    bound = entry["read_gb_per_s"] * 1e9 / (entry["weight_bytes"] + entry["cache_bytes_per_step"])
    assert entry["bound_tokens_per_s"] == pytest.approx(bound)
    # a share, not held below 1 here: the tiny model's weights stay in the CPU's caches, which the bound ignores
    assert anchor["to_bound"] == pytest.approx(anchor["tokens_per_s"] / bound) and anchor["to_bound"] > 0
    if node_unavailable(packages=(NODE,)):
        assert f"{NODE} cpu" not in rows and "not installed" in rows[NODE]["skipped"]
        return
    node = rows[f"{NODE} cpu"]
    assert "1 thread(s)" in node["configuration"]  # the registry's runner took the thread count
    # session.run alone is faster than the same steps through the pipe, which costs something each step
    assert node["in_node_tokens_per_s"] > node["tokens_per_s"] and node["pipe_ms_per_step"] > 0


def test_a_step_reads_the_past_at_the_runs_mean_length(benchmark, artifact_fp32):
    manifest = read_manifest(artifact_fp32, check_hashes=False)
    cache = manifest.cache
    per_position = 2 * cache.num_layers * cache.num_key_value_heads * cache.head_dim * 4  # keys and values, float32
    # 16 prompt positions, then 3 steps: pasts of 16, 17 and 18
    assert benchmark.cache_bytes_per_step(manifest, 3) == per_position * 17


def test_a_verify_report_run_as_a_user_runs_it_gives_each_row_its_verdict(benchmark, artifact_fp32):
    quick = ["--decode-steps", "2", "--no-sweep", "--no-long-context", "--no-genai"]
    report = benchmark.verify_report(artifact_fp32, [], quick)
    cells = benchmark.verdict_cells(report)
    cpu = cells["onnxruntime CPU"]
    # ONNX Runtime's CPU provider on its own float32 export: within its tolerance profile, with headroom
    assert cpu["verdict"] == "pass" and 0 <= cpu["worst_multiple"] < 0.5, cells
    assert benchmark.CROSS not in cells  # one runner: no pair to compare
    assert cells["onnxruntime-genai greedy tokens"]["verdict"] == "not checked"  # --no-genai, with the reason
    assert cells["onnxruntime-genai greedy tokens"]["why"]
    js = cells["transformers.js greedy tokens"]
    assert js["worst_multiple"] is None
    if node_unavailable(packages=(TRANSFORMERS_JS,)):
        assert js["verdict"] == "not checked" and js["why"]
    else:
        assert js["verdict"] == "pass", js


def row(passed, attributed=False, verdict=None, multiple=0.5, cause="", notes=()):
    runtime = {"name": "r 1.0", "configuration": "c", "known_cause": cause, "notes": list(notes)}
    entry = {"runtime": runtime, "passed": passed, "attributed": attributed, "worst_multiple": multiple}
    return entry if verdict is None else {**entry, "verdict": verdict}


def test_a_rows_verdict_says_why_it_differs_and_the_table_gives_each_reason_once(benchmark):
    report = {
        "verdict": "fail",
        "seconds": 12.0,
        "providers": [
            {"provider": "CPUExecutionProvider", **row(True, multiple=0.25, notes=["level ignored"])},
            {"provider": "vino default", **row(False, True, multiple=1234.4, cause="bf16")},
            {"provider": "web wasm", **row(False, multiple=1.04)},
        ],
        "quality": [{"provider": "node cpu", **row(False, verdict="undecided", multiple=1.2)}],
        "consumers": [{"consumer": "transformers.js 4.3.2", "passed": True, "greedy": {"note": "8 tokens identical"}}],
        "cross_provider": [
            {"name": "web wasm vs CPUExecutionProvider prefill logits", "passed": False, "multiple": 2.5},
            {"name": "web wasm vs CPUExecutionProvider prefill present", "passed": True, "multiple": 0.5},
        ],
        "skipped": {"CUDAExecutionProvider": "not available here"},
        "consumers_skipped": {"onnxruntime-genai": "not installed"},
    }
    cells = benchmark.verdict_cells(report)
    assert cells == {
        "onnxruntime CPU": {"verdict": "pass", "worst_multiple": 0.25, "why": "level ignored"},
        "vino default": {"verdict": "differs, known cause", "worst_multiple": 1234.4, "why": "bf16"},
        "web wasm": {"verdict": "FAIL", "worst_multiple": 1.04, "why": ""},
        "node cpu": {"verdict": "undecided", "worst_multiple": 1.2, "why": ""},
        benchmark.CROSS: {
            "verdict": "FAIL",
            "worst_multiple": 2.5,
            "why": "worst: web wasm vs CPUExecutionProvider prefill logits",
        },
        "transformers.js greedy tokens": {"verdict": "pass", "worst_multiple": None, "why": "8 tokens identical"},
        "onnxruntime CUDA": {"verdict": "not checked", "worst_multiple": None, "why": "not available here"},
        "onnxruntime-genai greedy tokens": {"verdict": "not checked", "worst_multiple": None, "why": "not installed"},
    }
    other = {"verdict": "pass", "seconds": 3.0, "rows": {"onnxruntime CPU": cells["onnxruntime CPU"]}}
    table = {"preset": "p", "verify_runtimes": "all", "verify_options": "", "verdicts": {}}
    table["verdicts"] = {"a": {"verdict": "fail", "seconds": 12.0, "rows": cells}, "b": other}
    lines = benchmark.verdict_lines(table)
    assert "| onnxruntime CPU | pass, 0.25x | pass, 0.25x |" in lines
    # three significant digits: a multiple just past 1 reads as such; a row the second report lacks reads "—"
    assert "| web wasm | FAIL, 1.04x | — |" in lines
    assert "| transformers.js greedy tokens | pass | — |" in lines  # tokens match or not: no multiple
    assert "| vino default | differs, known cause, 1234x | — |" in lines
    assert "| the report's verdict | fail | pass |" in lines
    assert lines.count("- onnxruntime CPU (a, b): level ignored") == 1  # shared by both: said once
    assert "- vino default (a): bf16" in lines


def test_a_node_runners_second_row_names_where_its_steps_ran(benchmark):
    assert benchmark.inside("onnxruntime-node cpu") == "onnxruntime-node cpu, inside Node"
    assert benchmark.inside("onnxruntime-web-chromium wasm") == "onnxruntime-web-chromium wasm, inside the page"
