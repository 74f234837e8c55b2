"""The library's loggers (``lifecycle.*``) print nothing unless the application configures logging.

Python's last-resort handler would otherwise print their warnings (a store outage, a teardown that
found live sequences) as bare lines on stderr in every program that uses the library. A
:class:`logging.NullHandler` on the package's logger keeps that choice with the application; the
command line installs a handler of its own (``--log-level``).
"""

from __future__ import annotations

import logging
from typing import Final

ROOT_LOGGER: Final = "lifecycle"


def install_null_handler() -> logging.NullHandler:
    """The package logger's NullHandler, added once however often this runs."""
    logger = logging.getLogger(ROOT_LOGGER)
    for handler in logger.handlers:
        if type(handler) is logging.NullHandler:
            return handler
    handler = logging.NullHandler()
    logger.addHandler(handler)
    return handler


install_null_handler()
