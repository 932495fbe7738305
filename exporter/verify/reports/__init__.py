"""Reports of a VerifyReport: the terminal table (text), JSON (to_dict), JUnit XML for CI systems, and a
self-contained HTML page with inline SVG plots."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path

from exporter.errors import OutputPathError
from exporter.paths import write_text_whole

from exporter.verify.reports.html import render_html, render_html_error
from exporter.verify.reports.junit import render_junit, render_junit_error
from exporter.verify.reports.text import format_verify
from exporter.verify.results import VerifyReport

__all__ = ["format_verify", "json_text", "render_html", "render_html_error", "render_junit", "render_junit_error",
           "write_error_reports", "write_reports"]


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
    """The requested reports of a verification's verdict; see _write."""
    _write([("--report-json", json_path, lambda: json_text(report.to_dict()) + "\n"),
            ("--junit", junit_path, lambda: render_junit(report)), ("--html", html_path, lambda: render_html(report))])


def write_error_reports(error: dict, json_path: Path | None = None, junit_path: Path | None = None,
                        html_path: Path | None = None) -> None:
    """The requested reports of a verification that stopped with an error, so that none left by an earlier run
    passes for this one's verdict: `error` is the document the CLI prints under --json,
    {"error": {"kind": ..., "message": ...}, "exit_code": N}."""
    kind, message = error["error"]["kind"], error["error"]["message"]
    _write([("--report-json", json_path, lambda: json_text(error) + "\n"),
            ("--junit", junit_path, lambda: render_junit_error(kind, message)),
            ("--html", html_path, lambda: render_html_error(kind, message))])


def _write(reports: list[tuple[str, Path | None, Callable[[], str]]]) -> None:
    """Each report with a path, written whole or not at all. One that cannot be written does not stop the others,
    and what an earlier run left at its path is removed; OutputPathError then names the first that failed."""
    failures = []
    for flag, path, render in reports:
        if path is None:
            continue
        try:
            write_text_whole(path, render())
        except OSError as exc:
            if Path(path).is_file():  # an earlier run's verdict, which would pass for this one's
                with contextlib.suppress(OSError):
                    Path(path).unlink()
            failures.append(f"{flag} {path}: cannot write the report ({exc.strerror or exc})")
    if failures:
        raise OutputPathError("; ".join(failures) + "; choose another path")
