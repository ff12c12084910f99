"""Dispatch inside the application's transaction: the event is a row until that transaction commits."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from ..durations import EPOCH, MAX_AHEAD
from ..errors import DispatchError
from ..events import event_type
from ..settings import Settings
from ..tracecontext import current_carrier
from .table import CHANNEL, OUTBOX_EVENTS

_INSERT = OUTBOX_EVENTS.insert()
_NOTIFY = sa.text(f"SELECT pg_notify('{CHANNEL}', '')")
_NOTIFIED = "dramatiq_gp.outbox.notified"

#: Whether dispatches NOTIFY the relays; ``None`` until a Kit sets it or ``OUTBOX_NOTIFY`` is read.
_notify: bool | None = None


def set_notify(enabled: bool) -> None:
    """Make this process's dispatches NOTIFY the relays (``OUTBOX_NOTIFY``), or not."""
    global _notify
    _notify = enabled


def write(
    target: Session | sa.Connection,
    event: object,
    *,
    envelope_id: str | None = None,
    trace_context: dict[str, str] | None = None,
    delay: timedelta | None = None,
    at: datetime | None = None,
) -> str:
    """Write ``event`` to the outbox in ``target``'s transaction; returns its id.

    Nothing reaches the queue unless that transaction commits; a rollback means
    the event never existed. On PostgreSQL the first dispatch of a transaction
    also NOTIFYs the relays (once per transaction), so they wake at commit.

    With ``delay`` (a non-negative ``timedelta``) or ``at`` (an aware ``datetime``;
    one in the past means now) the row waits in the table until then: the relays
    send it no sooner, and then as any other. It is due at most
    :data:`~dramatiq_gp.durations.MAX_AHEAD` (100 years) ahead; ``at`` is from 1970 on.

    Raises:
        EventError: ``event`` is not an event.
        EventEncodeError: its payload cannot be encoded; nothing was written.
        DispatchError: ``delay`` or ``at`` is not one it can keep, or the table lacks
            ``not_before`` (``dramatiq-gp migrate up``); nothing was written.
    """
    kind = event_type(event)
    due = due_time(delay, at)
    data = kind.encode(event)
    conn = target.connection() if isinstance(target, Session) else target
    event_id = uuid.UUID(envelope_id) if envelope_id else uuid.uuid4()
    carrier = trace_context if trace_context is not None else current_carrier()
    row = {"id": event_id, "event": kind.name, "payload": data, "trace_context": carrier}
    if due is None:
        conn.execute(_INSERT, row)
    else:
        if conn.dialect.name != "postgresql":  # SQLite keeps the table's times naive, in UTC
            due = due.replace(tzinfo=None)
        try:
            conn.execute(_INSERT, {**row, "available_at": due, "not_before": due})
        except sa.exc.DBAPIError as exc:
            if "not_before" not in str(exc.orig):
                raise
            raise DispatchError(
                f"the outbox table {OUTBOX_EVENTS.name!r} predates delayed events (no not_before column): "
                "run `dramatiq-gp migrate up`"
            ) from None
    if conn.dialect.name == "postgresql" and _notify_enabled():
        transaction = conn.get_transaction()
        if conn.info.get(_NOTIFIED) is not transaction:
            conn.execute(_NOTIFY)
            conn.info[_NOTIFIED] = transaction
    return str(event_id)


async def write_async(
    target: AsyncSession | AsyncConnection,
    event: object,
    *,
    envelope_id: str | None = None,
    delay: timedelta | None = None,
    at: datetime | None = None,
) -> str:
    """:func:`write` in an async SQLAlchemy transaction: the same row, the same NOTIFY, nothing sent without a commit.

    The insert runs through ``run_sync`` on the ``AsyncConnection`` (psycopg 3's
    async driver: ``postgresql+psycopg://`` with ``create_async_engine``), so it is
    :func:`write` itself, in the caller's transaction.

    Raises:
        EventError: ``event`` is not an event.
        EventEncodeError: its payload cannot be encoded; nothing was written.
        DispatchError: as :func:`write`.
    """
    event_type(event)  # a non-event, or a bad delay, is refused before any connection is checked out
    due_time(delay, at)
    conn = await target.connection() if isinstance(target, AsyncSession) else target
    carrier = current_carrier()  # read here: the greenlet run_sync uses need not see the caller's span
    return await conn.run_sync(
        lambda sync: write(sync, event, envelope_id=envelope_id, trace_context=carrier, delay=delay, at=at)
    )


def due_time(delay: timedelta | None, at: datetime | None) -> datetime | None:
    """When a dispatch with ``delay`` or ``at`` is due, in UTC; ``None`` for at once (neither, zero, or past).

    Read on this process's clock, as the caller means it.

    Raises:
        DispatchError: both given, ``delay`` negative or not a timedelta, ``at`` naive or not a datetime,
            either due more than 100 years ahead, ``at`` before 1970.
    """
    if delay is None and at is None:
        return None
    if delay is not None and at is not None:
        raise DispatchError("dispatch takes delay= or at=, not both")
    now = datetime.now(UTC)
    if delay is not None:
        if not isinstance(delay, timedelta):
            raise DispatchError(f"dispatch delay= takes a datetime.timedelta, not {type(delay).__name__} {delay!r}")
        if delay < timedelta(0):
            raise DispatchError(f"dispatch delay= must not be negative, got {delay.total_seconds():g} s")
        ahead, given = delay, f"delay={delay}"
    else:
        if not isinstance(at, datetime):
            raise DispatchError(f"dispatch at= takes a datetime.datetime, not {type(at).__name__} {at!r}")
        if at.tzinfo is None or at.utcoffset() is None:
            raise DispatchError(f"dispatch at= takes an aware datetime (with a tzinfo), not the naive {at.isoformat()}")
        if at < EPOCH:  # a placeholder (datetime.min), negative in ms since the epoch as the tools count
            raise DispatchError(
                f"dispatch at={at.isoformat()} is before 1970: give a time from 1970 on (a past one means now)"
            )
        # A difference of aware datetimes never overflows; at.astimezone(UTC) does, near the year 1 or 9999.
        ahead, given = at - now, f"at={at.isoformat()}"
    if ahead > MAX_AHEAD:
        raise DispatchError(
            f"dispatch {given} is more than {MAX_AHEAD.days} days (100 years) ahead, the furthest a dispatch may be due"
        )
    return now + ahead if ahead > timedelta(0) else None


def _notify_enabled() -> bool:
    if _notify is None:  # a process without a Kit, such as a web app
        set_notify(Settings.from_env().outbox.notify)
    return bool(_notify)
