"""Mutation benchmark (issue 33): how many of the faults in tests/mutants.py verification catches, and how.

Exports the tiny artifacts the mutants are written into (minimind-3-tiny in float32 and float16, its MoE + YaRN
variant in float32, the same model 7 layers deep through the layer template in float32 and int4), then for each
mutant edits a copy (the manifest re-signed), verifies it against the PyTorch reference with the test suite's quick
settings, and prints one row: the mutant, whether it was caught, by which checks (parity rows, weight audit,
invariants, expert choice), the worst failing parity row's multiple of its tolerance (for quantized blocks, the worst
weight's multiple of its half step, marked "audit"), its error against the float64 referee in multiples of the
reference's own (exporter/verify/checks/referee.py), the layer localisation names and the module the probe names,
and whether that is what the mutant expects; then the kill rate. The mutants are defined once, in tests/mutants.py,
which the tests run as cases.

    .venv/bin/python benchmarks/mutations.py [--json] [--artifacts DIR] [--match TEXT] [--real]

--artifacts DIR keeps the exports in DIR and reuses those already there (an export takes about a minute); --match
TEXT runs only the mutants whose name holds TEXT; --real adds the mutants of SmolLM2-135M-Instruct (tests/mutants.py
REAL_MUTANTS, in grown layers of the trained model, its GGUF fetched as the tests fetch it).
Exit codes: 0 every mutant caught as expected, 1 some mutant not caught or not localised as expected.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the mutant table and its helpers

import dataclasses  # noqa: E402

from conftest import DEEP_LAYERS, TINY, moe3_yarn_model  # noqa: E402
from gguf_files import smollm2_gguf  # noqa: E402
from mutants import MUTANTS, REAL_KIND, REAL_MUTANTS, SETTINGS, judge, unmet  # noqa: E402

from exporter import verify_artifact  # noqa: E402
from exporter.export.pipeline import export_artifact  # noqa: E402
from reference import build_model, get_preset  # noqa: E402


def _models() -> dict:
    """artifact kind (mutants.ARTIFACTS) -> (model, dtype, source record), as the tests' session fixtures export."""
    tiny = build_model(get_preset(TINY), seed=0)
    deep = build_model(dataclasses.replace(get_preset(TINY), num_hidden_layers=DEEP_LAYERS), seed=0)
    seeded = {"kind": "seeded", "preset": TINY, "seed": 0}
    return {
        "float32": (tiny, "float32", seeded),
        "float16": (tiny, "float16", seeded),
        "moe float32": (moe3_yarn_model("dense"), "float32", {"kind": "in-memory"}),
        "deep float32": (deep, "float32", {"kind": "in-memory"}),
        "deep int4": (deep, "int4", {"kind": "in-memory"}),
    }


def _real_model(root: Path) -> tuple:
    """SmolLM2's reference and its float32 artifact, exported from its GGUF as a user exports it."""
    from reference.source import checkpoint_model

    gguf = smollm2_gguf(Path.home() / ".cache" / "export-onnx" / "smollm2")
    folder = root / REAL_KIND.replace(" ", "-")
    if not (folder / "manifest.json").exists():
        print(f"exporting {REAL_KIND} ...", file=sys.stderr, flush=True)
        command = [sys.executable, "-m", "exporter.cli", "export", "--checkpoint", str(gguf), "-o", str(folder), "-q"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)  # its summary is no row of the table
    return checkpoint_model(gguf).model, folder


def _artifact(root: Path, kind: str, model, dtype: str, source: dict) -> Path:
    folder = root / kind.replace(" ", "-")
    if not (folder / "manifest.json").exists():
        print(f"exporting {kind} ...", file=sys.stderr, flush=True)
        export_artifact(model, folder, dtype=dtype, source=source)
    return folder


def run(root: Path, match: str = "", real: bool = False) -> list[tuple]:
    """(mutant, outcome, unmet expectations) per mutant whose name holds `match` (with `real`, SmolLM2's too); the
    artifacts exported into (or reused from) `root`."""
    models = _models()
    rows = []
    real_model = _real_model(root) if real and any(match in m.name for m in REAL_MUTANTS) else None
    for mutant in [m for m in MUTANTS + (REAL_MUTANTS if real else []) if match in m.name]:
        if mutant.kind == REAL_KIND:
            model, artifact = real_model
        else:
            model, dtype, source = models[mutant.kind]
            artifact = _artifact(root, mutant.kind, model, dtype, source)
        with tempfile.TemporaryDirectory(prefix="mutant-") as scratch:
            folder = shutil.copytree(artifact, Path(scratch) / artifact.name)
            mutant.edit(folder)
            start = time.perf_counter()
            report = verify_artifact(folder, model, ["cpu"], SETTINGS, genai=False)
            outcome = judge(mutant, report.to_dict())
        print(f"{mutant.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        rows.append((mutant, outcome, unmet(mutant, outcome)))
    return rows


def _layer(outcome) -> str:
    if outcome.first_layer is not None:
        return f"layer {outcome.first_layer} ({outcome.where})"
    return outcome.fault_in or "—"


def table(rows: list[tuple]) -> str:
    lines = [
        "| mutant | artifact | caught | by | × tolerance | × reference's own error (float64 referee) "
        "| first diverging layer | probe | as expected |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mutant, outcome, problems in rows:
        scale = (
            f"{outcome.scale:.3g}"
            if outcome.scale is not None
            else f"{outcome.audit_multiple:.3g} (audit)"
            if outcome.audit_multiple is not None
            else "—"
        )
        lines.append(
            f"| {mutant.name} | {mutant.kind} | {'yes' if outcome.caught else 'NO'} | {', '.join(outcome.by) or '—'} "
            f"| {scale} | {'—' if outcome.referee_ratio is None else f'{outcome.referee_ratio:.3g}'} "
            f"| {_layer(outcome)} | {outcome.probe or '—'} | {'; '.join(problems) or 'yes'} |"
        )
    killed = sum(outcome.caught for _, outcome, _ in rows)
    lines += ["", f"kill rate: {killed} of {len(rows)} ({killed / len(rows):.0%})"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--artifacts", type=Path, help="export into (and reuse exports from) this folder")
    parser.add_argument("--match", default="", help="run only the mutants whose name holds this text")
    parser.add_argument("--real", action="store_true", help="also the SmolLM2 mutants (minutes)")
    args = parser.parse_args()
    if args.artifacts is not None:
        args.artifacts.mkdir(parents=True, exist_ok=True)
        rows = run(args.artifacts, args.match, args.real)
    else:
        with tempfile.TemporaryDirectory(prefix="mutation-artifacts-") as root:
            rows = run(Path(root), args.match, args.real)
    if args.json:
        killed = sum(outcome.caught for _, outcome, _ in rows)
        document = {
            "settings": SETTINGS.to_dict(),
            "mutants": [
                {**outcome.to_dict(), "artifact": mutant.kind, "unmet": problems} for mutant, outcome, problems in rows
            ],
            "killed": killed,
            "total": len(rows),
            "kill_rate": killed / len(rows),
        }
        print(json.dumps(document, indent=2))
    else:
        print(table(rows))
    sys.exit(1 if any(problems for _, _, problems in rows) else 0)


if __name__ == "__main__":
    main()
