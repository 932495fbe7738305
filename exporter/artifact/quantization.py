"""Weight-only quantization as the manifest records it: the scheme an export applied, and its checks.

A quantized artifact computes in float32 (manifest `dtype` "float32": activations and cache), or in float16 where it
was exported for a GPU (`dtype` "float16"); its MatMul weights are stored as onnxruntime's MatMulNBits blocks (`bits`
per weight, one scale in the activations' type and one zero point per `block_size` consecutive weights along the
reduced axis), and its token embedding, unless kept float, as
GatherBlockQuantized rows in the same layout (blocks along the hidden axis). The manifest's optional `quantization`
field says so; a manifest without it is a float artifact, as every manifest written before the field existed.

An export made to a quality target (exporter.tuning) records its mix: the modules it kept at other precisions than
the scheme's (ModulePrecision: bits or float, accuracy level, algorithm), and the target with the figures it
measured on held-out text (QualityTarget).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from exporter.artifact.contract import DTYPES
from exporter.errors import InputError

SCHEMES = {"int4": 4, "int8": 8}  # the --dtype values that quantize, and their bits
# What a quantized artifact computes in, and what its cache holds, unless asked otherwise: float32, for the CPU, whose
# MatMulNBits kernels compute in float32 or int8; float16 is for CUDA, where activations and cache in float16 halve
# what every step reads besides the weights.
DEFAULT_ACTIVATIONS = "float32"
# Weights per scale by default: 32 for int4, as onnxruntime-genai's builder and llama.cpp's Q4_0 and Q8_0; 16 for
# int8, whose 8-bit projections' inputs accuracy level 4 rounds to int8 a block at a time by the block's largest
# element: at 16, half as many inputs share each rounding. int8 is the near-lossless scheme, and on a trained model
# whose activations carry outliers (SmolLM2-135M) its profile holds, with smoothing (SMOOTHING_BITS), at 16 and not
# at 32 (benchmarks/FRONTIER-RESULTS.md); the cost is a scale and a zero point per 16 weights rather than 32.
DEFAULT_BLOCK_SIZES = {"int4": 32, "int8": 16}
MIN_BLOCK_SIZE = 16  # MatMulNBits takes power-of-two blocks of at least 16
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits' accuracy_level: 0 unset (float32 math), 4 int8 math on the CPU
# Level 4 by default, as onnxruntime-genai's builder writes int4 for the CPU: onnxruntime's CPU MatMulNBits is fast
# only there (its float32-math kernels decode a 4-bit minimind-3 slower than the float32 artifact does, see
# benchmarks/QUANTIZED-RESULTS.md); the quality profile judges what its int8 activations cost. CUDA ignores it.
# int8 keeps level 4 too, its inputs smoothed (SMOOTHING_BITS) in blocks of 16 (DEFAULT_BLOCK_SIZES): onnxruntime's
# CPU kernel for 8-bit blocks in float math (level 0) decodes slower than the float32 artifact, which would leave
# int8 worth nothing but its bytes.
DEFAULT_ACCURACY_LEVEL = 4
# The embedding's or the lm_head's weights: kept float, at 8 bits, or at the scheme's bits.
TABLE_CHOICES = ("float", "int8", "same")
DEFAULT_LM_HEAD = "int8"
# The embedding at 8 bits by default: its rows are read once per token, so its bits cost no compute, and its 8-bit
# rounding (at most half a step of 1/255 of a block's range) stays far below the 4-bit projections'. Kept float, the
# table of a large vocabulary alone exceeds what an int4 artifact aims at (Qwen3-0.6B's is 0.26x of its float32
# bytes, against 0.2x for the whole artifact). A tied table at the lm_head's bits is stored once, read by both.
DEFAULT_EMBEDDING = "int8"
EMBEDDING_BEFORE_THE_FIELD = "float"  # what a manifest written before `embedding` was recorded did with it
QUANTIZED_OP = "MatMulNBits"
GATHER_OP = "GatherBlockQuantized"  # the quantized embedding's lookup (com.microsoft)
QUANTIZED_OPS = (QUANTIZED_OP, GATHER_OP)
# How a matrix's blocks are made: "rtn", onnxruntime's round-to-nearest (DefaultWeightOnlyQuantConfig); "hqq", its
# half-quadratic solver (HQQWeightOnlyQuantConfig): each block's scale spans the block's range, and the solver fits
# its zero point, stored as a float, to the weights. HQQ makes the 4-bit matrices only: 8-bit blocks (an int8 scheme,
# an lm_head or embedding at int8) stay round-to-nearest. A solver wins at 8 bits too where the weights lie on a
# coarser affine grid (a GGUF's Q4_1 blocks, whose float zero points integer ones miss by up to half a step), but an
# int8 scheme at level 4 smooths its weights off any grid, and at level 0 onnxruntime's 8-bit kernel decodes slower
# than float32. onnxruntime's GPTQ (its bundled neural-compressor code) is not offered: on the frontier's two trained
# models it measured no better than round-to-nearest (benchmarks/FRONTIER-RESULTS.md's models; see git history).
ALGORITHMS = ("rtn", "hqq")
DEFAULT_ALGORITHM = "rtn"
HQQ_BITS = 4
# Smoothing (SmoothQuant, Xiao et al. 2023) moves the outliers of a projection's input into its weights before they
# are quantized: the graph divides the input by a factor per channel, and the weights' rows along that channel are
# multiplied by it, x @ W = (x / s) @ (s · W), s = max|x|^alpha / max|W|^(1 - alpha) per channel, max|x| measured on
# calibration text. Accuracy level 4 quantizes each block of the input to int8 by its largest element, so one
# outlier channel costs its block's other channels their precision; spread over the weights, whose 8-bit rounding has
# steps to spare, it costs far less. It is the int8 scheme's default at level 4 only: at level 0 the input is not
# rounded, and at 4 bits the weights' rounding dominates, which the migrated outliers make worse.
SMOOTHING_BITS = 8
SMOOTHING_LEVEL = 4
DEFAULT_SMOOTHING = 0.5  # alpha, the migration strength: SmoothQuant's default
NO_SMOOTHING = "none"


@dataclass(frozen=True)
class ModulePrecision:
    """One module's weights at another precision than its scheme's, in an export made to a quality target.

    module: the reference module, e.g. "model.layers.3.mlp.down_proj"; bits: 4 or 8, None: kept float;
    accuracy_level: its MatMulNBits' (not read when float); algorithm: one of ALGORITHMS.
    """

    module: str
    bits: int | None
    accuracy_level: int = 0
    algorithm: str = DEFAULT_ALGORITHM

    @property
    def precision(self) -> str:
        """ "int4", "int8" or "float"."""
        return "float" if self.bits is None else f"int{self.bits}"

    def to_dict(self) -> dict:
        return {
            "module": self.module,
            "bits": self.bits,
            "accuracy_level": self.accuracy_level,
            "algorithm": self.algorithm,
        }

    @classmethod
    def from_dict(cls, data: dict) -> ModulePrecision:
        return cls(data["module"], data["bits"], data.get("accuracy_level", 0), data.get("algorithm", "rtn"))

    def problem(self) -> str | None:
        if self.bits not in (None, *SCHEMES.values()):
            return f"quantization mix: {self.module} has bits {self.bits!r}, none of 4, 8 or null (float)"
        if self.accuracy_level not in ACCURACY_LEVELS:
            return f"quantization mix: {self.module} has an unknown accuracy_level {self.accuracy_level!r}"
        if self.algorithm not in ALGORITHMS:
            return f"quantization mix: {self.module} has algorithm {self.algorithm!r}, none of {', '.join(ALGORITHMS)}"
        if self.algorithm == "hqq" and self.bits != HQQ_BITS:
            return f"quantization mix: {self.module} has algorithm hqq at {self.precision}; hqq makes int4 blocks only"
        return None


@dataclass(frozen=True)
class Smoothing:
    """How an int8 export smoothed its projections' inputs (module comment at SMOOTHING_BITS): `alpha` the migration
    strength, `calibration` what the inputs' channel maxima were measured on."""

    alpha: float
    calibration: str

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "calibration": self.calibration}

    @classmethod
    def from_dict(cls, data: dict) -> Smoothing:
        return cls(data["alpha"], data.get("calibration", ""))


@dataclass(frozen=True)
class QualityTarget:
    """The quality an export was made to: mean KL(float || artifact) per token at most `kl`, and top-1 agreement
    at least `top1` (None: not asked), with what the export measured on held-out text (`measured`: "kl_mean",
    "kl_mean_interval", "kl_p99", "top1_agreement", "positions", "text", "part"; empty until measured)."""

    kl: float
    top1: float | None = None
    measured: dict = field(default_factory=dict, compare=False)

    def limits(self) -> dict[str, float]:
        """{metric: limit} of the quality check's figures the target bounds: "kl_mean" at most, "top1_agreement"
        at least."""
        return {"kl_mean": self.kl, **({"top1_agreement": self.top1} if self.top1 is not None else {})}

    def describe(self) -> str:
        return f"kl={self.kl:g}" + (f",top1={self.top1:g}" if self.top1 is not None else "")

    def to_dict(self) -> dict:
        return {"kl_mean": self.kl, "top1_agreement": self.top1, "measured": dict(self.measured)}

    @classmethod
    def from_dict(cls, data: dict) -> QualityTarget:
        return cls(data["kl_mean"], data.get("top1_agreement"), dict(data.get("measured") or {}))


def parse_quality_target(text: str) -> QualityTarget:
    """`kl=X[,top1=Y]` (X > 0, 0 < Y <= 1) as a QualityTarget, or InputError naming what is wrong."""
    fields: dict[str, float] = {}
    for item in str(text).split(","):
        name, sep, value = item.strip().partition("=")
        name = name.strip()
        if not sep or name not in ("kl", "top1") or name in fields:
            raise InputError(
                f"quality target {text!r}: expected kl=X[,top1=Y], each once, e.g. kl=0.1 or kl=0.05,top1=0.9 "
                "(`quality_target`)"
            )
        try:
            fields[name] = float(value)
        except ValueError:
            raise InputError(f"quality target {text!r}: {name}={value.strip()!r} is not a number (`quality_target`)")
    if "kl" not in fields:
        raise InputError(f"quality target {text!r}: kl=X is required, e.g. kl=0.1 (`quality_target`)")
    kl, top1 = fields["kl"], fields.get("top1")
    if not 0 < kl < float("inf"):
        raise InputError(f"quality target {text!r}: kl must be a finite number > 0 (`quality_target`)")
    if top1 is not None and not 0 < top1 <= 1:
        raise InputError(f"quality target {text!r}: top1 must lie in (0, 1], a share of positions (`quality_target`)")
    return QualityTarget(kl, top1)


@dataclass(frozen=True)
class Quantization:
    """The scheme of a quantized artifact (manifest.json's `quantization`).

    scheme: "int4" or "int8"; bits: 4 or 8 (the lm_head and the embedding may carry 8 under int4);
    block_size: weights per scale; accuracy_level: MatMulNBits' (0: float math in the activations' type);
    symmetric: False, each block has a zero point; lm_head, embedding: "float", "int8" or "same" as asked;
    kept_float: the modules whose weights stay float, with why; matrices: weight matrices quantized (a tied table
    held once for the lm_head and the embedding counts once); float_bytes: their bytes before, in the graphs' dtype;
    quantized_bytes: their blocks, scales and zero points after; mix: the modules at another precision than the
    scheme's (an export made to a quality target); target: that target with its held-out figures, None if none;
    algorithm: how the scheme's 4-bit matrices are made (ALGORITHMS; a manifest without it: "rtn");
    smoothing: how the inputs of its 8-bit projections at accuracy level 4 were smoothed (`smooths`), None: not.
    """

    scheme: str
    bits: int
    block_size: int
    accuracy_level: int
    lm_head: str
    embedding: str = EMBEDDING_BEFORE_THE_FIELD
    symmetric: bool = False
    kept_float: tuple[str, ...] = ()
    matrices: int = 0
    float_bytes: int = 0
    quantized_bytes: int = 0
    mix: tuple[ModulePrecision, ...] = ()
    target: QualityTarget | None = None
    algorithm: str = DEFAULT_ALGORITHM
    smoothing: Smoothing | None = None

    @property
    def levels(self) -> set[int]:
        """Every accuracy level its MatMulNBits nodes carry: the scheme's and its mix's quantized modules'."""
        return {self.accuracy_level} | {m.accuracy_level for m in self.mix if m.bits is not None}

    def precision_of(self, module: str) -> ModulePrecision | None:
        """The mix's entry for `module`, None where it has the scheme's precision."""
        return next((m for m in self.mix if m.module == module), None)

    def algorithm_for(self, module: str, bits: int) -> str:
        """How the `bits`-bit blocks of `module` are made: its mix entry's algorithm, else the scheme's for 4-bit
        blocks; 8-bit blocks are round-to-nearest (ALGORITHMS)."""
        entry = self.precision_of(module)
        if entry is not None and entry.bits == bits:
            return entry.algorithm
        return self.algorithm if bits == HQQ_BITS else DEFAULT_ALGORITHM

    def smooths(self, module: str) -> bool:
        """Whether the projection `module` (not the lm_head) has its input smoothed: with smoothing recorded, where
        its blocks (the mix's, else the scheme's) are 8-bit at accuracy level 4."""
        entry = self.precision_of(module)
        bits, level = (self.bits, self.accuracy_level) if entry is None else (entry.bits, entry.accuracy_level)
        return self.smoothing is not None and bits == SMOOTHING_BITS and level == SMOOTHING_LEVEL

    @property
    def ratio(self) -> float:
        """The quantized matrices' bytes over their float bytes."""
        return self.quantized_bytes / self.float_bytes if self.float_bytes else 0.0

    def bits_for(self, choice: str) -> int | None:
        """The bits an lm_head or embedding choice ("float", "int8", "same") gives under this scheme; None: float."""
        return {"float": None, "int8": 8, "same": self.bits}[choice]

    def to_dict(self) -> dict:
        return {
            "scheme": self.scheme,
            "op": QUANTIZED_OP,
            "bits": self.bits,
            "block_size": self.block_size,
            "accuracy_level": self.accuracy_level,
            "symmetric": self.symmetric,
            "lm_head": self.lm_head,
            "embedding": self.embedding,
            "kept_float": list(self.kept_float),
            "matrices": self.matrices,
            "float_bytes": self.float_bytes,
            "quantized_bytes": self.quantized_bytes,
            **({"mix": [m.to_dict() for m in self.mix]} if self.mix else {}),
            **({"target": self.target.to_dict()} if self.target is not None else {}),
            "algorithm": self.algorithm,
            **({"smoothing": self.smoothing.to_dict()} if self.smoothing is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Quantization:
        return cls(
            scheme=data["scheme"],
            bits=data["bits"],
            block_size=data["block_size"],
            accuracy_level=data["accuracy_level"],
            lm_head=data["lm_head"],
            embedding=data.get("embedding", EMBEDDING_BEFORE_THE_FIELD),
            symmetric=data.get("symmetric", False),
            kept_float=tuple(data.get("kept_float", ())),
            matrices=data.get("matrices", 0),
            float_bytes=data.get("float_bytes", 0),
            quantized_bytes=data.get("quantized_bytes", 0),
            mix=tuple(ModulePrecision.from_dict(m) for m in data.get("mix", ())),
            target=QualityTarget.from_dict(data["target"]) if data.get("target") is not None else None,
            algorithm=data.get("algorithm", DEFAULT_ALGORITHM),
            smoothing=Smoothing.from_dict(data["smoothing"]) if data.get("smoothing") is not None else None,
        )

    def problem(self) -> str | None:
        """What in a manifest's record cannot be right, or None."""
        if self.scheme not in SCHEMES or self.bits != SCHEMES[self.scheme]:
            return f"quantization scheme {self.scheme!r} with {self.bits!r} bits is none of {_schemes()}"
        if block_size_problem(self.block_size):
            return f"quantization.{block_size_problem(self.block_size)}"
        if self.accuracy_level not in ACCURACY_LEVELS:
            return f"quantization accuracy_level {self.accuracy_level!r} is unknown"
        for name, choice in (("lm_head", self.lm_head), ("embedding", self.embedding)):
            if choice not in TABLE_CHOICES:
                return f"quantization {name} {choice!r} is none of {', '.join(TABLE_CHOICES)}"
        if self.algorithm not in ALGORITHMS:
            return f"quantization algorithm {self.algorithm!r} is none of {', '.join(ALGORITHMS)}"
        if self.smoothing is not None and alpha_problem(self.smoothing.alpha):
            return f"quantization smoothing {alpha_problem(self.smoothing.alpha)}"
        return next((problem for m in self.mix if (problem := m.problem())), None)


@dataclass(frozen=True)
class QuantizationSettings:
    """What an int4/int8 export is asked for (export_artifact's `quantization`); None takes the default, and a float
    dtype takes none of them (InputError names the one given).

    block_size: the weights per scale: a power of two >= 16 dividing the hidden size (None: DEFAULT_BLOCK_SIZES
        of the scheme: 32 for int4, 16 for int8).
    accuracy_level: MatMulNBits' accuracy_level (0: float32 math; 4, the default: int8 math on the CPU).
    lm_head: the lm_head's weights, tied or not: "int8" (default), "float", or "same" (the scheme's bits). The
        vocabulary-wide projection is the most sensitive one: its error moves every logit.
    embedding: the token embedding's weights, as onnxruntime's GatherBlockQuantized: "int8" (default), "float", or
        "same". Its rows are read once per token, so their bits cost no compute and 8 bits cost little size, while a
        float table (vocabulary x hidden size) can outweigh the quantized rest of a model with a large vocabulary;
        onnxruntime-genai's builder keeps an untied embedding float and llama.cpp's Q4_K_M keeps a tied one at 6
        bits, both above the 4 bits of the projections. A tied table at the same bits as the lm_head is stored once,
        read by both.
    activations: what the graphs compute in and the cache holds: "float32" (None, the default: for the CPU, whose
        MatMulNBits kernels compute in float32 or int8) or "float16" (for CUDA: half the bytes of every activation
        and of the cache, the scales in float16 too). A float dtype computes in itself.
    algorithm: how the 4-bit matrices' blocks are made, one of ALGORITHMS (None: "rtn"); "hqq" needs int4.
    smoothing: the migration strength alpha (0 < alpha <= 1) of the smoothing of the 8-bit projections' inputs at
        accuracy level 4 (module comment at SMOOTHING_BITS), or NO_SMOOTHING; None: DEFAULT_SMOOTHING for int8 at
        level 4, none otherwise. Only int8 at level 4 takes a value.
    """

    block_size: int | None = None
    accuracy_level: int | None = None
    lm_head: str | None = None
    embedding: str | None = None
    activations: str | None = None
    mix: tuple[ModulePrecision, ...] = ()
    algorithm: str | None = None
    smoothing: float | str | None = None


def block_inputs(node) -> list[str]:
    """The inputs of a MatMulNBits or GatherBlockQuantized node (an onnx NodeProto) that hold its quantized matrix:
    blocks, scales and, where present, zero points, in that order."""
    names = node.input[1:4] if node.op_type == QUANTIZED_OP else [node.input[0], *node.input[2:4]]
    return [name for name in names if name]


@dataclass(frozen=True)
class ZeroPointFractions:
    """What an HQQ MatMulNBits node's float zero points z became (exporter/export/quantize.py): the node reads them
    rounded to integers, and the graph adds back MatMul(MatMul(x, `blocks_sum`), `fractions`), the initializers'
    names: `blocks_sum` the (K, blocks) 0/1 matrix that sums each block of the node's input x, `fractions` the
    (blocks, N) float matrix of (round(z) - z) · scale."""

    fractions: str
    blocks_sum: str


def zero_point_fractions(graph) -> dict[str, ZeroPointFractions]:
    """By MatMulNBits node name, the ZeroPointFractions its output is added to, in `graph` (an onnx GraphProto):
    found by the graph's structure, Add(node's output, MatMul(MatMul(node's input, initializer), initializer))."""
    producers = {output: node for node in graph.node for output in node.output}
    initializers = {tensor.name for tensor in graph.initializer}
    found = {}
    for add in graph.node:
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        node, correction = (producers.get(name) for name in add.input)
        if node is None or correction is None or node.op_type != QUANTIZED_OP or correction.op_type != "MatMul":
            continue
        sums = producers.get(correction.input[0])
        if (
            sums is not None
            and sums.op_type == "MatMul"
            and sums.input[0] == node.input[0]
            and {sums.input[1], correction.input[1]} <= initializers
        ):
            found[node.name] = ZeroPointFractions(correction.input[1], sums.input[1])
    return found


def blocks_sum_matrix(k: int, block: int, dtype) -> np.ndarray:
    """The (K, blocks) 0/1 matrix that sums each block of `block` inputs (ZeroPointFractions.blocks_sum): 1 where
    row k lies in block k // block, in `dtype`."""
    matrix = np.zeros((k, -(-k // block)), dtype)
    matrix[np.arange(k), np.arange(k) // block] = 1
    return matrix


def smoothing_divisors(graph) -> dict[str, str]:
    """By MatMulNBits node name, the initializer its input is divided by (the node reads Div(x, initializer): a
    smoothed projection, module comment at SMOOTHING_BITS), in `graph` (an onnx GraphProto)."""
    producers = {output: node for node in graph.node for output in node.output}
    initializers = {tensor.name for tensor in graph.initializer}
    found = {}
    for node in graph.node:
        div = producers.get(node.input[0]) if node.op_type == QUANTIZED_OP else None
        if div is not None and div.op_type == "Div" and div.input[1] in initializers:
            found[node.name] = div.input[1]
    return found


def held_inputs(node, fractions: dict[str, ZeroPointFractions], divisors: dict[str, str]) -> list[str]:
    """The initializers that hold a quantized node's matrix: its block_inputs and, for an HQQ node (by name in
    `fractions`, zero_point_fractions'), its zero points' fractions and the block-sum matrix; for a smoothed one (by
    name in `divisors`, smoothing_divisors'), the divisors of its input."""
    held = fractions.get(node.name)
    extra = [held.fractions, held.blocks_sum] if held is not None else []
    return block_inputs(node) + extra + ([divisors[node.name]] if node.name in divisors else [])


def smoothed_weight(weight, divisors, dtype):
    """A Linear's `weight` (out, in) as a smoothed projection's blocks are made of it: each column (input channel)
    times its divisor, in float32 arithmetic (one correctly rounded product each), cast to `dtype`, the graphs'
    float type. The export and the weight audit both compute it here, so that the audit's blocks equal the export's
    bit for bit."""
    product = np.asarray(weight, np.float32) * np.asarray(divisors, np.float32)[None, :]
    return product.astype(dtype)


def alpha_problem(alpha) -> str | None:
    """Why `alpha` is no migration strength (a number in (0, 1]), or None."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
        return f"alpha {alpha!r} is not a number in (0, 1]"
    return None


def _schemes() -> str:
    return ", ".join(f"{name} ({bits} bits)" for name, bits in SCHEMES.items())


def block_size_problem(block_size) -> str | None:
    """Why `block_size` is no MatMulNBits block size, or None."""
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        return f"block_size is {block_size!r}, not an integer"
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two >= {MIN_BLOCK_SIZE}, which MatMulNBits requires"
    return None


def requested_scheme(dtype: str, hidden_size: int, settings: QuantizationSettings) -> Quantization | None:
    """The scheme an export of `dtype` with `settings` asks for (None for a float dtype), or InputError naming the
    setting.

    None takes the scheme's default; a float dtype takes none of them, as it quantizes nothing. A block size must
    divide the hidden size: every projection reads the hidden state, so a block that does not divide it would
    straddle two rows' worth of padding in each of them (MatMulNBits pads K up to a whole block), storing and
    computing zeros."""
    block_size, accuracy_level = settings.block_size, settings.accuracy_level
    lm_head, embedding = settings.lm_head, settings.embedding
    given = {"block_size": block_size, "accuracy_level": accuracy_level, "lm_head": lm_head, "embedding": embedding}
    given["mix"] = settings.mix or None
    given["algorithm"] = settings.algorithm
    given["smoothing"] = settings.smoothing
    if dtype not in SCHEMES:
        name = next((name for name, value in given.items() if value is not None), None)
        if name is not None:
            raise InputError(
                f"{name} {given[name]!r} applies to int4/int8 exports only; a {dtype} export quantizes nothing: "
                f'drop `{name}`, or choose `dtype="int4"` or `dtype="int8"`'
            )
        return None
    block_size = DEFAULT_BLOCK_SIZES[dtype] if block_size is None else block_size
    accuracy_level = DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
    lm_head = DEFAULT_LM_HEAD if lm_head is None else lm_head
    embedding = DEFAULT_EMBEDDING if embedding is None else embedding
    problem = block_size_problem(block_size)
    if problem:
        raise InputError(f"{problem}; choose e.g. 32 (`block_size`)")
    if hidden_size % block_size:
        raise InputError(
            f"block_size {block_size} does not divide the model's hidden size {hidden_size}; choose a power of two "
            f"that does, e.g. {_largest_divisor(hidden_size)} (`block_size`)"
        )
    if accuracy_level not in ACCURACY_LEVELS or isinstance(accuracy_level, bool):
        raise InputError(
            f"accuracy_level {accuracy_level!r} is none of {', '.join(map(str, ACCURACY_LEVELS))} "
            "(0: float32 math; 4: int8 math on the CPU) (`accuracy_level`)"
        )
    for name, choice in (("lm_head", lm_head), ("embedding", embedding)):
        if choice not in TABLE_CHOICES:
            raise InputError(
                f"{name} {choice!r} is none of {', '.join(TABLE_CHOICES)} (float: kept float; int8: 8 bits; same: "
                f"the scheme's bits) (`{name}`)"
            )
    algorithm = DEFAULT_ALGORITHM if settings.algorithm is None else settings.algorithm
    if algorithm not in ALGORITHMS:
        raise InputError(f"algorithm {algorithm!r} is none of {', '.join(ALGORITHMS)} (`algorithm`)")
    if algorithm == "hqq" and SCHEMES[dtype] != HQQ_BITS:
        raise InputError(
            f'algorithm hqq makes 4-bit blocks, and an {dtype} export has none: choose `dtype="int4"`, or drop '
            "`algorithm` (`algorithm`)"
        )
    smoothing = _smoothing(dtype, accuracy_level, settings.smoothing)
    mix = tuple(settings.mix)
    for entry in mix:
        if not isinstance(entry, ModulePrecision):
            raise InputError(f"mix entries must be ModulePrecision, got {type(entry).__name__} (`mix`)")
        if problem := entry.problem():
            raise InputError(f"{problem} (`mix`)")
    return Quantization(
        dtype,
        SCHEMES[dtype],
        block_size,
        accuracy_level,
        lm_head,
        embedding,
        mix=mix,
        algorithm=algorithm,
        smoothing=smoothing,
    )


def smoothing_applies(dtype: str, accuracy_level: int | None) -> bool:
    """Whether an export of `dtype` at `accuracy_level` (None: the default) takes smoothing (SMOOTHING_BITS)."""
    level = DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
    return SCHEMES.get(dtype) == SMOOTHING_BITS and level == SMOOTHING_LEVEL


def _smoothing(dtype: str, accuracy_level: int, asked: float | str | None) -> Smoothing | None:
    """The smoothing `asked` of an export of `dtype` at `accuracy_level` (QuantizationSettings.smoothing), its
    calibration not yet measured, or InputError."""
    applies = smoothing_applies(dtype, accuracy_level)
    if asked is None:
        return Smoothing(DEFAULT_SMOOTHING, "") if applies else None
    if asked == NO_SMOOTHING:
        return None
    if problem := alpha_problem(asked):
        raise InputError(
            f"smoothing {problem}: give the migration strength, e.g. {DEFAULT_SMOOTHING}, or "
            f'"{NO_SMOOTHING}" (`smoothing`)'
        )
    if not applies:
        why = (
            "at 4 bits the weights' rounding dominates, and the outliers moved into them make it worse"
            if SCHEMES[dtype] != SMOOTHING_BITS
            else f"at accuracy level {accuracy_level} the inputs are not rounded to int8"
        )
        raise InputError(
            f"smoothing applies to int8 at accuracy level {SMOOTHING_LEVEL} only ({why}): drop `smoothing`"
        )
    return Smoothing(float(asked), "")


def activations_dtype(dtype: str, activations: str | None) -> str:
    """What the graphs of an export of `dtype` compute in: `activations` for a quantization scheme (None: float32),
    the dtype itself for a float one (`activations` must then be None), or InputError naming the argument."""
    if dtype not in SCHEMES:
        if activations is not None:
            raise InputError(
                f"activations {activations!r} applies to int4/int8 exports only; a {dtype} export computes in "
                f'{dtype}: drop `activations`, or choose `dtype="int4"` or `dtype="int8"`'
            )
        return dtype
    if activations is None:
        return DEFAULT_ACTIVATIONS
    if activations not in DTYPES:
        raise InputError(
            f"activations {activations!r} is none of {', '.join(DTYPES)} (float32 for the CPU, float16 for CUDA) "
            "(`activations`)"
        )
    return activations


def _largest_divisor(hidden_size: int) -> int:
    size = MIN_BLOCK_SIZE
    while hidden_size % (size * 2) == 0 and size < 128:
        size *= 2
    return size
