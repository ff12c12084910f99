"""A worker app for the scheduler restart test: an ``@every 1s`` job and an ``@every 1s`` event that record each run.

Run as ``dramatiq tests.apps.ticks_app`` with ``REDIS_URL``, ``VALKEY_NAMESPACE``
and ``SCHEDULER_*`` set, and ``GP_TEST_LEDGER``: a PostgreSQL URL whose
``tick_runs`` table gets one row per run (``namespace``, ``entry``, ``tick``,
``pid``; the table stamps ``ran_at``), with the tick that run handled: the job's
from the time it is handed, the event listener's from
``gp.current_envelope().scheduled_at``. The ledger is
in PostgreSQL so that a Redis restart cannot touch it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa

import dramatiq_gp as gp

ledger = sa.create_engine(os.environ["GP_TEST_LEDGER"])


@gp.event("test.ticks.beat")
@dataclass(frozen=True)
class Beat:
    """Fired by the schedule every second."""


def _record(entry: str, tick: datetime) -> None:
    row = {"namespace": broker.namespace, "entry": entry, "tick": tick, "pid": os.getpid()}
    with ledger.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO tick_runs (namespace, entry, tick, pid) VALUES (:namespace, :entry, :tick, :pid)"), row
        )


def tick(scheduled_at: datetime) -> None:
    _record("test.tick", scheduled_at)


def beat(event: Beat) -> None:
    scheduled_at = gp.current_envelope().scheduled_at
    assert scheduled_at is not None
    _record("test.beat", scheduled_at)


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    registry.listen(Beat, beat, name="record")
    schedule.job("test.tick", "@every 1s", tick)
    schedule.every(timedelta(seconds=1), Beat(), name="test.beat")


kit = gp.Kit(register, registry=gp.Registry()).with_closer("ledger", ledger.dispose)
broker = kit.broker
