"""Telemetry bootstrap and flush: the first step of start-up and the last of shutdown.

For now this is logging: a handler when the process has none (programmatic
use; the dramatiq CLI installs its own) and the ``LOG_LEVEL``. Tracing and
Sentry plug in here.
"""

from __future__ import annotations

import logging

from .settings import LogSettings

#: The dramatiq CLI's format, so programmatic and CLI workers read alike.
LOG_FORMAT = "[%(asctime)s] [PID %(process)d] [%(threadName)s] [%(name)s] [%(levelname)s] %(message)s"


def bootstrap(settings: LogSettings) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format=LOG_FORMAT, level=settings.level_number)
    elif settings.level_was_set:
        root.setLevel(settings.level_number)


def flush() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
