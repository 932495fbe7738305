"""Each family's checkpoint loader: the knowledge of its tensors' names and of its config.json.

A loader is a class with
- `family`: the family's name (reference/families.py names the loader in the family's registration);
- `claims(state)`: whether tensors of this family's names are there (None: chosen by config.json's model_type only);
- `translate(data)`: toolkit config fields from a config.json or given fields;
- `infer(state, base)`: the config fields the tensors' shapes give beyond `base`, and the fields assumed;
- `visible_sizes(state, config)`: the sizes the tensors' names and shapes show, checked before a model is built;
- `prepare(state, model, report)`: the tensors as the family's model holds them (buffers checked and dropped, a
  tied head given both names).
reference.checkpoints chooses the loader and drives it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from reference.errors import CheckpointError, ConfigError
from reference.hf_decoder_config import TRANSFORMERS_BOOKKEEPING, translate_hf_config
from reference.minimind_config import GENERATION_DEFAULTS, MiniMindConfig

if TYPE_CHECKING:  # load_checkpoint's report, which prepare records into: a type here, built there
    from reference.checkpoints import LoadReport


def _count(state: dict, pattern: str) -> int:
    found = {int(m.group(1)): k for k in state if (m := re.match(pattern, k))}
    if found and len(found) != max(found) + 1:  # a gap: the largest index would size blocks no tensor fills
        gap = min(set(range(max(found) + 1)) - set(found))
        raise ValueError(f"{found[max(found)]} has index {max(found)} but no key has index {gap}")
    return max(found) + 1 if found else 0


def _span(state: dict, pattern: str, prefix: str) -> tuple[int, str]:
    """How many numbered modules the keys hold (`pattern` captures the index), and the keys that show it."""
    count = _count(state, pattern)
    return count, f"{prefix}0 to {prefix}{count - 1}" if count else f"no {prefix}* keys"


def _table_sizes(state: dict, key: str, fields: tuple[str, str]) -> dict:
    """The config fields a 2-D table's rows and columns give, with the shape that shows them."""
    table = state.get(key)
    if table is None or table.ndim != 2:
        return {}
    shown = f"{key} is {tuple(table.shape)}"
    return {field: (size, shown) for field, size in zip(fields, table.shape) if field is not None}


class MiniMindCheckpoints:
    """minimind-3 and MiniMind2, dense and MoE: `model.embed_tokens.weight`, `model.layers.{i}...`."""

    family = "minimind"
    # Transformers config.json keys: upstream name -> toolkit field, and bookkeeping keys without effect here.
    aliases = {"n_routed_experts": "num_experts", "aux_loss_alpha": "router_aux_loss_coef"}
    ignored = TRANSFORMERS_BOOKKEEPING | {"flash_attn", "scoring_func"}

    @staticmethod
    def claims(state: dict) -> bool:
        return (
            "model.embed_tokens.weight" in state
            or "lm_head.weight" in state
            and any(k.startswith("model.layers.") for k in state)
        )

    @classmethod
    def translate(cls, data: dict) -> dict:
        """Toolkit config fields from a config.json (upstream names accepted); None values dropped."""
        if data.get("scoring_func", "softmax") != "softmax":
            raise ConfigError(f"config field scoring_func must be 'softmax', got {data['scoring_func']!r}")
        hidden, heads, head_dim = data.get("hidden_size"), data.get("num_attention_heads"), data.get("head_dim")
        # A size of another type or below 1 is refused where it is read (infer, the config), not divided by here.
        sizes = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads, head_dim))
        if sizes and head_dim != hidden // heads:
            raise ConfigError(
                f"config field head_dim ({head_dim}) differs from hidden_size / num_attention_heads "
                f"({hidden // heads}); the reference supports only that head size"
            )
        # Keys with a leading underscore are Transformers' private records (`_attn_implementation_autoset`).
        # head_dim stays, for infer to count the heads by (MiniMind2's weights do not show them), and goes there.
        return {
            cls.aliases.get(k, k): v
            for k, v in data.items()
            if k not in cls.ignored and not k.startswith("_") and v is not None
        }

    @staticmethod
    def infer(state: dict, base: dict) -> tuple[dict, dict]:
        """Config fields read from tensor shapes (base: fields already known from config.json, whose head_dim,
        a size the config derives, is taken out here), and assumptions."""
        head_dim_given = base.pop("head_dim", None)
        heads = base.get("num_attention_heads", 1)
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise ConfigError(f"config field num_attention_heads must be a positive integer, got {heads!r}")
        embed = state.get("model.embed_tokens.weight", state.get("lm_head.weight"))
        fields = {
            "vocab_size": embed.shape[0],
            "hidden_size": embed.shape[1],
            "num_hidden_layers": _count(state, r"model\.layers\.(\d+)\."),
        }
        q_norm = state.get("model.layers.0.self_attn.q_norm.weight")
        fields["version"] = 3 if q_norm is not None else 2
        assumed = {}
        q_width = state["model.layers.0.self_attn.q_proj.weight"].shape[0]
        if head_dim_given is not None and (
            not isinstance(head_dim_given, int)
            or isinstance(head_dim_given, bool)
            or head_dim_given < 1
            or q_width % head_dim_given
            or q_norm is not None
            and head_dim_given != q_norm.shape[0]
            or head_dim_given * base.get("num_attention_heads", 0) not in (0, q_width)
        ):
            raise ConfigError(
                f"config field head_dim ({head_dim_given!r}) does not fit the checkpoint (q_proj has "
                f"{q_width} rows{f', q_norm {q_norm.shape[0]}' if q_norm is not None else ''}); "
                "correct or drop it"
            )
        if q_norm is not None:
            if q_width % q_norm.shape[0]:
                raise CheckpointError(
                    f"model.layers.0.self_attn.q_proj.weight has {q_width} rows, not a whole "
                    f"number of heads of q_norm's width {q_norm.shape[0]}; the checkpoint is "
                    "damaged or of another design"
                )
            fields["num_attention_heads"] = q_width // q_norm.shape[0]
        elif "num_attention_heads" not in base:
            if head_dim_given is not None:
                fields["num_attention_heads"] = q_width // head_dim_given
            else:
                assumed["num_attention_heads"] = fields["num_attention_heads"] = 8  # not visible in MiniMind2 weights
        heads = base.get("num_attention_heads", fields.get("num_attention_heads"))
        if q_width % heads:
            shown = ", assumed: MiniMind2's weights do not show it" if "num_attention_heads" in assumed else ""
            raise CheckpointError(
                f"{heads} heads (num_attention_heads{shown}) do not divide the {q_width} rows of "
                "model.layers.0.self_attn.q_proj.weight; pass --config with the model's "
                "num_attention_heads, or check the checkpoint"
            )
        head_dim = q_width // heads
        fields["num_key_value_heads"] = state["model.layers.0.self_attn.k_proj.weight"].shape[0] // head_dim
        experts = _count(state, r"model\.layers\.0\.mlp\.experts\.(\d+)\.")
        if experts:
            fields.update(
                use_moe=True,
                num_experts=experts,
                n_shared_experts=_count(state, r"model\.layers\.0\.mlp\.shared_experts\.(\d+)\."),
                moe_intermediate_size=state["model.layers.0.mlp.experts.0.gate_proj.weight"].shape[0],
            )
            shared = state.get("model.layers.0.mlp.shared_experts.0.gate_proj.weight")
            fields["intermediate_size"] = shared.shape[0] if shared is not None else fields["moe_intermediate_size"]
            if "num_experts_per_tok" not in base:
                assumed["num_experts_per_tok"] = GENERATION_DEFAULTS["num_experts_per_tok"][fields["version"]]
        else:
            fields["intermediate_size"] = state["model.layers.0.mlp.gate_proj.weight"].shape[0]
        if "max_position_embeddings" not in base:  # no tensor has the positions: RoPE is computed
            assumed["max_position_embeddings"] = MiniMindConfig.max_position_embeddings
        lm_head, embed_w = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
        if lm_head is not None and embed_w is not None and not torch.equal(lm_head, embed_w):
            fields["tie_word_embeddings"] = False
        return fields, assumed

    @staticmethod
    def visible_sizes(state: dict, config) -> dict:
        """Config field -> (size, the keys that show it), for the sizes the tensors' names and shapes give without
        building a model: the layers, the embedding table and, of an MoE config, the experts."""
        sizes = {"num_hidden_layers": _span(state, r"model\.layers\.(\d+)\.", "model.layers.")}
        table = "model.embed_tokens.weight" if "model.embed_tokens.weight" in state else "lm_head.weight"
        sizes.update(_table_sizes(state, table, ("vocab_size", "hidden_size")))
        experts = _span(state, r"model\.layers\.0\.mlp\.experts\.(\d+)\.", "model.layers.0.mlp.experts.")
        if config.use_moe and experts[0]:  # a dense config for MoE tensors: the fit check lists the keys
            sizes["num_experts"] = experts
            sizes["n_shared_experts"] = _span(
                state, r"model\.layers\.0\.mlp\.shared_experts\.(\d+)\.", "model.layers.0.mlp.shared_experts."
            )
        return sizes

    @staticmethod
    def prepare(state: dict, model, report: LoadReport) -> dict:
        """Tied embeddings: either key provides both; both present must agree."""
        if getattr(model.config, "tie_word_embeddings", False):
            lm_head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
            if lm_head is not None and embed is not None and not torch.equal(lm_head, embed):
                raise CheckpointError(
                    "lm_head.weight and model.embed_tokens.weight differ but the config ties them "
                    "(tie_word_embeddings=True); pass a config with tie_word_embeddings false"
                )
            shared = lm_head if lm_head is not None else embed
            if shared is not None:
                state = {**state, "lm_head.weight": shared, "model.embed_tokens.weight": shared}
        return state


class TeachingGPTCheckpoints:
    """The teaching GPT: `token_embed.weight`, `attn_blocks.{i}...`, buffers `pos_idxs` and `...tril`."""

    family = "teaching-gpt"
    ignored = {
        "device",
        "amp_dtype",
        "seed",
        "compile",
        "ckpt_dir",
        "log_dir",
        "use_wandb",
        "wandb_project",
        "dropout",
        "batch_size",
        "lr",
        "learning_rate",
        "max_iters",
        "eval_interval",
        "eval_iters",
    }

    @staticmethod
    def claims(state: dict) -> bool:
        return "token_embed.weight" in state

    @classmethod
    def translate(cls, data: dict) -> dict:
        """Toolkit config fields from the series' JSON config (its training keys dropped)."""
        return {"n_blocks" if k == "N_BLOCKS" else k: v for k, v in data.items() if k not in cls.ignored}

    @staticmethod
    def infer(state: dict, base: dict) -> tuple[dict, dict]:
        vocab, n_embed = state["token_embed.weight"].shape
        return {
            "vocab_size": vocab,
            "n_embed": n_embed,
            "context_length": state["position_embed.weight"].shape[0],
            "n_blocks": _count(state, r"attn_blocks\.(\d+)\."),
            "n_head": _count(state, r"attn_blocks\.0\.attn\.heads\.(\d+)\."),
        }, {}

    @staticmethod
    def visible_sizes(state: dict, config) -> dict:
        """As MiniMindCheckpoints.visible_sizes: the blocks, the heads, the token and position tables."""
        return {
            "n_blocks": _span(state, r"attn_blocks\.(\d+)\.", "attn_blocks."),
            "n_head": _span(state, r"attn_blocks\.0\.attn\.heads\.(\d+)\.", "attn_blocks.0.attn.heads."),
            **_table_sizes(state, "token_embed.weight", ("vocab_size", "n_embed")),
            **_table_sizes(state, "position_embed.weight", ("context_length", None)),
        }

    @staticmethod
    def prepare(state: dict, model, report: LoadReport) -> dict:
        """Check the buffers the original saves (they must be what the reference computes) and drop them."""
        ctx = model.config.context_length
        kept = {}
        for key, value in state.items():
            if key == "pos_idxs":
                if not torch.equal(value.long(), torch.arange(ctx)):
                    raise CheckpointError(
                        f"buffer pos_idxs is not 0..{ctx - 1} (shape {tuple(value.shape)}); "
                        "the checkpoint does not match context_length"
                    )
            elif key.endswith(".tril"):
                if tuple(value.shape) != (ctx, ctx) or not torch.equal(value.float(), torch.ones(ctx, ctx).tril()):
                    raise CheckpointError(
                        f"buffer {key} is not a lower-triangular mask of ones of shape ({ctx}, {ctx}) "
                        f"(got {tuple(value.shape)}); the reference cannot reproduce this model"
                    )
            else:
                kept[key] = value
                continue
            report.dropped.append(key)
        return kept


class HFDecoderCheckpoints:
    """Transformers folders of the model types of reference/hf_types.py: chosen by config.json's model_type (the
    tensors' names are MiniMind's too), every size read from config.json (reference.hf_decoder_config)."""

    family = "hf-decoder"
    claims = None  # never by the keys alone: see reference.checkpoints._loader_for

    @staticmethod
    def translate(data: dict) -> dict:
        return translate_hf_config(data)

    @staticmethod
    def infer(state: dict, base: dict) -> tuple[dict, dict]:
        return {}, {}  # config.json gives every field; the fit check holds it to the tensors

    @staticmethod
    def visible_sizes(state: dict, config) -> dict:
        """As MiniMindCheckpoints.visible_sizes: the layers and the embedding table."""
        sizes = {"num_hidden_layers": _span(state, r"model\.layers\.(\d+)\.", "model.layers.")}
        table = "model.embed_tokens.weight" if "model.embed_tokens.weight" in state else "lm_head.weight"
        return {**sizes, **_table_sizes(state, table, ("vocab_size", "hidden_size"))}

    @staticmethod
    def prepare(state: dict, model, report: LoadReport) -> dict:
        """Drop the rotary tables older Transformers saved (`...rotary_emb.inv_freq`: the reference computes them),
        and let either key of a tied head provide both."""
        kept = {}
        for key, value in state.items():
            if key.endswith("rotary_emb.inv_freq"):
                report.dropped.append(key)
            else:
                kept[key] = value
        return MiniMindCheckpoints.prepare(kept, model, report)
