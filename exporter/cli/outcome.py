"""How an export-onnx command ends: its exit code, a one-line error (with the error reports a verification owes),
its result on stdout, progress lines on stderr, and SIGINT/SIGTERM turned into a clean interruption."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from exporter.artifact.paths import set_uninterrupted
from exporter.cli.document import error_document, json_requested
from exporter.errors import ToolkitError, first_line
from exporter.export import LIBRARY_LOGGERS

EXIT_PARITY_FAILURE = 1
EXIT_INPUT_ERROR = 2
EXIT_INTERNAL_ERROR = 3


class ProgressHandler(logging.Handler):
    """Progress lines on stderr with the elapsed time, so stdout stays clean for --json."""

    def __init__(self):
        super().__init__()
        self.start = time.perf_counter()

    def emit(self, record):
        click.echo(printable(f"[{time.perf_counter() - self.start:6.1f}s] {record.getMessage()}"), err=True)
        if record.exc_info:  # --verbose: the traceback of a failure
            click.echo(logging.Formatter().formatException(record.exc_info), err=True)


@dataclass
class CommandState:
    """How far the running command got, which its error handling reads: the signal handler and the error exit
    (after click has left the command's context) reach it, so it is this module's, reset by begin_command per
    command (read it as outcome.state: the name is rebound)."""

    interrupted_by: str | None = None  # the signal that stopped this command, if one did
    # The report paths (by write_error_reports's keywords) a verification owes once its options were accepted: an
    # error then writes them as error reports, so that none an earlier run left passes for this one's verdict.
    owed_reports: dict[str, Path | None] = field(default_factory=dict)
    result_printed: bool = False  # stdout holds the result: under --json an error must not add a second document


state = CommandState()


def begin_command() -> None:
    """A fresh state for the command about to run, and SIGINT and SIGTERM routed to _interrupt, unless this
    process was started ignoring them (nohup, `cmd &` in a script, `trap '' INT`), as Python itself leaves an
    ignored SIGINT: taken over, a Ctrl-C meant for the script would stop the export it shields, and even then
    only from this line on, not while the modules import."""
    global state
    state = CommandState()
    set_uninterrupted(signals_deferred)
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _interrupt)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM held back while the block runs, and delivered (with the handlers found) right after it.
    Their handlers are swapped, not the signals blocked: a signal blocked in this thread is delivered to another
    (onnxruntime's pool threads), and Python runs its handler in the main thread all the same. Outside the main
    thread no handler can be set, and none is needed: Python raises a signal's exception only in the main thread.
    A signal that this process ignores, or whose handler is not Python's, is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    handlers = {
        signum: handler for signum, handler in handlers.items() if handler is not None and handler is not signal.SIG_IGN
    }
    try:
        for signum in handlers:
            signal.signal(signum, lambda received, frame: pending.append(received))
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


def _interrupt(signum, frame):
    """SIGINT and SIGTERM raise KeyboardInterrupt, so that cleanups run (an export's partial folder is
    removed); the signal is remembered because torch.export can turn the interrupt into an error of its own."""
    state.interrupted_by = signal.Signals(signum).name
    for library in LIBRARY_LOGGERS:  # what torch.export logs about the interrupt it turns into an error
        logging.getLogger(library).setLevel(logging.CRITICAL)
    raise KeyboardInterrupt


_WRITES_ARTIFACT = ("run", "export")  # the commands whose interruption leaves the destination as it was


_PREFIX = {"usage": "error: ", "input": "error: ", "internal": "internal error: ", "interrupted": ""}

# The flag that sets each parameter the library names. The library names a parameter in backticks, with a value
# where it suggests one (`golden_save`, `dtype="float16"`, `providers=["cpu", "cuda"]`); what a command prints
# names the flag instead (--golden-save, --dtype float16, --provider cpu --provider cuda). A parameter with no
# flag of its own keeps its backticked name.
FLAGS = {
    "folder": "--output",
    "dtype": "--dtype",
    "block_size": "--block-size",
    "accuracy_level": "--accuracy-level",
    "algorithm": "--quant-algorithm",
    "lm_head": "--lm-head",
    "embedding": "--embedding",
    "activations": "--activations",
    "trace_all_layers": "--trace-all-layers",
    "provider": "--provider",
    "providers": "--provider",
    "runtimes": "--runtime",
    "intra_op_threads": "--threads",
    "optimized_model_dir": "--save-optimized",
    "prompt_ids": "--prompt-ids",
    "turns": "--chat",
    "system": "--system",
    "do_sample": "--sample",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "repetition_penalty": "--repetition-penalty",
    "seed": "--seed",
    "stop_ids": "--stop-id",
    "golden": "--golden",
    "golden_save": "--golden-save",
    "fp16_companion": "--fp16-companion",
    "probe": "--probe",
    "reference": "--reference",
    "quality_text": "--quality-text",
    "quality_target": "--quality-target",
    "calibration_text": "--calibration-text",
    "calibration": "--calibration-text",
    "smoothing": "--smoothing",
    "decode_steps": "--decode-steps",
    "tokenizer": "--tokenizer",
    "with_tokenizer": "--no-tokenizer",
    "atol": "--atol",
    "rtol": "--rtol",
    "peak": "--peak",
    "json_path": "--report-json",
    "junit_path": "--junit",
    "html_path": "--html",
}
_PARAMETER = re.compile(r"`(\w+)(?:=([^`]*))?`")


def in_flags(message: str, flags: dict[str, str] = FLAGS) -> str:
    """`message` with each backticked parameter the library names written as the flag that sets it (`flags`)."""

    def flag(match: re.Match) -> str:
        name, value = match.groups()
        if name not in flags:
            return match.group(0)
        if value is None:
            return flags[name]
        try:
            values = json.loads(value)
        except ValueError:
            values = value
        values = values if isinstance(values, list) else [values]
        return " ".join(f"{flags[name]} {item}" for item in values)

    return _PARAMETER.sub(flag, message)


def missing_dependency(exc: ImportError) -> None:
    """The command cannot even be set up: one line naming the package (and a JSON error object under --json,
    read off the command line, which click has not parsed yet), exit 2."""
    package = (exc.name or "onnxruntime").split(".")[0]
    _fail(
        "input",
        f"{package} does not import here ({first_line(exc, 200)}); install it (pip install {package}), "
        "or reinstall this package with its dependencies",
        EXIT_INPUT_ERROR,
        json_requested(),
    )


def _fail(kind: str, message: str, code: int, as_json: bool) -> None:
    message = printable(in_flags(message))
    click.echo(_PREFIX[kind] + message, err=True)
    error = error_document(kind, message, code)
    if state.owed_reports:
        _write_error_reports(error)
    if as_json and not state.result_printed:  # stdout stays parseable: an error object instead of a result
        try:
            click.echo(json.dumps(error, indent=2))
        except OSError:  # stdout itself failed (a full disk, a closed pipe): the line on stderr has said it all
            sys.stdout = open(os.devnull, "w")  # nor may the flush at exit raise again
    sys.exit(code)


def _write_error_reports(error: dict) -> None:
    from exporter.verify.reports import write_error_reports

    try:
        write_error_reports(error, **state.owed_reports)
    except ToolkitError as exc:  # a second line: the first said why the verification stopped
        click.echo(f"error: {exc}", err=True)


def _closed_pipe_exit() -> None:
    """stdout closed by its reader (`| head`): no one is left to tell, so stop quietly; exit code 141 says it."""
    sys.stdout = open(os.devnull, "w")  # nor may the flush at exit raise again
    sys.exit(141)


def handle_errors(func):
    """Toolkit errors become a one-line message and exit code 2; anything unexpected exit code 3."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return func(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, (SystemExit, click.ClickException)):
                raise
            if isinstance(exc, BrokenPipeError):
                _closed_pipe_exit()
            log = logging.getLogger(__name__)
            interrupted_by = state.interrupted_by
            if isinstance(exc, KeyboardInterrupt) or interrupted_by is not None:
                code = 143 if interrupted_by == "SIGTERM" else 130
                signal_name = f" ({interrupted_by})" if interrupted_by else ""
                outcome = (
                    (
                        "; an export leaves no partial artifact: the destination holds the earlier one or the "
                        "complete new one"
                    )
                    if func.__name__ in _WRITES_ARTIFACT
                    else ""
                )
                _fail("interrupted", f"interrupted{signal_name}{outcome}", code, as_json)
            if isinstance(exc, ToolkitError):
                log.debug("input error", exc_info=True)
                _fail("input", str(exc), EXIT_INPUT_ERROR, as_json)
            log.debug("internal error", exc_info=True)
            hint = "" if log.isEnabledFor(logging.DEBUG) else " (rerun with --verbose for the traceback)"
            # the first line: torch's C++ errors carry their stack after it (14 lines for a size that overflows)
            detail = f": {first_line(exc, 400)}" if str(exc).strip() else ""
            _fail("internal", f"{type(exc).__name__}{detail}{hint}", EXIT_INTERNAL_ERROR, as_json)

    return wrapper


class OneLineErrorGroup(click.Group):
    """Usage errors as one line ('error: ... (see --help)') instead of click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's main, its usage errors, aborts and a --help that cannot be written ended as one-line errors.

        Args:
            args: the command line without the program name; None: sys.argv's.
            prog_name: the program's name in messages; None: click's choice.
            complete_var: click's shell-completion variable.
            standalone_mode: exit with the command's code (True), or return it (False).
            **extra: passed on to click's make_context.
        """
        as_json = json_requested(args)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
            _fail("usage", f"{exc.format_message()}{where}", EXIT_INPUT_ERROR, as_json)
        except click.ClickException as exc:
            _fail("usage", exc.format_message(), exc.exit_code, as_json)
        except click.Abort:  # a Ctrl-C before the command's own handling: under --json stdout still parses
            _fail("interrupted", "aborted", 130, as_json)
        except OSError as exc:  # click's --help on a stdout that cannot take it (a full disk; a closed pipe is
            # make_context's or invoke's), as echo_result says of a command's result
            sys.stdout = open(os.devnull, "w")  # nor may the flush at exit write there again
            _fail("input", f"cannot write the help to stdout ({exc.strerror or exc})", EXIT_INPUT_ERROR, as_json)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)

    # click prints --help in these two (the group's own in make_context, a command's in invoke) and turns a closed
    # pipe there into exit 1; the commands' own output stops with 141 (handle_errors), and so does the help's.
    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:
            _closed_pipe_exit()

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            _closed_pipe_exit()


def setup_logging(verbose: bool, quiet: bool) -> None:
    root = logging.getLogger()
    root.handlers[:] = [ProgressHandler()]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    for library in LIBRARY_LOGGERS:
        logging.getLogger(library).setLevel(logging.WARNING)


# A byte of a path that is no UTF-8, as Python holds it: a lone surrogate, U+DC80 to U+DCFF (PEP 383).
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def printable(text: str) -> str:
    """`text` with each byte of a path that is no UTF-8 written as \\xNN: a stream that encodes strictly (stdout in
    a UTF-8 locale, click's test runner) refuses the lone surrogate Python holds it as."""
    return _ESCAPED_BYTE.sub(lambda match: f"\\x{ord(match[0]) - 0xDC00:02x}", text)


def echo_result(text: str, nl: bool = True) -> None:
    """Print (part of) the result on stdout. A stdout that cannot take it (a full disk) is the user's to fix, not an
    internal error: an input error, exit 2. A closed pipe (BrokenPipeError) stays the quiet 141."""
    try:
        click.echo(printable(text), nl=nl)
    except BrokenPipeError:
        raise
    except OSError as exc:
        sys.stdout = open(os.devnull, "w")  # nor may the error object, or the flush at exit, write there again
        raise ToolkitError(f"cannot write the result to stdout ({exc.strerror or exc})") from None


def emit(result, as_json: bool, text: str) -> None:
    """Print the command's result (JSON with --json), whole: a SIGINT or SIGTERM while it is written (a slow reader
    holds the write in a full pipe) is held back until the last byte is out, and then stops the command, whose
    error no second document follows. Cut, a JSON document with an error object after it would parse as neither.
    A reader that stops reading holds the command until it reads again or goes (a Ctrl-C in a terminal stops the
    reader too, and the write ends in a closed pipe, exit 141)."""
    from exporter.verify.reports import json_text

    document = json_text(result) if as_json else text
    with signals_deferred():
        _write_whole(document + "\n")
        state.result_printed = True


def _write_whole(text: str) -> None:
    """Write `text` to stdout's file descriptor to its last byte, as echo_result fails. Python's buffered stdout is
    not used for it: a signal that cuts short a write into a full pipe loses the rest of its buffer, silently. A
    stdout without a descriptor (a test runner's) is written as echo_result writes."""
    stream = sys.stdout
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, OSError):  # None, closed, or io.UnsupportedOperation
        echo_result(text, nl=False)
        return
    data = memoryview(printable(text).encode(stream.encoding or "utf-8", "backslashreplace"))
    try:
        stream.flush()  # what echo_result wrote before (generate's streamed tokens) goes first
        while data:
            data = data[os.write(fd, data) :]  # a pipe may take part; an interrupted write resumes (PEP 475)
    except BrokenPipeError:
        raise
    except OSError as exc:
        sys.stdout = open(os.devnull, "w")  # nor may the error object, or the flush at exit, write there again
        raise ToolkitError(f"cannot write the result to stdout ({exc.strerror or exc})") from None
