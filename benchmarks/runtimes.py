"""Runtimes benchmark: decode tokens/s of one model in every runtime the verification runs it in, against ONNX
Runtime's CPU provider measured in the same run, and against the bound that memory bandwidth sets.

1. minimind-3 (seeded weights; --quick: minimind-3-tiny) exported in float32, then in int4 (block 32) at accuracy
   levels 0 and 4 from those same graphs, each folder under --work exported only when missing.
2. For each artifact, every runner of the runtime registry (exporter/runtime/registry.py): ONNX Runtime's CPU
   provider (the anchor), OpenVINO at f32 and at its defaults, onnxruntime-web (WASM, in Node) and onnxruntime-node,
   each built by its registration with --threads intra-op threads, in a process of its own; and ONNX Runtime with
   the settings `export-onnx generate` runs (prepacked weights, spinning threads), which the registry's checking
   runner leaves out. Each runs at batch 1 a 16-token prompt on an empty past, then --steps greedy decode steps,
   each fed the presents of the step before (the runner's start/step). A runtime that is not installed is a row
   saying why.
3. The runners take turns with benchmarks/runtime.py's machinery (a warm-up first; round after round each in turn,
   the order reversed every other round), the memory read bandwidth probe (--threads threads) among them: figures
   are medians of the rounds, ratios medians of the per-round ratios.

The Node runtimes answer through a pipe: each decode step sends the cache to Node and its presents back. Their rows
give tokens/s through the runner and inside Node (the steps' session.run time, which the bridge reports), and the
pipe's cost per step between the two.

The bound: bytes a decode step reads (the weights file, and the past keys and values at the run's mean length)
divided by the read bandwidth measured in the same rounds (the highest of them); a runtime's share of it is its
tokens/s over the bound's.

The verdicts: minimind-3 (or the tiny one) also in float16, each of float32, float16 and int4 at accuracy levels 4 and
0 verified as a user verifies it, `export-onnx verify FOLDER --runtime all --json` (with --runtime NAME: ONNX Runtime
and those; --verify-options added), in a process of its own: for each row of its report (every runner, the
consumers' greedy tokens, what it left out) the verdict, the worst multiple of a tolerance over the row's checks
(the report's worst_multiple), and why a row differs or was not checked.

Writes benchmarks/RUNTIME-RESULTS.md (or --results PATH; not with --no-results or --quick): a generated file.

    python benchmarks/runtimes.py [--steps N] [--rounds N] [--threads N] [--runtime NAME] [--quick] [--json]
        [--verify-options OPTIONS] [--results PATH | --no-results] [--work DIR]

Exit codes: 0 done, 1 a worker failed, 2 bad arguments or input, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import runtime as rt  # noqa: E402

DEFAULT_WORK = HERE.parent / "artifacts" / "runtimes"
DEFAULT_RESULTS = HERE / "RUNTIME-RESULTS.md"
ACCURACY_LEVELS = (0, 4)  # MatMulNBits in float32 math, and with int8 activations (the export's default)
ANCHOR = "onnxruntime CPU"  # the row of the registry's ONNX Runtime runner on CPUExecutionProvider
GENERATE = "onnxruntime CPU, generate's settings"
BANDWIDTH = "bandwidth"
CROSS = "runners against each other"  # the verdicts' row of a verify report's cross_provider comparisons
IN_NODE = "decode in node"  # a Node runner's task: its last decode run's tokens/s inside Node
STEPS, QUICK_STEPS = 32, 8
FLOATS = ("float32", "float16")
TIMED = ("float32", *(f"int4 level {level}" for level in ACCURACY_LEVELS))  # the decode part's artifacts
VERIFIED = ("float32", "float16", *(f"int4 level {level}" for level in reversed(ACCURACY_LEVELS)))  # the verdicts'


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the artifacts


def export_artifacts(preset: str, work: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """The artifacts `names` of `preset` (seed 0), by name: "float32" and "float16" exported with torch.onnx, "int4
    level N" quantized from the float32 graphs at accuracy level N (the float32 folder exported first where
    missing); each folder is exported only when missing."""
    folders = {name: work / preset / name.replace("int4 level ", "int4-level") for name in names}
    if all(folder.exists() for folder in folders.values()):
        return folders
    from quality import replayed

    import exporter.export.pipeline as pipeline
    from exporter.artifact.quantization import QuantizationSettings
    from reference.source import seeded_model

    seeded = seeded_model(preset)
    float32 = work / preset / "float32"
    for dtype in ("float32", "float16"):
        folder = work / preset / dtype
        if not folder.exists() and (dtype in names or (dtype == "float32" and set(names) - set(FLOATS))):
            progress(f"{preset}: exporting {dtype} (torch.onnx)")
            pipeline.export_artifact(seeded.model, folder, dtype=dtype, source=seeded.source)
    with replayed(float32):
        for level in ACCURACY_LEVELS:
            folder = folders.get(f"int4 level {level}")
            if folder is not None and not folder.exists():
                progress(f"{preset}: exporting int4 at accuracy level {level} from the float32 graphs")
                settings = QuantizationSettings(accuracy_level=level)
                pipeline.export_artifact(
                    seeded.model, folder, dtype="int4", source=seeded.source, quantization=settings
                )
    return folders


# ----------------------------------------------------------------------------- the workers


def decode_tasks(runner, steps: int) -> dict:
    """The decode run on `runner` (tokens/s through it); on a Node runner also IN_NODE, the last run's steps timed
    inside Node."""
    from exporter.runtime.node import NodeRunner

    if not isinstance(runner, NodeRunner):
        return {"decode": lambda: rt.ort_decode_run(runner, steps)}
    in_node = []  # each decode.onnx call's session.run milliseconds, the prompt's first
    decode = runner.decode

    def timed(feeds: dict) -> dict:
        outputs = decode(feeds)
        in_node.append(runner.last_run_ms)
        return outputs

    runner.decode = timed  # start/step call it

    def through_runner() -> float:
        in_node.clear()
        return rt.ort_decode_run(runner, steps)

    return {"decode": through_runner, IN_NODE: lambda: steps / (sum(in_node[-steps:]) / 1000)}


def runner_tasks(folder: Path, runtime: str, target: str | None, threads: int, steps: int, label: Path) -> dict:
    """The decode tasks of one row: the registry's runner of `runtime` on `target`, or ONNX Runtime with generate's
    settings (`runtime` GENERATE); the runner's label written to `label` as JSON."""
    from exporter.artifact.folder import open_artifact
    from exporter.runtime.registry import registered_runtimes

    if runtime == GENERATE:
        runner = rt.ort_runner(folder, "cpu", threads)
    else:
        runner = registered_runtimes()[runtime].runner(open_artifact(folder), target, threads=threads)
    label.write_text(json.dumps(runner.runtime.to_dict()))
    return decode_tasks(runner, steps)


def in_turns(folder: Path, rows: dict, threads: int, steps: int, rounds: int, labels: Path) -> dict:
    """runtime.run_in_turns over a worker per row (its name -> (runtime, target)) and the bandwidth probe, started
    as this script."""
    common = ["--folder", str(folder), "--threads", str(threads), "--steps", str(steps)]
    workers = {
        row: ["--worker", runtime, "--target", target, *common, "--label", str(labels / f"{row}.json")]
        for row, (runtime, target) in rows.items()
    }
    workers[BANDWIDTH] = ["--worker", BANDWIDTH, *common]
    with mock.patch.object(rt, "__file__", str(Path(__file__).resolve())):
        figures, _ = rt.run_in_turns(workers, rounds)
    return figures


# ----------------------------------------------------------------------------- the measurement


def registry_rows(manifest, names: list[str] | None) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """The registry's runners on the CPU of the runtimes `names` (None: every registered one; ONNX Runtime's always,
    first), each named "RUNTIME TARGET" (a provider without its "ExecutionProvider"): name -> (runtime, target); and
    the runtimes and targets left out, with the reason."""
    from exporter.runtime.registry import DEFAULT_RUNTIME, registered_runtimes

    rows, skipped = {}, {}
    for name, runtime in registered_runtimes().items():
        if names is not None and name not in (DEFAULT_RUNTIME, *names):
            continue
        if runtime.version() is None:
            skipped[name] = f"not installed: {runtime.install}"
            continue
        targets, left_out = runtime.targets(manifest, ["cpu"] if name == DEFAULT_RUNTIME else None)
        for target in targets:
            rows[f"{name} {target.removesuffix('ExecutionProvider')}"] = (name, target)
        skipped.update({f"{name} {target}": why for target, why in left_out.items()})
    return rows, skipped


def cache_bytes_per_step(manifest, steps: int) -> float:
    """Bytes of past keys and values a decode step reads, at the run's mean past length (the prompt, then one more
    each step)."""
    import numpy as np

    cache = manifest.cache
    mean_past = rt.PROMPT_FOR_DECODE + (steps - 1) / 2
    per_position = 2 * cache.num_layers * cache.num_key_value_heads * cache.head_dim * np.dtype(cache.dtype).itemsize
    return per_position * mean_past


def measure_artifact(folder: Path, threads: int, steps: int, rounds: int, names: list[str] | None = None) -> dict:
    """Every row's figures on the artifact in `folder` (the runtimes `names`, None: all), with the bound."""
    from exporter.artifact.manifest import read_manifest

    manifest = read_manifest(folder, check_hashes=False)
    rows, skipped = registry_rows(manifest, names)
    rows = {ANCHOR: rows.pop(ANCHOR), GENERATE: (GENERATE, "-"), **rows}
    progress(f"{folder}: timing {', '.join(rows)} in turns ({rounds} rounds of {steps} steps)")
    with tempfile.TemporaryDirectory() as labels:
        figures = in_turns(folder, rows, threads, steps, rounds, Path(labels))
        configurations = {row: json.loads((Path(labels) / f"{row}.json").read_text()) for row in rows}
    weights = (folder / manifest.weights_file).stat().st_size
    cache = cache_bytes_per_step(manifest, steps)
    # The highest bandwidth of the rounds: other load can only slow the probe, and a bound must not fall below what
    # the machine can read.
    bandwidth = max(figures[BANDWIDTH][BANDWIDTH])
    bound = bandwidth * 1e9 / (weights + cache)
    anchor = figures[ANCHOR]["decode"]
    out = {
        "folder": rt.shown_path(folder),
        "dtype": manifest.dtype,
        "accuracy_level": manifest.quantization.accuracy_level if manifest.quantization else None,
        "weight_bytes": weights,
        "cache_bytes_per_step": cache,
        "read_gb_per_s": bandwidth,
        "bound_tokens_per_s": bound,
        "rows": {},
    }
    for row in rows:
        tps = figures[row]["decode"]
        label = configurations[row]
        entry = {"configuration": f"{label['name']}, {label['configuration']}", "tokens_per_s": statistics.median(tps)}
        entry["step_ms"] = 1000 / entry["tokens_per_s"]
        entry["to_onnxruntime"], entry["to_onnxruntime_quartiles"] = rt.ratio_summary(tps, anchor)
        entry["to_bound"] = entry["tokens_per_s"] / bound
        if IN_NODE in figures[row]:
            in_node = figures[row][IN_NODE]
            entry["in_node_tokens_per_s"] = statistics.median(in_node)
            entry["in_node_to_onnxruntime"], _ = rt.ratio_summary(in_node, anchor)
            entry["pipe_ms_per_step"] = statistics.median(1000 / t - 1000 / n for t, n in zip(tps, in_node))
        out["rows"][row] = entry
    out["rows"].update({row: {"skipped": why} for row, why in skipped.items()})
    return out


def node_version() -> str | None:
    node = shutil.which("node")
    if node is None:
        return None
    done = subprocess.run([node, "--version"], capture_output=True, text=True)
    return done.stdout.strip() or None


def runtime_versions() -> dict[str, str | None]:
    from exporter.runtime.registry import registered_runtimes

    versions = {name: runtime.version() for name, runtime in registered_runtimes().items()}
    return {**versions, "node": node_version()}


# ----------------------------------------------------------------------------- the verdicts


def verify_report(folder: Path, names: list[str] | None, options: list[str]) -> dict:
    """`export-onnx verify FOLDER --runtime all --json` (with `names`: ONNX Runtime and those runtimes), as a user
    runs it, in a process of its own with `options` added: its JSON report. A failed check (exit 1) is a verdict
    the table reports; any other exit is the worker failing."""
    from exporter.runtime.registry import ALL, DEFAULT_RUNTIME

    runtimes = [ALL] if names is None else [DEFAULT_RUNTIME, *names]
    flags = [flag for name in runtimes for flag in ("--runtime", name)]
    command = [sys.executable, "-m", "exporter.cli", "verify", str(folder), *flags, "--json", "--quiet", *options]
    progress(f"{folder}: {shlex.join(['export-onnx', *command[3:]])}")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise rt.WorkerFailed(f"verify of {folder} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def row_name(provider: str) -> str:
    """A row's name: an ONNX Runtime provider as "onnxruntime CPU"; another runtime's row as the report names it."""
    if provider.endswith("ExecutionProvider"):
        return f"onnxruntime {provider.removesuffix('ExecutionProvider')}"
    return provider


def verdict_cells(report: dict) -> dict[str, dict]:
    """Each row of a verify JSON report, by row_name: its runners' rows (a float artifact's, judged by tolerance
    profiles; a quantized one's, by its quality profile), CROSS (a float artifact's runners compared pairwise on
    the prefill batch, those with a known cause left out), its consumers' greedy tokens, and what it left out: the
    verdict ("pass", "FAIL", "undecided", "differs, known cause", "not checked"), the worst multiple of a tolerance
    over the row's checks (the report's worst_multiple; None where the row has none: greedy tokens, a row not
    checked) and why, in words (a known cause, the runtime's notes, a consumer's note, a reason it did not run)."""
    cells = {}
    for row in [*report["providers"], *report.get("quality", [])]:
        runtime = row["runtime"]
        if row["passed"]:
            verdict = "pass"
        elif row["attributed"]:
            verdict = "differs, known cause"
        else:
            verdict = "undecided" if row.get("verdict") == "undecided" else "FAIL"
        why = [runtime["known_cause"]] if row["attributed"] else []
        cells[row_name(row["provider"])] = {
            "verdict": verdict,
            "worst_multiple": row["worst_multiple"],
            "why": "; ".join([*why, *runtime["notes"]]),
        }
    for consumer in report["consumers"]:
        cells[f"{consumer['consumer'].split()[0]} greedy tokens"] = {
            "verdict": "pass" if consumer["passed"] else "FAIL",
            "worst_multiple": None,
            "why": consumer["greedy"]["note"],
        }
    if report["cross_provider"]:  # a float artifact's runners without a known cause, each pair on the prefill batch
        worst = max(report["cross_provider"], key=lambda c: -1 if c["multiple"] is None else c["multiple"])
        cells[CROSS] = {
            "verdict": "pass" if all(c["passed"] for c in report["cross_provider"]) else "FAIL",
            "worst_multiple": worst["multiple"],
            "why": f"worst: {worst['name']}",
        }
    left_out = {row_name(name): why for name, why in report["skipped"].items()}
    left_out.update({f"{name} greedy tokens": why for name, why in report["consumers_skipped"].items()})
    for name, why in left_out.items():
        cells[name] = {"verdict": "not checked", "worst_multiple": None, "why": why}
    return cells


def verdicts(folders: dict[str, Path], names: list[str] | None, options: list[str]) -> dict:
    """verify_report of each artifact, its rows' verdict_cells, the report's own verdict and the seconds it took."""
    out = {}
    for name, folder in folders.items():
        report = verify_report(folder, names, options)
        out[name] = {"verdict": report["verdict"], "seconds": report["seconds"], "rows": verdict_cells(report)}
    return out


# ----------------------------------------------------------------------------- the report


def artifact_table(entry: dict) -> list[str]:
    lines = [
        "| runtime | tokens/s | step (ms) | / onnxruntime CPU (q1–q3) | share of the bound | configuration |",
        "|---|---|---|---|---|---|",
    ]
    for row, r in entry["rows"].items():
        if "skipped" in r:
            lines.append(f"| {row} | — | — | — | — | {r['skipped']} |")
            continue
        q1, q3 = r["to_onnxruntime_quartiles"]
        lines.append(
            f"| {row} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | {r['to_onnxruntime']:.2f}x "
            f"({q1:.2f}–{q3:.2f}) | {r['to_bound']:.0%} | {r['configuration']} |"
        )
        if "in_node_tokens_per_s" in r:
            lines.append(
                f"| {inside(row)} | {r['in_node_tokens_per_s']:.1f} | {1000 / r['in_node_tokens_per_s']:.2f} "
                f"| {r['in_node_to_onnxruntime']:.2f}x | "
                f"{r['in_node_tokens_per_s'] / entry['bound_tokens_per_s']:.0%} | session.run alone; the pipe adds "
                f"{r['pipe_ms_per_step']:.2f} ms a step |"
            )
    return lines


def bound_table(report: dict) -> list[str]:
    lines = [
        "| artifact | weights (MB) | cache read a step (MB) | read bandwidth (GB/s) | bound (tokens/s) | "
        "best measured (tokens/s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in report["artifacts"].items():
        measured = [r["tokens_per_s"] for r in entry["rows"].values() if "tokens_per_s" in r]
        lines.append(
            f"| {name} | {entry['weight_bytes'] / 1e6:.1f} | {entry['cache_bytes_per_step'] / 1e6:.2f} | "
            f"{entry['read_gb_per_s']:.1f} | {entry['bound_tokens_per_s']:.1f} | {max(measured):.1f} |"
        )
    return lines


def tables(report: dict) -> list[str]:
    lines = []
    for name, entry in report["artifacts"].items():
        lines += ["", f"## {report['preset']} {name}", "", *artifact_table(entry)]
    lines += [
        "",
        "## The bound",
        "",
        f"A decode step reads every weight once, and the past keys and values (at the run's mean past length, "
        f"{rt.PROMPT_FOR_DECODE} + ({report['steps']} - 1) / 2 positions): those bytes over the read bandwidth "
        f"({report['threads']} thread{'s' * (report['threads'] != 1)} summing a 512 MiB buffer, the highest of the "
        "rounds: load can only slow it) bound the tokens/s from above. The share of the bound above is a runtime's "
        "tokens/s over it.",
        "",
        *bound_table(report),
    ]
    if any(
        max(r["tokens_per_s"], r.get("in_node_tokens_per_s", 0)) > entry["bound_tokens_per_s"]
        for entry in report["artifacts"].values()
        for r in entry["rows"].values()
        if "tokens_per_s" in r
    ):
        lines += [
            "",
            "A share above 100% is a bound this run did not measure: the probe read slower than the runtime did (other "
            "processes' load fell on its turns), or the weights stayed partly in the CPU's caches between steps.",
        ]
    return lines


def verdict_cell(cell: dict | None) -> str:
    if cell is None:
        return "—"
    multiple = cell["worst_multiple"]
    if multiple is None:
        return cell["verdict"]
    return f"{cell['verdict']}, {multiple:.3g}x" if multiple < 1000 else f"{cell['verdict']}, {multiple:.0f}x"


def verdict_lines(report: dict) -> list[str]:
    """The runtime x artifact table of the verdicts part, the reports' own verdicts, and each row's reasons (once
    for the artifacts that share them)."""
    entries = report["verdicts"]
    names = list(entries)
    rows = list(dict.fromkeys(row for entry in entries.values() for row in entry["rows"]))
    seconds = [f"{entries[name]['seconds']:.0f}" for name in names]
    lines = [
        "",
        f"## Verdicts: {report['preset']} in every runtime",
        "",
        f"Each column is `export-onnx verify FOLDER --runtime {report['verify_runtimes']} --json"
        f"{' ' + report['verify_options'] if report['verify_options'] else ''}` on that artifact, as a user runs it; "
        "each cell the row's verdict and its worst multiple of a tolerance: the largest over the row's checks of "
        "the error over what the check allows (a float artifact: the prefill and decode outputs, the shape sweep, "
        "the long positions and the repeat run against the dtype's tolerance profile, or the float64 referee where "
        "it judged; an int4 one: the figures of its quality profile, at the end of their confidence interval the "
        "verdict rests on). At most 1 passes. Greedy tokens match or not, with no multiple. The runners against each "
        "other: a float artifact's runners without a known cause, each pair on the prefill batch, judged by the looser "
        "of their two profiles. A row is judged against the reference, not against ONNX Runtime: where ONNX "
        "Runtime's CPU row fails too, at a like multiple, the difference is the artifact's, not the runtime's.",
        "",
        f"| runtime | {' | '.join(names)} |",
        f"|---|{'---|' * len(names)}",
        *(f"| {row} | {' | '.join(verdict_cell(entries[n]['rows'].get(row)) for n in names)} |" for row in rows),
        f"| the report's verdict | {' | '.join(entries[n]['verdict'] for n in names)} |",
        f"| verify's seconds | {' | '.join(seconds)} |",
        "",
        "Why, where a row says more than its verdict:",
        "",
    ]
    for row in rows:
        reasons = {}
        for name in names:
            cell = entries[name]["rows"].get(row)
            if cell is not None and cell["why"]:
                reasons.setdefault(cell["why"], []).append(name)
        lines += [f"- {row} ({', '.join(artifacts)}): {why}" for why, artifacts in reasons.items()]
    return lines


def format_results(report: dict) -> str:
    env = report["environment"]
    lines = [
        *rt.results_header("Runtimes benchmark results", "`benchmarks/runtimes.py`", env),
        f"| python, numpy | {env['versions']['python']}, {env['versions']['numpy']} |",
        *(f"| {name} | {version or 'not installed'} |" for name, version in report["runtime_versions"].items()),
        f"| command | `{env['command']}` |",
        f"| model | {report['preset']}, seeded weights (seed 0); int4: block 32, lm_head and embedding int8 |",
        f"| run | batch 1, a {rt.PROMPT_FOR_DECODE}-token prompt on an empty past, then {report['steps']} greedy "
        "decode steps, each fed the presents of the step before; tokens/s of the steps |",
        f"| threads | {report['threads']} intra-op thread{'s' * (report['threads'] != 1)} in every runtime |",
        f"| load average (1 min) | {report['load_average'][0]:.1f} at the start, {report['load_average'][1]:.1f} at "
        "the end: other processes' share of the cores, which slows the figures unevenly round to round |",
        f"| rounds | {report['rounds']} in turns, after a warm-up run (figures: medians of the rounds; ratios: "
        "medians of the per-round ratios, q1–q3 their quartiles) |",
        "",
        "Every row but the second is a runner of the runtime registry, as `export-onnx verify --runtime` runs it: "
        "ONNX Runtime's checking settings (a float32 artifact's weights unprepacked, idle threads not spinning), the "
        "cache handed back as numpy arrays by OpenVINO's and the Node runners. The second row is ONNX Runtime with "
        "the settings `export-onnx generate` runs (prepacked weights, spinning threads, the cache bound in place). "
        "The Node runners send the cache through a pipe each step: their second row is the steps' session.run time "
        "inside Node (inside the page, for Chromium), as a program there that keeps its tensors would see it.",
        *tables(report),
        *verdict_lines(report),
    ]
    return "\n".join(lines) + "\n"


def inside(row: str) -> str:
    """A Node runner's second row: its steps' session.run time inside the program that runs them (a Chromium
    page's, for the runner that drives one through Node)."""
    return f"{row}, inside the page" if "chromium" in row else f"{row}, inside Node"


def summary(report: dict) -> str:
    lines = []
    for name, entry in report["artifacts"].items():
        lines.append(f"{report['preset']} {name} (bound {entry['bound_tokens_per_s']:.1f} tokens/s):")
        for row, r in entry["rows"].items():
            if "skipped" in r:
                lines.append(f"  {row:40} skipped: {r['skipped']}")
                continue
            lines.append(
                f"  {row:40} {r['tokens_per_s']:8.1f} tokens/s  {r['to_onnxruntime']:5.2f}x onnxruntime CPU  "
                f"{r['to_bound']:4.0%} of the bound"
            )
            if "in_node_tokens_per_s" in r:
                lines.append(
                    f"  {inside(row):40} {r['in_node_tokens_per_s']:8.1f} tokens/s  "
                    f"{r['in_node_to_onnxruntime']:5.2f}x onnxruntime CPU  (pipe {r['pipe_ms_per_step']:.2f} ms/step)"
                )
    return "\n".join([*lines, *verdict_lines(report)])


# ----------------------------------------------------------------------------- the command


def main() -> None:
    try:
        run()
    except KeyboardInterrupt:
        rt.fail("interrupted", "interrupted (SIGINT)", 130, rt.json_asked(sys.argv[1:]))


def run() -> None:
    from exporter.runtime.settings import MAX_THREADS

    parser = rt._Parser(description=__doc__.splitlines()[0], epilog=__doc__.splitlines()[-1])
    parser.add_argument("--steps", type=rt._at_least(1), help=f"decode steps per run (default {STEPS}; --quick 8)")
    parser.add_argument("--rounds", type=rt._at_least(1), default=3, help="rounds in turns (default 3; --quick 1)")
    parser.add_argument(
        "--threads",
        type=rt._at_least(1, MAX_THREADS),
        default=1,
        help="intra-op threads of every runtime, and of the bandwidth probe (default 1)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: minimind-3-tiny, 1 round, no results file")
    parser.add_argument(
        "--runtime",
        action="append",
        metavar="NAME",
        help="a registered runtime to time beside ONNX Runtime (repeatable; default: every registered one)",
    )
    parser.add_argument(
        "--verify-options",
        default="",
        metavar="OPTIONS",
        help='options the verdicts part adds to each `export-onnx verify`, e.g. "--decode-steps 16" (default none)',
    )
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"artifacts' folder (default {DEFAULT_WORK})")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    results = parser.add_mutually_exclusive_group()
    results.add_argument("--results", type=Path, default=DEFAULT_RESULTS, metavar="PATH")
    results.add_argument("--no-results", action="store_true", help="write no results file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--label", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    if args.worker == BANDWIDTH:
        rt.serve(rt.bandwidth_tasks(args.threads))
        return
    if args.worker:
        rt.serve(runner_tasks(args.folder, args.worker, args.target, args.threads, steps, args.label))
        return

    from exporter.errors import InputError, ToolkitError
    from exporter.runtime.registry import registered_runtimes
    from exporter.verify.reports import json_text
    from reference.presets import get_preset

    results_path = None if args.no_results or args.quick else args.results
    preset = "minimind-3-tiny" if args.quick else "minimind-3"
    rounds = 1 if args.quick else args.rounds
    load_at_start = os.getloadavg()[0]
    try:
        if results_path is not None:
            rt.check_results_path(results_path)
        unknown = sorted(set(args.runtime or ()) - set(registered_runtimes()))
        if unknown:
            raise InputError(f"--runtime {unknown[0]}: unknown; choose from {', '.join(registered_runtimes())}")
        positions = get_preset(preset).max_position_embeddings
        if rt.PROMPT_FOR_DECODE + steps > positions:
            raise InputError(
                f"--steps {steps}: {preset} has {positions} positions, room for {positions - rt.PROMPT_FOR_DECODE} "
                f"steps after the {rt.PROMPT_FOR_DECODE}-token prompt; pass fewer"
            )
        options = shlex.split(args.verify_options)
        folders = export_artifacts(preset, args.work, tuple(dict.fromkeys([*TIMED, *VERIFIED])))
        report = {"preset": preset, "threads": args.threads, "steps": steps, "rounds": rounds, "artifacts": {}}
        for name in TIMED:
            report["artifacts"][name] = measure_artifact(folders[name], args.threads, steps, rounds, args.runtime)
        runtimes = "all" if args.runtime is None else " --runtime ".join(["onnxruntime", *args.runtime])
        report["verify_runtimes"] = runtimes
        report["verify_options"] = shlex.join(options)
        report["verdicts"] = verdicts({name: folders[name] for name in VERIFIED}, args.runtime, options)
    except ToolkitError as exc:
        rt.fail("input", str(exc), 2, args.json)
    except rt.WorkerFailed as exc:
        rt.fail("worker", str(exc), 1, args.json)
    report["load_average"] = [load_at_start, os.getloadavg()[0]]
    report["runtime_versions"] = runtime_versions()
    report["environment"] = rt.environment(sys.argv)
    report["results_file"] = None if results_path is None else rt.shown_path(results_path)
    if results_path is not None:
        results_path.write_text(format_results(report))
    print(json_text(report) if args.json else summary(report))


if __name__ == "__main__":
    main()
