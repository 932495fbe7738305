"""The Node runtimes (exporter.runtime.node): onnxruntime-web's WASM backend and onnxruntime-node run the artifact's
graphs as ONNX Runtime's CPU provider does, within the float32 CPU profile, and transformers.js generates the
reference's greedy tokens from the folder as it is. Skipped, with the reason, where node or npm is missing."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace
from xml.etree import ElementTree

import numpy as np
import pytest
from helpers import CONSUMER_PROMPTS, QUICK, assert_one_line_error, node_packages, relist_json, run_cli

from exporter.artifact.folder import open_artifact
from exporter.errors import ConsumerError, GraphRunError, InputError, ProviderError
from exporter.runtime import chromium as chromium_module
from exporter.runtime import node as node_module
from exporter.runtime.chromium import CHROMIUM, CHROMIUM_ENV, ChromiumRunner, chromium_unavailable
from exporter.runtime.generation import generate_greedy
from exporter.runtime.node import (
    INSTALL_HINT,
    NODE,
    NODE_PACKAGES,
    PACKAGES_ENV,
    TRANSFORMERS_JS,
    WEB,
    NodeRunner,
    install_node_packages,
    node_unavailable,
    transformers_js_greedy,
)
from exporter.runtime.runner import presents_as_past
from exporter.tolerances.parity import profile_for
from exporter.verify import consumers, engine
from exporter.verify.consumers import (
    NO_REFERENCE,
    QUANTIZED_SKIP,
    check_transformers_js,
    consumer_skip_reason,
    transformers_js_skip_reason,
)
from exporter.verify.engine import verify_artifact
from exporter.verify.inputs import ParitySettings, next_tokens, prefill_feeds, prompt_batch
from exporter.verify.metrics import compare_outputs
from exporter.verify.references.torch_runner import TorchRunner, reference_greedy


@pytest.fixture(scope="module")
def packages():
    return node_packages()


@pytest.fixture(scope="module", params=["node", "chromium"])
def web(request, packages, artifact_fp32):
    """onnxruntime-web's WASM backend in Node, and in headless Chromium (skipped, with the reason, without one)."""
    if request.param == "node":
        runner = NodeRunner(artifact_fp32, WEB)
    elif reason := chromium_unavailable(packages):
        pytest.skip(reason)
    else:
        runner = ChromiumRunner(artifact_fp32)
    with runner:
        yield runner


def _calls(runner, manifest, steps: int, perturb=None) -> list[tuple[str, dict, np.ndarray]]:
    """Prefill on a left-padded batch of 2, then `steps` decode steps of one token, each on the runner's own
    presents: (label, outputs, mask) per call. `perturb(label, feeds)` edits a call's feeds first."""
    rng = np.random.default_rng(3)
    batch = prompt_batch(manifest, ParitySettings(), rng)
    feeds = prefill_feeds(manifest, batch)
    mask = batch["attention_mask"]
    calls = []
    for step in range(steps + 1):
        label = "prefill" if step == 0 else f"decode {step}"
        if perturb is not None:
            perturb(label, feeds)
        outputs = runner.prefill(feeds) if step == 0 else runner.decode(feeds)
        calls.append((label, outputs, mask))
        new, mask = next_tokens(manifest, mask, 1, rng)
        feeds = {**new, **presents_as_past(manifest, outputs)}
    return calls


def _failures(actual, expected) -> list[str]:
    profile = profile_for("float32")
    return [
        f"{row.name}: max abs {row.max_abs:.3g}"
        for (label, outputs, mask), (_, reference, _) in zip(actual, expected)
        for row in compare_outputs(label, outputs, reference, profile, mask)
        if not row.passed
    ]


def test_onnxruntime_web_matches_onnxruntime_cpu_within_the_float32_profile(web, runner):
    manifest = runner.manifest
    assert _failures(_calls(web, manifest, 3), _calls(runner, manifest, 3)) == []
    in_chromium = isinstance(web, ChromiumRunner)
    name = CHROMIUM if in_chromium else WEB
    assert web.name == f"{name} {NODE_PACKAGES[WEB]}" and web.provider == f"{name} wasm"
    assert web.runtime.configuration.startswith("wasm in headless Chromium " if in_chromium else "wasm in Node.js")


def test_a_perturbed_feed_fails_the_comparison(web, runner):
    def shift_positions(label, feeds):
        if label == "decode 2":
            feeds["position_ids"] = feeds["position_ids"] + 1

    failures = _failures(_calls(web, runner.manifest, 3, shift_positions), _calls(runner, runner.manifest, 3))
    assert failures and all(row.startswith(("decode 2", "decode 3")) for row in failures), failures


def test_onnxruntime_node_loads_and_runs_the_graphs(packages, artifact_fp32, runner):
    with NodeRunner(artifact_fp32, NODE) as node:
        assert node.name == f"onnxruntime-node {NODE_PACKAGES[NODE]}" and node.provider == "onnxruntime-node cpu"
        assert _failures(_calls(node, runner.manifest, 1), _calls(runner, runner.manifest, 1)) == []
        node.start(np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), np.array([[0, 1, 2]]))
        os.kill(node._bridge._process.pid, signal.SIGKILL)  # Node ending under a run: the run says so
        with pytest.raises(GraphRunError, match=r"decode.onnx \(onnxruntime-node cpu: node ended \(exit code -9\)"):
            node.step(np.array([[4]]), np.ones((1, 4), np.int64), np.array([[3]]))
    with pytest.raises(GraphRunError, match="the Node process was closed"):
        node.decode({})


def test_generation_on_onnxruntime_web_gives_our_tokens(web, runner):
    eos = runner.manifest.config.eos_token_id
    for prompt in CONSUMER_PROMPTS[:2]:
        assert generate_greedy(web, prompt, 12, eos).new_ids == generate_greedy(runner, prompt, 12, eos).new_ids


def test_a_run_the_runtime_refuses_is_one_line_and_the_runner_serves_on(web, runner):
    feeds = prefill_feeds(runner.manifest, prompt_batch(runner.manifest, QUICK, np.random.default_rng(0)))
    with pytest.raises(GraphRunError, match="prefill.onnx.*onnxruntime-web") as caught:
        web.prefill({**feeds, "input_ids": feeds["input_ids"].astype(np.int32)})
    assert "\n" not in str(caught.value)
    assert web.prefill(feeds)["logits"].shape[:2] == feeds["input_ids"].shape


def test_transformers_js_generates_the_reference_tokens(packages, artifact_fp32, tiny_model, runner):
    prompt, eos = CONSUMER_PROMPTS[0], tiny_model.config.eos_token_id
    theirs = transformers_js_greedy(open_artifact(artifact_fp32), prompt, 24)
    assert theirs == reference_greedy(tiny_model, prompt, 24, eos).ids
    assert theirs == generate_greedy(runner, prompt, 24, eos).new_ids
    assert len(set(theirs)) > 5, "degenerate output makes token equality meaningless"


def test_the_transformers_js_consumer_check_passes_and_can_fail(packages, artifact_fp32, tiny_model, monkeypatch):
    artifact = open_artifact(artifact_fp32)
    reference, profile = TorchRunner(tiny_model, artifact.manifest), profile_for("float32")
    assert transformers_js_skip_reason(artifact.manifest) == ""
    report = check_transformers_js(reference, artifact, QUICK, profile)
    assert report.passed and report.consumer == f"transformers.js {NODE_PACKAGES[TRANSFORMERS_JS]}"
    assert report.model_type == "qwen3" and report.greedy.onnx_ids == report.greedy.reference_ids
    other = list(report.greedy.onnx_ids)
    other[2] = (other[2] + 1) % tiny_model.config.vocab_size  # transformers.js choosing another third token
    monkeypatch.setattr(consumers, "transformers_js_greedy", lambda *args: other)
    failed = check_transformers_js(reference, artifact, QUICK, profile)
    assert not failed.passed and "diverged at token 2" in failed.greedy.note and "not a tie" in failed.greedy.note


def test_verify_runs_the_transformers_js_check_and_every_report_shows_it(packages, artifact_fp32, tmp_path):
    paths = {"--report-json": tmp_path / "r.json", "--junit": tmp_path / "r.xml", "--html": tmp_path / "r.html"}
    flags = ["--provider", "cpu", "--no-genai", "--transformers-js", "--decode-steps", "1", "--no-sweep", "-q"]
    result = run_cli("verify", artifact_fp32, *flags, *[part for item in paths.items() for part in item])
    assert result.exit_code == 0, result.output
    name = f"transformers.js {NODE_PACKAGES[TRANSFORMERS_JS]}"
    assert f"consumer {name} (model type qwen3): PASS" in result.stdout, result.stdout
    assert "consumer onnxruntime-genai: skipped (turned off)" in result.stdout
    assert "leaves it out" not in result.stdout  # transformers.js keeps its EOS: nothing is left out of the comparison
    (consumer,) = json.loads(paths["--report-json"].read_text())["consumers"]
    assert consumer["consumer"] == name and consumer["passed"] and not consumer["eos_dropped"]
    assert consumer["greedy"]["onnx_ids"] == consumer["greedy"]["reference_ids"]
    assert len(consumer["greedy"]["onnx_ids"]) > 5
    suite = ElementTree.parse(paths["--junit"]).getroot().find("testsuite[@name='consumers']")
    assert [case.get("name") for case in suite] == [name] and suite.find("testcase/failure") is None
    assert f"Consumer {name}" in paths["--html"].read_text()


def test_verify_fails_where_the_folder_makes_transformers_js_generate_other_tokens(packages, artifact_copy, tiny_model):
    # transformers.js applies generation_config.json's repetition penalty; the reference and our loop do not
    relist_json(artifact_copy, "generation_config.json", lambda config: config.update(repetition_penalty=10.0))
    settings = ParitySettings(decode_steps=1, greedy_tokens=24, sweep=False, long_context=False, probe=False)
    report = verify_artifact(artifact_copy, tiny_model, ["cpu"], settings, genai=False)
    assert all(r.passed for r in report.reports) and not report.passed
    (consumer,) = report.consumers
    assert consumer.consumer.startswith("transformers.js") and "not a tie" in consumer.greedy.note


def test_why_the_transformers_js_check_does_not_run(artifact_fp32, tiny_model, tmp_path, monkeypatch):
    manifest = open_artifact(artifact_fp32).manifest
    quantized = SimpleNamespace(quantization=object())

    def never() -> str:
        pytest.fail("asked for the consumer's own reason where it does not apply")

    assert consumer_skip_reason("transformers.js", None, artifact_fp32, manifest, False, never) == NO_REFERENCE
    assert consumer_skip_reason("transformers.js", False, artifact_fp32, manifest, True, never) == "turned off"
    assert consumer_skip_reason("transformers.js", None, artifact_fp32, quantized, True, never) == QUANTIZED_SKIP
    with pytest.raises(ConsumerError, match="cannot run the transformers.js check on .*: a quantized artifact"):
        consumer_skip_reason("transformers.js", True, artifact_fp32, quantized, True, never)
    monkeypatch.setenv(PACKAGES_ENV, str(tmp_path / "empty"))
    missing = transformers_js_skip_reason(manifest)
    assert "\n" not in missing and missing.endswith(INSTALL_HINT)
    assert consumer_skip_reason("transformers.js", None, artifact_fp32, manifest, True, lambda: missing) == missing
    # asked for where it cannot run: refused before any work
    monkeypatch.setattr(engine, "OrtRunner", lambda *args, **kwargs: pytest.fail("refused only after work began"))
    with pytest.raises(ConsumerError, match=r"cannot run the transformers.js check .* export-onnx install-node"):
        verify_artifact(artifact_fp32, tiny_model, ["cpu"], QUICK, genai=False, transformers_js=True)


def test_without_node_or_packages_each_runtime_says_how_to_install_them(artifact_fp32, tmp_path, monkeypatch):
    # what this machine has does not matter: node and npm are found (or not) and Node's version read as set here
    monkeypatch.setattr(node_module.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(node_module, "_node_version", lambda node: "v20.19.2")
    monkeypatch.setenv(PACKAGES_ENV, str(tmp_path / "empty"))
    with pytest.raises(ProviderError, match=r"package onnxruntime-web is not installed .* export-onnx install-node"):
        NodeRunner(artifact_fp32, WEB)
    with pytest.raises(ConsumerError, match=r"@huggingface/transformers is not installed"):
        transformers_js_greedy(open_artifact(artifact_fp32), [1, 2], 2)
    assert transformers_js_skip_reason(open_artifact(artifact_fp32).manifest).endswith(INSTALL_HINT)
    monkeypatch.setattr(node_module, "_node_version", lambda node: "v18.19.0")
    assert node_unavailable() == f"/usr/bin/node is Node.js v18.19.0; {INSTALL_HINT}"
    monkeypatch.setattr(node_module.shutil, "which", lambda name: None)
    with pytest.raises(ProviderError, match=r"^node is not installed; install Node.js"):
        NodeRunner(artifact_fp32, NODE)
    with pytest.raises(ProviderError, match=r"^npm is not installed"):
        install_node_packages()
    assert_one_line_error(run_cli("install-node", "-q"), 2, "npm is not installed")


def test_verify_in_headless_chromium_judges_its_row_as_onnxruntime_webs(packages, artifact_fp32, tiny_model):
    if reason := chromium_unavailable(packages):
        pytest.skip(reason)
    report = verify_artifact(
        artifact_fp32, tiny_model, settings=QUICK, genai=False, transformers_js=False, runtimes=[CHROMIUM]
    )
    assert report.passed and [r.provider for r in report.reports] == [f"{CHROMIUM} wasm"]
    assert report.reports[0].runtime.name == f"{CHROMIUM} {NODE_PACKAGES[WEB]}"


def test_without_chromium_its_runtime_says_how_to_install_it(artifact_fp32, tmp_path, monkeypatch):
    monkeypatch.setenv(CHROMIUM_ENV, str(tmp_path / "no-browser"))
    assert chromium_unavailable().startswith("no Chromium found (chromium, chromium-browser, google-chrome on the PATH")
    with pytest.raises(ProviderError, match=r"^no Chromium found .*apt-get install chromium"):
        ChromiumRunner(artifact_fp32)
    with pytest.raises(InputError, match=rf"runtime {CHROMIUM} is not installed here: install chromium"):
        verify_artifact(artifact_fp32, settings=QUICK, runtimes=[CHROMIUM])
    browser = tmp_path / "browser"  # a browser that does not start
    browser.write_text("#!/bin/sh\nexit 1\n")
    browser.chmod(0o755)
    monkeypatch.setenv(CHROMIUM_ENV, str(browser))
    chromium_module.chromium_version.cache_clear()
    assert chromium_unavailable() == f"{browser} --version fails; {chromium_module.INSTALL_HINT}"


def test_install_node_reports_the_installed_packages(packages):
    result = run_cli("install-node", "--folder", packages, "-q")
    assert result.exit_code == 0, result.output
    assert f"onnxruntime-web {NODE_PACKAGES[WEB]}" in result.stdout and str(packages) in result.stdout
