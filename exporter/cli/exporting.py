"""The export as `export` and `run` ask for it: the model and its source from --preset/--checkpoint/--config, the
artifact folder, the export itself."""

from __future__ import annotations

from pathlib import Path

import click

from exporter.artifact.paths import read_json_object
from exporter.cli.options import DEFAULT_ROOT, ExportOptions
from exporter.errors import EXPORT_EXTRA, ToolkitError, export_extra_error
from reference import DEFAULT_PRESET, get_preset


def _model_and_source(preset, seed, checkpoint, config_path, with_tokenizer=False):
    """The model to export, with the manifest's record of where its weights came from (a SourcedModel), and with
    `with_tokenizer` the tokenizer a checkpoint brings."""
    from reference.source import checkpoint_model, seeded_model

    if checkpoint is None:
        if config_path is not None:
            raise ToolkitError("--config describes a --checkpoint's model; for seeded weights choose a --preset")
        return seeded_model(preset or DEFAULT_PRESET, seed)
    context = click.get_current_context(silent=True)
    if context is not None and context.get_parameter_source("seed") == click.core.ParameterSource.COMMANDLINE:
        raise ToolkitError("--seed seeds generated weights; a --checkpoint brings its own: drop --seed")
    if preset is not None and config_path is not None:
        raise ToolkitError("give --preset or --config for a checkpoint, not both")
    data = (
        None
        if config_path is None
        else read_json_object(config_path, ToolkitError, "--config", "pass a JSON object of config fields")
    )
    return checkpoint_model(checkpoint, preset, config_data=data, with_tokenizer=with_tokenizer)


def planned_artifact(preset, seed, checkpoint, dtype) -> tuple:
    """(dtype, config, weights source) of the artifact `run` is about to export, what --fp16-companion is held
    to before the export; a checkpoint's config and source are known only once it has been read (None)."""
    from reference.source import seeded_source

    if checkpoint is not None:
        return dtype, None, None
    preset = preset or DEFAULT_PRESET
    return dtype, get_preset(preset), seeded_source(preset, seed)


def output_folder(output, preset, checkpoint, dtype, activations=None) -> Path:
    """-o, or artifacts/<checkpoint name, or preset>[-<dtype>][-<activations>]: two checkpoints fitting one preset
    get folders of their own, and an int4 export for CUDA (float16 activations) does not replace one for the CPU."""
    if output is not None:
        return output
    if checkpoint is None:
        name = preset or DEFAULT_PRESET
    else:  # resolved: `--checkpoint .` is named after the current folder; a folder keeps its dots (MiniMind2-v1.5)
        resolved = Path(checkpoint).resolve()
        name = resolved.name if resolved.is_dir() else resolved.stem
        if not name:
            raise ToolkitError(
                f"--checkpoint {checkpoint} has no name to call the artifact folder after; pass --output DIR"
            )
    name = name.lower()
    suffixes = [d for d in (dtype, activations) if d not in (None, "float32")]
    return DEFAULT_ROOT / "-".join([name, *suffixes])


def export_folder(to_export: ExportOptions) -> Path:
    """The folder the export writes: output_folder of the options."""
    return output_folder(
        to_export.output, to_export.preset, to_export.checkpoint, to_export.dtype, to_export.activations
    )


def _require_export_extra() -> None:
    """An export needs the `export` extra (PyTorch, torch.onnx's onnxscript, onnx-ir, safetensors); the base install
    holds only what inspect, generate and a golden replay need."""
    missing = export_extra_error()
    if missing is not None:
        raise ToolkitError(
            "exporting needs the export extra (PyTorch, onnxscript, onnx-ir, safetensors), which does not import "
            f"here ({missing}); install it: {EXPORT_EXTRA}"
        )


def _quality_target(dtype, quality_target, calibration_text):
    """(QualityTarget, text path) of --quality-target and --calibration-text, or None where no target is given;
    UsageError for a target without a text or a float --dtype, InputError for a target of bad syntax."""
    from exporter.artifact.quantization import SCHEMES, parse_quality_target

    if quality_target is None:
        return None
    if calibration_text is None:
        raise click.UsageError("--quality-target needs --calibration-text: give both")
    if dtype not in SCHEMES:
        raise click.UsageError(f"--quality-target applies to --dtype int4 or int8, not {dtype}")
    return parse_quality_target(quality_target), calibration_text


def _smoothing(value: str | None) -> float | str | None:
    """--smoothing as QuantizationSettings takes it: None, "none", or the migration strength as a number."""
    from exporter.artifact.quantization import NO_SMOOTHING

    if value is None or value == NO_SMOOTHING:
        return value
    try:
        return float(value)
    except ValueError:
        raise click.UsageError(f"--smoothing {value!r} is neither a number in (0, 1] nor {NO_SMOOTHING}") from None


def export_as_asked(to_export: ExportOptions, target: tuple = (None, None)) -> tuple:
    """Export as the command line says: --tokenizer, else the checkpoint's own unless --no-tokenizer; to a quality
    target where `target` (--quality-target, --calibration-text) gives one.

    Returns:
        (the model exported, export_artifact's result).
    """
    if to_export.tokenizer is not None and to_export.no_tokenizer:
        raise click.UsageError("give --tokenizer or --no-tokenizer, not both")
    from exporter.artifact.quantization import NO_SMOOTHING, smoothing_applies

    to_target = _quality_target(to_export.dtype, *target)
    smooths = smoothing_applies(to_export.dtype, to_export.accuracy_level) and to_export.smoothing != NO_SMOOTHING
    if to_target is None and target[1] is not None and not smooths:
        raise click.UsageError(
            "--calibration-text applies with --quality-target, or to an int8 export that smooths its projections' "
            "inputs (--dtype int8 at accuracy level 4, without --smoothing none)"
        )
    _require_export_extra()
    from exporter.artifact.destination import check_destination
    from exporter.artifact.quantization import QuantizationSettings
    from exporter.export.pipeline import export_artifact  # torch.onnx is slow to import; keep --help fast

    folder = export_folder(to_export)
    check_destination(folder)  # cheap: before a --checkpoint (gigabytes, perhaps inside the folder) is read
    with_tokenizer = to_export.tokenizer is None and not to_export.no_tokenizer
    sourced = _model_and_source(
        to_export.preset, to_export.seed, to_export.checkpoint, to_export.config_path, with_tokenizer
    )
    quantization = QuantizationSettings(
        to_export.block_size,
        to_export.accuracy_level,
        to_export.lm_head,
        to_export.embedding,
        to_export.activations,
        algorithm=to_export.quant_algorithm,
        smoothing=_smoothing(to_export.smoothing),
    )
    tokenizer = to_export.tokenizer if to_export.tokenizer is not None else sourced.tokenizer
    if to_target is not None:
        from exporter.tuning.search import export_to_target

        made = export_to_target(
            sourced.model,
            folder,
            to_export.dtype,
            *to_target,
            sourced.source,
            tokenizer,
            quantization=quantization,
            with_loss=not to_export.no_loss,
            trace_all_layers=to_export.trace_all_layers,
        )
        return sourced.model, made.export
    return sourced.model, export_artifact(
        sourced.model,
        folder,
        dtype=to_export.dtype,
        with_loss=not to_export.no_loss,
        source=sourced.source,
        tokenizer=tokenizer,
        quantization=quantization,
        calibration=target[1],
        trace_all_layers=to_export.trace_all_layers,
    )
