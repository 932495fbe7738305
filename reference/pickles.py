"""torch.save files (and pickles posing as them) read without running any of their code.

A pickle is read with `torch.load(weights_only=True)`, which rebuilds tensors and plain containers only; a file that
needs any other Python object is refused with CheckpointError and none of its code runs. A file written by
`pickle.dump` instead of `torch.save` (neither a zip nor torch's legacy format) is refused before torch sees it, as
what it is, naming the objects its opcodes import (read with pickletools, which runs nothing): torch's safe loader
would call one of protocol 4 or 5 damaged.
"""

from __future__ import annotations

import pickle
import pickletools
import re
import warnings
import zipfile
from pathlib import Path

import torch

from reference.errors import SHOWN, CheckpointError

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


def load_torch_file(path: Path):
    """What a torch.save file holds, read by torch's weights-only loader; a plain pickle, a file needing other
    Python objects, and a damaged file are refused with CheckpointError."""
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
