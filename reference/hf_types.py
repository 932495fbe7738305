"""The Hugging Face model types the hf-decoder family reads, one record each: what transformers' modeling file
computes and its config class assumes, what the consumers are told the model is, and the tiny model the tests build.

Adding a type is adding a record here (docs/extending.md); a type whose math the reference does not compute yet
first gains a field in reference/hf_decoder_config.py and its computation in reference/hf_decoder.py. Kept free of
torch and of the rest of the package, so that every module may read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The rope types the reference computes (reference/hf_decoder.py); a type's config class may take fewer.
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# Sliding windows, as each modeling file applies config.json's sliding_window.
NO_WINDOW = "none"  # never (llama)
EVERY_LAYER = "every layer"  # every layer, whenever there is a window (mistral)
WINDOW_LAYERS = "layer types"  # with use_sliding_window only: the layers layer_types names, else max_window_layers on


@dataclass(frozen=True)
class HFModelType:
    """One Hugging Face model_type, as transformers defines it.

    Attributes:
        name: config.json's model_type.
        math: HFDecoderConfig's flags as the modeling file sets them: a constant, or the name of the config.json
            field it reads the flag from. A flag left out keeps HFDecoderConfig's default (off).
        defaults: the defaults of transformers' config class for the fields that change the math, where they differ
            from hf_decoder_config.COMMON_DEFAULTS: a config.json that leaves a field out is read with them
            (tests/reference_models/test_hf_decoder_config.py holds them to transformers).
        null_read: the fields whose null the config class reads as derived (num_key_value_heads as
            num_attention_heads, head_dim as hidden_size / num_attention_heads); a null elsewhere is refused.
        window: which layers config.json's sliding_window applies to (NO_WINDOW, EVERY_LAYER, WINDOW_LAYERS).
        rope_types: the rope types of ROPE_TYPES the config class takes; another is refused.
        rope_aliases: rope types the config class reads as another (phi3 reads su and yarn as longrope).
        read_as_with_layer_types: the transformers model class a config.json of this type holding layer_types (even
            null) is read as instead (mistral's: Ministral, whose alternating attention the reference does not
            compute), so that such a config is refused; None: layer_types is read as this type's.
        partial_rotary: whether the modeling file turns only the leading partial_rotary_factor of each head;
            otherwise a factor other than 1 is refused.
        genai: onnxruntime-genai's model.type for its artifacts (genai_config.json).
        optimum: the model_type of the config.json written for Optimum.
        tiny: the fields of the tests' tiny model of this type, laid over tests/hf_folders.py's shared sizes (hidden
            64, 2 layers, 4 query heads over 2 kv heads, vocab 256) and chosen to exercise what the other types'
            do not.
    """

    name: str
    math: dict
    defaults: dict
    genai: str
    optimum: str
    tiny: dict
    null_read: tuple[str, ...] = ()
    window: str = NO_WINDOW
    rope_types: tuple[str, ...] = ROPE_TYPES
    rope_aliases: dict = field(default_factory=dict)
    partial_rotary: bool = False
    read_as_with_layer_types: str | None = None


HF_TYPES: dict[str, HFModelType] = {
    t.name: t
    for t in (
        # head_dim 32 (not hidden / heads = 16), attention_bias (q, k, v and o) and mlp_bias, an untied head, llama3
        # rope scaling with rope_theta 500000 over 131072 positions
        HFModelType(
            "llama",
            math={"qkv_bias": "attention_bias", "o_bias": "attention_bias", "mlp_bias": "mlp_bias"},
            defaults={
                "vocab_size": 32000,
                "intermediate_size": 11008,
                "max_position_embeddings": 2048,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            null_read=("num_key_value_heads", "head_dim"),
            genai="llama",
            optimum="llama",
            tiny=dict(
                head_dim=32,
                attention_bias=True,
                mlp_bias=True,
                tie_word_embeddings=False,
                max_position_embeddings=131072,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            ),
        ),
        # linear rope scaling, no sliding window
        HFModelType(
            "mistral",
            math={},
            defaults={
                "vocab_size": 32000,
                "intermediate_size": 14336,
                "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "sliding_window": 4096,
            },
            null_read=("head_dim",),
            window=EVERY_LAYER,
            read_as_with_layer_types="Ministral",
            genai="mistral",
            optimum="mistral",
            tiny=dict(
                sliding_window=None,
                max_position_embeddings=4096,
                tie_word_embeddings=False,
                rope_scaling={"rope_type": "linear", "factor": 2.0},
            ),
        ),
        # q/k/v biases (o_proj none), a tied head
        HFModelType(
            "qwen2",
            math={"qkv_bias": True},
            defaults={
                "vocab_size": 151936,
                "intermediate_size": 22016,
                "num_key_value_heads": 32,
                "max_position_embeddings": 32768,
                "sliding_window": 4096,
            },
            null_read=("num_key_value_heads",),
            window=WINDOW_LAYERS,
            genai="qwen2",
            optimum="qwen2",
            tiny=dict(tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=1e6),
        ),
        # q/k norms, head_dim 32, yarn rope scaling over 131072 positions, a tied head
        HFModelType(
            "qwen3",
            math={"qk_norm": True, "qkv_bias": "attention_bias", "o_bias": "attention_bias"},
            defaults={
                "vocab_size": 151936,
                "intermediate_size": 22016,
                "num_key_value_heads": 32,
                "head_dim": 128,
                "max_position_embeddings": 32768,
                "sliding_window": 4096,
            },
            null_read=("num_key_value_heads",),
            window=WINDOW_LAYERS,
            genai="qwen3",
            optimum="qwen3",
            tiny=dict(
                head_dim=32,
                tie_word_embeddings=True,
                max_position_embeddings=131072,
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            ),
        ),
        # q, k and v in one qkv_proj, gate and up in one gate_up_proj, rope over the leading three quarters of each
        # head (Phi-4-mini's partial_rotary_factor), an untied head. Phi3Config takes default and longrope ropes only
        # and reads su and yarn as longrope, whose frequencies switch with the positions a call reaches: refused.
        HFModelType(
            "phi3",
            math={"fused_qkv": True, "fused_gate_up": True},
            defaults={
                "vocab_size": 32064,
                "hidden_size": 3072,
                "intermediate_size": 8192,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "bos_token_id": 1,
                "eos_token_id": 32000,
            },
            null_read=("num_key_value_heads",),
            window=EVERY_LAYER,
            rope_types=("default",),
            rope_aliases={"su": "longrope", "yarn": "longrope"},
            partial_rotary=True,
            genai="phi3",
            # Optimum's phi3 sizes the empty first-step cache with num_attention_heads (no grouped-query
            # attention); its llama with num_key_value_heads
            optimum="llama",
            tiny=dict(
                partial_rotary_factor=0.75,
                max_position_embeddings=4096,
                pad_token_id=0,  # Phi3Config's 32000 lies outside the tiny vocabulary
            ),
        ),
    )
}
