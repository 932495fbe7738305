"""Reports of a VerifyReport: the terminal table (text), JSON (to_dict), JUnit XML for CI systems, and a
self-contained HTML page with inline SVG plots."""

from __future__ import annotations

import json
from pathlib import Path

from exporter.verify.reports.html import render_html
from exporter.verify.reports.junit import render_junit
from exporter.verify.reports.text import format_verify
from exporter.verify.results import VerifyReport

__all__ = ["format_verify", "render_html", "render_junit", "write_reports"]


def write_reports(report: VerifyReport, json_path: Path | None = None, junit_path: Path | None = None,
                  html_path: Path | None = None) -> None:
    for path, render in ((json_path, lambda r: json.dumps(r.to_dict(), indent=2) + "\n"),
                         (junit_path, render_junit), (html_path, render_html)):
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(render(report))
