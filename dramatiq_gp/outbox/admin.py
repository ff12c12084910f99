"""Looking after the outbox: the rows set aside, and putting them back."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from .table import OUTBOX_EVENTS

T = OUTBOX_EVENTS.c


def backlog(engine: sa.Engine) -> tuple[int, float | None, int]:
    """Due rows not yet relayed, seconds since the oldest of them fell due (``None`` without any), and the
    delayed rows not yet due.

    A row falls due when written, or at its ``not_before``: a delayed event is late
    from its time on, not from when it was written, and is no lag before.
    """
    with engine.connect() as conn:
        now: Any = sa.func.now() if conn.dialect.name == "postgresql" else datetime.now(UTC).replace(tzinfo=None)
        scheduled = T.not_before > now
        due = sa.or_(T.not_before.is_(None), T.not_before <= now)
        count, oldest, waiting = conn.execute(
            sa.select(
                sa.func.count().filter(due),
                sa.func.min(sa.func.coalesce(T.not_before, T.created_at)).filter(due),
                sa.func.count().filter(scheduled),
            ).where(T.published_at.is_(None), T.failed_at.is_(None))
        ).one()
    if oldest is None:
        return int(count), None, int(waiting)
    if oldest.tzinfo is None:  # SQLite: naive, in UTC
        oldest = oldest.replace(tzinfo=UTC)
    return int(count), max((datetime.now(UTC) - oldest).total_seconds(), 0.0), int(waiting)


def set_aside_count(engine: sa.Engine) -> int:
    """Rows the relays gave up on."""
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(T.failed_at.is_not(None))).scalar_one())


@dataclass(frozen=True)
class FailedEvent:
    """An outbox row the relays gave up on."""

    id: uuid.UUID
    event: str
    attempts: int
    last_error: str | None
    created_at: datetime
    failed_at: datetime
    payload: Any


def failed_events(conn: sa.Connection, *, limit: int = 100) -> list[FailedEvent]:
    """The rows set aside, oldest first."""
    rows = conn.execute(
        sa.select(T.id, T.event, T.attempts, T.last_error, T.created_at, T.failed_at, T.payload)
        .where(T.failed_at.is_not(None))
        .order_by(T.failed_at)
        .limit(limit)
    ).all()
    return [FailedEvent(*row) for row in rows]


@dataclass(frozen=True)
class ScheduledEvent:
    """A delayed outbox row not yet due."""

    id: uuid.UUID
    event: str
    created_at: datetime
    not_before: datetime


def scheduled_events(conn: sa.Connection, *, limit: int = 100) -> list[ScheduledEvent]:
    """The delayed rows not yet due, soonest first (never their payloads: those are the application's)."""
    now: Any = sa.func.now() if conn.dialect.name == "postgresql" else datetime.now(UTC).replace(tzinfo=None)
    rows = conn.execute(
        sa.select(T.id, T.event, T.created_at, T.not_before)
        # available_at starts at the due time and only moves later: the range the pending index serves.
        .where(T.published_at.is_(None), T.failed_at.is_(None), T.available_at > now, T.not_before > now)
        .order_by(T.available_at)
        .limit(limit)
    ).all()
    return [ScheduledEvent(*row) for row in rows]


def retry_failed(conn: sa.Connection, ids: Sequence[uuid.UUID | str] | None = None) -> int:
    """Make set-aside rows pending again (all of them when ``ids`` is None); returns how many."""
    query = sa.update(OUTBOX_EVENTS).where(T.failed_at.is_not(None))
    if ids is not None:
        query = query.where(T.id.in_([uuid.UUID(str(i)) for i in ids]))
    result = conn.execute(query.values(failed_at=None, attempts=0, last_error=None, available_at=sa.func.now()))
    return result.rowcount
