"""The inbox transaction: a message's id commits with its effect, so a redelivered copy is skipped.

:func:`transaction` begins a transaction, inserts the message id into
``inbox_messages`` with ``ON CONFLICT DO NOTHING`` and hands the transaction to
the handler. An id already there means the effect committed before (a worker
died between its commit and its ack, a relay enqueued an event twice): the
handler does not run. A handler that raises rolls back its effect and the id
together, so its retry runs it again.

On PostgreSQL two copies running at once are safe without the Redis claim: the
second one's insert waits for the first transaction's row lock, and finds the
id once it commits (or inserts it, if it rolled back). SQLite serialises
writers anyway. Other databases are refused, at registration.

:func:`prune` deletes rows past their retention in limited batches; the relays
call it (see :class:`~dramatiq_gp.outbox.Relay`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from ..errors import AlreadyApplied, RegistrationError
from .table import INBOX, INBOX_TABLE_NAME

logger = logging.getLogger("dramatiq_gp.inbox")

#: How many expired rows one prune deletes at most.
PRUNE_BATCH = 5000

# Sent on the DBAPI cursor of the handler's own connection, not through SQLAlchemy: Core's
# execute (cache lookup, result wrapping) cost more CPU than the statement (pinned, one
# thread: +270 us a message against +110). ON CONFLICT DO NOTHING sets rowcount 0 on a
# duplicate, with psycopg and sqlite3 alike. Per paramstyle: psycopg's %s, sqlite3's ?.
_INSERT = (
    f"INSERT INTO {INBOX_TABLE_NAME} (message_id, task_type, envelope_id) VALUES ({{0}}, {{0}}, {{0}}) "
    "ON CONFLICT (message_id) DO NOTHING"
)
_INSERTS = {"format": _INSERT.format("%s"), "pyformat": _INSERT.format("%s"), "qmark": _INSERT.format("?")}
_DIALECTS = ("postgresql", "sqlite")


def check_bind(bind: object, where: str, *, is_async: bool = False) -> None:
    """Refuse anything but an Engine or a sessionmaker on PostgreSQL or SQLite, naming ``where``.

    An async handler (``is_async``) takes an ``AsyncEngine`` or ``async_sessionmaker``
    instead, and a plain one refuses those: each must run its transaction the way it
    runs itself.

    Raises:
        RegistrationError: naming ``where`` and what was given.
    """
    engine: object = None
    if isinstance(bind, sa.Engine | AsyncEngine):
        engine = bind
    elif isinstance(bind, sessionmaker | async_sessionmaker):
        engine = bind.kw.get("bind")
    else:
        kinds = "AsyncEngine or async_sessionmaker" if is_async else "Engine or sessionmaker"
        raise RegistrationError(f"{where}: inbox= takes a SQLAlchemy {kinds}, not {type(bind).__name__} {bind!r}")
    given_async = isinstance(bind, AsyncEngine | async_sessionmaker)
    if not isinstance(engine, sa.Engine | AsyncEngine):
        raise RegistrationError(f"{where}: inbox= takes a sessionmaker bound to an Engine (sessionmaker(engine))")
    if given_async != is_async:
        wanted = "an AsyncEngine or async_sessionmaker" if is_async else "an Engine or sessionmaker"
        kind = "an async" if is_async else "a plain"
        raise RegistrationError(f"{where}: {kind} handler's inbox= takes {wanted}, not {type(bind).__name__}")
    dialect = engine.dialect
    if dialect.name not in _DIALECTS or dialect.paramstyle not in _INSERTS:
        raise RegistrationError(f"{where}: the inbox needs PostgreSQL (or SQLite), not {dialect.name}")


@contextmanager
def transaction(
    bind: sa.Engine | sessionmaker[Session], message_id: str, task_type: str, envelope_id: str | None
) -> Iterator[Any]:
    """A transaction on ``bind`` with ``message_id`` recorded in it; commits when the block ends.

    Yields a ``Connection`` for an Engine, a ``Session`` for a sessionmaker.

    Raises:
        AlreadyApplied: on entering, when ``message_id`` is recorded already (logged once).
    """
    row = {"message_id": message_id, "task_type": task_type, "envelope_id": envelope_id}
    if isinstance(bind, sa.Engine):
        with bind.begin() as conn:
            _record(conn, row)
            yield conn
    else:
        with bind() as session, session.begin():
            _record(session.connection(), row)
            yield session


@asynccontextmanager
async def transaction_async(
    bind: AsyncEngine | async_sessionmaker[AsyncSession], message_id: str, task_type: str, envelope_id: str | None
) -> AsyncIterator[Any]:
    """:func:`transaction` for async handlers: an ``AsyncConnection`` for an AsyncEngine, an
    ``AsyncSession`` for an async_sessionmaker; the same insert, run through ``run_sync``.

    Raises:
        AlreadyApplied: on entering, when ``message_id`` is recorded already (logged once).
    """
    row = {"message_id": message_id, "task_type": task_type, "envelope_id": envelope_id}
    if isinstance(bind, AsyncEngine):
        async with bind.begin() as conn:
            await conn.run_sync(lambda sync: _record(sync, row))
            yield conn
    else:
        async with bind() as session, session.begin():
            await session.run_sync(lambda sync: _record(sync.connection(), row))
            yield session


def _record(conn: sa.Connection, row: dict[str, Any]) -> None:
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]  # checked out: not None
    try:
        cursor.execute(_INSERTS[conn.dialect.paramstyle], (row["message_id"], row["task_type"], row["envelope_id"]))
        inserted = cursor.rowcount == 1
    finally:
        cursor.close()
    if inserted:
        return
    logger.warning("task skipped: already applied (inbox) task_type=%s task_id=%s", row["task_type"], row["message_id"])
    raise AlreadyApplied(f"message {row['message_id']} was applied already")


def prune(engine: sa.Engine, retention: timedelta, *, batch: int = PRUNE_BATCH) -> int:
    """Delete up to ``batch`` inbox rows older than ``retention``; returns how many.

    Limited batches, locked with ``SKIP LOCKED``, so several relays prune side by
    side and no delete holds many locks or one long transaction.
    """
    with engine.begin() as conn:
        postgres = conn.dialect.name == "postgresql"
        now: Any = sa.func.now() if postgres else datetime.now(UTC).replace(tzinfo=None)
        expired = (
            sa.select(INBOX.c.message_id)
            .where(INBOX.c.processed_at < now - retention)
            .limit(batch)
            .with_for_update(skip_locked=True)
        )
        return int(conn.execute(sa.delete(INBOX).where(INBOX.c.message_id.in_(expired.scalar_subquery()))).rowcount)
