"""Load real checkpoints into the reference models, safely.

Formats read:
- MiniMind `.pth` files of either generation, dense or MoE: a flat state dict,
  usually float16 (`full_sft_768.pth`, `pretrain_512.pth`, `full_sft_640_moe.pth`);
- Transformers-format folders: `config.json` plus `model.safetensors` (preferred),
  sharded safetensors with `model.safetensors.index.json`, or `pytorch_model.bin`; a config.json of
  one of reference/hf_types.py's model types loads into the hf-decoder family (reference/hf_decoder.py),
  one of model_type minimind (or none) into MiniMind;
- a single `.safetensors` file;
- a GGUF file (llama.cpp's format) of one of those model types, dequantized to float32 by
  transformers' GGUF loader (reference/gguf.py) and loaded as a Transformers folder of that model_type;
- the teaching GPT's `{'model_state_dict': ...}` files (optimizer state beside
  it is ignored; the `pos_idxs` and per-head `tril` buffers are checked and dropped);
- MiniMind's resume files (`*_resume.pth`, the weights under `model`, beside the
  optimizer state and the step).
Keys lose the prefixes of torch.compile (`_orig_mod.`) and DDP (`module.`), nested
in either order. Each family names its loader class in its registration (reference/families.py).

Safety: a pickle is read with `torch.load(weights_only=True)`, which rebuilds
tensors and plain containers only; a file that needs any other Python object is
refused with CheckpointError and none of its code runs. A file written by
`pickle.dump` instead of `torch.save` (neither a zip nor torch's legacy format)
is refused before torch sees it, as what it is, naming the objects its opcodes
import (read with pickletools, which runs nothing): torch's safe loader would
call one of protocol 4 or 5 damaged. safetensors holds no code at all and is
used wherever a folder offers it.

Configuration, in order of precedence: a config given by the caller (a preset
or `--config`), the folder's `config.json` (a folder without one is refused:
its sizes are never guessed), else, for a single file, inferred from tensor
shapes (family, sizes, generation, experts); fields the weights cannot show
take their generation's defaults and the LoadReport says which. A given config that
does not fit the tensors is an error listing the missing, unexpected and
mis-shaped keys, never a silent reshape. Tensors are converted to float32; the
export casts to its own dtype.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import pickletools
import re
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exporter.artifact.paths import read_json_object
from exporter.errors import first_line
from reference.errors import CheckpointError, ConfigError, ModelError
from reference.families import FAMILIES, family_named_by, family_of, get_family
from reference.gguf import GGUF_SUFFIX, is_gguf, read_gguf
from reference.hf_decoder_config import translate_hf_config
from reference.minimind_config import GENERATION_DEFAULTS, MiniMindConfig
from reference.presets import PRESETS

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DistributedDataParallel
SHOWN = 5  # keys listed per kind in an error message


@dataclass
class LoadReport:
    path: str
    format: str
    family: str
    # "given" (a config), "given fields" (config_data), "config.json", "gguf metadata" (a GGUF's) or "inferred"
    config_source: str
    converted: dict = field(default_factory=dict)  # original dtype -> number of tensors converted to float32
    dropped: list = field(default_factory=list)  # buffers checked and dropped
    assumed: dict = field(default_factory=dict)  # config fields the weights cannot show -> default used

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "format": self.format,
            "family": self.family,
            "config_source": self.config_source,
            "converted": self.converted,
            "dropped": self.dropped,
            "assumed": self.assumed,
        }


# ---------------------------------------------------------------- reading files


# Opcodes that push a string, that fetch from or store to the memo: what names an import in protocol 4 and on.
_STRING_OPCODES = {"UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING", "SHORT_BINSTRING"}
_MEMO_GETS, _MEMO_PUTS = {"GET", "BINGET", "LONG_BINGET"}, {"PUT", "BINPUT", "LONG_BINPUT"}


def _starts_as_zip(path: Path) -> bool:
    """Whether the file begins as a zip archive does: torch.save's format, whose directory is at its end."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _plain_pickle_error(path: Path) -> CheckpointError | None:
    """The refusal of a file written by pickle.dump, read from its opcodes (pickletools parses them and runs
    nothing); None for a torch.save file (a zip, or the legacy format, whose first pickle is torch's magic
    number), which torch.load then reads; a file that is neither a zip nor a pickle is refused too."""
    if zipfile.is_zipfile(path) or _starts_as_zip(path):
        return None
    protocol, memo, first = "0 or 1", {}, True
    imports = {}  # module.name -> None: the objects it imports, in first-use order, once each
    recent = (None, None)  # the last two values pushed: a string, or None for anything else
    try:
        with open(path, "rb") as f:
            for opcode, arg, _ in pickletools.genops(f):  # the file's first pickle, up to its STOP
                name = opcode.name
                if name == "PROTO":
                    protocol = arg
                    continue
                if name in ("FRAME", "STOP"):
                    continue
                if first and name == "LONG1" and arg == torch.serialization.MAGIC_NUMBER:
                    return None
                first = False
                if name == "MEMOIZE":
                    memo[len(memo)] = recent[1]
                    continue
                if name in _MEMO_PUTS:
                    memo[arg] = recent[1]
                    continue
                if name == "GLOBAL":  # its argument is "module name"
                    imports[arg.replace(" ", ".")] = None
                elif name == "STACK_GLOBAL" and None not in recent:  # protocol 4 on: module and name pushed before
                    imports[".".join(recent)] = None
                value = arg if name in _STRING_OPCODES else memo.get(arg) if name in _MEMO_GETS else None
                recent = (recent[1], value)
    except ValueError:  # an unknown opcode or a truncated stream: not a pickle (torch's loader said "KeyError: 101")
        return CheckpointError(
            f"{path} is not a readable torch checkpoint: neither a zip archive, as torch.save "
            "writes, nor a pickle (damaged, or of another format); check the file"
        )
    # What any pickle of tensors imports goes last: the rest is what the file would run besides.
    named = sorted(imports, key=lambda n: n.split(".")[0] in ("torch", "collections", "_codecs"))
    needs = (
        (
            f", and needs arbitrary Python objects to load (it references {', '.join(named[:SHOWN])}"
            f"{', ...' if len(named) > SHOWN else ''}); refusing to run code from a pickle"
        )
        if named
        else ""
    )
    return CheckpointError(
        f"{path} is a plain Python pickle (pickle.dump, protocol {protocol}), not a torch.save "
        f"checkpoint{needs}; nothing in it was run: re-save it as a plain state dict of tensors "
        "(torch.save(model.state_dict(), ...)) or as safetensors"
    )


def _torch_load(path: Path):
    refusal = _plain_pickle_error(path)
    if refusal is not None:
        raise refusal
    try:
        with warnings.catch_warnings():
            # torch warns of every pickle protocol but 2, even one it reads (3); the error below, if any, says more
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        if found is None:  # not an object it refused: a broken or unusual pickle ("Unsupported operand 110")
            detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(exc))
            raise CheckpointError(
                f"{path} is not a readable torch checkpoint (unpickler: "
                f"{detail.group(1) if detail else str(exc)[:120]}); the file is damaged, not a "
                "torch.save file, or saved with a pickle_protocol above 3, which torch's "
                "weights-only loader cannot read; nothing in it was run"
            ) from None
        raise CheckpointError(
            f"{path} needs arbitrary Python objects to load (it references {found.group(1)}); refusing to run code "
            "from a pickle: re-save it as a plain state dict of tensors (torch.save(model.state_dict(), ...)) "
            "or as safetensors"
        ) from None
    except Exception as exc:  # a truncated zip, not a torch file at all, ...
        detail = str(exc).splitlines()[0] if str(exc) else ""
        if _starts_as_zip(path):  # miniz's text goes on for a sentence about itself
            raise CheckpointError(
                f"{path} is a truncated or damaged torch.save file, a zip archive that cannot be "
                f"read ({type(exc).__name__}: {detail.split('. ')[0][:160]}); copy or save it "
                "again"
            ) from None
        raise CheckpointError(
            f"{path} is not a readable torch checkpoint ({type(exc).__name__}: {detail[:160]}); check the file"
        ) from None


def _safetensors_load(path: Path) -> dict:
    from safetensors.torch import load_file

    try:
        path.open("rb").close()  # safetensors reports a file it may not read as "No such file or directory"
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc}); let this user read it") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); check the file"
        ) from None


def _json_object(path: Path) -> dict:
    """The JSON object of a folder's config.json or shard index, read as transformers reads it (a key given twice
    at its last value), and bounded: a file of gigabytes is refused unread."""
    return read_json_object(path, CheckpointError, "model folder file", "fix or replace it", repeated_keys=True)


def _read_folder(folder: Path) -> tuple[dict, dict | None, str]:
    # A config.json there that is no readable file (a dangling link, a folder, a FIFO) is refused, not skipped.
    config = _json_object(folder / "config.json") if os.path.lexists(folder / "config.json") else None
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        return _safetensors_load(folder / "model.safetensors"), config, "transformers-folder (safetensors)"
    if index.is_file():
        weight_map = _json_object(index).get("weight_map", {})
        shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
        outside = [s for s in shards if not isinstance(s, str) or Path(s).name != s]
        if not shards or outside:
            raise CheckpointError(
                f"{index}: weight_map must map tensor names to shard files in {folder}; "
                f"got {outside[:3] or 'no shards'}"
            )
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names {len(missing)} shard file(s) missing from {folder} "
                f"({', '.join(missing[:SHOWN])}); copy every shard the index lists"
            )
        state = {}
        for shard in shards:
            state.update(_safetensors_load(folder / shard))
        return state, config, "transformers-folder (sharded safetensors)"
    if (folder / "pytorch_model.bin").is_file():
        return _torch_load(folder / "pytorch_model.bin"), config, "transformers-folder (pytorch_model.bin)"
    present = sorted(p.name for p in folder.iterdir())[:10]
    raise CheckpointError(
        f"{folder} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin "
        f"(found: {', '.join(present) or 'nothing'}); pass a checkpoint file or a Transformers folder"
    )


def read_checkpoint(path) -> tuple[dict, dict | None, str]:
    """(flat state dict of tensors, config.json contents or None, format name), without running any code."""
    if not isinstance(path, (str, os.PathLike)):  # Path(None) raised pathlib's TypeError
        raise CheckpointError(f"a checkpoint is a path (str or Path) of a file or model folder, got {path!r:.80}")
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a .pth/.safetensors file or a model folder")
    if not (path.is_dir() or path.is_file()):  # a FIFO's read waits for a writer, a device's may never end
        raise CheckpointError(
            f"checkpoint {path} is no regular file (a FIFO, a device or a socket), which would be read without end "
            "or wait for a writer; pass a .pth/.safetensors file or a model folder"
        )
    if path.is_dir():
        state, config, fmt = _read_folder(path)
    elif path.suffix == ".safetensors":
        state, config, fmt = _safetensors_load(path), None, "safetensors"
    elif is_gguf(path):
        state, config, fmt = read_gguf(path)
    elif path.suffix in PICKLE_SUFFIXES:
        state, config, fmt = _torch_load(path), None, "pth"
    else:
        raise CheckpointError(
            f"{path}: unknown checkpoint type {path.suffix!r}; expected a folder or a file "
            f"ending in .safetensors, {GGUF_SUFFIX} or {', '.join(PICKLE_SUFFIXES)}"
        )
    # The teaching GPT saves {"model_state_dict": ..., optimizer}; MiniMind's trainers save their *_resume.pth
    # as {"model": ..., "optimizer": ..., "epoch": ..., "step": ...}.
    for wrapper in ("model_state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state, fmt = state[wrapper], f"{fmt} ({wrapper})"
            break
    if not isinstance(state, dict) or not state:
        raise CheckpointError(
            f"{path} does not hold a state dict (got {'an empty dict' if state == {} else type(state).__name__}); "
            "save one with torch.save(model.state_dict(), path)"
        )
    not_tensors = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        shown = ", ".join(map(str, not_tensors[:SHOWN])) + (", ..." if len(not_tensors) > SHOWN else "")
        raise CheckpointError(
            f"{path} is not a flat state dict: {len(not_tensors)} entries are not tensors "
            f"({shown}); save model.state_dict() itself"
        )
    return _strip_wrappers(state), config, fmt


def _strip_wrappers(state: dict) -> dict:
    """The keys without the prefixes wrappers add, in whichever order they were nested: MiniMind's trainers
    wrap the compiled model in DDP (module._orig_mod.)."""
    while prefix := next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None):
        state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def checkpoint_change(path, sha256: str | None) -> str:
    """What became of the checkpoint an artifact was exported from (its path and fingerprint then): "" when it
    is there unchanged, else "is gone" or "changed since the export"."""
    path = Path(path)
    if not (path.is_file() or path.is_dir()):
        return "is gone"
    return "" if fingerprint(path) == sha256 else "changed since the export"


def fingerprint(path) -> str:
    """sha256 of a checkpoint file, or of a folder's weight and config files (names and contents). A GGUF's is the
    sha256 of its bytes alone, as sha256sum and the model hubs list it, so that the manifest names the file."""
    path = Path(path)
    named = not (is_gguf(path) and path.is_file())
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.is_file() and (p.suffix in (".safetensors", ".bin", ".json")))
    )
    digest = hashlib.sha256()
    for file in files:
        if named:
            digest.update(file.name.encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------- per-family config inference


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
    ignored = {
        "architectures",
        "auto_map",
        "model_type",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "_name_or_path",
        "flash_attn",
        "use_cache",
        "pad_token_id",
        "scoring_func",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
    }

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
    claims = None  # never by the keys alone: see _loader_for

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


# The config.json model_types a checkpoint may name, every family's.
KNOWN_MODEL_TYPES = tuple(model_type for family in FAMILIES.values() for model_type in family.model_types)


def _loader_for(state: dict, path, config_json: dict | None = None, config=None):
    """The loader of the family config.json's (or the given config fields') model_type names, or of the given
    config's family, when that loader claims no tensors by their keys (`claims` None: a Hugging Face decoder's names
    are MiniMind's too); else the one whose keys the tensors hold."""
    model_type = config_json.get("model_type") if config_json is not None else None
    if config is None and model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(
            f"{path}: config field model_type must be a string, one of {', '.join(KNOWN_MODEL_TYPES)}, "
            f"got {model_type!r:.40}; correct it"
        )
    named = family_of(config) if config is not None else family_named_by(model_type)
    loader = named.checkpoint_loader() if named is not None else None
    if loader is not None and loader.claims is None:
        return loader
    if config is None and isinstance(model_type, str) and named is None:
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(KNOWN_MODEL_TYPES)} (another decoder exports as your own, reference/byo.py)"
        )
    for loader in filter(None, (family.checkpoint_loader() for family in FAMILIES.values())):
        if loader.claims is not None and loader.claims(state):
            return loader
    raise CheckpointError(
        f"{path}: no known model family has these keys (first: {', '.join(list(state)[:SHOWN])}); "
        "export your own decoder with reference.byo instead"
    )


# ---------------------------------------------------------------- fitting tensors to a model


def _fit_error(path, config, missing, unexpected, misshaped) -> CheckpointError:
    parts = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if keys:
            parts.append(f"{len(keys)} {label} ({', '.join(keys[:SHOWN])}{', ...' if len(keys) > SHOWN else ''})")
    return CheckpointError(
        f"checkpoint {path} does not fit the {family_of(config).name} config: {'; '.join(parts)}; "
        "pass the preset or --config that matches the checkpoint, or neither to infer it; a "
        "model of another design exports as your own decoder (reference/byo.py)"
    )


_MATCHING_CONFIG = "pass the preset or config that matches the checkpoint, or none to infer it"
_SIZE_FIXES = {  # config source -> what to do about a size the tensors do not hold
    "given": _MATCHING_CONFIG,
    "inferred": _MATCHING_CONFIG,
    "given fields": "set it to {held} in --config, or leave it out to infer it",
    "config.json": "correct it in its config.json to {held}, or pass --config with the checkpoint's sizes",
    "gguf metadata": "the file contradicts itself; convert the model to GGUF again, or export its Transformers folder",
}


def _check_sizes(path, loader, state: dict, config, source: str) -> None:
    """Refuse a config whose layer count or table sizes the tensors' names and shapes contradict, before a model
    of that config is built: even on the meta device, building a model of a stray layer count (20000 layers,
    say) takes long, only for the fit check to refuse it."""
    try:
        sizes = loader.visible_sizes(state, config)
    except ValueError as exc:  # a gap in the numbered keys
        raise CheckpointError(
            f"{path}: {exc}, so no config fits its tensors; remove the stray keys or restore the missing ones"
        ) from None
    for name, (held, shown) in sizes.items():
        value = getattr(config, name)
        if value != held:
            raise CheckpointError(
                f"{path}: config field {name} is {value} but the checkpoint holds {held} "
                f"({shown}); {_SIZE_FIXES[source].format(held=held)}"
            )


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _check_fit(path, config, model, state: dict) -> None:
    model_tensors = model.state_dict()
    expected = {k: tuple(v.shape) for k, v in model_tensors.items()}
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    misshaped = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {expected[k]}"
        for k in expected
        if k in state and tuple(state[k].shape) != expected[k]
    ]
    if missing or unexpected or misshaped:
        raise _fit_error(path, config, missing, unexpected, misshaped)
    not_float = [
        f"{k} ({_dtype_name(v)})"
        for k, v in state.items()
        if model_tensors[k].is_floating_point() and not v.is_floating_point()
    ]
    if not_float:
        raise CheckpointError(
            f"{path}: weights stored as integers, which no model of this toolkit holds: "
            f"{', '.join(not_float[:SHOWN])}; the file is damaged or quantised — pass the "
            "floating-point checkpoint"
        )


def _config_file(path) -> str:
    """Where a checkpoint's own config comes from: a GGUF's metadata, or a folder's config.json."""
    return "gguf metadata" if is_gguf(path) else "config.json"


def _check_arguments(config, config_data) -> None:
    """load_checkpoint's config arguments: at most one of them, config_data a dict."""
    if config_data is not None and not isinstance(config_data, dict):
        raise ConfigError(
            f"config_data must be a dict of config fields, got {type(config_data).__name__} "
            f"{str(config_data)[:40]!r}; pass json.loads of the file's text, or a config"
        )
    if isinstance(config, (str, os.PathLike, dict)):  # a preset's name, a --config file or its fields
        fix = (
            f"pass reference.get_preset({config!r}) for a preset"
            if isinstance(config, str) and config in PRESETS
            else "pass the fields of a --config file as config_data (json.loads of its text)"
        )
        raise ConfigError(f"config must be a preset's config, got {type(config).__name__} {str(config)[:40]!r}; {fix}")
    if config is not None and config_data is not None:  # else config_data would be ignored (the CLI refuses the pair)
        raise ConfigError("give config (a preset's config) or config_data (config fields), not both")


def _given_config(path, loader, config):
    """The caller's config, refused when it is of another family than the tensors."""
    if family_of(config).name != loader.family:
        raise CheckpointError(
            f"checkpoint {path} holds a {loader.family} model but the given config is "
            f"{family_of(config).name}; pass a {loader.family} preset or config, or none"
        )
    return config


def _built_config(path, loader, state: dict, config_json: dict | None, given_fields: bool) -> tuple:
    """(config, assumed fields) from config.json's or the given fields, the rest inferred from the tensors."""
    try:
        base = loader.translate(config_json) if config_json is not None else {}
    except ConfigError as exc:
        where = "the given config fields" if given_fields else f"its {_config_file(path)}"
        raise CheckpointError(f"{path}: {where}: {exc}") from None
    try:
        inferred, assumed = loader.infer(state, base)
    except ModelError as exc:  # a field or a shape infer names itself
        raise CheckpointError(f"{path}: {exc}") from None
    except (KeyError, IndexError, ValueError, TypeError, ZeroDivisionError) as exc:
        missing = f"no tensor {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise CheckpointError(
            f"{path}: cannot infer the {loader.family} config from the checkpoint's tensors "
            f"({missing}); pass --preset or --config with its sizes, or, if the model is not "
            f"a {loader.family} one, export it as your own decoder (reference/byo.py)"
        ) from None
    try:
        config = get_family(loader.family).config_class.from_dict({**inferred, **base})
    except ConfigError as exc:
        raise CheckpointError(
            f"{path}: no valid config from the checkpoint's shapes and the given fields ({exc})"
        ) from None
    return config, assumed


def _fitted_state(path, loader, config, state: dict, report: LoadReport) -> dict:
    """The tensors prepared for the family's model and checked against it, built on the meta device: a config
    that does not fit them (a stray key model.layers.99999..., --config vocab_size 1e9) is refused before
    gigabytes are allocated for it."""
    try:
        with torch.device("meta"):
            shapes = get_family(loader.family).model_type()(config)
    except (RuntimeError, TypeError, OverflowError, ValueError) as exc:  # a size beyond what a tensor can hold
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: the config's sizes make tensors too large to build ({detail[:200]}); pass "
            "the preset or --config that matches the checkpoint, or neither to infer it"
        ) from None
    state = loader.prepare(state, shapes, report)
    _check_fit(path, config, shapes, state)
    return state


def _loaded_model(family_name: str, config, state: dict, report: LoadReport):
    """The model with the tensors in float32 (the report counts the ones converted): built on the meta device and
    given the state's own tensors (`assign`), so that a float32 checkpoint is held once, as read, with no random
    initialisation and no copy; a model the state leaves anything unset in is built for real instead."""
    for value in state.values():
        if value.dtype != torch.float32:
            report.converted[_dtype_name(value)] = report.converted.get(_dtype_name(value), 0) + 1
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    with torch.device("meta"):
        model = get_family(family_name).model_type()(config)
    # Parameters shared between modules (a tied head) are one object; assign gives each module its own.
    shared = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    model.load_state_dict(state, assign=True)
    for names in shared.values():
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):  # a buffer no checkpoint holds
        model = get_family(family_name).model_type()(config)
        model.load_state_dict(state)
    return model.eval()


def load_checkpoint(path, config=None, config_data: dict | None = None):
    """(reference model in float32 and eval mode, LoadReport) for a checkpoint file or folder.

    `config`: a family config that the checkpoint must fit exactly (a preset).
    `config_data`: config fields as JSON data (toolkit or upstream names) that
    take the place of a config.json; the remaining fields are inferred. With
    neither, config.json beside the weights is read when there is one.
    """
    _check_arguments(config, config_data)
    state, config_json, fmt = read_checkpoint(path)
    if config is None and config_data is None and config_json is None and Path(path).is_dir():
        raise CheckpointError(
            f"{path} holds no config.json, which a model folder's sizes are read from; copy the model's "
            "config.json beside its weights, or pass --config with its fields"
        )
    # A Hugging Face folder's tensors carry MiniMind's names: a config.json without a model_type reads as MiniMind's.
    untyped = config is None and config_data is None and config_json is not None and "model_type" not in config_json
    config_json = config_data if config_data is not None else config_json
    loader = _loader_for(state, path, config_json, config)
    if config is not None:
        config, source, assumed = _given_config(path, loader, config), "given", {}
    else:
        try:
            config, assumed = _built_config(path, loader, state, config_json, given_fields=config_data is not None)
        except CheckpointError as exc:
            if not untyped:
                raise
            raise CheckpointError(
                f"{path}: its config.json gives no model_type and is no MiniMind config "
                f"({first_line(exc, 160).replace(f'{path}: ', '')}); add model_type: one of "
                f"{', '.join(KNOWN_MODEL_TYPES)}"
            ) from None
        source = (
            "given fields" if config_data is not None else _config_file(path) if config_json is not None else "inferred"
        )
    report = LoadReport(str(path), fmt, loader.family, source, assumed=assumed)
    _check_sizes(path, loader, state, config, source)
    state = _fitted_state(path, loader, config, state, report)
    # Once the tensors fit: the assumed fields change no shape, and a refusal stays one line.
    for name, value in assumed.items():
        log.warning("%s: %s is not visible in the weights; assuming %r (pass --config to change it)", path, name, value)
    return _loaded_model(loader.family, config, state, report), report
