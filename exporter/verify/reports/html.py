"""A self-contained HTML page (inline CSS and SVG, no scripts, nothing fetched): the verdicts, the tables
of the text report, per provider three plots: error per decode step, error per layer, and the
histogram of |logit differences|, and for a quantized artifact the mean KL by position."""

from __future__ import annotations

from html import escape

from exporter.verify.inputs import PREFILL_BATCH
from exporter.verify.reports.svg import bar_chart, line_chart, points_chart
from exporter.verify.reports.text import (
    HEADER,
    QUALITY_HEADER,
    comparison_row,
    experts_verdict,
    kl_position_summary,
    probe_notes,
    quality_figures,
    quality_input,
    quality_rows,
    quality_title,
    referee_notes,
    routing_notes,
    row_verdict,
    runtime_notes,
    summary_tables,
    verdict,
    worst_note,
)
from exporter.verify.results import ProviderReport, VerifyReport

STYLE = """body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left}.pass{color:#17803d}.FAIL{color:#c00;
font-weight:bold}.attributed{color:#b36b00}.undecided{color:#b35c00;font-weight:bold}svg{display:block;margin:.5em 0;
border:1px solid #eee}"""
# The cells that name a verdict, coloured by it.
VERDICT_CELLS = ("pass", "FAIL", "undecided")


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{escape(c)}">{escape(c)}</td>' if c in VERDICT_CELLS else f"<td>{escape(str(c))}</td>"
            for c in row
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _plots(p: ProviderReport) -> str:
    tolerance_scale = [s.logits.needed.scale for s in p.curve]
    curve = line_chart(
        "Error per decode step (logits and present, max abs)",
        "decode step",
        {
            "logits max abs": [s.logits.max_abs for s in p.curve],
            "present max abs": [s.kv.max_abs for s in p.curve],
            "logits error / tolerance": tolerance_scale,
        },
        "plot decode-curve",
    )
    layers = bar_chart(
        "Error per layer (prefill present, max abs)",
        "layer",
        [str(x.layer) for x in p.layers],
        {"key": [x.key.max_abs for x in p.layers], "value": [x.value.max_abs for x in p.layers]},
        css_class="plot layer-errors",
    )
    h = p.histogram
    labels = [f"{e:.0e}" for e in h["edges"][:-1]]
    histogram = bar_chart(
        f"Histogram of |logit difference| (prefill; {h['zeros']} exact zeros, {h['non_finite']} not finite)",
        "|difference| from",
        labels or ["none"],
        {"count": h["counts"] or [0]},
        log_y=False,
        css_class="plot logit-histogram",
    )
    return curve + layers + histogram


def _provider(p: ProviderReport) -> str:
    rows = [comparison_row(c) for c in p.comparisons]
    rows.append(
        [
            "greedy tokens",
            f"{p.greedy.match_length}/{len(p.greedy.reference_ids)}",
            "",
            "",
            p.greedy.note,
            "",
            "",
            verdict(p.greedy.passed),
        ]
    )
    sweep = (
        _table(
            ["batch", "new tokens", "past", "logits max abs (x tol)", "present max abs (x tol)", "result"],
            [
                [
                    c.batch,
                    c.new_tokens,
                    c.past,
                    f"{c.logits.max_abs:.3g} ({c.logits.needed.scale:.2g}x)",
                    f"{c.kv.max_abs:.3g} ({c.kv.needed.scale:.2g}x)",
                    verdict(c.passed),
                ]
                for c in p.sweep
            ],
        )
        if p.sweep
        else "<p>sweep off</p>"
    )
    h = p.health
    loc = p.localisation
    overridden = f"; overridden: {', '.join(p.profile.overridden)}" if p.profile.overridden else ""
    headroom = f"; fp16 headroom {h.headroom:.3g}x" if h.headroom else ""
    repeat = "bit-identical" if p.repeat.max_abs == 0 else f"max abs {p.repeat.max_abs:.3g}"
    notes = [
        *runtime_notes(p),
        f"profile {p.profile.name}: {p.profile.why}{overridden}",
        f"health: {h.nan} NaN, {h.inf} Inf, {h.saturated} saturated, {h.zero_rows} zero rows{headroom}: "
        f"{verdict(h.passed)}",
        *h.issues,
        *h.warnings,
        f"repeat run of {PREFILL_BATCH} (nondeterminism): {repeat}: {verdict(p.repeat.passed)}",
    ]
    if loc.fault_in:
        notes.append(f"localisation: {loc.describe()}")
    notes += probe_notes(p)
    if p.experts is not None:
        notes.append(f"expert choice: {p.experts.note} ({experts_verdict(p.experts)})")
    notes += routing_notes(p) + referee_notes(p)
    items = "".join(f"<li>{escape(n)}</li>" for n in notes)
    return (
        f'<section class="provider"><h2>{escape(p.provider)} ({p.dtype}): '
        f'<span class="{"pass" if p.passed else "attributed" if p.attributed else "FAIL"}">'
        f"{escape(row_verdict(p))}</span>{escape(worst_note(p.worst_multiple))}</h2>"
        f"{_table(HEADER, rows)}<ul>{items}</ul>{_plots(p)}<h3>Shape sweep</h3>{sweep}</section>"
    )


def _kl_plot(q) -> str:
    """The mean KL at each position (QualityReport.kl_by_position), prefill and decode apart, with the profile's
    limit of the mean KL as a dashed line; positions without a real token are not drawn."""
    if not q.kl_by_position:
        return ""
    points = [(i, v) for i, v in enumerate(q.kl_by_position) if v is not None]
    limits = {"mean KL limit": c.threshold.limit for c in q.checks if c.threshold.metric == "kl_mean"}
    chart = points_chart(
        "Mean KL(reference || artifact) by position",
        "position",
        "KL (nats)",
        {
            "prefill": [(i, v) for i, v in points if i < q.prefill_positions],
            "decode": [(i, v) for i, v in points if i >= q.prefill_positions],
        },
        limits,
        "plot kl-by-position",
    )
    return f"{chart}<p>{escape(kl_position_summary(q))}</p>"


def _verdict_class(name: str) -> str:
    """The CSS class of a report's verdict ("pass", "fail" or "undecided")."""
    return "FAIL" if name == "fail" else name


def _quality_class(q) -> str:
    """The CSS class of a quality row's verdict: attributed to a known cause, or its own."""
    return "attributed" if q.attributed else _verdict_class(q.verdict)


def _quality(q) -> str:
    lines = "".join(f"<p>{escape(line)}</p>" for line in [*runtime_notes(q), q.profile.why, quality_input(q)])
    return (
        f'<section class="quality"><h2 class="{_quality_class(q)}">{escape(quality_title(q))}</h2>{lines}'
        f"{_table(QUALITY_HEADER, quality_rows(q))}<p>{escape(quality_figures(q))}</p>{_kl_plot(q)}</section>"
    )


def render_html(report: VerifyReport) -> str:
    overall = report.verdict.upper()
    parts = [
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>verify {escape(report.folder)}: "
        f"{overall}</title><style>{STYLE}</style></head><body>",
        f"<h1>Verification of {escape(report.folder)}: <span class='{_verdict_class(report.verdict)}'>{overall}"
        "</span></h1>",
        f"<p>reference: {escape(report.reference)}; {report.seconds:.1f} s; settings "
        f"{escape(str(report.settings))}</p>",
    ]
    overrides = report.tolerance_overrides.describe()
    parts += [f"<p>tolerance overrides: {escape(overrides)}</p>"] if overrides else []
    parts += [_provider(p) for p in report.reports]
    parts += [_quality(q) for q in report.quality]
    parts += [
        f"<p>{escape(k)}: skipped ({escape(v)})</p>" for k, v in {**report.skipped, **report.consumers_skipped}.items()
    ]
    parts += [f"<p>{escape(k)}: not checked ({escape(v)})</p>" for k, v in report.not_checked.items()]
    parts += [
        f"<h2>{escape(title.capitalize())}</h2>{_table(header, rows)}" for title, header, rows in summary_tables(report)
    ]
    for c in report.consumers:
        parts.append(f"<h2>Consumer {escape(c.consumer)}</h2><p>{escape(c.greedy.note)}: {verdict(c.passed)}</p>")
    return "\n".join(parts + ["</body></html>"]) + "\n"


def render_html_error(kind: str, message: str) -> str:
    """A verification that stopped with an error: the page says so, and what the error was."""
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>verify: ERROR</title>"
        f"<style>{STYLE}</style></head><body>\n<h1>Verification stopped: <span class='FAIL'>ERROR</span></h1>\n"
        f"<p>{escape(kind)} error: {escape(message)}</p>\n</body></html>\n"
    )
