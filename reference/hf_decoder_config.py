"""Configuration of the Hugging Face decoders (the model types of reference/hf_types.py), and its translation from a
Transformers `config.json`. Kept free of torch so that the ONNX Runtime side can read it.

The config holds the math, not the architecture's name: which projections carry a bias, whether the heads
are normalised, the rope in resolved form. `model_type` is kept for the consumers' configs (the type
onnxruntime-genai and Optimum are told) and for reports; the model never branches on it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from reference.configs import JsonConfig, check_field_types, check_positive_ints, check_token_ids
from reference.errors import ConfigError
from reference.hf_types import EVERY_LAYER, HF_TYPES, NO_WINDOW, ROPE_TYPES, WINDOW_LAYERS, HFModelType

log = logging.getLogger(__name__)

MODEL_TYPES = tuple(HF_TYPES)


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling in resolved form: what Transformers' rope functions read, defaults filled in.

    linear: every frequency divided by `factor`. yarn: frequencies blended between `factor`-interpolated and
    original over the band set by beta_fast/beta_slow, cos/sin times `attention_factor`. llama3: frequencies
    with a wavelength above original/low_freq_factor divided by `factor`, those below original/high_freq_factor
    kept, a smooth blend between.
    """

    rope_type: str  # one of ROPE_TYPES other than "default"
    factor: float
    original_max_position_embeddings: int | None = None  # yarn and llama3
    attention_factor: float = 1.0  # yarn: resolved from factor and mscale when the config gives none
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: floor/ceil the correction range
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3


@dataclass(frozen=True)
class HFDecoderConfig(JsonConfig):
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q_proj, k_proj, v_proj
    o_bias: bool = False  # o_proj
    mlp_bias: bool = False  # gate_proj, up_proj, down_proj
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotation (qwen3)
    fused_qkv: bool = False  # q, k and v as one qkv_proj, its rows in that order (phi3)
    fused_gate_up: bool = False  # gate and up as one gate_up_proj, gate's rows first (phi3)
    partial_rotary_factor: float = 1.0  # the leading fraction of each head that rope turns (phi3)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            check_field_types(RopeScaling, self.rope_scaling, prefix="rope_scaling.")
            names = {f.name for f in dataclasses.fields(RopeScaling)}
            unknown = sorted(set(self.rope_scaling) - names)
            if unknown:
                raise ConfigError(f"unknown config fields rope_scaling.{unknown}; known fields are {sorted(names)}")
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        self._validate()

    def _validate(self):
        check_positive_ints(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
            ),
        )
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"config field model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config field num_attention_heads ({self.num_attention_heads}) must be divisible "
                f"by num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"config field head_dim ({self.head_dim}) must be even for RoPE")
        if not 0 < self.partial_rotary_factor <= 1 or self.rope_dim < 2 or self.rope_dim % 2:
            raise ConfigError(
                f"config field partial_rotary_factor ({self.partial_rotary_factor!r}) must turn an even number of "
                f"at least 2 of each head's {self.head_dim} dims, at most all; got {self.rope_dim}"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"config field {name} must be positive and finite, got {getattr(self, name)!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"config field hidden_act must be 'silu', got {self.hidden_act!r}")
        scaling = self.rope_scaling
        if scaling is not None:
            if scaling.rope_type not in ROPE_TYPES[1:]:
                raise ConfigError(
                    f"config field rope_scaling.rope_type must be one of {ROPE_TYPES[1:]}, got {scaling.rope_type!r}"
                )
            if not 0 < scaling.factor < math.inf:
                raise ConfigError(f"config field rope_scaling.factor must be positive, got {scaling.factor!r}")
            if scaling.rope_type != "linear" and not (
                isinstance(scaling.original_max_position_embeddings, int)
                and scaling.original_max_position_embeddings > 0
            ):
                raise ConfigError(
                    f"config field rope_scaling.original_max_position_embeddings must be a positive integer for "
                    f"{scaling.rope_type}, got {scaling.original_max_position_embeddings!r}"
                )
            if scaling.rope_type == "llama3" and scaling.high_freq_factor <= scaling.low_freq_factor:
                raise ConfigError(
                    f"config field rope_scaling.high_freq_factor ({scaling.high_freq_factor}) must exceed "
                    f"low_freq_factor ({scaling.low_freq_factor})"
                )
        check_token_ids(self)

    @property
    def rope_dim(self) -> int:
        """The leading dims of each head that rope turns, as transformers sizes them: int(head_dim * factor)."""
        return int(self.head_dim * self.partial_rotary_factor)


# ---------------------------------------------------------------- translation from a Transformers config.json

# The defaults every type's config class shares for the fields that change the math; a type's own defaults
# (HFModelType.defaults) take precedence. Where a type gives none, head_dim is hidden_size / num_attention_heads and
# num_key_value_heads is num_attention_heads, as for null. A sliding window of a WINDOW_LAYERS type applies only with
# use_sliding_window.
COMMON_DEFAULTS = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "use_sliding_window": False,
    "max_window_layers": 28,
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value) -> bool:
    return _is_int(value) and value > 0


def _is_positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_token_id(value) -> bool:
    return _is_int(value) and value >= 0


_POSITIVE_INT = (_is_positive_int, "a positive integer")
_POSITIVE_NUMBER = (_is_positive_number, "a positive finite number")
_NUMBER = (_is_number, "a finite number")
_BOOL = (lambda v: isinstance(v, bool), "true or false")
_OBJECT = (lambda v: v is None or isinstance(v, dict), "an object or null")
# config.json's fields that the reading below uses: what each must be (null allowed where its text says so).
_SCHEMA = {
    "vocab_size": _POSITIVE_INT,
    "hidden_size": _POSITIVE_INT,
    "intermediate_size": _POSITIVE_INT,
    "num_hidden_layers": _POSITIVE_INT,
    "num_attention_heads": _POSITIVE_INT,
    "num_key_value_heads": (lambda v: v is None or _is_positive_int(v), "a positive integer or null"),
    "head_dim": (lambda v: v is None or _is_positive_int(v), "a positive integer or null"),
    "max_position_embeddings": _POSITIVE_INT,
    "rms_norm_eps": (
        lambda v: isinstance(v, float) and 0 < v < math.inf,
        "a positive finite number with a decimal point (transformers' config refuses an integer)",
    ),
    "rope_theta": _POSITIVE_NUMBER,
    "tie_word_embeddings": _BOOL,
    "attention_bias": _BOOL,
    "mlp_bias": _BOOL,
    "hidden_act": (lambda v: isinstance(v, str), "a string ('silu')"),
    "bos_token_id": (lambda v: v is None or _is_token_id(v), "a non-negative integer or null"),
    "eos_token_id": (
        lambda v: v is None or _is_token_id(v) or isinstance(v, list) and all(map(_is_token_id, v)),
        "a non-negative integer, a list of them, or null",
    ),
    "sliding_window": (lambda v: v is None or _is_positive_int(v), "a positive integer or null"),
    "use_sliding_window": _BOOL,
    "max_window_layers": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "layer_types": (
        lambda v: v is None or isinstance(v, list) and all(isinstance(t, str) for t in v),
        "a list of layer types ('full_attention', 'sliding_attention') or null",
    ),
    "partial_rotary_factor": _POSITIVE_NUMBER,
    "original_max_position_embeddings": _POSITIVE_INT,
    "rope_parameters": _OBJECT,
    "rope_scaling": _OBJECT,
}
# The fields of rope_parameters (or rope_scaling) that the rope functions read.
_ROPE_SCHEMA = {
    "rope_type": (lambda v: isinstance(v, str), "a string"),
    "type": (lambda v: isinstance(v, str), "a string"),
    "rope_theta": _POSITIVE_NUMBER,
    "factor": _POSITIVE_NUMBER,
    "original_max_position_embeddings": _POSITIVE_INT,
    "attention_factor": (lambda v: v is None or _is_positive_number(v), "a positive finite number or null"),
    "beta_fast": (lambda v: v is None or _is_positive_number(v), "a positive finite number or null"),
    "beta_slow": (lambda v: v is None or _is_positive_number(v), "a positive finite number or null"),
    "mscale": (lambda v: v is None or _is_number(v), "a finite number or null"),
    "mscale_all_dim": (lambda v: v is None or _is_number(v), "a finite number or null"),
    "low_freq_factor": _POSITIVE_NUMBER,
    "high_freq_factor": _POSITIVE_NUMBER,
    "truncate": _BOOL,
    "partial_rotary_factor": _POSITIVE_NUMBER,
}
LAYER_TYPES = ("full_attention", "sliding_attention")

# Keys of every Transformers config.json that say nothing about the model's math: bookkeeping and runtime options.
TRANSFORMERS_BOOKKEEPING = frozenset(
    {
        "architectures",
        "auto_map",
        "model_type",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "_name_or_path",
        "use_cache",
        "pad_token_id",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
    }
)
# Fields that change nothing the reference computes for inference: bookkeeping, training and runtime options.
_IGNORED = TRANSFORMERS_BOOKKEEPING | {
    "initializer_range",
    "attention_dropout",
    "pretraining_tp",  # Llama's tensor-parallel split of the same matmuls
    "tokenizer_class",
    "generation_config",
}
# Fields of another design that the types' modeling files would ignore, but whose presence says the weights
# are not of that design (a mixture of experts saved under a dense type).
_FOREIGN = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")


def _check_schema(data: dict, schema: dict, prefix: str = "") -> None:
    """Each field of `data` that `schema` names has the JSON type and range it gives."""
    for name, (valid, shown) in schema.items():
        if name in data and not valid(data[name]):
            raise ConfigError(f"config field {prefix}{name} must be {shown}, got {data[name]!r:.60}")


def translate_hf_config(data: dict) -> dict:
    """HFDecoderConfig fields from a Transformers config.json of a supported model_type, read as transformers'
    config class reads it: its defaults for a field left out, rope_scaling before rope_parameters.

    Fields without effect on inference are logged (info) and ignored; one that changes the math and that the
    reference does not compute is refused.

    Raises:
        ConfigError: naming the field and the fix.
    """
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(
            f"config field model_type must be a string, one of {', '.join(MODEL_TYPES)}, got {model_type!r:.40}"
        )
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported Hugging Face model types: "
            f"{', '.join(MODEL_TYPES)} (and minimind)"
        )
    for name in _FOREIGN:
        if data.get(name):
            raise ConfigError(
                f"config field {name} ({data[name]!r}) describes a mixture of experts, which model_type "
                f"{model_type} is not; export the model under its own type, or drop the field if it is dense"
            )
    _check_schema(data, _SCHEMA)
    hf_type = HF_TYPES[model_type]
    for name in ("num_key_value_heads", "head_dim"):
        if name in data and data[name] is None and name not in hf_type.null_read:
            raise ConfigError(f"config field {name} must be a positive integer for {model_type}, got None; give it")
    read = {**COMMON_DEFAULTS, **hf_type.defaults, **data}
    fields = {name: read[name] for name in _SIZES}
    fields["model_type"] = model_type
    for flag, source in hf_type.math.items():
        fields[flag] = source if isinstance(source, bool) else read[source]
    fields["num_key_value_heads"] = read.get("num_key_value_heads") or read["num_attention_heads"]
    fields["head_dim"] = read.get("head_dim") or read["hidden_size"] // read["num_attention_heads"]
    fields["bos_token_id"] = read.get("bos_token_id")
    fields["eos_token_id"] = _one_eos(read.get("eos_token_id"))
    fields["rope_theta"], scaling, fields["partial_rotary_factor"] = _rope(data, read, hf_type)
    fields["rope_scaling"] = dataclasses.asdict(scaling) if scaling is not None else None  # JSON, as from_dict reads
    _check_sliding_window(read, hf_type)
    known = {*_SCHEMA, *_IGNORED, *_FOREIGN}
    ignored = sorted(k for k in data if k not in known and not k.startswith("_"))
    if ignored:
        log.info("config.json fields without effect on the %s reference, ignored: %s", model_type, ", ".join(ignored))
    log.debug("config.json bookkeeping fields ignored: %s", ", ".join(sorted(set(data) & _IGNORED)))
    return fields


# Fields read as they are, once the defaults are filled in.
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "hidden_act",
)


def _one_eos(eos):
    """One end-of-sequence id: a list (Llama 3's three) keeps its first, which the artifact's runtime stops at."""
    if isinstance(eos, list):
        if not eos:
            return None
        if len(eos) > 1:
            log.warning(
                "config.json gives %d eos_token_ids %s; the artifact stops at the first, %r", len(eos), eos, eos[0]
            )
        return eos[0]
    return eos


def _rope(data: dict, read: dict, hf_type: HFModelType) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, scaling, partial_rotary_factor) from transformers 5's rope_parameters or the older rope_theta +
    rope_scaling; of both, rope_scaling, as transformers' config reads them."""
    name = "rope_scaling" if data.get("rope_scaling") else "rope_parameters"
    parameters = data.get(name) or {}
    if any(isinstance(v, dict) for v in parameters.values()):
        raise ConfigError(
            f"config field {name} gives a rope per layer type; the reference has one rope for every layer"
        )
    _check_schema(parameters, _ROPE_SCHEMA, prefix=f"{name}.")
    partial = parameters.get("partial_rotary_factor", read.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and not hf_type.partial_rotary:
        raise ConfigError(
            f"config field partial_rotary_factor is {partial!r}; {hf_type.name} rotates whole heads only (1.0)"
        )
    theta = parameters.get("rope_theta", read["rope_theta"])
    given = parameters.get("rope_type", parameters.get("type", "default"))
    kind = hf_type.rope_aliases.get(given, given)
    if kind == "default":
        return theta, None, partial
    if kind not in hf_type.rope_types:
        why = _UNSUPPORTED_ROPES.get(
            kind,
            f"{hf_type.name}'s config does not take it" if kind in ROPE_TYPES else "the reference does not compute it",
        )
        read_as = f"{hf_type.name} reads it as {kind}: " if kind != given else ""
        raise ConfigError(
            f"config field {name} has rope_type {given!r} ({read_as}{why}); supported: {', '.join(hf_type.rope_types)}"
        )
    max_positions = read["max_position_embeddings"]
    factor = parameters.get("factor")
    original = parameters.get("original_max_position_embeddings", data.get("original_max_position_embeddings"))
    if kind in ("yarn", "llama3") and original is None:
        original = max_positions  # Transformers' standardize_rope_params
    if factor is None:  # Transformers' rope validation requires it of every scaled type
        raise ConfigError(f"config field {name} has rope_type {kind!r} without its factor; give {name}.factor")
    return theta, _scaling(kind, factor, original, parameters), partial


# Why the reference computes no rope of these types.
_UNSUPPORTED_ROPES = {
    "dynamic": "dynamic NTK rescales with each sequence's length, which the reference does not",
    "longrope": "its frequencies switch from short to long factors once a call's positions pass "
    "original_max_position_embeddings, which the reference does not",
}


def _scaling(kind: str, factor, original, parameters: dict) -> RopeScaling:
    """The resolved scaling of a rope type other than default."""
    if kind == "yarn":
        attention_factor = parameters.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return RopeScaling(
            "yarn",
            float(factor),
            original,
            float(attention_factor),
            float(parameters.get("beta_fast") or 32.0),
            float(parameters.get("beta_slow") or 1.0),
            parameters.get("truncate", True),
        )
    if kind == "linear":
        return RopeScaling("linear", float(factor))
    return RopeScaling(
        "llama3",
        float(factor),
        original,
        low_freq_factor=float(parameters.get("low_freq_factor", 1.0)),
        high_freq_factor=float(parameters.get("high_freq_factor", 4.0)),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale 0.1 * mscale * ln(scale) + 1 (1 for no scaling), as Transformers computes it."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _sliding_layers(read: dict, hf_type: HFModelType, window) -> list[bool]:
    """Which layers transformers' modeling file gives a sliding window: none (NO_WINDOW); every layer when there is
    one (EVERY_LAYER, whose config ignores layer_types); else those layer_types names, or those from
    max_window_layers on."""
    layers = read["num_hidden_layers"]
    if hf_type.window == NO_WINDOW:
        return [False] * layers
    if hf_type.window == EVERY_LAYER:
        if hf_type.read_as_with_layer_types and "layer_types" in read:
            raise ConfigError(
                f"config field layer_types is given ({read['layer_types']!r}); transformers reads a {hf_type.name} "
                f"config holding it as {hf_type.read_as_with_layer_types}, with per-layer attention the reference "
                f"does not compute: drop the field to export the {hf_type.name} model"
            )
        return [window is not None] * layers
    layer_types = read.get("layer_types")
    if layer_types is None:
        return [window is not None and i >= read["max_window_layers"] for i in range(layers)]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(
            f"config field layer_types names {unknown}; the reference computes {' and '.join(LAYER_TYPES)} only"
        )
    if len(layer_types) != layers:
        raise ConfigError(
            f"config field layer_types has {len(layer_types)} entries but num_hidden_layers is {layers}; give "
            "one per layer"
        )
    return [kind == "sliding_attention" for kind in layer_types]


def _check_sliding_window(read: dict, hf_type: HFModelType) -> None:
    """Refuse a sliding window that some layer applies within the context; otherwise it changes nothing."""
    window = read.get("sliding_window")
    if hf_type.window == WINDOW_LAYERS and not read["use_sliding_window"]:  # their config drops the window
        window = None
    sliding = _sliding_layers(read, hf_type, window)
    if not any(sliding):
        return
    if window is None:  # transformers' cache fails on a sliding layer without a window
        raise ConfigError(
            "config field layer_types names sliding_attention layers but use_sliding_window is false, which "
            "leaves them no window; set use_sliding_window to true (with sliding_window), or make every layer "
            "full_attention"
        )
    context = read["max_position_embeddings"]
    if window < context:
        raise ConfigError(
            f"config field sliding_window ({window}) is shorter than max_position_embeddings ({context}), and "
            "the reference attends to the whole context; set max_position_embeddings to at most "
            f"{window} in config.json (the window changes nothing within it)"
        )
