"""verify_artifact's arguments checked before any work, and what they ask for: the runners to verify on, the
reference (the PyTorch model, a golden bundle, or none) with its settings and tolerance overrides, the float64
referee, the consumers' and Transformers' checks and why any does not run, the quality text."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from exporter.artifact.consumers import check_sidecars
from exporter.artifact.folder import Artifact, open_artifact
from exporter.artifact.manifest import Manifest, config_differences
from exporter.artifact.paths import check_outside_artifact
from exporter.errors import InputError, ProviderError
from exporter.runtime.protocol import Runner
from exporter.runtime.registry import Runtime, select_runtimes
from exporter.runtime.shared_weights import SharedWeightMap
from exporter.tolerances.parity import AppliedOverrides, Overrides
from exporter.verify.checks.providers import check_companion
from exporter.verify.consumers import (
    GENAI,
    QUANTIZED_SKIP,
    TRANSFORMERS_JS_CONSUMER,
    consumer_skip_reason,
    genai_skip_reason,
    transformers_js_skip_reason,
)
from exporter.verify.inputs import ParitySettings, QualityText, check_quality_text, read_quality_text
from exporter.verify.references.golden.reading import GoldenBundle, check_loaded, load_bundle
from exporter.verify.references.golden.recording import RecordedReference
from exporter.verify.references.golden.writing import check_golden_destination
from exporter.verify.references.referee import Float64Referee
from exporter.verify.references.transformers_reference import transformers_skip_reason
from reference.families import get_family
from reference.source import SourcedModel

log = logging.getLogger(__name__)


def _reference(
    manifest: Manifest, model, golden: Path | GoldenBundle | None, settings: ParitySettings, overrides: Overrides
):
    """(reference or None, its description, the settings to use, the tolerance overrides to judge with, the float64
    referee or None)."""
    if golden is not None:
        bundle = check_loaded(golden, manifest) if isinstance(golden, GoldenBundle) else load_bundle(golden, manifest)
        log.info(
            "reference: golden bundle %s (recorded with %s)",
            bundle.folder,
            ", ".join(f"{k} {v}" for k, v in bundle.versions.items()),
        )
        return (
            bundle.reference,
            f"golden bundle {bundle.folder}",
            ParitySettings(**{**bundle.settings.to_dict(), "probe": settings.probe}),
            AppliedOverrides(overrides, bundle.overrides),
            None,
        )
    if model is not None:
        from exporter.verify.references.torch_runner import TorchRunner  # torch only on this path

        runner = TorchRunner(model, manifest)
        return (
            RecordedReference(runner),
            "pytorch model",
            settings,
            AppliedOverrides(overrides),
            _referee(runner, manifest),
        )
    return None, "none", settings, AppliedOverrides(overrides), None


def _referee(runner, manifest: Manifest) -> Float64Referee | None:
    """The float64 referee of the PyTorch reference's float comparisons; None for a quantized artifact (judged by
    its quality profile) and a MoE model, whose failing calls are explained by its routers' near-ties instead: a
    float64 run may choose other experts than both float computations, which no ratio of rounding errors judges."""
    if manifest.quantization is not None or manifest.is_moe:
        return None
    return Float64Referee(runner.in_float64, manifest)


def _check_model(model, manifest: Manifest) -> None:
    """InputError unless `model` is of the artifact's family and config: another model's logits would fail every
    check and blame the export for it."""
    if isinstance(model, SourcedModel):
        raise InputError(
            "model is a SourcedModel (what seeded_model and checkpoint_model return); pass its model: "
            "verify_artifact(folder, sourced.model)"
        )
    config = getattr(model, "config", None)
    if type(config) is not type(manifest.config):
        raise InputError(
            f"the model ({type(model).__name__} with config {type(config).__name__}) is not of the "
            f"artifact's family {manifest.family}; pass the model the artifact was exported from"
        )
    ours, theirs = config.to_dict(), manifest.config.to_dict()
    changed = config_differences(ours, theirs)
    if changed:
        # the values of the first few, the names of all: one line either way
        shown = [f"{k} (model {ours.get(k)!r}, artifact {theirs.get(k)!r})" for k in changed[:4]] + changed[4:]
        raise InputError(
            f"the model does not match the artifact: its config differs in {', '.join(shown)}; pass "
            "the model the artifact was exported from, or re-export the artifact from this model"
        )


def _check_arguments(settings, genai, transformers_js, overrides) -> None:
    """verify_artifact's option objects, which failed deep in the engine (AttributeError), or read "no" as True."""
    if not isinstance(settings, ParitySettings):
        raise InputError(
            f"settings must be a ParitySettings, got {type(settings).__name__}; write e.g. "
            "ParitySettings(decode_steps=16)"
        )
    if not isinstance(overrides, Overrides):
        raise InputError(
            f"overrides must be an Overrides, got {type(overrides).__name__}; build one with "
            "exporter.tolerances.parity.parse_overrides(atol=['logits=1e-3'])"
        )
    for name, value in (("genai", genai), ("transformers_js", transformers_js)):
        if not isinstance(value, (bool, type(None))):
            raise InputError(f"{name} must be None, True or False, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class Row:
    """One runner to verify on: a runtime and its target (an ONNX Runtime provider, an OpenVINO configuration)."""

    runtime: Runtime
    target: str

    def runner(self, artifact: Artifact, weights: SharedWeightMap) -> Runner:
        return self.runtime.runner(artifact, self.target, weights=weights)


def _rows(manifest: Manifest, runtimes, providers) -> tuple[list[Row], dict[str, str]]:
    """The runners to verify on, each able to run the artifact, and those left out ({name: why}), before any work.

    Raises:
        ProviderError: providers empty, or one unknown, not available, or without the artifact's kernels.
        InputError: a runtime unknown or not installed; providers without ONNX Runtime among the runtimes.
    """
    if providers is not None and not providers:  # [] would verify nothing, and the report would fail
        raise ProviderError("providers is empty; pass e.g. ['cpu'], or None for every available one (`providers`)")
    chosen, skipped = select_runtimes(runtimes, providers)
    rows = []
    for runtime in chosen:
        targets, left_out = runtime.targets(manifest, providers)
        rows += [Row(runtime, target) for target in targets]
        skipped.update(left_out)
    return rows, skipped


@dataclass(frozen=True)
class Plan:
    """verify_artifact's arguments, checked before any work: the runners, the reference and what to run."""

    artifact: Artifact
    rows: list[Row]  # the runners to verify on, ONNX Runtime's first where it is among them
    skipped: dict[str, str]  # provider or runtime -> why it does not run
    companion: Artifact | None  # the float16 export for the precision leg
    reference: RecordedReference | None  # None: the invariants alone
    described: str  # the reference, in words
    settings: ParitySettings  # a golden replay's are its bundle's; fitted to the model's context
    applied: AppliedOverrides
    consumers_skipped: dict[str, str]  # consumer -> why its check does not run; "" when it does
    transformers_skipped: str | None  # why Transformers is not compared; "" when it is; None: not an HF artifact
    quality_text: QualityText | None  # what the quality check reads in place of random ids
    referee: Float64Referee | None  # judges the float comparisons that fail their fixed profile; None: none does


def plan_verification(
    artifact,
    model,
    *,
    providers,
    runtimes,
    settings,
    genai,
    transformers_js,
    golden,
    golden_save,
    overrides,
    fp16_companion,
    quality_text,
) -> Plan:
    """Every argument of verify_artifact checked (InputError, ProviderError, ConsumerError, ToolkitError) and the
    reference chosen, before any check runs."""
    _check_arguments(settings, genai, transformers_js, overrides)
    if model is not None and golden is not None:  # the bundle was replayed and the model ignored, silently
        raise InputError(
            "give model or golden, not both: a golden bundle replays the reference in the model's "
            "place; drop golden to verify against the model, or model to replay the bundle"
        )
    artifact = open_artifact(artifact)  # first: it refuses a folder that is no path
    folder, manifest = artifact.folder, artifact.manifest
    if model is not None:
        _check_model(model, manifest)
    rows, skipped = _rows(manifest, runtimes, providers)
    if golden_save is not None:
        if model is None:  # a golden bundle comes without one (see above)
            raise InputError(
                "`golden_save` records the PyTorch reference: it needs the model and no golden bundle (`golden`)"
            )
        check_outside_artifact(golden_save, "`golden_save`", folder)
        check_golden_destination(golden_save, manifest)
    companion = None if fp16_companion is None else check_companion(fp16_companion, manifest)
    if manifest.quantization is not None and (golden is not None or golden_save is not None or companion):
        raise InputError(
            f"{folder} is quantized ({manifest.precision}): it is judged by its quality profile against the PyTorch "
            "model, which golden bundles and the float16 companion do not serve; drop `golden`, `golden_save` and "
            "`fp16_companion`"
        )
    reference, described, settings, applied, referee = _reference(manifest, model, golden, settings, overrides)
    text = _quality_text(quality_text, manifest, folder, settings, reference)
    has_reference = reference is not None
    consumers_skipped = {
        GENAI: consumer_skip_reason(
            GENAI, genai, folder, manifest, has_reference, lambda: genai_skip_reason(folder, manifest)
        ),
        TRANSFORMERS_JS_CONSUMER: consumer_skip_reason(
            TRANSFORMERS_JS_CONSUMER,
            transformers_js,
            folder,
            manifest,
            has_reference,
            lambda: transformers_js_skip_reason(manifest),
        ),
    }
    check_sidecars(folder, manifest)  # what the consumers read of the model: the graphs' checks cannot see it
    transformers_skipped = None
    if get_family(manifest.family).transformers:
        transformers_skipped = (
            QUANTIZED_SKIP
            if manifest.quantization is not None
            else transformers_skip_reason(manifest)
            if model is not None
            else "compared beside the PyTorch reference only, not with a golden bundle or the invariants alone"
        )
    return Plan(
        artifact,
        rows,
        skipped,
        companion,
        reference,
        described,
        settings.fit(manifest.config.max_position_embeddings),
        applied,
        consumers_skipped,
        transformers_skipped,
        text,
        referee,
    )


def _quality_text(quality_text, manifest: Manifest, folder: Path, settings: ParitySettings, reference):
    """verify_artifact's `quality_text` read (a path) or checked (a QualityText), None without one."""
    if quality_text is None:
        return None
    if not isinstance(quality_text, (QualityText, str, os.PathLike)):
        raise InputError(
            f"quality_text is a text file's path or a QualityText, got {type(quality_text).__name__} (`quality_text`)"
        )
    if reference is None and manifest.quantization is not None:
        raise InputError(
            "`quality_text` is read by the quality check against the PyTorch model, and no model is given; pass "
            "the model (`model`), or drop `quality_text` to check the invariants alone"
        )
    if isinstance(quality_text, QualityText):
        check_quality_text(quality_text, manifest, folder, settings)
        return quality_text
    return read_quality_text(quality_text, manifest, folder, settings)
