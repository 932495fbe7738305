"""Output paths checked before any work is spent on what would be written there; files written whole, and the
JSON object files a user or an artifact gives read with one message for each way they can be wrong."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path

from exporter.errors import InputError, OutputPathError, ToolkitError, first_line

try:
    import fcntl
except ImportError:  # Windows: no folder_lock
    fcntl = None


def check_output_path(path: Path, option: str, folder: bool) -> None:
    """`path` (a file, or a folder when `folder`) can be created or replaced by this process."""
    path = Path(os.path.abspath(path))
    try:
        _check_output_path(path, option, folder)
    except OSError as exc:  # a parent this user may not search: Path.exists raised PermissionError, exit 3
        raise OutputPathError(
            f"{option} {path} cannot be reached ({exc.strerror or exc}); choose another path"
        ) from None


def shown_path(path) -> str:
    """`path` as a message shows it: a byte of its name that is no UTF-8 as \\xNN, which any terminal and any JSON
    reader takes (Python holds such a byte as a lone surrogate, which a UTF-8 stream refuses)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


# What to do about a path that is no UTF-8 (check_text_path).
TEXT_PATH_FIX = "rename it, or reach it by a symbolic link whose path is UTF-8 (ln -s)"


def check_text_path(path, what: str, fix: str, error: type[ToolkitError] = ToolkitError) -> None:
    """`path` is UTF-8 text, as onnx, onnxruntime and onnxruntime-genai need: their bindings hand the file system
    the path's UTF-8 encoding, and refuse a name that the file system allows but that is no UTF-8 (a byte such as
    0xff, which Python holds as a lone surrogate) as an argument of the wrong type.

    Args:
        path: the path (str, bytes or os.PathLike).
        what: what the message calls it ("artifact folder", "--tokenizer").
        fix: what to do, the message's last clause.
        error: the ToolkitError subclass raised.
    """
    raw = os.fsencode(path)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{what} {shown_path(path)} holds the byte 0x{raw[exc.start]:02x}, which is no UTF-8, and onnx and "
            f"onnxruntime take only UTF-8 paths; {fix}"
        ) from None


def check_outside_artifact(path, flag: str, folder) -> None:
    """A path this command writes must not lie in the artifact folder it reads (it would change it), nor in another
    one, whose integrity check would then fail on a file its manifest does not list."""
    from exporter.artifact.manifest import listed_files  # here: exporter.artifact.manifest imports this module

    artifact, resolved = Path(folder).resolve(), Path(path).resolve()
    if resolved == artifact:  # "lies inside the artifact folder x" read oddly of x itself
        raise ToolkitError(
            f"{flag} {path} is the artifact folder this command reads, which it would change; write it elsewhere"
        )
    if artifact in resolved.parents:
        raise ToolkitError(
            f"{flag} {path} lies inside the artifact folder {folder}, which it would change; write it elsewhere"
        )
    other = next((p for p in (resolved, *resolved.parents) if listed_files(p) is not None), None)
    if other == resolved:
        raise ToolkitError(f"{flag} {path} is an artifact folder, which it would change; write it elsewhere")
    if other is not None:
        raise ToolkitError(
            f"{flag} {path} lies inside the artifact folder {other}, which it would change; write it elsewhere"
        )


def outside_folder(folder, name, through_links: bool = True) -> bool:
    """Whether the file a folder's document names by `name` (a path relative to the folder) lies outside it: an
    absolute path, `..`, or, `through_links`, a link out. A folder names only files it holds."""
    resolve = os.path.realpath if through_links else os.path.abspath
    root = Path(resolve(folder))
    return root not in Path(resolve(root / name)).parents


def _check_output_path(path: Path, option: str, folder: bool) -> None:
    if path.exists() and path.is_dir() != folder:
        found, wanted = ("a folder", "a file") if path.is_dir() else ("a file", "a folder")
        raise OutputPathError(f"{option} {path} is {found}; give the path of {wanted}")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing != path and not existing.is_dir():
        raise OutputPathError(f"{option} {path} lies under {existing}, which is a file; choose another path")
    for target in [path, path.parent] if existing == path else [existing]:
        # A file is created to try only outside the destination: one created and removed inside a folder that is
        # there changes its ctime, by which a process reading it meanwhile tells a folder swapped in for it.
        problem = (
            _create_problem(target)
            if target.is_dir() and target != path
            else (None if os.access(target, os.W_OK) else "permission denied")
        )
        if problem:
            raise OutputPathError(f"{option}: cannot write to {target} ({problem}); choose another path")


# Reasons worth naming as they are; any other refusal (EACCES, EPERM, /proc's ENOENT) is "permission denied".
_NAMED_ERRORS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def _create_problem(folder: Path) -> str | None:
    """Why no file can be created in `folder`, or None: tried, since permission bits say nothing to root (/proc,
    say) nor of a read-only mount."""
    try:
        handle, name = tempfile.mkstemp(dir=folder, prefix=".write-check-")
    except OSError as exc:
        return exc.strerror.lower() if exc.errno in _NAMED_ERRORS and exc.strerror else "permission denied"
    os.close(handle)
    os.unlink(name)
    return None


def write_text_whole(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: into a file beside it, then renamed over it, so an interrupt
    or a full disk leaves the earlier file (or none), never a truncated one, nor the folders made for it. A path
    that exists and is no regular file (/dev/stdout, a pipe) is written as it is: renaming over it would replace
    the device."""
    path = Path(os.path.realpath(path))  # through a link to its file, which a rename would otherwise replace
    if path.exists() and not path.is_file():
        path.write_text(text, encoding="utf-8")
        return
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")  # a second process writing it keeps its own
    with parents_removed_unless_done(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            partial.write_text(text, encoding="utf-8")
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise


# What a short move of several files into place runs under, so that an interrupt cannot leave half of them moved:
# nothing by default (a program using the library keeps its own signal handling); the CLI installs a context that
# holds SIGINT and SIGTERM back until the block is done (exporter.cli.outcome.signals_deferred).
_uninterrupted: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def uninterrupted() -> contextlib.AbstractContextManager:
    """The context a multi-file move into place runs under (see set_uninterrupted)."""
    return _uninterrupted()


def set_uninterrupted(context: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Install the context that uninterrupted() returns a new one of."""
    global _uninterrupted
    _uninterrupted = context


@contextlib.contextmanager
def parents_removed_unless_done(path: Path):
    """The parent folders of `path` missing now (`-o a/b/c` with no a/b), which the block makes to write `path`,
    are removed again when it fails or is interrupted: each that is still empty, deepest first."""
    missing = []
    for parent in Path(path).parents:
        if os.path.lexists(parent):
            break
        missing.append(parent)
    try:
        yield
    except BaseException:
        for parent in missing:
            with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                parent.rmdir()
        raise


@contextlib.contextmanager
def folder_lock(folder: Path):
    """Held while this toolkit swaps what it wrote into `folder`: another process of it (a second export into the
    same parent folder, a second --golden-save into one bundle, a second --save-optimized into one folder) waits
    its turn, so that the later result replaces the earlier whole instead of the two swaps interleaving. An
    advisory lock (flock) on the folder itself, gone with the process; none where the platform has no flock, or
    the folder cannot be opened (what follows meets that problem and names it)."""
    handle = None
    if fcntl is not None:
        with contextlib.suppress(OSError):
            handle = os.open(folder, os.O_RDONLY)
    try:
        if handle is not None:
            with contextlib.suppress(OSError):  # a file system without locks (some network mounts): unlocked
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        if handle is not None:
            os.close(handle)


def json_type(value) -> str:
    """The JSON type of a value read by json.loads."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(value), "null"
    )


class _RepeatedKey(ValueError):
    """A JSON object giving one key twice, which json.loads reads as its last value, silently."""


def _refuse_repeated_keys(pairs: list) -> dict:
    data = {}
    for key, value in pairs:
        if key in data:
            raise _RepeatedKey(key)
        data[key] = value
    return data


# The most bytes read_json_file reads of a file. A config or tolerance file holds a few dozen fields (kilobytes): a
# file far past that is a mistake (a device such as /dev/zero, a weights file given as a config), which is refused
# at this size rather than read into memory until it runs out.
JSON_FILE_LIMIT = 16 << 20


def _size(count: int) -> str:
    return f"{count / (1 << 20):.0f} MiB" if count >= 1 << 20 else f"{count} bytes"


class _NotReadable(Exception):
    """A file that _read_bounded refuses, with why."""


def _read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of the regular file at `path` (through links), at most `limit` of them.

    Raises:
        OSError: the file cannot be opened or read.
        _NotReadable: it is no regular file (a FIFO, whose open and read would wait for a writer; a device, which
            may never end), or it holds more than `limit` bytes; its message is a predicate ("is a FIFO ...").
    """
    # O_NONBLOCK: opening a FIFO would wait for a writer before fstat could refuse it; a regular file ignores it
    handle = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(handle, "rb") as file:
        mode = os.fstat(handle).st_mode
        if stat.S_ISFIFO(mode):
            raise _NotReadable("is a FIFO (a named pipe), not a regular file: reading it would wait for a writer")
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            raise _NotReadable("is a device, not a regular file: reading it may never end")
        if not stat.S_ISREG(mode):
            raise _NotReadable("is not a regular file")
        content = file.read(limit + 1)
    if len(content) > limit:
        raise _NotReadable(f"holds more than {_size(limit)}, the most this reads of it")
    return content


def read_json_bounded(path: Path):
    """json.loads of the file at `path`, read as read_json_file reads a file (a regular file, through links, of at
    most JSON_FILE_LIMIT bytes, as UTF-8), for callers with messages of their own.

    Raises:
        OSError: it cannot be opened or read.
        ValueError: it is no regular file, holds more than the limit, or is no UTF-8 JSON.
        RecursionError: its JSON nests deeper than the parser goes.
    """
    try:
        content = _read_bounded(Path(path), JSON_FILE_LIMIT)
    except _NotReadable as exc:
        raise ValueError(f"the file {exc}") from None
    return json.loads(content.decode("utf-8"))


def read_json_object(
    path: Path, error: type[ToolkitError], what: str, fix: str, toml: bool = False, repeated_keys: bool = False
) -> dict:
    """The JSON object the file at `path` holds (a .toml file's table, when `toml`).

    Args:
        path: the file to read, as UTF-8 whatever the locale.
        error: the ToolkitError subclass raised when the file is unreadable, not JSON (or TOML), or no object.
        what: the option or the file's role, which the message names ("--config").
        fix: what to do, the message's last clause.
        toml: read a file whose name ends in .toml as TOML.
        repeated_keys: take a key given twice in one object at its last value, for files that other readers
            read so; otherwise it is refused (TOML refuses it itself).

    Raises:
        ToolkitError: `error`, naming `what` and the path and saying `fix`.
    """
    return read_json_file(path, error, what, fix, toml, repeated_keys)[1]


def read_json_file(
    path: Path,
    error: type[ToolkitError],
    what: str,
    fix: str,
    toml: bool = False,
    repeated_keys: bool = False,
    limit: int = JSON_FILE_LIMIT,
) -> tuple[bytes, dict]:
    """read_json_object's object with the bytes it was read from, for a caller that hashes or copies them.

    Args:
        path: the file to read.
        error: the ToolkitError subclass to raise.
        what: the option or the file's role, which the message names.
        fix: what to do, the message's last clause.
        toml: read a file whose name ends in .toml as TOML.
        repeated_keys: take a key given twice at its last value rather than refuse it.
        limit: the most bytes the file may hold; a file that is no regular file is refused too.

    Returns:
        (the file's bytes, the object they hold).
    """
    path = Path(path)
    kind = "TOML" if toml and path.suffix == ".toml" else "JSON"
    try:
        content = _read_bounded(path, limit)
    except _NotReadable as exc:
        raise error(f"{what} {path} {exc}; {fix}") from None
    except OSError as exc:
        raise error(f"{what} {path} is not a readable {kind} file ({exc.strerror or exc}); {fix}") from None
    try:
        text = content.decode("utf-8")  # JSON and TOML are UTF-8 whatever the locale
        data = (
            tomllib.loads(text)
            if kind == "TOML"
            else json.loads(text, object_pairs_hook=None if repeated_keys else _refuse_repeated_keys)
        )
    except _RepeatedKey as exc:
        raise error(f"{what} {path} gives the key {exc.args[0]!r} twice; keep one") from None
    except (OSError, ValueError, RecursionError) as exc:  # not UTF-8, invalid JSON or TOML, or nested too deep
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc, 200)
        raise error(f"{what} {path} is not a readable {kind} file ({reason}); {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{what} {path} holds a JSON {json_type(data)}, not a JSON object; {fix}")
    return content, data


def read_text_file(path, argument: str) -> str:
    """The UTF-8 text of the file at `path`, or InputError naming it and `argument` (the parameter it was given as)."""
    source = shown_path(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"`{argument}` {source}: {exc.strerror or exc}; give a UTF-8 text file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"`{argument}` {source} is not UTF-8 text ({exc.reason} at byte {exc.start}); give UTF-8 text"
        ) from None
