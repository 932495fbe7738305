"""Reports of a VerifyReport: the terminal table (text), JSON (to_dict), JUnit XML for CI systems, and a
self-contained HTML page with inline SVG plots."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path

from exporter.artifact.paths import write_text_whole
from exporter.errors import OutputPathError
from exporter.verify.reports.html import render_html, render_html_error
from exporter.verify.reports.junit import render_junit, render_junit_error
from exporter.verify.reports.text import format_verify
from exporter.verify.results import VerifyReport

__all__ = [
    "check_report_destination",
    "format_verify",
    "json_text",
    "render_html",
    "render_html_error",
    "render_junit",
    "render_junit_error",
    "write_error_reports",
    "write_reports",
]


# How a file of each report kind begins, whoever wrote it (this toolkit, pytest's --junitxml, a browser's save).
_REPORT_STARTS = {
    "json_path": ("JSON", ("{",)),
    "junit_path": ("JUnit XML", ("<?xml", "<testsuite")),
    "html_path": ("HTML", ("<!doctype html", "<html")),
}


def check_report_destination(path: Path, parameter: str) -> None:
    """A file already at a report's path is replaced only when it is empty or a report of that kind: a path
    mistyped onto a source file (a JSON report's path given as verify.py) would otherwise lose it, unasked, to a
    report that can be written again. `parameter`: write_reports' parameter for that kind (json_path,
    junit_path, html_path)."""
    kind, starts = _REPORT_STARTS[parameter]
    try:
        if not Path(path).is_file():  # none yet, or /dev/stdout: written as it is
            return
        with open(path, "rb") as handle:
            head = handle.read(64).decode("utf-8", "replace").lstrip("\ufeff \t\r\n").lower()
    except OSError:  # unreadable: whether it can be written is check_output_path's question
        return
    if head and not head.startswith(starts):
        raise OutputPathError(
            f"`{parameter}` {path} is a file that holds no {kind} report; refusing to overwrite it: "
            "give the path of a new file or of an earlier report, or remove it first"
        )


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


def write_reports(
    report: VerifyReport, json_path: Path | None = None, junit_path: Path | None = None, html_path: Path | None = None
) -> None:
    """The requested reports of a verification's verdict, each written whole or not at all.

    Args:
        report: the verification's report.
        json_path: where to write the JSON report; None: none.
        junit_path: where to write the JUnit XML report; None: none.
        html_path: where to write the HTML report; None: none.

    Raises:
        OutputPathError: a report cannot be written; the others are written all the same, and what an earlier
            run left at the failed path is removed.
    """
    _write(
        [
            ("json_path", json_path, lambda: json_text(report.to_dict()) + "\n"),
            ("junit_path", junit_path, lambda: render_junit(report)),
            ("html_path", html_path, lambda: render_html(report)),
        ]
    )


def write_error_reports(
    error: dict, json_path: Path | None = None, junit_path: Path | None = None, html_path: Path | None = None
) -> None:
    """The requested reports of a verification that stopped with an error, so that none left by an earlier run
    passes for this one's verdict.

    Args:
        error: the document the CLI prints under --json, {"error": {"kind": ..., "message": ...}, "exit_code": N}.
        json_path: where to write the JSON report; None: none.
        junit_path: where to write the JUnit XML report; None: none.
        html_path: where to write the HTML report; None: none.

    Raises:
        OutputPathError: a report cannot be written (as write_reports).
    """
    kind, message = error["error"]["kind"], error["error"]["message"]
    _write(
        [
            ("json_path", json_path, lambda: json_text(error) + "\n"),
            ("junit_path", junit_path, lambda: render_junit_error(kind, message)),
            ("html_path", html_path, lambda: render_html_error(kind, message)),
        ]
    )


def _write(reports: list[tuple[str, Path | None, Callable[[], str]]]) -> None:
    """Each report with a path, written whole or not at all. One that cannot be written does not stop the others,
    and what an earlier run left at its path is removed; OutputPathError then names the first that failed."""
    failures = []
    for parameter, path, render in reports:
        if path is None:
            continue
        try:
            write_text_whole(path, render())
        except OSError as exc:
            if Path(path).is_file():  # an earlier run's verdict, which would pass for this one's
                with contextlib.suppress(OSError):
                    Path(path).unlink()
            failures.append(f"`{parameter}` {path}: cannot write the report ({exc.strerror or exc})")
    if failures:
        raise OutputPathError("; ".join(failures) + "; choose another path")
