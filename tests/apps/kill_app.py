"""A worker app for the ``kill -9`` test: ``hold(n)`` and ``hold_idempotent(n)``, which record each run's start and end.

Run as ``dramatiq tests.apps.kill_app`` with ``REDIS_URL`` and ``VALKEY_NAMESPACE``
set. Runs are recorded in the Redis list ``<namespace>:test:runs`` as JSON
(``n``, ``pid``, ``event``: ``started`` or ``finished``, ``at``: the Unix time).
With ``GP_TEST_STALL=1`` a run never finishes, so the process keeps every message
it fetched (running or prefetched) until it is killed.
"""

from __future__ import annotations

import json
import os
import threading
import time

import dramatiq

import dramatiq_gp as gp

STALL = os.environ.get("GP_TEST_STALL") == "1"

kit = gp.Kit(registry=gp.Registry())
broker = kit.broker


def _record(n: int, event: str) -> None:
    run = {"n": n, "pid": os.getpid(), "event": event, "at": time.time()}
    broker.client.rpush(f"{broker.namespace}:test:runs", json.dumps(run))


def _hold(n: int) -> None:
    _record(n, "started")
    if STALL:
        threading.Event().wait()
    _record(n, "finished")


hold = dramatiq.actor(_hold, broker=broker, actor_name="hold")
# Idempotent like the kit's listeners and jobs: the dead worker's claims are in play too.
hold_idempotent = dramatiq.actor(_hold, broker=broker, actor_name="hold_idempotent", idempotent=True)
