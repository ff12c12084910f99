"""A worker app for the Sentinel failover test: an ``@every 1s`` job and an idempotent actor, each run recorded.

Run as ``dramatiq tests.apps.sentinel_app`` with ``VALKEY_SENTINELS``,
``VALKEY_NAMESPACE`` and ``GP_TEST_LEDGER``: a PostgreSQL URL whose
``sentinel_runs`` table gets one row per run (``namespace``, ``kind``: ``tick`` or
``item``, ``key``: the tick's time or the item's number, ``pid``). The ledger is in
PostgreSQL so that the failover it measures cannot touch it.
"""

from __future__ import annotations

import os
from datetime import datetime

import dramatiq
import sqlalchemy as sa

import dramatiq_gp as gp

ledger = sa.create_engine(os.environ["GP_TEST_LEDGER"])


def _record(kind: str, key: str) -> None:
    row = {"namespace": broker.namespace, "kind": kind, "key": key, "pid": os.getpid()}
    with ledger.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO sentinel_runs (namespace, kind, key, pid) VALUES (:namespace, :kind, :key, :pid)"),
            row,
        )


def tick(scheduled_at: datetime) -> None:
    _record("tick", scheduled_at.isoformat())


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    schedule.job("sentinel.tick", "@every 1s", tick)


kit = gp.Kit(register, registry=gp.Registry()).with_closer("ledger", ledger.dispose)
broker = kit.broker


def _item(n: int) -> None:
    _record("item", str(n))


# Idempotent like the kit's listeners and jobs: its claims and done marks are in the failover too.
item = dramatiq.actor(_item, broker=broker, actor_name="sentinel.item", queue_name="default", idempotent=True)
