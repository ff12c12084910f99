"""A worker app for the delayed-dispatch tests: one listener that records when each event reached it.

Run as ``dramatiq tests.apps.delay_app`` with ``REDIS_URL``, ``VALKEY_NAMESPACE``
and ``DB_URL`` set (so every worker process runs a relay too), and ``BROKER_URL``
for RabbitMQ. ``remember`` appends one JSON record per run to the Redis list
``<namespace>:test:arrivals``: ``n``, the envelope id, the envelope's ``at``,
``arrived`` (the listener's Unix time) and ``pid``.
"""

from __future__ import annotations

import json
import os
import time

import dramatiq_gp as gp
from tests.apps.app_events import Numbered


def remember(event: Numbered) -> None:
    envelope = gp.current_envelope()
    record = {"n": event.n, "id": envelope.id, "arrived": time.time(), "pid": os.getpid()}
    kit.broker.client.rpush(f"{kit.broker.namespace}:test:arrivals", json.dumps(record))


kit = gp.Kit(registry=gp.Registry())
kit.registry.listen(Numbered, remember, name="remember")
broker = kit.broker
