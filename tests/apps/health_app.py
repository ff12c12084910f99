"""A worker app for the health tests: a task that wedges its thread, a slow one, and a check a test can fail.

Run as ``dramatiq tests.apps.health_app`` with ``VALKEY_NAMESPACE`` and ``GP_TEST_UNHEALTHY``
(a path: while a file is there, the application's check fails with its content).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import dramatiq

import dramatiq_gp as gp

kit = gp.Kit(registry=gp.Registry())
broker = kit.broker


@kit.health_check
def search_index() -> None:
    marker = Path(os.environ["GP_TEST_UNHEALTHY"])
    if marker.exists():
        raise RuntimeError(marker.read_text())


@dramatiq.actor(time_limit=1000, max_retries=0)
def wedge() -> None:
    # Blocks in C, where TimeLimit's exception never lands: only a restart frees the thread.
    threading.Event().wait()


@dramatiq.actor(max_retries=0)
def slow(seconds: float) -> None:
    time.sleep(seconds)
