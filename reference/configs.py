"""What every family's frozen config dataclass shares (JSON round trip, field checks naming the field),
and DecoderSpec, the config of a decoder the toolkit did not define (reference/byo.py). No torch here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from reference.errors import ConfigError


class JsonConfig:
    """Mixin for frozen dataclass configs: to_dict / from_dict, unknown fields refused by name."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict):
        if not isinstance(data, dict):
            raise ConfigError(f"a config is a JSON object of fields, got a {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known fields are {sorted(known)}")
        check_field_types(cls, data)
        return cls(**data)


# What a JSON value may be for each annotation a config field uses; a nested config is read from an object.
_JSON_TYPES = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "None": (type(None),),
    "YarnScaling": (dict,),
    "RopeScaling": (dict,),
}


def check_field_types(cls, data: dict, prefix: str = "") -> None:
    """Each value of `data` has the JSON type its dataclass field declares (a bool is not a number)."""
    for field in dataclasses.fields(cls):
        if field.name not in data:
            continue
        value = data[field.name]
        names = [part.strip() for part in str(field.type).split("|")]
        allowed = tuple(t for name in names for t in _JSON_TYPES.get(name, (object,)))
        wrong = not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)
        if wrong:
            nested = {"YarnScaling": "an object of YaRN fields", "RopeScaling": "an object of rope scaling fields"}
            shown = " or ".join(nested.get(name, name) for name in names)
            raise ConfigError(f"config field {prefix}{field.name} must be {shown}, got {value!r}")


def check_positive_ints(config, names) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")


def check_token_ids(config, names=("bos_token_id", "eos_token_id"), optional: bool = True) -> None:
    for name in names:
        value = getattr(config, name)
        if value is None and optional:
            continue
        if not isinstance(value, int) or not 0 <= value < config.vocab_size:
            raise ConfigError(
                f"config field {name} ({value!r}) must {'be None or ' if optional else ''}lie in [0, vocab_size)"
            )


@dataclass(frozen=True)
class DecoderSpec(JsonConfig):
    """The sizes the two graphs' I/O contract needs, for a decoder the toolkit did not define."""

    name: str
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Not in the graphs' contract, only in the consumers' configs (config.json, genai_config.json); when not
    # given they are assumed as a decoder without grouped-query attention has them, and inspect says so.
    num_attention_heads: int | None = None
    hidden_size: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"config field name must be a non-empty string, got {self.name!r}")
        check_positive_ints(
            self, ("num_hidden_layers", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
        )
        check_positive_ints(
            self, [name for name in ("num_attention_heads", "hidden_size") if getattr(self, name) is not None]
        )
        if self.num_attention_heads is not None and self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config field num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        check_token_ids(self)
