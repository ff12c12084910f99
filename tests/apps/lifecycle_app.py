"""A worker app for the CLI tests: a slow listener and closers that write what happens to a file.

Run as ``dramatiq tests.apps.lifecycle_app`` with ``GP_TEST_TRACE`` (a file) and
``GP_TEST_NAMESPACE`` (the Redis key prefix) set. ``GP_TEST_CRON`` adds a schedule
entry with that spec; ``GP_TEST_EVENT_NAME`` declares an event of that name at import;
``GP_TEST_ASYNC`` makes the listener ``async def``.
"""

from __future__ import annotations

import asyncio
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


async def async_slow_listener(event: Slow) -> None:
    # A copy that was cancelled at a shutdown before finishes at once, so a test can see it run again.
    with open(os.environ["GP_TEST_TRACE"]) as file:
        again = "listener cancelled" in file.read()
    trace("listener started")
    try:
        await asyncio.sleep(0 if again else event.seconds)
    except asyncio.CancelledError:
        trace("listener cancelled")
        raise
    trace("listener finished")


def broken_closer() -> None:
    raise RuntimeError("this closer fails")


if "GP_TEST_EVENT_NAME" in os.environ:
    gp.event(os.environ["GP_TEST_EVENT_NAME"])


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    registry.listen(Slow, async_slow_listener if os.environ.get("GP_TEST_ASYNC") else slow_listener, name="slow")
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
