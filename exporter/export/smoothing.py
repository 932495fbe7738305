"""The smoothing of an int8 export's projection inputs (exporter.artifact.quantization, the comment at
SMOOTHING_BITS): each input channel's largest magnitude, measured in PyTorch on calibration token ids, and the
divisors made of it.

The calibration ids come from a text tokenized with the export's tokenizer (the caller's, or else this package's
calibration.txt: about 5 kB of varied English prose, dialogue, figures, code and a few other languages), or from
seeded random ids where the export has no tokenizer. The outlier channels smoothing is for are the model's own, seen
on any input; a text shows them as the model's users meet them. The divisor of channel j is

    s_j = max|x_j|^alpha / max_i |W_ij|^(1 - alpha)

each maximum floored at 1e-5 of its largest, so that a channel silent on the calibration ids gets a finite divisor,
and the divisors divided by their geometric mean (x / s and s · W compute the same for any common factor of s; the
mean keeps both in their original range).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from exporter.artifact.paths import read_text_file
from exporter.errors import InputError

BUILT_IN_TEXT = Path(__file__).with_name("calibration.txt")
WINDOW = 128  # tokens per calibration window
MAX_WINDOWS = 32  # a longer text is read up to this many windows
RANDOM_WINDOWS = 8  # of seeded random ids, where the export has no tokenizer
ROWS_PER_CALL = 4
FLOOR = 1e-5  # a maximum's floor, relative to the largest of its kind


@dataclass(frozen=True)
class Calibration:
    """Calibration token ids, (W, L) windows, and what they are (for the manifest)."""

    rows: np.ndarray
    source: str


def calibration_rows(tokenizer, text: Path | None, vocab_size: int, max_positions: int) -> Calibration:
    """The calibration windows: `text` (a UTF-8 file), else the built-in text, tokenized with `tokenizer` (a
    TokenizerSource); without one, seeded random ids below `vocab_size`. InputError when `text` is given without a
    tokenizer, or gives less than one window."""
    window = min(WINDOW, max_positions)
    if tokenizer is None:
        if text is not None:
            raise InputError(
                "`calibration_text` is tokenized with the export's tokenizer, and none is given: pass `tokenizer`"
            )
        rows = np.random.default_rng(0).integers(0, vocab_size, (RANDOM_WINDOWS, window), dtype=np.int64)
        return Calibration(rows, f"{RANDOM_WINDOWS} windows of {window} seeded random token ids (no tokenizer)")
    path = BUILT_IN_TEXT if text is None else Path(text)
    ids = np.asarray(tokenizer.loaded.encode(read_text_file(path, "calibration_text")).ids, np.int64)
    windows = min(MAX_WINDOWS, len(ids) // window)
    if windows == 0:
        raise InputError(
            f"`calibration_text` {text} gives {len(ids)} tokens, less than one window of {window}: give a longer text"
        )
    shown = "the built-in calibration text" if text is None else str(text)
    rows = ids[: windows * window].reshape(windows, window)
    return Calibration(rows, f"{windows} windows of {window} tokens of {shown}")


def measured_divisors(
    model: torch.nn.Module, modules: list[str], calibration: Calibration, alpha: float
) -> dict[str, np.ndarray]:
    """By module of `modules` (Linear), the divisors of its input's channels measured on `calibration`; a module the
    calibration never reaches (a MoE expert no token was routed to) gets divisors of 1, leaving it as it was."""
    divisors = smoothing_divisors(model, input_maxima(model, modules, calibration.rows), alpha)
    for name in modules:
        if name not in divisors:
            divisors[name] = np.ones(model.get_submodule(name).in_features)
    return divisors


def input_maxima(model: torch.nn.Module, modules: list[str], rows: np.ndarray) -> dict[str, np.ndarray]:
    """By Linear module name, the largest magnitude of each of its input channels over every position of `rows`,
    the model run as a prefill of each window, float64."""
    maxima: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_module, args):
            seen = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).double()
            maxima[name] = seen if name not in maxima else torch.maximum(maxima[name], seen)

        return record

    handles = [model.get_submodule(name).register_forward_pre_hook(hook(name)) for name in modules]
    try:
        with torch.no_grad():
            for start in range(0, len(rows), ROWS_PER_CALL):
                ids = torch.from_numpy(np.ascontiguousarray(rows[start : start + ROWS_PER_CALL]))
                model(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    position_ids=torch.arange(ids.shape[1]).expand(ids.shape),
                    use_cache=True,
                )
    finally:
        for handle in handles:
            handle.remove()
    return {name: maxima[name].numpy() for name in modules if name in maxima}


def smoothing_divisors(model: torch.nn.Module, maxima: dict[str, np.ndarray], alpha: float) -> dict[str, np.ndarray]:
    """By module, the divisors of its input's channels (the module's docstring), float64."""
    found = {}
    for name, seen in maxima.items():
        weight = model.get_submodule(name).weight.detach().abs().double().amax(0).numpy()
        activation = np.maximum(seen, FLOOR * seen.max())
        weight = np.maximum(weight, FLOOR * weight.max())
        divisors = activation**alpha / weight ** (1 - alpha)
        found[name] = divisors / np.exp(np.log(divisors).mean())
    return found
