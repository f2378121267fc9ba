"""Logging set-up for the command-line entry points (library code only gets loggers)."""

from __future__ import annotations

import logging

TRAIN_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
CONTROLLER_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(fmt: str = TRAIN_FORMAT, *, quiet_httpx: bool = True) -> None:
    """INFO lines on stderr. A no-op when the root logger already has a handler (a caller
    that set up logging keeps it). `quiet_httpx` drops httpx's line per request."""
    logging.basicConfig(level=logging.INFO, format=fmt)
    if quiet_httpx:
        logging.getLogger("httpx").setLevel(logging.WARNING)
