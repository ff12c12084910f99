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
* when ``SOAK_SAMPLES_DIR`` is set, every message a worker starts (past the kit's own
  checks: a copy the idempotency claim skips is not started) is noted by
  :class:`StartSamples`: when it started, how long it waited since it was due (its
  ``message_timestamp``, or its ``eta`` when it was delayed or retried), and its actor,
  one line a message in ``<dir>/<pid>.txt``, appended once a second; the soak reads
  them for its queue wait and messages per second.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
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
from examples.shop.deps import Dependencies, Mailer
from examples.shop.events import OrderPlaced

FLAKY = float(os.environ.get("SOAK_FLAKY", "0.5"))
SAMPLES_DIR = os.environ.get("SOAK_SAMPLES_DIR")
#: How often a worker process appends its start samples to its file.
SAMPLE_FLUSH_S = 1.0
VERSION = int(os.environ.get("SOAK_VERSION", "0"))
#: Connections the process keeps (``SOAK_POOL_SIZE``; the shop's 5 by default): one for each worker thread
#: and for the relay, the scheduler's and the inbox pruning, so that no connection is opened and closed
#: again for a transaction past the pool (at 1,000 messages/s that churn cost PostgreSQL 0.17 of a core).
POOL_SIZE = int(os.environ.get("SOAK_POOL_SIZE", "5"))
PRE_PING = os.environ.get("SOAK_POOL_PRE_PING", "true") == "true"
engine = sa.create_engine(os.environ.get("DB_URL", "sqlite:///shop.db"), pool_pre_ping=PRE_PING, pool_size=POOL_SIZE)
deps = Dependencies(engine=engine, mailer=Mailer(engine))


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


class AuditDown(RuntimeError):
    """What ``audit`` raises on the attempts it fails on purpose."""


class WithoutAuditTracebacks(logging.Filter):
    """Log the failures ``audit`` makes on purpose without their traceback.

    The task log writes a failed attempt at ERROR with its traceback; at 1,000
    messages/s the audit fails 100 times a second, and formatting each traceback
    (Python 3.11 parses the source lines for its carets) is CPU the soak would spend
    on its own fault rather than on the kit. The line itself stays.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], AuditDown):
            record.exc_info = None
        return True


logging.getLogger("dramatiq_gp.tasks").addFilter(WithoutAuditTracebacks())
AUDIT = "listener:shop.order_placed:audit"
#: Set by ``record_audit`` once its write is done: this attempt applied the effect (it commits unless it raises).
_applied = threading.local()


def record_audit(event: OrderPlaced, conn: sa.Connection) -> None:
    if random.random() < FLAKY:
        raise AuditDown("the audit service is having a bad day")
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


class StartSamples(Middleware):
    """Notes each message a worker starts as ``<started ms> <waited ms> <actor>`` (see the module docstring).

    The lines are kept in memory and appended to ``<directory>/<pid>.txt`` every
    :data:`SAMPLE_FLUSH_S` by a thread of the worker process: a process killed with
    ``kill -9`` loses at most that last second, which the figures can spare.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def after_process_boot(self, broker: Broker) -> None:
        self._lines = []  # nothing noted before a fork belongs to this process
        threading.Thread(target=self._flush_forever, name="soak-samples", daemon=True).start()

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        now = time.time() * 1000
        due = max(message.message_timestamp, message.options.get("eta") or 0)
        line = f"{now:.0f} {now - due:.0f} {message.actor_name}\n"
        with self._lock:
            self._lines.append(line)

    def before_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        self._stop.set()
        self._flush()

    def _flush_forever(self) -> None:
        while not self._stop.wait(SAMPLE_FLUSH_S):
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
        if lines:
            with open(os.path.join(self.directory, f"{os.getpid()}.txt"), "a") as out:
                out.write("".join(lines))


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


middleware: list[Middleware] = [KillAfterInboxCommit()]
if SAMPLES_DIR:
    middleware.append(StartSamples(SAMPLES_DIR))
kit = gp.Kit(register, engine=deps.engine, middleware=middleware).with_closer("database", deps.engine.dispose)
broker = kit.broker
