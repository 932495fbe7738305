"""Plain-text tables of results, for people; the result objects' to_dict() is for machines."""

from __future__ import annotations

from typing import TYPE_CHECKING

from exporter.artifact.consumers import ModelSizes
from exporter.artifact.manifest import Manifest
from exporter.verify.reports.text import table as _table

if TYPE_CHECKING:  # the export module imports torch, which inspect must not need
    from exporter.export.pipeline import ExportResult


def _files_table(files: dict, status: dict | None = None) -> str:
    """The files as the manifest lists them; with `status` (manifest.file_status), a column of their state."""
    rows = [
        [name, f"{entry['bytes'] / 1e6:.2f} MB", entry["sha256"][:16]] + ([status[name]] if status else [])
        for name, entry in files.items()
    ]
    return _table(["file", "size", "sha256"] + (["status"] if status else []), rows)


def _quantized(manifest) -> str:
    q = manifest.quantization
    if q is None:
        return ""
    kept = "; ".join(q.kept_float) or "nothing"
    return (
        f"{q.matrices} weight matrices as {q.bits}-bit blocks of {q.block_size} (accuracy level "
        f"{q.accuracy_level}, {q.algorithm}, lm_head {q.lm_head}, embedding {q.embedding}): "
        f"{q.float_bytes / 1e6:.2f} MB "
        f"{manifest.dtype} -> {q.quantized_bytes / 1e6:.2f} MB ({q.ratio:.2f}x); kept float: {kept}; activations "
        f"and cache {manifest.dtype}\n"
    )


def _smoothing_lines(manifest) -> list[str]:
    """An int8 export that smoothed its projections' inputs: how, and what it measured them on; [] otherwise."""
    q = manifest.quantization
    if q is None or q.smoothing is None:
        return []
    return [
        f"  smoothing: the inputs of the 8-bit projections at accuracy level 4 divided per channel (alpha "
        f"{q.smoothing.alpha:g}), measured on {q.smoothing.calibration}"
    ]


def _target_lines(manifest) -> list[str]:
    """An export made to a quality target: its mix (how many modules at each precision, by the kind of module) and
    the target with the figures it measured on held-out text; [] for any other artifact."""
    q = manifest.quantization
    if q is None or (not q.mix and q.target is None):
        return []
    groups: dict[tuple, dict[str, int]] = {}
    for entry in q.mix:
        kinds = groups.setdefault((entry.precision, entry.accuracy_level, entry.algorithm), {})
        kind = entry.module.rsplit(".", 1)[-1]
        kinds[kind] = kinds.get(kind, 0) + 1
    lines = [
        f"  mix: {sum(kinds.values())} module(s) at {precision}"
        + (f" (accuracy level {level}, {algorithm})" if precision != "float" else "")
        + ": "
        + ", ".join(f"{kind} x{count}" for kind, count in kinds.items())
        for (precision, level, algorithm), kinds in groups.items()
    ] or [f"  mix: none, every projection at {q.scheme}"]
    if q.target is not None:
        m = q.target.measured
        figures = (
            f"held-out mean KL {m['kl_mean']:.4g} [{m['kl_mean_interval'][0]:.4g}, {m['kl_mean_interval'][1]:.4g}], "
            f"p99 KL {m['kl_p99']:.4g}, top-1 {m['top1_agreement']:.3f} over {m['positions']} positions of {m['text']}"
            if {"kl_mean", "kl_mean_interval", "kl_p99", "top1_agreement", "positions", "text"} <= set(m)
            else "no held-out figures recorded"
        )
        lines.append(f"  quality target {q.target.describe()}: {figures}")
    return lines


def format_export(result: ExportResult) -> str:
    manifest = result.manifest
    return (
        f"exported {result.folder} ({manifest.precision}) in {result.seconds:.1f} s, {result.bytes / 1e6:.1f} MB\n"
        + _quantized(manifest)
        + "".join(f"{line.strip()}\n" for line in _smoothing_lines(manifest) + _target_lines(manifest))
        + _files_table(manifest.files)
    )


def describe_source(source: dict) -> str:
    """Where an artifact's weights came from, as a line for people: "seeded preset minimind-3, seed 0", or the
    kind followed by its other fields as key=value."""
    if source.get("kind") == "seeded":
        return f"seeded preset {source.get('preset')}, seed {source.get('seed')}"
    fields = [f"{k}={v}" for k, v in source.items() if k != "kind" and v not in ({}, [])]  # empty: nothing to say
    return ", ".join([str(source.get("kind", "unknown"))] + fields)


ASSUMED_AS = {
    "num_attention_heads": "num_attention_heads as the kv heads",
    "hidden_size": "hidden_size as heads x head_dim",
}


def format_inspect(manifest: Manifest, folder: str, status: dict) -> str:
    sizes = ModelSizes.of(manifest)  # the sizes every family has, as the consumers' configs state them
    lines = [
        f"artifact {folder}",
        f"  model: {manifest.family}, {sizes.num_hidden_layers} layers, hidden {sizes.hidden_size}, "
        f"heads {sizes.num_attention_heads}/{sizes.num_key_value_heads}, vocab {sizes.vocab_size}, "
        f"max positions {sizes.context_length}",
        *(
            [
                "  assumed, not given by the config (in config.json and genai_config.json): "
                + ", ".join(ASSUMED_AS[name] for name in sizes.assumed)
            ]
            if sizes.assumed
            else []
        ),
        f"  weights from: {describe_source(manifest.source)}",
        f"  dtype {manifest.precision}"
        + (f" (activations and cache {manifest.dtype})" if manifest.quantization is not None else "")
        + f", opset {manifest.opset}, weights file {manifest.weights_file}",
        *_smoothing_lines(manifest),
        *_target_lines(manifest),
        "  versions: " + ", ".join(f"{k} {v}" for k, v in manifest.versions.items()),
    ]
    for contract in (manifest.prefill, manifest.decode):
        rows = [
            [direction, spec.name, spec.dtype, "[" + ", ".join(map(str, spec.axes)) + "]"]
            for direction, specs in (("in", contract.inputs), ("out", contract.outputs))
            for spec in specs
        ]
        lines += ["", contract.file, _table(["", "name", "dtype", "axes"], rows)]
    lines += ["", _files_table(manifest.files, status)]
    return "\n".join(lines)
