"""Dispatch inside the application's transaction: the event is a row until that transaction commits."""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

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
) -> str:
    """Write ``event`` to the outbox in ``target``'s transaction; returns its id.

    Nothing reaches the queue unless that transaction commits; a rollback means
    the event never existed. On PostgreSQL the first dispatch of a transaction
    also NOTIFYs the relays (once per transaction), so they wake at commit.

    Raises:
        EventError: ``event`` is not an event.
        EventEncodeError: its payload cannot be encoded; nothing was written.
    """
    kind = event_type(event)
    data = kind.encode(event)
    conn = target.connection() if isinstance(target, Session) else target
    event_id = uuid.UUID(envelope_id) if envelope_id else uuid.uuid4()
    carrier = trace_context if trace_context is not None else current_carrier()
    conn.execute(_INSERT, {"id": event_id, "event": kind.name, "payload": data, "trace_context": carrier})
    if conn.dialect.name == "postgresql" and _notify_enabled():
        transaction = conn.get_transaction()
        if conn.info.get(_NOTIFIED) is not transaction:
            conn.execute(_NOTIFY)
            conn.info[_NOTIFIED] = transaction
    return str(event_id)


async def write_async(target: AsyncSession | AsyncConnection, event: object, *, envelope_id: str | None = None) -> str:
    """:func:`write` in an async SQLAlchemy transaction: the same row, the same NOTIFY, nothing sent without a commit.

    The insert runs through ``run_sync`` on the ``AsyncConnection`` (psycopg 3's
    async driver: ``postgresql+psycopg://`` with ``create_async_engine``), so it is
    :func:`write` itself, in the caller's transaction.

    Raises:
        EventError: ``event`` is not an event.
        EventEncodeError: its payload cannot be encoded; nothing was written.
    """
    event_type(event)  # a non-event is refused before any connection is checked out
    conn = await target.connection() if isinstance(target, AsyncSession) else target
    carrier = current_carrier()  # read here: the greenlet run_sync uses need not see the caller's span
    return await conn.run_sync(lambda sync: write(sync, event, envelope_id=envelope_id, trace_context=carrier))


def _notify_enabled() -> bool:
    if _notify is None:  # a process without a Kit, such as a web app
        set_notify(Settings.from_env().outbox.notify)
    return bool(_notify)
