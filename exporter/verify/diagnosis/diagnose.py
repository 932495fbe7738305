"""The diagnosis as the engine runs it on one provider: the debug copies of both graphs, the layer-level localisation
of a failure with the node-level probe of each graph against the reference, and the probe of each provider's values
against the first provider's."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from exporter.artifact.manifest import Manifest
from exporter.tolerances.parity import Overrides, Profile, profile_for
from exporter.verify.checks.outputs import DecodeCall
from exporter.verify.diagnosis.localise import Localisation, ProbeResult, locate_layer, probe_between, probe_reference
from exporter.verify.diagnosis.probe import DebugGraph
from exporter.verify.inputs import PREFILL_BATCH, ParitySettings
from exporter.verify.references.golden.recording import RecordedReference

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DebugGraphs:
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


def localise(
    prefill,
    decode,
    reference: RecordedReference,
    debug: DebugGraphs,
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


def probes_between(
    debug: DebugGraphs, values: dict, manifest: Manifest, overrides: Overrides, batch: dict
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
