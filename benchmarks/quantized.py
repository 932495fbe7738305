"""Quantized exports benchmark: float32, int8 and int4 of minimind-3 side by side, and our int4 against
onnxruntime-genai's builder int4 of the same Hugging Face folders.

1. minimind-3 (seeded weights; --quick: minimind-3-tiny) exported in float32 (torch.onnx), then in int8 and int4
   from those same graphs (the export's defaults: int4 in blocks of 32, int8 in blocks of 16 with its inputs
   smoothed; --accuracy-level, default 4: int8 math on the CPU; the lm_head and the token embedding at the
   export's defaults, which the tables name). Artifact bytes per
   precision; prefill and decode timed in turns with benchmarks/runtime.py's workers (same prompts, steps,
   warm-up, rounds; ratios are medians of per-round ratios) against PyTorch float32; the int4 weight-read floor.
2. The Qwen3-0.6B config (export_sizes.py's random-weight folder; --quick: a tiny one) exported by us in float32
   and int4 from the folder, decoded in turns with the weight-read floor measured beside them.
3. int4 at block sizes 32, 64 and 128, and at block 32 with float32 math (accuracy level 0): decode speed on the
   model of 1 against its float32 (in turns), and quality on the trained fixture's Qwen3 folder of 4 (exported and
   verified as there).
4. Two Qwen3 folders: the trained fixture (tests/fixtures/minimind-3-stdlib) written as a Qwen3ForCausalLM
   (its logits checked against the toolkit's reference first), and export_sizes.py's random-weight
   minimind-3-qwen3 folder (--quick: a tiny one). Each is exported by us (`export-onnx export --checkpoint
   FOLDER --dtype int4`) and by the builder (`-p int4 -e cpu`), verified with `export-onnx verify` (the
   builder's with `--reference FOLDER`), and decoded in turns: ours with our runtime and with
   onnxruntime-genai, the builder's with onnxruntime-genai (one engine for both artifacts).

Writes benchmarks/QUANTIZED-RESULTS.md (or --results PATH; not with --no-results): a generated file.

    python benchmarks/quantized.py [--rounds N] [--accuracy-level 0|1|2|3|4] [--quick] [--json]
        [--results PATH | --no-results] [--work DIR]

Exit codes: 0 done, 1 a step failed, 2 bad arguments, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import runtime as rt  # noqa: E402
from export_sizes import SIZES, Size, build_folder, cached_folder, our_env, tool_command  # noqa: E402
from foreign import export_command  # noqa: E402

ROOT = HERE.parent
FIXTURE = ROOT / "tests" / "fixtures" / "minimind-3-stdlib"
DEFAULT_WORK = ROOT / "artifacts" / "quantized"
DEFAULT_RESULTS = HERE / "QUANTIZED-RESULTS.md"
PRECISIONS = ("float32", "int8", "int4")
BLOCK_SIZES = (32, 64, 128)  # int4 blocks of the block-size trade-off; 32 is the export's default
FLOAT_MATH_LEVEL = 0  # MatMulNBits computing in float32: the other side of the accuracy-level trade-off
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "amx_tile")
QUALITY = ("kl_mean", "kl_p99", "top1_agreement", "nll_delta")
TINY_QWEN3 = Size(
    "qwen3-tiny",
    dict(
        SIZES["minimind-3-qwen3"].config,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        max_window_layers=2,
    ),
    "a tiny qwen3 folder (--quick)",
)
FIXTURE_POSITIONS = 512  # the fixture's 128 positions leave no room for the decode run (16 + 128 + 1)
TARGETS = {
    "int4_size": 0.2,  # int4 artifact bytes / float32 at most
    "int4_decode": 3.0,  # int4 / float32 decode tokens/s at least
    "int4_floor": 1.3,  # int4 decode step / its weight-read floor at most
    "int4_prefill": 1.5,  # PyTorch float32 / int4 prefill 512 ms at least (VNNI/AMX CPUs)
}


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def cpu_flags() -> list[str]:
    """The VNNI/AMX flags of the first processor in /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.partition(":")[2].split())
                    return [flag for flag in VNNI_FLAGS if flag in present]
    except OSError:
        pass
    return []


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_step(what: str, command: list[str]) -> None:
    done = subprocess.run(command, env=our_env(), capture_output=True, text=True)
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise StepFailed(f"{what} failed (exit {done.returncode}): {tail}")


class StepFailed(Exception):
    pass


# ----------------------------------------------------------------------------- workers


def genai_tasks(folder: Path) -> dict:
    """onnxruntime-genai on a folder it loads, the builder's (which has no manifest for runtime.genai_tasks) or
    ours: the same greedy decode as runtime.genai_tasks, EOS masked (min_length) so every run takes DECODE_STEPS
    steps."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
    ids = rt.prompt(rt.PROMPT_FOR_DECODE, vocab)[0].tolist()

    def decode_run():
        length = len(ids) + 1 + rt.DECODE_STEPS
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, num_beams=1, max_length=length, min_length=length)
        return rt.genai_decode_rate(og.Generator(model, params), ids)

    return {"decode": decode_run}


def serve_worker(kind: str, folder: Path) -> None:
    rt.serve(
        {
            "ort": lambda: rt.ort_tasks(folder, "cpu", 0),
            "ort-decode": lambda: {"decode": rt.ort_tasks(folder, "cpu", 0)["decode"]},
            "torch": lambda: rt.torch_tasks(folder, 0, "cpu"),
            "bandwidth": lambda: rt.bandwidth_tasks(0),
            "genai": lambda: genai_tasks(folder),
        }[kind]()
    )


def in_turns(workers: dict[str, tuple[str, Path | None]], rounds: int) -> dict:
    """runtime.run_in_turns, its worker processes started as this script (which serves runtime's tasks and the
    builder's)."""
    args = {name: ["--worker", kind, "--folder", str(folder or ".")] for name, (kind, folder) in workers.items()}
    with mock.patch.object(rt, "__file__", str(Path(__file__).resolve())):
        figures, _ = rt.run_in_turns(args, rounds)
    return figures


# ----------------------------------------------------------------------------- 1. float32, int8, int4


def variant_name(block: int, level: int) -> str:
    return f"int4 block {block} level {level}"


def export_precisions(preset: str, work: Path, accuracy_level: int) -> tuple[dict[str, Path], list[tuple[int, int]]]:
    """float32, int8 and int4 (the export's default blocks) of `preset` at `accuracy_level`, and each int4 variant of
    the trade-off table (trade_off_variants, keyed by variant_name; the first is that int4), the quantized ones from
    the float32 graphs; and those variants."""
    from quality import replayed

    import exporter.export.pipeline as pipeline
    from exporter.artifact.quantization import QuantizationSettings
    from reference.source import seeded_model

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # a line per node otherwise
    seeded = seeded_model(preset)
    folders = {p: work / preset / p for p in PRECISIONS}
    progress(f"{preset}: exporting float32 (torch.onnx)")
    pipeline.export_artifact(seeded.model, folders["float32"], dtype="float32", source=seeded.source)
    with replayed(folders["float32"]):
        for scheme in PRECISIONS[1:]:
            progress(f"{preset}: exporting {scheme} from the float32 graphs")
            pipeline.export_artifact(
                seeded.model,
                folders[scheme],
                dtype=scheme,
                source=seeded.source,
                quantization=QuantizationSettings(accuracy_level=accuracy_level),
            )
        variants = trade_off_variants(seeded.model.config.hidden_size, accuracy_level)
        folders[variant_name(*variants[0])] = folders["int4"]
        for block, level in variants[1:]:
            progress(f"{preset}: exporting int4 block {block} at accuracy level {level} from the float32 graphs")
            folders[variant_name(block, level)] = work / preset / f"int4-block{block}-level{level}"
            pipeline.export_artifact(
                seeded.model,
                folders[variant_name(block, level)],
                dtype="int4",
                source=seeded.source,
                quantization=QuantizationSettings(accuracy_level=level, block_size=block),
            )
    return folders, variants


def trade_off_variants(hidden_size: int, accuracy_level: int) -> list[tuple[int, int]]:
    """(block, accuracy level) of each int4 row of the trade-off table, the precisions' int4 first: each of
    BLOCK_SIZES that divides `hidden_size` at `accuracy_level`, and block 32 at float32 math unless that is it."""
    variants = [(block, accuracy_level) for block in BLOCK_SIZES if hidden_size % block == 0]
    return variants + [(BLOCK_SIZES[0], FLOAT_MATH_LEVEL)] * (accuracy_level != FLOAT_MATH_LEVEL)


MATMUL_OPS = ("MatMul", "FusedMatMul", "Gemm", "MatMulNBits")


def kernel_times(folder: Path, length: int, past: int, calls: int = 10) -> dict:
    """Milliseconds per decode.onnx call spent in its matrix-product kernels and in every other node, from
    onnxruntime's own profile (a session of its own, as our runtime's decode session: prepacked), for `length` new
    tokens after `past` cached ones."""
    import tempfile

    import numpy as np
    import onnxruntime as ort

    from exporter.artifact.manifest import read_manifest

    manifest = read_manifest(folder, check_hashes=False)
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "profile")
    session = ort.InferenceSession(str(folder / manifest.decode.file), options, providers=["CPUExecutionProvider"])
    ids = rt.prompt(length, manifest.config.vocab_size)
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones((1, past + length), np.int64),
        "position_ids": np.arange(past, past + length, dtype=np.int64)[None],
    }
    for value in session.get_inputs():
        if value.name not in feeds:  # a past: (batch, kv heads, past, head dim)
            heads, dim = (d for d in value.shape if isinstance(d, int))
            feeds[value.name] = np.zeros((1, heads, past, dim), np.float32)
    warm_up = 2
    for _ in range(warm_up + calls):
        session.run(None, feeds)
    path = Path(session.end_profiling())
    events = json.loads(path.read_text())
    shutil.rmtree(path.parent, ignore_errors=True)
    counted_from = sorted(e["ts"] for e in events if e["name"] == "model_run")[warm_up]
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    counted = [e for e in kernels if e["ts"] >= counted_from]
    matmul = sum(e["dur"] for e in counted if e["args"]["op_name"] in MATMUL_OPS) / 1000 / calls
    other = sum(e["dur"] for e in counted if e["args"]["op_name"] not in MATMUL_OPS) / 1000 / calls
    return {"matmul_ms": matmul, "other_ms": other}


def kernel_bounds(folders: dict[str, Path], floor_step_ms: float) -> dict:
    """Where a decode step and a 128-token prompt chunk spend their time, float32 against int4: the bounds that the
    matrix-product kernels alone put on the decode and prefill targets."""
    found = {}
    for precision in ("float32", "int4"):
        progress(f"profiling {precision}'s kernels")
        found[precision] = {
            "step": kernel_times(folders[precision], 1, rt.PROMPT_FOR_DECODE),
            "chunk_128": kernel_times(folders[precision], 128, 0, calls=3),
        }
    int4, f32 = found["int4"], found["float32"]
    found["int4_matmul_step_to_floor"] = int4["step"]["matmul_ms"] / floor_step_ms
    found["float32_to_int4_matmul_step"] = f32["step"]["matmul_ms"] / int4["step"]["matmul_ms"]
    found["float32_to_int4_matmul_chunk"] = f32["chunk_128"]["matmul_ms"] / int4["chunk_128"]["matmul_ms"]
    return found


def weight_read_floor(folder: Path, bandwidths: list[float]) -> tuple[int, list[float]]:
    """The bytes of the weights file of the artifact in `folder`, and the tokens/s of a decode step that did nothing
    but read them once, at each measured read bandwidth (GB/s): the weight-read floor."""
    from exporter.artifact.manifest import read_manifest

    weights = (folder / read_manifest(folder, check_hashes=False).weights_file).stat().st_size
    return weights, [gb * 1e9 / weights for gb in bandwidths]


def measure_precisions(folders: dict[str, Path], rounds: int, flags: list[str], accuracy_level: int) -> dict:
    from exporter.artifact.manifest import read_manifest

    workers = {p: ("ort", folders[p]) for p in PRECISIONS}
    workers.update(pytorch=("torch", folders["float32"]), bandwidth=("bandwidth", None))
    progress(f"timing {', '.join(workers)} in turns ({rounds} rounds)")
    figures = in_turns(workers, rounds)
    manifest = read_manifest(folders["int4"], check_hashes=False)
    weights, floor_tps = weight_read_floor(folders["int4"], figures["bandwidth"]["bandwidth"])
    out = {"precisions": {}, "ratios": {}, "quartiles": {}}

    def ratio(name, numerators, denominators):
        out["ratios"][name], out["quartiles"][name] = rt.ratio_summary(numerators, denominators)

    for p in (*PRECISIONS, "pytorch"):
        side = {"bytes": folder_bytes(folders[p]) if p in folders else None}
        for task, values in figures[p].items():
            side[task.replace(" ", "_")] = statistics.median(values)
        out["precisions"][p] = side
    f32 = out["precisions"]["float32"]["bytes"]
    for p in PRECISIONS:
        out["precisions"][p]["bytes_to_float32"] = out["precisions"][p]["bytes"] / f32
    ratio("int4_to_float32_decode", figures["int4"]["decode"], figures["float32"]["decode"])
    ratio("int8_to_float32_decode", figures["int8"]["decode"], figures["float32"]["decode"])
    ratio("int4_step_to_floor", floor_tps, figures["int4"]["decode"])
    if "prefill 512" in figures["int4"]:
        ratio("pytorch_to_int4_prefill_512", figures["pytorch"]["prefill 512"], figures["int4"]["prefill 512"])
    out["floor"] = {
        "int4_weight_bytes": weights,
        "read_gb_per_s": statistics.median(figures["bandwidth"]["bandwidth"]),
        "floor_step_ms": 1000 / statistics.median(floor_tps),
    }
    out["kernels"] = kernel_bounds(folders, out["floor"]["floor_step_ms"])
    out["accuracy_level"] = accuracy_level
    out["lm_head"], out["embedding"] = manifest.quantization.lm_head, manifest.quantization.embedding
    out["vnni_flags"] = flags
    return out


REAL_SIZE_BLOCKS = (32, 64)  # int4 blocks of the real size: the export's default and the next


def real_size_decode(work: Path, rounds: int, accuracy_level: int, quick: bool) -> dict:
    """The Qwen3-0.6B config (export_sizes.py's folder; --quick: the tiny one) exported by us in float32 and in int4
    at each of REAL_SIZE_BLOCKS from the Hugging Face folder, and decoded in turns with the weight-read bandwidth
    probe. "int4" is block 32, the export's default; the floor is its."""
    size = TINY_QWEN3 if quick else SIZES["qwen3-0.6b"]
    folder = random_qwen3_folder(work, quick) if quick else cached_folder(size, work)
    int4 = {"int4" if block == 32 else f"int4 block {block}": block for block in REAL_SIZE_BLOCKS}
    folders = {p: work / size.name / p.replace(" ", "-") for p in ("float32", *int4)}
    progress(f"{size.name}: our float32 export")
    run_step(f"{size.name}: our float32 export", tool_command("ours", folder, folders["float32"], Path(".")) + ["-q"])
    for precision, block in int4.items():
        our_int4_export(f"{size.name}: our {precision} export", folder, folders[precision], block, accuracy_level)
    workers = {p: ("ort-decode", out) for p, out in folders.items()} | {"bandwidth": ("bandwidth", None)}
    progress(f"{size.name}: decode in turns ({rounds} rounds)")
    figures = in_turns(workers, rounds)
    weights, floor_tps = weight_read_floor(folders["int4"], figures["bandwidth"]["bandwidth"])
    out = {"name": size.name, "precisions": {}, "ratios": {}, "quartiles": {}}
    for p, artifact in folders.items():
        out["precisions"][p] = {"bytes": folder_bytes(artifact), "decode": statistics.median(figures[p]["decode"])}
    ratios = [
        (f"{p.replace(' ', '_')}_to_float32_decode", figures[p]["decode"], figures["float32"]["decode"]) for p in int4
    ]
    for name, numerators, denominators in (*ratios, ("int4_step_to_floor", floor_tps, figures["int4"]["decode"])):
        out["ratios"][name], out["quartiles"][name] = rt.ratio_summary(numerators, denominators)
    out["bytes_to_float32"] = out["precisions"]["int4"]["bytes"] / out["precisions"]["float32"]["bytes"]
    out["floor_step_ms"] = 1000 / statistics.median(floor_tps)
    out["int4_weight_bytes"] = weights
    return out


# ----------------------------------------------------------------------------- 2. ours against the builder


def fixture_qwen3_folder(work: Path) -> tuple[Path, float]:
    """The trained fixture as a Qwen3ForCausalLM folder (same parameter names), its logits checked against the
    toolkit's reference; returns the folder and the largest absolute logit difference."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from reference.source import checkpoint_model

    reference = checkpoint_model(FIXTURE).model.eval()
    c = reference.config
    fields = dict(
        model_type="qwen3",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        hidden_act=c.hidden_act,
        max_position_embeddings=max(c.max_position_embeddings, FIXTURE_POSITIONS),
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        rope_scaling=None,
        attention_bias=False,
        tie_word_embeddings=c.tie_word_embeddings,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=c.num_hidden_layers,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
    )
    config = Qwen3Config(**{k: v for k, v in fields.items() if k != "model_type"})
    model = Qwen3ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise StepFailed(f"the fixture's weights do not fit Qwen3ForCausalLM: missing {missing}, extra {unexpected}")
    model.tie_weights()
    ids = torch.from_numpy(rt.prompt(64, c.vocab_size))
    with torch.inference_mode():
        diff = float((model(ids).logits - reference(ids).logits).abs().max())
        scale = float(reference(ids).logits.abs().max())
    if diff > 1e-4 * max(1.0, scale):
        raise StepFailed(f"the Qwen3 model of the fixture differs from the reference by {diff:.3g} (logits)")
    folder = work / "folders" / "fixture-qwen3"
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, safe_serialization=True)
    # transformers 4's config layout (rope_theta at the top), as export_sizes.build_folder writes it
    published = {"architectures": ["Qwen3ForCausalLM"], **fields, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(published, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, folder / name)
    return folder, diff


def random_qwen3_folder(work: Path, quick: bool) -> Path:
    if not quick:
        return cached_folder(SIZES["minimind-3-qwen3"], work)
    folder = work / "folders" / TINY_QWEN3.name
    if not folder.is_dir():
        build_folder(TINY_QWEN3, folder)
    return folder


def quality_of(report: Path) -> dict:
    """The quality figures of a verify report's JSON (its metrics, as benchmarks/foreign.py's `rows` reads the
    checks), the quality profile's verdict, and the overall verdict with the names of the checks that failed."""
    document = json.loads(report.read_text())
    if "error" in document:
        return {"verdict": f"error: {document['error']['message']}"}
    failed = [i["name"] for i in document.get("invariants", []) if i.get("passed") is False]
    for provider in document.get("providers", [])[:1]:
        failed += [c["name"] for c in provider.get("comparisons", []) if c.get("passed") is False]
    found = {"verdict": "PASS" if document.get("passed") else "FAIL: " + "; ".join(failed or ["see the report"])}
    for quality in document.get("quality", [])[:1]:
        found.update(quality["metrics"])
        found["quality_verdict"] = "pass" if quality["passed"] else "FAIL"
    if found.get("perplexity_ratio") is None and found.get("nll_delta") is not None:
        found["perplexity_ratio"] = math.exp(found["nll_delta"])  # exp(ΔNLL)
    return found


def matmulnbits_levels(folder: Path) -> list[int]:
    """The accuracy_level attributes of the MatMulNBits nodes of a folder's graphs."""
    import onnx

    levels = set()
    for graph in folder.glob("*.onnx"):
        for node in onnx.load(str(graph), load_external_data=False).graph.node:
            if node.op_type == "MatMulNBits":
                levels.update(a.i for a in node.attribute if a.name == "accuracy_level")
    return sorted(levels)


def left_padded_rows(ours: Path, builder: Path, folder: Path) -> dict[str, float]:
    """For our int4 artifact and the builder's of `folder`: the largest |Δ logits| between row 0 of verify's prompt
    batch, left-padded, and its real tokens alone (the padded-row invariant, which verify does not run on the
    builder's graph, docs/foreign.md), MatMulNBits in float32 math in both runs (float_matmul_settings), so that
    only how each graph treats the padding differs."""
    import numpy as np

    from exporter.artifact.foreign import foreign_manifest, read_foreign, reference_config
    from exporter.artifact.manifest import read_manifest
    from exporter.runtime.foreign import ForeignRunner
    from exporter.runtime.runner import OrtRunner
    from exporter.runtime.settings import SessionSettings
    from exporter.tolerances.parity import profile_for
    from exporter.verify.checks.invariants import float_matmul_settings, padded_row_alone
    from exporter.verify.inputs import ParitySettings, prompt_batch

    graph = read_foreign(builder)
    manifests = {"ours": read_manifest(ours), "builder": foreign_manifest(graph, reference_config(folder), folder)}
    settings = {side: float_matmul_settings(m) or SessionSettings() for side, m in manifests.items()}
    runners = {
        "ours": OrtRunner(ours, settings=settings["ours"]),
        "builder": ForeignRunner(graph, manifests["builder"], settings=settings["builder"]),
    }
    found = {}
    for side, runner in runners.items():
        batch = prompt_batch(manifests[side], ParitySettings(), np.random.default_rng(0))
        invariant = padded_row_alone(runner, manifests[side], batch, profile_for("float32"))
        found[side] = next(c.max_abs for c in invariant.comparisons if c.kind == "logits")
    return found


def our_int4_export(what: str, folder: Path, out: Path, block: int, accuracy_level: int) -> None:
    """`export-onnx export --checkpoint folder --dtype int4` into `out` at `block` and `accuracy_level`."""
    progress(what)
    flags = ["--block-size", str(block), "--accuracy-level", str(accuracy_level), "-q"]
    run_step(what, tool_command("ours", folder, out, Path("."), "int4") + flags)


def verified(what: str, artifact: Path, report: Path, quick: bool, extra: tuple[str, ...] = ()) -> dict:
    """quality_of `export-onnx verify`'s JSON report (at `report`) on `artifact`, CPU, no sweep, no
    onnxruntime-genai (4 decode steps with --quick), with the folder's bytes."""
    progress(f"{what}: verifying")
    command = [sys.executable, "-m", "exporter.cli", "verify", str(artifact), "--report-json", str(report)]
    command += ["--no-sweep", "--no-genai", "--provider", "cpu", "-q", *(["--decode-steps", "4"] * quick), *extra]
    subprocess.run(command, env=our_env(), capture_output=True)
    if not report.is_file():
        raise StepFailed(f"{what}: verify wrote no report")
    return quality_of(report) | {"bytes": folder_bytes(artifact)}


def against_builder(name: str, folder: Path, work: Path, rounds: int, accuracy_level: int, quick: bool) -> dict:
    out_dir = work / "vs-builder" / name
    ours, builder = out_dir / "ours-int4", out_dir / "builder-int4"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    our_int4_export(f"{name}: our int4 export", folder, ours, BLOCK_SIZES[0], accuracy_level)
    progress(f"{name}: the builder's int4 export")
    run_step(f"{name}: the builder's int4 export", export_command("builder int4", folder, builder, Path(".")))
    result = {}
    for side, artifact, extra in (("ours", ours, ()), ("builder", builder, ("--reference", str(folder)))):
        result[side] = verified(f"{name}: {side}", artifact, out_dir / f"{side}.json", quick, extra)
        result[side]["accuracy_levels"] = matmulnbits_levels(artifact)
    result["left_padded_row"] = left_padded_rows(ours, builder, folder)
    progress(f"{name}: decode in turns ({rounds} rounds)")
    # ours twice: in our runtime, and in onnxruntime-genai's loop, the builder's engine: the artifacts alone compared
    workers = {"ours": ("ort-decode", ours), "ours-genai": ("genai", ours), "builder": ("genai", builder)}
    figures = in_turns(workers, rounds)
    for side in ("ours", "builder"):
        result[side]["decode_tokens_per_s"] = statistics.median(figures[side]["decode"])
    result["ours"]["genai_decode_tokens_per_s"] = statistics.median(figures["ours-genai"]["decode"])
    for side, key in (("ours", "ours_to_builder_decode"), ("ours-genai", "ours_genai_to_builder_decode")):
        result[key], result[f"{key}_quartiles"] = rt.ratio_summary(
            figures[side]["decode"], figures["builder"]["decode"]
        )
    return result


def block_trade_off(
    folders: dict[str, Path], variants: list[tuple[int, int]], fixture: Path, work: Path, rounds: int, quick: bool
) -> dict:
    """int4 at each of `variants` (export_precisions): decode speed on the minimind precisions' model (against its
    float32, in turns) and quality on the trained fixture (its Qwen3 folder exported and verified as in
    against_builder)."""
    artifacts = {v: folders[variant_name(*v)] for v in variants}
    workers = {"float32": ("ort-decode", folders["float32"])}
    workers.update({variant_name(*v): ("ort-decode", folder) for v, folder in artifacts.items()})
    progress(f"int4 block sizes and accuracy levels: decode in turns ({rounds} rounds)")
    figures = in_turns(workers, rounds)
    rows = []
    for (block, level), folder in artifacts.items():
        name = variant_name(block, level)
        ratio, quartiles = rt.ratio_summary(figures[name]["decode"], figures["float32"]["decode"])
        artifact = work / "blocks" / f"fixture-int4-block{block}-level{level}"
        shutil.rmtree(artifact, ignore_errors=True)
        our_int4_export(f"fixture: {name} export", fixture, artifact, block, level)
        quality = verified(f"fixture: {name}", artifact, artifact.with_suffix(".json"), quick)
        rows.append(
            {
                "block": block,
                "accuracy_level": level,
                "bytes": folder_bytes(folder),
                "decode": statistics.median(figures[name]["decode"]),
                "to_float32_decode": ratio,
                "to_float32_decode_quartiles": quartiles,
                "fixture": quality,
            }
        )
    return {"float32_decode": statistics.median(figures["float32"]["decode"]), "rows": rows}


# ----------------------------------------------------------------------------- targets and output


def targets(report: dict) -> list[tuple[str, str, str]]:
    """(target, measured, MET / MISSED / n/a and why)."""
    p, ratios = report["precisions"], report["precisions"]["ratios"]

    def verdict(ok: bool) -> str:
        return "MET" if ok else "MISSED"

    size = p["precisions"]["int4"]["bytes_to_float32"]
    rows = [
        (f"int4 bytes ≤ {TARGETS['int4_size']}× float32", f"{size:.3f}×", verdict(size <= TARGETS["int4_size"])),
        (
            f"int4 decode ≥ {TARGETS['int4_decode']}× float32",
            f"{ratios['int4_to_float32_decode']:.2f}× (matrix products alone: "
            f"{p['kernels']['float32_to_int4_matmul_step']:.2f}×)",
            verdict(ratios["int4_to_float32_decode"] >= TARGETS["int4_decode"]),
        ),
        (
            f"int4 decode step ≤ {TARGETS['int4_floor']}× weight-read floor",
            f"{ratios['int4_step_to_floor']:.2f}×",
            verdict(ratios["int4_step_to_floor"] <= TARGETS["int4_floor"]),
        ),
    ]
    label = f"int4 prefill 512 ≥ {TARGETS['int4_prefill']}× faster than PyTorch float32"
    speedup = ratios.get("pytorch_to_int4_prefill_512")
    if speedup is None:
        rows.append((label, "—", "n/a: the model has fewer than 513 positions"))
    elif not p["vnni_flags"]:
        rows.append(
            (
                label,
                f"{speedup:.2f}×",
                "n/a: no avx512_vnni / avx_vnni / amx on this CPU (MatMulNBits accuracy level 4 computes in int8)",
            )
        )
    elif p["accuracy_level"] != 4:
        rows.append((label, f"{speedup:.2f}×", f"n/a: accuracy level {p['accuracy_level']} computes in float32"))
    else:
        rows.append((label, f"{speedup:.2f}×", verdict(speedup >= TARGETS["int4_prefill"])))
    real = report["real_size"]
    rows += [
        (
            f"{real['name']}: int4 bytes ≤ {TARGETS['int4_size']}× float32",
            f"{real['bytes_to_float32']:.3f}×",
            verdict(real["bytes_to_float32"] <= TARGETS["int4_size"]),
        ),
        (
            f"{real['name']}: int4 decode ≥ {TARGETS['int4_decode']}× float32",
            f"{real['ratios']['int4_to_float32_decode']:.2f}×",
            verdict(real["ratios"]["int4_to_float32_decode"] >= TARGETS["int4_decode"]),
        ),
        (
            f"{real['name']}: int4 decode step ≤ {TARGETS['int4_floor']}× weight-read floor",
            f"{real['ratios']['int4_step_to_floor']:.2f}×",
            verdict(real["ratios"]["int4_step_to_floor"] <= TARGETS["int4_floor"]),
        ),
    ]
    for name, result in report["builder"].items():
        if "error" in result:
            rows.append((f"{name}: ours ≥ builder", "—", f"MISSED: {result['error']}"))
            continue
        ours, theirs = result["ours"], result["builder"]
        try:
            ok = ours["kl_mean"] <= theirs["kl_mean"] and ours["top1_agreement"] >= theirs["top1_agreement"]
            shown = (
                f"mean KL {ours['kl_mean']:.3g} vs {theirs['kl_mean']:.3g}, "
                f"top-1 {ours['top1_agreement']:.3f} vs {theirs['top1_agreement']:.3f}"
            )
            rows.append((f"{name}: ours ≥ builder in quality", shown, verdict(ok)))
        except (KeyError, TypeError):
            rows.append((f"{name}: ours ≥ builder in quality", "—", "MISSED: a quality figure is missing"))
        speed, ours_loop = result["ours_genai_to_builder_decode"], result["ours_to_builder_decode"]
        shown = f"{speed:.2f}× in onnxruntime-genai ({ours_loop:.2f}× in our runtime)"
        rows.append((f"{name}: ours ≥ builder in decode speed, one engine", shown, verdict(speed >= 1.0)))
    return rows


def _f(value, digits: int = 1) -> str:
    if value is None:
        return "—"
    return f"{value:.{-digits}g}" if digits < 0 else f"{value:.{digits}f}"  # digits < 0: significant ones


def ratio_table(measured: dict) -> list[str]:
    """The ratios of `measured` ("ratios", "quartiles") as a table."""
    lines = ["| ratio | median | q1–q3 |", "|---|---|---|"]
    for name, value in measured["ratios"].items():
        q = measured["quartiles"][name]
        lines.append(f"| {name} | {value:.2f} | {q[0]:.2f}–{q[1]:.2f} |")
    return lines


def kernel_table(kernels: dict) -> list[str]:
    lines = [
        "### Where the time goes (onnxruntime's profile of decode.onnx, prepacked)",
        "",
        "| precision | call | matrix products (ms) | every other node (ms) |",
        "|---|---|---|---|",
    ]
    for precision in ("float32", "int4"):
        for call, label in (("step", "decode step"), ("chunk_128", "128-token prompt chunk")):
            k = kernels[precision][call]
            lines.append(f"| {precision} | {label} | {k['matmul_ms']:.3f} | {k['other_ms']:.3f} |")
    lines += [
        "",
        f"- int4's MatMulNBits kernels alone take {kernels['int4_matmul_step_to_floor']:.2f}× the int4 weight-read "
        "floor per decode step: no graph change brings the step closer to the floor than that.",
        f"- In a decode step, float32's matrix products take {kernels['float32_to_int4_matmul_step']:.2f}× the time "
        "of int4's: int4's decode reaches that multiple of float32's tokens/s only if every other node (the same "
        "graph in both) took no time.",
        f"- On a 128-token chunk, float32's matrix products take {kernels['float32_to_int4_matmul_chunk']:.2f}× the "
        "time of int4's: the most int4's prefill can gain over our float32 prefill from its kernels.",
    ]
    return lines


def block_table(trade: dict, preset: str) -> list[str]:
    lines = [
        "## int4 block size and accuracy level: decode speed against quality",
        "",
        f"Decode: `{preset}` (seeded weights) in turns with its float32 "
        f"({_f(trade['float32_decode'])} tokens/s in this run). Quality: the trained fixture's Qwen3 folder exported "
        "as each row and verified as in the builder comparison below. A block holds one scale and one zero point: "
        "larger blocks store and unpack fewer of them per weight, and round each weight to a coarser grid. Accuracy "
        "level 4 multiplies in int8 on the CPU, level 0 in float32.",
        "",
        "| block | accuracy level | bytes | × float32 decode (q1–q3) | decode tokens/s | fixture bytes "
        "| fixture mean KL | p99 KL | top-1 | perplexity ratio | quality profile |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in trade["rows"]:
        q, fx = row["to_float32_decode_quartiles"], row["fixture"]
        lines.append(
            f"| {row['block']} | {row['accuracy_level']} | {row['bytes']} | {row['to_float32_decode']:.2f}× "
            f"({q[0]:.2f}–{q[1]:.2f}) | {_f(row['decode'])} | {fx['bytes']} | {_f(fx.get('kl_mean'), -3)} | "
            f"{_f(fx.get('kl_p99'), -3)} | {_f(fx.get('top1_agreement'), 3)} | "
            f"{_f(fx.get('perplexity_ratio'), 4)} | {fx.get('quality_verdict', fx['verdict'])} |"
        )
    return lines


def real_size_table(real: dict, accuracy_level: int) -> list[str]:
    lines = [
        f"## {real['name']}: float32 and int4 decode",
        "",
        f"Exported by us from the folder (`--checkpoint`); int4 at block 32 (the export's default) and 64, accuracy "
        f"level {accuracy_level}, the lm_head and embedding at the export's defaults.",
        "",
        "| | bytes | decode tokens/s |",
        "|---|---|---|",
    ]
    for name, side in real["precisions"].items():
        lines.append(f"| ours {name} | {side['bytes']} | {_f(side['decode'])} |")
    lines += ["", *ratio_table(real)]
    lines += [
        "",
        f"int4 weight-read floor: {real['int4_weight_bytes'] / 1e6:.1f} MB weights per step = "
        f"{real['floor_step_ms']:.3f} ms per step.",
    ]
    return lines


def tables(report: dict) -> list[str]:
    p = report["precisions"]
    lines = [
        "## minimind precisions",
        "",
        f"Model `{report['preset']}`, seeded weights; int8/int4 block 32, accuracy level {p['accuracy_level']}, "
        f"lm_head {p['lm_head']}, embedding {p['embedding']}.",
        "",
        "| | bytes | × float32 | prefill 128 (ms) | prefill 512 (ms) | decode tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for name in (*PRECISIONS, "pytorch"):
        side = p["precisions"][name]
        label = "PyTorch float32" if name == "pytorch" else f"ours {name}"
        lines.append(
            f"| {label} | {side['bytes'] or '—'} | {_f(side.get('bytes_to_float32'), 3)} | "
            f"{_f(side.get('prefill_128'))} | {_f(side.get('prefill_512'))} | {_f(side.get('decode'))} |"
        )
    floor = p["floor"]
    lines += ["", *ratio_table(p)]
    lines += [
        "",
        f"int4 weight-read floor: {floor['int4_weight_bytes'] / 1e6:.1f} MB weights / "
        f"{floor['read_gb_per_s']:.1f} GB/s = {floor['floor_step_ms']:.3f} ms per step.",
        "",
        *kernel_table(p["kernels"]),
        "",
        *block_table(report["blocks"], report["preset"]),
        "",
        *real_size_table(report["real_size"], p["accuracy_level"]),
        "",
        "## Ours against onnxruntime-genai's builder (int4)",
        "",
        "| folder | export | bytes | MatMulNBits accuracy level | mean KL | p99 KL | top-1 | perplexity ratio "
        "| quality profile | verify verdict | decode tokens/s (our runtime) | decode tokens/s (onnxruntime-genai) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in report["builder"].items():
        if "error" in result:
            lines.append(f"| {name} | — | — | — | — | — | — | — | — | {result['error']} | — | — |")
            continue
        for side in ("ours", "builder"):
            r = result[side]
            lines.append(
                f"| {name} | {side} | {r['bytes']} | {', '.join(map(str, r['accuracy_levels'])) or '—'} | "
                f"{_f(r.get('kl_mean'), -3)} | {_f(r.get('kl_p99'), -3)} | {_f(r.get('top1_agreement'), 3)} | "
                f"{_f(r.get('perplexity_ratio'), 4)} | {r.get('quality_verdict', '—')} | {r['verdict']} | "
                + (f"— | {_f(r['decode_tokens_per_s'])} |" if side == "builder" else "")
                + (f"{_f(r['decode_tokens_per_s'])} | {_f(r['genai_decode_tokens_per_s'])} |" if side == "ours" else "")
            )
        q, g = result["ours_to_builder_decode_quartiles"], result["ours_genai_to_builder_decode_quartiles"]
        lines.append(
            f"| {name} | ours / builder decode | | | | | | | | | {result['ours_to_builder_decode']:.2f}× "
            f"({q[0]:.2f}–{q[1]:.2f}) | {result['ours_genai_to_builder_decode']:.2f}× ({g[0]:.2f}–{g[1]:.2f}) |"
        )
    padded = [(name, r["left_padded_row"]) for name, r in report["builder"].items() if "left_padded_row" in r]
    if padded:
        lines += [
            "",
            "A left-padded row against its real tokens alone (largest |Δ logits|, MatMulNBits in float32 math in both "
            "runs): the builder's GroupQueryAttention reads each row's length from the mask and takes its tokens to "
            "start at the first slot (right padding), which verify therefore does not check on its graph.",
            "",
        ]
        lines += [f"- {name}: ours {r['ours']:.3g}, builder {r['builder']:.3g}" for name, r in padded]
    lines += ["", "## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in targets(report)]
    if report.get("notes"):
        lines += ["", *[f"- {note}" for note in report["notes"]]]
    return lines


def format_results(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# Quantized exports benchmark results",
        "",
        "Generated by `benchmarks/quantized.py`; do not edit.",
        "",
        "| | |",
        "|---|---|",
        f"| date | {env['date']} |",
        f"| CPU | {env['cpu']} |",
        f"| CPU flags (VNNI/AMX) | {', '.join(report['precisions']['vnni_flags']) or 'none'} |",
        f"| cores | {env['cpus']} logical, {env['usable_cpus']} usable |",
        *(f"| {name} | {version or 'not installed'} |" for name, version in env["versions"].items()),
        f"| command | `{env['command']}` |",
        f"| rounds | {report['rounds']} (in turns; figures: medians of the rounds; ratios: medians of the "
        "per-round ratios, q1–q3 their quartiles) |",
        "",
        *tables(report),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    try:
        run()
    except KeyboardInterrupt:
        print("interrupted (SIGINT)", file=sys.stderr)
        sys.exit(130)


def run() -> None:
    parser = rt._Parser(description=__doc__.splitlines()[0], epilog=__doc__.splitlines()[-1])
    parser.add_argument("--rounds", type=rt._at_least(1), default=3, help="rounds in turns (default 3)")
    parser.add_argument(
        "--accuracy-level",
        type=rt._at_least(0, 4),
        default=4,
        help="MatMulNBits accuracy_level of our int8/int4 exports (default 4: int8 math on the CPU, as the builder's)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny models, 1 round")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"work folder (default {DEFAULT_WORK})")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    results = parser.add_mutually_exclusive_group()
    results.add_argument("--results", type=Path, default=DEFAULT_RESULTS, metavar="PATH")
    results.add_argument("--no-results", action="store_true", help="write no results file")
    parser.add_argument(
        "--worker", choices=["ort", "ort-decode", "torch", "bandwidth", "genai"], help=argparse.SUPPRESS
    )
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve_worker(args.worker, args.folder)
        return
    import importlib.util

    from exporter.errors import ToolkitError

    results_path = None if args.no_results else args.results
    rounds = 1 if args.quick else args.rounds
    try:
        if results_path is not None:
            rt.check_results_path(results_path)
        if not importlib.util.find_spec("onnxruntime_genai"):
            raise StepFailed("onnxruntime-genai is not installed: the builder comparison needs it")
        preset = "minimind-3-tiny" if args.quick else "minimind-3"
        args.work.mkdir(parents=True, exist_ok=True)
        flags = cpu_flags()
        folders, variants = export_precisions(preset, args.work, args.accuracy_level)
        report = {"preset": preset, "rounds": rounds, "quick": args.quick, "notes": []}
        report["precisions"] = measure_precisions(folders, rounds, flags, args.accuracy_level)
        report["real_size"] = real_size_decode(args.work, rounds, args.accuracy_level, args.quick)
        fixture, diff = fixture_qwen3_folder(args.work)
        report["notes"].append(
            f"fixture as Qwen3ForCausalLM: largest logit difference from the toolkit's reference {diff:.3g}; "
            f"its max_position_embeddings raised to {FIXTURE_POSITIONS} for the decode run (rope unchanged)"
        )
        random_name = TINY_QWEN3.name if args.quick else "minimind-3-qwen3"
        report["blocks"] = block_trade_off(folders, variants, fixture, args.work, rounds, args.quick)
        report["builder"] = {}
        for name, folder in (("fixture (trained)", fixture), (f"{random_name} (random)", None)):
            folder = folder or random_qwen3_folder(args.work, args.quick)
            try:
                report["builder"][name] = against_builder(
                    name.split()[0], folder, args.work, rounds, args.accuracy_level, args.quick
                )
            except StepFailed as exc:
                progress(f"error: {exc}")
                report["builder"][name] = {"error": str(exc)}
    except ToolkitError as exc:
        rt.fail("input", str(exc), 2, args.json)
    except (StepFailed, rt.WorkerFailed) as exc:
        rt.fail("worker", str(exc), 1, args.json)
    report["environment"] = rt.environment(sys.argv)
    text = format_results(report)
    if results_path is not None:
        results_path.write_text(text)
        report["results_file"] = rt.shown_path(results_path)
    print(json.dumps(report, indent=1, default=str) if args.json else "\n".join(tables(report)))


if __name__ == "__main__":
    main()
