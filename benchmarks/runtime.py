"""Runtime benchmark: ONNX Runtime against the PyTorch reference, measured in the same run.

For minimind-3 (fp32 by default) at batch 1 it prints prefill latency at 128
and 512 tokens, decode tokens/s over 128 steps and peak RSS, for ONNX Runtime
and for PyTorch eager; the ratios; and the weight-read floor (weight bytes
divided by the memory bandwidth measured in this run). Each side runs in its
own process, so peak RSS is its own. The timed work runs in turns: every
worker stays loaded and, round after round, each one in turn (the order
reversed every other round) runs the same prefill or decode, and the memory
bandwidth probe takes its turn too. Load from elsewhere on the machine then
falls on all sides alike: each ratio is the median of its per-round ratios,
each figure the median of its rounds. onnxruntime-genai's generator on the
same folder is one more worker, when it is installed, running the same
prompts and decode as ours (so both processes hold what a 512-token prompt
leaves in their allocators when they decode).

Every full run also writes benchmarks/RESULTS.md (or --results PATH; not with
--no-results): a generated file with the machine, the versions, the command
line and the figures.

    .venv/bin/python benchmarks/runtime.py [--artifact DIR] [--threads N] [--rounds N] [--provider cpu|cuda] [--json]
        [--results PATH | --no-results]

Exit codes: 0 done, 1 a worker failed, 2 bad arguments or artifact, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

PREFILL_LENGTHS = (128, 512)
DECODE_STEPS = 128
PROMPT_FOR_DECODE = 16
SETTLE_S = 0.1  # between turns: the previous worker's pool threads stop spinning


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def elapsed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def prompt(length: int, vocab: int):
    import numpy as np

    return np.random.default_rng(length).integers(3, vocab, (1, length), dtype=np.int64)


# ----------------------------------------------------------------------------- the workers' tasks
# Each worker offers named tasks ("prefill 128", "prefill 512", "decode", "bandwidth"), each
# returning one figure: milliseconds for a prefill, tokens/s for a decode run, GB/s for bandwidth.


def ort_runner(artifact: Path, provider: str, threads: int, shared_pool: bool = False):
    from exporter.runtime.runner import OrtRunner
    from exporter.runtime.settings import SessionSettings

    return OrtRunner(
        artifact, provider, settings=SessionSettings(intra_op_threads=threads, shared_thread_pool=shared_pool)
    )


def ort_start(runner, ids):
    import numpy as np

    from exporter.runtime.runner import position_ids_from_mask

    mask = np.ones_like(ids)
    return runner.start(ids, mask, position_ids_from_mask(mask))


def ort_decode_run(runner, steps: int = DECODE_STEPS) -> float:
    """Greedy decode of `steps` tokens after a short prompt, one step() at a time as generate() and stream() run it;
    tokens/s of the steps. `runner`: any Runner (exporter.runtime.protocol), OrtRunner as users run it."""
    import numpy as np

    logits = ort_start(runner, prompt(PROMPT_FOR_DECODE, runner.manifest.config.vocab_size))
    mask = np.ones((1, PROMPT_FOR_DECODE), dtype=np.int64)
    begin = time.perf_counter()
    for _ in range(steps):
        token = np.array([[int(logits.argmax())]], dtype=np.int64)
        mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        logits = runner.step(token, mask, np.array([[mask.shape[1] - 1]], dtype=np.int64))
    return steps / (time.perf_counter() - begin)


def prompt_lengths(context: int) -> list[int]:
    """The prefill lengths a model with `context` positions can take, leaving one for a new token (a tiny
    test model has fewer than 512)."""
    return [n for n in PREFILL_LENGTHS if n < context]


def ort_tasks(artifact: Path, provider: str, threads: int) -> dict:
    """Generation as users run it: prompts through OrtRunner.start, then decode steps."""
    runner = ort_runner(artifact, provider, threads)
    vocab = runner.manifest.config.vocab_size
    tasks = {
        f"prefill {n}": (lambda ids=prompt(n, vocab): elapsed_ms(lambda: ort_start(runner, ids)))
        for n in prompt_lengths(runner.manifest.config.max_position_embeddings)
    }
    tasks["decode"] = lambda: ort_decode_run(runner)
    return tasks


def torch_tasks(artifact: Path, threads: int, device: str) -> dict:
    import torch

    from exporter.artifact.manifest import read_manifest
    from exporter.verify.references.model_source import rebuild_reference

    if threads:
        torch.set_num_threads(threads)
    manifest = read_manifest(artifact, check_hashes=False)
    # The model verify compares the artifact with (seeded again, or its checkpoint read again), in the
    # artifact's precision as the parity checks run it (a float16 artifact against float32 PyTorch would
    # compare two precisions).
    model = rebuild_reference(artifact, manifest).to(device, getattr(torch, manifest.dtype))
    vocab = manifest.config.vocab_size
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    @torch.inference_mode()
    def forward(ids, **kwargs):
        out = model(ids, use_cache=True, **kwargs)
        sync()
        return out

    @torch.inference_mode()
    def decode_run():
        out = forward(torch.from_numpy(prompt(PROMPT_FOR_DECODE, vocab)).to(device))
        begin = time.perf_counter()
        for _ in range(DECODE_STEPS):
            token = out.logits[:, -1:].argmax(-1)
            out = forward(token, past_key_values=out.past_key_values)
        return DECODE_STEPS / (time.perf_counter() - begin)

    tasks = {
        f"prefill {n}": (lambda ids=torch.from_numpy(prompt(n, vocab)).to(device): elapsed_ms(lambda: forward(ids)))
        for n in prompt_lengths(manifest.config.max_position_embeddings)
    }
    tasks["decode"] = decode_run
    return tasks


def genai_tasks(artifact: Path, threads: int) -> dict:
    """onnxruntime-genai's own generator on the same folder (its genai_config.json session options, the
    thread count of --threads when given), running the same prompts and greedy decode as the ONNX Runtime
    worker."""
    from exporter.runtime.genai import GenaiGenerator

    generator = GenaiGenerator(artifact, threads=threads)
    vocab = generator.manifest.config.vocab_size
    decode_ids = prompt(PROMPT_FOR_DECODE, vocab)[0].tolist()

    def prefill_ms(ids: list[int]) -> float:
        run = generator.greedy_search(len(ids) + 1, stop_at_eos=False)
        return elapsed_ms(lambda: run.append_tokens(ids))  # runs the prompt

    def decode_run():
        run = generator.greedy_search(len(decode_ids) + 1 + DECODE_STEPS, stop_at_eos=False)
        return genai_decode_rate(run, decode_ids)

    tasks = {
        f"prefill {n}": (lambda ids=prompt(n, vocab)[0].tolist(): prefill_ms(ids))
        for n in prompt_lengths(generator.manifest.config.max_position_embeddings)
    }
    tasks["decode"] = decode_run
    return tasks


def genai_decode_rate(run, prompt_ids: list[int]) -> float:
    """Tokens/s of DECODE_STEPS greedy steps of an onnxruntime-genai generator (`run`, room for the prompt, one
    token more and the steps) after `prompt_ids`. The first generate_next_token only picks a token from the prompt's
    logits; each later one runs the model on the token before, then picks: DECODE_STEPS model runs, as in
    ort_decode_run."""
    run.append_tokens(prompt_ids)
    run.generate_next_token()
    begin = time.perf_counter()
    for _ in range(DECODE_STEPS):
        run.generate_next_token()
    return DECODE_STEPS / (time.perf_counter() - begin)


def bandwidth_tasks(threads: int) -> dict:
    """Memory read bandwidth: summing a 512 MiB buffer, split over `threads` threads (numpy frees the GIL)."""
    import numpy as np

    data = np.ones(512 * 2**20 // 8, dtype=np.float64)
    parts = np.array_split(data, threads or os.cpu_count())

    def read_all():
        workers = [threading.Thread(target=np.add.reduce, args=(part,)) for part in parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def read_gb_per_s():
        return data.nbytes / statistics.median(elapsed_ms(read_all) for _ in range(5)) / 1e6

    return {"bandwidth": read_gb_per_s}


def serve(tasks: dict) -> None:
    """Run one task per line read from stdin (its name) and print its figure; "rss" prints the peak RSS."""
    for task in tasks.values():
        task()  # warm-up: first-call allocations
    print(json.dumps(sorted(tasks)), flush=True)
    for line in sys.stdin:
        name = line.strip()
        print(peak_rss_mb() if name == "rss" else tasks[name](), flush=True)


class WorkerFailed(Exception):
    """A worker process stopped; its own error went to stderr."""


def _ignore_sigint() -> None:
    """In a worker, before it runs: Ctrl-C reaches the whole process group, and the parent stops the workers
    itself; left alone, each worker would print its own KeyboardInterrupt traceback. Python keeps a SIGINT
    that is ignored at its start ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_in_turns(workers: dict[str, list[str]], rounds: int) -> tuple[dict, dict]:
    """Every task of every worker, `rounds` times, in turns: within a round each task runs on each
    worker offering it, in an order reversed every other round. Returns each worker's figures per
    task (one per round) and each worker's peak RSS at the end."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, __file__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_ignore_sigint,
        )
        for name, args in workers.items()
    }
    try:
        return _turns(procs, rounds)
    finally:  # a failed worker stops the others too, rather than leaving them behind
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _turns(procs: dict, rounds: int) -> tuple[dict, dict]:
    offered = {}
    for name, proc in procs.items():
        line = proc.stdout.readline()
        if not line:
            raise WorkerFailed(f"benchmark worker {name} failed to start (its error is above)")
        offered[name] = json.loads(line)
    tasks = sorted({task for names in offered.values() for task in names})
    figures = {name: {task: [] for task in offered[name]} for name in procs}

    def ask(name: str, request: str) -> float:
        procs[name].stdin.write(request + "\n")
        procs[name].stdin.flush()
        answer = procs[name].stdout.readline()
        if not answer:
            raise WorkerFailed(f"benchmark worker {name} stopped during {request!r} (its error is above)")
        return float(answer)

    for turn in range(rounds):
        for task in tasks:
            order = [name for name in procs if task in offered[name]]
            for name in order if turn % 2 == 0 else order[::-1]:
                time.sleep(SETTLE_S)
                figures[name][task].append(ask(name, task))
    peaks = {name: ask(name, "rss") for name in procs}
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    return figures, peaks


# ----------------------------------------------------------------------------- two sessions in one process


def worker_sessions(artifact: Path, provider: str, threads: int, shared_pool: bool) -> dict:
    """RSS with both sessions loaded; a decode step right after a call to the other session (prefill.onnx)
    against one right after a decode step; RSS once prefill.onnx has run too."""
    import numpy as np

    from exporter.runtime.runner import position_ids_from_mask

    runner = ort_runner(artifact, provider, threads, shared_pool)
    result = {"loaded_peak_rss_mb": peak_rss_mb()}
    ids = prompt(PROMPT_FOR_DECODE, runner.manifest.config.vocab_size)
    mask = np.ones_like(ids)
    prefill_feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
    if runner.manifest.with_loss:
        prefill_feeds["labels"] = ids
    ort_start(runner, ids)
    step_mask = mask

    def timed_step():  # the next step of a generation that goes on
        nonlocal step_mask
        step_mask = np.concatenate([step_mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        inputs = (np.array([[5]], dtype=np.int64), step_mask, np.array([[step_mask.shape[1] - 1]], dtype=np.int64))
        return elapsed_ms(lambda: runner.step(*inputs))

    timed_step()
    alternating, in_a_row, after_pause = [], [], []
    for _ in range(20):
        prefill_ms = elapsed_ms(lambda: runner.prefill(prefill_feeds))
        alternating.append(timed_step())
        in_a_row.append(timed_step())
        # A lone session idle as long: its step after the pause is what the alternating step should match.
        time.sleep(prefill_ms / 1e3)
        after_pause.append(timed_step())
    result["decode_step_after_prefill_ms"] = statistics.median(alternating)
    result["decode_step_in_a_row_ms"] = statistics.median(in_a_row)
    result["decode_step_after_pause_ms"] = statistics.median(after_pause)
    result["peak_rss_with_prefill_graph_run_mb"] = peak_rss_mb()
    return result


def run_worker(args: list[str]) -> dict:
    proc = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint,
    )
    try:
        stdout, stderr = proc.communicate()
    finally:  # on an interrupt, stopped and waited for: subprocess.run killed it without a wait, leaving a zombie
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        sys.stderr.write(stderr[-2000:])
        raise WorkerFailed(f"benchmark worker {args[1]} failed (its error is above)")
    return json.loads(stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the report

DEFAULT_ARTIFACT = Path("artifacts/minimind-3")


def ensure_artifact(folder: Path) -> None:
    """The default folder is exported when it is missing; any other folder must be an artifact already, with
    room for the decode run (a prompt, DECODE_STEPS steps, and onnxruntime-genai's last picked token), and a
    PyTorch side the toolkit can rebuild."""
    if folder == DEFAULT_ARTIFACT and not folder.exists():
        print(f"no artifact at {folder}; exporting minimind-3 (about 2 minutes)", file=sys.stderr)
        from exporter.export.pipeline import export_artifact
        from reference.source import seeded_model

        seeded = seeded_model("minimind-3")
        export_artifact(seeded.model, folder, source=seeded.source)
    from exporter.artifact.manifest import read_manifest
    from exporter.errors import EXPORT_EXTRA, InputError
    from exporter.verify.references.model_source import rebuild_problem

    manifest = read_manifest(folder)  # ArtifactError: not an artifact, or damaged
    problem = rebuild_problem(manifest)
    if problem is not None:  # else the PyTorch worker fails in its warm-up, the others started
        fix = {
            "torch": f"install the export extra ({EXPORT_EXTRA})",
            "checkpoint": "restore it or re-export",
            "source": "benchmark an artifact export-onnx exported from a preset or a checkpoint",
        }[problem.cause]
        raise InputError(
            f"{folder}: the benchmark times the PyTorch reference beside onnxruntime, and {problem.reason}; {fix}"
        )
    needed = PROMPT_FOR_DECODE + DECODE_STEPS + 1
    if manifest.config.max_position_embeddings < needed:  # else every worker fails in its warm-up
        raise InputError(
            f"{folder}: the decode run needs {needed} positions ({PROMPT_FOR_DECODE}-token prompt, "
            f"{DECODE_STEPS} steps); the model has {manifest.config.max_position_embeddings}"
        )


def ratio_summary(numerators: list[float], denominators: list[float]) -> tuple[float, list[float]]:
    """The median of the per-round ratios, and their first and third quartiles: on a shared machine
    the spread over rounds says how far a single run's ratio can be trusted."""
    per_round = [n / d for n, d in zip(numerators, denominators)]
    if len(per_round) < 2:
        return per_round[0], per_round * 2
    q1, median, q3 = statistics.quantiles(per_round, n=4, method="inclusive")
    return median, [q1, q3]


def summarise(figures: dict, peaks: dict, weight_bytes: int) -> dict:
    """Medians per side and task, and the same-round ratios (ours against each other side)."""

    def side(name):
        out = {
            f"prefill_{n}_ms": statistics.median(figures[name][f"prefill {n}"])
            for n in PREFILL_LENGTHS
            if f"prefill {n}" in figures[name]
        }
        out["decode_tokens_per_s"] = statistics.median(figures[name]["decode"])
        out["decode_step_ms"] = 1000 / out["decode_tokens_per_s"]
        out["peak_rss_mb"] = peaks[name]
        return out

    ours, torch_ = figures["onnxruntime"], figures["pytorch"]
    bandwidth = figures["bandwidth"]["bandwidth"]
    floor_steps_ms = [weight_bytes / (gb * 1e9) * 1000 for gb in bandwidth]
    ratios, quartiles = {}, {}

    def ratio(name, numerators, denominators):
        ratios[name], quartiles[name] = ratio_summary(numerators, denominators)

    for n in [n for n in PREFILL_LENGTHS if f"prefill {n}" in ours]:
        ratio(f"prefill_{n}", torch_[f"prefill {n}"], ours[f"prefill {n}"])
    ratio("decode", ours["decode"], torch_["decode"])
    # decode step / floor step = floor tokens/s / our tokens/s
    ratio("decode_step_to_floor", [1000 / ms for ms in floor_steps_ms], ours["decode"])
    ratios["peak_rss"] = peaks["pytorch"] / peaks["onnxruntime"]
    report = {
        "onnxruntime": side("onnxruntime"),
        "pytorch": side("pytorch"),
        "ratios": ratios,
        "ratio_quartiles": quartiles,
        "floor": {
            "weight_mb": weight_bytes / 1e6,
            "read_gb_per_s": statistics.median(bandwidth),
            "floor_step_ms": statistics.median(floor_steps_ms),
        },
        "onnxruntime_genai": None,
    }
    if "genai" in figures:
        report["onnxruntime_genai"] = side("genai")
        genai = figures["genai"]
        for n in [n for n in PREFILL_LENGTHS if f"prefill {n}" in genai]:  # speed: genai's ms over ours
            ratio(f"prefill_{n}_ours_to_genai", genai[f"prefill {n}"], ours[f"prefill {n}"])
        ratio("ours_to_genai", ours["decode"], genai["decode"])
    return report


def session_steps(sessions: dict) -> str:
    return " / ".join(
        f"{sessions[f'decode_step_{when}_ms']:.1f} ms" for when in ("after_prefill", "after_pause", "in_a_row")
    )


def format_table(report: dict) -> str:
    ort, torch_, ratios, floor = report["onnxruntime"], report["pytorch"], report["ratios"], report["floor"]
    quartiles = report["ratio_quartiles"]

    def spread(name):
        return f"{quartiles[name][0]:.2f}-{quartiles[name][1]:.2f}" if name in quartiles else ""

    rows = [
        ("prefill 128 tokens (ms)", "prefill_128_ms", "prefill_128"),
        ("prefill 512 tokens (ms)", "prefill_512_ms", "prefill_512"),
        ("decode tokens/s (128 steps)", "decode_tokens_per_s", "decode"),
        ("decode step (ms)", "decode_step_ms", "decode"),
        ("peak RSS (MB)", "peak_rss_mb", "peak_rss"),
    ]
    lines = [f"{'':32}{'onnxruntime':>14}{'pytorch':>12}{'ratio':>10}{'q1-q3':>12}", "-" * 80]
    for label, key, ratio in [row for row in rows if row[1] in ort]:
        lines.append(f"{label:32}{ort[key]:>14.1f}{torch_[key]:>12.1f}{ratios[ratio]:>9.2f}x {spread(ratio):>11}")
    genai = report["onnxruntime_genai"]
    if genai:
        lines += ["", f"{'':32}{'genai':>14}{'':12}{'ours/genai':>10}{'q1-q3':>12}  (speed: >1 means ours is faster)"]
        for n in [n for n in PREFILL_LENGTHS if f"prefill_{n}_ms" in genai]:
            name = f"prefill_{n}_ours_to_genai"
            lines.append(
                f"{f'prefill {n} tokens (ms)':32}{genai[f'prefill_{n}_ms']:>14.1f}"
                f"{'':12}{ratios[name]:>9.2f}x {spread(name):>11}"
            )
        lines.append(
            f"{'decode tokens/s (128 steps)':32}{genai['decode_tokens_per_s']:>14.1f}"
            f"{'':12}{ratios['ours_to_genai']:>9.2f}x {spread('ours_to_genai'):>11}"
        )
    else:
        lines.append("onnxruntime-genai: not installed (or not on this provider), column skipped")
    sessions, shared = report["sessions"], report["sessions_shared_pool"]
    lines += [
        "",
        f"ratios: medians of the per-round ratios ({report['rounds']} round{'s' * (report['rounds'] != 1)}, "
        f"in turns), q1-q3 their "
        f"quartiles; figures: medians of the rounds",
        f"weights {floor['weight_mb']:.1f} MB; memory read bandwidth {floor['read_gb_per_s']:.1f} GB/s; "
        f"weight-read floor {floor['floor_step_ms']:.1f} ms/token",
        f"onnxruntime decode step / floor: {ratios['decode_step_to_floor']:.2f}x "
        f"(q1-q3 {spread('decode_step_to_floor')})",
        f"peak RSS / weights: {ort['peak_rss_mb'] / floor['weight_mb']:.2f}x generating; "
        f"{sessions['loaded_peak_rss_mb'] / floor['weight_mb']:.2f}x with both sessions loaded; "
        f"{sessions['peak_rss_with_prefill_graph_run_mb'] / floor['weight_mb']:.2f}x "
        f"once prefill.onnx has run too",
        "decode step right after a prefill.onnx call (alternating sessions) / after an idle pause as long "
        "as that call / right after a decode step:",
        f"  per-session pools, prefill threads not spinning (default): {session_steps(sessions)}",
        f"  one shared thread pool (opt-in): {session_steps(shared)}",
    ]
    if "prefill_skipped" in report:
        lines.append(f"prefill skipped: {report['prefill_skipped']}")
    if "floor_note" in report:
        lines.append(f"mixture of experts: {report['floor_note']}")
    if "host_memory_figures" in report:
        lines.append(f"on cuda: {report['host_memory_figures']}")
    if report.get("results_file"):
        lines.append(f"results written to {report['results_file']}")
    return "\n".join(lines)


DEFAULT_RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
VERSIONED = ("torch", "onnxruntime", "onnxruntime-genai", "numpy")  # distributions whose version RESULTS.md lists


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, with its family, model and stepping where it gives them (a model
    name such as "AMD EPYC" spans generations); "unknown" where it names none."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or fields.get("Model") or platform.processor() or "unknown"
    ids = [f"{key} {fields[key]}" for key in ("cpu family", "model", "stepping") if fields.get(key)]
    return f"{name} ({', '.join(ids)})" if ids else name


def shown_path(path) -> str:
    """A path as a user in this folder would type it: relative below the current folder, absolute elsewhere."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def environment(argv: list[str]) -> dict:
    """Where and how this run measured: the date, the machine, the versions, the command line."""
    versions = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    python = shown_path(sys.executable)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "versions": versions,
        "command": shlex.join([python, *argv]),
    }


def _cell(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def results_header(title: str, generated_by: str, env: dict) -> list[str]:
    """A results file's first lines: its title, what generates it, and the first rows of its environment table (the
    date and the machine); the caller's rows follow."""
    return [
        f"# {title}",
        "",
        f"Generated by {generated_by}; do not edit.",
        "",
        "| | |",
        "|---|---|",
        f"| date | {env['date']} |",
        f"| CPU | {env['cpu']} |",
        f"| cores | {env['cpus']} logical, {env['usable_cpus']} usable |",
    ]


def format_results(report: dict) -> str:
    """RESULTS.md: the run's environment and its figures as tables, generated, never edited by hand."""
    env, ratios, quartiles, floor = report["environment"], report["ratios"], report["ratio_quartiles"], report["floor"]
    ours, torch_, genai = report["onnxruntime"], report["pytorch"], report["onnxruntime_genai"] or {}
    versions = env["versions"]

    def ratio(name):
        if name not in ratios:
            return "—", "—"
        q = quartiles.get(name)
        return f"{ratios[name]:.2f}x", (f"{q[0]:.2f}–{q[1]:.2f}" if q else "—")

    lines = [
        *results_header("Runtime benchmark results", "`benchmarks/runtime.py` on every full run", env),
        *(f"| {name} | {versions[name] or 'not installed'} |" for name in ("python", *VERSIONED)),
        f"| command | `{env['command']}` |",
        f"| artifact | `{report['artifact']}` ({report.get('dtype', '?')}) |",
        f"| provider, threads | {report['provider']}, {report['threads'] or 'each library default'} |",
        f"| rounds | {report['rounds']} (in turns; figures: medians of the rounds; ratios: medians of the "
        "per-round ratios, q1–q3 their quartiles) |",
        "",
        "## Figures",
        "",
        "| | ours (onnxruntime) | PyTorch | onnxruntime-genai |",
        "|---|---|---|---|",
    ]
    rows = [(f"prefill {n} tokens (ms)", f"prefill_{n}_ms") for n in PREFILL_LENGTHS if f"prefill_{n}_ms" in ours] + [
        (f"decode tokens/s ({DECODE_STEPS} steps)", "decode_tokens_per_s"),
        ("decode step (ms)", "decode_step_ms"),
        ("peak RSS (MB)", "peak_rss_mb"),
    ]
    for label, key in rows:
        lines.append(f"| {label} | {_cell(ours[key])} | {_cell(torch_[key])} | {_cell(genai.get(key))} |")
    lines += ["", "## Ratios", "", "| | median | q1–q3 |", "|---|---|---|"]
    named = [
        (f"ours / PyTorch, prefill {n} (speed)", f"prefill_{n}") for n in PREFILL_LENGTHS if f"prefill_{n}" in ratios
    ]
    named += [
        ("ours / PyTorch, decode tokens/s", "decode"),
        ("PyTorch / ours, peak RSS", "peak_rss"),
    ]
    named += [
        (f"ours / genai, prefill {n} (speed)", f"prefill_{n}_ours_to_genai")
        for n in PREFILL_LENGTHS
        if f"prefill_{n}_ours_to_genai" in ratios
    ]
    named += [
        ("ours / genai, decode tokens/s", "ours_to_genai"),
        ("ours decode step / weight-read floor", "decode_step_to_floor"),
    ]
    for label, name in named:
        median, spread = ratio(name)
        lines.append(f"| {label} | {median} | {spread} |")
    lines += [
        "",
        "## Weight-read floor",
        "",
        "| weights (MB) | read bandwidth (GB/s) | floor step (ms) | floor tokens/s |",
        "|---|---|---|---|",
        f"| {floor['weight_mb']:.1f} | {floor['read_gb_per_s']:.1f} | {floor['floor_step_ms']:.2f} | "
        f"{1000 / floor['floor_step_ms']:.1f} |",
    ]
    sessions, shared = report["sessions"], report["sessions_shared_pool"]
    lines += [
        "",
        "## Decode step in one process holding both sessions (ms)",
        "",
        "| thread pools | after a prefill.onnx call | after an idle pause as long | after a decode step |",
        "|---|---|---|---|",
    ]
    for label, figures in (("per session (default)", sessions), ("one shared pool", shared)):
        lines.append(
            f"| {label} | "
            + " | ".join(
                f"{figures[f'decode_step_{when}_ms']:.2f}" for when in ("after_prefill", "after_pause", "in_a_row")
            )
            + " |"
        )
    notes = [(key, report[key]) for key in ("prefill_skipped", "floor_note", "host_memory_figures") if key in report]
    if notes:
        lines += ["", "| note | |", "|---|---|", *(f"| {key} | {text} |" for key, text in notes)]
    return "\n".join(lines) + "\n"


def check_results_path(path: Path) -> None:
    """A --results path that can be written, refused before any worker starts."""
    from exporter.errors import InputError

    if path.is_dir():
        raise InputError(f"--results {path} is a folder; give a file path, e.g. {path / 'RESULTS.md'}")
    if not path.parent.is_dir():
        raise InputError(f"--results {path}: the folder {path.parent} does not exist; create it or write elsewhere")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"--results {path} cannot be written by this user; write it elsewhere, or pass --no-results")


def write_results(path: Path, report: dict) -> None:
    """RESULTS.md written whole: to a file beside it, then renamed over it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(format_results(report))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _at_least(lowest: int, highest: int | None = None):
    def parse(text: str) -> int:
        value = int(text)
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be {lowest} or more, got {value}")
        if highest is not None and value > highest:
            raise argparse.ArgumentTypeError(f"must be {highest} or less, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its error
    return parse


def json_asked(argv: list[str]) -> bool:
    """Whether the command line asks for --json, spelled out or abbreviated as argparse accepts it (--js)."""
    return any(len(arg) > 2 and "--json".startswith(arg) for arg in argv)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # With --json an error is a JSON object on stdout too (README), a usage error included; on stderr it is
        # one line, as the CLI's is.
        if json_asked(sys.argv[1:]):
            from exporter.cli.document import error_document

            print(json.dumps(error_document("usage", message, 2), indent=2))
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def fail(kind: str, message: str, code: int, as_json: bool) -> None:
    """One line on stderr and, with --json, the CLI's error object on stdout (kind "worker" for a worker
    process that failed); then exit with `code`."""
    print(message if kind == "interrupted" else f"error: {message}", file=sys.stderr)
    if as_json:  # exporter.errors only: an interrupt may have left a heavier import (onnx, numpy) half done
        from exporter.cli.document import error_document

        print(json.dumps(error_document(kind, message, code), indent=2))
    sys.exit(code)


def main() -> None:
    # Ctrl-C at any point, the imports before a worker starts included, is the one line and exit 130 of an
    # interrupt, not a traceback (the workers ignore SIGINT: run_in_turns and run_worker stop them).
    try:
        run()
    except KeyboardInterrupt:
        fail("interrupted", "interrupted (SIGINT)", 130, json_asked(sys.argv[1:]))


def run() -> None:
    from exporter.runtime.settings import MAX_THREADS  # more is refused here, not by a worker's traceback

    parser = _Parser(description=__doc__.splitlines()[0], epilog=__doc__.splitlines()[-1])  # the exit codes
    parser.add_argument(
        "--artifact",
        type=Path,
        default=DEFAULT_ARTIFACT,
        help=f"artifact folder to measure (default {DEFAULT_ARTIFACT}, exported with seeded "
        "minimind-3 weights when missing; any other folder must be an artifact already)",
    )
    parser.add_argument(
        "--threads",
        type=_at_least(0, MAX_THREADS),
        default=0,
        help="threads for every side; 0 (default): each library's own default, as users get it: "
        "ONNX Runtime one pinned thread per physical core (our runtime's default and what "
        "genai_config.json asks for), PyTorch torch's default, the bandwidth probe one per CPU",
    )
    parser.add_argument(
        "--rounds",
        type=_at_least(1),
        default=7,
        help="rounds in turns (default 7); each figure is the median of its rounds",
    )
    parser.add_argument(
        "--provider",
        default="cpu",
        choices=["cpu", "cuda"],
        help="onnxruntime provider; with cuda, PyTorch also runs on the GPU",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout instead of a table")
    results = parser.add_mutually_exclusive_group()
    results.add_argument(
        "--results",
        type=Path,
        default=DEFAULT_RESULTS,
        metavar="PATH",
        help="write the generated results file here (default benchmarks/RESULTS.md beside this script)",
    )
    results.add_argument("--no-results", action="store_true", help="write no results file")
    parser.add_argument(
        "--worker",
        choices=["ort", "torch", "genai", "bandwidth", "sessions", "sessions-shared-pool"],
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    if args.worker in ("sessions", "sessions-shared-pool"):
        shared = args.worker == "sessions-shared-pool"
        print(json.dumps(worker_sessions(args.artifact, args.provider, args.threads, shared)))
        return
    if args.worker:
        serve(
            {
                "ort": lambda: ort_tasks(args.artifact, args.provider, args.threads),
                "torch": lambda: torch_tasks(args.artifact, args.threads, "cuda" if args.provider == "cuda" else "cpu"),
                "genai": lambda: genai_tasks(args.artifact, args.threads),
                "bandwidth": lambda: bandwidth_tasks(args.threads),
            }[args.worker]()
        )
        return

    from exporter.errors import ToolkitError
    from exporter.runtime.providers import check_provider
    from exporter.verify.reports import json_text

    results = None if args.no_results else args.results
    try:
        check_provider(args.provider)  # before any worker starts
        if results is not None:
            check_results_path(results)
        ensure_artifact(args.artifact)
        report = measure(args)
    except (ToolkitError, WorkerFailed) as exc:
        kind, code = ("input", 2) if isinstance(exc, ToolkitError) else ("worker", 1)
        fail(kind, str(exc), code, args.json)
    report["environment"] = environment(sys.argv)
    report["results_file"] = None if results is None else shown_path(results)
    try:
        if results is not None:
            write_results(results, report)
    except OSError as exc:  # the measurement is still printed; the error follows it in one line
        print(json_text(report) if args.json else format_table(report))
        print(f"error: cannot write --results {results} ({exc.strerror or exc})", file=sys.stderr)
        sys.exit(2)
    print(json_text(report) if args.json else format_table(report))


def floor_note(config) -> str | None:
    """Why the weight-read floor does not bound this model's decode step, if it does not."""
    if getattr(config, "use_moe", False):
        return (
            "the floor counts every expert's weights, but a step reads only the experts its tokens are routed "
            "to: for this model it is not a lower bound, and decode / floor can fall below 1"
        )
    return None


def measure(args) -> dict:
    common = ["--artifact", str(args.artifact), "--threads", str(args.threads), "--provider", args.provider]
    workers = {
        "onnxruntime": ["--worker", "ort", *common],
        "pytorch": ["--worker", "torch", *common],
        "bandwidth": ["--worker", "bandwidth", *common],
    }
    if importlib.util.find_spec("onnxruntime_genai") and args.provider == "cpu":  # its config selects the CPU
        workers["genai"] = ["--worker", "genai", *common]
    figures, peaks = run_in_turns(workers, args.rounds)
    from exporter.artifact.manifest import read_manifest

    manifest = read_manifest(args.artifact, check_hashes=False)
    report = summarise(figures, peaks, (args.artifact / manifest.weights_file).stat().st_size)
    note = floor_note(manifest.config)
    if note:
        report["floor_note"] = note
    positions = manifest.config.max_position_embeddings
    if skipped := [str(n) for n in PREFILL_LENGTHS if n not in prompt_lengths(positions)]:
        report["prefill_skipped"] = f"{' and '.join(skipped)} tokens: the model has {positions} positions"
    if args.provider == "cuda":
        report["host_memory_figures"] = (
            "the bandwidth, the weight-read floor and peak RSS measure the host's "
            "memory, not the GPU's: they do not bound a decode on the GPU"
        )
    report.update(
        artifact=str(args.artifact),
        dtype=manifest.dtype,
        provider=args.provider,
        threads=args.threads,
        rounds=args.rounds,
        sessions=run_worker(["--worker", "sessions", *common]),
        sessions_shared_pool=run_worker(["--worker", "sessions-shared-pool", *common]),
    )
    return report


if __name__ == "__main__":
    main()
