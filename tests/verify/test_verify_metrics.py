"""Pure comparison functions and tolerance profiles, against values worked out by hand."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from exporter.errors import InputError
from exporter.runtime.providers import session_providers
from exporter.tolerances.parity import CPU, CUDA, Tolerance, parse_overrides, profile_for
from exporter.verify.checks.referee import refereed
from exporter.verify.metrics import (
    Refereed,
    aggregate,
    compare,
    compare_outputs,
    difference_histogram,
    logits_metrics,
    match_length,
    real_keys,
    real_queries,
)


def test_compare_applies_allclose_and_nan_rules():
    tol = Tolerance(atol=1e-3, rtol=1e-2)
    assert compare("x", "kv", [1.0, 100.5], [1.0005, 100.0], tol).passed  # 0.5 <= 1e-3 + 1.0
    failed = compare("x", "kv", [1.0, 102.0], [1.0, 100.0], tol)
    assert not failed.passed and failed.max_abs == pytest.approx(2.0) and failed.max_rel == pytest.approx(0.02)
    assert compare("loss", "loss", np.nan, np.nan, tol).passed
    assert not compare("loss", "loss", np.nan, 1.0, tol).passed
    assert not compare("loss", "loss", 1.0, np.nan, tol).passed
    assert not compare("x", "kv", np.zeros((2, 3)), np.zeros((3, 2)), tol).passed
    # the same infinity on both sides (a masked score) is equal; another one, or a finite value, is not
    masked = compare("x", "kv", [-np.inf, 1.0], [-np.inf, 1.0], tol)
    assert masked.passed and masked.max_abs == 0 and masked.cosine == pytest.approx(1.0)
    assert not compare("x", "kv", [np.inf, 1.0], [-np.inf, 1.0], tol).passed
    assert not compare("x", "kv", [5.0, 1.0], [-np.inf, 1.0], tol).passed
    assert not compare("x", "kv", [-np.inf, 1.0], [5.0, 1.0], tol).passed
    # an infinite expected value does not widen the bound of the finite ones
    assert not compare("x", "kv", [-np.inf, 2.0], [-np.inf, 1.0], Tolerance(0.0, 0.0, 0.01)).passed
    peak = Tolerance(atol=0.0, rtol=0.0, peak=0.01)
    assert compare("x", "kv", [0.9, 100.0], [0.0, 100.0], peak).passed
    assert not compare("x", "kv", [1.1, 100.0], [0.0, 100.0], peak).passed
    # the bound is inclusive (<=, as numpy.allclose): an error exactly at it passes, and a zero tolerance (an
    # override asking for bit-identical outputs) passes identical outputs
    assert compare("x", "kv", [1.5, 2.0], [1.0, 2.0], Tolerance(atol=0.5, rtol=0.0)).passed
    assert compare("x", "kv", [3.0, -2.0], [3.0, -2.0], Tolerance(0.0, 0.0)).passed
    # NaN on one side is an infinite error, never a NaN figure that a max over comparisons would skip or misorder
    one_sided = compare("x", "kv", [np.nan, 1.0], [1.0, 1.0], tol)
    assert one_sided.max_abs == np.inf and one_sided.needed.scale == np.inf


def test_smallest_passing_tolerance_is_reported_and_sufficient():
    tol = Tolerance(atol=1e-3, rtol=1e-2)
    result = compare("x", "kv", [1.0, 103.0], [1.0, 100.0], tol)
    # |diff| 3 at expected 100: atol would need 3 - 1.0 = 2; rtol (3 - 1e-3) / 100; scale 3 / 1.001.
    assert result.needed.atol == pytest.approx(2.0)
    assert result.needed.rtol == pytest.approx(0.02999)
    assert result.needed.scale == pytest.approx(3 / 1.001)
    assert compare("x", "kv", [1.0, 103.0], [1.0, 100.0], Tolerance(2.0 + 1e-9, 1e-2)).passed
    assert compare("x", "kv", [1.0, 103.0], [1.0, 100.0], Tolerance(1e-3, 0.02999 + 1e-9)).passed
    assert compare("x", "kv", [1.0, 1.0], [1.0, 1.0], tol).needed.scale == 0


def test_cosine_and_logits_metrics_by_hand():
    assert compare("x", "kv", [1.0, 0.0], [0.0, 1.0], Tolerance(9, 0)).cosine == pytest.approx(0.0)
    expected = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))
    actual = np.log(np.array([[0.25, 0.5, 0.25], [0.1, 0.2, 0.7]]))
    metrics = logits_metrics(actual, expected, k=2)
    assert metrics["top1_agreement"] == 0.5  # row 0 flips from id 0 to id 1
    assert metrics["topk_overlap"] == 1.0  # the top-2 sets are {0, 1} and {1, 2} on both sides
    kl_row0 = 0.5 * np.log(0.5 / 0.25) + 0.25 * np.log(0.25 / 0.5)
    assert metrics["kl_max"] == pytest.approx(kl_row0) and metrics["kl_mean"] == pytest.approx(kl_row0 / 2)
    # KL(reference || onnx), not the reverse (the rows above are symmetric: both directions give the same value)
    p, q = np.array([0.9, 0.1]), np.array([0.5, 0.5])
    kl = logits_metrics(np.log(q)[None], np.log(p)[None], k=1)["kl_max"]
    assert kl == pytest.approx(0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5))
    # a sign flip is the opposite direction, not a perfect match
    assert compare("x", "kv", [-1.0, -2.0], [1.0, 2.0], Tolerance(9, 0)).cosine == pytest.approx(-1.0)
    # `valid` leaves positions out (left padding).
    assert logits_metrics(actual, expected, valid=np.array([False, True]), k=2)["top1_agreement"] == 1.0


def test_logits_are_judged_at_real_queries_only_and_a_real_fault_still_fails():
    # A padded query attends to no real token: a decoder whose mask leaves it no key at all (a boolean mask into
    # scaled_dot_product_attention) gives it whatever each runtime makes of an empty softmax.
    tol = Tolerance(0.0, 0.0, 1e-3)
    expected = np.array([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])  # (B 1, T 3, V 2); position 0 is padding
    queries = real_queries(np.array([[1, 1, 0, 1, 1]]), 3)  # the last 3 of a (B, total) mask
    assert queries.tolist() == [[False, True, True]]
    padded_differs = expected.copy()
    padded_differs[0, 0] = [1e6, np.nan]
    judged = compare("logits", "logits", padded_differs, expected, tol, valid=queries)
    assert judged.passed and judged.max_abs == 0 and judged.cosine == pytest.approx(1.0)
    assert judged.llm["positions"] == 2 and judged.llm["top1_agreement"] == 1.0
    assert not compare("logits", "logits", padded_differs, expected, tol).passed  # every position judged
    real_differs = expected.copy()
    real_differs[0, 2, 1] += 0.01  # beyond 1e-3 x the peak 6
    failed = compare("logits", "logits", real_differs, expected, tol, valid=queries)
    assert not failed.passed and failed.max_abs == pytest.approx(0.01)
    assert failed.needed.scale == pytest.approx(0.01 / 6e-3)
    # nor does a large value at another position widen the peak bound of a real one (1e-3 x 1e6 would): each
    # position's logits are held to their own peak, judged or not
    large_padding = expected.copy()
    large_padding[0, 0] = 1e6
    faulty = large_padding + (real_differs - expected)
    assert not compare("logits", "logits", faulty, large_padding, tol).passed
    assert not compare("logits", "logits", faulty, large_padding, tol, valid=queries).passed
    assert compare("logits", "logits", faulty, large_padding, Tolerance(0.0, 0.0, 2e-3)).passed  # 0.01 < 2e-3 x 6


def test_a_kv_head_of_small_magnitude_is_held_to_its_own_peak():
    """Presents (B, kv_heads, L, head_dim): head 1 is a hundred times smaller than head 0. A 5% error in head 1
    is far below the bound a whole-tensor peak would give (1e-3 x 100), and beyond its own (1e-3 x 1)."""
    expected = np.stack([np.full((3, 4), 100.0), np.ones((3, 4))])[None]  # (1, 2, 3, 4)
    actual = expected.copy()
    actual[0, 1] *= 1.05
    assert not compare("present", "kv", actual, expected, Tolerance(0.0, 0.0, 1e-3)).passed
    actual = expected.copy()
    actual[0, 1] += 0.5e-3  # within head 1's own bound
    actual[0, 0] += 0.05  # within head 0's
    assert compare("present", "kv", actual, expected, Tolerance(0.0, 0.0, 1e-3)).passed


def test_presents_are_judged_at_real_keys_in_every_head():
    tol = Tolerance(0.0, 0.0, 1e-3)
    mask = np.array([[0, 1, 1], [1, 1, 1]])  # row 0 left-padded by one
    assert real_keys(mask).shape == (2, 1, 3)
    expected = np.random.default_rng(0).standard_normal((2, 2, 3, 4))  # (B, kv_heads, L, head_dim)
    padded_differs = expected.copy()
    padded_differs[0, :, 0] = 7.0  # the padded key of row 0, in both heads
    assert compare("present", "kv", padded_differs, expected, tol, valid=real_keys(mask)).passed
    assert not compare("present", "kv", padded_differs, expected, tol).passed
    real_differs = expected.copy()
    real_differs[1, 1, 0, 3] += 0.1  # row 1's position 0 is real
    failed = compare("present", "kv", real_differs, expected, tol, valid=real_keys(mask))
    assert not failed.passed and failed.max_abs == pytest.approx(0.1)


def test_compare_outputs_judges_every_layers_present():
    """A fault in one present of the last layer alone fails the presents row (the invariants' comparison)."""
    rng = np.random.default_rng(0)
    mask = np.array([[0, 1, 1], [1, 1, 1]])
    clean = {
        "logits": rng.standard_normal((2, 3, 5)),
        **{
            f"present.{layer}.{kind}": rng.standard_normal((2, 2, 3, 4))
            for layer in range(3)
            for kind in ("key", "value")
        },
    }
    profile = profile_for("float32", CPU)
    rows = compare_outputs("x", clean, clean, profile, mask)
    assert [r.name for r in rows] == ["x logits", "x present (all layers)"] and all(rows)
    for name in clean:
        faulty = {**clean, name: clean[name].copy()}
        faulty[name][1, ..., 0, 0] += 0.1  # row 1, first position or query: real
        rows = compare_outputs("x", faulty, clean, profile, mask)
        assert [r.passed for r in rows] == ([False, True] if name == "logits" else [True, False]), name
        assert name == "logits" or rows[1].worst == f"x {name}"


def test_loss_metrics_and_aggregate():
    loss = compare("loss", "loss", 2.0, 1.9, Tolerance(1e-3, 0))
    assert loss.llm["loss_abs_diff"] == pytest.approx(0.1) and loss.llm["perplexity_ratio"] == pytest.approx(
        np.exp(0.1)
    )
    rows = [compare("a", "kv", [1.0], [1.0], Tolerance(0.1, 0)), compare("b", "kv", [1.5], [1.0], Tolerance(0.1, 0))]
    total = aggregate("all", rows)
    assert not total.passed and total.worst == "b" and total.max_abs == pytest.approx(0.5)
    assert total.needed.scale == pytest.approx(5.0)
    assert match_length([1, 2, 3], [1, 2, 4]) == 2 and match_length([1], [1, 2]) == 1


def test_a_comparisons_multiple_is_its_error_over_what_its_own_judgement_allows():
    tol = Tolerance(atol=0.1, rtol=0.0)
    plain = compare("a", "kv", [1.0, 1.09], [1.0, 1.0], tol)
    assert plain.passed and plain.multiple == pytest.approx(0.9)  # |0.09| of 0.1 allowed
    assert plain.to_dict()["multiple"] == pytest.approx(0.9)
    # beyond its fixed tolerance (4x), passed by the float64 referee at 8x the reference's error of a 16x limit
    failed = compare("b", "kv", [1.4], [1.0], tol)
    judged = refereed(failed, Refereed(onnx_error=0.4, reference_error=0.05, ratio=8.0, limit=16.0, dtype="float32"))
    assert failed.multiple == pytest.approx(4.0) and judged.passed and judged.multiple == pytest.approx(0.5)
    # an aggregate: its worst member's multiple, each member judged its own way (not the fixed 4x of the refereed
    # one, nor the referee's 0.5 alone, which would hide the other member's 0.9)
    assert aggregate("all", [plain, judged]).multiple == pytest.approx(0.9)
    assert aggregate("all", [plain, failed]).multiple == pytest.approx(4.0)
    nothing = compare("c", "kv", [1.0], [1.0], tol, valid=np.array([False]))
    assert not nothing.passed and np.isnan(nothing.multiple)
    assert aggregate("all", [nothing, plain]).multiple == pytest.approx(0.9)


def test_difference_histogram_counts_zeros_and_non_finite_apart():
    expected = np.zeros(6)
    actual = np.array([0.0, 1e-3, 2e-3, 1.0, np.nan, np.inf])
    h = difference_histogram(actual, expected, bins=3)
    assert (h["zeros"], h["non_finite"], sum(h["counts"])) == (1, 2, 3)
    assert h["edges"][0] <= 1e-3 and h["edges"][-1] >= 1.0
    assert difference_histogram([np.nan, 0.0], [1.0, 0.0]) == {"zeros": 1, "non_finite": 1, "edges": [], "counts": []}


def test_profiles_differ_by_dtype_and_provider():
    assert profile_for("float32", CPU).logits == Tolerance(0.0, 0.0, 512 * 2.0**-24)  # the peak term alone
    assert profile_for("float16", CPU).logits.peak == 16 * 2.0**-11
    # float32 on CUDA runs with TF32 off: float32 on both sides, as on the CPU
    assert profile_for("float32", CUDA).logits == profile_for("float32", CPU).logits
    assert session_providers(CUDA) == [(CUDA, {"use_tf32": "0"}), CPU] and session_providers(CPU) == [CPU]
    assert profile_for("float32", "SomeOtherProvider") == profile_for("float32", CPU)


def test_the_float32_profile_passes_float32_rounding_and_fails_a_ten_thousandth(tiny_model):
    # The reference's own float32 error (against float64) must pass; logits scaled by 1.0001, what one
    # weight matrix off by a relative 1e-4 does, must not (the former profile's 1e-4 + 1e-4|x| let it pass).
    import copy

    import torch

    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = tiny_model(ids).logits.numpy()
        exact = copy.deepcopy(tiny_model).double()(ids).logits.numpy()
    tolerance = profile_for("float32", CPU).logits
    assert compare("float32 vs float64", "logits", logits, exact, tolerance).passed
    assert not compare("scaled by 1.0001", "logits", logits * np.float32(1.0001), logits, tolerance).passed


def test_overrides_from_options_and_files(tmp_path):
    overrides = parse_overrides(atol=["logits=1e-3"], rtol=["kv=0"])
    profile = overrides.apply(profile_for("float32"))
    assert profile.logits.atol == 1e-3 and profile.kv.rtol == 0 and profile.loss == profile_for("float32").loss
    assert profile.overridden == ("logits.atol", "kv.rtol")
    (tmp_path / "t.json").write_text(json.dumps({"loss": {"atol": 0.5}}))
    (tmp_path / "t.toml").write_text("[kv]\npeak = 0.25\n")
    assert parse_overrides(file=tmp_path / "t.json").apply(profile_for("float16")).loss.atol == 0.5
    assert parse_overrides(file=tmp_path / "t.toml").apply(profile_for("float16")).kv.peak == 0.25
    for bad in (
        dict(atol=["logits"]),
        dict(atol=["weights=1"]),
        dict(rtol=["kv=abc"]),
        dict(peak=["kv=-1"]),
        dict(file=tmp_path / "missing.json"),
    ):
        with pytest.raises(InputError):
            parse_overrides(**bad)
    # the shared JSON-object reader's three refusals, each naming the file, the format and the fix
    (tmp_path / "bad.toml").write_text("[kv\n")
    (tmp_path / "list.json").write_text("[1]")
    for name, said in (
        ("missing.json", "is not a readable JSON file (No such file or directory)"),
        ("bad.toml", "is not a readable TOML file ("),
        ("list.json", "holds a JSON array, not a JSON object"),
    ):
        with pytest.raises(InputError, match=re.escape(f"tolerance file {tmp_path / name} {said}")) as info:
            parse_overrides(file=tmp_path / name)
        assert str(info.value).endswith('; give a JSON or .toml file like {"logits": {"atol": 1e-3}}'), info.value
    # a str is one term, not one term per character; a kind given twice with two values is refused, not the last
    # one kept
    assert parse_overrides(atol="logits=1e-3") == parse_overrides(atol=["logits=1e-3"])
    with pytest.raises(
        InputError,
        match=r"^`atol` logits=2: logits's atol is given twice \(1 and 2\); "
        "give it once$",
    ):
        parse_overrides(atol=["logits=1", "logits=2"])
    # a misspelt term in a file is refused by its name
    (tmp_path / "typo.json").write_text(json.dumps({"logits": {"atol": 1e-3, "atl": 1e-3}}))
    with pytest.raises(
        InputError,
        match=re.escape(f"{tmp_path / 'typo.json'}: logits holds an unknown term 'atl'; choose among atol, rtol, peak"),
    ):
        parse_overrides(file=tmp_path / "typo.json")


def test_the_float16_and_loss_profiles_fail_what_their_reasoning_says_they_catch(tiny_model):
    # The float32 logits profile is pinned above; this pins the float16 profile and both loss profiles, so that
    # none of their terms can be loosened with every test still passing. Each is held to its stated reasoning:
    # float16's own rounding passes, an error float16's 11 bits cannot explain fails; a loss fails well before
    # a perplexity change anyone would notice.
    import copy

    import torch

    u16 = 2.0**-11
    assert profile_for("float16", CPU).logits == profile_for("float16", CPU).kv == Tolerance(1e-3, 4 * u16, 16 * u16)
    assert profile_for("float16", CPU).loss == Tolerance(2e-3, 4 * u16)
    assert profile_for("float32", CPU).loss == Tolerance(1e-5, 1e-5)
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, half = tiny_model(ids, labels=ids), copy.deepcopy(tiny_model).half()(ids, labels=ids)
    logits32, logits16 = full.logits.numpy(), half.logits.float().numpy()
    loss32, loss16 = full.loss.item(), half.loss.float().item()
    float16 = profile_for("float16", CPU)
    assert compare("float16 vs float32", "logits", logits16, logits32, float16.logits).passed
    assert compare("float16 vs float32", "loss", loss16, loss32, float16.loss).passed
    # 1 + 2^-6 is 32 float16 units: no rounding of float16 gives it (measured: float16 is 0.3x its tolerance)
    assert not compare("scaled", "logits", logits16 * np.float32(1 + 2.0**-6), logits16, float16.logits).passed
    assert not compare("loss + 0.05", "loss", loss16 + 0.05, loss16, float16.loss).passed  # perplexity +5%
    float32 = profile_for("float32", CPU)
    assert not compare("loss + 1e-3", "loss", loss32 + 1e-3, loss32, float32.loss).passed  # perplexity +0.1%
