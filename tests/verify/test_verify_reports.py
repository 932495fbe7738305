"""The verdict and the reports that carry it: JUnit, HTML (drawn by a headless browser where chromium is
installed), JSON and text, for the default run and broken variants of it."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from xml.etree import ElementTree as ET

import pytest

from exporter.verify.metrics import Needed
from exporter.verify.reports import format_verify, json_text, render_html, render_junit


def test_junit_and_html_reports(full, tmp_path):
    report, _ = full
    suites = ET.fromstring(render_junit(report))
    cases = suites.findall(".//testcase")
    assert len(cases) >= 36 + 5 and not suites.findall(".//failure")
    assert {s.get("name") for s in suites} >= {
        "CPUExecutionProvider float32",
        "invariants",
        "weight audit",
        "attribution",
    }
    page = render_html(report)
    assert "Attribution (export / provider / precision)" in page and "<td>export</td>" in page
    for plot in ("decode-curve", "layer-errors", "logit-histogram"):
        assert f'class="plot {plot}"' in page
    offline = page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # a namespace name, never fetched
    for fetch in ("<script", "http://", "https://", "src=", "url(", "@import", "<link"):
        assert fetch not in offline, fetch


def test_reports_of_a_broken_run_stay_readable_and_name_what_failed(full):
    # A folder name with XML-forbidden and markup characters; a sweep case failing on present alone;
    # a decode curve holding NaN and Inf, as a model whose outputs overflowed gives.
    report, _ = full
    [cpu] = report.reports
    case = cpu.sweep[5]
    kv = dataclasses.replace(case.kv, max_abs=0.5, passed=False, needed=Needed(0.5, 0.5, 3000.0), members_multiple=None)
    curve = [
        dataclasses.replace(s, logits=dataclasses.replace(s.logits, max_abs=value))
        for s, value in zip(cpu.curve, [float("nan"), float("inf")] + [s.logits.max_abs for s in cpu.curve[2:]])
    ]
    broken = dataclasses.replace(
        report,
        folder="art\x01<&>",
        reports=[
            dataclasses.replace(
                cpu, sweep=[*cpu.sweep[:5], dataclasses.replace(case, kv=kv), *cpu.sweep[6:]], curve=curve
            )
        ],
    )

    suites = ET.fromstring(render_junit(broken))  # parses: the control character is replaced
    assert suites.get("name") == "verify art\ufffd<&>" and suites.get("time") == f"{report.seconds:.3f}"
    assert int(suites.get("tests")) == len(suites.findall(".//testcase"))
    assert int(suites.get("failures")) == len(suites.findall(".//failure")) == 1
    [failure] = suites.findall(".//failure")
    assert "present max abs 0.5 (3e+03x tol, FAIL)" in failure.text and "logits max abs" in failure.text
    assert failure.get("message") == failure.text[:200]  # what a CI system lists without opening the case
    worst = {p.get("value") for p in suites.findall(".//property") if p.get("name") == "worst_multiple"}
    assert worst == {f"{broken.reports[0].worst_multiple:.4g}"} and broken.reports[0].worst_multiple > 1000

    text = format_verify(broken)
    assert f"3e+03x (present) at {case.name}" in text  # the summary row: the worse of the two outputs
    assert f"sweep FAIL: {case.name}: logits max abs" in text
    [row] = [line for line in text.splitlines() if line.startswith("shape sweep (36 shapes)")]
    [header] = [line for line in text.splitlines() if line.startswith(f"{cpu.provider} (")]
    assert (
        row.split()[-1] == "FAIL"
        and header.endswith(": FAIL (worst check at 3e+03x its tolerance)")
        and text.split("\n")[-1].startswith("overall: FAIL")
    )

    document = broken.to_dict()  # the provider fails on its sweep alone: every comparison row passes
    assert all(c["passed"] for c in document["providers"][0]["comparisons"])
    assert document["providers"][0]["passed"] is False and document["passed"] is False

    def not_json(constant):
        raise AssertionError(f"{constant} is not JSON")

    steps = json.loads(json_text(document), parse_constant=not_json)["providers"][0]["decode_curve"]
    assert [s["logits_max_abs"] for s in steps[:3]] == [None, None, curve[2].logits.max_abs]

    page = render_html(broken)
    assert "art\x01&lt;&amp;&gt;" in page and "2 not finite, not drawn" in page
    assert not re.search(r'="[^"]*\b(nan|inf)\b', page)  # no SVG attribute holds a non-finite number
    assert ": FAIL</title>" in page and "<span class='FAIL'>FAIL</span></h1>" in page
    assert (
        f'{cpu.provider} (float32): <span class="FAIL">FAIL</span> (worst check at 3e+03x its tolerance)</h2>' in page
    )

    # MoE routing: one failing call's flip explained by a near-tie, another's not: the row fails
    from types import SimpleNamespace

    def flip(explained):
        return SimpleNamespace(explained=explained, describe=lambda: f"flip explained {explained}")

    routed = dataclasses.replace(
        cpu, prefill_routing=flip(False), curve=[dataclasses.replace(cpu.curve[0], routing=flip(True)), *cpu.curve[1:]]
    )
    [row] = [
        line
        for line in format_verify(dataclasses.replace(report, reports=[routed])).splitlines()
        if line.startswith("routing near-ties")
    ]
    assert "1/2 explained" in row and row.split()[-1] == "FAIL", row
    assert "health: 0 NaN, 0 Inf, 0 saturated, 0 zero rows" in page and ": pass</li>" in page


def test_every_report_carries_a_verdict_that_no_provider_row_shows(full):
    # Every provider passes; one invariant fails and a provider did not run. The whole report's verdict (JSON
    # "passed", the HTML heading and title, the text's last line) is the report's, not its providers'; the
    # provider that did not run is listed in each format; a repeat run within tolerance but not bit-identical
    # passes and is not called deterministic; an expert choice that measured nothing is skipped, not failed.
    report, _ = full
    [cpu] = report.reports
    first, *others = report.invariants
    reason = "not available in this onnxruntime build"
    from exporter.verify.checks.routing import ExpertAgreement  # one that measured nothing: skipped, not failed

    varied = dataclasses.replace(
        cpu,
        repeat=dataclasses.replace(cpu.repeat, max_abs=1e-7),
        experts=ExpertAgreement(False, 0, 0, 0, "router TopK nodes not found"),
    )
    failing = dataclasses.replace(
        report,
        reports=[varied],
        skipped={"CUDAExecutionProvider": reason},
        invariants=[dataclasses.replace(first, passed=False, detail="graph broken"), *others],
    )
    assert varied.passed and not failing.passed

    document = failing.to_dict()
    assert document["passed"] is False and document["providers"][0]["passed"] is True
    assert document["skipped"] == {"CUDAExecutionProvider": reason}
    assert document["providers"][0]["repeat"]["deterministic"] is False and document["providers"][0]["repeat"]["passed"]
    assert report.to_dict()["providers"][0]["repeat"]["deterministic"] is True

    text = format_verify(failing)
    assert f"CUDAExecutionProvider: skipped ({reason})" in text and text.split("\n")[-1].startswith("overall: FAIL")

    page = render_html(failing)
    assert ": FAIL</title>" in page and "<span class='FAIL'>FAIL</span></h1>" in page
    assert f"<p>CUDAExecutionProvider: skipped ({reason})</p>" in page

    suites = ET.fromstring(render_junit(failing))
    [skipped] = [s for s in suites.findall("testsuite") if s.get("name") == "skipped"]
    [case] = [c for c in skipped.findall("testcase") if c.get("name") == "CUDAExecutionProvider"]
    assert case.find("skipped").get("message") == reason
    [provider] = [s for s in suites.findall("testsuite") if s.get("name") == f"{cpu.provider} float32"]
    assert (provider.get("failures"), provider.get("skipped")) == ("0", "1"), provider.attrib
    assert (suites.get("failures"), suites.get("skipped")) == ("1", str(2 + len(report.consumers_skipped)))
    [failure] = suites.findall(".//failure")
    assert failure.text == "graph broken"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_html_report_renders_with_its_plots_in_a_headless_browser(full, tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render_html(full[0]))
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dom = out.stdout
    assert out.returncode == 0 and "</html>" in dom, out.stderr[-2000:]
    assert dom.count("<svg") == 3 and dom.count("<polyline") == 3 and dom.count("<rect") > 10
    assert "Verification of" in dom and "PASS" in dom


def test_every_check_of_a_report_can_fail_the_verdict():
    """The overall verdict (exit code 1, pytest's FAILED) reads each check: a report whose only failure is the
    health scan, the repeat run, the greedy tokens, one sweep case, the weight audit, a provider-vs-provider row or a
    consumer fails. The checks' own tests build the failing rows; this one proves that they reach the verdict."""
    from types import SimpleNamespace

    from exporter.runtime.protocol import RuntimeLabel
    from exporter.verify.checks.routing import ExpertAgreement
    from exporter.verify.results import ConsumerReport, ProviderReport, VerifyReport

    ok, bad = SimpleNamespace(passed=True), SimpleNamespace(passed=False)
    differ, unmeasured = ExpertAgreement(True, 10, 9, 0, "1 differs"), ExpertAgreement(False, 0, 0, 0, "not found")
    parts = {"comparisons": [ok], "greedy": ok, "sweep": [ok], "health": ok, "repeat": ok, "experts": None}
    honest = RuntimeLabel("onnxruntime", "CPUExecutionProvider")

    def provider(runtime=honest, **broken):
        fields = {**parts, **broken}
        return ProviderReport(
            provider="cpu",
            runtime=runtime,
            dtype="float32",
            profile=None,
            comparisons=fields["comparisons"],
            greedy=fields["greedy"],
            curve=[],
            layers=[],
            histogram={},
            sweep=fields["sweep"],
            health=fields["health"],
            repeat=fields["repeat"],
            localisation=None,
            experts=fields["experts"],
        )

    assert provider().passed
    for name, value in (
        ("comparisons", [ok, bad]),
        ("greedy", bad),
        ("sweep", [ok, bad]),
        ("health", bad),
        ("repeat", bad),
        ("experts", differ),
    ):
        assert not provider(**{name: value}).passed, name
    assert provider(experts=unmeasured).passed  # skipped: a limitation of the check, not a parity failure
    whole = dict(
        folder="x",
        reports=[provider()],
        reference="pytorch model",
        invariants=[ok],
        cross=[ok],
        consumers=[ConsumerReport("onnxruntime-genai", "qwen3", ok)],
    )
    assert VerifyReport(**whole).passed
    # nothing compared with the reference passes only where there is no reference and the invariants ran
    nothing = {**whole, "reports": [], "cross": [], "consumers": []}
    assert not VerifyReport(**nothing).passed  # every provider skipped
    assert VerifyReport(**{**nothing, "reference": "none"}).passed
    assert not VerifyReport(**{**nothing, "reference": "none", "invariants": []}).passed
    for name, value in (
        ("reports", [provider(), provider(health=bad)]),
        ("invariants", [ok, bad]),
        ("weights", bad),
        ("cross", [ok, bad]),
        ("consumers", [ConsumerReport("onnxruntime-genai", "qwen3", bad)]),
    ):
        assert not VerifyReport(**{**whole, name: value}).passed, name
    # a row failing with its configuration's known cause is left out where its runtime's honest row carries the
    # verdict, and only there
    by_design = provider(RuntimeLabel("onnxruntime", "bf16", known_cause="bf16"), health=bad)
    alone = provider(RuntimeLabel("other", "bf16", known_cause="bf16"), health=bad)  # no honest row of its runtime
    assert by_design.attributed and not by_design.passed
    assert VerifyReport(**{**whole, "reports": [provider(), by_design]}).passed
    assert not VerifyReport(**{**whole, "reports": [provider(health=bad), by_design]}).passed
    assert not VerifyReport(**{**whole, "reports": [provider(), alone]}).passed
