"""GGUF files (llama.cpp's format) read through transformers' GGUF loader: float32 weights, config and tokenizer.

A GGUF of an architecture of reference/hf_types.py becomes what a Transformers folder of that model_type gives
reference.checkpoint_files: a state dict under Transformers' names, dequantized to float32 by transformers (each quant
type's blocks as llama.cpp defines them), and the config as transformers reads it, without its GGUF quantization
record. transformers also converts the file's tokenizer metadata into a `tokenizers` tokenizer, which comes along
with its special tokens and chat template.

transformers reads a GGUF with the `gguf` package, and loads a model from one only with `accelerate` installed (the
independent reference of verify does): both, with transformers, are the optional extra GGUF_EXTRA, imported here
and nowhere else on the export path.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from reference.errors import CheckpointError
from reference.hf_decoder_config import MODEL_TYPES
from reference.quiet import quiet_loggers

GGUF_SUFFIX = ".gguf"
GGUF_EXTRA = "pip install 'export-onnx[gguf]'"
# The tokenizer_config.json keys a GGUF's tokenizer names, as transformers' tokenizer gives them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def is_gguf(path) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX


def gguf_missing() -> str:
    """Why a GGUF cannot be read here (the missing module of the extra), or ""."""
    try:
        import accelerate  # noqa: F401  transformers' from_pretrained(gguf_file=) refuses to run without it
        import gguf  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return ""


def _require_extra(path: Path) -> None:
    missing = gguf_missing()
    if missing:
        raise CheckpointError(
            f"reading {path} needs the gguf extra (gguf, accelerate, transformers), which does not import here "
            f"({missing}); install it: {GGUF_EXTRA}"
        )


def _unreadable(path: Path, exc: Exception) -> CheckpointError:
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return CheckpointError(
        f"{path} is not a GGUF transformers can read ({detail}); pass a GGUF of architecture "
        f"{', '.join(MODEL_TYPES)}, or its Transformers folder"
    )


class _TensorNames:
    """What load_gguf_checkpoint reads of the model it maps the file's tensors to: the config and the state dict's
    keys. It maps the tensors of every submodule again, building gguf's name table once per module (~400 for a
    30-layer model, a third of the loading time); for these architectures the whole model's keys map every tensor,
    so this model shows no submodules."""

    def __init__(self, model):
        self.config = model.config
        self._keys = dict.fromkeys(model.state_dict())

    def state_dict(self) -> dict:
        return self._keys

    def named_children(self):
        return iter(())


def quiet_loader():
    """Where transformers dequantizes a GGUF: its tqdm bar goes to stderr whatever transformers' logging says, and
    the CLI's progress lines are the command's own."""
    return contextlib.redirect_stderr(io.StringIO())


def read_gguf(path: Path) -> tuple[dict, dict, str]:
    """(state dict of float32 tensors under Transformers' names, the config as config.json data, format name).

    Raises:
        CheckpointError: the extra is missing, the file is no GGUF transformers reads, or its architecture is not
            one of reference.hf_decoder_config.MODEL_TYPES.
    """
    path = Path(path)
    _require_extra(path)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:  # what transformers warns of a file it reads (a missing vocab_size) is the error below, or nothing
        with quiet_loggers("transformers"):
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # a damaged file, or an architecture transformers does not read (ValueError, KeyError)
        raise _unreadable(path, exc) from None
    if config.model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{path} holds a {config.model_type} model, which this toolkit does not export; GGUFs of architecture "
            f"{', '.join(MODEL_TYPES)} export (another decoder exports as your own, reference/byo.py)"
        )
    # Transformers' names for the file's tensors come from a model of the config; on the meta device it holds no data.
    with torch.device("meta"):
        names = _TensorNames(AutoModelForCausalLM.from_config(config))
    try:
        with quiet_loader():
            loaded = load_gguf_checkpoint(
                str(path), return_tensors=True, model_to_load=names, torch_dtype=torch.float32
            )
    except Exception as exc:  # a tensor of a quant type the gguf package cannot dequantize, a truncated file
        raise _unreadable(path, exc) from None
    data = config.to_dict()
    data.pop("quantization_config", None)  # the file's record; the weights are float32 now
    return loaded["tensors"], data, "gguf"


def read_gguf_tokenizer(path: Path) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json fields: special tokens and chat template) of a GGUF's tokenizer,
    as transformers converts it."""
    path = Path(path)
    _require_extra(path)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # a tokenizer type transformers cannot convert
        raise CheckpointError(
            f"transformers cannot convert the tokenizer of {path} ({str(exc).strip().splitlines()[0][:200]}); "
            "pass the model's tokenizer.json (`tokenizer`), or leave the tokenizer out (`with_tokenizer`)"
        ) from None
    fields = {name: getattr(tokenizer, name) for name in SPECIAL_TOKENS}
    fields["chat_template"] = tokenizer.chat_template
    return tokenizer.backend_tokenizer.to_str(), {k: v for k, v in fields.items() if v is not None}
