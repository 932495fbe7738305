"""Pre-export checks: what an export refuses before it traces anything, and the smoke run of what it wrote.

Before tracing: export_artifact's own arguments, the source record, the weights (finite in the export's dtype) and
the model's eager forward against the contract (reference/byo.py), each of which would otherwise fail only after the
exports, or name neither the field nor the fix. After writing: both graphs run in onnxruntime at sizes other than
the tracing example, judged by the parity profile of the export's dtype (exporter.tolerances).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import torch

from exporter.artifact.contract import cache_layout
from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import Manifest, source_problem
from exporter.errors import ExportFailed, GraphRunError, InputError, check_flag, first_line
from exporter.runtime.runner import OrtRunner, position_ids_from_mask
from exporter.runtime.settings import checking_settings
from exporter.tolerances.parity import profile_for
from reference.source import SourcedModel


def smoke_run(folder: Path, manifest: Manifest) -> None:
    """Run both graphs at sizes other than the tracing example, including 1-token and past-0 cases."""
    # The files just written, not hashed again; unprepacked whatever the precision, so that both sessions read the
    # one mapping of the weights (a prepacked decode.onnx holds a copy of its own, beside the model the export
    # still holds).
    settings = dataclasses.replace(checking_settings(manifest), prepack_weights=False)
    runner = OrtRunner(Artifact(folder, manifest), "cpu", settings=settings)
    tolerance = profile_for(manifest.dtype).logits
    vocab = manifest.config.vocab_size
    rng = np.random.default_rng(0)
    for batch, length in ((1, 1), (3, min(5, manifest.config.max_position_embeddings))):
        ids = rng.integers(0, vocab, (batch, length), dtype=np.int64)
        mask = np.ones_like(ids)
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
        if manifest.with_loss:
            feeds["labels"] = ids
        out = runner.prefill(feeds)
        if out["logits"].shape != (batch, length, vocab):
            raise ExportFailed(
                f"smoke run: prefill gave logits of shape {out['logits'].shape} for batch {batch}, "
                f"length {length}; expected {(batch, length, vocab)}"
            )
        if not np.isfinite(out["logits"]).all():
            # the weights were finite in this dtype (check_finite_weights): the activations overflowed
            fix = "check the checkpoint, or export float32" if manifest.dtype == "float16" else "check the checkpoint"
            raise ExportFailed(
                f"smoke run: prefill gave non-finite logits (NaN or Inf) for batch {batch}, length "
                f"{length}: the activations overflow {manifest.dtype}; {fix}"
            )
        decode_feeds = {
            "input_ids": ids[:, :1],
            "attention_mask": np.ones((batch, 1), np.int64),
            "position_ids": np.zeros((batch, 1), np.int64),
            **runner.empty_past(batch),
        }
        step = runner.decode(decode_feeds)
        # The verification's own rule for this pair (its "decode(past 0) == prefill" invariant): a fixed
        # 1e-3 would sit below float16's resolution (an ulp is 7.8e-3 at logits of 8) and fail a correct export.
        first, expected = step["logits"][:, 0].astype(np.float32), out["logits"][:, 0].astype(np.float32)
        if not np.all(np.abs(first - expected) <= tolerance.allowed(expected)):
            raise ExportFailed(
                "smoke run: decode with past length 0 disagrees with prefill on the first token "
                f"(max abs {np.abs(first - expected).max():.3g})"
            )
    # The last position the manifest promises: a learned position table or a precomputed RoPE table
    # shorter than max_position_embeddings exports fine at the example's positions and fails only there.
    last = manifest.config.max_position_embeddings - 1
    feeds = {
        "input_ids": np.zeros((1, 1), np.int64),
        "attention_mask": np.ones((1, 1), np.int64),
        "position_ids": np.full((1, 1), last, np.int64),
        **runner.empty_past(1),
    }
    try:
        logits = runner.decode(feeds)["logits"]
    except GraphRunError as exc:
        raise ExportFailed(
            f"smoke run: the graphs fail at position {last}, the last of max_position_embeddings "
            f"{last + 1} ({exc.detail}); set max_position_embeddings to the positions the model "
            "has"
        ) from exc
    if not np.isfinite(logits).all():
        raise ExportFailed(
            f"smoke run: decode gave non-finite logits at position {last}, the last of "
            f"max_position_embeddings {last + 1}; set it to the positions the model has"
        )


def check_forward(model: torch.nn.Module, config, args, with_loss: bool, dtype: str) -> None:
    """One eager prefill of the tracing example and one cached step after it, their outputs held to the
    config's sizes. A wrong layer count or cache layout otherwise surfaces from the graph lint as outputs out
    of place ("loss has rank 4", "unexpected input/output div_2"), which names neither the field nor the fix;
    a present without the past, as an axis-name clash after both traces; a forward giving no loss for labels,
    as a KeyError when verifying the export's loss against it. Then the prefill again on an empty cache
    (_check_empty_past): prefill.onnx is cut from the cached program."""
    from reference.byo import output_problems

    input_ids, attention_mask, position_ids = args[:3]
    labels = args[3] if with_loss else None
    try:
        prompt = out = model(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, labels=labels
        )
    except Exception as exc:  # the user's own forward: any type
        raise ExportFailed(
            f"the model's forward failed on a {tuple(input_ids.shape)} example: {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    problems = output_problems(out, config, *input_ids.shape, with_loss)
    if not problems:  # one cached step on that prefill's present: the decode graph's forward
        batch, length = input_ids.shape
        try:
            out = model(
                input_ids[:, -1:],
                attention_mask=torch.ones(batch, length + 1, dtype=attention_mask.dtype),
                position_ids=position_ids[:, -1:] + 1,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        except Exception as exc:
            raise ExportFailed(
                f"the model's forward failed on one cached step after a {tuple(input_ids.shape)} "
                f"example: {type(exc).__name__}: {first_line(exc)}"
            ) from exc
        problems = output_problems(out, config, batch, 1, past_length=length)
    if problems:
        raise ExportFailed(f"the model's forward breaks the contract (reference/byo.py): {'; '.join(problems)}")
    _check_empty_past(model, config, args, prompt, dtype)


def _check_empty_past(model: torch.nn.Module, config, args, prompt, dtype: str) -> None:
    """The prompt's logits on an empty cache (past length 0, in the dtype of the cache the forward returned)
    against `prompt`'s, the forward's without a cache: prefill.onnx computes the former. The two run the same
    products, the cached one concatenating empty tensors, so they differ by the dtype's rounding at most, which the
    parity profile's logits bound (the verification's own rule for decode with past 0 against prefill); a model
    that treats an empty cache otherwise (another mask, another position offset) differs at the logits' own
    scale."""
    input_ids, attention_mask, position_ids = args[:3]
    cache = cache_layout(config, "")
    kept = prompt.past_key_values[0][0].dtype
    empty = torch.zeros(input_ids.shape[0], 0, cache.num_key_value_heads, cache.head_dim, dtype=kept)
    try:
        out = model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=[(empty, empty) for _ in range(cache.num_layers)],
            use_cache=True,
        )
    except Exception as exc:
        raise ExportFailed(
            f"the model's forward failed on an empty cache (past length 0): {type(exc).__name__}: {first_line(exc)}; "
            "prefill.onnx computes the prompt on one, so the forward must accept it (reference/byo.py)"
        ) from exc
    expected = prompt.logits.float().numpy()
    difference = np.abs(out.logits.float().numpy() - expected)
    if not np.all(difference <= profile_for(dtype).logits.allowed(expected)):
        raise ExportFailed(
            f"the model's forward on an empty cache (past length 0) gives other logits than without a cache "
            f"(max abs difference {difference.max():.3g}); prefill.onnx computes the prompt on one, so the forward "
            "must treat an empty cache as none (reference/byo.py)"
        )


def check_source(source) -> None:
    """The source as manifest.json must record it: readable back (the reader's own rule) and JSON."""
    problem = source_problem(source)
    if problem is None:
        try:
            json.dumps(source)
        except (TypeError, ValueError) as exc:  # a Path: the export would fail after all its work
            problem = f"model.source cannot be written as JSON ({exc})"
    if problem:
        raise InputError(
            f'source is {source!r:.80}: {problem}; pass a dict of JSON values with a "kind", e.g. '
            '{"kind": "custom", "model": "my-decoder"}'
        )


def check_arguments(model, folder, with_loss) -> None:
    """export_artifact's own arguments, refused here rather than left to fail as AttributeError or pathlib's
    TypeError, or to read "no" as True."""
    if isinstance(model, SourcedModel):
        raise InputError(
            "model is a SourcedModel (what seeded_model and checkpoint_model return); pass its model and "
            "its source: export_artifact(sourced.model, folder, source=sourced.source)"
        )
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise InputError(
            f"model must be a reference model or a reference.byo adapter (a torch.nn.Module with a "
            f".config), got {type(model).__name__}; build one with reference.source.seeded_model"
            "(preset).model or checkpoint_model(path).model"
        )
    if not isinstance(folder, (str, os.PathLike)):
        raise InputError(f"folder must be a path (str or Path), got {folder!r:.80} (`folder`)")
    check_flag("with_loss", with_loss)


def check_finite_weights(model: torch.nn.Module, exported: torch.nn.Module, dtype: str) -> None:
    """InputError naming the first weight that holds NaN or Inf in `model`, or that `exported` (its copy in the
    export's dtype) holds beyond that dtype's range: the graphs would compute NaN, which only the smoke run after
    both exports would find. Parameters only: a buffer may hold -inf by design (a causal mask)."""
    originals = dict(model.named_parameters())
    for name, weight in exported.named_parameters():
        if not weight.is_floating_point() or bool(torch.isfinite(weight).all()):
            continue
        original = originals.get(name, weight)
        if original.dtype != weight.dtype and bool(torch.isfinite(original).all()):
            limit = torch.finfo(weight.dtype).max
            raise InputError(
                f"weight {name} holds values beyond {dtype}'s range (|x| > {limit:g}), which become Inf in a "
                f'{dtype} export; export float32 (`dtype="float32"`), or scale the weights'
            )
        raise InputError(
            f"weight {name} holds NaN or Inf, which every output the graphs compute from it would hold; check "
            "the checkpoint (a diverged training run, or a damaged file)"
        )
