"""export-onnx: export MiniMind to ONNX, verify it against PyTorch, run it.

A thin layer: parse options, call the library, print its result objects.
Exit codes: 0 success, 1 parity failure, 2 usage or input error, 3 internal error, 130/143 interrupted
(SIGINT/SIGTERM), 141 stdout closed early.
This module holds the command group `main`, which each command module joins; the modules:

- run / export / verify / generate / inspect / install_node: one command each
- exporting: the export as `run` and `export` ask for it
- generate_input: generate's option checks and its prompts read into token ids
- options: the options several commands share (ExportOptions, VerifyOptions)
- verification: the verification as `verify` and `run` ask for it: its checks, its run and its ending
- outcome: how a command ends (exit codes, one-line errors, signals, progress lines)
- document: the JSON error document
- export_report: the export's and inspect's tables for people
- pytest_plugin: the verification as pytest items
- __main__: python -m exporter.cli
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _interrupted_while_starting(signum, frame):
    """A Ctrl-C while the command's modules import (onnxruntime's the longest): one line and 130, as later, not
    Python's traceback of the import it stopped. Under --json, stdout holds the error object.

    It leaves with os._exit: nothing started yet needs cleaning up, and an exception raised inside an extension's
    initialisation is not the caller's to handle. In onnx's (nanobind) it aborts the process (exit -6 and a
    traceback), in onnxruntime's (pybind11) it becomes `ImportError: initialization failed` (a second error line
    saying onnxruntime is not installed, exit 2), and an interpreter left with a half-initialised one can crash
    at exit (-11)."""
    message, code = f"interrupted ({signal.Signals(signum).name})", 128 + signum
    try:  # whatever fails here (a closed stdout), the exit stays this one
        from exporter.cli.document import error_document, json_requested

        print(message, file=sys.stderr)
        if json_requested():
            print(json.dumps(error_document("interrupted", message, code), indent=2))
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# Until this module is done (its imports, then its commands' definitions); then whatever was there before (a program
# importing this module keeps its own handling), and begin_command routes the signals for the command. One started
# ignoring a signal keeps ignoring it.
_BEFORE_IMPORTS = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
for _signum, _handler in _BEFORE_IMPORTS.items():
    if _handler is not signal.SIG_IGN:
        try:
            signal.signal(_signum, _interrupted_while_starting)
        except ValueError:  # imported from a thread other than the main one, which cannot set handlers
            break

import click  # after the handlers above, as every import below

from exporter.cli.outcome import OneLineErrorGroup, begin_command, missing_dependency

try:
    import onnxruntime  # noqa: F401  every command runs it: a deployment set up with --no-deps may lack it
except ImportError as exc:
    missing_dependency(exc)


@click.group(
    cls=OneLineErrorGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.pass_context
def main(ctx):
    """Export MiniMind to ONNX (prefill + cached decode graphs) and prove that ONNX Runtime reproduces
    the PyTorch reference: logits, present KV and loss, on every available execution provider.

    With no command, runs `export-onnx run`: export the minimind-3 preset with seeded weights to
    artifacts/minimind-3, then verify it.

    Exit codes: 0 success, 1 parity failure, 2 usage or input error, 3 internal error, 130/143
    interrupted (SIGINT/SIGTERM), 141 stdout closed early (e.g. piped into head).
    """
    begin_command()
    if ctx.invoked_subcommand is None:
        ctx.invoke(run.run)


from exporter.cli import export, generate, inspect, install_node, run, verify  # noqa: E402  each joins `main`

for _command in (run.run, export.export, verify.verify, generate.generate, inspect.inspect, install_node.install_node):
    main.add_command(_command)

# At the end: the definitions above run for a tenth of a second too (click's types call gettext, which reads the disk).
for _signum, _handler in _BEFORE_IMPORTS.items():
    if signal.getsignal(_signum) is _interrupted_while_starting and _handler is not None:  # None: not Python's
        signal.signal(_signum, _handler)
