"""transformers.js as a consumer of an artifact folder: its greedy generation in Node (exporter.runtime.node) against
the reference's, from the prompt of the engine's greedy check, as check_genai judges onnxruntime-genai's."""

from __future__ import annotations

import logging

import numpy as np

from exporter.artifact.consumers import HF_CONFIG, consumer_types
from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import Manifest
from exporter.runtime.node import NODE_PACKAGES, TRANSFORMERS_JS, node_unavailable, transformers_js_greedy
from exporter.tolerances import Profile
from exporter.verify.checks.greedy import judge_greedy
from exporter.verify.inputs import ParitySettings, greedy_prompt
from exporter.verify.results import ConsumerReport

log = logging.getLogger(__name__)


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


def check_transformers_js(reference, artifact: Artifact, settings: ParitySettings, profile: Profile) -> ConsumerReport:
    """transformers.js's greedy tokens on the folder against the reference's, from check_greedy's prompt.

    transformers.js keeps the EOS it stops at, as the reference's trace does: the lists compare as they are.

    Args:
        reference: the reference (TorchRunner or a golden bundle's RecordedReference), which runs greedily.
        artifact: the artifact transformers.js loads.
        settings: the verification's settings (seed, greedy_tokens).
        profile: the profile whose logits tolerance defines a near-tie.

    Raises:
        ConsumerError: node or transformers.js is missing, or it could not load or run the folder.
    """
    manifest = artifact.manifest
    prompt = greedy_prompt(manifest, np.random.default_rng(settings.seed + 2))
    trace = reference.greedy(prompt, settings.greedy_tokens, manifest.config.eos_token_id)
    log.info("consumer check: greedy generation of %d tokens in transformers.js", settings.greedy_tokens)
    actual = transformers_js_greedy(artifact, prompt, settings.greedy_tokens)
    greedy = judge_greedy(trace, actual, profile)
    return ConsumerReport(f"transformers.js {NODE_PACKAGES[TRANSFORMERS_JS]}", consumer_types(manifest).hf, greedy)
