"""Transformers as an independent reference: the model `AutoModelForCausalLM` loads from the Hugging Face folder (or
the GGUF file) an artifact was exported from, against ONNX Runtime on the verification's prefill batch and decode
steps.

The toolkit's own reference (reference/hf_decoder.py) is what the graphs are exported from, so a mistake in it
would be exported and pass every other check; Transformers' modeling code is written by others, so agreeing with
it too shows the artifact computes the released model. Runs only when transformers imports, the artifact's
family is one whose checkpoints transformers loads (its registration's `transformers`, reference/families.py) and
its checkpoint folder is unchanged; transformers is imported lazily, as torch is.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
from pathlib import Path

import numpy as np

from exporter.artifact.contract import KV_KINDS
from exporter.artifact.manifest import Manifest
from exporter.errors import InputError, first_line, first_of
from exporter.tolerances.parity import Profile
from exporter.verify.checks.greedy import GreedyTrace
from exporter.verify.checks.health import HealthScan
from exporter.verify.checks.outputs import check_decode, check_prefill
from exporter.verify.inputs import ParitySettings
from exporter.verify.references.golden.recording import RecordedReference
from exporter.verify.references.referee import Float64Referee
from exporter.verify.results import IndependentReport
from reference.families import get_family
from reference.quiet import quiet_loggers

log = logging.getLogger(__name__)

NAME = "transformers"


def transformers_version() -> str | None:
    """The installed transformers' version, or None when it does not import."""
    try:
        import transformers
    except Exception:  # absent, or broken against this torch: either way no reference here
        return None
    return transformers.__version__


def transformers_skip_reason(manifest: Manifest) -> str:
    """Why Transformers cannot serve as the artifact's independent reference here; "" when it can."""
    source = manifest.source
    if not get_family(manifest.family).transformers or source.get("kind") != "checkpoint":
        return f"the artifact was not exported from a Hugging Face folder (family {manifest.family})"
    if transformers_version() is None:
        return "transformers is not installed (pip install 'transformers>=5')"
    from reference.gguf import GGUF_EXTRA, gguf_missing, is_gguf

    if is_gguf(source["path"]) and gguf_missing():
        return f"loading a GGUF needs the gguf extra ({gguf_missing()}; {GGUF_EXTRA})"
    from reference.checkpoint_files import checkpoint_change

    change = checkpoint_change(source["path"], source.get("sha256"))
    if change:
        return f"its checkpoint {source['path']} {change}"
    return ""


class TransformersRunner:
    """Transformers' model of a folder behind the named-feed interface of TorchRunner (prefill, decode, greedy), in
    the artifact's dtype or in `dtype` (torch.float64 for the referee)."""

    name = NAME

    def __init__(self, folder: Path, manifest: Manifest, dtype=None):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging

        from reference.gguf import is_gguf, quiet_loader

        transformers_logging.disable_progress_bar()  # the CLI's progress lines are the verification's own
        self.manifest = manifest
        dtype = dtype or {"float32": torch.float32, "float16": torch.float16}[manifest.dtype]
        # float32 weights cast to the artifact's dtype, as the export casts them; eager attention: written out. A GGUF
        # is dequantized to float32 by the loader the export read it with (reference/gguf.py).
        where, quiet = {"pretrained_model_name_or_path": folder}, contextlib.nullcontext()
        if is_gguf(folder):
            where, quiet = {"pretrained_model_name_or_path": folder.parent, "gguf_file": folder.name}, quiet_loader()
        # In float64 (the referee) eager attention would not do: transformers' eager softmax runs in float32, where
        # float64's mask minimum becomes -inf and a padded query's row NaN, which the padded keys then pass on to
        # every real token at weight 0; sdpa computes in float64 throughout.
        attention = "sdpa" if dtype == torch.float64 else "eager"
        # transformers' load report (many lines) stays quiet: what is wrong with the folder is one line here.
        # Mismatched sizes are loaded (reinitialised), so that they are listed with the missing tensors and refused.
        with quiet, quiet_loggers(NAME):
            try:
                model, info = AutoModelForCausalLM.from_pretrained(
                    **where,
                    dtype=torch.float32,
                    attn_implementation=attention,
                    ignore_mismatched_sizes=True,
                    output_loading_info=True,
                )
            except Exception as exc:  # transformers' errors have no common base; each is about the folder it read
                raise InputError(
                    f"transformers cannot load {folder} ({type(exc).__name__}: {first_line(exc, 200)}); pass a Hugging "
                    "Face folder holding its config.json and every weight it names"
                ) from None
        _check_loaded(folder, info)
        self.model = model.to(dtype).eval()
        # the cache's keyword and output field: `cache` in recent transformers 5 releases, `past_key_values` before
        parameters = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"

    def _call(self, feeds: dict, past=None) -> dict:
        import torch

        labels = feeds.get("labels")
        kwargs = {self._cache_arg: past} if past is not None else {}
        with torch.no_grad():
            out = self.model(
                input_ids=torch.from_numpy(feeds["input_ids"]),
                attention_mask=torch.from_numpy(feeds["attention_mask"]),
                position_ids=torch.from_numpy(feeds["position_ids"]),
                labels=torch.from_numpy(labels) if labels is not None else None,
                use_cache=True,
                **kwargs,
            )
        cache = self._cache_of(out)
        wide = torch.promote_types(out.logits.dtype, torch.float32)  # float32, or float64 for the referee
        result = {"logits": out.logits.to(wide).numpy()}
        for layer in range(self.manifest.cache.num_layers):
            stored = cache.layers[layer]
            for kind, tensor in zip(KV_KINDS, (stored.keys, stored.values)):
                result[self.manifest.cache.present(layer, kind)] = tensor.numpy()  # (B, Hkv, L, D), as the graphs
        if out.loss is not None:
            result["loss"] = result["logits"].dtype.type(out.loss.item())
        return result

    @staticmethod
    def _cache_of(out):
        cache = getattr(out, "cache", None)
        return out.past_key_values if cache is None else cache

    def prefill(self, feeds: dict) -> dict:
        return self._call(feeds)

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> GreedyTrace:
        """Greedy decoding on transformers' own cache and default positions, as reference_greedy decodes."""
        import torch

        new_ids: list[int] = []
        logits = []
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
            while True:
                token = int(out.logits[0, -1].argmax())
                new_ids.append(token)
                logits.append(out.logits[0, -1].float().numpy())
                if token == eos_token_id or len(new_ids) == max_new_tokens:
                    return GreedyTrace(new_ids, np.stack(logits))
                cache = {self._cache_arg: self._cache_of(out)}
                out = self.model(input_ids=torch.tensor([[token]]), use_cache=True, **cache)

    def decode(self, feeds: dict) -> dict:
        import torch
        from transformers import DynamicCache

        cache, names = DynamicCache(), self.manifest.cache
        for layer in range(names.num_layers):
            key, value = (torch.from_numpy(feeds[names.past(layer, kind)]) for kind in KV_KINDS)
            cache.update(key, value, layer)
        return self._call(feeds, cache)


def _check_loaded(folder: Path, info: dict) -> None:
    """InputError naming the weights transformers' model of `folder` lacks or holds in other shapes than its config
    gives them (`info`: from_pretrained's loading info): those it initialises at random, and no verdict against such
    a model means anything."""
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, held, due = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise InputError(
            f"the weights in {folder} do not fit its config.json: {key} is {tuple(held)} in the weights where the "
            f"config gives {tuple(due)}{more}; pass the config.json the weights were saved with"
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise InputError(
            f"{folder} lacks {len(missing)} weight(s) its config.json's model has ({first_of(missing, 3)}); pass the "
            "folder whole, every weight file with it"
        )


def float64_referee(folder: Path, manifest: Manifest, profile: Profile) -> Float64Referee | None:
    """Transformers' model of `folder` in float64 as the referee of comparisons beyond `profile` (built at the first
    one); None where none judges: a profile the user overrode (their bound is the verdict), a MoE model."""
    if manifest.is_moe or profile.overridden:
        return None
    built: list[TransformersRunner] = []

    def float64() -> contextlib.AbstractContextManager:
        if not built:
            import torch

            log.info("referee: transformers loading %s in float64", folder)
            built.append(TransformersRunner(folder, manifest, torch.float64))
        return contextlib.nullcontext(built[0])

    return Float64Referee(float64, manifest)


def check_transformers(
    reference, onnx, manifest: Manifest, batch: dict, settings: ParitySettings, profile: Profile
) -> list[IndependentReport]:
    """The toolkit's PyTorch reference, then ONNX Runtime (`onnx`, an OrtRunner), against Transformers' model of
    the artifact's checkpoint folder: the prefill batch (logits, presents, loss) and the decode steps, judged by
    `profile` as the PyTorch reference is; a comparison beyond it is refereed by Transformers' own model in float64
    (exporter.verify.checks.referee), built only then. The referee is Transformers' and not the toolkit's model, which
    would agree with a fault of its own. Transformers computes its norms and rotary angles in float32 even in float64,
    so this referee is exact only to float32's rounding there: enough for a float16 artifact, and for a float32 one an
    error in its favour (ONNX Runtime's error then looks larger, never smaller).

    Transformers' calls are recorded while it is compared with the toolkit's reference, and its model is released
    before ONNX Runtime runs against the recording: at most two of the three copies of the weights (the toolkit's
    model, Transformers', the mapping ONNX Runtime reads) are resident at once.

    Args:
        reference: the toolkit's PyTorch reference (a RecordedReference of a TorchRunner), which records these
            calls for the providers' runs to replay.
        onnx: the OrtRunner of the provider compared.
        manifest: the artifact's manifest, whose source names the folder.
        batch: the prompt batch the providers are verified on.
        settings: the verification's settings (decode steps, seed).
        profile: the tolerances of that provider.

    Returns:
        [ONNX Runtime against Transformers, the toolkit's reference against Transformers].
    """
    folder = Path(manifest.source["path"])
    log.info("independent reference: transformers loading %s", folder)
    transformers = RecordedReference(TransformersRunner(folder, manifest))
    referee = float64_referee(folder, manifest, profile)

    def against(compared) -> list:
        transformers.rewind()
        reference.rewind()
        health = HealthScan(manifest.dtype)  # the providers' checks report ONNX Runtime's health; not again here
        prefill, _ = check_prefill(transformers, compared, manifest, batch, profile, health, referee=referee)
        decode, _ = check_decode(
            transformers,
            compared,
            manifest,
            batch,
            settings,
            profile,
            health,
            np.random.default_rng(settings.seed + 1),
            referee=referee,
        )
        return prefill.comparisons + decode.comparisons

    log.info("independent reference: the pytorch reference against transformers")
    reference_rows = against(reference)
    transformers.backing = None  # recorded: its model is released before ONNX Runtime reads the weights
    gc.collect()
    log.info("independent reference: %s against transformers", onnx.provider)
    onnx_rows = against(onnx)
    version = f"{NAME} {transformers_version()}"
    return [
        IndependentReport(version, onnx.provider, str(folder), onnx_rows),
        IndependentReport(version, None, str(folder), reference_rows),
    ]
