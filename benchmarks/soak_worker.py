"""The shop's worker as the soak runs it: ``dramatiq benchmarks.soak_worker``.

It registers the shop's listeners and schedule as ``examples.shop.worker`` does,
plus what the soak needs to keep score, in PostgreSQL and idempotent the way the
shop's own listeners are (see :mod:`benchmarks.soak_tables`):

* ``audit``, a second listener of ``OrderPlaced`` that fails half its attempts
  (``SOAK_FLAKY``) and records its effect under the envelope id, counting runs,
  in its inbox transaction (``inbox=``): a run the inbox let through twice shows;
* the fault the driver aims between an inbox commit and its ack: when the key
  ``<namespace>:soak:kill_after_commit`` exists, the first worker whose ``audit``
  run has just committed deletes it and SIGKILLs itself, from
  ``after_process_message`` (before the ack is handed to the settler);
* ``soak.tick``, an ``@every 1s`` job, and ``soak.beat``, an ``@every 1s`` event
  with one listener, each recording its runs under the tick in its inbox
  transaction, so a tick missed, or applied twice, shows up. (Without the inbox a
  worker killed between a tick's commit and its ack runs that tick again, at least
  once as any task: a 2-minute ``make chaos`` run hit that window once.)
* the version ``SOAK_VERSION`` (``soak --deploys`` rolls a new one out every minute or
  so): the listeners of ``soak.parcel`` it has (:func:`~benchmarks.soak_tables.parcel_listeners`:
  each deploy adds one and retires another), and, from
  :data:`~benchmarks.soak_tables.FIELD_ADDED_IN`, the event's added ``weight_g`` field.
  Each records its deliveries per envelope in its inbox transaction, counting runs.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from sqlalchemy.dialects.postgresql import insert

import dramatiq_gp as gp
from benchmarks.soak_tables import FIELD_ADDED_IN, audit, deliveries, parcel_listeners, ticks
from examples.shop import jobs, listeners
from examples.shop.deps import Dependencies
from examples.shop.events import OrderPlaced

FLAKY = float(os.environ.get("SOAK_FLAKY", "0.5"))
VERSION = int(os.environ.get("SOAK_VERSION", "0"))
deps = Dependencies.from_env()


@gp.event("soak.beat")
@dataclass(frozen=True)
class Beat:
    """Fired every second by the schedule."""


if VERSION >= FIELD_ADDED_IN:

    @gp.event("soak.parcel")
    @dataclass(frozen=True)
    class Parcel:
        """Written with each order; this version added ``weight_g``."""

        order_id: int
        weight_g: int = 0

else:

    @gp.event("soak.parcel")
    @dataclass(frozen=True)
    class Parcel:  # type: ignore[no-redef]
        """Written with each order; newer versions add ``weight_g``, which this one ignores."""

        order_id: int


def record_delivery(listener: str) -> Any:
    def record(event: Parcel, conn: sa.Connection) -> None:
        statement = insert(deliveries).values(
            listener=listener, envelope_id=gp.current_envelope().id, order_id=event.order_id
        )
        conn.execute(
            statement.on_conflict_do_update(
                index_elements=["listener", "envelope_id"], set_={"runs": deliveries.c.runs + 1}
            )
        )

    return record


AUDIT = "listener:shop.order_placed:audit"
#: Set by ``record_audit`` once its write is done: this attempt applied the effect (it commits unless it raises).
_applied = threading.local()


def record_audit(event: OrderPlaced, conn: sa.Connection) -> None:
    if random.random() < FLAKY:
        raise RuntimeError("the audit service is having a bad day")
    envelope_id = gp.current_envelope().id
    statement = insert(audit).values(envelope_id=envelope_id, order_id=event.order_id)
    conn.execute(statement.on_conflict_do_update(index_elements=["envelope_id"], set_={"runs": audit.c.runs + 1}))
    _applied.done = True


class KillAfterInboxCommit(Middleware):
    """SIGKILLs this worker process right after an ``audit`` inbox commit, when the driver asks for it."""

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        applied, _applied.done = getattr(_applied, "done", False), False
        if message.actor_name != AUDIT or exception is not None or not applied:
            return  # not a committed audit run (a failure, or a copy the inbox skipped)
        kit_broker: Any = broker
        if kit_broker.client.delete(f"{kit_broker.namespace}:soak:kill_after_commit"):
            os.kill(os.getpid(), signal.SIGKILL)


def record_tick(entry: str, scheduled_at: datetime, conn: sa.Connection) -> None:
    statement = insert(ticks).values(entry=entry, tick=scheduled_at)
    conn.execute(statement.on_conflict_do_update(index_elements=["entry", "tick"], set_={"runs": ticks.c.runs + 1}))


def run_tick(scheduled_at: datetime, conn: sa.Connection) -> None:
    record_tick("soak.tick", scheduled_at, conn)


def record_beat(event: Beat, conn: sa.Connection) -> None:
    scheduled_at = gp.current_envelope().scheduled_at
    assert scheduled_at is not None
    record_tick("soak.beat", scheduled_at, conn)


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    listeners.register(registry, deps)
    jobs.register(schedule, deps)
    registry.listen(OrderPlaced, record_audit, name="audit", inbox=deps.engine)
    registry.listen(Beat, record_beat, name="record_beat", inbox=deps.engine)
    schedule.job("soak.tick", "@every 1s", run_tick, inbox=deps.engine)
    schedule.every(timedelta(seconds=1), Beat(), name="soak.beat")
    for name in parcel_listeners(VERSION):
        registry.listen(Parcel, record_delivery(name), name=name, inbox=deps.engine)


kit = gp.Kit(register, engine=deps.engine, middleware=[KillAfterInboxCommit()]).with_closer(
    "database", deps.engine.dispose
)
broker = kit.broker
