"""Optimum's, onnxruntime-genai builder's and our exports of one Qwen3 folder, each verified by this toolkit's
engine, side by side: every check's figure and verdict, written to benchmarks/FOREIGN-RESULTS.md.

    python benchmarks/foreign.py [--size minimind-3-qwen3] [--decode-steps 16] [--optimum-venv DIR]

The folder is export_sizes.py's (random weights, transformers' own save). Optimum float32, the builder float32 and
int4, and ours (float32) are exported, then verified with `export-onnx verify` (`--reference FOLDER` for the
foreign ones); each report's JSON gives the rows. An exporter that fails or is missing is a column saying so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_sizes import DEFAULT_OPTIMUM_VENV, DEFAULT_WORK, SIZES, cached_folder, our_env, tool_command  # noqa: E402

RESULTS = Path(__file__).with_name("FOREIGN-RESULTS.md")
EXPORTS = ("optimum fp32", "builder fp32", "builder int4", "ours fp32")


def export_command(name: str, folder: Path, out: Path, venv: Path) -> list[str]:
    tool = name.split()[0]
    command = tool_command(tool, folder, out, venv)
    return [("int4" if part == "fp32" else part) for part in command] if name == "builder int4" else command


def rows(document: dict) -> dict[str, str]:
    """Each check of a verify report's JSON: its figure and verdict."""
    found = {}
    verdict = {True: "pass", False: "FAIL"}
    for provider in document.get("providers", [])[:1]:
        for c in provider["comparisons"]:
            found[c["name"]] = f"{c['max_abs']:.3g} {verdict[c['passed']]}"
        greedy = provider["greedy"]
        found["greedy tokens"] = f"{greedy['match_length']}/{len(greedy['reference_ids'])} {verdict[greedy['passed']]}"
        sweep = provider["sweep"]
        if sweep:
            found["shape sweep"] = f"{sum(c['passed'] for c in sweep)}/{len(sweep)} shapes pass"
        found["repeat run"] = f"{provider['repeat']['max_abs']:.3g} {verdict[provider['repeat']['passed']]}"
    for quality in document.get("quality", [])[:1]:
        for check in quality["checks"]:
            value = check["value"]
            figure = "-" if value is None else f"{value:.4g}"
            found[f"quality {check['metric']}"] = f"{figure} {verdict[check['passed']]}"
    for invariant in document.get("invariants", []):
        found[f"invariant: {invariant['name']}"] = verdict[invariant["passed"]]
    for reference in document.get("independent_references", []):
        for c in reference["comparisons"]:
            found[f"against transformers: {c['name']}"] = f"{c['max_abs']:.3g} {verdict[c['passed']]}"
    for check in document.get("not_checked", {}):
        found[f"{check}"] = "not checked"
    found["overall"] = "PASS" if document.get("passed") else "FAIL"
    return found


def run(name: str, folder: Path, work: Path, args) -> dict[str, str]:
    out = work / "foreign" / name.replace(" ", "-")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_name(out.name + "-cache"), ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{name}: exporting", file=sys.stderr)
    done = subprocess.run(export_command(name, folder, out, args.optimum_venv), env=our_env(), capture_output=True)
    if done.returncode:
        return {"overall": f"export failed ({done.stderr.decode(errors='replace').strip().splitlines()[-1:]})"}
    report = out.with_name(out.name + ".json")
    command = [sys.executable, "-m", "exporter.cli", "verify", str(out), "--decode-steps", str(args.decode_steps)]
    command += ["--report-json", str(report), "--provider", "cpu", "-q"]
    command += [] if name.startswith("ours") else ["--reference", str(folder)]
    print(f"{name}: verifying", file=sys.stderr)
    subprocess.run(command, env=our_env(), capture_output=True)
    document = json.loads(report.read_text())
    if "error" in document:
        return {"overall": f"error: {document['error']['message']}"}
    return rows(document)


def table(results: dict[str, dict[str, str]]) -> str:
    names = list(dict.fromkeys(row for found in results.values() for row in found if row != "overall"))
    lines = ["| check | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for row in [*names, "overall"]:
        lines.append(f"| {row} | " + " | ".join(found.get(row, "—") for found in results.values()) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="minimind-3-qwen3", choices=sorted(SIZES))
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--optimum-venv", type=Path, default=DEFAULT_OPTIMUM_VENV)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    folder = cached_folder(SIZES[args.size], args.work)
    results = {name: run(name, folder, args.work, args) for name in EXPORTS}
    text = (
        f"# Foreign exports verified by this toolkit\n\n`python benchmarks/foreign.py --size {args.size} "
        f"--decode-steps {args.decode_steps}`: one {args.size} folder ({SIZES[args.size].about}, random weights), "
        "exported by each tool and verified on the CPU against transformers (foreign) or our reference (ours, "
        "with transformers as the independent reference). A figure is the largest absolute difference, a quality "
        "row its metric; '—': the check does not exist for that export.\n\n" + table(results) + "\n"
    )
    args.results.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
