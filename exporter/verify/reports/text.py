"""The terminal report: one table per runner (an ONNX Runtime provider, or another runtime's configuration), with
its runtime, its checks, the sweep and health, then notes (greedy, decode curve, localisation); then the invariants,
the weight audit, the runners against each other, attribution and the consumer check."""

from __future__ import annotations

import math

from exporter.tolerances.quality import QUALITY_CONFIDENCE
from exporter.verify.checks.faithfulness import NAME
from exporter.verify.checks.weights.results import SHOWN_FINDINGS
from exporter.verify.inputs import PREFILL_BATCH
from exporter.verify.metrics import Comparison
from exporter.verify.results import ProviderReport, VerifyReport


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in [header, ["-" * w for w in widths], *rows]
    ]
    return "\n".join(lines)


def verdict(passed: bool) -> str:
    return "pass" if passed else "FAIL"


def row_verdict(row) -> str:
    """A runner's row (ProviderReport, QualityReport): PASS, FAIL, or DIFFERS with the known cause it is attributed
    to, which leaves it out of the verdict (VerifyReport.passed)."""
    if row.attributed:
        return f"DIFFERS, known cause: {row.runtime.known_cause} (left out of the verdict)"
    return "PASS" if row.passed else "FAIL"


def worst_note(multiple: float | None) -> str:
    """A row's worst multiple of a tolerance (at most 1 where every check passed), or nothing where none has one."""
    if multiple is None or math.isnan(multiple):
        return ""
    return f" (worst check at {multiple:.3g}x its tolerance)"


def runtime_notes(row) -> list[str]:
    """The runtime a runner's row ran in and its configuration, then what its user should know of its results."""
    label = row.runtime
    cause = [f"known cause of differences: {label.known_cause}"] if label.known_cause else []
    return [f"runtime: {label.name}, {label.configuration}", *cause, *(f"note: {note}" for note in label.notes)]


def experts_verdict(experts) -> str:
    """An ExpertAgreement's result: one that measured nothing (routers not found) is skipped, neither pass nor
    FAIL; its note says why."""
    return "skipped" if experts.result is None else verdict(experts.result)


def _llm(c: Comparison) -> str:
    if "top1_agreement" in c.llm:
        return f"top1 {c.llm['top1_agreement']:.3f} top{5} {c.llm['topk_overlap']:.3f} KL {c.llm['kl_mean']:.2g}"
    if "perplexity_ratio" in c.llm:
        return f"ppl ratio {c.llm['perplexity_ratio']:.6f}"
    return f"cos {c.cosine:.6f}"


def comparison_row(c: Comparison) -> list[str]:
    t = c.tolerance
    return [
        c.name,
        f"{c.max_abs:.3g}",
        f"{c.mean_abs:.3g}",
        f"{c.max_rel:.3g}",
        _llm(c),
        f"{t.atol:g}/{t.rtol:.3g}/{t.peak:.3g}",
        f"{c.needed.atol:.2g} ({c.needed.scale:.2g}x)",
        verdict(c.passed) + (f" (refereed: {c.referee.ratio:.2g}x own)" if c.referee else ""),
    ]


def _sweep_outputs(case) -> tuple[tuple[str, Comparison], ...]:
    return ("logits", case.logits), ("present", case.kv)


def sweep_detail(case) -> str:
    """A sweep case's two outputs, each with its multiple of the tolerance and its verdict."""
    outputs = ", ".join(
        f"{output} max abs {c.max_abs:.3g} ({c.needed.scale:.2g}x tol"
        f"{'; refereed: ' + c.referee.describe() if c.referee else ''}, {verdict(c.passed)})"
        for output, c in _sweep_outputs(case)
    )
    return "; ".join([outputs] + [flip.describe() for flip in case.routing])


def referee_notes(p: ProviderReport) -> list[str]:
    """The comparisons beyond their fixed profile that the float64 referee judged (the sweep's are in its own
    lines)."""
    return [
        f"refereed {verdict(c.passed)}: {c.name}: {c.referee.describe()}"
        for c in p.comparisons
        if c.referee is not None
    ]


def routing_notes(p: ProviderReport) -> list[str]:
    """The prefill's and decode steps' failing calls with their expert choices, and where ONNX Runtime
    took the reference's cache after an explained flip (the sweep's are in its own lines)."""
    notes = [f"routing {'near-tie' if flip.explained else 'FAIL'}: {flip.describe()}" for flip in p.chain_flips]
    fed = [str(s.step) for s in p.curve if s.fed_reference_cache]
    if fed:
        notes.append(f"decode steps fed the reference's cache after an explained routing flip: {', '.join(fed)}")
    return notes


HEADER = ["check", "max abs", "mean abs", "max rel", "LLM metrics", "atol/rtol/peak", "needed atol (x tol)", "result"]


def _provider(p: ProviderReport) -> str:
    rows = [comparison_row(c) for c in p.comparisons]
    g = p.greedy
    rows.append(
        ["greedy tokens", f"{g.match_length}/{len(g.reference_ids)} match", "", "", "", "", "", verdict(g.passed)]
    )
    if p.sweep:
        failed = [c.name for c in p.sweep if not c.passed]
        output, worst, case = max(
            ((output, x, c) for c in p.sweep for output, x in _sweep_outputs(c)),
            key=lambda entry: entry[1].needed.scale,
        )
        rows.append(
            [
                f"shape sweep ({len(p.sweep)} shapes)",
                f"{worst.max_abs:.3g}",
                "",
                "",
                "",
                "",
                f"{worst.needed.scale:.2g}x ({output}) at {case.name}",
                verdict(not failed),
            ]
        )
    if p.long_context:
        worst = max((c for case in p.long_context for c in (case.logits, case.kv)), key=lambda c: c.needed.scale)
        rows.append(
            [
                f"long positions ({len(p.long_context)} cases)",
                f"{worst.max_abs:.3g}",
                "",
                "",
                "",
                "",
                f"{worst.needed.scale:.2g}x ({worst.name})",
                verdict(all(case.passed for case in p.long_context)),
            ]
        )
    flips = p.routing_flips
    if flips:
        explained = sum(flip.explained for flip in flips)
        rows.append(
            [
                "routing near-ties",
                f"{explained}/{len(flips)} explained",
                "",
                "",
                "failing calls whose routers chose other experts",
                "",
                "",
                verdict(explained == len(flips)),
            ]
        )
    if p.experts is not None:
        agreement = f"{100 * p.experts.fraction:.2f}% agree" if p.experts.measured else "not measured"
        rows.append(["expert choice", agreement, "", "", "", "", "", experts_verdict(p.experts)])
    rows.append(
        [
            f"repeat run of {PREFILL_BATCH} (nondeterminism)",
            f"{p.repeat.max_abs:.3g}",
            "",
            "",
            "",
            "",
            "",
            verdict(p.repeat.passed),
        ]
    )
    h = p.health
    headroom = f"fp16 headroom {h.headroom:.3g}x" if h.headroom else ""
    rows.append(
        [
            "health (NaN/Inf/saturated/zero rows)",
            f"{h.nan}/{h.inf}/{h.saturated}/{h.zero_rows}",
            "",
            "",
            headroom,
            "",
            "",
            verdict(h.passed),
        ]
    )
    lines = [
        f"{p.provider} ({p.dtype}, profile {p.profile.name}"
        f"{', overridden: ' + ', '.join(p.profile.overridden) if p.profile.overridden else ''}): {row_verdict(p)}"
        f"{worst_note(p.worst_multiple)}",
        *(f"  {line}" for line in runtime_notes(p)),
        table(HEADER, rows),
        f"  greedy: {g.note}",
    ]
    if p.experts is not None:
        lines.append(f"  experts: {p.experts.note}")
    curve = p.curve
    lines.append(
        f"  decode error curve: step 0 {curve[0].logits.max_abs:.3g} -> step {curve[-1].step} "
        f"{curve[-1].logits.max_abs:.3g} (max {max(s.logits.max_abs for s in curve):.3g})"
    )
    lines += [f"  {note}" for note in routing_notes(p) + referee_notes(p)]
    lines += [
        f"  sweep {'FAIL' if not c.passed else 'pass, refereed' if c.refereed else 'pass at a routing near-tie'}: "
        f"{c.name}: {sweep_detail(c)}"
        for c in p.sweep
        if not c.passed or c.routing_near_tie or c.refereed
    ]
    lines += [
        f"  long positions {'FAIL' if not c.passed else 'pass, refereed'}: {c.name} ({c.why}): "
        + ", ".join(
            f"{output} max abs {x.max_abs:.3g} ({x.needed.scale:.2g}x tol"
            f"{'; refereed: ' + x.referee.describe() if x.referee else ''})"
            for output, x in (("logits", c.logits), ("present", c.kv))
        )
        for c in p.long_context
        if not c.passed or c.refereed
    ]
    lines += [f"  health: {issue}" for issue in h.issues] + [f"  health warning: {w}" for w in h.warnings]
    loc = p.localisation
    if loc.fault_in:
        lines.append(f"  localisation: {loc.describe()}")
    lines += [f"  {note}" for note in probe_notes(p)]
    return "\n".join(lines)


def probe_notes(p: ProviderReport) -> list[str]:
    """What the node-level probe found in each graph, or why it did not run where that graph's check failed
    (a prefill fault shows in the layer-level localisation, a decode one in any failing step)."""
    loc = p.localisation
    decode_failed = not all(step.passed for step in p.curve)
    if loc.probe is None and loc.decode_probe is None and loc.probe_skipped == loc.decode_probe_skipped:
        return [f"probe: {loc.probe_skipped}"] if loc.fault_in or decode_failed else []
    notes = []
    for graph, probe, skipped, failed in (
        ("prefill", loc.probe, loc.probe_skipped, bool(loc.fault_in)),
        ("decode", loc.decode_probe, loc.decode_probe_skipped, decode_failed),
    ):
        if probe is None:
            notes += [f"probe of the {graph} graph: {skipped}"] if failed else []
            continue
        first = probe.first
        if first is not None:
            found = (
                f"first diverging checked value {first.tensor}, computed by {first.node} ({first.op_type}) in "
                f"{first.module}, max abs {first.max_abs:.3g} ({first.needed_scale:.2g}x tol); the fault lies "
                "there or in the operators since the last agreeing value"
            )
        else:
            found = f"no checked value diverges ({probe.note})"
            if graph == "decode" and decode_failed:
                found += (
                    f"; {probe.graph} computes this call as the reference does when fed the reference's "
                    "past, so the decode check's failure comes from the cache ONNX Runtime built before it"
                )
        notes.append(f"probe {probe.graph} ({probe.call}): {found}")
    return notes


def weight_rows(audit) -> list[list[str]]:
    """Per graph its summary, then each finding (the first SHOWN_FINDINGS, then how many more)."""
    rows = []
    for graph in audit.graphs:
        rows.append([graph.graph, graph.summary, verdict(graph.passed)])
        rows += [["", f"{f.problem}: {f.detail}", "FAIL"] for f in graph.findings[:SHOWN_FINDINGS]]
        if len(graph.findings) > SHOWN_FINDINGS:
            rows.append(["", f"and {len(graph.findings) - SHOWN_FINDINGS} more (the JSON report lists each)", ""])
    return rows


def summary_tables(report: VerifyReport) -> list[tuple[str, list[str], list[list[str]]]]:
    """The whole-report tables (title, header, rows) that every format renders in its own markup."""
    tables = []
    if report.invariants:
        tables.append(
            (
                "reference-free invariants",
                ["invariant", "detail", "result"],
                [[i.name, i.detail, verdict(i.passed)] for i in report.invariants],
            )
        )
    if report.weights is not None:
        tables.append(
            (
                "weight audit (every initializer against the PyTorch model's parameters)",
                ["graph", "detail", "result"],
                weight_rows(report.weights),
            )
        )
    if report.faithfulness is not None:
        tables.append(
            (
                f"quantized export {NAME}: {report.faithfulness.detail}",
                HEADER,
                [comparison_row(c) for c in report.faithfulness.comparisons],
            )
        )
    if report.cross:
        tables.append(
            (
                f"runners against each other (providers and runtimes, on {PREFILL_BATCH} only)",
                HEADER,
                [comparison_row(c) for c in report.cross],
            )
        )
    if report.cross_probes:
        tables.append(
            (
                "node-level probe between providers",
                ["providers", "covers", "first diverging operator"],
                [
                    [
                        probe.mode,
                        probe.covers,
                        f"{probe.first.node} ({probe.first.op_type}) in {probe.first.module or 'graph'}"
                        if probe.first
                        else "no operator diverges",
                    ]
                    for probe in report.cross_probes
                ],
            )
        )
    if report.attribution is not None:
        a = report.attribution
        rows = [
            [
                leg.cause,
                leg.covers,
                f"{leg.comparison.max_abs:.3g}",
                f"{leg.comparison.needed.scale:.2g}x",
                verdict(leg.comparison.passed),
            ]
            for leg in a.legs
        ]
        tables.append(
            (
                "attribution (export / provider / precision)",
                ["leg", "covers", "logits max abs", "x tol", "result"],
                rows + ([["skipped", a.skipped, "", "", ""]] if a.skipped else []),
            )
        )
    for independent in report.independent:
        tables.append(
            (
                f"independent reference: {independent.compared} against {independent.reference} "
                f"loading {independent.source}",
                HEADER,
                [comparison_row(c) for c in independent.comparisons],
            )
        )
    return tables


def _figure(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def quality_verdict(check) -> str:
    """A quality metric's verdict: "not judged" where there was no value to judge, never "pass"; "undecided" where
    its interval straddles the limit."""
    if not check.judged:
        return "not judged"
    if check.verdict == "undecided":
        return "undecided"
    return verdict(check.passed) + (" (excused)" if check.excused else "")


QUALITY_HEADER = ["metric", "value", f"{QUALITY_CONFIDENCE:.0%} interval", "limit", "verdict", "why"]


def _interval(interval) -> str:
    return "-" if interval is None else f"[{interval[0]:.4g}, {interval[1]:.4g}]"


def quality_detail(check) -> str:
    """A quality check in one line: its verdict, value, interval, limit and why."""
    interval = "" if check.interval is None else f" ({QUALITY_CONFIDENCE:.0%} interval {_interval(check.interval)})"
    return (
        f"{quality_verdict(check)}: {_figure(check.value)}{interval}, {check.threshold.bound} "
        f"{check.threshold.limit:.4g}; {check.note or check.threshold.why}"
    )


def quality_rows(q) -> list[list[str]]:
    """A quantized artifact's quality checks on one provider: each metric, its interval, its limit, its verdict
    and why."""
    return [
        [
            c.threshold.metric,
            _figure(c.value),
            _interval(c.interval),
            f"{c.threshold.bound} {c.threshold.limit:.4g}",
            quality_verdict(c),
            c.note or c.threshold.why,
        ]
        for c in q.checks
    ]


def quality_figures(q) -> str:
    """The quality figures no threshold judges, in one line, with their intervals."""
    m, i = q.metrics, q.intervals

    def shown(name):
        return _figure(m[name]) + (f" {_interval(i[name])}" if name in i else "")

    return (
        f"{m['positions']} positions: KL median {_figure(m['kl_median'])}, max {_figure(m['kl_max'])}; top-1 "
        f"agreement over all {shown('top1_agreement')}, top-5 overlap {shown('top5_overlap')}; NLL of the next "
        f"token at {m['nll_positions']} positions: reference {_figure(m['nll_reference'])}, artifact "
        f"{_figure(m['nll_onnx'])}, perplexity ratio {shown('perplexity_ratio')}; greedy "
        f"{m['greedy_match']}/{m['greedy_tokens']} tokens agree"
    )


def kl_position_summary(q) -> str:
    """Where the mean KL by position (QualityReport.kl_by_position) peaks, in one line; "" without a series."""
    known = [(v, i) for i, v in enumerate(q.kl_by_position) if v is not None and math.isfinite(v)]
    if not known:
        return ""
    value, position = max(known)
    phase = "prefill" if position < q.prefill_positions else "decode"
    decode = len(q.kl_by_position) - q.prefill_positions
    hidden = sum(v is not None and not math.isfinite(v) for v in q.kl_by_position)
    return (
        f"KL by position: max {value:.4g} nats at position {position} ({phase}) of {q.prefill_positions} prefill "
        f"and {decode} decode positions" + (f"; {hidden} not finite" if hidden else "")
    )


def quality_input(q) -> str:
    """What the quality checks read, how much of it, and in what time."""
    read = f"{q.windows} rows of {q.window_length} ids, {q.metrics['positions']} positions judged, in {q.seconds:.1f} s"
    read += f"; intervals resample the {q.resampled}"
    if q.text is None:
        return f"input: seeded random ids ({read})"
    return f"input: text {q.text.source}, {len(q.text.ids)} tokens read whole ({read})"


def quality_title(q) -> str:
    shown = "UNDECIDED" if q.verdict == "undecided" and not q.attributed else row_verdict(q)
    return f"{q.provider} ({q.scheme}, quality profile {q.profile.name}): {shown}{worst_note(q.worst_multiple)}"


def format_quality(q) -> str:
    """A quantized artifact's quality checks on one provider, then the other figures."""
    summary = kl_position_summary(q)
    lines = [quality_title(q), *runtime_notes(q), q.profile.why, quality_input(q)]
    return (
        "\n  ".join(lines)
        + f"\n{table(QUALITY_HEADER, quality_rows(q))}\n  {quality_figures(q)}"
        + (f"\n  {summary}" if summary else "")
    )


def format_verify(report: VerifyReport) -> str:
    overrides = report.tolerance_overrides.describe()
    blocks = [f"reference: {report.reference}" + (f"\ntolerance overrides: {overrides}" if overrides else "")]
    if report.writer:
        blocks.append(f"written by {report.writer['writer']}: {report.writer['contract']}")
    blocks += [_provider(p) for p in report.reports]
    blocks += [format_quality(q) for q in report.quality]
    blocks += [f"{provider}: skipped ({reason})" for provider, reason in report.skipped.items()]
    blocks += [f"{title}\n{table(header, rows)}" for title, header, rows in summary_tables(report)]
    for consumer in report.consumers:
        greedy = consumer.greedy
        blocks.append(
            f"consumer {consumer.consumer} (model type {consumer.model_type}): "
            f"{'PASS' if consumer.passed else 'FAIL'}\n  greedy against the reference: "
            f"{greedy.match_length}/{len(greedy.reference_ids)} match, {greedy.note}"
            + (f" (a final EOS is not compared: {consumer.consumer} leaves it out)" if consumer.eos_dropped else "")
        )
    blocks += [f"consumer {consumer}: skipped ({reason})" for consumer, reason in report.consumers_skipped.items()]
    blocks += [f"independent reference {name}: skipped ({why})" for name, why in report.independent_skipped.items()]
    if report.not_checked:
        blocks.append(
            "\n".join(
                ["not checked (never counted as passed):"] + [f"  {c}: {w}" for c, w in report.not_checked.items()]
            )
        )
    blocks.append(f"overall: {report.verdict.upper()} in {report.seconds:.1f} s")
    return "\n\n".join(blocks)
