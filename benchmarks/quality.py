"""The quality figures of int8 and int4 exports, on the trained fixture and on random weights of the same size:
the measurements the quality profiles (exporter/tolerances/quality.py, QUALITY_PROFILES) are checked against.

    python benchmarks/quality.py [--batch 8] [--decode-steps 64] [--json]

Each model is exported once in float32 (torch.onnx), then quantized from those graphs (block 32, accuracy level
4: the export's defaults), and judged by exporter.verify.checks.quality against its float32 PyTorch model on two
inputs: the seeded random ids that `export-onnx verify` uses, and the fixture's held-out text (heldout.txt, never
trained on). Writes benchmarks/QUALITY-RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import onnx_ir
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import exporter.export.pipeline as pipeline  # noqa: E402
import exporter.export.tracing as tracing  # noqa: E402
from exporter.artifact.folder import Artifact  # noqa: E402
from exporter.artifact.quantization import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZES  # noqa: E402
from exporter.runtime.runner import OrtRunner  # noqa: E402
from exporter.tolerances.quality import quality_profile_for
from exporter.verify.checks.quality import check_quality  # noqa: E402
from exporter.verify.inputs import ParitySettings, QualityText, prompt_batch  # noqa: E402
from exporter.verify.references.torch_runner import TorchRunner  # noqa: E402
from reference import build_model  # noqa: E402
from reference.source import checkpoint_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "minimind-3-stdlib"
RESULTS = Path(__file__).with_name("QUALITY-RESULTS.md")
SCHEMES = ("int8", "int4")
SHOWN = (
    ("kl_mean", "mean KL"),
    ("kl_p99", "p99 KL"),
    ("kl_max", "max KL"),
    ("top1_agreement", "top-1"),
    ("top1_agreement_decisive", "top-1 decisive"),
    ("decisive_share", "decisive positions"),
    ("top5_overlap_decisive", "top-5 decisive"),
    ("top_logprob_delta_mean", "mean abs Δ log p top"),
    ("nll_delta", "ΔNLL"),
    ("greedy_agreement", "greedy"),
)


def float_graphs(float_folder: Path):
    """A stand-in for export_artifact's torch.onnx step (tracing.traced_graphs) that gives a float artifact's own
    graphs, loaded with their weights: what the dynamo export of the same model in its dtype gives, without its
    trace."""
    graphs = [onnx.load(str(float_folder / name)) for name in ("prefill.onnx", "decode.onnx")]

    def replay(model, template, dtype, with_loss, store, contracts):  # each graph as store makes it from torch.onnx's
        copies = [onnx.ModelProto() for _ in graphs]
        for copy, graph in zip(copies, graphs):
            copy.CopyFrom(graph)
        return tuple(store(onnx_ir.serde.deserialize_model(copy)) for copy in copies)

    return replay


@contextmanager
def replayed(float_folder: Path):
    """export_artifact's torch.onnx step replaced by the float32 artifact's graphs (what it would export again)."""
    with mock.patch.object(tracing, "traced_graphs", float_graphs(float_folder)):
        yield


def exports(model, source: dict, root: Path) -> dict[str, Path]:
    folders = {"float32": root / "float32"}
    pipeline.export_artifact(model, folders["float32"], dtype="float32", source=source)
    with replayed(folders["float32"]):
        for scheme in SCHEMES:
            folders[scheme] = root / scheme
            pipeline.export_artifact(model, folders[scheme], dtype=scheme, source=source)
    return folders


def measure(model, folder: Path, scheme: str, settings: ParitySettings, text: QualityText | None) -> dict:
    artifact = Artifact.open(folder)
    rng = np.random.default_rng(settings.seed)
    batch = prompt_batch(artifact.manifest, settings, rng)
    report = check_quality(
        TorchRunner(model, artifact.manifest),
        OrtRunner(artifact),
        artifact.manifest,
        batch,
        settings,
        quality_profile_for(scheme),
        np.random.default_rng(settings.seed + 1),
        text=text,
    )
    metrics = dict(report.metrics)
    metrics["decisive_share"] = metrics["decisive_positions"] / metrics["positions"]
    metrics["passed"] = report.passed
    metrics["failed"] = [c.threshold.metric for c in report.failures]
    return metrics


def table(results: dict) -> str:
    lines = [
        "| model | input | scheme | " + " | ".join(label for _, label in SHOWN) + " | profile |",
        "|---" * (len(SHOWN) + 4) + "|",
    ]
    for (model, text, scheme), metrics in results.items():
        cells = ["-" if metrics.get(key) is None else f"{metrics[key]:.3g}" for key, _ in SHOWN]
        verdict = "pass" if metrics["passed"] else "FAIL: " + ", ".join(metrics["failed"])
        lines.append(f"| {model} | {text} | {scheme} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="rows of the prefill batch")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON as well")
    args = parser.parse_args()
    settings = ParitySettings(batch=args.batch, decode_steps=args.decode_steps, sweep=False)
    trained = checkpoint_model(FIXTURE)
    config = trained.model.config
    models = {
        "trained": (trained.model, trained.source),
        "random": (build_model(config, seed=0), {"kind": "in-memory"}),
    }
    tokenizer = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    heldout = FIXTURE / "heldout.txt"
    heldout_text = QualityText(str(heldout), np.asarray(tokenizer.encode(heldout.read_text()).ids))
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name, (model, source) in models.items():
            folders = exports(model, source, Path(work) / name)
            for scheme in SCHEMES:
                for text, read in (("random ids", None), ("held-out text", heldout_text)):
                    results[(name, text, scheme)] = measure(model, folders[scheme], scheme, settings, read)
                    print(f"{name} {text} {scheme}: {results[(name, text, scheme)]}", file=sys.stderr)
    body = table(results)
    RESULTS.write_text(
        "# Quality of int8 and int4 exports: trained fixture vs random weights\n\n"
        f"Written by `python benchmarks/quality.py` (batch {args.batch}, {args.decode_steps} decode steps; "
        f"the model {config.hidden_size} hidden, {config.num_hidden_layers} layers, vocabulary "
        f"{config.vocab_size}; blocks of {DEFAULT_BLOCK_SIZES['int8']} (int8) and {DEFAULT_BLOCK_SIZES['int4']} "
        f"(int4), MatMulNBits accuracy level {DEFAULT_ACCURACY_LEVEL}: "
        "int8 math on the CPU). `decisive positions`: the share whose reference top token leads by >= 0.5 nats, "
        "where top-1 and top-5 are judged.\n\n" + body + "\n"
    )
    print(body)
    if args.json:
        print(json.dumps({" / ".join(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
