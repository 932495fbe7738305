"""Checkpoint files read into a flat state dict of tensors, whatever their format, and fingerprinted.

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
Keys lose the prefixes of torch.compile (`_orig_mod.`) and DDP (`module.`), nested in either order.

Pickles are read as reference/pickles.py reads them, running none of their code; safetensors holds no code at all
and is used wherever a folder offers it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from exporter.artifact.paths import read_json_object
from reference.errors import SHOWN, CheckpointError
from reference.gguf import GGUF_SUFFIX, is_gguf, read_gguf
from reference.pickles import load_torch_file

PICKLE_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DistributedDataParallel


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
        return load_torch_file(folder / "pytorch_model.bin"), config, "transformers-folder (pytorch_model.bin)"
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
        state, config, fmt = load_torch_file(path), None, "pth"
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
