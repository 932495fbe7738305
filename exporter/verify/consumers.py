"""The consumer checks: onnxruntime-genai's and transformers.js's own generation loops over the artifact folder as it
is, their greedy tokens against the reference's from the prompt of the engine's greedy check; and why either does
not run on an artifact."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from exporter.artifact.consumers import (
    GENAI_CONFIG,
    HF_CONFIG,
    consumer_types,
    genai_eos_token_id,
    genai_unsupported,
)
from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import Manifest
from exporter.errors import ConsumerError
from exporter.runtime.genai import INSTALL_HINT, GenaiGenerator, genai_model_type, genai_version
from exporter.runtime.node import NODE_PACKAGES, TRANSFORMERS_JS, node_unavailable, transformers_js_greedy
from exporter.tolerances.parity import Profile
from exporter.verify.checks.greedy import GreedyResult, judge_greedy
from exporter.verify.inputs import ParitySettings, greedy_prompt
from exporter.verify.results import ConsumerReport

log = logging.getLogger(__name__)

GENAI, TRANSFORMERS_JS_CONSUMER = "onnxruntime-genai", "transformers.js"  # the consumers, as the reports name them
# Why the token-equality checks of other consumers and references do not run on a quantized artifact.
QUANTIZED_SKIP = (
    "a quantized artifact's tokens differ from a float reference's by design; its quality profile judges it"
)
NO_REFERENCE = "no reference to compare with (invariants only)"


def consumer_skip_reason(
    consumer: str, asked: bool | None, folder: Path, manifest: Manifest, has_reference: bool, reason: Callable[[], str]
) -> str:
    """Why `consumer`'s check does not run on the artifact, in one line; "" when it runs.

    Args:
        consumer: the consumer's name, for the error.
        asked: None runs the check where it can; True makes each reason it cannot an error; False turns it off.
        folder: the artifact's folder, for the error.
        manifest: the artifact's manifest.
        has_reference: whether there is a reference to compare with.
        reason: the consumer's own reason it cannot run here ("" when it can), asked only where it applies.

    Raises:
        ConsumerError: `asked` is True, and the check cannot run (before any work, as the caller asked for it).
    """
    if not has_reference:
        return NO_REFERENCE
    if manifest.quantization is not None:
        skipped = QUANTIZED_SKIP
    elif asked is False:
        return "turned off"
    else:
        skipped = reason()
    if skipped and asked:
        raise ConsumerError(f"cannot run the {consumer} check on {folder}: {skipped}")
    return skipped


def genai_skip_reason(folder: Path, manifest: Manifest) -> str:
    """Why the onnxruntime-genai check cannot run on this artifact here, in one line; "" when it can.

    Raises:
        ArtifactError: the listed genai_config.json is damaged (refused before any work, rather than after every
            check).
    """
    if genai_version() is None:
        return f"onnxruntime-genai is not installed ({INSTALL_HINT})"
    if reason := genai_unsupported(manifest):
        return reason
    if GENAI_CONFIG not in manifest.files:  # GenaiGenerator loads the listed file alone, whatever else is there
        return f"the folder's manifest lists no {GENAI_CONFIG} (exported by an older toolkit); re-export it"
    genai_model_type(folder)
    return ""


def transformers_js_skip_reason(manifest: Manifest) -> str:
    """Why the transformers.js check cannot run on this artifact here, in one line; "" when it can."""
    if reason := node_unavailable(packages=(TRANSFORMERS_JS,)):
        return reason
    types = consumer_types(manifest)
    if types.hf is None:  # transformers.js picks its model class by config.json's model_type
        return types.hf_unsupported
    if HF_CONFIG not in manifest.files:
        return f"the folder's manifest lists no {HF_CONFIG} (exported by an older toolkit); re-export it"
    return ""


def _explained_by_our_loop(greedy: GreedyResult, actual: list[int], runtime: GreedyResult | None) -> GreedyResult:
    """A consumer's greedy result, passed where our loop on the CPU (`runtime`, the same graph and prompt) chose its
    tokens up to and including the differing one and a router near-tie explains our loop's difference
    (check_greedy): the consumer's routers cannot be probed, and that near-tie explains its difference too."""
    shared = greedy.match_length + 1  # the tokens up to and including the differing one
    if (
        greedy.passed
        or runtime is None
        or runtime.routing is None
        or not runtime.routing.explained_flip
        or runtime.match_length != greedy.match_length
        or actual[:shared] != runtime.onnx_ids[:shared]
    ):
        return greedy
    return replace(
        greedy,
        passed=True,
        routing=runtime.routing,
        note=f"{greedy.note}; the tokens of our loop on the CPU up to and including this one, where "
        f"a router near-tie explains the difference: {runtime.routing.note}",
    )


def _reference_greedy(reference, manifest: Manifest, settings: ParitySettings):
    """check_greedy's prompt, and the reference's greedy run (GreedyTrace) from it."""
    prompt = greedy_prompt(manifest, np.random.default_rng(settings.seed + 2))
    return prompt, reference.greedy(prompt, settings.greedy_tokens, manifest.config.eos_token_id)


def check_genai(
    reference,
    artifact: Artifact,
    settings: ParitySettings,
    profile: Profile,
    runtime: GreedyResult | None = None,
) -> ConsumerReport:
    """onnxruntime-genai's own loop over the folder against the reference, from check_greedy's prompt.

    onnxruntime-genai stops at EOS and leaves it out, so the reference's tokens are compared up to its
    first EOS; for a model without one, up to the id genai_config.json makes genai stop at instead.

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference), which runs greedily.
        artifact: the artifact onnxruntime-genai loads.
        settings: the verification's settings (seed, greedy_tokens).
        profile: the profile whose logits tolerance defines a near-tie.
        runtime: check_greedy's result for our loop on the CPU, whose routing can explain genai's difference
            (_explained_by_our_loop); None: no such explanation.
    """
    manifest = artifact.manifest
    prompt, trace = _reference_greedy(reference, manifest, settings)
    eos = genai_eos_token_id(manifest.config.eos_token_id, manifest.config.vocab_size)
    expected = trace.ids[: trace.ids.index(eos)] if eos in trace.ids else trace.ids
    log.info("consumer check: greedy generation of %d tokens in onnxruntime-genai", settings.greedy_tokens)
    generator = GenaiGenerator(artifact)
    actual = generator.greedy(prompt, settings.greedy_tokens)
    greedy = _explained_by_our_loop(judge_greedy(trace, actual, profile, expected, dropped_eos=eos), actual, runtime)
    return ConsumerReport(f"{GENAI} {genai_version()}", generator.model_type, greedy, eos_dropped=True)


def check_transformers_js(
    reference,
    artifact: Artifact,
    settings: ParitySettings,
    profile: Profile,
    runtime: GreedyResult | None = None,
) -> ConsumerReport:
    """transformers.js's greedy tokens on the folder (its text-generation path, model.generate) against the
    reference's, from check_greedy's prompt.

    transformers.js keeps the EOS it stops at, as the reference's trace does: the lists compare as they are.

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference), which runs greedily.
        artifact: the artifact transformers.js loads.
        settings: the verification's settings (seed, greedy_tokens).
        profile: the profile whose logits tolerance defines a near-tie.
        runtime: check_greedy's result for our loop on the CPU, as check_genai takes it.

    Raises:
        ConsumerError: node or transformers.js is missing, or it could not load or run the folder.
    """
    manifest = artifact.manifest
    prompt, trace = _reference_greedy(reference, manifest, settings)
    log.info("consumer check: greedy generation of %d tokens in transformers.js", settings.greedy_tokens)
    actual = transformers_js_greedy(artifact, prompt, settings.greedy_tokens)
    greedy = _explained_by_our_loop(judge_greedy(trace, actual, profile), actual, runtime)
    return ConsumerReport(
        f"{TRANSFORMERS_JS_CONSUMER} {NODE_PACKAGES[TRANSFORMERS_JS]}", consumer_types(manifest).hf, greedy
    )


CONSUMER_CHECKS = {GENAI: check_genai, TRANSFORMERS_JS_CONSUMER: check_transformers_js}  # in the reports' order
