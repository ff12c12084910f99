"""A worker app for the settle-window tests: ``ok(n)`` and ``fails(n)`` (which fails its first attempt).

Run as ``dramatiq tests.apps.settle_app`` with ``REDIS_URL`` and ``VALKEY_NAMESPACE``
set (and ``BROKER_URL`` for RabbitMQ); ``GP_TEST_HEARTBEAT_MS`` shortens Dramatiq's
heartbeat timeout on Redis, so a killed worker's messages come back within seconds. Runs are recorded in the Redis list
``<namespace>:test:runs`` as JSON (``actor``, ``n``, ``pid``).
"""

from __future__ import annotations

import json
import os

import dramatiq

import dramatiq_gp as gp

# Redis's only (RabbitMQ gives a dead worker's messages back as its connection closes).
heartbeat = os.environ.get("GP_TEST_HEARTBEAT_MS")
kit = gp.Kit(
    registry=gp.Registry(),
    broker_options={"heartbeat_timeout": int(heartbeat)} if heartbeat else {},
)
broker = kit.broker


def _record(actor: str, n: int) -> int:
    run = {"actor": actor, "n": n, "pid": os.getpid()}
    return int(broker.client.rpush(f"{broker.namespace}:test:runs", json.dumps(run)))


@dramatiq.actor(broker=broker, actor_name="ok")
def ok(n: int) -> None:
    _record("ok", n)


@dramatiq.actor(broker=broker, actor_name="fails", max_retries=3, min_backoff=200, max_backoff=200)
def fails(n: int) -> None:
    runs = [json.loads(r) for r in broker.client.lrange(f"{broker.namespace}:test:runs", 0, -1)]
    _record("fails", n)
    if not any(r["actor"] == "fails" and r["pid"] == os.getpid() for r in runs):
        raise ConnectionError("the first attempt in each process fails")
