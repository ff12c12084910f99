"""A worker app for the overlap tests: an ``@every 1s`` job slower than its period, ``overlap=`` from the environment.

Run as ``dramatiq tests.apps.overlap_app`` with ``REDIS_URL``, ``VALKEY_NAMESPACE``,
``SCHEDULER_*`` and ``GP_TEST_OVERLAP`` (``allow``, ``skip`` or ``wait``) set, and
``GP_TEST_RUN_S``, how long a run takes (2.5 s by default). The job
``test.slow`` records each run's start and end in the Redis list
``<namespace>:test:runs`` as JSON (``tick``: the scheduled time, ``pid`` and
``ppid`` of the worker process, ``event``: ``started`` or ``finished``, ``at``: the
Unix time).
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime

import dramatiq_gp as gp

RUN_S = float(os.environ.get("GP_TEST_RUN_S", "2.5"))
OVERLAP = os.environ["GP_TEST_OVERLAP"]


def _record(tick: datetime, event: str) -> None:
    run = {"tick": tick.isoformat(), "pid": os.getpid(), "ppid": os.getppid(), "event": event, "at": time.time()}
    broker.client.rpush(f"{broker.namespace}:test:runs", json.dumps(run))


def slow(scheduled_at: datetime) -> None:
    _record(scheduled_at, "started")
    time.sleep(RUN_S)
    _record(scheduled_at, "finished")


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    schedule.job("test.slow", "@every 1s", slow, overlap=OVERLAP)  # type: ignore[arg-type]


kit = gp.Kit(register, registry=gp.Registry())
broker = kit.broker
