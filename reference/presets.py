"""Named model configurations, gathered from the family registry (each family's `presets`): the published sizes
(docs/models.md, "Families and presets") and tiny ones for tests.

Names are matched case-insensitively ("MiniMind2-small" works).
"""

from __future__ import annotations

from reference.errors import ConfigError
from reference.families import FAMILIES

PRESETS: dict = {name: config for family in FAMILIES.values() for name, config in family.presets.items()}

DEFAULT_PRESET = "minimind-3"


def get_preset(name: str):
    config = PRESETS.get(name.lower()) if isinstance(name, str) else None
    if config is None:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return config
