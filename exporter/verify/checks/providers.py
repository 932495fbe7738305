"""Execution providers against each other: pairwise agreement, a repeat run, and the attribution chain.

Attribution splits the error between PyTorch fp32 and ONNX Runtime CUDA fp16
into three causes: export (ORT CPU fp32 vs PyTorch fp32, one leg per graph: the
prefill batch's logits and the decode check's over every step), provider (ORT
CUDA fp32 vs ORT CPU fp32) and precision (ORT CUDA fp16 vs ORT CUDA fp32, the
float16 export of the same weights), the last two on the prefill batch. Each leg
names the graph and inputs it covers, so that a passing prefill leg cannot read
as a verdict on decode.onnx. The CUDA legs run where CUDA is available and the
float32 artifact is verified with a float16 companion.

The providers against each other and the repeat run compare the prefill batch
alone, and their rows say so.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import numpy as np

from exporter.artifact.folder import Artifact, open_artifact
from exporter.artifact.manifest import Manifest, config_differences
from exporter.errors import ArtifactError, InputError
from exporter.runtime.runner import OrtRunner
from exporter.tolerances.parity import CPU, CUDA, Overrides, profile_for
from exporter.verify.inputs import PREFILL_BATCH, prefill_feeds
from exporter.verify.metrics import Comparison, aggregate, compare, compare_outputs
from exporter.verify.results import Attribution, AttributionLeg, ProviderReport

log = logging.getLogger(__name__)


def _looser(dtype: str, a: str, b: str, overrides: Overrides):
    profiles = [overrides.apply(profile_for(dtype, p)) for p in (a, b)]
    return max(profiles, key=lambda p: p.logits.peak + p.logits.atol)


def _pair(b: str, a: str) -> str:
    return f"{b} vs {a} prefill"


def repeat_run(onnx: OrtRunner, manifest: Manifest, batch: dict, first: dict, profile) -> Comparison:
    """The prefill batch once more on the same session; any difference is nondeterminism.

    Args:
        onnx: the OrtRunner that ran the batch first.
        manifest: the artifact's manifest.
        batch: the prompt batch (prompt_batch).
        first: ONNX Runtime's outputs of the first run.
        profile: the tolerances that judge the difference.
    """
    again = onnx.prefill(prefill_feeds(manifest, batch))
    return aggregate(
        f"{onnx.provider} repeat run of {PREFILL_BATCH}",
        compare_outputs("repeat", again, first, profile, batch["attention_mask"]),
    )


def cross_providers(outputs: dict[str, dict], dtype: str, overrides: Overrides, mask: np.ndarray) -> list[Comparison]:
    """Every pair of providers on the prefill batch, with the looser of their two profiles.

    Args:
        outputs: each provider's prefill outputs, in the order the providers were given.
        dtype: the artifact's dtype, which picks the profiles.
        overrides: tolerance terms in place of the profiles'.
        mask: the prefill batch's attention mask: only real positions are judged.
    """
    rows = []
    for a, b in itertools.combinations(outputs, 2):
        rows += compare_outputs(_pair(b, a), outputs[b], outputs[a], _looser(dtype, a, b, overrides), mask)
    return rows


def read_companion(companion: Path | Artifact) -> Artifact:
    """A float16 companion artifact (the precision leg of the attribution), opened unless it is already."""
    try:
        companion = open_artifact(companion)
    except ArtifactError as exc:
        raise InputError(f"`fp16_companion`: {exc}") from None
    folder, dtype = companion.folder, companion.manifest.dtype
    if dtype != "float16":
        raise InputError(
            f"`fp16_companion` {folder} is not a float16 export ({dtype}); "
            'export the same model as float16 (`dtype="float16"`)'
        )
    return companion


def check_companion(companion: Path | Artifact, manifest: Manifest) -> Artifact:
    """A float16 export of the artifact's model, checked before the verification runs."""
    return companion_for(companion, manifest.dtype, manifest.config, manifest.source)


def companion_for(companion: Path | Artifact, dtype: str, config=None, source: dict | None = None) -> Artifact:
    """A float16 export of the model of the artifact it accompanies; `export-onnx run` checks so before its
    export, the engine after it.

    Args:
        companion: the float16 companion, an Artifact or its folder's path.
        dtype: the verified artifact's dtype, which must be float32.
        config: the verified artifact's model config, which the companion's must equal; None: not known yet,
            not compared.
        source: the verified artifact's weights source (manifest "source"), which the companion's must match
            where both identify their weights; None: not known yet, not compared.

    Raises:
        InputError: the companion is no float16 export of the same model and weights, or the artifact is
            not float32.
    """
    if dtype != "float32":
        raise InputError(f"`fp16_companion` needs a float32 artifact to verify; this one is {dtype}")
    artifact = read_companion(companion)
    folder, companion = artifact.folder, artifact.manifest
    changed = [] if config is None else config_differences(config.to_dict(), companion.config.to_dict())
    if changed:
        raise InputError(
            f"`fp16_companion` {folder} is not a float16 export of the same model "
            f"(its config differs in {', '.join(changed)}); export this model as float16 "
            '(`dtype="float16"`)'
        )
    ours, theirs = _weights_of(source or {}), _weights_of(companion.source)
    if ours is not None and theirs is not None and ours != theirs:
        # the precision leg would charge the difference of the weights to float16
        raise InputError(
            f"`fp16_companion` {folder} holds other weights "
            f"({', '.join(map(str, theirs))} against {', '.join(map(str, ours))}); export this model's "
            'weights as float16 (`dtype="float16"`)'
        )
    return artifact


def _weights_of(source: dict) -> tuple | None:
    """What identifies an export's weights in its manifest's source; None when it cannot tell (in-memory)."""
    if source.get("kind") == "seeded":
        return "seeded", source.get("preset"), f"seed {source.get('seed')}"
    if source.get("kind") == "checkpoint":
        return "checkpoint", f"sha256 {source.get('sha256')}"
    return None


def attribute(
    reports: list[ProviderReport],
    outputs: dict[str, dict],
    cross: list[Comparison],
    manifest: Manifest,
    batch: dict,
    companion: Artifact | None,
    overrides: Overrides,
) -> Attribution:
    """The attribution chain of a float32 artifact's error (see the module docstring), as far as the
    providers and the companion allow; what is missing is said in `skipped`.

    Args:
        reports: each provider's report (the CPU's comparisons and decode curve make the export legs).
        outputs: each provider's prefill outputs.
        cross: cross_providers' rows, whose CUDA-vs-CPU logits row is the provider leg.
        manifest: the verified artifact's manifest.
        batch: the prompt batch (prompt_batch).
        companion: the float16 companion artifact for the precision leg, run on CUDA; None: no such leg.
        overrides: tolerance terms in place of the profiles'.
    """
    legs: list[AttributionLeg] = []
    missing = []
    cpu = next((r for r in reports if r.provider == CPU), None)
    if manifest.dtype != "float32":
        return Attribution(
            [],
            "attribution starts from a float32 artifact; verify the float32 export with the "
            "float16 one as its companion",
        )
    prefill_batch = f"{manifest.prefill.file}, {PREFILL_BATCH}"
    if cpu is not None:  # ORT CPU fp32 vs PyTorch fp32
        legs.append(AttributionLeg("export", prefill_batch, cpu.comparisons[0]))  # the prefill logits
        steps = len(cpu.curve)
        legs.append(
            AttributionLeg(
                "export",
                f"{manifest.decode.file}, the {steps} decode steps after it",
                aggregate(f"decode logits ({steps} steps)", [s.logits for s in cpu.curve]),
            )
        )
    if CPU not in outputs:
        missing.append('export and provider legs need CPUExecutionProvider too (`providers=["cpu", "cuda"]`)')
    if CUDA not in outputs:
        missing.append("provider and precision legs need CUDAExecutionProvider (onnxruntime-gpu and a CUDA GPU)")
    else:
        # cross_providers names a pair in the order the providers were given
        pair = {f"{_pair(CUDA, CPU)} logits", f"{_pair(CPU, CUDA)} logits"}
        provider_leg = next((c for c in cross if c.name in pair), None)
        if provider_leg is not None:
            legs.append(AttributionLeg("provider", prefill_batch, provider_leg))
        if companion is None:
            missing.append("precision leg needs a float16 companion artifact")
        else:
            log.info("attribution: the float16 companion on %s", CUDA)
            fp16 = OrtRunner(companion, CUDA).prefill(prefill_feeds(companion.manifest, batch))
            legs.append(
                AttributionLeg(
                    "precision",
                    prefill_batch,
                    compare(
                        "ORT CUDA fp16 vs ORT CUDA fp32 logits",
                        "logits",
                        fp16["logits"],
                        outputs[CUDA]["logits"],
                        overrides.apply(profile_for("float16", CUDA)).logits,
                        valid=batch["attention_mask"] == 1,
                    ),
                )
            )
    return Attribution(legs, "; ".join(missing))
