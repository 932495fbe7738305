"""Writing a golden bundle: a recording saved over an older bundle whole or not at all, and the folder
`golden_save` may write into."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from exporter.artifact.manifest import Manifest, sha256_file
from exporter.artifact.paths import check_output_path, folder_lock, parents_removed_unless_done, read_json_bounded
from exporter.errors import OutputPathError
from exporter.tolerances.parity import Overrides
from exporter.verify.inputs import ParitySettings
from exporter.verify.references.golden.bundle import (
    ARRAYS,
    BUNDLE,
    FORMAT,
    FORMAT_VERSION,
    MODULE_ENTRIES,
    artifact_difference,
    identity,
    recording_digest,
)

if TYPE_CHECKING:
    from exporter.verify.references.golden.recording import RecordedReference

log = logging.getLogger(__name__)


def save_bundle(
    reference: RecordedReference,
    folder: Path,
    manifest: Manifest,
    settings: ParitySettings,
    overrides: Overrides,
    versions: dict,
) -> Path:
    """Write `reference`'s recording as a bundle, with the settings and tolerance overrides it was judged with.

    Args:
        reference: the recording reference whose calls, greedy runs and module outputs the bundle holds.
        folder: the bundle's folder, made when missing; an older bundle there is replaced whole, or kept
            whole when the save fails.
        manifest: the recorded artifact's manifest, whose config, dtype and hashes tie the bundle to it.
        settings: the verification's settings the calls were made with.
        overrides: the tolerance overrides the recording was judged with, which a replay applies.
        versions: those of the reference side (e.g. torch).

    Returns:
        The folder.

    Raises:
        OutputPathError: the bundle cannot be written.
    """
    folder = Path(folder)
    arrays, calls = {}, []
    for index, ((kind, tokens, outputs), routing) in enumerate(zip(reference.calls, reference.routing)):
        calls.append({"kind": kind, "feeds": list(tokens), "outputs": list(outputs), "routed_layers": list(routing)})
        arrays.update({f"{index}/feed/{k}": v for k, v in tokens.items()})
        arrays.update({f"{index}/out/{k}": v for k, v in outputs.items()})
        for layer, (scores, ids) in routing.items():
            arrays[f"{index}/router/{layer}/scores"], arrays[f"{index}/router/{layer}/ids"] = scores, ids
    greedy = []
    for index, ((prompt, n, eos), trace) in enumerate(reference.greedy_traces.items()):
        greedy.append(
            {
                "prompt": list(prompt),
                "max_new_tokens": n,
                "eos": eos,
                "ids": trace.ids,
                "routed_layers": [list(routing) for routing in trace.routing],
            }
        )
        arrays[f"greedy/{index}/logits"] = trace.logits
        for call, routing in enumerate(trace.routing):
            for layer, (scores, ids) in routing.items():
                key = f"greedy/{index}/router/{call}/{layer}"
                arrays[f"{key}/scores"], arrays[f"{key}/ids"] = scores, ids
    for graph, (tokens, outputs) in reference.recorded_module_outputs.items():
        feeds_prefix, outputs_prefix = MODULE_ENTRIES[graph]
        arrays.update({f"{feeds_prefix}{k}": v for k, v in tokens.items()})
        arrays.update({f"{outputs_prefix}{k}": v for k, v in outputs.items()})
    with parents_removed_unless_done(folder / BUNDLE):  # the bundle's folder too, when this save made it
        folder.mkdir(parents=True, exist_ok=True)
        with folder_lock(folder):  # a second save into this folder writes its files before or after
            _write(folder, arrays, manifest, settings, overrides, versions, calls, greedy)
    log.info(
        "golden bundle written to %s (%d calls, %.1f MB)",
        folder,
        len(calls),
        (folder / ARRAYS).stat().st_size / 1e6,
    )
    return folder


def _write(folder, arrays, manifest, settings, overrides, versions, calls, greedy) -> None:
    """Over an older bundle: each file is written aside and swapped in, the index last, the older arrays kept
    (a hard link) until the index is swapped too. An interrupted or failed save leaves the older bundle whole;
    only a kill between the two swaps (no cleanup runs) leaves its index with the new arrays, whose hash it
    then refuses."""
    partial_arrays, partial_index = folder / f".{ARRAYS}.partial", folder / f".{BUNDLE}.partial"
    previous = folder / f".{ARRAYS}.previous"
    try:
        with open(partial_arrays, "wb") as f:  # a file object: savez would append .npz to a name
            np.savez(f, **arrays)
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "artifact": identity(manifest),
            "arrays_sha256": sha256_file(partial_arrays),
            "settings": settings.to_dict(),
            "overrides": overrides.to_dict(),
            "calls": calls,
            "greedy": greedy,
            "versions": {
                **versions,
                "numpy": np.__version__,
                "onnxruntime": ort.__version__,
                "python": platform.python_version(),
            },
        }
        meta["recording_sha256"] = recording_digest(meta)
        partial_index.write_text(json.dumps(meta, indent=1) + "\n")
        _keep_previous(folder / ARRAYS, previous)
        os.replace(partial_arrays, folder / ARRAYS)
        os.replace(partial_index, folder / BUNDLE)
    except OSError as exc:
        raise OutputPathError(
            f"cannot write the golden bundle {folder} ({exc.strerror or exc}); choose another `golden_save` folder"
        ) from None
    finally:  # after an interrupt too: a partial file left would make the next save refuse the folder
        if partial_index.exists() and previous.exists():  # the index was not swapped: the older arrays back
            os.replace(previous, folder / ARRAYS)
        previous.unlink(missing_ok=True)
        partial_arrays.unlink(missing_ok=True)
        partial_index.unlink(missing_ok=True)


def _keep_previous(arrays: Path, previous: Path) -> None:
    """A second name for an older bundle's arrays, which the swap of the new ones would otherwise drop before the
    index that lists them is swapped too. Without hard links (a FAT drive, say) there is none."""
    previous.unlink(missing_ok=True)  # one a killed save left
    if arrays.is_file():
        with contextlib.suppress(OSError):
            os.link(arrays, previous)


def check_golden_destination(folder: Path, manifest: Manifest | None = None) -> None:
    """golden_save writes golden.json and arrays.npz: into a new or empty folder, or over an older bundle; with
    `manifest`, only over one recorded from that artifact (re-recording it), not another's, which it would lose."""
    check_output_path(folder, "`golden_save`", folder=True)
    folder = Path(folder)
    if folder.is_dir() and any(folder.iterdir()) and not (folder / BUNDLE).is_file():
        raise OutputPathError(
            f"`golden_save` {folder} is not empty and holds no golden bundle; choose a new or empty folder"
        )
    if manifest is None or not (folder / BUNDLE).is_file():
        return
    try:
        difference = artifact_difference(manifest, read_json_bounded(folder / BUNDLE)["artifact"])
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return  # unreadable or damaged: what re-recording it is for
    if difference is not None:
        other, detail = difference
        raise OutputPathError(
            f"`golden_save` {folder} holds a golden bundle recorded from another "
            f"{other} ({detail}), which this save would replace; remove it or choose another folder"
        )
