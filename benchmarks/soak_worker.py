"""The shop's worker as the soak runs it: ``dramatiq benchmarks.soak_worker``.

It registers the shop's listeners and schedule as ``examples.shop.worker`` does,
plus what the soak needs to keep score, in PostgreSQL and idempotent the way the
shop's own listeners are (see :mod:`benchmarks.soak_tables`):

* ``audit``, a second listener of ``OrderPlaced`` that fails half its attempts
  (``SOAK_FLAKY``) and records its effect under the envelope id, counting runs;
* ``soak.tick``, an ``@every 1s`` job, and ``soak.beat``, an ``@every 1s`` event
  with one listener, each recording its runs under the tick, so a tick missed or
  run twice shows up.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.dialects.postgresql import insert

import dramatiq_gp as gp
from benchmarks.soak_tables import audit, ticks
from examples.shop import jobs, listeners
from examples.shop.deps import Dependencies
from examples.shop.events import OrderPlaced

FLAKY = float(os.environ.get("SOAK_FLAKY", "0.5"))
deps = Dependencies.from_env()


@gp.event("soak.beat")
@dataclass(frozen=True)
class Beat:
    """Fired every second by the schedule."""


def record_audit(event: OrderPlaced) -> None:
    if random.random() < FLAKY:
        raise RuntimeError("the audit service is having a bad day")
    envelope_id = gp.current_envelope().id
    with deps.engine.begin() as conn:
        statement = insert(audit).values(envelope_id=envelope_id, order_id=event.order_id)
        conn.execute(statement.on_conflict_do_update(index_elements=["envelope_id"], set_={"runs": audit.c.runs + 1}))


def record_tick(entry: str, scheduled_at: datetime) -> None:
    with deps.engine.begin() as conn:
        statement = insert(ticks).values(entry=entry, tick=scheduled_at)
        conn.execute(statement.on_conflict_do_update(index_elements=["entry", "tick"], set_={"runs": ticks.c.runs + 1}))


def run_tick(scheduled_at: datetime) -> None:
    record_tick("soak.tick", scheduled_at)


def record_beat(event: Beat) -> None:
    scheduled_at = gp.current_envelope().scheduled_at
    assert scheduled_at is not None
    record_tick("soak.beat", scheduled_at)


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    listeners.register(registry, deps)
    jobs.register(schedule, deps)
    registry.listen(OrderPlaced, record_audit, name="audit")
    registry.listen(Beat, record_beat, name="record_beat")
    schedule.job("soak.tick", "@every 1s", run_tick)
    schedule.every(timedelta(seconds=1), Beat(), name="soak.beat")


kit = gp.Kit(register, engine=deps.engine).with_closer("database", deps.engine.dispose)
broker = kit.broker
