"""A worker app for the task log through the ``dramatiq`` command: ``dramatiq tests.apps.log_app``.

With ``REDIS_URL`` and ``VALKEY_NAMESPACE`` set; ``GP_TEST_LOG_HOLD_S`` holds the
worker's INFO lines that long before writing them (``LOG_FLUSH_INTERVAL_S``), so a
test can tell a line written at once from a queued one.
"""

from __future__ import annotations

import logging
import os
import time

import dramatiq

import dramatiq_gp as gp
from dramatiq_gp import telemetry

if "GP_TEST_LOG_HOLD_S" in os.environ:
    telemetry.LOG_FLUSH_INTERVAL_S = float(os.environ["GP_TEST_LOG_HOLD_S"])

logger = logging.getLogger("tests.apps.log_app")
kit = gp.Kit(registry=gp.Registry())
broker = kit.broker


@dramatiq.actor(broker=broker, queue_name="default")
def quick(n: int) -> None:
    broker.client.incr(f"{broker.namespace}:test:quick")


@dramatiq.actor(broker=broker, queue_name="default")
def sleepy(seconds: float) -> None:
    broker.client.incr(f"{broker.namespace}:test:sleepy")
    time.sleep(seconds)


@dramatiq.actor(broker=broker, queue_name="default", max_retries=0)
def fails(tag: str) -> None:
    raise RuntimeError(f"failed on purpose: {tag}")


@dramatiq.actor(broker=broker, queue_name="default")
def says(size: int) -> None:
    """Logs where the root handler writes, then a line of ``size`` characters (a long one goes another way)."""
    logger.info("root handler writes to %s", type(logging.getLogger().handlers[0].stream).__name__)
    logger.info("long line %s end", "x" * size)


def _child() -> None:
    logger.info("a line from a forked child")


@dramatiq.actor(broker=broker, queue_name="default")
def forks() -> None:
    """Runs a child process (forked) that logs one line, as a task using ``multiprocessing`` would."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_child)
    child.start()
    child.join()
    broker.client.incr(f"{broker.namespace}:test:forks")
