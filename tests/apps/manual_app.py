"""A worker app for the run-now and backfill tests: an ``@every 1s`` job and an hourly event, each run recorded.

Run as ``dramatiq tests.apps.manual_app`` with ``REDIS_URL`` (``BROKER_URL`` for RabbitMQ),
``VALKEY_NAMESPACE`` and ``GP_TEST_QUEUE``, the queue of every message (RabbitMQ's queues
have no namespace: one of the test's own keeps other tests' workers off it). Each run
appends one JSON object to ``<namespace>:test:runs``: ``entry``, ``scheduled_at`` (what
the handler was handed), ``message_id`` (the job's as ``gp.inbox()`` would key it, the
event's envelope id) and ``pid``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime

import redis

import dramatiq_gp as gp
from dramatiq_gp.exactly_once import current_message

namespace = os.environ["VALKEY_NAMESPACE"]
ledger = redis.Redis.from_url(os.environ["REDIS_URL"])
queue = os.environ["GP_TEST_QUEUE"]


@gp.event("test.manual.report")
@dataclass(frozen=True)
class Report:
    """Fired by the schedule every hour."""

    kind: str


def _record(entry: str, scheduled_at: datetime | None, message_id: str) -> None:
    run = {"entry": entry, "scheduled_at": scheduled_at and scheduled_at.isoformat(), "message_id": message_id}
    ledger.rpush(f"{namespace}:test:runs", json.dumps({**run, "pid": os.getpid()}))


def every(scheduled_at: datetime) -> None:
    _record("test.every", scheduled_at, current_message()[0])


def report(event: Report) -> None:
    envelope = gp.current_envelope()
    assert event.kind == "sales"
    _record("test.report", envelope.scheduled_at, envelope.id)


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    registry.listen(Report, report, name="record", queue=queue)
    schedule.job("test.every", "@every 1s", every, queue=queue)
    schedule.cron("0 * * * *", Report("sales"), name="test.report", queue=queue)


kit = gp.Kit(register, registry=gp.Registry()).with_closer("ledger", ledger.close)
broker = kit.broker
