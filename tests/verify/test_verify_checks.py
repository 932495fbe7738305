"""The checks, each on the fault it guards against: invariants, routing near-ties, per-call and per-layer
judging, greedy tokens, the repeat run, provider pairs and float16 companions."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import onnx
import pytest
from helpers import QUICK, claim_seed, edit_manifest, perturb_weight, scale_inline_weight

from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import read_manifest
from exporter.runtime.runner import OrtRunner
from exporter.tolerances.parity import Overrides, profile_for
from exporter.verify.checks import calls, invariants
from exporter.verify.checks import outputs as checks
from exporter.verify.inputs import ParitySettings, prefill_feeds, prompt_batch
from exporter.verify.metrics import NOTHING_COMPARED, compare, real_queries
from exporter.verify.references.torch_runner import TorchRunner


def test_a_routing_near_tie_excuses_only_the_positions_its_flip_reached(artifact_copy, tiny_model):
    """A real fault that fails every shape, with stand-in expert choices: a flip explained by near-ties leaves
    out of the comparison the positions it reached and nothing else, so the fault still fails every call with
    a position left to judge. A flip that is not a near-tie, or no differing choice at all, excuses nothing."""
    from exporter.verify.checks.health import HealthScan
    from exporter.verify.checks.outputs import run_sweep
    from exporter.verify.checks.routing import ExpertAgreement
    from exporter.verify.checks.routing_explainer import CallRouting

    perturb_weight(artifact_copy, "model.layers.1.mlp.down_proj", 0.05)  # moves the logits only: the presents pass
    manifest = read_manifest(artifact_copy)
    reference, onnx = TorchRunner(tiny_model, manifest), OrtRunner(Artifact(artifact_copy, manifest))
    profile = profile_for("float32", "cpu")

    def sweep(agreement, reach):
        def explain(graph, onnx_feeds, valid):
            assert graph == "decode"  # the past's prefill passes: only its presents are handed on
            return CallRouting(agreement, reach(np.shape(valid)))

        return run_sweep(reference, onnx, manifest, profile, HealthScan("float32"), np.random.default_rng(0), explain)

    def everything(shape):
        return np.ones(shape, dtype=bool)

    def last_token(shape):
        reached = np.zeros(shape, dtype=bool)
        reached[:, -1] = True
        return reached

    tie = ExpertAgreement(True, 10, 9, 1, "1 of 10 differ, 1 explained")
    # a flip that reached every position leaves nothing to judge: no pass
    assert all(not c.passed and c.routing_near_tie for c in sweep(tie, everything))
    assert all(c.logits.worst == NOTHING_COMPARED for c in sweep(tie, everything))
    cases = sweep(tie, last_token)
    assert not any(c.passed for c in cases)
    # a single new token: every position reached, none left to judge, which is no pass; more: the fault fails
    assert [c.logits.worst == NOTHING_COMPARED for c in cases] == [c.new_tokens == 1 for c in cases]
    assert all(c.logits.needed.scale > 1 for c in cases if c.new_tokens > 1)
    assert all(c.routing_near_tie and c.routing[0].excluded == c.batch for c in cases)
    for other in (
        ExpertAgreement(True, 10, 9, 0, "not a tie"),
        ExpertAgreement(True, 10, 10, 0, "all agree"),
        ExpertAgreement(False, 0, 0, 0, "not measured"),
    ):
        assert not any(c.passed or c.routing_near_tie for c in sweep(other, everything)), other.note


def test_a_routing_difference_is_a_near_tie_or_reached_by_an_earlier_layers_flip():
    """Two rows of two tokens, two layers, top-1 of 3 experts. A flip at layer 0 reaches, in later layers, its
    own token and the later tokens of its row (through attention): their differences follow from it whatever
    their router gaps. An earlier token of its row or a token of another row is not reached: a difference
    there is explained only as a near-tie of its own."""
    from exporter.tolerances.parity import Tolerance
    from exporter.verify.checks.routing import compare_choices

    tolerance = Tolerance(1e-4, 1e-4)
    tie, clear = [0.5, 0.49999, 0.0], [0.9, 0.05, 0.05]  # a near-tie: experts 0 and 1 within 1e-5
    valid = np.ones((2, 2), dtype=bool)
    reference_ids = np.zeros((4, 1), dtype=np.int64)  # tokens in row order: (0, 0), (0, 1), (1, 0), (1, 1)

    def count(layer0_tie: int, layer0_flip: int, layer1_flips: list[int]):
        scores = np.array([tie if token == layer0_tie else clear for token in range(4)])
        flipped = [np.isin(np.arange(4), flips).astype(np.int64)[:, None] for flips in ([layer0_flip], layer1_flips)]
        reference = {0: (scores, reference_ids), 1: (np.array([clear] * 4), reference_ids)}
        onnx = {layer: (reference[layer][0], ids) for layer, ids in enumerate(flipped)}
        result = compare_choices(reference, onnx, valid, tolerance)
        return (result.pairs, result.agreeing, result.explained), result.reached.tolist()

    # token (0, 0) flips at a near-tie; at layer 1 it and the next token of its row follow
    assert count(0, 0, [0, 1]) == ((8, 5, 3), [[True, True], [False, False]])
    # a clear flip in the other row at layer 1 is not reached
    assert count(0, 0, [2]) == ((8, 6, 1), [[True, True], [True, True]])
    # token (0, 1) flips at a near-tie; the earlier token (0, 0) is not reached by it
    assert count(1, 1, [0]) == ((8, 6, 1), [[True, True], [False, False]])
    # a flip at a clear choice is not explained; what it reached at layer 1 is
    assert count(1, 0, [0, 1]) == ((8, 5, 2), [[True, True], [False, False]])
    assert count(0, -1, []) == ((8, 8, 0), [[False, False], [False, False]])


def _one_token_choice(scores, reference_expert: int, onnx_expert: int, onnx_scores=None, tolerance=None):
    from exporter.tolerances.parity import Tolerance
    from exporter.verify.checks.routing import agreement, compare_choices

    scores = np.array([scores])
    onnx_scores = scores if onnx_scores is None else np.array([onnx_scores])
    count = compare_choices(
        {0: (scores, np.array([[reference_expert]]))},
        {0: (onnx_scores, np.array([[onnx_expert]]))},
        np.ones((1, 1), dtype=bool),
        tolerance or Tolerance(1e-2, 0.0),
    )
    return agreement([count])


def test_a_flip_is_excused_only_between_experts_tied_with_the_reference_choice():
    """Scores [0.30, 0.295, 0.25, 0.155], top-1, a bound of 0.01: the reference's expert 0 and expert 1 are
    tied, so ONNX choosing 1 is a near-tie; choosing expert 3 (0.145 below) is a fault, however close the
    reference's own first and second scores are."""
    scores = [0.30, 0.295, 0.25, 0.155]
    tied = _one_token_choice(scores, 0, 1)
    assert (tied.explained, tied.near_ties) == (1, 1) and tied.passed  # one flip is allowed at any sample size
    far = _one_token_choice(scores, 0, 3)
    assert (far.explained, far.near_ties) == (0, 0) and not far.passed
    assert _one_token_choice(scores, 0, 0).passed


def test_router_scores_off_their_bound_fail_without_any_flip():
    """The same choice on both sides, but one score off by 0.02 where the bound is 0.01 + 0: a router fault
    that moves scores without (yet) changing a choice."""
    agree = _one_token_choice([0.6, 0.2, 0.2], 0, 0, [0.6, 0.18, 0.22])
    assert agree.agreeing == 1 and agree.score_scale == pytest.approx(2.0) and not agree.passed
    within = _one_token_choice([0.6, 0.2, 0.2], 0, 0, [0.6, 0.195, 0.205])
    assert within.score_scale == pytest.approx(0.5) and within.passed


def test_near_tie_flips_are_capped_and_nothing_compared_is_no_pass():
    from exporter.verify.checks.routing import MAX_NEAR_TIE_SHARE, ExpertAgreement

    # one tie flip in 8 pairs: at the cap, passes; two: over it; of 24 pairs, three pass and four do not
    assert ExpertAgreement(True, 8, 7, 1, "", near_ties=1, score_scale=0.1).passed
    assert not ExpertAgreement(True, 8, 6, 2, "", near_ties=2, score_scale=0.1).passed
    assert ExpertAgreement(True, 24, 21, 3, "", near_ties=3, score_scale=0.1).passed
    assert not ExpertAgreement(True, 24, 20, 4, "", near_ties=4, score_scale=0.1).passed
    assert ExpertAgreement(True, 2, 1, 1, "", near_ties=1, score_scale=0.1).passed  # a single flip: always one
    assert 1 / 8 <= MAX_NEAR_TIE_SHARE < 2 / 8
    assert not ExpertAgreement(True, 0, 0, 0, "nothing").passed


def test_a_comparison_left_with_no_position_fails():
    from exporter.tolerances.parity import Tolerance

    values = np.ones((1, 2, 3))
    result = compare("x", "logits", values, values, Tolerance(0, 0, 1e-3), valid=np.zeros((1, 2), bool))
    assert not result.passed and result.worst == NOTHING_COMPARED
    assert compare("x", "logits", values, values, Tolerance(0, 0, 1e-3), valid=np.ones((1, 2), bool)).passed


class _DecodeFlipsAt:
    """An OrtRunner whose decode call `at` (counting from 0) returns row 0's logits and layer 1's key moved by
    1 at its new positions, as a token of that row routed to another expert would: a difference the next steps
    inherit through the cache."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.calls = inner, at, 0

    def prefill(self, feeds):
        return self.inner.prefill(feeds)

    def decode(self, feeds):
        outputs = self.inner.decode(feeds)
        self.calls += 1
        if self.calls - 1 != self.at:
            return outputs
        key = self.inner.manifest.cache.present(1, "key")
        moved, logits = outputs[key].copy(), outputs["logits"].copy()
        moved[0, :, -feeds["input_ids"].shape[1] :] += 1
        logits[0] += 1
        return {**outputs, "logits": logits, key: moved}


def test_after_an_explained_routing_flip_decode_continues_from_the_reference_cache(runner, tiny_model):
    """Without the reference's cache, every step after a flip inherits it and fails; with it, the later steps
    judge the graph again. A flip that is not a near-tie keeps its failure and ONNX Runtime its own cache."""
    from exporter.verify.checks.health import HealthScan
    from exporter.verify.checks.outputs import check_decode
    from exporter.verify.checks.routing import ExpertAgreement
    from exporter.verify.checks.routing_explainer import CallRouting

    manifest = runner.manifest
    batch = prompt_batch(manifest, QUICK, np.random.default_rng(0))
    profile = profile_for("float32", "cpu")
    asked = []

    def decode(agreement):
        def explain(graph, onnx_feeds, valid):
            asked.append(graph)
            reached = np.zeros(np.shape(valid), dtype=bool)
            reached[0] = True  # row 0's flip reaches its own positions, none of the other rows'
            return CallRouting(agreement, reached)

        return check_decode(
            TorchRunner(tiny_model, manifest),
            _DecodeFlipsAt(runner, 2),
            manifest,
            batch,
            ParitySettings(decode_steps=5),
            profile,
            HealthScan("float32"),
            np.random.default_rng(1),
            explain,
        )[0]

    result = decode(ExpertAgreement(True, 4, 3, 1, "1 of 4 differ, 1 explained"))
    assert asked == ["decode"] and all(row.passed for row in result.comparisons)
    assert [s.routing is not None and s.routing.explained for s in result.curve] == [
        False,
        False,
        True,
        False,
        False,
        False,
    ]
    assert [s.fed_reference_cache for s in result.curve] == [False, False, False, True, False, False]
    assert result.curve[2].routing.logits.needed.scale > 1000  # the whole call failed; none of it was judged
    not_a_tie = decode(ExpertAgreement(True, 4, 3, 0, "1 of 4 differ, not a near-tie"))
    assert [s.logits.passed for s in not_a_tie.curve] == [True, True, False, False, False, False]
    assert not any(s.fed_reference_cache for s in not_a_tie.curve)


class _DecodeLogitsShifted:
    """An OrtRunner whose decode.onnx logits are off by 1e-2, about a hundred times the float32 tolerance
    (512 float32 units of a peak near 3: 9e-5)."""

    def __init__(self, inner):
        self.inner = inner

    def prefill(self, feeds):
        return self.inner.prefill(feeds)

    def decode(self, feeds):
        outputs = self.inner.decode(feeds)
        return {**outputs, "logits": outputs["logits"] + np.float32(1e-2)}

    def empty_past(self, batch):
        return self.inner.empty_past(batch)


class _PaddingAttended(_DecodeLogitsShifted):
    """An OrtRunner whose prefill attends to left padding, as a graph that dropped the padding mask would."""

    def prefill(self, feeds):
        return self.inner.prefill({**feeds, "attention_mask": np.ones_like(feeds["attention_mask"])})

    def decode(self, feeds):
        return self.inner.decode(feeds)


class _PresentsNaN(_DecodeLogitsShifted):
    """An OrtRunner whose graphs both give NaN in the first present, as a model with NaN weights would: the
    two sides of every invariant still agree."""

    def _broken(self, outputs):
        first = next(name for name in outputs if name.startswith("present."))
        return {**outputs, first: np.full_like(outputs[first], np.nan)}

    def prefill(self, feeds):
        return self._broken(self.inner.prefill(feeds))

    def decode(self, feeds):
        return self._broken(self.inner.decode(feeds))


def test_each_invariant_fails_on_the_fault_it_guards_against(artifact_copy):
    from exporter.verify.checks import invariants

    manifest = read_manifest(artifact_copy)
    runner = OrtRunner(Artifact(artifact_copy, manifest))
    batch = prompt_batch(manifest, ParitySettings(), np.random.default_rng(0))
    profile = profile_for("float32", "cpu")
    assert all(i.passed for i in invariants.check_invariants(Artifact(artifact_copy, manifest), runner, batch, profile))
    # inline: the 9 norm weights (each distinct) and the rotary frequencies; scalars are constants, not weights
    assert invariants.identical_weights(Artifact(artifact_copy, manifest)).detail == (
        "15 distinct weight tensors in the weights file and 10 floating initializers inline, the same in both graphs"
    )
    shifted = _DecodeLogitsShifted(runner)
    assert not invariants.split_prefill(shifted, manifest, batch, profile, k=7).passed
    assert not invariants.decode_past_zero(shifted, manifest, batch, profile).passed
    assert not invariants.padded_row_alone(_PaddingAttended(runner), manifest, batch, profile).passed
    broken = _PresentsNaN(runner)
    for invariant in (
        invariants.split_prefill(broken, manifest, batch, profile, k=7),
        invariants.decode_past_zero(broken, manifest, batch, profile),
        invariants.padded_row_alone(broken, manifest, batch, profile),
    ):
        assert not invariant.passed and "NaN or Inf in" in invariant.detail, invariant.detail
        assert "present.0.key" in invariant.detail and "no invariant can vouch for" in invariant.detail

    # decode.onnx scales a norm weight kept inline (16 floats, under the weights file's 1 KiB threshold)
    clean = {name: (artifact_copy / name).read_bytes() for name in ("decode.onnx", "manifest.json")}
    scale_inline_weight(artifact_copy, "decode.onnx", "layers.0.self_attn.q_norm.weight", 1.05)
    weights = invariants.identical_weights(Artifact(artifact_copy, manifest))
    assert not weights.passed and weights.detail == "1 tensor(s) only in prefill, 1 only in decode (shapes [16] inline)"
    for name, data in clean.items():
        (artifact_copy / name).write_bytes(data)

    # decode.onnx reads one weight from other bytes; then bakes the batch axis of input_ids
    model = onnx.load(str(artifact_copy / "decode.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    info = {e.key: e.value for e in tensor.external_data}
    with open(artifact_copy / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        data = bytearray(f.read(int(info["length"])))
    data[0] ^= 1
    (artifact_copy / "other.data").write_bytes(bytes(data))
    for entry in tensor.external_data:
        entry.value = {"location": "other.data", "offset": "0"}.get(entry.key, entry.value)
    onnx.save(model, str(artifact_copy / "decode.onnx"))
    weights = invariants.identical_weights(Artifact(artifact_copy, manifest))
    assert not weights.passed and weights.detail == (
        "1 tensor(s) only in prefill, 1 only in decode (shapes [512, 64] in the weights file)"
    )
    assert invariants.symbolic_axes(Artifact(artifact_copy, manifest)).passed
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    onnx.save(model, str(artifact_copy / "decode.onnx"))
    axes = invariants.symbolic_axes(Artifact(artifact_copy, manifest))
    assert not axes.passed and "input_ids" in axes.detail, axes.detail

    # a rounding to float16 in a float32 graph, which the CPU provider would drop unseen
    model.graph.node.append(
        onnx.helper.make_node(
            "Cast", [model.graph.output[0].name], ["logits_float16"], to=onnx.TensorProto.FLOAT16, name="rounding"
        )
    )
    onnx.save(model, str(artifact_copy / "decode.onnx"))
    rounding = invariants.computes_in_float32(Artifact(artifact_copy, manifest))
    assert not rounding.passed and "1 Cast(s) to float16 or bfloat16: decode.onnx: rounding" in rounding.detail


class _PrefillPresentNaN(_PresentsNaN):
    """An OrtRunner whose prefill.onnx alone gives NaN in the first present: decode(past 0) is finite."""

    def decode(self, feeds):
        return self.inner.decode(feeds)


class _PaddedQueriesNaN(_DecodeLogitsShifted):
    """An OrtRunner whose logits are NaN at padded queries, which nothing reads, and right elsewhere."""

    def _padded_nan(self, feeds, outputs):
        logits = outputs["logits"].copy()
        logits[~real_queries(feeds["attention_mask"], logits.shape[1])] = np.nan
        return {**outputs, "logits": logits}

    def prefill(self, feeds):
        return self._padded_nan(feeds, self.inner.prefill(feeds))

    def decode(self, feeds):
        return self._padded_nan(feeds, self.inner.decode(feeds))


def test_an_invariant_names_nan_on_either_side_and_judges_logits_at_real_queries_only(runner):
    # NaN on the expected side alone (prefill, against decode with an empty past) is named as such, not left to
    # read as a plain difference; NaN at a padded query's logits, which no token reads, fails nothing.
    manifest = runner.manifest
    batch = prompt_batch(manifest, ParitySettings(), np.random.default_rng(0))
    profile = profile_for("float32", "cpu")
    assert not batch["attention_mask"].all()  # row 0 is left-padded
    past0 = invariants.decode_past_zero(_PrefillPresentNaN(runner), manifest, batch, profile)
    assert not past0.passed and "NaN or Inf in present.0.key" in past0.detail, past0.detail
    padded = _PaddedQueriesNaN(runner)
    k = batch["input_ids"].shape[1] // 2 + 1
    for invariant in (
        invariants.split_prefill(padded, manifest, batch, profile, k),
        invariants.decode_past_zero(padded, manifest, batch, profile),
        invariants.padded_row_alone(padded, manifest, batch, profile),
    ):
        assert invariant.passed, (invariant.name, invariant.detail)
    # the split falls past row 0's padding, so every row carries a real token in the past decode reads
    split = invariants.check_invariants(Artifact(runner.folder, manifest), runner, batch, profile)[0]
    assert split.passed and split.detail.startswith(f"k={k} of {batch['input_ids'].shape[1]} tokens")
    assert batch["attention_mask"][:, :k].any(axis=1).all()


def test_a_weight_in_one_graph_alone_fails_the_identical_weights_check(artifact_copy):
    # decode.onnx holds a floating constant that prefill.onnx lacks, prefill.onnx none that decode.onnx lacks
    manifest = read_manifest(artifact_copy)
    model = onnx.load(str(artifact_copy / "decode.onnx"), load_external_data=False)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.full(3, 0.125, np.float32), "stray"))
    onnx.save(model, str(artifact_copy / "decode.onnx"))
    weights = invariants.identical_weights(Artifact(artifact_copy, manifest))
    assert not weights.passed and weights.detail == "0 tensor(s) only in prefill, 1 only in decode (shapes [3] inline)"


def test_a_scalar_constant_in_one_graph_alone_is_no_weight(artifact_copy):
    # a loss's own constant (a one-element initializer only prefill.onnx computes with) is no weight of the model
    manifest = read_manifest(artifact_copy)
    model = onnx.load(str(artifact_copy / "prefill.onnx"), load_external_data=False)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.full(1, -100.0, np.float32), "loss_constant"))
    onnx.save(model, str(artifact_copy / "prefill.onnx"))
    assert invariants.identical_weights(Artifact(artifact_copy, manifest)).passed


def test_a_rounding_to_bfloat16_inside_a_graph_function_is_found(artifact_copy):
    # computes_in_float32 reads the nodes of the graph's local functions too, and bfloat16 is as much a rounding
    # the CPU provider drops unseen as float16 is
    manifest = read_manifest(artifact_copy)
    model = onnx.load(str(artifact_copy / "decode.onnx"), load_external_data=False)
    cast = onnx.helper.make_node("Cast", ["x"], ["y"], to=onnx.TensorProto.BFLOAT16, name="hidden_rounding")
    model.functions.append(
        onnx.helper.make_function("local", "round", ["x"], ["y"], [cast], [onnx.helper.make_opsetid("", 18)])
    )
    model.opset_import.append(onnx.helper.make_opsetid("local", 1))
    model.graph.node.append(
        onnx.helper.make_node(
            "round", [model.graph.output[0].name], ["logits_bfloat16"], domain="local", name="call_round"
        )
    )
    onnx.save(model, str(artifact_copy / "decode.onnx"))
    rounding = invariants.computes_in_float32(Artifact(artifact_copy, manifest))
    assert not rounding.passed and rounding.detail == (
        "1 Cast(s) to float16 or bfloat16: decode.onnx: hidden_rounding"
    ), rounding.detail


def test_the_repeat_run_compares_the_second_run_with_the_first(runner):
    from exporter.verify.checks.providers import repeat_run

    class Drifting(_DecodeLogitsShifted):  # the second prefill on the session differs, as a nondeterministic one
        provider = "cpu"

        def prefill(self, feeds):
            outputs = self.inner.prefill(feeds)
            return {**outputs, "logits": outputs["logits"] + np.float32(1e-2)}

    manifest = runner.manifest
    batch = prompt_batch(manifest, ParitySettings(), np.random.default_rng(0))
    first = runner.prefill(prefill_feeds(manifest, batch))
    profile = profile_for("float32", "cpu")
    assert repeat_run(runner, manifest, batch, first, profile).passed
    again = repeat_run(Drifting(runner), manifest, batch, first, profile)
    assert not again.passed and again.max_abs == pytest.approx(1e-2, rel=1e-3), again


def test_layer_errors_judge_the_key_and_the_value_of_every_layer():
    """A fault in one present alone (a layer's value, the last layer's key) fails that layer and that kind only;
    a fault at a padded cache position fails nothing."""
    from types import SimpleNamespace

    from exporter.artifact.contract import CacheLayout

    manifest = SimpleNamespace(cache=CacheLayout(num_layers=3, num_key_value_heads=2, head_dim=4, dtype="float32"))
    rng = np.random.default_rng(0)
    mask = np.array([[0, 1, 1], [1, 1, 1]])
    clean = {
        f"present.{layer}.{kind}": rng.standard_normal((2, 2, 3, 4)) for layer in range(3) for kind in ("key", "value")
    }
    profile = profile_for("float32", "cpu")
    assert [e.layer for e in calls.layer_errors(manifest, clean, clean, profile, "x", mask)] == [0, 1, 2]
    for layer, kind in ((0, "value"), (1, "value"), (2, "key"), (2, "value")):
        name = f"present.{layer}.{kind}"
        faulty = {**clean, name: clean[name].copy()}
        faulty[name][1, 0, 0, 0] += 0.1
        errors = calls.layer_errors(manifest, faulty, clean, profile, "x", mask)
        assert [e.passed for e in errors] == [e.layer != layer for e in errors], name
        assert [errors[layer].key.passed, errors[layer].value.passed] == [kind != "key", kind != "value"], name
        assert getattr(errors[layer], kind).name == f"x {name}"
        faulty[name][1, 0, 0, 0] -= 0.1
        faulty[name][0, 1, 0, 2] = 7.0  # row 0's position 0 is padding
        assert all(e.passed for e in calls.layer_errors(manifest, faulty, clean, profile, "x", mask)), name


def test_a_call_fails_by_its_logits_any_present_or_its_loss_alone():
    """check_prefill's rows and judge_call's verdict read every output: a fault in one present or in the loss
    alone fails the call, as a decode step fails by its cache alone."""
    from types import SimpleNamespace

    from exporter.artifact.contract import CacheLayout
    from exporter.verify.checks.health import HealthScan

    names = ["input_ids", "attention_mask", "position_ids", "labels"]
    manifest = SimpleNamespace(
        cache=CacheLayout(num_layers=2, num_key_value_heads=2, head_dim=3, dtype="float32"),
        prefill=SimpleNamespace(input_names=names),
    )
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]])
    batch = {
        "input_ids": np.ones((2, 4), np.int64),
        "attention_mask": mask,
        "position_ids": np.zeros((2, 4), np.int64),
        "labels": np.ones((2, 4), np.int64),
    }
    rng = np.random.default_rng(0)
    clean = {
        "logits": rng.standard_normal((2, 4, 5)).astype(np.float32),
        "loss": np.float32(2.5),
        **{
            f"present.{layer}.{kind}": rng.standard_normal((2, 2, 4, 3)).astype(np.float32)
            for layer in range(2)
            for kind in ("key", "value")
        },
    }
    profile = profile_for("float32", "cpu")

    def prefill(actual):
        side = lambda outputs: SimpleNamespace(prefill=lambda feeds: outputs)  # noqa: E731
        result, _ = checks.check_prefill(side(clean), side(actual), manifest, batch, profile, HealthScan("float32"))
        return result, calls.judge_call(manifest, "c", "prefill", batch, actual, clean, profile, mask, mask)

    result, call = prefill(clean)
    assert [c.name for c in result.comparisons] == ["prefill logits", "prefill present (all layers)", "prefill loss"]
    assert all(result.comparisons) and call.passed
    for name in clean:
        faulty = {**clean, name: clean[name] + np.float32(0.1)}
        result, call = prefill(faulty)
        assert [c.passed for c in result.comparisons] == [
            name != "logits",
            not name.startswith("present."),
            name != "loss",
        ], name
        assert not call.passed, name
    ok = compare("x", "kv", [1.0], [1.0], profile.kv)
    assert not checks.StepError(0, 1, ok, compare("x", "kv", [2.0], [1.0], profile.kv), 1).passed


def test_a_greedy_divergence_passes_only_at_a_near_tie_of_the_reference():
    from exporter.verify.checks.greedy import GreedyTrace, judge_greedy

    profile = profile_for("float32", "cpu")
    logits = np.zeros((3, 6), np.float32)
    logits[1, 2], logits[1, 4] = 5.0, 5.0 - 1e-5  # at token 1, ids 2 and 4 lie within the logits tolerance
    trace = GreedyTrace([0, 2, 3], logits)
    assert judge_greedy(trace, [0, 2, 3], profile).passed
    tie = judge_greedy(trace, [0, 4, 1], profile)
    assert tie.passed and tie.match_length == 1 and "a near-tie within tolerance" in tie.note
    logits[1, 4] = 4.9
    clear = judge_greedy(GreedyTrace([0, 2, 3], logits), [0, 4, 1], profile)
    assert not clear.passed and "not a tie" in clear.note
    early = judge_greedy(trace, [0, 2], profile)
    assert not early.passed and early.note == "one side stopped early"
    # the bound is the tolerance at the chosen logit: float16's relative term there (5), not at the row's
    # largest magnitude (-100): 0.9 apart lies beyond 1e-3 + 4u x 5 + 16u x 100 = 0.79 (u = 2^-11)
    row = np.zeros((2, 6), np.float32)
    row[1, 0], row[1, 2], row[1, 4] = -100.0, 5.0, 4.1
    assert not judge_greedy(GreedyTrace([0, 2], row), [0, 4], profile_for("float16", "cpu")).passed
    row[1, 4] = 4.3  # 0.7 apart: a near-tie
    assert judge_greedy(GreedyTrace([0, 2], row), [0, 4], profile_for("float16", "cpu")).passed

    # A consumer that leaves EOS (5) out: a list that ends first chose EOS there, judged by the same rule.
    logits[1, 5] = 5.0 - 1e-5
    stopped = GreedyTrace([0, 2, 3], logits)
    genai_stopped = judge_greedy(stopped, [0], profile, dropped_eos=5)
    assert genai_stopped.passed and "reference 2 vs onnx 5" in genai_stopped.note
    reference_stopped = judge_greedy(GreedyTrace([0, 5], logits[:2]), [0, 2, 3], profile, [0], dropped_eos=5)
    assert reference_stopped.passed and "reference 5 vs onnx 2" in reference_stopped.note
    logits[1, 5] = 4.0
    assert not judge_greedy(GreedyTrace([0, 2, 3], logits), [0], profile, dropped_eos=5).passed
    at_once = judge_greedy(GreedyTrace([5], logits[:1]), [], profile, [], dropped_eos=5)
    assert (
        at_once.passed and at_once.note == "0 tokens identical (both stopped at EOS at once: nothing else to compare)"
    )


def test_nan_logits_in_our_greedy_loop_are_a_failed_check_not_an_error(runner):
    from exporter.verify.checks.greedy import GreedyTrace, check_greedy

    class NaNRunner:  # generation's interface over an artifact whose logits hold a NaN
        manifest, cache = runner.manifest, []

        def start(self, input_ids, attention_mask, position_ids):
            logits = np.zeros((len(input_ids), self.manifest.config.vocab_size), np.float32)
            logits[:, 7] = np.nan
            return logits

        def step(self, input_ids, attention_mask, position_ids):
            raise AssertionError("a NaN in the prompt's logits ends the loop before any step")

    class Reference:
        def greedy(self, prompt, new_tokens, eos):
            return GreedyTrace([3] * new_tokens, np.zeros((new_tokens, 8), np.float32))

    result = check_greedy(Reference(), NaNRunner(), runner.manifest, [1, 2], QUICK, profile_for("float32", "cpu"))
    assert not result.passed and result.onnx_ids == [] and "not finite" in result.note


def test_providers_are_compared_with_the_looser_profile_of_the_two(artifact_fp32, artifact_fp16, monkeypatch):
    from exporter.tolerances import parity
    from exporter.tolerances.parity import CPU, CUDA
    from exporter.verify.checks.providers import attribute, cross_providers

    rng = np.random.default_rng(0)
    cpu = {
        "logits": rng.standard_normal((2, 5, 8)).astype(np.float32) * 4,
        "present.0.key": rng.standard_normal((2, 1, 5, 4)).astype(np.float32),
    }
    mask = np.ones((2, 5), np.int64)
    # a difference within a looser CUDA profile (4 float16 units more of the peak), beyond the CPU profile
    strict = profile_for("float32", CPU)
    looser = dataclasses.replace(strict.logits, peak=strict.logits.peak + 4 * 2.0**-11)
    monkeypatch.setitem(parity.PROFILES, ("float32", CUDA), dataclasses.replace(strict, logits=looser, kv=looser))
    peak = np.abs(cpu["logits"]).max(axis=-1, keepdims=True)  # each position's peak: its logits' own bound
    tf32 = {**cpu, "logits": cpu["logits"] + (2 * 2.0**-11 * peak).astype(np.float32)}
    assert not compare("cpu", "logits", tf32["logits"], cpu["logits"], strict.logits).passed
    assert all(c.passed for c in cross_providers({CPU: cpu, CUDA: tf32}, "float32", Overrides(), mask))
    assert all(c.passed for c in cross_providers({CUDA: tf32, CPU: cpu}, "float32", Overrides(), mask))
    wrong = {**cpu, "logits": cpu["logits"] + np.float32(0.5)}
    rows = cross_providers({CPU: cpu, CUDA: wrong}, "float32", Overrides(), mask)
    assert [c.name for c in rows if not c.passed] == [f"{CUDA} vs {CPU} prefill logits"]

    manifest = read_manifest(artifact_fp32)
    provider = attribute([], {CPU: cpu, CUDA: tf32}, rows, manifest, {}, None, Overrides())
    [leg] = provider.legs
    assert (leg.cause, leg.covers) == ("provider", "prefill.onnx, the prefill batch") and not leg.comparison.passed
    assert provider.skipped == "precision leg needs a float16 companion artifact"
    # the pair in the order the providers were given; CUDA alone has no provider leg
    flipped = attribute(
        [],
        {CUDA: tf32, CPU: cpu},
        cross_providers({CUDA: wrong, CPU: cpu}, "float32", Overrides(), mask),
        manifest,
        {},
        None,
        Overrides(),
    )
    [leg] = flipped.legs
    assert leg.comparison.name == f"{CPU} vs {CUDA} prefill logits" and not leg.comparison.passed
    cuda_only = attribute([], {CUDA: tf32}, [], manifest, {}, None, Overrides())
    assert not cuda_only.legs and "need CPUExecutionProvider too" in cuda_only.skipped
    cpu_only = attribute([], {CPU: cpu}, [], manifest, {}, None, Overrides())
    assert not cpu_only.legs and "need CUDAExecutionProvider" in cpu_only.skipped
    half = attribute([], {CPU: cpu, CUDA: tf32}, rows, read_manifest(artifact_fp16), {}, None, Overrides())
    assert not half.legs and "starts from a float32 artifact" in half.skipped


def test_the_precision_leg_compares_float16_with_cuda_float32_at_real_queries(
    artifact_fp32, artifact_fp16, monkeypatch
):
    # No CUDA here: the float16 companion runs on the CPU in its place. The leg reads CUDA's float32 logits (not
    # the CPU's, far off here), at real queries only, with float16's CUDA profile; the user's overrides apply to
    # every profile, the provider pairs' included.
    from exporter.tolerances.parity import CPU, CUDA
    from exporter.verify.checks import providers

    asked = []

    def on_the_cpu(artifact, provider):
        asked.append(provider)
        return OrtRunner(artifact, CPU)

    monkeypatch.setattr(providers, "OrtRunner", on_the_cpu)
    manifest, fp16_manifest = read_manifest(artifact_fp32), read_manifest(artifact_fp16)
    batch = prompt_batch(manifest, ParitySettings(), np.random.default_rng(0))
    fp32 = OrtRunner(Artifact(artifact_fp32, manifest)).prefill(prefill_feeds(manifest, batch))
    cuda = {**fp32, "logits": fp32["logits"].copy()}
    cuda["logits"][~real_queries(batch["attention_mask"], cuda["logits"].shape[1])] = 1e3  # read by no token
    cpu = {**fp32, "logits": fp32["logits"] + np.float32(1.0)}
    result = providers.attribute(
        [], {CPU: cpu, CUDA: cuda}, [], manifest, batch, Artifact(artifact_fp16, fp16_manifest), Overrides()
    )
    [leg] = result.legs
    assert asked == [CUDA] and (leg.cause, leg.covers) == ("precision", "prefill.onnx, the prefill batch")
    assert leg.comparison.passed and leg.comparison.tolerance == profile_for("float16", CUDA).logits, leg.comparison
    loosened = Overrides((("logits", "atol", 1.0),))
    rows = providers.cross_providers(
        {CPU: fp32, CUDA: {**fp32, "logits": fp32["logits"] + np.float32(0.5)}},
        "float32",
        loosened,
        batch["attention_mask"],
    )
    assert all(c.passed for c in rows) and rows[0].tolerance.atol == 1.0, rows


def test_a_float16_companion_must_hold_the_same_weights(artifact_fp32, artifact_fp16, tmp_path):
    from exporter.errors import InputError
    from exporter.verify.checks.providers import check_companion

    manifest = read_manifest(artifact_fp32)
    assert check_companion(artifact_fp16, manifest).manifest.dtype == "float16"
    other = shutil.copytree(artifact_fp16, tmp_path / "other")
    edit_manifest(other, claim_seed(7))  # the precision leg would charge other weights to float16
    with pytest.raises(InputError, match="holds other weights .*seed 7 against .*seed 0"):
        check_companion(other, manifest)


def test_a_float16_companion_from_another_checkpoint_or_of_the_wrong_dtype_is_refused(
    artifact_fp32, artifact_fp16, tmp_path
):
    # a checkpoint is told by its content hash, not its path: the same bytes elsewhere are the same weights
    from exporter.errors import InputError
    from exporter.verify.checks.providers import companion_for

    other = shutil.copytree(artifact_fp16, tmp_path / "other")
    edit_manifest(other, lambda m: m["model"].update(source={"kind": "checkpoint", "path": "/b.pth", "sha256": "b"}))
    ours = {"kind": "checkpoint", "path": "/a.pth", "sha256": "a"}
    with pytest.raises(InputError, match="holds other weights .checkpoint, sha256 b against checkpoint, sha256 a."):
        companion_for(other, "float32", None, ours)
    assert companion_for(other, "float32", None, {**ours, "sha256": "b"}).manifest.dtype == "float16"
    with pytest.raises(InputError, match="is not a float16 export .float32."):
        companion_for(artifact_fp32, "float32", None, None)
    with pytest.raises(InputError, match="needs a float32 artifact to verify; this one is float16"):
        companion_for(artifact_fp16, "float16", None, None)


def test_a_float16_companion_of_another_config_names_the_fields(artifact_fp16):
    from exporter.errors import InputError
    from exporter.verify.checks.providers import companion_for
    from reference import get_preset

    with pytest.raises(
        InputError,
        match=r"is not a float16 export of the same model \(its config differs in "
        r"intermediate_size, .*, version\)",
    ):
        companion_for(artifact_fp16, "float32", get_preset("minimind2-tiny"))
