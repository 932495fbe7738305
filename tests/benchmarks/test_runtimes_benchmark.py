"""The runtimes benchmark script (benchmarks/runtimes.py): one short measurement of a tiny artifact, and its
arithmetic. The figures are the script's to measure; these tests keep it working as the runners change under it."""

from __future__ import annotations

import pytest
from helpers import benchmark_script

from exporter.artifact.manifest import read_manifest
from exporter.runtime import registry
from exporter.runtime.node import NODE, node_unavailable


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
