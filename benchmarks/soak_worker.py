"""The shop's worker as the soak runs it: ``dramatiq benchmarks.soak_worker``.

It registers the shop's listeners and schedule as ``examples.shop.worker`` does,
plus what the soak needs to keep score, in PostgreSQL and idempotent the way the
shop's own listeners are:

* ``audit``, a second listener of ``OrderPlaced`` that fails half its attempts
  (``SOAK_FLAKY``) and records its effect once per order;
* ``soak.tick``, an ``@every 1s`` job recording each run under its tick, counting
  runs, so a tick run twice shows up.
"""

from __future__ import annotations

import os
import random
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

import dramatiq_gp as gp
from examples.shop import jobs, listeners
from examples.shop.deps import Dependencies
from examples.shop.events import OrderPlaced

metadata = sa.MetaData()
audit = sa.Table(
    "soak_audit", metadata,
    sa.Column("order_id", sa.BigInteger, primary_key=True),
    sa.Column("runs", sa.Integer, nullable=False, server_default="1"),
)  # fmt: skip
ticks = sa.Table(
    "soak_ticks", metadata,
    sa.Column("tick", sa.DateTime(timezone=True), primary_key=True),
    sa.Column("runs", sa.Integer, nullable=False, server_default="1"),
)  # fmt: skip

FLAKY = float(os.environ.get("SOAK_FLAKY", "0.5"))
deps = Dependencies.from_env()


def record_audit(event: OrderPlaced) -> None:
    if random.random() < FLAKY:
        raise RuntimeError("the audit service is having a bad day")
    with deps.engine.begin() as conn:
        statement = insert(audit).values(order_id=event.order_id)
        conn.execute(statement.on_conflict_do_update(index_elements=["order_id"], set_={"runs": audit.c.runs + 1}))


def record_tick(scheduled_at: datetime) -> None:
    with deps.engine.begin() as conn:
        statement = insert(ticks).values(tick=scheduled_at)
        conn.execute(statement.on_conflict_do_update(index_elements=["tick"], set_={"runs": ticks.c.runs + 1}))


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    listeners.register(registry, deps)
    jobs.register(schedule, deps)
    registry.listen(OrderPlaced, record_audit, name="audit")
    schedule.job("soak.tick", "@every 1s", record_tick)


kit = gp.Kit(register, engine=deps.engine).with_closer("database", deps.engine.dispose)
broker = kit.broker
