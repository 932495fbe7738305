"""verify_artifact: every check of the verification engine on one artifact folder.

The reference is the PyTorch model when one is given (recorded once and
replayed for the other providers; its parameters are also held to the graphs'
initializers, the weight audit), a golden bundle when one is given (no
torch), or nothing: then only the reference-free invariants run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from exporter.artifact.consumers import check_sidecars
from exporter.artifact.folder import Artifact, open_artifact
from exporter.artifact.manifest import Manifest, config_differences, unchanged_while_read
from exporter.artifact.paths import check_outside_artifact
from exporter.errors import InputError, ProviderError
from exporter.runtime.protocol import DEBUG_GRAPHS, ROUTER_PROBES, Runner, missing
from exporter.runtime.registry import DEFAULT_RUNTIME, Runtime, registered_runtimes, select_runtimes
from exporter.runtime.runner import OrtRunner
from exporter.runtime.sessions import CPU, SharedWeightMap, checking_settings
from exporter.tolerances import AppliedOverrides, Overrides, Profile, profile_for, quality_profile_for
from exporter.verify.checks.faithfulness import check_faithfulness
from exporter.verify.checks.greedy import check_greedy
from exporter.verify.checks.health import HealthScan
from exporter.verify.checks.invariants import check_invariants, float_matmul_settings
from exporter.verify.checks.long_context import check_long_context
from exporter.verify.checks.outputs import DecodeCall, check_decode, check_prefill, run_sweep
from exporter.verify.checks.providers import attribute, check_companion, cross_providers, repeat_run
from exporter.verify.checks.quality import QualityReport, check_quality, recorded_target_checks
from exporter.verify.checks.routing import (
    CallRouting,
    ExpertAgreement,
    RouterProbe,
    check_expert_choice,
    greedy_choices,
    routing_agreement,
)
from exporter.verify.checks.weights.audit import audit_weights
from exporter.verify.checks.weights.results import WeightAudit
from exporter.verify.consumers import (
    CONSUMER_CHECKS,
    GENAI,
    QUANTIZED_SKIP,
    TRANSFORMERS_JS_CONSUMER,
    consumer_skip_reason,
    genai_skip_reason,
    transformers_js_skip_reason,
)
from exporter.verify.diagnosis.localise import Localisation, ProbeResult, locate_layer, probe_between, probe_reference
from exporter.verify.diagnosis.probe import DebugGraph
from exporter.verify.inputs import (
    FINAL_CHUNK,
    PREFILL_BATCH,
    ParitySettings,
    QualityText,
    check_quality_text,
    greedy_prompt,
    prefill_feeds,
    prompt_batch,
    read_quality_text,
)
from exporter.verify.references.golden import (
    GoldenBundle,
    RecordedReference,
    check_golden_destination,
    check_loaded,
    load_bundle,
)
from exporter.verify.references.referee import Float64Referee
from exporter.verify.references.transformers_reference import check_transformers, transformers_skip_reason
from exporter.verify.results import ConsumerReport, ProviderReport, VerifyReport
from reference.families import get_family
from reference.source import SourcedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _DebugGraphs:
    """The debug copies of both graphs: prefill.onnx's for the activation scan and the probe, decode.onnx's for
    the probe alone (None without --probe)."""

    prefill: DebugGraph
    decode: DebugGraph | None


def _probe_decode(
    call: DecodeCall, reference: RecordedReference, debug: DebugGraph, provider: str, profile: Profile
) -> tuple[ProbeResult | None, str]:
    """decode.onnx's values on the reference's inputs of `call` against the reference's module outputs for it;
    or None and why not."""
    module_outputs = reference.module_outputs(call.feeds, "decode")
    if module_outputs is None:
        return None, (
            f"the bundle holds no module outputs of {call.label} (it keeps those of the decode call probed "
            "when it was recorded; one recorded before they were kept, none): re-record it with "
            "`golden_save`, or probe against the PyTorch model"
        )
    values = debug.run(call.feeds, provider)
    log.info(
        "probe: comparing %d values of %s on %s with the reference's module outputs",
        len(values),
        debug.graph_file,
        call.label,
    )
    return probe_reference(
        debug,
        values,
        module_outputs,
        profile.kv,
        call.feeds["attention_mask"],
        f"{call.label}, fed the reference's past",
    ), ""


def _localise(
    prefill,
    decode,
    reference: RecordedReference,
    debug: _DebugGraphs,
    values: dict,
    provider: str,
    batch: dict,
    settings: ParitySettings,
    profile: Profile,
    probe_missing: str,
) -> Localisation:
    """The layer-level localisation, and with `probe` the node-level probe of both graphs where the runner has
    debug graphs (`probe_missing`: why it has none, "" when it has)."""
    located = locate_layer(prefill.layers, prefill.comparisons[0], decode.curve)  # [0]: the logits row
    if not settings.probe or probe_missing:
        skipped = probe_missing or "not requested (`probe`)"
        return replace(located, probe_skipped=skipped, decode_probe_skipped=skipped)
    module_outputs = reference.module_outputs(batch)
    probe, skipped = None, "the bundle holds no module outputs: re-record it with `golden_save`"
    if module_outputs is not None:
        log.info(
            "probe: comparing %d values of %s with the reference's module outputs",
            len(values),
            debug.prefill.graph_file,
        )
        probe, skipped = (
            probe_reference(debug.prefill, values, module_outputs, profile.kv, batch["attention_mask"], PREFILL_BATCH),
            "",
        )
    decode_probe, decode_skipped = _probe_decode(decode.probe_call, reference, debug.decode, provider, profile)
    return replace(
        located, probe=probe, probe_skipped=skipped, decode_probe=decode_probe, decode_probe_skipped=decode_skipped
    )


def _expert_choice(
    reference: RecordedReference,
    artifact: Artifact,
    provider: str,
    batch: dict,
    settings: ParitySettings,
    profile: Profile,
) -> ExpertAgreement | None:
    """MoE routing agreement against the reference's routers, live or from a golden bundle (None for models
    without routers)."""
    manifest = artifact.manifest
    if not manifest.is_moe:
        return None
    log.info("%s: expert choice of the MoE routers", provider)
    rng = np.random.default_rng(settings.seed + 4)
    steps = [
        rng.integers(0, manifest.config.vocab_size, (settings.batch, n), dtype=np.int64)
        for n in [1] * min(settings.decode_steps, 16) + [FINAL_CHUNK]
    ]
    return check_expert_choice(reference, artifact, provider, batch, steps, profile.kv)


class _RoutingExplainer:
    """For MoE models: the expert choices of both sides behind a failing call (judge_call's explain_routing,
    asked right after the reference's call) or a greedy run that differs (check_greedy's); each graph's
    router probe is built at its first use."""

    def __init__(self, reference: RecordedReference, onnx: Runner, manifest: Manifest, profile: Profile):
        self.reference, self.onnx, self.manifest, self.tolerance = reference, onnx, manifest, profile.kv
        self._probes: dict[str, RouterProbe] = {}

    def _probe(self, graph: str) -> RouterProbe:
        if graph not in self._probes:
            self._probes[graph] = RouterProbe(self.onnx.artifact, graph, self.onnx.provider)
        return self._probes[graph]

    def call(self, graph: str, onnx_feeds: dict, valid) -> CallRouting:
        return routing_agreement(self.reference.last_routing(), self._probe(graph), onnx_feeds, valid, self.tolerance)

    def greedy(self, reference_calls: list[dict], prompt: list[int], shared: list[int]) -> ExpertAgreement:
        return greedy_choices(
            reference_calls, self.onnx, self._probe("decode"), self.manifest, prompt, shared, self.tolerance
        )


@dataclass(frozen=True)
class _ProviderRun:
    report: ProviderReport
    outputs: dict  # the runner's prefill outputs, for the runners against each other
    values: dict | None  # the prefill debug copy's values, for the probe between providers; None: no debug graphs
    decode_call: DecodeCall  # the decode call the probe examines, whose module outputs a golden bundle keeps
    not_checked: dict[str, str]  # check (and row) -> why it did not run on this runner


def _run_provider(
    onnx: Runner,
    manifest: Manifest,
    reference,
    debug: _DebugGraphs,
    batch: dict,
    settings: ParitySettings,
    overrides: Overrides,
    referee=None,
) -> _ProviderRun:
    profile = overrides.apply(profile_for(manifest.dtype, onnx.provider))
    health = HealthScan(manifest.dtype)
    reference.rewind()
    not_checked, values = {}, None
    if no_debug_graphs := missing(onnx, DEBUG_GRAPHS):
        not_checked[f"activation scan ({onnx.provider})"] = no_debug_graphs
    else:
        log.info("%s: activation scan of a debug copy of %s", onnx.provider, manifest.prefill.file)
        values = debug.prefill.run(prefill_feeds(manifest, batch), onnx.provider)
        health.scan_activations(
            values,
            {o: f"{n.op_type} in {n.module or 'the graph'}" for n in debug.prefill.nodes for o in n.outputs},
            debug.prefill.mask_fed,
        )
    explainer = None
    if manifest.is_moe:
        if no_router_probes := missing(onnx, ROUTER_PROBES):
            not_checked[f"expert choice and routing near-ties ({onnx.provider})"] = no_router_probes
        else:
            explainer = _RoutingExplainer(reference, onnx, manifest, profile)
    explain_routing = explainer.call if explainer else None
    if profile.overridden:  # the user's own bound is the verdict: the referee judges beyond the profile's alone
        referee = None
    log.info("%s: prefill", onnx.provider)
    prefill, outputs = check_prefill(reference, onnx, manifest, batch, profile, health, explain_routing, referee)
    repeat = repeat_run(onnx, manifest, batch, outputs, profile)
    log.info("%s: %d decode steps feeding present back as past", onnx.provider, settings.decode_steps + 1)
    decode, _ = check_decode(
        reference,
        onnx,
        manifest,
        batch,
        settings,
        profile,
        health,
        np.random.default_rng(settings.seed + 1),
        explain_routing,
        referee,
    )
    log.info("%s: greedy generation of %d tokens", onnx.provider, settings.greedy_tokens)
    prompt = greedy_prompt(manifest, np.random.default_rng(settings.seed + 2))
    greedy = check_greedy(reference, onnx, manifest, prompt, settings, profile, explainer.greedy if explainer else None)
    sweep = []
    if settings.sweep:
        log.info("%s: shape sweep", onnx.provider)
        sweep = run_sweep(
            reference,
            onnx,
            manifest,
            profile,
            health,
            np.random.default_rng(settings.seed + 3),
            explain_routing,
            referee=referee,
        )
    long_context = []
    if settings.long_context:  # last: a golden bundle recorded before it replays every call before
        log.info("%s: long positions", onnx.provider)
        long_context = check_long_context(
            reference, onnx, manifest, profile, health, np.random.default_rng(settings.seed + 5), referee
        )
    if settings.probe and no_debug_graphs:
        not_checked[f"probe ({onnx.provider})"] = no_debug_graphs
    localisation = _localise(
        prefill, decode, reference, debug, values, onnx.provider, batch, settings, profile, no_debug_graphs
    )
    experts = _expert_choice(reference, onnx.artifact, onnx.provider, batch, settings, profile) if explainer else None
    report = ProviderReport(
        provider=onnx.provider,
        runtime=onnx.runtime,
        dtype=manifest.dtype,
        profile=profile,
        comparisons=prefill.comparisons + decode.comparisons,
        greedy=greedy,
        curve=decode.curve,
        layers=prefill.layers,
        histogram=prefill.histogram,
        sweep=sweep,
        long_context=long_context,
        health=health.report(),
        repeat=repeat,
        localisation=localisation,
        experts=experts,
        prefill_routing=prefill.routing,
    )
    return _ProviderRun(report, outputs, values, decode.probe_call, not_checked)


def _run_quality(
    onnx: Runner, manifest: Manifest, reference, batch: dict, settings: ParitySettings, text: QualityText | None
) -> QualityReport:
    """A quantized artifact on one provider: its quality profile's distributional checks, in place of parity, on
    seeded random ids or on `text`."""
    reference.rewind()
    target = manifest.quantization.target  # an artifact made to a quality target is judged by it
    profile = quality_profile_for(manifest.precision, target)
    report = check_quality(
        reference, onnx, manifest, batch, settings, profile, np.random.default_rng(settings.seed + 1), text
    )
    if target is not None:
        report = dataclasses.replace(report, checks=report.checks + recorded_target_checks(target))
    for check in report.failures:
        log.info(
            "%s: %s %.4g is beyond %s %.4g",
            onnx.provider,
            check.threshold.metric,
            check.value,
            check.threshold.bound,
            check.threshold.limit,
        )
    return report


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
            "exporter.tolerances.parse_overrides(atol=['logits=1e-3'])"
        )
    for name, value in (("genai", genai), ("transformers_js", transformers_js)):
        if not isinstance(value, (bool, type(None))):
            raise InputError(f"{name} must be None, True or False, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class _Row:
    """One runner to verify on: a runtime and its target (an ONNX Runtime provider, an OpenVINO configuration)."""

    runtime: Runtime
    target: str

    def runner(self, artifact: Artifact, weights: SharedWeightMap) -> Runner:
        return self.runtime.runner(artifact, self.target, weights=weights)


def _rows(manifest: Manifest, runtimes, providers) -> tuple[list[_Row], dict[str, str]]:
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
        rows += [_Row(runtime, target) for target in targets]
        skipped.update(left_out)
    return rows, skipped


@dataclass(frozen=True)
class _Plan:
    """verify_artifact's arguments, checked before any work: the runners, the reference and what to run."""

    artifact: Artifact
    rows: list[_Row]  # the runners to verify on, ONNX Runtime's first where it is among them
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


def _plan(
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
) -> _Plan:
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
    return _Plan(
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


def _probes_between(
    debug: _DebugGraphs, values: dict, manifest: Manifest, overrides: Overrides, batch: dict
) -> list[ProbeResult]:
    """The node-level probe of each provider's prefill values against the first provider's (none with one)."""
    if len(values) < 2:
        return []
    first, *others = values
    return [
        probe_between(
            debug.prefill,
            values[p],
            values[first],
            overrides.apply(profile_for(manifest.dtype, p)).kv,
            f"{p} vs {first}",
            batch["attention_mask"],
            PREFILL_BATCH,
        )
        for p in others
    ]


def _consumers(plan: _Plan, reports: list[ProviderReport]) -> tuple[list[ConsumerReport], dict]:
    """The consumers' checks against the reference (onnxruntime-genai's, transformers.js's), and why the others did
    not run ({consumer: reason})."""
    skipped = {consumer: why for consumer, why in plan.consumers_skipped.items() if why}
    if len(skipped) == len(CONSUMER_CHECKS):
        return [], skipped
    plan.reference.rewind()
    cpu = next((r.greedy for r in reports if r.provider == CPU), None)
    # one runs: there is a reference, so each provider ran (_plan refuses none) and has its report
    ran = [
        check(plan.reference, plan.artifact, plan.settings, reports[0].profile, cpu)
        for consumer, check in CONSUMER_CHECKS.items()
        if consumer not in skipped
    ]
    return ran, skipped


def _audit(artifact: Artifact, model) -> WeightAudit:
    log.info("weight audit: every initializer of both graphs against the model's parameters")
    audit = audit_weights(artifact, model)
    for finding in audit.findings:
        log.info("weight audit: %s", finding.describe())
    return audit


def _independent(
    plan: _Plan, onnx: OrtRunner, batch: dict, settings: ParitySettings, overrides: Overrides
) -> tuple[list, dict]:
    """Transformers' model of the artifact's folder against the toolkit's reference and against ONNX Runtime on
    the first provider (`onnx`), or why not ({reference: reason}); neither for an artifact not exported from a
    Hugging Face folder. Run before the providers' runs, which replay the reference's calls it recorded."""
    if plan.transformers_skipped is None:
        return [], {}
    if plan.transformers_skipped:
        return [], {"transformers": plan.transformers_skipped}
    profile = overrides.apply(profile_for(plan.artifact.manifest.dtype, onnx.provider))
    return check_transformers(plan.reference, onnx, plan.artifact.manifest, batch, settings, profile), {}


def _save_golden(
    reference: RecordedReference,
    destination: Path,
    manifest: Manifest,
    settings: ParitySettings,
    overrides: Overrides,
    batch: dict,
    decode_call: DecodeCall,
) -> None:
    import torch  # the reference side's version, recorded with the bundle

    # recorded with or without --probe, so that any replay can probe both graphs
    reference.module_outputs(batch)
    reference.module_outputs(decode_call.feeds, "decode")
    reference.save(destination, manifest, settings, overrides, {"torch": torch.__version__})


def verify_artifact(
    artifact: Artifact | Path,
    model=None,
    providers: list[str] | None = None,
    settings: ParitySettings = ParitySettings(),
    genai: bool | None = None,
    *,
    runtimes: list[str] | None = None,
    transformers_js: bool | None = None,
    golden: Path | GoldenBundle | None = None,
    golden_save: Path | None = None,
    overrides: Overrides = Overrides(),
    fp16_companion: Path | Artifact | None = None,
    quality_text: Path | QualityText | None = None,
) -> VerifyReport:
    """Every check of the verification engine on one artifact, against the PyTorch model, a golden bundle, or
    (with neither) the reference-free invariants alone.

    Args:
        artifact: an opened Artifact (not read again), or an artifact folder's path, opened here with every hash
            checked.
        model: the PyTorch reference (torch.nn.Module), of the artifact's family and config.
        providers: ONNX Runtime's providers to verify on, each of which must be available ("cpu", "cuda"; a str
            names one), or None for every available one.
        settings: decode steps, greedy tokens, sweep, probe and seed.
        genai: also check onnxruntime-genai's greedy tokens; None runs the check when it can and reports why not
            otherwise, True makes each of those an error, False skips it.
        transformers_js: also check transformers.js's greedy tokens (in Node), as `genai` does onnxruntime-genai's.
        runtimes: the runtimes to verify in (exporter.runtime.registry: "onnxruntime", "openvino", "all" for every
            installed one; a str names one), each runner a row of the report; None: ONNX Runtime alone.
        golden: a golden bundle to compare with instead of a model (no torch): its folder, or the GoldenBundle
            that exporter.verify.references.golden.load_bundle read (not read again; held to the artifact all the
            same, and replayed from its first call), judged with the tolerance overrides it was recorded with,
            each term in `overrides` taking its recorded one's place.
        golden_save: a folder to record the reference's inputs and outputs in, with `overrides`.
        overrides: tolerance terms in place of the profiles' (exporter.tolerances.parse_overrides).
        fp16_companion: a float16 export of the same model (Artifact or path), for the precision leg of the CUDA
            attribution.
        quality_text: for a quantized artifact, a text its quality check reads in place of seeded random ids: a
            UTF-8 file, tokenized with the artifact's tokenizer.json, or the QualityText read_quality_text made;
            the batch rows are windows of it (exporter.verify.inputs.text_windows), the decode steps its
            continuation.

    Returns:
        The VerifyReport; `passed` is the verdict.

    Raises:
        InputError: a model of another family or config, both model and golden, golden_save without a model;
            quality_text for a float artifact, for one without a tokenizer.json, without a model, or not readable
            UTF-8 text, or too short for one window.
        TokenizerError: quality_text given, and the artifact's tokenizer.json does not fit the model.
        ProviderError: a provider that is unknown or not available.
        InputError: a runtime that is unknown or not installed (the message names its install).
        ConsumerError: genai=True where the onnxruntime-genai check cannot run, transformers_js=True where the
            transformers.js check cannot; a runtime that cannot compile or
            run the artifact's graphs.
        ArtifactError: the artifact (or the companion, or the bundle) is damaged or not one; a consumer config
            giving other ids or sizes than the manifest's model config is damage too.
    """
    start = time.perf_counter()
    folder = artifact.folder if isinstance(artifact, Artifact) else artifact
    with unchanged_while_read(folder):  # an export into it meanwhile: no report on a mix of two artifacts
        plan = _plan(
            artifact,
            model,
            providers=providers,
            runtimes=runtimes,
            settings=settings,
            genai=genai,
            transformers_js=transformers_js,
            golden=golden,
            golden_save=golden_save,
            overrides=overrides,
            fp16_companion=fp16_companion,
            quality_text=quality_text,
        )
        artifact, reference, settings = plan.artifact, plan.reference, plan.settings
        folder, manifest = artifact.folder, artifact.manifest
        overrides = plan.applied.overrides  # a replay's: the bundle's, each given term in its place
        weights = _audit(artifact, model) if model is not None else None
        batch = prompt_batch(manifest, settings, np.random.default_rng(settings.seed))
        mapping = SharedWeightMap(artifact)  # every session below reads it: one resident copy of the file
        sessions = checking_settings(manifest)
        # a quantized artifact against itself (split prefill, past 0, a padded row alone) computes in its float dtype
        # on the same quantized weights, at accuracy level 4 in sessions of its own (float_matmul_settings): that
        # dtype's rounding bounds those differences as in a float artifact of it
        matched = float_matmul_settings(manifest)
        # The invariants hold the artifact's graphs to each other in ONNX Runtime, the runtime they were exported
        # for, on its first provider asked for (the CPU where ONNX Runtime is not among the runtimes). That runner
        # serves the independent reference, its row's run and the invariants; with no reference and sessions of the
        # invariants' own, nothing reads it.
        first = next((row for row in plan.rows if row.runtime.name == DEFAULT_RUNTIME), None)
        first = first or _Row(registered_runtimes()[DEFAULT_RUNTIME], CPU)
        invariant_provider = first.target
        first_runner = first.runner(artifact, mapping) if reference is not None or matched is None else None
        independent, independent_skipped = _independent(plan, first_runner, batch, settings, overrides)
        runs, quality = [], []
        quantized = manifest.quantization is not None
        debug = (
            None
            if quantized
            else _DebugGraphs(
                DebugGraph(artifact, manifest.prefill, mapping, sessions),
                DebugGraph(artifact, manifest.decode, mapping, sessions) if settings.probe else None,
            )
        )
        if reference is not None:
            for row in plan.rows:
                onnx = first_runner if row == first else row.runner(artifact, mapping)
                if quantized:
                    quality.append(_run_quality(onnx, manifest, reference, batch, settings, plan.quality_text))
                else:
                    runs.append(
                        _run_provider(onnx, manifest, reference, debug, batch, settings, overrides, plan.referee)
                    )
        reports = [run.report for run in runs]
        # the runners against each other: those whose configuration differs by design are not held to the others
        outputs = {run.report.provider: run.outputs for run in runs if not run.report.runtime.known_cause}
        values = {run.report.provider: run.values for run in runs if run.values is not None}
        log.info("reference-free invariants on %s", invariant_provider)
        invariant_profile = overrides.apply(profile_for(manifest.dtype, invariant_provider))
        invariant_runner = (
            first_runner
            if matched is None
            else OrtRunner(artifact, invariant_provider, settings=matched, weights=mapping)
        )
        invariants = check_invariants(artifact, invariant_runner, batch, invariant_profile)
        # a quantized artifact's export judged apart from its scheme's loss: the float profile, on the sessions that
        # compute MatMulNBits in float (the invariants')
        faithfulness = (
            check_faithfulness(artifact, model, invariant_runner, batch, settings, invariant_profile)
            if quantized and model is not None
            else None
        )
        cross = cross_providers(outputs, manifest.dtype, overrides, batch["attention_mask"])
        probes = _probes_between(debug, values, manifest, overrides, batch) if settings.probe and debug else []
        attribution = (
            attribute(reports, outputs, cross, manifest, batch, plan.companion, overrides) if reports else None
        )
        consumers, consumers_skipped = _consumers(plan, reports)
    if golden_save is not None:
        _save_golden(reference, golden_save, manifest, settings, overrides, batch, runs[0].decode_call)
    return VerifyReport(
        folder=str(folder),
        reports=reports,
        quality=quality,
        skipped=plan.skipped,
        consumers=consumers,
        consumers_skipped=consumers_skipped,
        independent=independent,
        independent_skipped=independent_skipped,
        reference=plan.described,
        invariants=invariants,
        weights=weights,
        faithfulness=faithfulness,
        cross=cross,
        cross_probes=probes,
        attribution=attribution,
        not_checked={check: why for run in runs for check, why in run.not_checked.items()},
        settings=settings.to_dict(),
        tolerance_overrides=plan.applied,
        seconds=time.perf_counter() - start,
    )
