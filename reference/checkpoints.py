"""Load real checkpoints into the reference models, safely.

The file or folder is read into a flat state dict (reference/checkpoint_files.py: every format, no code run), the
family chosen by config.json's model_type or by the tensors' names, and the tensors prepared and checked by that
family's loader (reference/checkpoint_loaders.py); each family names its loader class in its registration
(reference/families.py).

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

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exporter.errors import first_line
from reference.checkpoint_files import read_checkpoint
from reference.errors import SHOWN, CheckpointError, ConfigError, ModelError
from reference.families import FAMILIES, family_named_by, family_of, get_family
from reference.gguf import is_gguf
from reference.presets import PRESETS

log = logging.getLogger(__name__)


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
