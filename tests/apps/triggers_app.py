"""A worker app with two jobs on APScheduler triggers: an ``IntervalTrigger(seconds=1)`` and a ``DateTrigger``.

Run as ``dramatiq tests.apps.triggers_app`` with ``REDIS_URL``, ``VALKEY_NAMESPACE``,
``GP_TEST_ANCHOR`` (the interval's ``start_date``, so every process computes the
same ticks) and ``GP_TEST_RUN_AT`` (the date's run time), both ISO; each run
pushes the tick it handled onto ``<namespace>:test:runs:<job>``.
"""

from __future__ import annotations

import os
from datetime import datetime

import redis
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

import dramatiq_gp as gp

namespace = os.environ["VALKEY_NAMESPACE"]
runs = redis.Redis.from_url(os.environ["REDIS_URL"])
anchor = datetime.fromisoformat(os.environ["GP_TEST_ANCHOR"])
run_at = datetime.fromisoformat(os.environ["GP_TEST_RUN_AT"])


def record(job: str):  # type: ignore[no-untyped-def]
    def handle(scheduled_at: datetime) -> None:
        runs.rpush(f"{namespace}:test:runs:{job}", scheduled_at.isoformat())

    return handle


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    schedule.job("every_second", IntervalTrigger(seconds=1, start_date=anchor), record("every_second"))
    schedule.job("once", DateTrigger(run_date=run_at), record("once"))


broker = gp.Kit(register, registry=gp.Registry()).broker
