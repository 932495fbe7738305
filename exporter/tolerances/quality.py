"""The quality profiles of weight-only quantized artifacts: the distributional metrics (KL, top-1, perplexity) an
int4/int8 artifact is judged by against the float reference, their limits with the reasoning, the statistics'
confidence, and the thresholds of a quality target an export was made to.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.artifact.quantization import QualityTarget

# ------------------------------------------------------------------------------------- quantized artifacts
#
# A weight-only quantized artifact (manifest `quantization`) cannot meet a float32 profile: rounding every weight to
# 4 or 8 bits moves the logits by far more than float32's rounding, by design. It is judged instead by how far its
# next-token distributions lie from the float32 PyTorch reference's, with the statistics llama.cpp's
# `perplexity --kl-divergence` reports for its quantization types (mean and 99th-percentile KL divergence per token,
# "same top p", the change in perplexity), plus the top-5 overlap, the change of the log-probability the reference
# gives its own top token, and how many greedy tokens agree. The anchors are llama.cpp's published figures for
# 7-8B models on wikitext (its perplexity README and the KL tables of its quantization pull requests):
# Q8_0 (8 bits, blocks of 32, one scale) mean KL ~5e-4 to 1e-3, 99% KL ~5e-3 to 1e-2, same top ~98.5-99.5%,
# ΔPPL ~+0.01-0.1%; Q4_0/Q4_1 (4 bits, blocks of 32; Q4_1 with a minimum, as our asymmetric blocks) mean KL
# ~0.03-0.07, 99% KL ~0.3-0.6, same top ~90-93%, ΔPPL ~+2-6%. Our int8 and int4 are those block formats (round to
# nearest, block 32 by default), so each limit is the anchor's worse end with a margin of about 2-5x for the
# spread between models and texts: a correct export of a normal model lies well inside, while a broken one (a scale
# or zero point off, a block misaligned, the wrong matrix) moves the distributions by O(1) nats.


@dataclass(frozen=True)
class QualityThreshold:
    """One distributional metric's limit: `metric` must be <= `limit` ("at most"), >= it ("at least"), or within
    +-`limit` ("within +-": a change that is suspect either way)."""

    metric: str
    limit: float
    bound: str  # "at most", "at least" or "within +-"
    why: str

    def holds(self, value: float) -> bool:
        if self.bound == "within +-":
            return abs(value) <= self.limit
        return value <= self.limit if self.bound == "at most" else value >= self.limit

    def holds_over(self, low: float, high: float) -> bool | None:
        """Whether the limit holds over the whole interval [low, high] (True), at none of it (False), or at part
        of it (None: the interval straddles the limit). The values that hold form one interval, so both ends
        holding means all of it does."""
        if self.holds(low) and self.holds(high):
            return True
        if self.bound == "within +-":
            apart = high < -self.limit or low > self.limit
        else:
            apart = not self.holds(low if self.bound == "at most" else high)
        return False if apart else None

    def multiple(self, value: float) -> float:
        """`value`'s error in multiples of what the limit allows, at most 1 exactly where it holds: value / limit
        ("at most"), |value| / limit ("within +-"); an "at least" limit is on a share of agreement (top-1, top-5,
        greedy tokens), whose error is its shortfall from full agreement: (1 - value) / (1 - limit)."""
        if self.bound == "at least":
            return (1 - value) / (1 - self.limit)
        return (abs(value) if self.bound == "within +-" else value) / self.limit

    def to_dict(self) -> dict:
        return {"metric": self.metric, "limit": self.limit, "bound": self.bound, "why": self.why}


@dataclass(frozen=True)
class QualityProfile:
    """The distributional limits of one quantization scheme, with their reasoning."""

    name: str
    thresholds: tuple[QualityThreshold, ...]
    why: str

    def to_dict(self) -> dict:
        return {"name": self.name, "thresholds": [t.to_dict() for t in self.thresholds], "why": self.why}


_QUALITY_WHY = (
    "weight-only {scheme}: judged by distributional distance from the float32 PyTorch reference, anchored on "
    "llama.cpp's perplexity --kl-divergence figures for {anchor} (limits = the anchor's worse end x2-5)"
)
GREEDY_QUALITY_TOKENS = 64  # the greedy run of a quality profile, fitted to the model's positions
# Top-1 agreement, top-5 overlap and the greedy run measure how often the quantization flips the reference's choice,
# which depends on how decisive the reference is as much as on the quantization: at a near-tie any perturbation
# flips it. llama.cpp's "same top p" is measured on trained models over real text, where most positions are
# decisive. They are judged here at the positions where the reference's top token leads the runner-up by at least
# DECISIVE_MARGIN nats (1.65x its probability): int4's measured |Δ log p| of the top token is ~0.15 nats (tiny
# random model, block 32), so two tokens' log-probabilities drifting independently differ by ~0.2; 0.5 nats is
# ~2.5 of those, beyond which a flip is the export's doing rather than a coin toss. A randomly initialised model is
# nearly uniform (top token ~2% on 512 tokens, median margin ~0.18 nats): with fewer than MIN_DECISIVE_POSITIONS
# decisive positions these checks are reported as not judged, and KL and ΔNLL alone judge it. On the trained fixture
# (tests/fixtures/minimind-3-stdlib, benchmarks/quality.py) ~48% of positions are decisive, int4's |Δ log p| is
# ~0.04-0.06 and every top-1 flip falls below the margin (top-1 96.7% overall, 100% at decisive positions); its
# KL lies 40-100x inside the limits below, which stay anchored on llama.cpp's figures for real models.
DECISIVE_MARGIN = 0.5
MIN_DECISIVE_POSITIONS = 16
# Each figure averaged over positions is judged by its bootstrap confidence interval, as llama.cpp's perplexity
# --kl-divergence gives each figure with its uncertainty: a figure passes where the whole interval keeps its limit,
# fails where none of it does, and is undecided where the interval straddles the limit (more positions, a longer
# text, decide it). 95% over 1000 resamples: the interval's ends move by about 2% of its width from one seed of the
# resampling to another.
#
# What is resampled: the positions of one window share its context (a hard passage makes every position after it
# harder), so they do not vary independently, and resampling positions one by one understates a figure's spread
# between texts; on real text one window's mean KL can be several times another's (the real model's figures in
# benchmarks/FRONTIER-RESULTS.md). A text's windows are therefore what is resampled (a cluster bootstrap) once there
# are MIN_BOOTSTRAP_WINDOWS of them: k windows give C(2k-1, k) distinct resamples, 6435 at k = 8, so that 1000
# resamples give quantiles that are not a handful of repeated values. Below it (a short text, or the random ids' few
# batch rows) the positions are resampled, and the report says which.
MIN_BOOTSTRAP_WINDOWS = 8
QUALITY_CONFIDENCE = 0.95
QUALITY_RESAMPLES = 1000

QUALITY_PROFILES: dict[str, QualityProfile] = {
    "int8": QualityProfile(
        "int8 quality",
        (
            QualityThreshold("kl_mean", 5e-3, "at most", "Q8_0: mean KL 5e-4..1e-3; x5"),
            QualityThreshold("kl_p99", 5e-2, "at most", "Q8_0: 99% KL 5e-3..1e-2; x5"),
            QualityThreshold(
                "top1_agreement_decisive", 0.97, "at least", "Q8_0: same top p 98.5-99.5%; 1.5 points lower"
            ),
            QualityThreshold(
                "top5_overlap_decisive", 0.97, "at least", "as top-1, at positions whose 5th token leads the 6th"
            ),
            QualityThreshold(
                "top_logprob_delta_mean",
                0.045,
                "at most",
                "|Δ log p| of the reference's top token; of the order of sqrt(2 x mean KL) for small shifts: "
                "sqrt(2 x 1e-3) at Q8_0's worse end",
            ),
            QualityThreshold(
                "nll_delta",
                0.01,
                "within +-",
                "Q8_0: ΔPPL +0.01..0.1%; 1% perplexity (0.01 nats) is 10x that, either way: a loss that drops by more "
                "than the scheme's noise is no better model but a different one (a scale or a head changed)",
            ),
            QualityThreshold(
                "greedy_agreement",
                0.25,
                "at least",
                "share of the 64 greedy tokens equal before the first difference; with same top p ~99% per step, "
                "an expected first flip after ~100 tokens, yet one near-tie ends it early: a quarter",
            ),
        ),
        _QUALITY_WHY.format(scheme="int8 (8-bit blocks, a scale and a zero point each)", anchor="Q8_0"),
    ),
    "int4": QualityProfile(
        "int4 quality",
        (
            QualityThreshold("kl_mean", 0.15, "at most", "Q4_0/Q4_1: mean KL 0.03..0.07; x2-5"),
            QualityThreshold("kl_p99", 1.5, "at most", "Q4_0/Q4_1: 99% KL 0.3..0.6; x2.5-5"),
            QualityThreshold(
                "top1_agreement_decisive", 0.85, "at least", "Q4_0/Q4_1: same top p 90-93%; 5 points lower"
            ),
            QualityThreshold(
                "top5_overlap_decisive", 0.85, "at least", "as top-1, at positions whose 5th token leads the 6th"
            ),
            QualityThreshold(
                "top_logprob_delta_mean",
                0.25,
                "at most",
                "|Δ log p| of the reference's top token; of the order of sqrt(2 x mean KL) for small shifts: "
                "sqrt(2 x 0.03) at Q4's better end, as the top token moves less than the tail",
            ),
            QualityThreshold(
                "nll_delta",
                0.10,
                "within +-",
                "Q4_0/Q4_1: ΔPPL +2..6%; 10% perplexity (0.1 nats), either way (as int8's)",
            ),
            QualityThreshold(
                "greedy_agreement",
                1 / 16,
                "at least",
                "share of the 64 greedy tokens equal before the first difference; with same top p ~90% per step "
                "the first flip is expected after ~10 tokens, so only the first few (4 of 64) are required",
            ),
        ),
        _QUALITY_WHY.format(scheme="int4 (4-bit blocks, a scale and a zero point each)", anchor="Q4_0/Q4_1"),
    ),
}


# An artifact made to a quality target (exporter.tuning: `export --quality-target kl=X[,top1=Y]`) is judged by the
# target in place of the profile's limits on the same figures: the target is the user's statement of the loss they
# accept, which the export measured on held-out text and records. Its mean KL is held to X, and its top-1 agreement
# over every position, where given, to Y. The profile's other limits stay: they catch a broken export, which moves
# every figure by O(1) nats, whatever the target.
TARGET_WHY = "the quality target the export was made to (exporter.tuning), in place of the profile's limit"


def target_thresholds(target: QualityTarget) -> tuple[QualityThreshold, ...]:
    """A quality target's limits as thresholds of the quality check's figures, in target.limits()' order."""
    bounds = {"kl_mean": "at most", "top1_agreement": "at least"}
    return tuple(
        QualityThreshold(metric, limit, bounds[metric], TARGET_WHY) for metric, limit in target.limits().items()
    )


def quality_profile_for(scheme: str, target: QualityTarget | None = None) -> QualityProfile:
    """The quality profile of a quantization scheme ("int4", "int8"), with `target`'s limits in place of the
    profile's on the same figures where the artifact was made to one; the provider does not change it: the
    quantization's error dwarfs any provider's rounding."""
    profile = QUALITY_PROFILES[scheme]
    if target is None:
        return profile
    added = target_thresholds(target)
    kept = tuple(t for t in profile.thresholds if t.metric not in target.limits())
    return QualityProfile(
        f"{profile.name}, target {target.describe()}",
        added + kept,
        f"{profile.why}; the export's quality target {target.describe()} in place of its limits on those figures",
    )
