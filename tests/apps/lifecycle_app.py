"""A worker app for the CLI tests: a slow listener and closers that write what happens to a file.

Run as ``dramatiq tests.apps.lifecycle_app`` with ``GP_TEST_TRACE`` (a file) and
``GP_TEST_NAMESPACE`` (the Redis key prefix) set. ``GP_TEST_CRON`` adds a schedule
entry with that spec; ``GP_TEST_EVENT_NAME`` declares an event of that name at import.
"""

from __future__ import annotations

import os
import time

import dramatiq_gp as gp
from tests.apps.app_events import Slow


def trace(line: str) -> None:
    with open(os.environ["GP_TEST_TRACE"], "a") as file:
        file.write(line + "\n")


def slow_listener(event: Slow) -> None:
    trace("listener started")
    time.sleep(event.seconds)
    trace("listener finished")


def broken_closer() -> None:
    raise RuntimeError("this closer fails")


if "GP_TEST_EVENT_NAME" in os.environ:
    gp.event(os.environ["GP_TEST_EVENT_NAME"])


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    registry.listen(Slow, slow_listener, name="slow")
    if "GP_TEST_CRON" in os.environ:
        schedule.cron(os.environ["GP_TEST_CRON"], Slow(0))


kit = (
    gp.Kit(
        register,
        registry=gp.Registry(),
        broker_options={"namespace": os.environ["GP_TEST_NAMESPACE"]},
    )
    .with_closer("first", lambda: trace("closer first"))
    .with_closer("second", lambda: trace("closer second"))
    .with_closer("broken", broken_closer)
)
broker = kit.broker
