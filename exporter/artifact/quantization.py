"""Weight-only quantization as the manifest records it: the scheme an export applied, and its checks.

A quantized artifact computes in float32 (manifest `dtype` "float32": activations and cache), or in float16 where it
was exported for a GPU (`dtype` "float16"); its MatMul weights are stored as onnxruntime's MatMulNBits blocks (`bits`
per weight, one scale in the activations' type and one zero point per `block_size` consecutive weights along the
reduced axis), and its token embedding, unless kept float, as
GatherBlockQuantized rows in the same layout (blocks along the hidden axis). The manifest's optional `quantization`
field says so; a manifest without it is a float artifact, as every manifest written before the field existed.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.artifact.contract import DTYPES
from exporter.errors import InputError

SCHEMES = {"int4": 4, "int8": 8}  # the --dtype values that quantize, and their bits
# What a quantized artifact computes in, and what its cache holds, unless asked otherwise: float32, for the CPU, whose
# MatMulNBits kernels compute in float32 or int8; float16 is for CUDA, where activations and cache in float16 halve
# what every step reads besides the weights.
DEFAULT_ACTIVATIONS = "float32"
DEFAULT_BLOCK_SIZE = 32
MIN_BLOCK_SIZE = 16  # MatMulNBits takes power-of-two blocks of at least 16
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits' accuracy_level: 0 unset (float32 math), 4 int8 math on the CPU
# Level 4 by default, as onnxruntime-genai's builder writes int4 for the CPU: onnxruntime's CPU MatMulNBits is fast
# only there (its float32-math kernels decode a 4-bit minimind-3 slower than the float32 artifact does, see
# benchmarks/QUANTIZED-RESULTS.md); the quality profile judges what its int8 activations cost. CUDA ignores it.
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


@dataclass(frozen=True)
class Quantization:
    """The scheme of a quantized artifact (manifest.json's `quantization`).

    scheme: "int4" or "int8"; bits: 4 or 8 (the lm_head and the embedding may carry 8 under int4);
    block_size: weights per scale; accuracy_level: MatMulNBits' (0: float math in the activations' type);
    symmetric: False, each block has a zero point; lm_head, embedding: "float", "int8" or "same" as asked;
    kept_float: the modules whose weights stay float, with why; matrices: weight matrices quantized (a tied table
    held once for the lm_head and the embedding counts once); float_bytes: their bytes before, in the graphs' dtype;
    quantized_bytes: their blocks, scales and zero points after.
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
        return None


@dataclass(frozen=True)
class QuantizationSettings:
    """What an int4/int8 export is asked for (export_artifact's `quantization`); None takes the default, and a float
    dtype takes none of them (InputError names the one given).

    block_size: the weights per scale: a power of two >= 16 dividing the hidden size (None: 32).
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
    """

    block_size: int | None = None
    accuracy_level: int | None = None
    lm_head: str | None = None
    embedding: str | None = None
    activations: str | None = None


def block_inputs(node) -> list[str]:
    """The inputs of a MatMulNBits or GatherBlockQuantized node (an onnx NodeProto) that hold its quantized matrix:
    blocks, scales and, where present, zero points, in that order."""
    names = node.input[1:4] if node.op_type == QUANTIZED_OP else [node.input[0], *node.input[2:4]]
    return [name for name in names if name]


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
    if dtype not in SCHEMES:
        name = next((name for name, value in given.items() if value is not None), None)
        if name is not None:
            raise InputError(
                f"{name} {given[name]!r} applies to int4/int8 exports only; a {dtype} export quantizes nothing: "
                f'drop `{name}`, or choose `dtype="int4"` or `dtype="int8"`'
            )
        return None
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
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
    return Quantization(dtype, SCHEMES[dtype], block_size, accuracy_level, lm_head, embedding)


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
