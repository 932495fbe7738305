"""Golden bundles: the reference's inputs and outputs recorded once, replayed later without torch.

RecordedReference sits where the PyTorch reference would: on the first pass
it calls the backing reference and records every call; afterwards (other
providers, or a bundle loaded from disk) it replays the recording, checking
that the token inputs are the ones recorded. Decode calls store only the new
positions of each present (the reference's present is its past with the new
positions appended), so a bundle holds each cache entry once. For MoE models
each call, and each call of a greedy run, also keeps its routers' scores and
chosen experts, so that expert choice and the routing explanation of a failing
call or of a greedy run that differs replay too (a v4 bundle recorded before
greedy runs kept them replays without that explanation). Every saved bundle also
holds the reference's module outputs (TorchRunner.module_outputs) for the prefill
batch and for the decode call the probe examines (the decode check's first failing
call, its first call when none fails), so that a replay's node-level probe names
the diverging operator in either graph as a live one does (a v4 bundle recorded
before they were kept replays without the probe, one recorded before the decode
call's were kept without the probe of decode.onnx).

A bundle folder holds golden.json (format, versions, the artifact's config,
dtype and file hashes, the settings, the tolerance overrides the recording
was judged with, the call list, the sha256 of arrays.npz and one of what
golden.json records) and arrays.npz. A replay judges with the recorded
overrides (see tolerances.AppliedOverrides). The hashes tie the two files
together: a save interrupted between them, or a stored value or id edited
since, reads as a damaged bundle, never as a numeric failure of the artifact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from exporter.artifact.contract import BATCH, SEQUENCE, TOTAL
from exporter.artifact.manifest import MANIFEST, Manifest, config_differences, sha256_file
from exporter.artifact.paths import check_output_path, folder_lock, parents_removed_unless_done, read_json_bounded
from exporter.errors import InputError, OutputPathError, ToolkitError
from exporter.tolerances import Overrides
from exporter.verify.checks.greedy import GreedyTrace
from exporter.verify.checks.routing import record_reference_routing
from exporter.verify.inputs import ParitySettings

log = logging.getLogger(__name__)

BUNDLE = "golden.json"
ARRAYS = "arrays.npz"
# 2: router choices per call; 3: the two sha256; 4: the tolerance overrides, and prefill labels that leave out
# each padded row's first real token (a v3 recording holds other labels, so it could not replay)
FORMAT, FORMAT_VERSION = "minimind-onnx-golden", 4
TOKEN_FEEDS = ("input_ids", "attention_mask", "position_ids", "labels")
# The probe's module outputs are arrays.npz entries alone, covered by its sha256: golden.json and its digest stay
# as every v4 toolkit reads them, so a toolkit from before they were kept still replays a bundle that holds them.
# graph -> (prefix of the call's token feeds, prefix of its module outputs)
MODULE_ENTRIES = {
    "prefill": ("modules/feed/", "modules/out/"),
    "decode": ("modules/decode/feed/", "modules/decode/out/"),
}


class GoldenMismatch(ToolkitError):
    """A golden bundle that does not belong to the artifact, or was recorded with other inputs."""


def _tokens(feeds: dict) -> dict:
    return {k: np.asarray(feeds[k]) for k in TOKEN_FEEDS if k in feeds}


def _same_tokens(recorded: dict, tokens: dict) -> bool:
    return recorded.keys() == tokens.keys() and all(np.array_equal(recorded[k], tokens[k]) for k in tokens)


def _identity(manifest: Manifest) -> dict:
    """What a bundle must share with an artifact: the model config, the dtype and the graphs' and weights' hashes."""
    files = [manifest.prefill.file, manifest.decode.file, manifest.weights_file]
    return {
        "config": manifest.config.to_dict(),
        "dtype": manifest.dtype,
        "sha256": {name: manifest.files[name]["sha256"] for name in files},
    }


class RecordedReference:
    """A reference that records its backing's calls, or replays a recording (a bundle loaded from disk).

    Args:
        backing: the live reference to call and record (a TorchRunner); None replays the recording alone, and a
            call it does not hold is a GoldenMismatch.
        calls: the recorded calls, in order: (kind, token feeds, stored outputs), a decode call's presents
            holding only their new positions.
        greedy: the recorded greedy runs, by (prompt, max_new_tokens, eos).
        source: the name reports give the reference; "" takes the backing's.
        routing: per recorded call, {layer: (router scores, chosen expert ids)}; None: no routers recorded.
        module_outputs: per graph ("prefill", "decode"), the token feeds of one call and the reference's module
            outputs on it, for the probe.
    """

    def __init__(
        self,
        backing=None,
        calls: list | None = None,
        greedy: dict | None = None,
        source: str = "",
        routing: list | None = None,
        module_outputs: dict[str, tuple[dict, dict]] | None = None,
    ):
        self.backing = backing
        self.calls: list[tuple[str, dict, dict]] = calls or []  # (kind, token feeds, stored outputs)
        self.routing: list[dict] = routing or [{} for _ in self.calls]  # per call: {layer: (scores, ids)}
        self.greedy_traces: dict[tuple, GreedyTrace] = greedy or {}
        # graph -> (token feeds, {module path or present name: output}) of one call of that graph; a graph is
        # absent until asked for, and in a bundle recorded before its module outputs were kept
        self.recorded_module_outputs = module_outputs or {}
        self.cursor = 0
        self.name = source or getattr(backing, "name", "recorded reference")

    def rewind(self) -> None:
        """Replay from the first call (the next provider runs the same calls in the same order)."""
        self.cursor = 0

    def _call(self, kind: str, feeds: dict) -> dict:
        tokens = _tokens(feeds)
        if self.cursor < len(self.calls):
            recorded_kind, recorded_tokens, outputs = self.calls[self.cursor]
            if recorded_kind != kind or not _same_tokens(recorded_tokens, tokens):
                raise GoldenMismatch(
                    f"call {self.cursor} ({kind}) does not match the recording: the bundle was "
                    "recorded with other inputs; re-record it with `golden_save`"
                )
        elif self.backing is None:
            raise GoldenMismatch(
                f"the bundle holds {len(self.calls)} calls and this verification needs more; "
                "re-record it with `golden_save`"
            )
        else:
            with record_reference_routing(self.backing.model) as routed:
                full = getattr(self.backing, kind)(feeds)
            outputs = {name: self._stored(kind, name, value, feeds) for name, value in full.items()}
            self.calls.append((kind, tokens, outputs))
            self.routing.append({layer: calls[-1] for layer, calls in routed.items()})
        self.cursor += 1
        return {name: self._restored(kind, name, value, feeds) for name, value in outputs.items()}

    @staticmethod
    def _stored(kind: str, name: str, value, feeds: dict):
        past = feeds.get(name.replace("present.", "past_key_values.", 1)) if kind == "decode" else None
        # a copy: a view of the new positions would keep the whole present alive, past included, for every call
        return np.asarray(value)[:, :, past.shape[2] :].copy() if past is not None else np.asarray(value)

    @staticmethod
    def _restored(kind: str, name: str, value, feeds: dict):
        past = feeds.get(name.replace("present.", "past_key_values.", 1)) if kind == "decode" else None
        return np.concatenate([past, value], axis=2) if past is not None else value

    def last_routing(self) -> dict:
        """{layer: (router scores (N, E), chosen expert ids (N, k))} of the last call; empty without routers."""
        return self.routing[self.cursor - 1]

    def prefill(self, feeds: dict) -> dict:
        return self._call("prefill", feeds)

    def decode(self, feeds: dict) -> dict:
        return self._call("decode", feeds)

    def greedy(self, prompt: list[int], max_new_tokens: int, eos: int | None) -> GreedyTrace:
        key = (tuple(prompt), max_new_tokens, eos)
        if key not in self.greedy_traces:
            if self.backing is None:
                raise GoldenMismatch("the bundle holds no greedy run for this prompt; re-record it with `golden_save`")
            with record_reference_routing(self.backing.model) as routed:
                trace = self.backing.greedy(prompt, max_new_tokens, eos)
            calls = len(next(iter(routed.values()), []))
            self.greedy_traces[key] = replace(
                trace, routing=[{layer: routed[layer][call] for layer in routed} for call in range(calls)]
            )
        return self.greedy_traces[key]

    def module_outputs(self, feeds: dict, graph: str = "prefill") -> dict | None:
        """Every reference module's output and the presents for a call of `graph` ("prefill" or "decode") on
        `feeds`, which the probe matches to the graph's values: the backing's, recorded (one call per graph, the
        latest asked for); replayed for the recorded token feeds. None without a backing when none were recorded
        for that graph (a bundle recorded before they were kept), or for a decode call other than the recorded
        one (a replay whose first failing decode call is another)."""
        tokens = _tokens(feeds)
        recorded = self.recorded_module_outputs.get(graph)
        if recorded is not None and _same_tokens(recorded[0], tokens):
            return recorded[1]
        if self.backing is None:
            if recorded is None or graph == "decode":
                return None
            raise GoldenMismatch(
                "the bundle's module outputs were recorded for other inputs than this prefill; "
                "re-record it with `golden_save`"
            )
        self.recorded_module_outputs[graph] = (tokens, self.backing.module_outputs(feeds, graph))
        return self.recorded_module_outputs[graph][1]

    def save(
        self, folder: Path, manifest: Manifest, settings: ParitySettings, overrides: Overrides, versions: dict
    ) -> Path:
        """Write the recording as a bundle, with the settings and tolerance overrides it was judged with.

        Args:
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
        for index, ((kind, tokens, outputs), routing) in enumerate(zip(self.calls, self.routing)):
            calls.append(
                {"kind": kind, "feeds": list(tokens), "outputs": list(outputs), "routed_layers": list(routing)}
            )
            arrays.update({f"{index}/feed/{k}": v for k, v in tokens.items()})
            arrays.update({f"{index}/out/{k}": v for k, v in outputs.items()})
            for layer, (scores, ids) in routing.items():
                arrays[f"{index}/router/{layer}/scores"], arrays[f"{index}/router/{layer}/ids"] = scores, ids
        greedy = []
        for index, ((prompt, n, eos), trace) in enumerate(self.greedy_traces.items()):
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
        for graph, (tokens, outputs) in self.recorded_module_outputs.items():
            feeds_prefix, outputs_prefix = MODULE_ENTRIES[graph]
            arrays.update({f"{feeds_prefix}{k}": v for k, v in tokens.items()})
            arrays.update({f"{outputs_prefix}{k}": v for k, v in outputs.items()})
        with parents_removed_unless_done(folder / BUNDLE):  # the bundle's folder too, when this save made it
            folder.mkdir(parents=True, exist_ok=True)
            with folder_lock(folder):  # a second save into this folder writes its files before or after
                self._write(folder, arrays, manifest, settings, overrides, versions, calls, greedy)
        log.info(
            "golden bundle written to %s (%d calls, %.1f MB)",
            folder,
            len(calls),
            (folder / ARRAYS).stat().st_size / 1e6,
        )
        return folder

    def _write(self, folder, arrays, manifest, settings, overrides, versions, calls, greedy) -> None:
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
                "artifact": _identity(manifest),
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
            meta["recording_sha256"] = _recording_digest(meta)
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
        if _recording_digest(meta) != meta.get("recording_sha256"):
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


def _recording_digest(meta: dict) -> str:
    """The sha256 of what golden.json records (with the arrays' own hash): an edited id, setting or override
    would otherwise read as a failure of the artifact."""
    recorded = {key: meta[key] for key in ("arrays_sha256", "settings", "overrides", "calls", "greedy")}
    return hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()


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
        difference = _artifact_difference(manifest, read_json_bounded(folder / BUNDLE)["artifact"])
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return  # unreadable or damaged: what re-recording it is for
    if difference is not None:
        other, detail = difference
        raise OutputPathError(
            f"`golden_save` {folder} holds a golden bundle recorded from another "
            f"{other} ({detail}), which this save would replace; remove it or choose another folder"
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
    difference = _artifact_difference(manifest, theirs)
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


def _artifact_difference(manifest: Manifest, theirs: dict) -> tuple[str, str] | None:
    """How the artifact a bundle was recorded from (golden.json's "artifact") differs from `manifest`'s: ("model",
    its config or dtype) or ("export", the files whose hashes differ); None when it is the same."""
    ours = _identity(manifest)
    if theirs["config"] != ours["config"] or theirs["dtype"] != ours["dtype"]:
        changed = config_differences(ours["config"], theirs["config"])
        if len(changed) > 5:  # another family's config differs in every field: 25 names hid the message's end
            changed = [f"{len(changed)} config fields, among them {', '.join(changed[:5])}"]
        if theirs["dtype"] != ours["dtype"]:  # named only when it differs: "bundle float32, artifact float32" misled
            changed.append(f"dtype: bundle {theirs['dtype']}, artifact {ours['dtype']}")
        return "model", f"differs in {', '.join(changed)}"
    changed = [name for name, digest in ours["sha256"].items() if theirs["sha256"].get(name) != digest]
    return ("export", f"{', '.join(changed)} differ(s) in sha256") if changed else None


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
