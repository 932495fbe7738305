"""onnxruntime-genai as a consumer of an artifact folder: its own generation loop over decode.onnx.

The folder is loaded as it is (genai_config.json beside the graph), on the
CPU. onnxruntime-genai stops at EOS and leaves the EOS token out of what it
returns; our runtime and the reference keep it. A model without an EOS still
stops in genai, at the id consumers.genai_eos_token_id names.
"""

from __future__ import annotations

import json
from pathlib import Path

from exporter.artifact.consumers import GENAI_CONFIG, genai_unsupported
from exporter.artifact.folder import Artifact, open_artifact
from exporter.artifact.paths import TEXT_PATH_FIX, check_text_path
from exporter.errors import ArtifactError, ConsumerError, first_line
from exporter.runtime.runner import check_prompt

INSTALL_HINT = "pip install onnxruntime-genai"


def genai_version() -> str | None:
    """The installed onnxruntime-genai version, or None when it cannot be imported."""
    try:
        import onnxruntime_genai
    except ImportError:
        return None
    return onnxruntime_genai.__version__


def _import_genai():
    try:
        import onnxruntime_genai
    except ImportError:
        raise ConsumerError(f"onnxruntime-genai is not installed; {INSTALL_HINT}") from None
    return onnxruntime_genai


def genai_model_type(folder: Path) -> str:
    """The model type genai_config.json names; ArtifactError, in one line, when the file is no JSON that names
    one (an edit listed again in the manifest: its hash alone cannot tell)."""
    path = Path(folder) / GENAI_CONFIG
    try:
        return json.loads(path.read_text())["model"]["type"]
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, or JSON without model.type
        raise ArtifactError(
            f"{path} is not onnxruntime-genai's config ({type(exc).__name__}: {first_line(exc)}); "
            "undo the edit or re-export the folder"
        ) from None


class GenaiGenerator:
    """An artifact folder loaded once in onnxruntime-genai (CPU); `greedy` and `greedy_search` may be called many
    times."""

    def __init__(self, artifact: Artifact | Path, threads: int = 0):
        """`artifact`: an opened Artifact, or an artifact folder's path, opened here (every hash checked);
        `threads`: intra-op threads for its session, 0 for what genai_config.json asks (one per physical core)."""
        og = _import_genai()
        artifact = open_artifact(artifact)
        self.folder, self.manifest = artifact.folder, artifact.manifest
        folder = self.folder
        reason = genai_unsupported(self.manifest)
        if reason:
            raise ConsumerError(f"{folder} cannot run in onnxruntime-genai: {reason}")
        if GENAI_CONFIG not in self.manifest.files:  # listed, so hashed: what the export wrote
            raise ConsumerError(
                f"{folder} has no {GENAI_CONFIG}; re-export it with this toolkit to run it in onnxruntime-genai"
            )
        self.model_type = genai_model_type(self.folder)
        check_text_path(folder, "artifact folder", TEXT_PATH_FIX, ArtifactError)
        try:
            config = og.Config(str(self.folder))
            config.clear_providers()  # the CPU
            if threads:  # over genai_config.json's own count, without rewriting the hashed file
                options = {"intra_op_num_threads": threads}
                config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
            self.model = og.Model(config)
        except Exception as exc:  # onnxruntime-genai raises RuntimeError with the runtime's message
            raise ConsumerError(f"onnxruntime-genai could not load {folder}: {first_line(exc)}") from exc
        self._og = og

    def greedy_search(self, max_length: int, stop_at_eos: bool = True):
        """A new onnxruntime-genai Generator doing greedy search on this model, for sequences of up to
        `max_length` tokens, prompt included; the caller appends the prompt and steps it. Without
        `stop_at_eos` it never picks EOS and runs to max_length (a benchmark times a fixed number of steps)."""
        options = {"do_sample": False, "num_beams": 1, "max_length": max_length}
        if not stop_at_eos:
            options["min_length"] = max_length  # below min_length genai masks EOS out of the choice
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(**options)
        return self._og.Generator(self.model, params)

    def greedy(self, prompt_ids, max_new_tokens: int) -> list[int]:
        """New token ids, greedy; stops at EOS, which onnxruntime-genai leaves out."""
        ids = check_prompt(self.manifest.config, prompt_ids, max_new_tokens)
        if max_new_tokens == 0:
            return []
        generator = self.greedy_search(len(ids) + max_new_tokens)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        return [int(token) for token in generator.get_sequence(0)[len(ids) :]]


def genai_greedy(folder: Path, prompt_ids, max_new_tokens: int) -> list[int]:
    """Greedy new tokens from onnxruntime-genai for one prompt (EOS, where reached, is left out)."""
    return GenaiGenerator(folder).greedy(prompt_ids, max_new_tokens)
