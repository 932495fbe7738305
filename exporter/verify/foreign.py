"""verify_foreign: the verification engine's checks on a folder another exporter wrote (Optimum, onnxruntime-genai's
builder), against Transformers' model of the Hugging Face folder it was exported from.

The graph runs behind OrtRunner's interface (exporter.runtime.foreign.ForeignRunner) and is judged by the same
checks and profiles as the toolkit's own artifacts: a float graph by its dtype's bit-parity profile on the prefill
batch, the decode steps fed its own presents, greedy tokens and the shape sweep, with the output health scan, a
repeat run, the layer-level localisation and the invariants that need no second graph; a quantized graph by its
scheme's quality profile, on seeded random ids or on a text tokenized with the folder's own tokenizer.json (as
Optimum and the builder copy it from the Hugging Face folder). Whatever the graph cannot give is listed in the report
as not checked, with the reason.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from exporter.artifact.foreign import ForeignGraph, check_sizes, foreign_manifest, read_foreign, reference_config
from exporter.artifact.manifest import Manifest
from exporter.artifact.tokenizer import TOKENIZER
from exporter.errors import InputError
from exporter.runtime.foreign import ForeignRunner
from exporter.runtime.providers import available_parity_providers, check_parity_providers, check_quantized_provider
from exporter.tolerances.parity import Overrides, profile_for
from exporter.tolerances.quality import quality_profile_for
from exporter.verify.checks.greedy import check_greedy
from exporter.verify.checks.health import HealthScan
from exporter.verify.checks.invariants import float_matmul_settings, padded_row_alone, split_prefill
from exporter.verify.checks.outputs import check_decode, check_prefill, run_sweep
from exporter.verify.checks.providers import repeat_run
from exporter.verify.checks.quality import check_quality
from exporter.verify.diagnosis.localise import locate_layer
from exporter.verify.inputs import (
    ParitySettings,
    QualityText,
    check_quality_text,
    check_quantized,
    greedy_prompt,
    prompt_batch,
    tokenize_quality_text,
)
from exporter.verify.references.transformers_reference import (
    TransformersRunner,
    float64_referee,
    transformers_version,
)
from exporter.verify.results import ProviderReport, VerifyReport

log = logging.getLogger(__name__)

# What no foreign graph gives, and why.
ALWAYS_NOT_CHECKED = {
    "loss": "the graph has no loss output",
    "weight audit": "the graph's initializers are named and laid out by its writer, not after the model's parameters",
    "fp16 health of activations": "the debug copy that exposes every activation is made of the toolkit's graphs; "
    "the outputs' health is checked",
    "probe": "it matches values to modules by the scope metadata torch.onnx records, which this graph lacks",
    "decode(past 0) == prefill, identical weights": "one graph serves as prefill and as decode",
    "onnxruntime-genai consumer": "the folder is judged as its writer left it, not as a consumer reads it",
}
LEFT_PADDING = (
    "its GroupQueryAttention takes each row's length from the mask and the row's tokens to start at its first slot "
    "(right padding), so every check ran on unpadded rows"
)
BATCHED_CHUNKS = (
    "its GroupQueryAttention runs several tokens on a past for a batch of one only, so such calls ran one row at a "
    "time and were judged row by row"
)


def not_checked(right_padded_only: bool) -> dict[str, str]:
    """The checks that cannot run on such a foreign graph, with the reason."""
    reasons = dict(ALWAYS_NOT_CHECKED)
    if right_padded_only:
        reasons["left-padded rows"] = LEFT_PADDING
        reasons["batched multi-token calls on a past"] = BATCHED_CHUNKS
    return reasons


def verify_foreign(
    folder: Path,
    reference: Path,
    providers: list[str] | None = None,
    settings: ParitySettings = ParitySettings(),
    overrides: Overrides = Overrides(),
    quality_text: Path | QualityText | None = None,
) -> VerifyReport:
    """Every check that applies to a foreign folder's graph, against Transformers' model of `reference`.

    Args:
        folder: the folder Optimum or onnxruntime-genai's builder wrote.
        reference: the Hugging Face folder the graph was exported from (config.json and weights).
        providers: the providers to verify on ("cpu", "cuda"), or None for every available one.
        settings: decode steps, greedy tokens, sweep and seed (the probe does not apply).
        overrides: tolerance terms in place of the profiles'.
        quality_text: for a quantized graph, a text its quality check reads in place of seeded random ids: a UTF-8
            file, tokenized with the folder's tokenizer.json, or a QualityText of ids; as for the toolkit's own
            artifacts (verify_artifact), the same windows, intervals and verdicts.

    Raises:
        ArtifactError: the folder holds no graph, or one that follows no contract read here.
        InputError: the reference folder has no readable config, its sizes are not the graph's, transformers is
            not installed, or the probe is asked for; `quality_text` for a float graph, for a folder without a
            tokenizer.json, unreadable, not UTF-8 or too short for one window.
        TokenizerError: quality_text given, and the folder's tokenizer.json cannot be read or does not fit the
            reference's vocabulary.
        ProviderError: a provider that is unknown or not available.
    """
    start = time.perf_counter()
    graph = read_foreign(folder)
    config = reference_config(reference)
    check_sizes(graph, config, reference)
    if settings.probe:
        raise InputError(f"the probe cannot run on {folder}: {ALWAYS_NOT_CHECKED['probe']}; drop `probe`")
    if transformers_version() is None:
        raise InputError(
            "the reference of a foreign folder is transformers, which is not installed: pip install 'transformers>=5'"
        )
    manifest = foreign_manifest(graph, config, reference)
    chosen, skipped = available_parity_providers() if providers is None else (check_parity_providers(providers), {})
    if manifest.quantization is not None:
        for provider in chosen:
            check_quantized_provider(provider, manifest)
    if not graph.left_padding:
        settings = replace(settings, left_padding=0)
    settings = settings.fit(config.max_position_embeddings)
    text = _quality_text(quality_text, graph, manifest, settings)
    batch = prompt_batch(manifest, settings, np.random.default_rng(settings.seed))
    log.info("reference: transformers loading %s", reference)
    model = TransformersRunner(reference, manifest)
    reports, quality, invariants = [], [], []
    for provider in chosen:
        onnx = ForeignRunner(graph, manifest, provider)
        if manifest.quantization is not None:
            log.info("%s: quality profile %s", onnx.provider, manifest.precision)
            quality.append(
                check_quality(
                    model,
                    onnx,
                    manifest,
                    batch,
                    settings,
                    quality_profile_for(manifest.precision),
                    np.random.default_rng(settings.seed + 1),
                    text,
                )
            )
        else:
            reports.append(_run_provider(model, onnx, graph.left_padding, batch, settings, overrides, reference))
        if not invariants:
            # a quantized graph against itself computes in its float dtype on the same weights, at accuracy level 4
            # in a session of its own (float_matmul_settings): that dtype's profile bounds it
            profile = overrides.apply(profile_for(manifest.dtype, onnx.provider))
            matched = float_matmul_settings(manifest)
            runner = onnx if matched is None else ForeignRunner(graph, manifest, onnx.provider, matched)
            k = batch["input_ids"].shape[1] // 2 + 1
            invariants = [split_prefill(runner, manifest, batch, profile, k)]
            if graph.left_padding:
                invariants.append(padded_row_alone(runner, manifest, batch, profile))
    return VerifyReport(
        folder=str(folder),
        reports=reports,
        quality=quality,
        skipped=skipped,
        reference=f"transformers {transformers_version()} loading {reference} (float32, eager attention, cast to "
        f"{manifest.dtype})",
        invariants=invariants,
        settings=settings.to_dict(),
        not_checked=not_checked(not graph.left_padding),
        writer=graph.to_dict(),
        seconds=time.perf_counter() - start,
    )


def _quality_text(
    quality_text, graph: ForeignGraph, manifest: Manifest, settings: ParitySettings
) -> QualityText | None:
    """verify_foreign's `quality_text` read with the folder's own tokenizer.json (a path) or checked (a
    QualityText); None without one."""
    if quality_text is None:
        return None
    if isinstance(quality_text, QualityText):
        check_quality_text(quality_text, manifest, graph.folder, settings)
        return quality_text
    check_quantized(manifest, graph.folder)
    tokenizer = graph.folder / TOKENIZER
    if not tokenizer.is_file():
        raise InputError(
            f"`quality_text` is tokenized with the folder's own {TOKENIZER}, and {graph.folder} has none "
            f"({graph.writer} copies the one of the Hugging Face folder it exports); export it again from a folder "
            "that holds its tokenizer, or verify without `quality_text`"
        )
    return tokenize_quality_text(quality_text, tokenizer, manifest, graph.folder, settings)


def _run_provider(
    model: TransformersRunner,
    onnx: ForeignRunner,
    left_padded: bool,
    batch: dict,
    settings: ParitySettings,
    overrides: Overrides,
    reference: Path,
) -> ProviderReport:
    manifest = onnx.manifest
    profile = overrides.apply(profile_for(manifest.dtype, onnx.provider))
    referee = float64_referee(reference, manifest, profile)  # built at the first comparison beyond the profile
    health = HealthScan(manifest.dtype)
    log.info("%s: prefill", onnx.provider)
    prefill, outputs = check_prefill(model, onnx, manifest, batch, profile, health, referee=referee)
    repeat = repeat_run(onnx, manifest, batch, outputs, profile)
    log.info("%s: %d decode steps feeding present back as past", onnx.provider, settings.decode_steps + 1)
    decode, _ = check_decode(
        model,
        onnx,
        manifest,
        batch,
        settings,
        profile,
        health,
        np.random.default_rng(settings.seed + 1),
        referee=referee,
    )
    log.info("%s: greedy generation of %d tokens", onnx.provider, settings.greedy_tokens)
    prompt = greedy_prompt(manifest, np.random.default_rng(settings.seed + 2))
    greedy = check_greedy(model, onnx, manifest, prompt, settings, profile)
    sweep = []
    if settings.sweep:
        log.info("%s: shape sweep", onnx.provider)
        rng = np.random.default_rng(settings.seed + 3)
        sweep = run_sweep(model, onnx, manifest, profile, health, rng, left_padded=left_padded, referee=referee)
    skipped = f"not run: {ALWAYS_NOT_CHECKED['probe']}"
    localisation = replace(
        locate_layer(prefill.layers, prefill.comparisons[0], decode.curve),
        probe_skipped=skipped,
        decode_probe_skipped=skipped,
    )
    return ProviderReport(
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
        health=health.report(),
        repeat=repeat,
        localisation=localisation,
    )
