"""The relay: moves committed outbox rows to the queue, once each, losing none.

One relay thread runs in every worker process; any number run together. Each
round, in one database transaction, a relay

1. claims up to ``OUTBOX_BATCH_SIZE`` pending rows whose time has come with
   ``FOR UPDATE SKIP LOCKED`` (by status, not by an id cursor, so a transaction
   that commits out of id order is never skipped, and relays never wait on each
   other);
2. enqueues one ``event:<event>`` message per row, under the row's id, as one
   batch (on Redis one round trip; on RabbitMQ published at once, then every
   message confirmed);
3. marks the rows published (or deletes them when ``OUTBOX_RETENTION=0``) and commits.

While batches come back full, a relay on PostgreSQL pipelines them
(:meth:`Relay.relay_batches`): each batch still in a transaction of its own, the
next one is claimed, and the one before committed, by two threads of the relay
on connections of their own while this one is sent, so the database's round
trips and the broker's (on RabbitMQ, the confirms) overlap; a busy relay holds
up to three of the engine's connections.

Every ``PURGE_INTERVAL_S`` it also deletes a batch of published rows past
``OUTBOX_RETENTION`` and one of inbox rows past ``OUTBOX_INBOX_RETENTION`` (again
a second later while a batch comes back full), never all at once.

A crash between 2 and 3 (of any batch in the pipeline) leaves the rows pending: another relay enqueues them
again under the same ids, and idempotent execution turns the copies into no-ops.
A row whose event this process cannot read (an unknown event type, a payload that
no longer matches its class) is retried with backoff, then set aside, without
holding back the rows behind it. A row that can never become a message (JSON
nested too deep to read or write, a payload that is not an object, a trace
context that is not one) is set aside at once, with the reason, alone: the
relay reads each row's JSON itself, so one such row cannot fail its batch.
It encodes each message itself, as Dramatiq's ``Message.encode`` would (the
same dict, in its field order, through the compact ``json.dumps`` of Dramatiq's
``JSONEncoder`` when that is the encoder set), and a broker may send those bytes
as they are: a test compares them with Dramatiq's own.

Between rounds the relay waits for a NOTIFY (sent by ``dispatch`` at commit) or
its poll interval, which backs off from ``OUTBOX_POLL_INTERVAL_MIN`` to ``_MAX``
while there is nothing to do, and never past the time the next delayed row falls
due (read from the table after a round that found nothing due): a delayed event
is claimed within milliseconds of its time, whatever the poll interval. If
PostgreSQL or Redis goes away it logs once, backs off and carries on when they
return. An outbox table ``dramatiq-gp migrate up`` has not yet brought up to
date is said in one line, and waited for.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import psycopg
import redis
import sqlalchemy as sa
from dramatiq import JSONEncoder, Message, get_encoder
from dramatiq.errors import BrokerConnectionError
from opentelemetry.metrics import Observation
from sqlalchemy.dialects.postgresql import ARRAY

from ..brokers.base import KitBroker
from ..errors import GPError, PayloadMismatch
from ..events import event_type_named
from ..metrics import instruments, observe
from ..names import EVENT_QUEUE, event_actor
from ..settings import OutboxSettings, WorkerSettings, resolve_inbox_retention
from ..telemetry import printable
from ..tracecontext import ORIGIN
from .admin import backlog
from .inbox import PRUNE_BATCH, prune
from .table import CHANNEL, INBOX_TABLE_NAME, OUTBOX_EVENTS, outbox_problem

T = OUTBOX_EVENTS.c

#: How often published rows past their retention are purged, and how many at a time.
PURGE_INTERVAL_S, PURGE_BATCH = 30.0, 5000
#: How soon the inbox is pruned again after a full batch: there is more to delete.
PRUNE_AGAIN_S = 1.0
#: Longest pause between attempts while the database or Redis is away.
MAX_OUTAGE_BACKOFF_S = 5.0
#: How often a waiting relay checks whether it should stop.
STOP_CHECK_S = 0.2
#: How long :meth:`Relay.relay_batches` keeps its pipeline going before the round ends (and purging gets a turn).
PIPELINE_FOR_S = 1.0

_OUTAGE = (
    sa.exc.OperationalError,
    sa.exc.InterfaceError,
    psycopg.Error,
    redis.RedisError,
    BrokerConnectionError,
    OSError,
)


def _unreached(error: BaseException) -> str:
    """Which of the relay's three servers ``error`` (one of :data:`_OUTAGE`) says is out of reach."""
    if isinstance(error, redis.RedisError):
        return "Redis/Valkey"
    if isinstance(error, BrokerConnectionError):
        return "the broker"
    if isinstance(error, sa.exc.OperationalError | sa.exc.InterfaceError | psycopg.Error):
        return "the database"
    return "the database, Redis/Valkey or the broker"


class PoisonEvent(GPError):
    """A row this process cannot turn into a message."""


def _json(text: str | None, column: str) -> Any:
    """The value of a JSON column read as text; :class:`UnreadableRow` naming the column when it cannot be read."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UnreadableRow(f"its {column} cannot be read as JSON ({type(exc).__name__})") from None


class UnreadableRow(PoisonEvent):
    """A row no process can turn into a message: retrying it would not help."""


_R = TypeVar("_R")


class _Stage:
    """A daemon thread running what it is given, in turn: a stage of :meth:`Relay.relay_batches`.

    Not a ``ThreadPoolExecutor``: the interpreter waits for those threads at exit,
    and a stage stuck on a database that does not answer would hold up a worker's
    exit, as the relay's own thread (a daemon) does not.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, function: Callable[..., _R], *args: Any) -> Future[_R]:
        future: Future[_R] = Future()
        self._jobs.put((future, function, args))
        return future

    def shutdown(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, function, args = job
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


@dataclass
class _Claim:
    """A claimed batch: its rows, the messages of those that can be sent (ids, encodings), the poisoned ones."""

    rows: Sequence[Any]
    messages: list[Message[Any]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    published: list[Any] = field(default_factory=list)
    poisoned: list[tuple[Any, PoisonEvent]] = field(default_factory=list)


@dataclass
class _Batch:
    """A claim and the connection whose open transaction holds its rows."""

    conn: sa.Connection
    claim: _Claim


class Relay:
    """Forwards committed outbox rows to the queue (see the module docstring).

    Parameters:
        engine: the database holding ``outbox_events``.
        broker: where the events go.
        settings: batch size, poll intervals, NOTIFY, retention, attempts.
    """

    name = "outbox relay"

    def __init__(self, *, engine: sa.Engine, broker: KitBroker, settings: OutboxSettings) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.engine = engine
        self.broker = broker
        self.settings = settings
        self._postgres = engine.dialect.name == "postgresql"
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: psycopg.Connection[Any] | None = None
        #: The threads that claim the next batch and commit the last one while one is sent (:meth:`relay_batches`).
        self._stages: dict[str, _Stage] = {}
        #: Set when the engine's pool could not lend the pipeline a second connection: one batch at a time.
        self._serial = False
        self._last_purge = 0.0
        self._next_prune = 0.0
        #: Whether the table was found as this version needs it; and whether it was found not to be (said once).
        self._schema_ok = self._outdated = False
        #: Seconds until the next pending row falls due, as the last round that found none due read it.
        self._next_due: float | None = None
        #: How long inbox rows are kept (``OUTBOX_INBOX_RETENTION``, resolved by ``Settings.from_env``).
        self.inbox_retention = (
            settings.inbox_retention or resolve_inbox_retention(WorkerSettings(), settings).inbox_retention
        )
        self._published = instruments().outbox_published
        self._backlog: tuple[float, int, float] = (0.0, 0, 0.0)  # read at, pending, oldest age
        observe("dramatiq_gp.outbox.backlog", "{event}", "Outbox rows due, not yet relayed", self._observe_backlog)
        observe(
            "dramatiq_gp.outbox.oldest_age",
            "s",
            "How long the oldest outbox row not yet relayed has been due",
            self._observe_oldest_age,
        )

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="gp-outbox-relay", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current round; its transaction commits or rolls back first."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        stages, self._stages = self._stages, {}
        for stage in stages.values():
            stage.shutdown()

    def close(self) -> None:
        listener, self._listener = self._listener, None  # the relay's thread and a stopping one may both close
        if listener is not None:
            listener.close()

    # -- one round -----------------------------------------------------------------

    def relay_once(self) -> int:
        """Relay one batch; returns how many rows it handled (published or set back)."""
        with self.engine.begin() as conn:
            claim = self._claim(conn)
            if claim is not None:
                self._send(claim)
                self._finish(conn, claim)
        return self._count(claim)

    def relay_batches(self) -> int:
        """Relay batches while they come back full, for up to :data:`PIPELINE_FOR_S`; returns the rows handled.

        What the relay thread runs each round. On PostgreSQL it is a pipeline of
        three stages, each batch in a transaction of its own: while this thread
        waits for a batch's enqueue (on RabbitMQ, its confirms), the relay's claim
        thread claims the next batch and builds its messages, and its commit
        thread marks the batch sent before published and commits it; at most three
        of the engine's connections at a time. A row is still marked only once its
        enqueue returned, in the transaction that claimed it. A claim skips the
        rows the batches in flight hold, and sees those committed as published, so
        no row is sent twice while nothing fails. Whatever fails, the batches not
        yet committed roll back and stay pending (a sent one is sent again, under
        the same ids, as after a crash). An engine whose pool cannot lend a second
        connection within its timeout is said so once, and relayed one batch at a time.
        """
        if not self._postgres or self._serial:
            return self.relay_once()
        current = self._begin()
        handled, until = 0, time.monotonic() + PIPELINE_FOR_S
        ahead: Future[_Batch | None] | None = None
        committing: Future[int] | None = None
        try:
            while current is not None:
                if (
                    len(current.claim.rows) >= self.settings.batch_size
                    and time.monotonic() < until
                    and not self._stopping.is_set()
                ):
                    ahead = self._stage("claim").submit(self._begin)
                self._send(current.claim)
                sent, current, before = current, None, committing
                committing = self._stage("commit").submit(self._commit, sent)
                if before is not None:
                    handled += before.result()
                if ahead is not None:
                    try:
                        current = ahead.result()
                    except sa.exc.TimeoutError:
                        self._pool_too_small()
                    ahead = None
            if committing is not None:
                handled, committing = handled + committing.result(), None
        finally:
            if current is not None:
                current.conn.close()  # rolls back: its rows stay pending
            if ahead is not None:
                with contextlib.suppress(Exception):
                    if (claimed := ahead.result()) is not None:
                        claimed.conn.close()
            if committing is not None:
                with contextlib.suppress(Exception):
                    committing.result()  # a sent batch: let its commit end, or fail
        return handled

    def _pool_too_small(self) -> None:
        self._serial = True
        self.logger.warning(
            "outbox relay: the engine's pool lends it no second connection within its timeout; relaying one batch "
            "at a time (give the pool three connections to spare, e.g. DB_POOL_SIZE, for the relay's pipeline)"
        )

    def _stage(self, name: str) -> _Stage:
        """The relay's thread for one stage of :meth:`relay_batches`, started at first use."""
        stage = self._stages.get(name)
        if stage is None:
            stage = self._stages[name] = _Stage(f"gp-outbox-{name}")
        return stage

    def _begin(self) -> _Batch | None:
        """A claimed batch in a transaction left open on a connection of its own; ``None`` when none is due."""
        conn = self.engine.connect()
        try:
            conn.begin()
            claim = self._claim(conn)
        except BaseException:
            conn.close()
            raise
        if claim is None:
            conn.close()
            return None
        return _Batch(conn, claim)

    def _commit(self, sent: _Batch) -> int:
        """Mark a sent batch published and commit it; how many rows it handled."""
        try:
            self._finish(sent.conn, sent.claim)
            sent.conn.commit()
        finally:
            sent.conn.close()
        return self._count(sent.claim)

    def _claim(self, conn: sa.Connection) -> _Claim | None:
        """Lock up to a batch of due rows in ``conn``'s transaction, and build their messages; ``None``: none due."""
        # The JSON is read here, row by row: decoded by the driver, one row nested too deep failed the batch.
        rows = conn.execute(
            sa.select(
                T.id,
                T.event,
                sa.cast(T.payload, sa.Text).label("payload"),
                sa.cast(T.trace_context, sa.Text).label("trace_context"),
                T.attempts,
                T.created_at,
                T.not_before,
            )
            .where(T.published_at.is_(None), T.failed_at.is_(None), T.available_at <= self._now())
            .order_by(T.available_at)
            .limit(self.settings.batch_size)
            .with_for_update(skip_locked=True)
        ).all()
        if not rows:
            self._next_due = self._seconds_to_next_due(conn)
            return None
        claim = _Claim(rows)
        encode, timestamp = _encoder(), int(time.time() * 1000)
        for row in rows:
            try:
                message, body = self._message(row, encode, timestamp)
            except PoisonEvent as exc:
                claim.poisoned.append((row, exc))
                continue
            claim.messages.append(message)
            claim.bodies.append(body)
            claim.published.append(row.id)
        return claim

    def _send(self, claim: _Claim) -> None:
        if claim.messages:
            self.broker.enqueue_many(claim.messages, encoded=claim.bodies)

    def _finish(self, conn: sa.Connection, claim: _Claim) -> None:
        """Mark the sent rows published (delete them when ``OUTBOX_RETENTION=0``) and set back the poisoned ones."""
        now = self._now()
        if claim.published:
            done = self._among(claim.published)
            if self.settings.retention:
                conn.execute(sa.update(OUTBOX_EVENTS).where(done).values(published_at=now))
            else:
                conn.execute(sa.delete(OUTBOX_EVENTS).where(done))
        for row, error in claim.poisoned:
            self._set_back(conn, row, str(error), now, at_once=isinstance(error, UnreadableRow))

    def _count(self, claim: _Claim | None) -> int:
        """Count a committed batch's published rows; how many rows it handled."""
        if claim is None:
            return 0
        if claim.published:
            self._published.add(len(claim.published))
        return len(claim.rows)

    def _now(self) -> Any:
        return sa.func.statement_timestamp() if self._postgres else _utcnow()

    def _seconds_to_next_due(self, conn: sa.Connection) -> float | None:
        """Seconds until the earliest pending row's ``available_at``, on the database's clock; ``None`` without one.

        The smallest key of the pending index: one index probe, however many rows wait.
        """
        earliest = sa.select(sa.func.min(T.available_at)).where(T.published_at.is_(None), T.failed_at.is_(None))
        if self._postgres:
            seconds = sa.func.extract("epoch", earliest.scalar_subquery() - sa.func.statement_timestamp())
            value = conn.execute(sa.select(seconds)).scalar_one()
            return None if value is None else float(value)
        due: datetime | None = conn.execute(earliest).scalar_one()
        return None if due is None else (due.replace(tzinfo=None) - _utcnow()).total_seconds()

    def _among(self, ids: list[Any]) -> sa.ColumnElement[bool]:
        """``id`` is one of ``ids``: on PostgreSQL one array parameter, not a placeholder per id to expand and parse."""
        if self._postgres:
            return T.id == sa.any_(sa.bindparam("ids", ids, type_=ARRAY(T.id.type)))
        return T.id.in_(ids)

    def purge(self) -> int:
        """Delete up to a batch of published rows past their retention."""
        with self.engine.begin() as conn:
            now = sa.func.now() if self._postgres else _utcnow()
            expired = (
                sa.select(T.id)
                .where(T.published_at < now - self.settings.retention)
                .limit(PURGE_BATCH)
                .with_for_update(skip_locked=True)
            )
            return conn.execute(sa.delete(OUTBOX_EVENTS).where(T.id.in_(expired.scalar_subquery()))).rowcount

    def prune_inbox(self) -> int:
        """Delete up to a batch of inbox rows past their retention; 0 where there is no inbox table."""
        with self.engine.connect() as conn:
            if not sa.inspect(conn).has_table(INBOX_TABLE_NAME):
                return 0  # an outbox migrated before the inbox existed: `dramatiq-gp migrate up` adds it
        assert self.inbox_retention is not None
        return prune(self.engine, self.inbox_retention)

    def _message(self, row: Any, encode: Any, timestamp: int) -> tuple[Message[Any], bytes]:
        """The row's message, stamped ``timestamp``, and its encoding by ``encode`` (the broker may send it as is)."""
        # Unpacked once: each attribute of a result row is a lookup by name.
        row_id, event, payload_text, trace_text, _attempts, created_at, not_before = row
        payload, trace_context = _json(payload_text, "payload"), _json(trace_text, "trace_context")
        if not isinstance(payload, dict):
            raise UnreadableRow(f"its payload is a JSON {type(payload).__name__}, not an object")
        if trace_context is not None and not isinstance(trace_context, dict):
            raise UnreadableRow(f"its trace_context is a JSON {type(trace_context).__name__}, not an object")
        kind = event_type_named(event)
        if kind is None:
            raise PoisonEvent(f"event type {event!r} is unknown here (no class declares it)")
        try:
            kind.decode(payload)
        except PayloadMismatch as exc:
            raise PoisonEvent(str(exc)) from None
        event_id = str(row_id)
        # ``at``: a listener retired after the event was written still gets it (see subscriptions). A
        # delayed event is written when due: it fans out to whoever listens then, as if dispatched then.
        written = not_before or created_at
        written = written if written.tzinfo else written.replace(tzinfo=UTC)
        args = ({"id": event_id, "event": event, "data": payload, "at": int(written.timestamp() * 1000)},)
        actor = event_actor(event)
        # The dispatching code's context is the message's creation context.
        options = {ORIGIN: trace_context} if trace_context else {}
        fields: dict[str, Any] = {
            "queue_name": EVENT_QUEUE,
            "actor_name": actor,
            "args": args,
            "kwargs": {},
            "options": options,
            "message_id": event_id,
            "message_timestamp": timestamp,
        }
        try:
            # What Message.encode does (the same dict, in its field order), without Message.asdict's
            # per-field introspection; done here so that a row the broker cannot encode does not fail the batch.
            body = encode(fields)
        except (ValueError, TypeError, RecursionError) as exc:
            raise UnreadableRow(f"it cannot be encoded as a message ({type(exc).__name__})") from None
        return Message(**fields), body

    def backlog(self) -> tuple[int, float]:
        """Due rows not yet relayed, and seconds since the oldest of them fell due (delayed rows not yet due: none)."""
        count, age, _scheduled = backlog(self.engine)
        return count, age or 0.0

    def _observe_backlog(self) -> list[Observation]:
        read = self._read_backlog()
        return [] if read is None else [Observation(read[0])]

    def _observe_oldest_age(self) -> list[Observation]:
        read = self._read_backlog()
        return [] if read is None else [Observation(read[1])]

    def _read_backlog(self) -> tuple[int, float] | None:
        # Only while the relay runs: once stopped, its engine may be disposed, and a
        # collection must not open a new pool on it that nothing would close. Nor on a
        # table without the columns it reads: the relay has said so, once.
        if self._thread is None or self._stopping.is_set() or self._outdated:
            return None
        # Both gauges are read in one collection: one query serves them.
        read_at, count, age = self._backlog
        if time.monotonic() - read_at > 1.0:
            try:
                count, age = self.backlog()
            except _OUTAGE as exc:
                self.logger.warning("outbox backlog gauge: cannot read the outbox: %s", exc)
                return 0, 0.0
            self._backlog = (time.monotonic(), count, age)
        return count, age

    def _set_back(self, conn: sa.Connection, row: Any, error: str, now: Any, *, at_once: bool = False) -> None:
        attempts = row.attempts + 1
        if at_once:
            self.logger.error(
                "outbox event %s (%s) set aside: %s; `dramatiq-gp outbox retry %s` re-queues it once fixed",
                row.id,
                printable(row.event),
                error,
                row.id,
            )
            values: dict[str, Any] = {"failed_at": now}
            instruments().outbox_set_aside.add(1, {"event": row.event})
        elif attempts >= self.settings.max_attempts:
            self.logger.error(
                "outbox event %s (%s) set aside after %d attempts: %s; `dramatiq-gp outbox retry %s` re-queues it",
                row.id,
                printable(row.event),
                attempts,
                error,
                row.id,
            )
            values = {"failed_at": now}
            instruments().outbox_set_aside.add(1, {"event": row.event})
        else:
            delay = timedelta(seconds=min(2**attempts, 300))
            self.logger.warning(
                "outbox event %s (%s) cannot be relayed (attempt %d of %d, next in %ss): %s",
                row.id,
                printable(row.event),
                attempts,
                self.settings.max_attempts,
                delay.seconds,
                error,
            )
            values = {"available_at": now + delay}
        conn.execute(
            sa.update(OUTBOX_EVENTS).where(T.id == row.id).values(attempts=attempts, last_error=error, **values)
        )

    # -- the loop ------------------------------------------------------------------

    def _run(self) -> None:
        interval = poll_min = self.settings.poll_interval_min.total_seconds()
        poll_max = self.settings.poll_interval_max.total_seconds()
        outage_backoff, failing = 0.0, False
        while not self._stopping.is_set():
            try:
                if not self._schema_ok and not self._check_schema():
                    self._stopping.wait(MAX_OUTAGE_BACKOFF_S)
                    continue
                self._ensure_listening()
                handled = self.relay_batches()
                if time.monotonic() - self._last_purge > PURGE_INTERVAL_S and self.settings.retention:
                    self._last_purge = time.monotonic()
                    self.purge()
                if time.monotonic() > self._next_prune:
                    full = self.prune_inbox() == PRUNE_BATCH
                    self._next_prune = time.monotonic() + (PRUNE_AGAIN_S if full else PURGE_INTERVAL_S)
            except _OUTAGE as exc:
                if not failing:
                    self.logger.warning("outbox relay cannot reach %s, retrying: %s", _unreached(exc), exc)
                failing = True
                self.close()
                outage_backoff = min(max(outage_backoff * 2, 0.1), MAX_OUTAGE_BACKOFF_S)
                self._stopping.wait(outage_backoff)
                continue
            except Exception:
                self.logger.exception("outbox relay round failed; retrying")
                self._stopping.wait(MAX_OUTAGE_BACKOFF_S)
                continue
            if failing:
                self.logger.info("outbox relay reconnected")
                failing, outage_backoff = False, 0.0
            if handled:
                interval = poll_min  # there may be more; look again at once
                continue
            # A due row found none claimable is another relay's: no early wake for it.
            due = self._next_due
            self._wait(interval if due is None or due <= 0 else min(interval, due))
            interval = min(interval * 2, poll_max)
        self.close()  # its LISTEN connection: this thread's, and left open it is only closed when collected

    def _check_schema(self) -> bool:
        """Whether the outbox table is as this version needs it; says what is not once, until it is."""
        with self.engine.connect() as conn:
            problem = outbox_problem(conn)
        if problem is None:
            if self._outdated:
                self.logger.info("outbox table migrated, relaying")
            self._schema_ok, self._outdated = True, False
        elif not self._outdated:
            self.logger.error("outbox relay waiting: %s", problem)
            self._outdated = True
        return self._schema_ok

    def _ensure_listening(self) -> None:
        if self._listener is not None or not (self.settings.notify and self._postgres):
            return
        url = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._listener = psycopg.connect(url, autocommit=True, connect_timeout=5)
        self._listener.execute(f"LISTEN {CHANNEL}")

    def _wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``; return early on a NOTIFY or a stop."""
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._listener is None:
                self._stopping.wait(min(left, STOP_CHECK_S))
                continue
            try:
                if any(True for _ in self._listener.notifies(timeout=min(left, STOP_CHECK_S), stop_after=1)):
                    # Several commits may have notified; one round serves them all.
                    for _ in self._listener.notifies(timeout=0):
                        pass
                    return
            except psycopg.Error as exc:
                self.logger.warning("outbox relay lost its LISTEN connection, polling until it is back: %s", exc)
                self.close()


#: What Dramatiq's ``JSONEncoder.encode`` runs (``json.dumps`` with these separators), built once:
#: ``json.dumps`` with any option builds an encoder per call. A test pins the bytes to Dramatiq's.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":")).encode


def _encoder() -> Any:
    """The message encoder Dramatiq is set to use, as a function; its JSON one without the per-call set-up."""
    encoder = get_encoder()
    if type(encoder) is JSONEncoder:
        return lambda data: _COMPACT_JSON(data).encode("utf-8")
    return encoder.encode


def _utcnow() -> datetime:
    # SQLite stores naive timestamps; the table's defaults are UTC.
    return datetime.now(UTC).replace(tzinfo=None)
