"""Token generation over the two graphs: greedy or sampled, batched, streamed.

The logits processing follows MiniMind's `generate`: divide by the
temperature, penalise every id already in the row (prompt included) by the
repetition penalty (a positive logit divided, a negative one multiplied), keep the top-k, keep the smallest set
whose probability reaches top-p, then sample (or take the argmax). Finished
rows keep receiving the eos id until every row is done, as upstream does.

Each row draws from a numpy generator of its own, seeded with the row's seed
(one seed for all rows, or one per row): a row samples the same tokens in
any batch as alone, and the same prompt twice in one batch needs two seeds to
give two different samples. Upstream draws for the whole batch from one
generator, so its rows depend on each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from exporter.errors import InputError, ToolkitError, is_integer
from exporter.runtime.runner import check_prompt, position_ids_from_mask
from reference.families import DecoderConfig

PAD_ID = 0  # any valid id; padded slots are masked out
# The smallest temperature and repetition penalty: logits divided by both stay finite in float32 (a smaller
# one, 1e-40 say, overflows them to inf, and the draw then falls outside the vocabulary); a temperature this
# small is the argmax in all but name.
MIN_DIVISOR = 1e-6
# The largest: both are applied in float32, where a larger one rounds to inf (and a seen logit of 0 times an
# infinite penalty is NaN, which would be blamed on the artifact).
MAX_DIVISOR = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | tuple[int, ...] = 0  # one seed for every row, or one per row

    def __post_init__(self):
        if not isinstance(self.do_sample, (bool, np.bool_)):  # a string such as "no" would read as true
            raise InputError(
                f"`do_sample` must be True or False, got {self.do_sample!r} ({type(self.do_sample).__name__})"
            )
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
                raise InputError(f"`{name}` must be a number, got {value!r}")
        if self.do_sample and not MIN_DIVISOR <= self.temperature <= MAX_DIVISOR:
            raise InputError(
                f"`temperature` must lie in [{MIN_DIVISOR:g}, {MAX_DIVISOR:.4g}] (finite "
                f"in float32) when sampling, got {self.temperature}; use greedy decoding for "
                "deterministic output"
            )
        if not 0 < self.top_p <= 1:
            raise InputError(f"`top_p` must lie in (0, 1], got {self.top_p}")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise InputError(f"`top_k` must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not MIN_DIVISOR <= self.repetition_penalty <= MAX_DIVISOR:
            raise InputError(
                f"`repetition_penalty` must lie in [{MIN_DIVISOR:g}, "
                f"{MAX_DIVISOR:.4g}] (finite in float32; 1 disables it), got {self.repetition_penalty}"
            )
        seeds = self.seed if isinstance(self.seed, (tuple, list)) else (self.seed,)
        if not seeds or not all(is_integer(s) and s >= 0 for s in seeds):
            raise InputError(f"`seed` must be an integer >= 0 or a tuple of them (one per row), got {self.seed!r}")

    def seeds(self, batch: int) -> list[int]:
        """One seed per row; a tuple must have one for each row."""
        if not isinstance(self.seed, (tuple, list)):
            return [self.seed] * batch
        if len(self.seed) != batch:
            raise InputError(
                f"{len(self.seed)} seeds for a batch of {batch} prompts; give one seed per row, "
                "or a single seed for all"
            )
        return list(self.seed)


def process_logits(logits: np.ndarray, seen: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """MiniMind's logits processing for one step. logits (B, V) float32; seen (B, V) bool."""
    logits = logits.astype(np.float32, copy=True)
    if config.do_sample:
        logits /= np.float32(config.temperature)
    if config.repetition_penalty != 1.0:
        # As upstream (jingyaogong/minimind dddedc6, "[fix] repetition_penalty"): a positive logit is divided,
        # a negative one multiplied, so a seen token always becomes less likely (dividing a negative raises it).
        penalty = np.float32(config.repetition_penalty)
        with np.errstate(over="ignore"):  # a seen negative logit times a huge penalty: -inf, never chosen
            logits = np.where(seen, np.where(logits > 0, logits / penalty, logits * penalty), logits)
    if config.top_k > 0 and config.top_k < logits.shape[-1]:
        kth = -np.partition(-logits, config.top_k - 1, axis=-1)[:, config.top_k - 1 : config.top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    if config.top_p < 1.0:
        order = np.argsort(-logits, axis=-1, kind="stable")
        sorted_logits = np.take_along_axis(logits, order, axis=-1)
        probs = _softmax(sorted_logits)
        drop = np.cumsum(probs, axis=-1) > config.top_p
        drop[:, 1:] = drop[:, :-1].copy()  # keep the token that crosses top_p
        drop[:, 0] = False
        removed = np.zeros_like(drop)
        np.put_along_axis(removed, order, drop, axis=-1)
        logits = np.where(removed, -np.inf, logits)
    return logits


def _softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):  # inf - inf where the top is +inf: those entries are the top
        shifted = np.exp(np.where(logits == top, 0.0, logits - top))
    return shifted / shifted.sum(axis=-1, keepdims=True)


class NonFiniteLogits(ToolkitError):
    """The model's logits hold a NaN: no token can be chosen (verify reports it as a greedy failure)."""

    reason = "the model's logits are not finite (NaN), so no token can be chosen"

    def __init__(self):
        super().__init__(f"{self.reason}; check the artifact with `export-onnx verify`")


def choose_tokens(logits: np.ndarray, config: SamplingConfig, rngs: list[np.random.Generator]) -> np.ndarray:
    if not config.do_sample:
        tokens = logits.argmax(axis=-1)
        # argmax takes a NaN for the largest: a row holding one chooses a NaN, found by reading B values, not B x V
        if np.isnan(logits[np.arange(len(tokens)), tokens]).any():
            raise NonFiniteLogits()
        return tokens
    cumulative = np.cumsum(_softmax(logits.astype(np.float64)), axis=-1)
    if not np.isfinite(cumulative[:, -1]).all():
        raise NonFiniteLogits()
    draws = [rng.random() * row[-1] for rng, row in zip(rngs, cumulative)]
    return np.array([np.searchsorted(row, u, side="right") for row, u in zip(cumulative, draws)])


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int] = field(default_factory=list)
    stopped: bool = False  # ended at eos or another stop id (included in new_ids), not at max_new_tokens

    def add(self, token: int | None, stops: set[int]) -> None:
        """One step's token of this row, as `stream` yields it (None: the row has stopped)."""
        if token is not None:
            self.new_ids.append(token)
            self.stopped = token in stops

    def to_dict(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "new_ids": self.new_ids, "stopped": self.stopped}


def left_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask), each (B, longest), prompts aligned to the right."""
    longest = max(len(p) for p in prompts)
    ids = np.full((len(prompts), longest), PAD_ID, dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = prompt
        mask[row, longest - len(prompt) :] = 1
    return ids, mask


def check_prompts(config, prompts, max_new_tokens: int) -> list[list[int]]:
    """A batch of prompts (a list of id lists, or a 2-D integer array) as lists of ints, each checked."""
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    elif isinstance(prompts, (str, bytes, np.ndarray)) or not isinstance(prompts, (list, tuple)):
        raise InputError(
            f"prompts must be a list of prompts (each a list of token ids) or a 2-D integer array, "
            f"got {type(prompts).__name__}"
        )
    if not prompts:
        raise InputError("no prompts given; pass at least one list of token ids")
    if is_integer(prompts[0]):
        raise InputError("prompts must be a list of prompts, got a list of ids; wrap one prompt as [[1, 2, 3]]")
    if len(prompts) == 1:
        return [check_prompt(config, prompts[0], max_new_tokens)]
    checked = []
    for row, prompt in enumerate(prompts):
        try:
            checked.append(check_prompt(config, prompt, max_new_tokens))
        except InputError as exc:
            raise InputError(f"prompt {row}: {exc}") from None
    return checked


def runner_config(runner) -> DecoderConfig:
    """The model config of a runner given to generate, stream or generate_greedy, which must be a runner:
    anything else (a folder, say) is refused as InputError naming what to pass, not left to fail inside the
    loop as an AttributeError."""
    if not all(hasattr(runner, name) for name in ("manifest", "start", "step")):
        raise InputError(
            f"runner must be an OrtRunner, got {runner!r:.80}; make one with OrtRunner(folder) "
            "(exporter.runtime.runner)"
        )
    return runner.manifest.config


def check_request(
    config, prompts, max_new_tokens: int, sampling: SamplingConfig, eos_token_id: int | None, stop_ids
) -> tuple[list[list[int]], set[int]]:
    """Everything a generation is given, checked before anything runs.

    Args:
        config: the model config (DecoderConfig) the prompts and ids are checked against.
        prompts: a list of prompts (each a list of token ids) or a 2-D integer array.
        max_new_tokens: how many tokens each row may add; prompt plus these must fit the model's positions.
        sampling: the SamplingConfig; a tuple seed needs one seed per prompt.
        eos_token_id: the id that stops a row, a token id of the vocabulary; None: only `stop_ids` stop.
        stop_ids: further ids that stop a row, a 1-D iterable of token ids of the vocabulary.

    Returns:
        The prompts as lists of ints, and the set of ids that stop a row.

    Raises:
        InputError: any of them is not what it must be.
    """
    if not isinstance(sampling, SamplingConfig):
        raise InputError(
            f"sampling must be a SamplingConfig, got {type(sampling).__name__}; "
            "write e.g. SamplingConfig(do_sample=True, top_p=0.9)"
        )
    prompts = check_prompts(config, prompts, max_new_tokens)
    sampling.seeds(len(prompts))
    if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__") or getattr(stop_ids, "ndim", 1) != 1:
        example = f"[{stop_ids}]" if is_integer(stop_ids) else "[2]"  # a lone id wrapped; anything else replaced
        raise InputError(
            f"stop_ids must be a list of token ids, got {stop_ids!r}; write e.g. stop_ids={example}, or () for none"
        )
    stop_ids = list(stop_ids)
    vocab = config.vocab_size
    bad_stops = [i for i in stop_ids if not is_integer(i) or not 0 <= i < vocab]
    if bad_stops:
        raise InputError(f"stop ids (`stop_ids`) {bad_stops} are not token ids of the vocabulary [0, {vocab})")
    if eos_token_id is not None and not (is_integer(eos_token_id) and 0 <= eos_token_id < vocab):
        raise InputError(
            f"eos_token_id {eos_token_id!r} is not a token id of the vocabulary [0, {vocab}); "
            "pass the model's eos id, or None to stop only at stop_ids"
        )
    return prompts, _stop_set(eos_token_id, stop_ids)


def stream(
    runner,
    prompts,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id: int | None = None,
    stop_ids=(),
) -> Iterator[list[int | None]]:
    """An iterator yielding, after every step, each row's new token (None once a row has stopped).

    Everything is checked here, before anything runs (check_request). Streams may interleave on one
    runner: each keeps its own cache.

    Args:
        runner: an OrtRunner (or anything with its start/step interface and `cache`).
        prompts: a list of prompts (each a list of token ids) or a 2-D integer array; rows are left-padded.
        max_new_tokens: the most steps to run; 0 yields nothing.
        sampling: greedy by default; a sampled row draws from a generator seeded with its own seed.
        eos_token_id: the id that stops a row (and is fed to finished rows while others run); None: only
            `stop_ids` stop.
        stop_ids: further ids that stop a row (the stopping id is yielded).

    Raises:
        InputError: an argument is refused (check_request).
        NonFiniteLogits: the model's logits hold a NaN, so no token can be chosen.
    """
    prompts, stops = check_request(runner_config(runner), prompts, max_new_tokens, sampling, eos_token_id, stop_ids)
    return _steps(runner, prompts, max_new_tokens, sampling, eos_token_id, stops)


def _stop_set(eos_token_id: int | None, stop_ids) -> set[int]:
    return set(stop_ids) | ({eos_token_id} if eos_token_id is not None else set())


def _processed(sampling: SamplingConfig) -> bool:
    """Whether the logits are processed before the choice: greedy choice is the argmax, which the temperature,
    top-k and top-p keep; only sampling or a repetition penalty can change it."""
    return sampling.do_sample or sampling.repetition_penalty != 1.0


def _grown_mask(prompt_mask: np.ndarray, steps: int) -> np.ndarray:
    """The attention mask of the prompt followed by `steps` real tokens."""
    mask = np.ones((prompt_mask.shape[0], prompt_mask.shape[1] + steps), dtype=np.int64)
    mask[:, : prompt_mask.shape[1]] = prompt_mask
    return mask


def _steps(runner, prompts, max_new_tokens, sampling, eos_token_id, stops) -> Iterator[list[int | None]]:
    """The generation loop. Its Python runs between decode steps that have just streamed every weight
    through the caches, so each numpy call here costs several times its warm cost, and a loop written
    plainly (a new mask each step, the positions as a cumulative sum over it) would spend several times a
    bare greedy loop's time between two steps. Hence the mask is one buffer sliced, the positions count up,
    and the repetition-penalty bookkeeping and the logits processing run only when they can change the
    choice."""
    if max_new_tokens == 0:
        return
    config = runner.manifest.config
    rngs = [np.random.default_rng(seed) for seed in sampling.seeds(len(prompts))]
    ids, prompt_mask = left_pad(prompts)
    batch, length = ids.shape
    processed = _processed(sampling)
    seen = np.zeros((batch, config.vocab_size), dtype=bool)
    for row, prompt in enumerate(prompts):
        seen[row, prompt] = True
    # The mask of every step, as one buffer: each new token is real, so its slot is 1. Sized by the steps run, doubled
    # as they need, not by max_new_tokens: a generation stopped early never holds what its limit would allow.
    mask = _grown_mask(prompt_mask, min(max_new_tokens, length))
    positions = position_ids_from_mask(prompt_mask)
    finished = [False] * batch
    # an OrtRunner's lock: threads generating on one runner take turns, each step on its own cache
    lock = getattr(runner, "lock", None) or contextlib.nullcontext()
    with lock:
        logits = runner.start(ids, prompt_mask, positions)
        cache = runner.cache
    positions = positions[:, -1:]
    rows = np.arange(batch)
    for step in range(max_new_tokens):
        tokens = choose_tokens(process_logits(logits, seen, sampling) if processed else logits, sampling, rngs)
        chosen = [
            eos_token_id if done and eos_token_id is not None else token
            for token, done in zip(tokens.tolist(), finished)
        ]
        yield [None if done else token for token, done in zip(chosen, finished)]
        if sampling.repetition_penalty != 1.0:
            seen[rows, chosen] = True
        finished = [done or token in stops for token, done in zip(chosen, finished)]
        if all(finished) or step == max_new_tokens - 1:
            return
        positions = positions + 1
        if length + step + 1 > mask.shape[1]:
            mask = _grown_mask(prompt_mask, min(max_new_tokens, 2 * (mask.shape[1] - length)))
        with lock:
            runner.cache = cache  # another stream on this runner may have run since this one's last step
            logits = runner.step(np.array(chosen, dtype=np.int64)[:, None], mask[:, : length + step + 1], positions)
            cache = runner.cache


def generate(
    runner,
    prompts,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_id: int | None = None,
    stop_ids=(),
) -> list[Generation]:
    """Generate to the end (as `stream` does) and collect each row's tokens.

    Args:
        runner: an OrtRunner (or anything with its start/step interface and `cache`).
        prompts: a list of prompts (each a list of token ids) or a 2-D integer array.
        max_new_tokens: the most tokens each row may add.
        sampling: greedy by default (SamplingConfig).
        eos_token_id: the id that stops a row; None: only `stop_ids` stop.
        stop_ids: further ids that stop a row.

    Returns:
        One Generation per prompt, in order; a stopping id is the last of its new_ids.
    """
    prompts, stops = check_request(runner_config(runner), prompts, max_new_tokens, sampling, eos_token_id, stop_ids)
    results = [Generation(prompt) for prompt in prompts]
    for tokens in _steps(runner, prompts, max_new_tokens, sampling, eos_token_id, stops):
        for result, token in zip(results, tokens):
            result.add(token, stops)
    return results


def generate_greedy(runner, prompt_ids, max_new_tokens: int, eos_token_id: int | None = None) -> Generation:
    """Greedy decoding of one prompt: the prompt through decode.onnx on an empty past (OrtRunner.start), then one
    token at a time feeding present back as past.

    Args:
        runner: an OrtRunner (or anything with its start/step interface and `cache`).
        prompt_ids: the prompt, a list of token ids.
        max_new_tokens: the most tokens to add.
        eos_token_id: the id that stops the generation (included in new_ids); None: it runs to max_new_tokens.
    """
    return generate(runner, [prompt_ids], max_new_tokens, eos_token_id=eos_token_id)[0]
