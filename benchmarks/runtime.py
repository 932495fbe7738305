"""Runtime benchmark: ONNX Runtime against the PyTorch reference, measured in the same run.

For minimind-3 (fp32 by default) at batch 1 it prints prefill latency at 128
and 512 tokens, decode tokens/s over 128 steps and peak RSS, for ONNX Runtime
and for PyTorch eager; the ratios; and the weight-read floor (weight bytes
divided by the memory bandwidth measured in this run). Each side runs in its
own process so peak RSS is its own. Figures are medians of several runs.
Our decode and onnxruntime-genai's run in turns, in two processes kept loaded,
so that the ratio between them holds on a machine shared with other work
(the median of the per-round ratios).

    .venv/bin/python benchmarks/runtime.py [--artifact DIR] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

PREFILL_LENGTHS = (128, 512)
DECODE_STEPS = 128
PROMPT_FOR_DECODE = 16


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def prompt(length: int, vocab: int):
    import numpy as np
    return np.random.default_rng(length).integers(3, vocab, (1, length), dtype=np.int64)


def ort_runner(artifact: Path, provider: str, threads: int, shared_pool: bool = False):
    from exporter.runtime import OrtRunner, SessionSettings
    return OrtRunner(artifact, provider,
                     settings=SessionSettings(intra_op_threads=threads, shared_thread_pool=shared_pool))


def ort_start(runner, ids):
    import numpy as np

    from exporter.runtime import position_ids_from_mask
    mask = np.ones_like(ids)
    return runner.start(ids, mask, position_ids_from_mask(mask))


def ort_decode_run(runner) -> float:
    """Greedy decode of DECODE_STEPS tokens after a short prompt; tokens/s of the steps."""
    import numpy as np
    logits = ort_start(runner, prompt(PROMPT_FOR_DECODE, runner.manifest.config.vocab_size))
    mask = np.ones((1, PROMPT_FOR_DECODE), dtype=np.int64)
    begin = time.perf_counter()
    for _ in range(DECODE_STEPS):
        token = np.array([[int(logits.argmax())]], dtype=np.int64)
        mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        logits = runner.step(token, mask, np.array([[mask.shape[1] - 1]], dtype=np.int64))
    return DECODE_STEPS / (time.perf_counter() - begin)


def worker_ort(artifact: Path, provider: str, threads: int, repeats: int, shared_pool: bool = False) -> dict:
    import numpy as np

    from exporter.runtime import position_ids_from_mask

    runner = ort_runner(artifact, provider, threads, shared_pool)
    vocab = runner.manifest.config.vocab_size
    loaded_mb = peak_rss_mb()
    result = {"name": f"onnxruntime {provider}", "loaded_peak_rss_mb": loaded_mb}

    for length in PREFILL_LENGTHS:
        ids = prompt(length, vocab)
        ort_start(runner, ids)  # warm-up: first-call allocations
        result[f"prefill_{length}_ms"] = median_ms(lambda: ort_start(runner, ids), repeats)

    ort_decode_run(runner)
    result["decode_tokens_per_s"] = statistics.median(ort_decode_run(runner) for _ in range(max(3, repeats // 2)))
    result["peak_rss_mb"] = peak_rss_mb()  # generation: prompts and decode steps, both graphs loaded
    # A decode step right after a call to the other session (prefill.onnx), against steps in a row.
    ids = prompt(PROMPT_FOR_DECODE, vocab)
    mask = np.ones_like(ids)
    prefill_feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
    if runner.manifest.with_loss:
        prefill_feeds["labels"] = ids
    step_inputs = (np.array([[5]], dtype=np.int64), np.ones((1, PROMPT_FOR_DECODE + 1), dtype=np.int64),
                   np.array([[PROMPT_FOR_DECODE]], dtype=np.int64))
    ort_start(runner, ids)
    cache = dict(runner._cache)

    def timed_step():
        runner._cache = cache
        begin = time.perf_counter()
        runner.step(*step_inputs)
        return time.perf_counter() - begin

    alternating, in_a_row = [], []
    for _ in range(20):
        runner.prefill(prefill_feeds)
        alternating.append(timed_step())
        in_a_row.append(timed_step())
    result["decode_step_after_prefill_ms"] = statistics.median(alternating) * 1000
    result["decode_step_in_a_row_ms"] = statistics.median(in_a_row) * 1000
    result["decode_step_ms"] = 1000 / result["decode_tokens_per_s"]
    result["peak_rss_with_prefill_graph_run_mb"] = peak_rss_mb()
    return result


def worker_torch(artifact: Path, threads: int, repeats: int, device: str) -> dict:
    import torch

    from exporter.manifest import read_manifest
    from reference import build_model

    torch.set_num_threads(threads or os.cpu_count())
    manifest = read_manifest(artifact, check_hashes=False)
    model = build_model(manifest.config, manifest.source.get("seed", 0)).to(device)
    vocab = manifest.config.vocab_size
    result = {"name": f"pytorch eager ({device})", "loaded_peak_rss_mb": peak_rss_mb()}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def forward(ids, **kwargs):
        out = model(ids, use_cache=True, **kwargs)
        sync()
        return out

    with torch.inference_mode():
        for length in PREFILL_LENGTHS:
            ids = torch.from_numpy(prompt(length, vocab)).to(device)
            forward(ids)
            result[f"prefill_{length}_ms"] = median_ms(lambda: forward(ids), repeats)

        def decode_run():
            out = forward(torch.from_numpy(prompt(PROMPT_FOR_DECODE, vocab)).to(device))
            begin = time.perf_counter()
            for _ in range(DECODE_STEPS):
                token = out.logits[:, -1:].argmax(-1)
                out = forward(token, past_key_values=out.past_key_values)
            return DECODE_STEPS / (time.perf_counter() - begin)

        decode_run()
        result["decode_tokens_per_s"] = statistics.median(decode_run() for _ in range(max(3, repeats // 2)))
    result["decode_step_ms"] = 1000 / result["decode_tokens_per_s"]
    result["peak_rss_mb"] = peak_rss_mb()
    return result


def genai_decode_run(artifact: Path):
    """onnxruntime-genai's own generator on the same folder (its genai_config.json session options):
    a function running the same greedy decode as ort_decode_run, returning tokens/s of the steps."""
    from exporter.genai import GenaiGenerator

    generator = GenaiGenerator(artifact)
    og, model = generator._og, generator.model
    ids = [int(i) for i in prompt(PROMPT_FOR_DECODE, generator.manifest.config.vocab_size)[0]]

    def decode_run():
        params = og.GeneratorParams(model)
        total = len(ids) + DECODE_STEPS  # min_length keeps eos from ending the run early
        params.set_search_options(do_sample=False, min_length=total, max_length=total)
        run = og.Generator(model, params)
        run.append_tokens(ids)  # the prompt
        begin = time.perf_counter()
        for _ in range(DECODE_STEPS):
            run.generate_next_token()
        return DECODE_STEPS / (time.perf_counter() - begin)

    return decode_run


def serve_decode_runs(decode_run) -> None:
    """One decode run per line read from stdin, its tokens/s printed as a line: the driver interleaves workers."""
    decode_run()  # warm-up
    print("ready", flush=True)
    for _ in sys.stdin:
        print(decode_run(), flush=True)


def interleaved_decode(workers: dict[str, list[str]], rounds: int) -> dict:
    """Decode tokens/s of several workers, measured in turns (A B, B A, ...) so that load from
    elsewhere on the machine falls on all of them alike. Returns per worker the median tokens/s
    and the median over rounds of its ratio to the first worker."""
    procs = {name: subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for name, args in workers.items()}
    for name, proc in procs.items():
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"benchmark worker {name} failed to start")
    runs: dict[str, list[float]] = {name: [] for name in procs}
    for turn in range(rounds):
        for name in (list(procs) if turn % 2 == 0 else list(procs)[::-1]):
            procs[name].stdin.write("run\n")
            procs[name].stdin.flush()
            runs[name].append(float(procs[name].stdout.readline()))
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    first = runs[next(iter(runs))]
    return {name: {"decode_tokens_per_s": statistics.median(values),
                   "ratio_to_first": statistics.median(v / f for v, f in zip(values, first))}
            for name, values in runs.items()}


def worker_bandwidth(threads: int, repeats: int) -> dict:
    """Memory read bandwidth: summing a 512 MiB buffer, split over `threads` threads (numpy frees the GIL)."""
    import numpy as np

    data = np.ones(512 * 2**20 // 8, dtype=np.float64)
    parts = np.array_split(data, threads)

    def read_all():
        workers = [threading.Thread(target=np.add.reduce, args=(part,)) for part in parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    read_all()
    seconds = median_ms(read_all, repeats) / 1000
    return {"name": "memory bandwidth", "read_gb_per_s": data.nbytes / seconds / 1e9}


def run_worker(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"benchmark worker {args[1]} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ensure_artifact(folder: Path) -> None:
    if (folder / "manifest.json").is_file():
        return
    print(f"no artifact at {folder}; exporting minimind-3 (about 2 minutes)", file=sys.stderr)
    from exporter.export import export_artifact
    from reference import build_model, get_preset
    export_artifact(build_model(get_preset("minimind-3"), 0), folder,
                    source={"kind": "seeded", "preset": "minimind-3", "seed": 0})


def format_table(report: dict) -> str:
    ort, torch_, floor = report["onnxruntime"], report["pytorch"], report["floor"]
    rows = [("prefill 128 tokens (ms)", "prefill_128_ms", False), ("prefill 512 tokens (ms)", "prefill_512_ms", False),
            ("decode tokens/s (128 steps)", "decode_tokens_per_s", True), ("decode step (ms)", "decode_step_ms", False),
            ("peak RSS (MB)", "peak_rss_mb", False)]
    lines = [f"{'':32}{'onnxruntime':>14}{'pytorch':>12}{'ratio':>10}", "-" * 68]
    for label, key, higher_is_better in rows:
        ratio = ort[key] / torch_[key] if higher_is_better else torch_[key] / ort[key]
        lines.append(f"{label:32}{ort[key]:>14.1f}{torch_[key]:>12.1f}{ratio:>9.2f}x")
    genai, shared = report["onnxruntime_genai"], report["onnxruntime_shared_pool"]
    if genai:
        lines.append(f"decode tok/s, ours and onnxruntime-genai in turns ({report['rounds']} rounds each): "
                     f"{genai['ours']['decode_tokens_per_s']:.1f} vs {genai['genai']['decode_tokens_per_s']:.1f}; "
                     f"ours / genai {genai['ours']['ratio_to_first']:.2f}x (median of per-round ratios)")
    else:
        lines.append("onnxruntime-genai: not installed, column skipped")
    lines += ["",
              f"weights {floor['weight_mb']:.1f} MB; memory read bandwidth {floor['read_gb_per_s']:.1f} GB/s; "
              f"weight-read floor {floor['floor_step_ms']:.1f} ms/token ({floor['floor_tokens_per_s']:.1f} tok/s)",
              f"onnxruntime decode step / floor: {ort['decode_step_ms'] / floor['floor_step_ms']:.2f}x; "
              f"peak RSS / weights: {ort['peak_rss_mb'] / floor['weight_mb']:.2f}x (generating); "
              f"{ort['peak_rss_with_prefill_graph_run_mb'] / floor['weight_mb']:.2f}x once prefill.onnx has run too",
              "decode step right after a prefill.onnx call (alternating sessions) vs right after a decode step:",
              f"  per-session pools, prefill threads not spinning (default): "
              f"{ort['decode_step_after_prefill_ms']:.1f} ms vs {ort['decode_step_in_a_row_ms']:.1f} ms",
              f"  one shared thread pool (opt-in): {shared['decode_step_after_prefill_ms']:.1f} ms "
              f"vs {shared['decode_step_in_a_row_ms']:.1f} ms; decode {shared['decode_tokens_per_s']:.1f} tok/s"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/minimind-3"))
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both sides")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--provider", default="cpu", choices=["cpu", "cuda"],
                        help="onnxruntime provider; with cuda, PyTorch also runs on the GPU")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", choices=["ort", "ort-shared-pool", "ort-decode", "torch", "genai-decode",
                                             "bandwidth"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker in ("ort", "ort-shared-pool"):
        shared = args.worker == "ort-shared-pool"
        print(json.dumps(worker_ort(args.artifact, args.provider, args.threads, args.repeats, shared)))
        return
    if args.worker == "torch":
        device = "cuda" if args.provider == "cuda" else "cpu"
        print(json.dumps(worker_torch(args.artifact, args.threads, args.repeats, device)))
        return
    if args.worker == "ort-decode":
        runner = ort_runner(args.artifact, args.provider, args.threads)
        serve_decode_runs(lambda: ort_decode_run(runner))
        return
    if args.worker == "genai-decode":
        serve_decode_runs(genai_decode_run(args.artifact))
        return
    if args.worker == "bandwidth":
        print(json.dumps(worker_bandwidth(args.threads, args.repeats)))
        return

    ensure_artifact(args.artifact)
    common = ["--artifact", str(args.artifact), "--threads", str(args.threads), "--repeats", str(args.repeats)]
    bandwidth = run_worker(["--worker", "bandwidth", *common])
    ort = run_worker(["--worker", "ort", "--provider", args.provider, *common])
    shared_pool = run_worker(["--worker", "ort-shared-pool", "--provider", args.provider, *common])
    torch_ = run_worker(["--worker", "torch", "--provider", args.provider, *common])
    genai = None
    if importlib.util.find_spec("onnxruntime_genai"):
        genai = interleaved_decode({"genai": ["--worker", "genai-decode", *common],
                                    "ours": ["--worker", "ort-decode", "--provider", args.provider, *common]},
                                   args.repeats)
    weight_bytes = (args.artifact / "weights.onnx.data").stat().st_size
    floor_s = weight_bytes / (bandwidth["read_gb_per_s"] * 1e9)
    report = {"artifact": str(args.artifact), "threads": args.threads, "rounds": args.repeats,
              "onnxruntime": ort, "pytorch": torch_,
              "onnxruntime_shared_pool": shared_pool, "onnxruntime_genai": genai,
              "floor": {"weight_mb": weight_bytes / 1e6, "read_gb_per_s": bandwidth["read_gb_per_s"],
                        "floor_step_ms": floor_s * 1000, "floor_tokens_per_s": 1 / floor_s}}
    print(json.dumps(report, indent=2) if args.json else format_table(report))


if __name__ == "__main__":
    main()
