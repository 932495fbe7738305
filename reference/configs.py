"""What every family's frozen config dataclass shares: JSON round trip and field checks naming the field."""

from __future__ import annotations

import dataclasses

from reference.errors import ConfigError


class JsonConfig:
    """Mixin for frozen dataclass configs: to_dict / from_dict, unknown fields refused by name."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known fields are {sorted(known)}")
        return cls(**data)


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
            raise ConfigError(f"config field {name} ({value!r}) must {'be None or ' if optional else ''}"
                              f"lie in [0, vocab_size)")
