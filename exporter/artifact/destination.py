"""The destination of an export: its refusals, the hidden folder it is built in, and the swap into place.

An export is built in a hidden sibling of its destination (.NAME.partial-PID-*), named for its process so that a
later export can tell whether the one that made it still runs, and renamed into place only once it is complete;
an earlier artifact there is moved aside (.NAME.old-PID-*) and removed only after the new one is in place. Under
folder_lock, so that a second export into the same folder swaps its result in before or after, never between.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from exporter.artifact.manifest import MANIFEST, listed_files
from exporter.artifact.paths import check_output_path, check_text_path, folder_lock, parents_removed_unless_done
from exporter.errors import OutputPathError, first_line, first_of

log = logging.getLogger(__name__)


def check_destination(folder) -> None:
    """Refuse a destination that cannot be written, or whose replacement would lose what this toolkit did not
    write: before the export runs, so that nothing is spent on an export that cannot land. export_artifact makes
    these refusals first; a caller makes them before building the model, as reading a checkpoint can take minutes."""
    folder = Path(os.path.abspath(folder))
    # onnx.checker takes the path of the graphs it checks, as UTF-8: the export would be spent before it failed
    check_text_path(folder, "output folder", "choose an output folder whose path is UTF-8 (`folder`)", OutputPathError)
    try:
        check_output_path(folder, "output folder", folder=True)
    except OutputPathError as exc:  # named as this function's other refusals name it
        raise OutputPathError(f"{exc} (`folder`)") from None
    if folder.is_symlink():  # the swap into place would replace the link, not what it points to
        raise OutputPathError(
            f"output folder {folder} is a symbolic link; pass the folder it points to "
            f"({folder.resolve()}) or another output folder (`folder`)"
        )
    if os.path.ismount(folder):  # the rename of the built folder onto it fails with "Device or resource busy"
        raise OutputPathError(
            f"output folder {folder} is a mount point, and the export is built beside its "
            "destination and then swapped in, which a mount point cannot be; export into a "
            f"folder inside it (e.g. {folder / 'artifact'})"
        )
    artifact = next((parent for parent in folder.parents if listed_files(parent) is not None), None)
    if artifact is not None:  # as --report-json and --save-optimized are: the outer one would hold an unlisted folder
        raise OutputPathError(
            f"output folder {folder} lies inside the artifact folder {artifact}, which it would "
            "change; choose another output folder (`folder`)"
        )
    if not folder.is_dir():
        return
    cwd, real = Path.cwd().resolve(), folder.resolve()
    if real == cwd or real in cwd.parents:
        raise OutputPathError(
            f"output folder {folder} holds the current directory, which replacing it would "
            "delete; run from elsewhere or choose another output folder (`folder`)"
        )
    if not any(folder.iterdir()):
        return
    listed = listed_files(folder)
    if listed is None:
        raise OutputPathError(
            f"output folder {folder} is not empty and holds no {MANIFEST} of this toolkit; "
            "refusing to overwrite files it did not write: choose another output folder "
            "(`folder`) or empty it"
        )
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if p.name not in listed)
    if foreign:
        them = "them" if len(foreign) > 1 else "it"
        raise OutputPathError(
            f"output folder {folder} holds {first_of(foreign, 5)}, which its artifact does "
            f"not list and replacing it would delete {them}; move {them} out or choose another "
            "output folder (`folder`)"
        )


def _hidden_sibling(folder: Path, kind: str) -> Path:
    """A new hidden folder beside `folder`, named for this process, so that a later export can tell whether the
    export that made it is still running."""
    return Path(tempfile.mkdtemp(prefix=f".{folder.name}.{kind}-{os.getpid()}-", dir=folder.parent))


def _process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: running, as far as this one can tell
        pass
    return True


def clear_interrupted(folder: Path) -> list[Path]:
    """Clear the hidden folders that an export stopped where no cleanup could run (SIGKILL, SIGHUP, a power cut)
    left beside `folder`; those of a running export are left alone. One killed between the two renames of the swap
    had moved the earlier artifact aside, into .NAME.old-*: that artifact is put back first where `folder` is
    missing or an empty folder (made since). Returns the .NAME.old-* folders that still hold something (an earlier
    artifact whose place another has taken), which the caller removes only once its new artifact is in place: what
    may be the only complete copy is never deleted before another is."""
    pattern = re.compile(rf"\.{re.escape(folder.name)}\.(partial|old)-(\d+)-[^/]+")
    kept = []
    for leftover in sorted(folder.parent.glob(f".{glob.escape(folder.name)}.*-*")):
        match = pattern.fullmatch(leftover.name)
        if match is None or _process_running(int(match[2])):
            continue
        if match[1] == "old" and (leftover / folder.name).is_dir():
            if _vacant(folder):
                if os.path.lexists(folder):
                    folder.rmdir()
                os.rename(leftover / folder.name, folder)
                log.warning("put back %s, which an interrupted export moved aside to %s", folder.name, leftover.name)
            else:
                kept.append(leftover)
                continue
        _remove_leftover(leftover, folder)
    return kept


def _vacant(folder: Path) -> bool:
    """Nothing at `folder`, or an empty folder (no link): where an artifact moved aside can be put back."""
    if not os.path.lexists(folder):
        return True
    return folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir())


def _remove_leftover(leftover: Path, folder: Path) -> None:
    shutil.rmtree(leftover, ignore_errors=True)
    if not leftover.exists():
        log.warning("removed %s, left beside %s by an interrupted export", leftover.name, folder.name)


def move_into_place(built: Path, folder: Path) -> None:
    """Swap the finished folder in; an earlier artifact is removed only after the new one is in place."""
    old = None
    if folder.exists():
        old = _hidden_sibling(folder, "old")
    try:
        if old is not None:
            try:
                os.rename(folder, old / folder.name)
            except FileNotFoundError:  # gone since the line above: moved aside by another export's swap
                raise _overtaken(folder) from None
            except OSError as exc:
                raise OutputPathError(
                    f"cannot replace {folder} ({exc.strerror}); the earlier artifact is "
                    "untouched, the new one was not kept"
                ) from None
        try:
            os.rename(built, folder)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):  # another export's folder landed there meanwhile
                raise _overtaken(folder) from None
            raise
    except BaseException:
        # One handler for both renames: a Ctrl-C can land just after the first, between the two.
        if old is not None:
            if (old / folder.name).exists() and not folder.exists():
                os.rename(old / folder.name, folder)
            shutil.rmtree(old, ignore_errors=True)  # empty, or the earlier artifact once the new one is in place
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _overtaken(folder: Path) -> OutputPathError:
    """Two exports to one folder, swapping their results in at the same moment: the other one's stays."""
    return OutputPathError(
        f"another process replaced {folder} while this export was moving its result there (two "
        "exports to one folder?): the folder holds the other's artifact, and this one was not "
        "kept; export again once the other is done, or into another folder (`folder`)"
    )


def _write_failed(folder: Path, exc: OSError) -> OutputPathError:
    where = f" ({exc.filename})" if exc.filename else ""
    return OutputPathError(
        f"cannot write the export for {folder}: {exc.strerror or first_line(exc)}{where}; it is "
        f"built in a hidden folder beside it, .{folder.name}.partial-*, removed again, and an "
        "earlier artifact there is untouched: free space, or choose a shorter or other output "
        "folder (`folder`)"
    )


@contextlib.contextmanager
def built_in_place(folder: Path):
    """A new empty hidden folder beside `folder` (absolute) to build the artifact in, swapped into place once the
    block completes: a failed or interrupted block leaves an earlier artifact at `folder` untouched, and what an
    interrupted export left beside it is cleared first (clear_interrupted). Missing parents are made, and removed
    again when the block fails.

    Raises:
        OutputPathError: the hidden folder cannot be made or written (an OSError in the block: a full disk, a name
            too long), or the swap fails.
    """
    with parents_removed_unless_done(folder):
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            moved_aside = clear_interrupted(folder)
            built = _hidden_sibling(folder, "partial")
        except OSError as exc:
            raise _write_failed(folder, exc) from None
        umask = os.umask(0)
        os.umask(umask)
        try:
            built.chmod(0o777 & ~umask)  # mkdtemp makes it private; the artifact should not be
            yield built
            with folder_lock(folder.parent):  # a second export to this folder swaps its result in before or after
                move_into_place(built, folder)
            for leftover in moved_aside:  # earlier artifacts, once this one is in place
                _remove_leftover(leftover, folder)
        except OSError as exc:  # a full disk, a name too long for the hidden sibling: the user's to fix
            raise _write_failed(folder, exc) from None
        finally:
            shutil.rmtree(built, ignore_errors=True)
