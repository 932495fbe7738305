"""Reading a golden bundle: its two files checked against each other and against the artifact it is replayed for,
and the recording handed back as a GoldenBundle, whose RecordedReference replays it."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exporter.artifact.contract import BATCH, SEQUENCE, TOTAL
from exporter.artifact.manifest import MANIFEST, Manifest, sha256_file
from exporter.artifact.paths import read_json_bounded
from exporter.errors import InputError, ToolkitError
from exporter.tolerances.parity import Overrides
from exporter.verify.checks.greedy import GreedyTrace
from exporter.verify.inputs import ParitySettings
from exporter.verify.references.golden.bundle import (
    ARRAYS,
    BUNDLE,
    FORMAT,
    FORMAT_VERSION,
    MODULE_ENTRIES,
    GoldenMismatch,
    artifact_difference,
    recording_digest,
)
from exporter.verify.references.golden.recording import RecordedReference


@dataclass(frozen=True)
class GoldenBundle:
    reference: RecordedReference  # replays the recorded calls
    settings: ParitySettings
    overrides: Overrides  # the tolerance overrides the recording was judged with
    versions: dict  # of the recording side: torch, numpy, onnxruntime, python
    folder: Path  # where it was read from
    recorded_from: dict  # golden.json's "artifact": the config, dtype and file hashes of the artifact recorded


def load_bundle(folder: Path, manifest: Manifest) -> GoldenBundle:
    """The bundle, ready to replay; GoldenMismatch when it belongs to another artifact (config, dtype or
    file hashes), ToolkitError when it is no bundle or a damaged one."""
    folder = Path(folder)
    meta = check_bundle(folder, manifest)
    try:
        digest = sha256_file(folder / ARRAYS)
    except OSError as exc:
        raise _unreadable(folder, exc) from None
    # before numpy reads it: numpy answers a file that is no archive with advice to load it unpickled
    if digest != meta.get("arrays_sha256"):
        raise _damaged(
            folder,
            ValueError(
                f"{ARRAYS} is not the file {BUNDLE} was written with (sha256 differs): "
                "an interrupted save, or values changed since"
            ),
        )
    try:
        if not zipfile.is_zipfile(folder / ARRAYS):
            raise ValueError(f"{ARRAYS} is no npz (zip) archive")
        arrays = np.load(folder / ARRAYS, allow_pickle=False)
        if recording_digest(meta) != meta.get("recording_sha256"):
            raise ValueError(
                f"the calls, greedy runs, settings or overrides in {BUNDLE} changed since the save (sha256 differs)"
            )
        return _replay(folder, meta, arrays, manifest)
    except (
        KeyError,
        TypeError,
        AttributeError,
        ValueError,
        IndexError,
        InputError,
        OSError,
        zipfile.BadZipFile,
    ) as exc:
        raise _damaged(folder, exc) from None


def check_loaded(bundle: GoldenBundle, manifest: Manifest) -> GoldenBundle:
    """A bundle load_bundle read earlier, held to `manifest` as load_bundle holds its folder: GoldenMismatch when
    it was recorded from another artifact."""
    _check_artifact(bundle.folder, manifest, bundle.recorded_from)
    return bundle


def check_bundle(folder: Path, manifest: Manifest) -> dict:
    """The bundle's description, once its format is known, it was recorded from this artifact and its
    tolerance overrides read (what load_bundle checks before it reads the arrays)."""
    folder = Path(folder)
    try:
        meta = read_json_bounded(folder / BUNDLE)
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise _unreadable(folder, exc) from None
    try:
        _check_identity(folder, manifest, meta)
        recorded_overrides(meta)
    except (KeyError, TypeError, AttributeError, InputError) as exc:
        raise _damaged(folder, exc) from None
    return meta


def _unreadable(folder: Path, exc: Exception) -> ToolkitError:
    if folder.is_file():  # golden.json itself, say: errno 20 named "golden.json/golden.json"
        parent = f": {folder.parent}" if folder.name in (BUNDLE, ARRAYS) else ""
        return ToolkitError(f"{folder} is a file, not a golden bundle; pass the folder that holds {BUNDLE}{parent}")
    if (folder / MANIFEST).is_file() and not (folder / BUNDLE).exists():
        return ToolkitError(
            f"{folder} is an artifact folder, not a golden bundle; pass the folder that `golden_save` "
            f"wrote ({BUNDLE} and {ARRAYS})"
        )
    return ToolkitError(f"{folder} is not a readable golden bundle ({exc}); record one with `golden_save`")


def _damaged(folder: Path, exc: Exception) -> ToolkitError:
    return ToolkitError(
        f"golden bundle {folder} is damaged ({type(exc).__name__}: {exc}); re-record it with `golden_save`"
    )


def misplaced_bundle_hint(folders, golden_flag: str, folder_flag: str) -> str:
    """For the golden bundles among `folders` (golden.json and no manifest.json), given where an artifact folder goes:
    a hint to append to the error that refused them, naming the option a bundle goes to ("" when none is one)."""
    bundles = [str(f) for f in folders if (Path(f) / BUNDLE).is_file() and not (Path(f) / MANIFEST).exists()]
    return (
        f" ({', '.join(bundles)}: a golden bundle; pass it as {golden_flag}, with the artifact it was recorded "
        f"from as {folder_flag})"
        if bundles
        else ""
    )


def _check_identity(folder: Path, manifest: Manifest, meta: dict) -> None:
    version = meta.get("format_version")
    if meta.get("format") != FORMAT or version != FORMAT_VERSION:
        later = meta.get("format") == FORMAT and isinstance(version, int) and version > FORMAT_VERSION
        raise ToolkitError(
            f"{folder / BUNDLE} is format {meta.get('format')!r} v{version}, expected {FORMAT!r} "
            f"v{FORMAT_VERSION}; "
            + ("a later version of this toolkit wrote it: upgrade the toolkit, or " if later else "")
            + "re-record it with `golden_save`"
        )
    _check_artifact(folder, manifest, meta["artifact"])


def _check_artifact(folder: Path, manifest: Manifest, theirs: dict) -> None:
    """GoldenMismatch unless the artifact the bundle was recorded from (golden.json's "artifact") is `manifest`'s."""
    difference = artifact_difference(manifest, theirs)
    if difference is None:
        return
    other, detail = difference
    if other == "model":
        raise GoldenMismatch(
            f"golden bundle {folder} belongs to another model ({detail}); verify against a bundle "
            "recorded from this artifact"
        )
    raise GoldenMismatch(
        f"golden bundle {folder} was recorded from another export: {detail}; re-record the bundle from this artifact"
    )


def recorded_overrides(meta: dict) -> Overrides:
    """The tolerance overrides a bundle's golden.json records; InputError when the field is missing or is no
    table of tolerance terms."""
    if "overrides" not in meta:
        raise InputError(f"{BUNDLE} records no tolerance overrides, which a v{FORMAT_VERSION} bundle holds")
    return Overrides.from_dict(meta["overrides"], f"{BUNDLE} overrides")


def _replay(folder: Path, meta: dict, arrays, manifest: Manifest) -> GoldenBundle:
    calls = [
        (c["kind"], {k: arrays[f"{i}/feed/{k}"] for k in c["feeds"]}, {k: arrays[f"{i}/out/{k}"] for k in c["outputs"]})
        for i, c in enumerate(meta["calls"])
    ]
    for index, (kind, feeds, outputs) in enumerate(calls):
        _check_call(index, kind, feeds, outputs, manifest)
    routing = [
        {
            layer: (arrays[f"{i}/router/{layer}/scores"], arrays[f"{i}/router/{layer}/ids"])
            for layer in c["routed_layers"]
        }
        for i, c in enumerate(meta["calls"])
    ]
    greedy = {
        (tuple(g["prompt"]), g["max_new_tokens"], g["eos"]): GreedyTrace(
            g["ids"],
            arrays[f"greedy/{i}/logits"],
            [
                {
                    layer: (
                        arrays[f"greedy/{i}/router/{call}/{layer}/scores"],
                        arrays[f"greedy/{i}/router/{call}/{layer}/ids"],
                    )
                    for layer in layers
                }
                for call, layers in enumerate(g.get("routed_layers", []))
            ],
        )
        for i, g in enumerate(meta["greedy"])
    }
    vocab = manifest.config.vocab_size
    for (prompt, n, eos), trace in greedy.items():
        ids = [*prompt, *trace.ids, *([] if eos is None else [eos])]
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids) or n < 1:
            raise ValueError(f"a greedy run holds ids outside the vocabulary [0, {vocab}) or {n} new tokens")
    module_outputs = {}
    for graph, prefixes in MODULE_ENTRIES.items():
        feeds, outputs = (_entries(arrays, prefix) for prefix in prefixes)
        if feeds or outputs:  # else recorded before this graph's were kept
            _check_module_outputs(graph, feeds, outputs, manifest)
            module_outputs[graph] = feeds, outputs
    # a bundle recorded before the long-context check holds none of its calls: it replays without it
    settings = {"long_context": False, **meta["settings"]}
    if not all(isinstance(v, int) and v >= 0 for k, v in settings.items() if k not in ("sweep", "probe")):
        raise ValueError(f"settings must be integers of at least 0, got {settings}")
    return GoldenBundle(
        RecordedReference(None, calls, greedy, f"golden bundle {folder}", routing, module_outputs),
        ParitySettings(**settings),
        recorded_overrides(meta),
        meta["versions"],
        Path(folder),
        meta["artifact"],
    )


def _check_call(index: int, kind: str, feeds: dict, outputs: dict, manifest: Manifest) -> None:
    """A recorded call holds what its graph returns, each output shaped as the contract says."""
    contract = manifest.contract(kind)
    ids = feeds["input_ids"]
    if ids.ndim != 2:
        raise ValueError(f"call {index}: input_ids has shape {ids.shape}, expected (batch, sequence)")
    if sorted(outputs) != sorted(contract.output_names):
        raise ValueError(
            f"call {index} ({kind}) holds the outputs {sorted(outputs)}, expected {sorted(contract.output_names)}"
        )
    # a decode call's stored present keeps the new positions only (see RecordedReference._stored)
    _check_shapes(f"call {index} ({kind})", contract.outputs, outputs, ids.shape)


def _entries(arrays, prefix: str) -> dict:
    """The arrays.npz entries under `prefix`, by the rest of their names."""
    return {name[len(prefix) :]: arrays[name] for name in arrays.files if name.startswith(prefix)}


def _check_module_outputs(graph: str, feeds: dict, outputs: dict, manifest: Manifest) -> None:
    """Recorded module outputs are floating-point values of one call of `graph` on 2-D token feeds (a decode
    call's attention mask covers its past too), among them its presents in the contract's shapes."""
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    total = mask.shape[-1] if graph == "decode" and mask.ndim == 2 else ids.shape[-1]
    if (
        ids.ndim != 2
        or feeds["position_ids"].shape != ids.shape
        or mask.shape != (ids.shape[0], total)
        or total < ids.shape[1]
    ):
        raise ValueError(
            f"the {graph} module outputs' token feeds have shapes {[feeds[k].shape for k in feeds]}, "
            "expected one (batch, sequence) and an attention mask over the past too in a decode call"
        )
    not_floating = sorted(name for name, value in outputs.items() if not np.issubdtype(value.dtype, np.floating))
    if not_floating:
        raise ValueError(f"the module outputs {not_floating} hold no floating-point values")
    contract = manifest.contract(graph)
    presents = [spec for spec in contract.outputs if spec.name.startswith("present.")]
    missing = [spec.name for spec in presents if spec.name not in outputs]
    if missing:
        raise ValueError(f"the {graph} module outputs lack the presents {missing}")
    _check_shapes(f"{graph} module outputs", presents, outputs, ids.shape, total)


def _check_shapes(where: str, specs, outputs: dict, tokens: tuple[int, int], total: int | None = None) -> None:
    """Each output of `specs` shaped as the contract says, for (batch, sequence) `tokens` and `total` positions
    with the past (None: the sequence, as in a prefill or a decode call's stored presents)."""
    sizes = {BATCH: tokens[0], SEQUENCE: tokens[1], TOTAL: tokens[1] if total is None else total}
    for spec in specs:
        expected = tuple(sizes.get(axis, axis) if isinstance(axis, str) else axis for axis in spec.axes)
        shape = outputs[spec.name].shape
        if len(shape) != len(expected) or any(isinstance(e, int) and e != s for e, s in zip(expected, shape)):
            raise ValueError(f"{where}: {spec.name} has shape {shape}, expected {expected}")
