"""A golden bundle's files and format, and what ties it to the artifact it was recorded from: the artifact's
config, dtype and file hashes (its identity), and the sha256 of what golden.json records, which ties golden.json
to arrays.npz."""

from __future__ import annotations

import hashlib
import json

from exporter.artifact.manifest import Manifest, config_differences
from exporter.errors import ToolkitError

BUNDLE = "golden.json"
ARRAYS = "arrays.npz"
# 2: router choices per call; 3: the two sha256; 4: the tolerance overrides, and prefill labels that leave out
# each padded row's first real token (a v3 recording holds other labels, so it could not replay)
FORMAT, FORMAT_VERSION = "minimind-onnx-golden", 4
# The probe's module outputs are arrays.npz entries alone, covered by its sha256: golden.json and its digest stay
# as every v4 toolkit reads them, so a toolkit from before they were kept still replays a bundle that holds them.
# graph -> (prefix of the call's token feeds, prefix of its module outputs)
MODULE_ENTRIES = {
    "prefill": ("modules/feed/", "modules/out/"),
    "decode": ("modules/decode/feed/", "modules/decode/out/"),
}


class GoldenMismatch(ToolkitError):
    """A golden bundle that does not belong to the artifact, or was recorded with other inputs."""


def identity(manifest: Manifest) -> dict:
    """What a bundle must share with an artifact: the model config, the dtype and the graphs' and weights' hashes."""
    files = [manifest.prefill.file, manifest.decode.file, manifest.weights_file]
    return {
        "config": manifest.config.to_dict(),
        "dtype": manifest.dtype,
        "sha256": {name: manifest.files[name]["sha256"] for name in files},
    }


def recording_digest(meta: dict) -> str:
    """The sha256 of what golden.json records (with the arrays' own hash): an edited id, setting or override
    would otherwise read as a failure of the artifact."""
    recorded = {key: meta[key] for key in ("arrays_sha256", "settings", "overrides", "calls", "greedy")}
    return hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()


def artifact_difference(manifest: Manifest, theirs: dict) -> tuple[str, str] | None:
    """How the artifact a bundle was recorded from (golden.json's "artifact") differs from `manifest`'s: ("model",
    its config or dtype) or ("export", the files whose hashes differ); None when it is the same."""
    ours = identity(manifest)
    if theirs["config"] != ours["config"] or theirs["dtype"] != ours["dtype"]:
        changed = config_differences(ours["config"], theirs["config"])
        if len(changed) > 5:  # another family's config differs in every field: 25 names hid the message's end
            changed = [f"{len(changed)} config fields, among them {', '.join(changed[:5])}"]
        if theirs["dtype"] != ours["dtype"]:  # named only when it differs: "bundle float32, artifact float32" misled
            changed.append(f"dtype: bundle {theirs['dtype']}, artifact {ours['dtype']}")
        return "model", f"differs in {', '.join(changed)}"
    changed = [name for name, digest in ours["sha256"].items() if theirs["sha256"].get(name) != digest]
    return ("export", f"{', '.join(changed)} differ(s) in sha256") if changed else None
