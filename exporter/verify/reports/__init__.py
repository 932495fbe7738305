"""Reports of a VerifyReport: the terminal table (text), JSON (to_dict), JUnit XML for CI systems, and a
self-contained HTML page with inline SVG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

from exporter.verify.reports.html import render_html
from exporter.verify.reports.junit import render_junit
from exporter.verify.reports.text import format_verify
from exporter.verify.results import VerifyReport

__all__ = ["format_verify", "json_text", "render_html", "render_junit", "write_reports"]


def json_text(document) -> str:
    """Strict JSON, which every parser reads: a non-finite number (the max abs of a NaN output, the
    multiple of a zero tolerance) is written as null, not as Python's NaN or Infinity."""
    return json.dumps(_finite(document), indent=2, allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_reports(report: VerifyReport, json_path: Path | None = None, junit_path: Path | None = None,
                  html_path: Path | None = None) -> None:
    for path, render in ((json_path, lambda r: json_text(r.to_dict()) + "\n"),
                         (junit_path, render_junit), (html_path, render_html)):
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(render(report))
