"""Optimum's, onnxruntime-genai builder's and our exports of one Qwen3 folder, each verified by this toolkit's
engine, side by side: every check's figure and verdict, written to benchmarks/FOREIGN-RESULTS.md.

    python benchmarks/foreign.py [--size minimind-3-qwen3] [--decode-steps 16] [--no-sweep] [--optimum-venv DIR]
        [--keep] [--max-rss-gb 16] [--results PATH] [--render]

The folder is export_sizes.py's (random weights, transformers' own save). Optimum float32, the builder float32 and
int4, and ours (float32) are exported, then verified with `export-onnx verify` on the CPU provider
(`--reference FOLDER` for the foreign ones); each report's JSON gives the rows. Each command runs in its own process
tree, its wall time and peak RSS recorded (export_sizes.run_command: stopped past --max-rss-gb). An exporter that
fails or is missing is a column saying so. The results file has a section per size, each naming the machine, the
versions and the command line of its run; a run replaces its own size's section. The reports stay under
--work/foreign/SIZE; --render writes the section again from them without exporting or verifying.

The Optimum venv (transformers 4, which our reference does not use) defaults to `.venv-optimum` at the repository's
root where one is, else export_sizes.py's; the tests' own (tests/helpers.py optimum_python, in ~/.cache/export-onnx)
can be passed with --optimum-venv.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_sizes import (  # noqa: E402
    DEFAULT_OPTIMUM_VENV,
    DEFAULT_WORK,
    ROOT,
    SIZES,
    Run,
    cached_folder,
    environment,
    environment_rows,
    optimum_versions,
    our_env,
    run_command,
    tool_command,
    weight_bytes,
)

RESULTS = Path(__file__).with_name("FOREIGN-RESULTS.md")
EXPORTS = ("optimum fp32", "builder fp32", "builder int4", "ours fp32")
# The tests' Optimum environment (tests/helpers.py optimum_python) where it is built, else export_sizes.py's.
OPTIMUM_VENV = next((v for v in (ROOT / ".venv-optimum", DEFAULT_OPTIMUM_VENV) if v.is_dir()), DEFAULT_OPTIMUM_VENV)
VERDICT = {True: "pass", False: "FAIL", None: "not judged"}
# A quantized report's figures shown beside the judged ones: the KL's tail, and top-1 over every position.
INFORMATIONAL = ("kl_max", "top1_agreement", "decisive_positions")


def export_command(name: str, folder: Path, out: Path, venv: Path) -> list[str]:
    tool = name.split()[0]
    command = tool_command(tool, folder, out, venv)
    return [("int4" if part == "fp32" else part) for part in command] if name == "builder int4" else command


def _figure(value) -> str:
    return "—" if value is None else f"{value:.3g}"


def rows(document: dict) -> dict[str, str]:
    """Each check of a verify report's JSON: its figure and verdict (the first provider's)."""
    found = {}
    for provider in document.get("providers", [])[:1]:
        for c in provider["comparisons"]:
            found[c["name"]] = f"{_figure(c['max_abs'])} {VERDICT[c['passed']]}"
        greedy = provider["greedy"]
        found["greedy tokens"] = f"{greedy['match_length']}/{len(greedy['reference_ids'])} {VERDICT[greedy['passed']]}"
        sweep = provider["sweep"]
        if sweep:
            failed = sum(not c["passed"] for c in sweep)
            found["shape sweep"] = f"{len(sweep) - failed}/{len(sweep)} {VERDICT[not failed]}"
        health = provider["health"]
        found["output health"] = f"{_figure(health['output_max_abs'])} {VERDICT[health['passed']]}"
        found["repeat run"] = f"{_figure(provider['repeat']['max_abs'])} {VERDICT[provider['repeat']['passed']]}"
    for quality in document.get("quality", [])[:1]:
        metrics = quality["metrics"]
        for metric in INFORMATIONAL:
            if metrics.get(metric) is not None:
                found[f"quality {metric} (not judged: figure only)"] = f"{metrics[metric]:.4g}"
        for check in quality["checks"]:
            verdict = VERDICT[check["passed"]] + (" (excused)" if check["passed"] and check.get("note") else "")
            found[f"quality {check['metric']} ({check['bound']} {check['limit']:g})"] = (
                f"{'—' if check['value'] is None else format(check['value'], '.4g')} {verdict}"
            )
    for invariant in document.get("invariants", []):
        found[f"invariant: {invariant['name']}"] = VERDICT[invariant["passed"]]
    for reference in document.get("independent_references", []):
        against = "against transformers" if reference["provider"] else "pytorch reference against transformers"
        for c in reference["comparisons"]:
            found[f"{against}: {c['name']}"] = f"{_figure(c['max_abs'])} {VERDICT[c['passed']]}"
    audit = document.get("weight_audit")
    if audit:
        found["weight audit"] = VERDICT[audit["passed"]]
    for consumer in document.get("consumers", []):
        greedy = consumer["greedy"]
        found["onnxruntime-genai consumer"] = (
            f"{greedy['match_length']}/{len(greedy['reference_ids'])} {VERDICT[consumer['passed']]}"
        )
    for check in document.get("not_checked", {}):
        found[check] = "not checked"
    found["overall"] = "PASS" if document.get("passed") else "FAIL"
    return found


def reasons(document: dict) -> dict[str, str]:
    """Why each check not checked, and each quality metric not judged, was not."""
    found = dict(document.get("not_checked", {}))
    for quality in document.get("quality", [])[:1]:
        for check in quality["checks"]:
            if check["passed"] is None:
                found[f"quality {check['metric']}"] = check["note"]
    return found


def _cost(run: Run) -> str:
    return f"{run.seconds:.0f} s, {run.peak_rss_bytes / 1e9:.2f} GB" if run.seconds is not None else "—"


def run(name: str, folder: Path, args) -> dict[str, str]:
    """One export and its verify; the verify report lands beside the export as NAME.json, the costs as
    NAME.costs.json (rows read back by `rendered`)."""
    out = args.work / "foreign" / args.size / name.replace(" ", "-")
    cache, report, costs = (out.with_name(out.name + suffix) for suffix in ("-cache", ".json", ".costs.json"))
    for path in (out, cache):
        shutil.rmtree(path, ignore_errors=True)
    for path in (report, costs):
        path.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    found = {}
    if name.startswith("optimum") and not (args.optimum_venv / "bin" / "optimum-cli").is_file():
        found["overall"] = f"not run: no optimum-cli in {args.optimum_venv}"
    else:
        print(f"{name}: exporting", file=sys.stderr)
        command = export_command(name, folder, out, args.optimum_venv)
        exported = run_command(name, command, our_env(), args.max_rss)
        shutil.rmtree(cache, ignore_errors=True)
        found["export (wall, peak RSS)"] = _cost(exported)
        if not exported.ok:
            found["overall"] = f"export failed: {exported.note}"
        else:
            command = [sys.executable, "-m", "exporter.cli", "verify", str(out), "--report-json", str(report)]
            command += ["--decode-steps", str(args.decode_steps), "--provider", "cpu"]
            command += [] if args.sweep else ["--no-sweep"]
            command += [] if name.startswith("ours") else ["--reference", str(folder)]
            print(f"{name}: verifying ({shlex.join(command[3:])})", file=sys.stderr)
            verified = run_command(name, command, our_env(), args.max_rss)
            found["verify (wall, peak RSS)"] = _cost(verified)
            if not report.is_file():
                found["overall"] = f"verify wrote no report: {verified.note}"
    costs.write_text(json.dumps(found) + "\n")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return found


def rendered(name: str, args) -> tuple[dict[str, str], dict[str, str]]:
    """(rows, reasons) of one export, from the files `run` left."""
    out = args.work / "foreign" / args.size / name.replace(" ", "-")
    found = json.loads(out.with_name(out.name + ".costs.json").read_text())
    report = out.with_name(out.name + ".json")
    if "overall" in found or not report.is_file():
        return found, {}
    document = json.loads(report.read_text())
    if "error" in document:
        return {**found, "overall": f"error: {document['error']['message']}"}, {}
    return {**found, **rows(document)}, reasons(document)


def table(results: dict[str, dict[str, str]]) -> str:
    names = list(dict.fromkeys(row for found in results.values() for row in found if row != "overall"))
    lines = ["| check | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for row in [*names, "overall"]:
        lines.append(f"| {row} | " + " | ".join(found.get(row, "—") for found in results.values()) + " |")
    return "\n".join(lines)


HEAD = (
    "# Foreign exports verified by this toolkit\n\nGenerated by `benchmarks/foreign.py`, a section per size (a run "
    "replaces its size's section); do not edit.\n"
)


def section(size: str, run_info: dict, results: dict, why: dict) -> str:
    env, settings = run_info["environment"], run_info["settings"]
    flags = f"--decode-steps {settings['decode_steps']}" + ("" if settings["sweep"] else " --no-sweep")
    lines = [
        f"<!-- size: {size} -->",
        f"## {size}",
        "",
        *environment_rows(env, run_info["command"]),
        "",
        f"One {size} folder ({SIZES[size].about}, {run_info['parameters'] / 1e6:.1f}M parameters, random weights, "
        f"float32), exported by each tool and verified on the CPU provider with `export-onnx verify {flags}`: the "
        "foreign exports against transformers (`--reference FOLDER`), ours against the PyTorch reference its "
        "manifest rebuilds, with transformers as the independent reference. A figure is the largest absolute "
        "difference (output health: the largest |output|; greedy tokens: tokens equal from the start; a quality "
        "row: its metric, judged against its bound); '—': the check does not exist for that export. Wall times and "
        "peak RSS are each command's whole process tree, on a machine shared with other work.",
        "",
        table(results),
    ]
    if why:
        lines += ["", "Not checked or not judged, and why:", "", "| check | why |", "|---|---|"]
        lines += [f"| {check} | {reason} |" for check, reason in why.items()]
    return "\n".join(lines) + f"\n<!-- end: {size} -->\n"


def write_section(path: Path, size: str, text: str) -> None:
    """Replace (or add) the size's section of the results file, the sections in SIZES' order."""
    old = path.read_text() if path.is_file() else ""
    sections = {
        name: old[
            old.index(f"<!-- size: {name} -->") : old.index(f"<!-- end: {name} -->") + len(f"<!-- end: {name} -->\n")
        ]
        for name in SIZES
        if f"<!-- size: {name} -->" in old and f"<!-- end: {name} -->" in old
    }
    sections[size] = text
    body = "\n".join(sections[name] for name in SIZES if name in sections)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(HEAD + "\n" + body)
    os.replace(temporary, path)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="minimind-3-qwen3", choices=sorted(SIZES))
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True, help="verify's shape sweep")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--optimum-venv", type=Path, default=OPTIMUM_VENV, help=f"default {OPTIMUM_VENV}")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true", help="keep the exported folders under --work/foreign")
    parser.add_argument("--max-rss-gb", type=float, default=16.0, help="stop a command past this (default 16)")
    parser.add_argument(
        "--render",
        action="store_true",
        help="only write the size's section again from the reports the last run of it left under --work",
    )
    args = parser.parse_args(argv)
    args.work = args.work.resolve()
    args.max_rss = int(args.max_rss_gb * 1e9)
    info = args.work / "foreign" / args.size / "run.json"
    if args.render and not info.is_file():
        parser.error(f"--render: no run of {args.size} under {args.work / 'foreign'}")
    if not args.render:
        env = environment(argv)
        env["versions"].update(optimum_versions(args.optimum_venv))
        folder = cached_folder(SIZES[args.size], args.work)
        for name in EXPORTS:
            run(name, folder, args)
        info.write_text(
            json.dumps(
                {
                    "environment": env,
                    "command": shlex.join(["benchmarks/foreign.py", *argv]),
                    "settings": {"decode_steps": args.decode_steps, "sweep": args.sweep},
                    "parameters": weight_bytes(folder)[1],
                }
            )
            + "\n"
        )
    results, why = {}, {}
    for name in EXPORTS:
        results[name], reasons_of = rendered(name, args)
        why.update(reasons_of)
    text = section(args.size, json.loads(info.read_text()), results, why)
    write_section(args.results, args.size, text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
