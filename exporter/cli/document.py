"""The error object a command prints on stdout under --json, and whether --json was asked for before click has
parsed the command line. A leaf module: the handler of an interrupt while the CLI's modules import uses it."""

import sys


def error_document(kind: str, message: str, exit_code: int) -> dict:
    """What a failed command prints on stdout under --json (and writes as its error report): the CLI's, the
    benchmark's and inspect's error object."""
    return {"error": {"kind": kind, "message": message}, "exit_code": exit_code}


def json_requested(args: list[str] | None = None) -> bool:
    """Whether the command line (`args`, else sys.argv's) asks for --json: read off it before click has parsed it,
    by what reports an error that can come first (an interrupt while the modules import, a missing dependency,
    a usage error)."""
    return "--json" in (sys.argv[1:] if args is None else args)
