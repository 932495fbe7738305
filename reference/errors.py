"""Errors raised by the reference models for bad configurations, checkpoints or inputs.

Every message names the problem and the fix; the CLI shows it as one line (exit 2). They belong to the toolkit's
one hierarchy (exporter.errors.ToolkitError), and stay ValueErrors, as bad values are.
"""

from exporter.errors import ToolkitError

SHOWN = 5  # keys, or the objects a pickle imports, listed per kind in a checkpoint error message


class ModelError(ToolkitError, ValueError):
    """Base of the errors a user can cause in `reference/`."""


class ConfigError(ModelError):
    """A model configuration field is invalid; the message names the field."""


class CheckpointError(ModelError):
    """A checkpoint file cannot be read safely, or does not fit the model it is loaded into."""


class ContextLengthError(ModelError):
    """A sequence is longer than the positions the model has (learned absolute positions)."""
