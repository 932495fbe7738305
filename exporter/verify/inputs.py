"""Seeded inputs that real generation produces: left-padded batches, position ids that skip the
padding, labels with ignored targets, token chunks for decode steps, and the shape sweep grid; and a text's
windows, which the quality check of a quantized artifact reads in their place (QualityText)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from exporter.artifact.manifest import Manifest
from exporter.artifact.paths import read_text_file, shown_path
from exporter.artifact.tokenizer import TOKENIZER, load_tokenizer
from exporter.errors import InputError, check_flag, is_integer
from exporter.runtime.runner import position_ids_from_mask

SWEEP_BATCHES = (1, 2, 3)
SWEEP_NEW_TOKENS = (1, 2, 7, 64)
SWEEP_PASTS = (0, 1, 17)
GREEDY_PROMPT_LENGTH = 8
FINAL_CHUNK = 3  # the decode check ends with one multi-token step
PREFILL_BATCH = "the prefill batch"  # how reports name prompt_batch's call: what a check on it alone covers


@dataclass(frozen=True)
class ParitySettings:
    batch: int = 2
    prompt_length: int = 12
    left_padding: int = 3  # on the first row of the batch
    decode_steps: int = 64  # single-token steps, followed by one 3-token chunk
    greedy_tokens: int = 32
    seed: int = 0
    sweep: bool = True  # the batch x new tokens x past grid, with ragged left padding
    long_context: bool = True  # positions where the math changes, and a real long cache (checks/long_context.py)
    probe: bool = False  # node-level localisation with debug copies of prefill.onnx and decode.onnx

    def __post_init__(self):
        # of the wrong type, a field would fail deep in the run (a str's '<', numpy's refusal of a negative seed)
        for name in ("batch", "prompt_length", "left_padding", "decode_steps", "greedy_tokens", "seed"):
            value = getattr(self, name)
            if not is_integer(value) or (name == "seed" and value < 0):
                raise InputError(
                    f"ParitySettings.{name} must be an integer{' >= 0' * (name == 'seed')}, got "
                    f"{value!r} ({type(value).__name__})"
                )
        for name in ("sweep", "long_context", "probe"):
            check_flag(f"ParitySettings.{name}", getattr(self, name))
        if self.decode_steps < 1 or self.greedy_tokens < 1:
            raise InputError(
                f"decode_steps and greedy_tokens must be >= 1, got {self.decode_steps} and {self.greedy_tokens}"
            )
        if not 0 <= self.left_padding < self.prompt_length or self.batch < 1:
            raise InputError(
                f"left_padding must lie in [0, prompt_length) and batch >= 1; got batch {self.batch}, "
                f"prompt_length {self.prompt_length}, left_padding {self.left_padding}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    def fit(self, context: int) -> ParitySettings:
        """These settings with the decode steps and greedy tokens shortened to the model's positions (a
        small teaching GPT has 64); the report's settings show what ran."""
        steps = min(self.decode_steps, context - self.prompt_length - FINAL_CHUNK)
        greedy = min(self.greedy_tokens, context - GREEDY_PROMPT_LENGTH)
        if steps < 1 or greedy < 1:
            raise InputError(
                f"the model has only {context} positions: too few for a {self.prompt_length}-token "
                f"prompt and {FINAL_CHUNK + 1} decode tokens (ParitySettings.prompt_length "
                "can be lowered through the Python API)"
            )
        return dataclasses.replace(self, decode_steps=steps, greedy_tokens=greedy)


def prompt_batch(
    manifest: Manifest, settings: ParitySettings, rng: np.random.Generator, ids: np.ndarray | None = None
) -> dict:
    """A left-padded batch with labels holding -100 on padding, on each row's first real token and on a few
    other real tokens; its ids drawn from `rng`, or `ids` (batch, prompt_length) when given (a text's).

    The loss predicts token t from position t - 1, so the first real token of a padded row would be
    predicted from a padded position, whose output verification does not judge (nothing reads it); the
    first token of an unpadded row is never a target anyway."""
    b, t = settings.batch, settings.prompt_length
    if ids is None:
        input_ids = rng.integers(0, manifest.config.vocab_size, (b, t), dtype=np.int64)
    else:
        input_ids = np.asarray(ids, dtype=np.int64).reshape(b, t)
    mask = np.ones((b, t), dtype=np.int64)
    mask[0, : settings.left_padding] = 0
    predicted_from_real = np.pad(mask[:, :-1], ((0, 0), (1, 0))) == 1
    labels = np.where((mask == 1) & predicted_from_real, input_ids, -100)
    labels[:, -2] = -100
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": position_ids_from_mask(mask),
        "labels": labels,
    }


def prefill_feeds(manifest: Manifest, batch: dict) -> dict:
    return {name: batch[name] for name in manifest.prefill.input_names}


def next_tokens(
    manifest: Manifest, mask: np.ndarray, length: int, rng: np.random.Generator, ids: np.ndarray | None = None
) -> tuple[dict, np.ndarray]:
    """Feeds of `length` new tokens on top of a cache covering `mask`.

    Args:
        manifest: the artifact's manifest, whose vocabulary the ids are drawn from.
        mask: (B, L), the attention mask the cache covers.
        length: how many new tokens per row.
        rng: the generator the new ids are drawn from.
        ids: (B, length) the new ids, in place of drawn ones (a text's continuation); None: drawn.

    Returns:
        The feeds (input_ids, attention_mask, position_ids), and the mask extended by the new tokens.
    """
    if ids is None:
        tokens = rng.integers(0, manifest.config.vocab_size, (mask.shape[0], length), dtype=np.int64)
    else:
        tokens = np.asarray(ids, dtype=np.int64).reshape(mask.shape[0], length)
    mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
    return {
        "input_ids": tokens,
        "attention_mask": mask,
        "position_ids": position_ids_from_mask(mask, mask.shape[1] - length),
    }, mask


def text_windows(ids, rows: int, length: int) -> np.ndarray:
    """(rows, length): `rows` windows of `length` consecutive ids of a tokenized text, spread evenly over it.

    Raises:
        InputError: the text has fewer than `length` ids.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(ids) < length:
        raise InputError(
            f"the text gives {len(ids)} tokens, fewer than the {length} each row of the run reads (prompt, decode "
            "steps and the final chunk); give a longer text or fewer decode steps (`decode_steps`)"
        )
    starts = np.linspace(0, len(ids) - length, rows).astype(np.int64)
    return np.stack([ids[s : s + length] for s in starts])


def windows_covering(tokens: int, length: int, fewest: int = 1) -> int:
    """How many windows of `length` ids text_windows spreads over a text of `tokens` ids for them to cover every id:
    one per `length` ids, rounded up (at least `fewest`). Spread evenly, consecutive windows then start at most
    `length` ids apart."""
    return max(fewest, -(-tokens // length))


def window_length(settings: ParitySettings) -> int:
    """The ids each row of the quality check reads from a text: the prompt, the decode steps and the final chunk."""
    return settings.prompt_length + settings.decode_steps + FINAL_CHUNK


@dataclass(frozen=True)
class QualityText:
    """A tokenized text that the quality check of a quantized artifact reads in place of random ids.

    source: where the ids came from, as the reports name it (the file as given); ids: the text's token ids.
    """

    source: str
    ids: np.ndarray = field(compare=False, repr=False)

    def to_dict(self) -> dict:
        return {"source": self.source, "tokens": int(len(self.ids))}


def check_quantized(manifest: Manifest, folder: Path) -> None:
    """InputError unless the graph at `folder` is quantized: a text feeds a quantized graph's quality check; a float
    one is judged by parity, on random ids."""
    if manifest.quantization is None:
        raise InputError(
            f"`quality_text` feeds the quality check of a quantized artifact; {folder} is {manifest.precision}, judged "
            "by parity with its reference on seeded random ids: drop `quality_text`"
        )


def check_quality_text(text: QualityText, manifest: Manifest, folder: Path, settings: ParitySettings) -> None:
    """InputError unless `text` can feed the quality check of the artifact at `folder`: a quantized artifact (a
    float one is judged by parity, on random ids), and at least one window of ids for `settings` fitted to the
    model's positions."""
    check_quantized(manifest, folder)
    settings = settings.fit(manifest.config.max_position_embeddings)
    length = window_length(settings)
    if len(text.ids) < length:
        raise InputError(
            f"`quality_text` {text.source} gives {len(text.ids)} tokens, fewer than the {length} each of the "
            f"{settings.batch} windows reads (a {settings.prompt_length}-token prompt, {settings.decode_steps} decode "
            f"steps and a {FINAL_CHUNK}-token chunk); give a longer text or fewer decode steps (`decode_steps`)"
        )


def read_quality_text(path, manifest: Manifest, folder: Path, settings: ParitySettings) -> QualityText:
    """A UTF-8 text file tokenized with the artifact's tokenizer.json, checked to feed its quality check
    (check_quality_text).

    Args:
        path: the text file.
        manifest: the artifact's manifest.
        folder: the artifact's folder, which holds the tokenizer.json its manifest lists.
        settings: the verification's settings, whose prompt and decode steps each window reads.

    Raises:
        InputError: a float artifact, one without a tokenizer, a file that cannot be read or is not UTF-8, a text
            too short for one window.
        TokenizerError: the artifact's tokenizer.json cannot be read or does not fit the model.
    """
    check_quantized(manifest, folder)
    if TOKENIZER not in manifest.files:
        raise InputError(
            f"`quality_text` is tokenized with the artifact's {TOKENIZER}, and {folder} has none; export it with a "
            "tokenizer (`tokenizer`), or verify without `quality_text`"
        )
    return tokenize_quality_text(path, Path(folder) / TOKENIZER, manifest, folder, settings)


def tokenize_quality_text(
    path, tokenizer: Path, manifest: Manifest, folder: Path, settings: ParitySettings
) -> QualityText:
    """A UTF-8 text file tokenized with `tokenizer` (a tokenizer.json), checked to feed the quality check of the graph
    at `folder` (check_quality_text): read_quality_text's reading, for a caller that finds the tokenizer itself and
    has refused a float graph first (check_quantized).

    Raises:
        InputError: a float graph, a file that cannot be read or is not UTF-8, a text too short for one window.
        TokenizerError: the tokenizer cannot be read or does not fit the model's vocabulary.
    """
    source = shown_path(path)
    text = read_text_file(path, "quality_text")
    loaded = load_tokenizer(tokenizer, manifest.config.vocab_size)
    quality_text = QualityText(source, np.asarray(loaded.encode(text).ids, dtype=np.int64))
    check_quality_text(quality_text, manifest, folder, settings)
    return quality_text


def greedy_prompt(manifest: Manifest, rng: np.random.Generator) -> list[int]:
    return [int(i) for i in rng.integers(0, manifest.config.vocab_size, GREEDY_PROMPT_LENGTH)]


def sweep_grid(context: int) -> list[tuple[int, int, int]]:
    """(batch, new tokens, past) of the grid whose sequences fit the model's positions."""
    return [
        (b, n, p) for b, n, p in itertools.product(SWEEP_BATCHES, SWEEP_NEW_TOKENS, SWEEP_PASTS) if n + p <= context
    ]


def ragged_mask(batch: int, past: int, new: int) -> np.ndarray:
    """Row r is left-padded by r/batch of the first segment (the past, or the new tokens when there is no
    past), keeping at least one real token in it: rows of different real lengths in one batch."""
    first = past if past else new
    mask = np.ones((batch, past + new), dtype=np.int64)
    for row in range(batch):
        mask[row, : row * (first - 1) // batch] = 0
    return mask
