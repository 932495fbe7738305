"""Libraries' log lines held back where the caller reports the outcome itself."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def quiet_loggers(*names: str):
    """The named loggers (and their children that inherit their level) pass only errors while the block runs."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
