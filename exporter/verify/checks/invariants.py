"""Reference-free invariants, checked on the ONNX graphs alone (no torch).

They hold for any correct export whatever the weights, so they also run on an
artifact whose reference model is not available:
- prefill of a whole prompt equals prefill of its first k tokens followed by
  decode of the rest (the cache carries everything the rest needs);
- decode with an empty past equals prefill;
- a row of a left-padded batch equals the same sequence run alone;
- the two graphs carry identical weights, inline ones included;
- every axis the contract declares dynamic is symbolic in the saved graphs;
- a float32 export casts nothing to float16 or bfloat16.

The three numeric ones compare the graphs on the same weights in float32, so float32's rounding bounds their
differences. On a quantized artifact at MatMulNBits' accuracy level 4 that holds only where both graphs run each
MatMulNBits unprepacked (float_matmul_settings): see INT8_ACTIVATIONS_LEVEL.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from exporter.artifact.axes import lint_axes
from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import Manifest
from exporter.runtime.runner import position_ids_from_mask, presents_as_past
from exporter.runtime.settings import SessionSettings
from exporter.tolerances.parity import Profile
from exporter.verify.diagnosis.probe import FLOAT_TYPES
from exporter.verify.inputs import prefill_feeds
from exporter.verify.metrics import Comparison, compare_outputs, real_queries

# onnxruntime's CPU MatMulNBits at accuracy level 4 quantizes its float32 input A to int8 per block of `block_size`
# along K (symmetric, scale max|a|/127, round to nearest) and multiplies it with the quantized weights in integers, but
# only in its kernel for prepacked weights; a session that does not prepack (one that reads the weights file in place)
# dequantizes the weights and multiplies in float32, whatever the level. Every other level computes in float32 for
# float32 inputs. Measured (int4, block 32; minimind-3-tiny, the trained fixture, the minimind-3 preset): each
# MatMulNBits output equals Q8(A) @ W prepacked and A @ W unprepacked within float32 rounding, and the two differ with
# the RMS of uniform rounding, sqrt(sum over blocks of s^2/12 sum w^2) (measured 0.97-1.01x of it): 0.6-1.5% of a row's
# peak per node, 0.7-6% of the logits' peak after the last layer (0.05-0.7). An unprepacked graph (float32) against a
# prepacked one (int8 activations) thus differs by the activation quantization, 200-1800x the float32 profile; a bound
# that wide would pass decode-only faults such as every logit x1.001 (33x the float32 bound). Int8 activations on both
# sides bound nothing tighter: the rounding is discontinuous, so the float32 rounding differences of another batch shape
# flip single int8 codes by a whole step, and each flip spreads (a padded row against the same sequence alone,
# minimind-3 preset: one code differs at layer 2's down_proj input, 614 at layer 3's, the logits by 0.17). Unprepacked,
# both graphs compute A @ W in float32, continuous in A, so the float32 profile holds as for a float32 artifact (split
# and past 0 bit-identical on the three models, a padded row within 0.05x of the bound), and the float16 profile for
# float16 activations (continuous in A as well); the int8 arithmetic itself is judged by the quality profile.
INT8_ACTIVATIONS_LEVEL = 4
FLOAT_MATMUL_NOTE = "MatMulNBits unprepacked in both graphs, in float, not int8"


def float_matmul_settings(manifest: Manifest) -> SessionSettings | None:
    """The session settings the numeric invariants need on `manifest`'s artifact, where any runner's would not do:
    on a quantized artifact at accuracy level 4, both graphs unprepacked (INT8_ACTIVATIONS_LEVEL); else None."""
    quantization = manifest.quantization
    if quantization is None or INT8_ACTIVATIONS_LEVEL not in quantization.levels:
        return None
    return SessionSettings(prepack_weights=False)


def _sessions(manifest: Manifest, what: str) -> str:
    """`what`, naming how MatMulNBits ran where float_matmul_settings applies."""
    return f"{what}, {FLOAT_MATMUL_NOTE}" if float_matmul_settings(manifest) else what


@dataclass(frozen=True)
class Invariant:
    name: str
    passed: bool
    detail: str
    comparisons: tuple[Comparison, ...] = ()

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "passed": self.passed,
            "detail": self.detail,
            "comparisons": [c.to_dict() for c in self.comparisons],
        }


def _outcome(name: str, rows: list[Comparison], nonfinite: list[str], what: str) -> Invariant:
    if nonfinite:  # NaN equals NaN here: two broken runs would agree
        return Invariant(
            name,
            False,
            f"{what}: NaN or Inf in {', '.join(nonfinite[:4])}"
            f"{' ...' if len(nonfinite) > 4 else ''}, which no invariant can vouch for",
            tuple(rows),
        )
    worst = max(rows, key=lambda c: c.needed.scale)
    bitwise = all(c.max_abs == 0 for c in rows)
    detail = (
        f"{what}: {'bit-identical' if bitwise else f'max abs {max(c.max_abs for c in rows):.3g}'}"
        f" ({worst.needed.scale:.2g}x the tolerance at worst)"
    )
    return Invariant(name, all(c.passed for c in rows), detail, tuple(rows))


def _pair(
    label: str, actual: dict, expected: dict, profile: Profile, mask: np.ndarray
) -> tuple[list[Comparison], list[str]]:
    """compare_outputs of the two runs, and the outputs of either side holding NaN or Inf where it matters: at
    a real query's logits, or anywhere in a present (a later step weighs a padded key by zero, and 0 x NaN is
    NaN)."""
    names = ["logits", *(n for n in actual if n.startswith("present."))]
    queries = real_queries(mask, actual["logits"].shape[1])
    nonfinite = [
        n
        for n in names
        if not all(np.isfinite(side[n][queries] if n == "logits" else side[n]).all() for side in (actual, expected))
    ]
    return compare_outputs(label, actual, expected, profile, mask), nonfinite


def split_prefill(runner, manifest: Manifest, batch: dict, profile: Profile, k: int) -> Invariant:
    """The prefill of the whole batch against its first `k` tokens' prefill followed by a decode of the rest.

    Args:
        runner: the OrtRunner whose graphs are held to each other, with float_matmul_settings where they apply.
        manifest: the artifact's manifest.
        batch: the prompt batch (prompt_batch).
        profile: the tolerances that judge the difference.
        k: how many tokens the first prefill takes; past every row's padding, so each row has a real past token.
    """
    feeds = prefill_feeds(manifest, batch)
    whole = runner.prefill(feeds)
    head = runner.prefill({name: value[:, :k] for name, value in feeds.items()})
    mask = batch["attention_mask"]
    rest = runner.decode(
        {
            "input_ids": batch["input_ids"][:, k:],
            "attention_mask": mask,
            "position_ids": position_ids_from_mask(mask, k),
            **presents_as_past(manifest, head),
        }
    )
    tail = {"logits": whole["logits"][:, k:], **{n: whole[n] for n in rest if n != "logits"}}
    return _outcome(
        "prefill(all) == prefill(first k) + decode(rest)",
        *_pair("split", rest, tail, profile, mask),
        what=_sessions(manifest, f"k={k} of {mask.shape[1]} tokens"),
    )


def decode_past_zero(runner, manifest: Manifest, batch: dict, profile: Profile) -> Invariant:
    """decode.onnx on an empty past against prefill.onnx, on the same prompt batch.

    Args:
        runner: the OrtRunner whose graphs are held to each other, with float_matmul_settings where they apply.
        manifest: the artifact's manifest.
        batch: the prompt batch (prompt_batch).
        profile: the tolerances that judge the difference.
    """
    feeds = prefill_feeds(manifest, batch)
    prefill = runner.prefill(feeds)
    decode = runner.decode(
        {
            **{k: feeds[k] for k in ("input_ids", "attention_mask", "position_ids")},
            **runner.empty_past(len(batch["input_ids"])),
        }
    )
    return _outcome(
        "decode(past 0) == prefill",
        *_pair("past-0", decode, prefill, profile, batch["attention_mask"]),
        what=_sessions(manifest, "same prompt"),
    )


def padded_row_alone(runner, manifest: Manifest, batch: dict, profile: Profile) -> Invariant:
    """Row 0 of the batch is left-padded; its real tokens alone must give the same logits and cache entries.

    Args:
        runner: the OrtRunner whose prefill.onnx runs both, with float_matmul_settings where they apply.
        manifest: the artifact's manifest.
        batch: the prompt batch (prompt_batch), its row 0 left-padded.
        profile: the tolerances that judge the difference.
    """
    mask = batch["attention_mask"]
    real = mask[0] == 1
    feeds = prefill_feeds(manifest, batch)
    padded = runner.prefill(feeds)
    alone_mask = np.ones((1, int(real.sum())), dtype=np.int64)
    alone = runner.prefill(
        {
            name: value[:1, real] if name != "position_ids" else position_ids_from_mask(alone_mask)
            for name, value in feeds.items()
        }
    )
    row = {
        "logits": padded["logits"][:1, real],
        **{n: padded[n][:1, :, real] for n in alone if n.startswith("present.")},
    }
    return _outcome(
        "padded row == same sequence alone",
        *_pair("padded", row, alone, profile, alone_mask),
        what=_sessions(manifest, f"{int((~real).sum())} padding tokens"),
    )


def _weight_keys(model: onnx.ModelProto) -> set[tuple]:
    """What identifies each of a graph's weights, read the way ONNX Runtime reads them: those in the weights file by
    the graph's own external-data reference (file, offset, length; the export stores each distinct tensor once, so
    equal content is an equal reference), and every floating initializer of more than one element kept inline (a
    small norm weight, the rotary frequencies) by a hash of its content, which no hash of the weights file covers.
    Inline integer initializers are shapes and axes, and floating ones of one element constants (an epsilon, the
    attention scale, the loss's own, which only prefill computes), as the weight audit leaves them out: the two
    graphs need not share them."""
    keys = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in tensor.external_data}
            where = ("in the weights file", info["location"], int(info.get("offset", 0)), int(info["length"]))
        elif tensor.data_type in FLOAT_TYPES and math.prod(tensor.dims) > 1:
            where = ("inline", hashlib.sha256(numpy_helper.to_array(tensor).tobytes()).hexdigest())
        else:
            continue
        keys.add((where, tensor.data_type, tuple(tensor.dims)))
    return keys


def identical_weights(artifact: Artifact) -> Invariant:
    """Matched by where the bytes are (or, inline, by content), not by name: the exporter names folded tensors
    differently in each graph."""
    manifest = artifact.manifest
    prefill, decode = (_weight_keys(artifact.graph(g)) for g in (manifest.prefill, manifest.decode))
    only_prefill, only_decode = prefill - decode, decode - prefill
    if only_prefill or only_decode:
        shapes = sorted({f"{list(key[2])} {key[0][0]}" for key in only_prefill | only_decode})
        return Invariant(
            "prefill and decode carry identical weights",
            False,
            f"{len(only_prefill)} tensor(s) only in prefill, {len(only_decode)} only in decode "
            f"(shapes {', '.join(shapes[:6])})",
        )
    inline = sum(key[0][0] == "inline" for key in prefill)
    return Invariant(
        "prefill and decode carry identical weights",
        True,
        f"{len(prefill) - inline} distinct weight tensors in the weights file and {inline} floating "
        "initializers inline, the same in both graphs",
    )


def symbolic_axes(artifact: Artifact) -> Invariant:
    problems = []
    for contract in (artifact.manifest.prefill, artifact.manifest.decode):
        problems += lint_axes(artifact.graph(contract), contract)
    return Invariant(
        "every dynamic axis is symbolic",
        not problems,
        "; ".join(problems[:5]) if problems else "all contract axes symbolic, named as declared",
    )


_BELOW_FLOAT32 = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def computes_in_float32(artifact: Artifact) -> Invariant:
    """A float32 export casts nothing to float16 or bfloat16. ONNX Runtime's CPU provider drops a cast down
    and back up as a no-op, so no comparison on the CPU can see the rounding that CUDA would then do."""
    found = []
    for contract in (artifact.manifest.prefill, artifact.manifest.decode):
        model = artifact.graph(contract)
        nodes = [*model.graph.node, *(node for function in model.functions for node in function.node)]
        found += [
            f"{contract.file}: {node.name or node.op_type}"
            for node in nodes
            if node.op_type == "Cast" and any(a.name == "to" and a.i in _BELOW_FLOAT32 for a in node.attribute)
        ]
    return Invariant(
        "a float32 export computes in float32",
        not found,
        f"{len(found)} Cast(s) to float16 or bfloat16: {', '.join(found[:4])}"
        if found
        else "no Cast to float16 or bfloat16 in either graph",
    )


def check_invariants(artifact: Artifact, onnx_runner, batch: dict, profile: Profile) -> list[Invariant]:
    """The reference-free invariants: three of `onnx_runner`'s outputs against each other, three of the graphs.

    Args:
        artifact: the artifact whose graphs are inspected.
        onnx_runner: an OrtRunner on it, with float_matmul_settings where they apply.
        batch: the prompt batch (prompt_batch), its row 0 left-padded.
        profile: the tolerances that judge the differences.
    """
    manifest = artifact.manifest
    k = batch["input_ids"].shape[1] // 2 + 1  # past the first row's padding, so every row has a real past token
    return [
        split_prefill(onnx_runner, manifest, batch, profile, k),
        decode_past_zero(onnx_runner, manifest, batch, profile),
        padded_row_alone(onnx_runner, manifest, batch, profile),
        identical_weights(artifact),
        symbolic_axes(artifact),
        *([computes_in_float32(artifact)] if manifest.dtype == "float32" else []),
    ]
