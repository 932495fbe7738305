"""Output paths checked before any work is spent on what would be written there."""

from __future__ import annotations

import os
from pathlib import Path

from exporter.errors import OutputPathError


def check_output_path(path: Path, option: str, folder: bool) -> None:
    """`path` (a file, or a folder when `folder`) can be created or replaced by this process."""
    path = Path(os.path.abspath(path))
    if path.exists() and path.is_dir() != folder:
        found, wanted = ("a folder", "a file") if path.is_dir() else ("a file", "a folder")
        raise OutputPathError(f"{option} {path} is {found}; give the path of {wanted}")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing != path and not existing.is_dir():
        raise OutputPathError(f"{option} {path} lies under {existing}, which is a file; choose another path")
    for target in ([path, path.parent] if existing == path else [existing]):
        if not os.access(target, os.W_OK | os.X_OK if target.is_dir() else os.W_OK):
            raise OutputPathError(f"{option}: cannot write to {target} (permission denied); choose another path")
