"""JUnit XML: one testsuite per provider (plus invariants, the weight audit, cross-provider checks, the attribution's
legs, the consumers and what was skipped), one testcase per check, a <failure> with the figures when it fails; CI
systems show these natively."""

from __future__ import annotations

import re
from xml.etree import ElementTree as ET

from exporter.verify.inputs import PREFILL_BATCH
from exporter.verify.reports.text import quality_detail, sweep_detail
from exporter.verify.results import VerifyReport

# Characters XML 1.0 forbids even escaped (control characters but tab and newlines, lone surrogates, U+FFFE/F),
# which ElementTree writes as they are; a folder name can hold them.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(text: str) -> str:
    return _NOT_XML.sub("\ufffd", text)


def _case(suite: ET.Element, name: str, passed: bool | None, detail: str) -> None:
    """passed None: the check measured nothing; skipped, `detail` saying why."""
    case = ET.SubElement(suite, "testcase", classname=suite.get("name"), name=_xml_text(name), time="0")
    if passed is None:
        ET.SubElement(case, "skipped", message=_xml_text(detail))
    elif not passed:
        ET.SubElement(case, "failure", message=_xml_text(detail[:200])).text = _xml_text(detail)
    else:
        ET.SubElement(case, "system-out").text = _xml_text(detail)


def _suite(root: ET.Element, name: str, cases: list[tuple[str, bool | None, str]], row=None) -> None:
    """A testsuite of `cases` (name, passed, detail). `row`: the runner's report (ProviderReport, QualityReport)
    whose runtime the suite's properties name; where its failure is attributed to a known cause, its failing cases
    are skipped with that cause, as the verdict leaves them out."""
    if row is not None and row.attributed:
        cause = f"known cause: {row.runtime.known_cause} (left out of the verdict)"
        cases = [
            (name, None, f"{cause}; {detail}") if passed is False else (name, passed, detail)
            for name, passed, detail in cases
        ]
    suite = ET.SubElement(
        root,
        "testsuite",
        name=_xml_text(name),
        tests=str(len(cases)),
        failures=str(sum(passed is not None and not passed for _, passed, _ in cases)),
        errors="0",
        skipped=str(sum(passed is None for _, passed, _ in cases)),
        time="0",
    )
    if row is not None:
        label = row.runtime
        properties = ET.SubElement(suite, "properties")
        worst = () if row.worst_multiple is None else (("worst_multiple", f"{row.worst_multiple:.4g}"),)
        entries = (("runtime", f"{label.name}, {label.configuration}"), *worst, *(("note", n) for n in label.notes))
        for name, value in entries:
            ET.SubElement(properties, "property", name=name, value=_xml_text(value))
    for case in cases:
        _case(suite, *case)


def _comparison(c, name: str | None = None) -> tuple[str, bool, str]:
    return (
        name or c.name,
        c.passed,
        f"max abs {c.max_abs:.3g}, mean abs {c.mean_abs:.3g}, max rel {c.max_rel:.3g}, "
        f"needed atol {c.needed.atol:.3g} ({c.needed.scale:.3g}x the tolerance)",
    )


def render_junit(report: VerifyReport) -> str:
    # Times per check are not measured apart: the whole verification's time is on <testsuites>.
    root = ET.Element("testsuites", name=_xml_text(f"verify {report.folder}"), time=f"{report.seconds:.3f}")
    for q in report.quality:
        _suite(
            root,
            f"{q.provider} {q.scheme} quality",
            [(c.threshold.metric, c.passed, quality_detail(c)) for c in q.checks],
            q,
        )
    for p in report.reports:
        cases = [_comparison(c) for c in p.comparisons]
        cases.append(("greedy tokens", p.greedy.passed, p.greedy.note))
        if p.experts is not None:
            cases.append(("expert choice", p.experts.result, p.experts.note))
        if p.routing_flips:
            cases.append(
                (
                    "routing near-ties",
                    all(flip.explained for flip in p.routing_flips),
                    "; ".join(flip.describe() for flip in p.routing_flips),
                )
            )
        cases += [(f"sweep {c.name}", c.passed, sweep_detail(c)) for c in p.sweep]
        cases += [
            (
                f"long positions {c.name}",
                c.passed,
                f"{c.why}; logits {c.logits.max_abs:.3g}, present {c.kv.max_abs:.3g}",
            )
            for c in p.long_context
        ]
        cases.append((f"repeat run of {PREFILL_BATCH}", p.repeat.passed, f"max abs {p.repeat.max_abs:.3g}"))
        cases.append(("health", p.health.passed, "; ".join(p.health.issues + p.health.warnings) or "clean"))
        _suite(root, f"{p.provider} {p.dtype}", cases, p)
    if report.invariants:
        _suite(root, "invariants", [(i.name, i.passed, i.detail) for i in report.invariants])
    if report.weights is not None:
        _suite(root, "weight audit", [(g.graph, g.passed, g.detail) for g in report.weights.graphs])
    if report.cross:
        _suite(root, "cross-provider", [_comparison(c) for c in report.cross])
    if report.attribution is not None and report.attribution.legs:
        _suite(
            root,
            "attribution",
            [_comparison(leg.comparison, f"{leg.cause} leg ({leg.covers})") for leg in report.attribution.legs],
        )
    if report.consumers:
        _suite(root, "consumers", [(c.consumer, c.passed, c.greedy.note) for c in report.consumers])
    for independent in report.independent:
        _suite(
            root,
            f"{independent.compared} against {independent.reference}",
            [_comparison(c) for c in independent.comparisons],
        )
    skipped = {**report.skipped, **report.consumers_skipped, **report.not_checked}
    if skipped:
        suite = ET.SubElement(
            root,
            "testsuite",
            name="skipped",
            tests=str(len(skipped)),
            failures="0",
            errors="0",
            skipped=str(len(skipped)),
            time="0",
        )
        for name, reason in skipped.items():
            ET.SubElement(
                ET.SubElement(suite, "testcase", classname="skipped", name=name, time="0"),
                "skipped",
                message=_xml_text(reason),
            )
    suites = root.findall("testsuite")
    for total in ("tests", "failures", "errors", "skipped"):
        root.set(total, str(sum(int(suite.get(total)) for suite in suites)))
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def render_junit_error(kind: str, message: str) -> str:
    """A verification that stopped with an error: one testsuite with one testcase holding the <error>, which CI
    systems show as a broken run rather than a pass."""
    root = ET.Element("testsuites", name="verify", tests="1", failures="0", errors="1", skipped="0", time="0")
    suite = ET.SubElement(root, "testsuite", name="verify", tests="1", failures="0", errors="1", skipped="0", time="0")
    case = ET.SubElement(suite, "testcase", classname="verify", name="verification", time="0")
    ET.SubElement(case, "error", type=kind, message=_xml_text(message[:200])).text = _xml_text(message)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
