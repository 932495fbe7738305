"""verify_artifact: every check of the verification engine on one artifact folder.

The reference is the PyTorch model when one is given (recorded once and
replayed for the other providers; its parameters are also held to the graphs'
initializers, the weight audit), a golden bundle when one is given (no
torch), or nothing: then only the reference-free invariants run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import Manifest, unchanged_while_read
from exporter.runtime.protocol import DEBUG_GRAPHS, ROUTER_PROBES, Runner, missing
from exporter.runtime.providers import CPU
from exporter.runtime.registry import DEFAULT_RUNTIME, registered_runtimes
from exporter.runtime.runner import OrtRunner
from exporter.runtime.settings import checking_settings
from exporter.runtime.shared_weights import SharedWeightMap
from exporter.tolerances.parity import Overrides, profile_for
from exporter.tolerances.quality import quality_profile_for
from exporter.verify.checks.faithfulness import check_faithfulness
from exporter.verify.checks.greedy import check_greedy
from exporter.verify.checks.health import HealthScan
from exporter.verify.checks.invariants import check_invariants, float_matmul_settings
from exporter.verify.checks.long_context import check_long_context
from exporter.verify.checks.outputs import DecodeCall, check_decode, check_prefill, run_sweep
from exporter.verify.checks.providers import attribute, cross_providers, repeat_run
from exporter.verify.checks.quality import QualityReport, check_quality, recorded_target_checks
from exporter.verify.checks.routing import expert_choice
from exporter.verify.checks.routing_explainer import RoutingExplainer
from exporter.verify.checks.weights.audit import audit_weights
from exporter.verify.checks.weights.results import WeightAudit
from exporter.verify.consumers import CONSUMER_CHECKS
from exporter.verify.diagnosis.diagnose import DebugGraphs, localise, probes_between
from exporter.verify.diagnosis.probe import DebugGraph
from exporter.verify.inputs import ParitySettings, QualityText, greedy_prompt, prefill_feeds, prompt_batch
from exporter.verify.plan import Plan, Row, plan_verification
from exporter.verify.references.golden.reading import GoldenBundle
from exporter.verify.references.golden.recording import RecordedReference
from exporter.verify.references.golden.writing import save_bundle
from exporter.verify.references.transformers_reference import check_transformers
from exporter.verify.results import ConsumerReport, ProviderReport, VerifyReport

log = logging.getLogger(__name__)


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
    debug: DebugGraphs,
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
            explainer = RoutingExplainer(reference, onnx, manifest, profile)
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
    localisation = localise(
        prefill, decode, reference, debug, values, onnx.provider, batch, settings, profile, no_debug_graphs
    )
    experts = expert_choice(reference, onnx.artifact, onnx.provider, batch, settings, profile) if explainer else None
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
        report = replace(report, checks=report.checks + recorded_target_checks(target))
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


def _consumers(plan: Plan, reports: list[ProviderReport]) -> tuple[list[ConsumerReport], dict]:
    """The consumers' checks against the reference (onnxruntime-genai's, transformers.js's), and why the others did
    not run ({consumer: reason})."""
    skipped = {consumer: why for consumer, why in plan.consumers_skipped.items() if why}
    if len(skipped) == len(CONSUMER_CHECKS):
        return [], skipped
    plan.reference.rewind()
    cpu = next((r.greedy for r in reports if r.provider == CPU), None)
    # one runs: there is a reference, so each provider ran (plan_verification refuses none) and has its report
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
    plan: Plan, onnx: OrtRunner, batch: dict, settings: ParitySettings, overrides: Overrides
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
    save_bundle(reference, destination, manifest, settings, overrides, {"torch": torch.__version__})


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
            that exporter.verify.references.golden.reading.load_bundle read (not read again; held to the artifact
            all the same, and replayed from its first call), judged with the tolerance overrides it was recorded
            with, each term in `overrides` taking its recorded one's place.
        golden_save: a folder to record the reference's inputs and outputs in, with `overrides`.
        overrides: tolerance terms in place of the profiles' (exporter.tolerances.parity.parse_overrides).
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
        plan = plan_verification(
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
        first = first or Row(registered_runtimes()[DEFAULT_RUNTIME], CPU)
        invariant_provider = first.target
        first_runner = first.runner(artifact, mapping) if reference is not None or matched is None else None
        independent, independent_skipped = _independent(plan, first_runner, batch, settings, overrides)
        runs, quality = [], []
        quantized = manifest.quantization is not None
        debug = (
            None
            if quantized
            else DebugGraphs(
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
        probes = probes_between(debug, values, manifest, overrides, batch) if settings.probe and debug else []
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
