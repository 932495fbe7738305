"""Configuration of the Hugging Face decoders (llama, mistral, qwen2, qwen3), and its translation from a
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

log = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "yarn", "llama3")


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


# ---------------------------------------------------------------- translation from a Transformers config.json

# Per model_type: the math Transformers' modeling file hard-codes or reads from which field, and the head_dim
# its config class assumes when config.json gives none.
_ARCHITECTURES = {
    "llama": {"qk_norm": False, "qkv_bias": "attention_bias", "o_bias": "attention_bias", "mlp_bias": "mlp_bias"},
    "mistral": {"qk_norm": False, "qkv_bias": False, "o_bias": False, "mlp_bias": False},
    "qwen2": {"qk_norm": False, "qkv_bias": True, "o_bias": False, "mlp_bias": False},
    "qwen3": {"qk_norm": True, "qkv_bias": "attention_bias", "o_bias": "attention_bias", "mlp_bias": False},
}
_HEAD_DIM_DEFAULT = {"qwen3": 128}  # the others: hidden_size / num_attention_heads
_MAX_POSITIONS_DEFAULT = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768}
_CONFIG_DEFAULTS = {"vocab_size": 32000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
_TOKEN_DEFAULTS = {"llama": (1, 2), "mistral": (1, 2), "qwen2": (None, None), "qwen3": (None, None)}

# Sizes read as they are.
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "rms_norm_eps",
    "tie_word_embeddings",
    "hidden_act",
)
# Fields that change nothing the reference computes for inference: bookkeeping, training and runtime options.
_IGNORED = {
    "architectures",
    "auto_map",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "use_cache",
    "pad_token_id",
    "initializer_range",
    "attention_dropout",
    "pretraining_tp",  # Llama's tensor-parallel split of the same matmuls
    "max_window_layers",  # read with use_sliding_window below
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "bos_token_id",
    "eos_token_id",
    "head_dim",
    "num_key_value_heads",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "attention_bias",
    "mlp_bias",
    "max_position_embeddings",
    "partial_rotary_factor",
    "tokenizer_class",
    "generation_config",
}
# Fields of another design that the four types' modeling files would ignore, but whose presence says the weights
# are not of that design (a mixture of experts saved under a dense type).
_FOREIGN = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")


def translate_hf_config(data: dict) -> dict:
    """HFDecoderConfig fields from a Transformers config.json of a supported model_type.

    Fields without effect on inference are logged (info) and ignored; one that changes the math and that the
    reference does not compute is refused.

    Raises:
        ConfigError: naming the field and the fix.
    """
    model_type = data.get("model_type")
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
    arch = _ARCHITECTURES[model_type]
    fields = {"model_type": model_type}
    for name in _SIZES:
        if name in data and data[name] is not None:
            fields[name] = data[name]
    for name, default in _CONFIG_DEFAULTS.items():
        fields.setdefault(name, default)
    for flag, source in arch.items():
        fields[flag] = source if isinstance(source, bool) else bool(data.get(source, False))
    heads = fields.get("num_attention_heads")
    fields["num_key_value_heads"] = data.get("num_key_value_heads") or heads
    head_dim = data.get("head_dim")
    if head_dim is None:
        head_dim = _HEAD_DIM_DEFAULT.get(model_type)
    if head_dim is None and _is_positive_int(fields.get("hidden_size")) and _is_positive_int(heads):
        head_dim = fields["hidden_size"] // heads
    if head_dim is not None:
        fields["head_dim"] = head_dim
    fields["max_position_embeddings"] = data.get("max_position_embeddings") or _MAX_POSITIONS_DEFAULT[model_type]
    bos, eos = _TOKEN_DEFAULTS[model_type]
    fields["bos_token_id"] = data.get("bos_token_id", bos)
    fields["eos_token_id"] = _one_eos(data.get("eos_token_id", eos))
    _check_partial_rotary(data)
    fields["rope_theta"], scaling = _rope(data, fields["max_position_embeddings"])
    fields["rope_scaling"] = dataclasses.asdict(scaling) if scaling is not None else None  # JSON, as from_dict reads
    _check_sliding_window(data, model_type, fields)
    ignored = sorted(k for k in data if k not in _SIZES and k not in _IGNORED and not k.startswith("_"))
    ignored = [k for k in ignored if k not in _FOREIGN]
    if ignored:
        log.info("config.json fields without effect on the %s reference, ignored: %s", model_type, ", ".join(ignored))
    log.debug("config.json bookkeeping fields ignored: %s", ", ".join(sorted(set(data) & _IGNORED)))
    return {k: v for k, v in fields.items() if v is not None or k in ("bos_token_id", "eos_token_id")}


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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


def _check_partial_rotary(data: dict) -> None:
    parameters = data.get("rope_parameters") or {}
    factor = data.get("partial_rotary_factor", parameters.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ConfigError(
            f"config field partial_rotary_factor is {factor!r}; the reference rotates whole heads only (1.0)"
        )


def _rope(data: dict, max_positions: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's rope_parameters or the older rope_theta + rope_scaling."""
    parameters = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(parameters, dict):
        raise ConfigError(f"config field rope_parameters must be an object, got {parameters!r}")
    if any(isinstance(v, dict) for v in parameters.values()):
        raise ConfigError(
            "config field rope_parameters gives a rope per layer type; the reference has one rope for every layer"
        )
    theta = parameters.get("rope_theta", data.get("rope_theta", 10000.0))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        why = (
            "dynamic NTK rescales with each sequence's length, which the reference does not"
            if kind == "dynamic"
            else "the reference does not compute it"
        )
        raise ConfigError(
            f"config field rope_scaling has rope_type {kind!r} ({why}); supported: {', '.join(ROPE_TYPES)}"
        )
    factor = parameters.get("factor")
    original = parameters.get("original_max_position_embeddings", data.get("original_max_position_embeddings"))
    if kind in ("yarn", "llama3") and original is None:
        original = max_positions  # Transformers' standardize_rope_params
    if kind == "yarn":
        if factor is None:
            factor = max_positions / original
        attention_factor = parameters.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return theta, RopeScaling(
            "yarn",
            float(factor),
            original,
            float(attention_factor),
            float(parameters.get("beta_fast") or 32.0),
            float(parameters.get("beta_slow") or 1.0),
            bool(parameters.get("truncate", True)),
        )
    if factor is None:
        raise ConfigError(f"config field rope_scaling of type {kind} gives no factor; add it")
    if kind == "linear":
        return theta, RopeScaling("linear", float(factor))
    return theta, RopeScaling(
        "llama3",
        float(factor),
        original,
        low_freq_factor=float(parameters.get("low_freq_factor", 1.0)),
        high_freq_factor=float(parameters.get("high_freq_factor", 4.0)),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale 0.1 * mscale * ln(scale) + 1 (1 for no scaling), as Transformers computes it."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _check_sliding_window(data: dict, model_type: str, fields: dict) -> None:
    """Refuse a sliding window that some layer applies within the context; otherwise it changes nothing."""
    window = data.get("sliding_window")
    if model_type == "mistral":
        sliding = window is not None
    elif model_type == "llama":
        sliding = False
    elif not data.get("use_sliding_window"):  # qwen2/qwen3 drop the window unless use_sliding_window
        sliding = False
    elif data.get("layer_types") is not None:
        sliding = any(kind != "full_attention" for kind in data["layer_types"])
    else:  # Transformers' layer_types: the layers from max_window_layers on slide
        sliding = fields.get("num_hidden_layers", 0) > data.get("max_window_layers", 28)
    if not sliding or window is None:
        return
    context = fields["max_position_embeddings"]
    if window < context:
        raise ConfigError(
            f"config field sliding_window ({window}) is shorter than max_position_embeddings ({context}), and "
            "the reference attends to the whole context; set max_position_embeddings to at most "
            f"{window} in config.json (the window changes nothing within it)"
        )
