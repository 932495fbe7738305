"""Sidecar configs that let onnxruntime-genai and Hugging Face Optimum load an artifact folder as it is.

- genai_config.json: onnxruntime-genai (`onnxruntime_genai.Model(folder)`) drives decode.onnx;
- config.json + generation_config.json: Optimum
  (`ORTModelForCausalLM.from_pretrained(folder, file_name="decode.onnx", use_cache=True)`).

Both consumers only run the graph; the model type tells them which defaults
to assume (input names, tokenizer handling), not how to compute. A family
therefore supplies just two names, its registration's consumer_types (reference/families.py); everything else comes
from the manifest. Which type each family gets in each consumer is tabulated in docs/runtime.md ("Deploying with
onnxruntime-genai and Optimum"); tests/artifact/ load the folders in both.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from exporter.artifact.contract import KV_KINDS
from exporter.artifact.manifest import Manifest
from exporter.artifact.paths import json_type, read_json_bounded
from exporter.artifact.tokenizer import TOKENIZER, TokenizerSource, copy_tokenizer, minimal_tokenizer_config
from exporter.errors import ArtifactError, InputError, first_line
from reference.families import get_family

log = logging.getLogger(__name__)

GENAI_CONFIG = "genai_config.json"
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"

# MiniMind's sampling (its eval script: temperature and top_p 0.85, with transformers' top_k of 50): the
# CLI's --sample and the consumers' configs (genai_config.json, generation_config.json) sample so.
# (exporter.runtime.generation.SamplingConfig's own defaults leave the distribution as it is.)
MINIMIND_SAMPLING = {"temperature": 0.85, "top_k": 50, "top_p": 0.85}


@dataclass(frozen=True)
class FamilyTypes:
    """How a model family presents itself to each consumer; None where it cannot run there (with why)."""

    genai: str | None  # onnxruntime-genai model.type
    hf: str | None  # Hugging Face config.json model_type
    genai_unsupported: str = ""
    hf_unsupported: str = ""


def consumer_types(manifest: Manifest) -> FamilyTypes:
    """What each consumer is told the artifact's model is: its family's consumer types (reference/families.py)."""
    genai, hf = get_family(manifest.family).consumer_types(manifest.config)
    reason = f"model family {manifest.family!r} names no {{}} type in its registration (reference/families.py)"
    return FamilyTypes(
        genai, hf, "" if genai else reason.format("onnxruntime-genai"), "" if hf else reason.format("Optimum")
    )


# Config fields that keep their meaning under the same name in a Hugging Face config.json.
_HF_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "hidden_act",
)


# The most positions onnxruntime-genai reads a context length as (a signed 32-bit integer), and Optimum's
# configs likewise; a larger one is refused when genai_config.json is loaded.
MAX_CONTEXT_LENGTH = 2**31 - 1


def check_context_length(max_position_embeddings: int) -> None:
    """InputError unless the consumers can load a model of `max_position_embeddings` positions."""
    if max_position_embeddings > MAX_CONTEXT_LENGTH:
        raise InputError(
            f"max_position_embeddings ({max_position_embeddings}) exceeds {MAX_CONTEXT_LENGTH}, the most "
            "onnxruntime-genai reads (a 32-bit integer); set the model's max_position_embeddings to the positions "
            "it was trained for"
        )


@dataclass(frozen=True)
class ModelSizes:
    """What both consumers read about a model, gathered from the manifest once."""

    types: FamilyTypes
    vocab_size: int
    context_length: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    head_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    assumed: tuple[str, ...] = ()  # fields the config does not give (a DecoderSpec may leave them out)

    @classmethod
    def of(cls, manifest: Manifest, pad_token_id: int | None = None) -> ModelSizes:
        config, cache = manifest.config, manifest.cache
        heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
        assumed = tuple(
            name for name, value in (("num_attention_heads", heads), ("hidden_size", hidden)) if value is None
        )
        # Without grouped-query attention: as many query heads as kv heads, each head_dim wide.
        heads = cache.num_key_value_heads if heads is None else heads
        return cls(
            types=consumer_types(manifest),
            vocab_size=config.vocab_size,
            context_length=config.max_position_embeddings,
            hidden_size=heads * cache.head_dim if hidden is None else hidden,
            assumed=assumed,
            num_attention_heads=heads,
            num_key_value_heads=cache.num_key_value_heads,
            num_hidden_layers=cache.num_layers,
            head_size=cache.head_dim,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.eos_token_id if pad_token_id is None else pad_token_id,
        )


def genai_unsupported(manifest: Manifest) -> str:
    """Why onnxruntime-genai cannot run this artifact, or '' when it can."""
    types = consumer_types(manifest)
    return "" if types.genai else types.genai_unsupported


def optimum_unsupported(manifest: Manifest) -> str:
    """Why Optimum cannot run this artifact, or '' when it can."""
    types = consumer_types(manifest)
    if types.hf is None:
        return types.hf_unsupported
    sizes = ModelSizes.of(manifest)
    if sizes.head_size * sizes.num_attention_heads != sizes.hidden_size:
        # Optimum sizes the empty first-step cache as hidden_size / num_attention_heads, ignoring head_dim.
        return (
            f"head_dim {sizes.head_size} != hidden_size / num_attention_heads "
            f"({sizes.hidden_size} / {sizes.num_attention_heads}); Optimum would build a wrong empty cache"
        )
    return ""


def genai_eos_token_id(eos_token_id: int | None, vocab_size: int) -> int:
    """The token onnxruntime-genai stops at: the model's EOS, or for a model without one the last id.

    genai always stops at some id: it refuses one outside the vocabulary, and given none it stops at its pad
    id, 0 unless set (as of 0.18.0: a teaching GPT without an EOS would stop at the first 0 it generates, which
    is "!" in GPT-2's tokenizer). The last id of the teaching GPT's 50304-row vocabulary is a padding row
    that GPT-2's 50257-token tokenizer never produces."""
    return vocab_size - 1 if eos_token_id is None else eos_token_id


def _token_ids(sizes: ModelSizes) -> dict:
    """The special ids for genai_config.json; onnxruntime-genai reads a missing one as "none", not a JSON null."""
    ids = {
        "bos_token_id": sizes.bos_token_id,
        "eos_token_id": genai_eos_token_id(sizes.eos_token_id, sizes.vocab_size),
        "pad_token_id": sizes.pad_token_id,
    }
    return {name: value for name, value in ids.items() if value is not None}


def genai_config(manifest: Manifest, sizes: ModelSizes) -> dict:
    """onnxruntime-genai's config for decode.onnx (past length 0 serves as the prompt step)."""
    cache = manifest.cache
    names = {
        kind: (cache.past_name.format(layer="%d", kind=kind), cache.present_name.format(layer="%d", kind=kind))
        for kind in KV_KINDS
    }
    decoder = {
        "filename": manifest.decode.file,
        # 0 threads: ONNX Runtime's default (one per physical core).
        "session_options": {
            "log_id": "onnxruntime-genai",
            "provider_options": [],
            "intra_op_num_threads": 0,
            "inter_op_num_threads": 1,
        },
        "head_size": sizes.head_size,
        "hidden_size": sizes.hidden_size,
        "num_attention_heads": sizes.num_attention_heads,
        "num_key_value_heads": sizes.num_key_value_heads,
        "num_hidden_layers": sizes.num_hidden_layers,
        "inputs": {
            "input_ids": "input_ids",
            "attention_mask": "attention_mask",
            "position_ids": "position_ids",
            "past_key_names": names["key"][0],
            "past_value_names": names["value"][0],
        },
        "outputs": {"logits": "logits", "present_key_names": names["key"][1], "present_value_names": names["value"][1]},
    }
    return {
        "model": {
            "type": sizes.types.genai,
            "context_length": sizes.context_length,
            "vocab_size": sizes.vocab_size,
            **_token_ids(sizes),
            "decoder": decoder,
        },
        # The graph concatenates past and new keys, so past and present cannot share one buffer.
        "search": {
            "max_length": sizes.context_length,
            "past_present_share_buffer": False,
            "do_sample": False,
            # greedy unless the caller samples, and then as MiniMind does (a top_k of 1 here made
            # genai's sampling greedy)
            "num_beams": 1,
            "num_return_sequences": 1,
            "min_length": 0,
            **MINIMIND_SAMPLING,
            "repetition_penalty": 1.0,
            "length_penalty": 1.0,
            "early_stopping": True,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
        },
    }


def hf_config(manifest: Manifest, sizes: ModelSizes) -> dict:
    """A Hugging Face config.json: what Optimum reads to build its cache and stop at EOS."""
    config = manifest.config.to_dict()
    return {
        "model_type": sizes.types.hf,
        **{name: config[name] for name in _HF_FIELDS if name in config},
        "hidden_size": sizes.hidden_size,
        "num_attention_heads": sizes.num_attention_heads,
        "num_key_value_heads": sizes.num_key_value_heads,
        "num_hidden_layers": sizes.num_hidden_layers,
        "vocab_size": sizes.vocab_size,
        "max_position_embeddings": sizes.context_length,
        "head_dim": sizes.head_size,
        "bos_token_id": sizes.bos_token_id,
        "eos_token_id": sizes.eos_token_id,
        "pad_token_id": sizes.pad_token_id,
        "torch_dtype": manifest.dtype,
        "use_cache": True,
    }


def generation_config(sizes: ModelSizes) -> dict:
    return {
        "bos_token_id": sizes.bos_token_id,
        "eos_token_id": sizes.eos_token_id,
        "pad_token_id": sizes.pad_token_id,
        "do_sample": False,
        **MINIMIND_SAMPLING,
        "max_length": sizes.context_length,
    }


def write_consumer_files(folder: Path, manifest: Manifest, tokenizer: TokenizerSource | None = None) -> list[str]:
    """Write the configs of every consumer this family runs in, and copy the tokenizer; return the names."""
    sizes = ModelSizes.of(manifest, tokenizer.pad_token_id() if tokenizer else None)
    if sizes.assumed:
        log.warning(
            "the config gives no %s: the consumers' configs assume %d query heads and hidden size %d; "
            "set them in the DecoderSpec if the model's differ",
            " or ".join(sizes.assumed),
            sizes.num_attention_heads,
            sizes.hidden_size,
        )
    documents = {}
    if reason := genai_unsupported(manifest):
        log.warning("no %s: onnxruntime-genai cannot run this artifact (%s)", GENAI_CONFIG, reason)
    else:
        documents[GENAI_CONFIG] = genai_config(manifest, sizes)
    if optimum_unsupported(manifest):
        log.warning("no %s: Optimum cannot run this artifact (%s)", HF_CONFIG, optimum_unsupported(manifest))
    else:
        documents[HF_CONFIG] = hf_config(manifest, sizes)
        documents[GENERATION_CONFIG] = generation_config(sizes)
    for name, document in documents.items():
        (Path(folder) / name).write_text(json.dumps(document, indent=2) + "\n")
    names = list(documents)
    if tokenizer is not None and GENAI_CONFIG in documents:
        _warn_of_genai_tokenizer_limits(tokenizer, sizes)
    if tokenizer is not None:
        for disagreement in tokenizer.disagreements({"bos_token": sizes.bos_token_id, "eos_token": sizes.eos_token_id}):
            log.warning("%s", disagreement)
        minimal = minimal_tokenizer_config(
            tokenizer, sizes.context_length, sizes.bos_token_id, sizes.eos_token_id, sizes.pad_token_id
        )
        names += copy_tokenizer(tokenizer, folder, minimal)
    return names


def _warn_of_genai_tokenizer_limits(tokenizer: TokenizerSource, sizes: ModelSizes) -> None:
    """What onnxruntime-genai will do wrong with this tokenizer in this artifact, said at export: it writes the
    artifact all the same, as our runtime and Optimum read the tokenizer as the `tokenizers` library does."""
    if tokenizer.genai_unreadable:
        log.warning(
            "%s is %s: onnxruntime-genai's og.Tokenizer cannot read it (it fails to load, "
            "encodes other ids or, for WordPiece and WordLevel, may crash); generate with token ids there, or "
            "text with export-onnx generate --prompt",
            tokenizer.tokenizer.name,
            tokenizer.genai_unreadable,
        )
    if tokenizer.missing_byte_symbols:
        log.warning(
            "%s lacks %d of the 256 byte symbols of a byte-level BPE: onnxruntime-genai's og.Tokenizer "
            "encodes a character needing one as -1, which the graphs refuse; train it with "
            "initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), or generate there with token ids",
            tokenizer.tokenizer.name,
            tokenizer.missing_byte_symbols,
        )
    stop_id = genai_eos_token_id(sizes.eos_token_id, sizes.vocab_size)
    if sizes.eos_token_id is None and stop_id in tokenizer.tokens:
        log.warning(
            "the model has no eos_token_id, so %s makes onnxruntime-genai stop at the last id, %d, but the "
            "tokenizer uses it for %r: genai would end a text at that token; give the model an "
            "eos_token_id",
            GENAI_CONFIG,
            stop_id,
            tokenizer.tokens[stop_id],
        )


# The fields of each consumer's config that carry the model's ids and sizes, as dotted paths: what the consumer
# stops at, pads with and sizes its cache and search by. Edited and listed again in the manifest, its hash cannot
# tell: an eos_token_id changed in genai_config.json made onnxruntime-genai stop at another token. The other fields
# are not compared: sampling defaults and session options are the consumer's settings, not the model's, and the
# model type is the toolkit's choice of the consumer's defaults (consumer_types), which another version of it may
# make otherwise; the consumer check runs the folder with the type it names.
_SIDECAR_FIELDS = {
    GENAI_CONFIG: (
        "model.context_length",
        "model.vocab_size",
        "model.bos_token_id",
        "model.eos_token_id",
        "model.pad_token_id",
        "model.decoder.filename",
        "model.decoder.head_size",
        "model.decoder.hidden_size",
        "model.decoder.num_attention_heads",
        "model.decoder.num_key_value_heads",
        "model.decoder.num_hidden_layers",
        "search.max_length",
    ),
    HF_CONFIG: (*_HF_FIELDS, "head_dim", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype"),
    GENERATION_CONFIG: ("bos_token_id", "eos_token_id", "pad_token_id", "max_length"),
}
_ABSENT = object()


def _field(document, path: str):
    for key in path.split("."):
        if not isinstance(document, dict) or key not in document:
            return _ABSENT
        document = document[key]
    return document


def _shown(value) -> str:
    return "absent" if value is _ABSENT else json.dumps(value)


def sidecar_differences(folder: Path, manifest: Manifest) -> dict[str, list[str]]:
    """Where the consumer configs the manifest lists (genai_config.json, config.json, generation_config.json) give
    ids or sizes other than the manifest's model config does, by file: ["eos_token_id is 5, the manifest's
    config gives 2", ...]; a file that is no JSON object is one difference. The pad id comes from the tokenizer
    the export was given, when it names one, which the manifest does not record: where a tokenizer is listed, the
    pad id need only lie in the vocabulary and be the same in every file; otherwise it is the EOS id, as the
    export writes it.

    Args:
        folder: the artifact folder, whose listed files are read.
        manifest: its manifest.
    """
    documents = {}
    for name in _SIDECAR_FIELDS:
        if name not in manifest.files:
            continue
        try:
            documents[name] = read_json_bounded(Path(folder) / name)
        except (OSError, ValueError, RecursionError) as exc:
            documents[name] = exc
    if not documents:
        return {}
    pads = {
        _field(document, "model.pad_token_id" if name == GENAI_CONFIG else "pad_token_id")
        for name, document in documents.items()
        if isinstance(document, dict)
    }
    pad = next(iter(pads)) if TOKENIZER in manifest.files and len(pads) == 1 else None
    in_vocabulary = isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < manifest.config.vocab_size
    sizes = ModelSizes.of(manifest, pad if in_vocabulary else None)
    expected = {GENAI_CONFIG: genai_config(manifest, sizes), HF_CONFIG: hf_config(manifest, sizes)}
    expected[GENERATION_CONFIG] = generation_config(sizes)
    found = {}
    for name, document in documents.items():
        fields = _SIDECAR_FIELDS[name]
        if not isinstance(document, dict):
            reason = (
                f"{type(document).__name__}: {first_line(document, 120)}"
                if isinstance(document, Exception)
                else f"a JSON {json_type(document)}"
            )
            found[name] = [f"is no JSON object ({reason})"]
            continue
        shown = {path: (_shown(_field(document, path)), _shown(_field(expected[name], path))) for path in fields}
        differences = [
            f"{path} is {given}, the manifest's config gives {wanted}"
            for path, (given, wanted) in shown.items()
            if given != wanted  # as JSON: an id of 2.0 is no id 2
        ]
        if differences:
            found[name] = differences
    return found


def check_sidecars(folder: Path, manifest: Manifest) -> None:
    """ArtifactError, in one line, where a consumer config gives ids or sizes other than the manifest's config
    (sidecar_differences): a consumer would run the graphs as another model, and verifying the graphs alone could
    not tell."""
    differences = sidecar_differences(folder, manifest)
    if differences:
        named = "; ".join(f"{name}: {', '.join(problems[:3])}" for name, problems in differences.items())
        raise ArtifactError(
            f"{folder} holds consumer configs that disagree with its manifest ({named}); undo the edit or "
            "re-export the folder"
        )
