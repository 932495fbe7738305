"""Small inline SVG charts (no plotting library, no JavaScript): lines, bars and points on a log10 y axis, which
suits errors spanning orders of magnitude."""

from __future__ import annotations

import math
from html import escape

WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 640, 260, 64, 16, 28, 40
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
FLOOR = 1e-12  # log axis floor: an exact zero is drawn here


def _log(y: float) -> float:
    return math.log10(max(y, FLOOR))


def _frame(
    title: str, xlabel: str, low: float, high: float, css_class: str, log_axis: bool = True, ylabel: str = ""
) -> list[str]:
    middle = (TOP + HEIGHT - BOTTOM) / 2
    parts = [
        f'<svg class="{css_class}" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" font-size="13">{escape(title)}</text>',
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 6}" text-anchor="middle" font-size="11">{escape(xlabel)}</text>',
        f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" stroke="#333"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" stroke="#333"/>',
    ]
    if ylabel:
        parts.append(
            f'<text x="12" y="{middle:.1f}" transform="rotate(-90 12 {middle:.1f})" text-anchor="middle" '
            f'font-size="11">{escape(ylabel)}</text>'
        )
    for exponent in range(math.floor(low), math.ceil(high) + 1) if log_axis else ():
        y = _y(exponent, low, high)
        parts.append(
            f'<line x1="{LEFT - 4}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#ddd"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="10">1e{exponent}</text>'
        )
    return parts


def _y(value_log: float, low: float, high: float) -> float:
    return HEIGHT - BOTTOM - (value_log - low) / max(high - low, 1e-9) * (HEIGHT - TOP - BOTTOM)


def _range(values: list[float]) -> tuple[float, float]:
    logs = [_log(v) for v in values if math.isfinite(v)] or [0.0]
    return math.floor(min(logs)), math.ceil(max(logs)) + (1 if math.ceil(max(logs)) == math.floor(min(logs)) else 0)


def _titled(title: str, values: list[float]) -> str:
    """The title, saying how many values are not drawn: NaN and Inf have no place on the axis."""
    hidden = sum(not math.isfinite(v) for v in values)
    return f"{title}; {hidden} not finite, not drawn" if hidden else title


def _legend(labels: list[str]) -> list[str]:
    return [
        f'<text x="{LEFT + 8 + 150 * i}" y="{TOP + 10}" font-size="11" fill="{COLOURS[i % len(COLOURS)]}">'
        f"&#9632; {escape(label)}</text>"
        for i, label in enumerate(labels)
    ]


def line_chart(title: str, xlabel: str, series: dict[str, list[float]], css_class: str = "plot") -> str:
    """One line per series over x = 0..n-1, log10 y.

    Args:
        title: the chart's title, which also says how many values are not finite and not drawn.
        xlabel: the x axis's label.
        series: label -> y values; exact zeros are drawn at the axis floor.
        css_class: the svg element's class.

    Returns:
        The chart as an inline <svg> element.
    """
    values = [v for ys in series.values() for v in ys]
    low, high = _range(values)
    parts = _frame(_titled(title, values), xlabel, low, high, css_class)
    n = max(len(ys) for ys in series.values())
    for i, (label, ys) in enumerate(series.items()):
        points = " ".join(
            f"{LEFT + x / max(n - 1, 1) * (WIDTH - LEFT - RIGHT):.1f},{_y(_log(y), low, high):.1f}"
            for x, y in enumerate(ys)
            if math.isfinite(y)
        )
        parts.append(
            f'<polyline class="series" fill="none" stroke="{COLOURS[i % len(COLOURS)]}" stroke-width="1.5" '
            f'points="{points}"><title>{escape(label)}</title></polyline>'
        )
    for tick in sorted({0, n // 2, n - 1}):
        x = LEFT + tick / max(n - 1, 1) * (WIDTH - LEFT - RIGHT)
        parts.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle" font-size="10">{tick}</text>')
    return "\n".join(parts + _legend(list(series)) + ["</svg>"])


def bar_chart(
    title: str,
    xlabel: str,
    labels: list[str],
    series: dict[str, list[float]],
    log_y: bool = True,
    css_class: str = "plot",
) -> str:
    """Grouped bars, one group per label; log10 y (or linear counts).

    Args:
        title: the chart's title, which also says how many values are not finite and not drawn.
        xlabel: the x axis's label.
        labels: one per group, the x axis's tick labels.
        series: series name -> one value per label.
        log_y: a log10 y axis; False: linear, from 0 to the largest value.
        css_class: the svg element's class.

    Returns:
        The chart as an inline <svg> element.
    """
    values = [v for ys in series.values() for v in ys]
    title = _titled(title, values)
    if log_y:
        low, high = _range(values)
        height = lambda v: _y(_log(v), low, high)  # noqa: E731
        parts = _frame(title, xlabel, low, high, css_class)
    else:
        top = max([v for v in values if math.isfinite(v)] + [1])
        height = lambda v: HEIGHT - BOTTOM - v / top * (HEIGHT - TOP - BOTTOM)  # noqa: E731
        parts = _frame(title, xlabel, 0, 1, css_class, log_axis=False)
        parts.append(f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end" font-size="10">{top}</text>')
    group = (WIDTH - LEFT - RIGHT) / max(len(labels), 1)
    bar = group * 0.8 / max(len(series), 1)
    for s, (name, ys) in enumerate(series.items()):
        for i, v in enumerate(ys):
            if not math.isfinite(v):
                continue
            x = LEFT + i * group + group * 0.1 + s * bar
            y = height(v)
            parts.append(
                f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" '
                f'height="{max(HEIGHT - BOTTOM - y, 0):.1f}" fill="{COLOURS[s % len(COLOURS)]}">'
                f"<title>{escape(name)} {escape(labels[i])}: {v:.3g}</title></rect>"
            )
    step = max(1, len(labels) // 12)
    for i in range(0, len(labels), step):
        parts.append(
            f'<text x="{LEFT + (i + 0.5) * group:.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle" '
            f'font-size="10">{escape(labels[i])}</text>'
        )
    return "\n".join(parts + (_legend(list(series)) if len(series) > 1 else []) + ["</svg>"])


def points_chart(
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, list[tuple[int, float]]],
    rules: dict[str, float] | None = None,
    css_class: str = "plot",
) -> str:
    """Lines with a marker at each point, log10 y, each series over its own x values; dashed horizontal rules.

    Args:
        title: the chart's title, which also says how many values are not finite and not drawn.
        xlabel: the x axis's label.
        ylabel: the y axis's label.
        series: label -> (x, y) points, x ascending; a series may cover a different x range than another.
        rules: label -> y of a horizontal reference line (a limit), drawn dashed across the chart.
        css_class: the svg element's class.

    Returns:
        The chart as an inline <svg> element: one <circle class="point"> per finite point.
    """
    rules = rules or {}
    values = [y for points in series.values() for _, y in points]
    low, high = _range(values + list(rules.values()))
    xs = [x for points in series.values() for x, _ in points] or [0]
    first, last = min(xs), max(xs)

    def at(x: float) -> float:
        return LEFT + (x - first) / max(last - first, 1) * (WIDTH - LEFT - RIGHT)

    parts = _frame(_titled(title, values), xlabel, low, high, css_class, ylabel=ylabel)
    for label, limit in rules.items():
        y = _y(_log(limit), low, high)
        parts.append(
            f'<line class="rule" x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#555" '
            f'stroke-dasharray="5 3"><title>{escape(label)}: {limit:.4g}</title></line>'
            f'<text x="{WIDTH - RIGHT - 2}" y="{y - 3:.1f}" text-anchor="end" font-size="10" fill="#555">'
            f"{escape(label)} {limit:.4g}</text>"
        )
    for i, (label, points) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        finite = [(x, y) for x, y in points if math.isfinite(y)]
        path = " ".join(f"{at(x):.1f},{_y(_log(y), low, high):.1f}" for x, y in finite)
        parts.append(
            f'<polyline class="series" fill="none" stroke="{colour}" stroke-width="1.5" points="{path}">'
            f"<title>{escape(label)}</title></polyline>"
        )
        parts += [
            f'<circle class="point" cx="{at(x):.1f}" cy="{_y(_log(y), low, high):.1f}" r="2.5" fill="{colour}">'
            f"<title>{escape(label)} {x}: {y:.3g}</title></circle>"
            for x, y in finite
        ]
    ticks = {first, last} | {points[0][0] for points in series.values() if points}
    for tick in sorted(ticks):
        parts.append(
            f'<text x="{at(tick):.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle" font-size="10">{tick}</text>'
        )
    return "\n".join(parts + _legend(list(series)) + ["</svg>"])
