"""One error hierarchy; every message says what was expected, what was found and what to do.

The CLI turns these into a one-line message and exit code 2 (usage or input
error). Parity failures are results, not errors: they exit with 1.
"""

import importlib
import numbers


def first_of(names, shown: int) -> str:
    """The first `shown` of `names`, and how many more there are: a list in a message that stays one line."""
    names = [str(name) for name in names]
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


# pyproject.toml's `export` extra, which the base install (inspect, generate, a golden bundle's replay) goes without:
# what a message tells a user without it to install, and the modules it brings (torch.onnx's translator, the graph
# library whose weights the export moves out, the checkpoint reader).
EXPORT_EXTRA = "pip install 'export-onnx[export]'"
EXPORT_MODULES = ("torch", "onnxscript", "onnx_ir", "safetensors")


def export_extra_error(modules: tuple[str, ...] = EXPORT_MODULES) -> str | None:
    """Why the first of `modules` that fails to import does, or None when all import: the export needs the whole
    extra, rebuilding the reference model ("torch",) alone (onnx_ir is slow to import); a deployment may hold only
    the base install. A broken install counts too: torch raises OSError when one of its shared libraries cannot be
    loaded (libtorch_cpu.so, a CUDA library of another version)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except (ImportError, OSError) as exc:
            return str(exc)
    return None


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message, or its type's name when it has none: what a one-line error
    quotes of a library's multi-line one. Past `limit` characters its middle is left out: onnxruntime puts
    the reason last, after the source file and the kernel's C++ signature."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0]
    if limit is None or len(line) <= limit:
        return line
    half = (limit - 5) // 2
    return f"{line[:half]} ... {line[-half:]}"


class ToolkitError(Exception):
    """Base of every error a user can cause; the message is shown as is."""


class ArtifactError(ToolkitError):
    """An artifact folder is missing, incomplete, or does not match its manifest."""


class GraphRunError(ArtifactError):
    """A graph that loaded but failed to run: damaged, or not built to the manifest's contract."""

    def __init__(self, graph_file: str, detail: str):
        # The graphs refuse an id or label outside the vocabulary, as the reference does: the inputs come first.
        super().__init__(
            f"onnxruntime failed running {graph_file} ({detail}); check the inputs (an id or label "
            "outside the vocabulary fails here as in the reference), else the graph is damaged: "
            "re-export the folder"
        )
        self.graph_file, self.detail = graph_file, detail


class OutputPathError(ToolkitError):
    """The export destination cannot be used without losing what is there."""


class ExportFailed(ToolkitError):
    """torch.onnx or a post-export check failed; nothing was written to the destination."""


class InputError(ToolkitError):
    """Token ids, lengths or options outside what the model accepts."""


class QualityTargetMissed(ToolkitError):
    """No mix of precisions below the rung above the scheme keeps an export's quality target (exporter.tuning)."""


class ProviderError(ToolkitError):
    """A requested ONNX Runtime execution provider is not available here."""


class TokenizerError(ToolkitError):
    """A tokenizer is missing, unreadable, or does not fit the model's vocabulary."""


class ConsumerError(ToolkitError):
    """A consumer runtime (onnxruntime-genai) is missing or cannot load an artifact."""


def is_integer(value) -> bool:
    """A Python or numpy integer (numpy registers its integers as numbers.Integral); bools are not token ids."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_flag(name: str, value) -> None:
    """InputError unless `value` is True or False: a string such as "no" or "false" would read as true."""
    if not isinstance(value, bool):
        raise InputError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
