"""Errors raised by the reference models for bad configurations or inputs."""


class ConfigError(ValueError):
    """A model configuration field is invalid; the message names the field."""
