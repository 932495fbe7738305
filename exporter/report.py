"""Plain-text tables of results, for people; the result objects' to_dict() is for machines."""

from __future__ import annotations

from exporter.export import ExportResult
from exporter.manifest import Manifest
from exporter.parity import VerifyReport


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in [header, ["-" * w for w in widths], *rows]]
    return "\n".join(lines)


def format_verify(report: VerifyReport) -> str:
    blocks = []
    for provider in report.reports:
        rows = [[c.name, f"{c.max_abs:.3g}", f"{c.max_rel:.3g}", f"{c.mean_abs:.3g}",
                 f"{c.tolerance.atol:g}/{c.tolerance.rtol:.3g}/{c.tolerance.peak:.3g}", "pass" if c.passed else "FAIL"]
                for c in provider.comparisons]
        greedy = provider.greedy
        rows.append(["greedy tokens", f"{greedy.match_length}/{len(greedy.reference_ids)} match", "", "", "",
                     "pass" if greedy.passed else "FAIL"])
        experts = provider.experts
        if experts is not None:
            agreement = f"{100 * experts.fraction:.2f}% agree" if experts.measured else "not measured"
            rows.append(["expert choice", agreement, "", "", "", "pass" if experts.passed else "FAIL"])
        title = f"{provider.provider} ({provider.dtype}): {'PASS' if provider.passed else 'FAIL'}"
        blocks.append(title + "\n" + _table(["check", "max abs", "max rel", "mean abs", "atol/rtol/peak", "result"],
                                            rows) + f"\n  greedy: {greedy.note}"
                      + (f"\n  experts: {experts.note}" if experts is not None else ""))
    for provider, reason in report.skipped.items():
        blocks.append(f"{provider}: skipped ({reason})")
    for consumer in report.consumers:
        greedy = consumer.greedy
        blocks.append(f"consumer {consumer.consumer} (model type {consumer.model_type}): "
                      f"{'PASS' if consumer.passed else 'FAIL'}\n  greedy against the reference: "
                      f"{greedy.match_length}/{len(greedy.reference_ids)} match, {greedy.note} (a final EOS is not "
                      "compared: onnxruntime-genai leaves it out)")
    for consumer, reason in report.consumers_skipped.items():
        blocks.append(f"consumer {consumer}: skipped ({reason})")
    blocks.append(f"overall: {'PASS' if report.passed else 'FAIL'}")
    return "\n\n".join(blocks)


def _files_table(files: dict) -> str:
    rows = [[name, f"{entry['bytes'] / 1e6:.2f} MB", entry["sha256"][:16]] for name, entry in files.items()]
    return _table(["file", "size", "sha256"], rows)


def format_export(result: ExportResult) -> str:
    return (f"exported {result.folder} ({result.manifest.dtype}) in {result.seconds:.1f} s, "
            f"{result.bytes / 1e6:.1f} MB\n" + _files_table(result.manifest.files))


def format_inspect(manifest: Manifest, folder: str) -> str:
    config = manifest.config
    lines = [f"artifact {folder}",
             f"  model: {manifest.family}, {config.num_hidden_layers} layers, kv heads {config.num_key_value_heads} "
             f"x {config.head_dim}, vocab {config.vocab_size}, max positions {config.max_position_embeddings}",
             f"  weights from: {manifest.source}",
             f"  dtype {manifest.dtype}, opset {manifest.opset}, weights file {manifest.weights_file}",
             "  versions: " + ", ".join(f"{k} {v}" for k, v in manifest.versions.items())]
    for contract in (manifest.prefill, manifest.decode):
        rows = [[direction, spec.name, spec.dtype, "[" + ", ".join(map(str, spec.axes)) + "]"]
                for direction, specs in (("in", contract.inputs), ("out", contract.outputs)) for spec in specs]
        lines += ["", contract.file, _table(["", "name", "dtype", "axes"], rows)]
    lines += ["", _files_table(manifest.files)]
    return "\n".join(lines)
