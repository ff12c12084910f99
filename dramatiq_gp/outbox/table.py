"""The ``outbox_events`` and ``inbox_messages`` tables, and the migration that creates them.

A row of the outbox is *pending* while ``published_at`` and ``failed_at`` are
both null; the relay claims pending rows whose ``available_at`` has come, oldest
first, through a partial index that holds only pending rows, so the index stays
small however many published rows wait for their retention to end.

A row of the inbox is a message whose effect committed: it is written in the
same transaction as the effect (:mod:`dramatiq_gp.outbox.inbox`), so a copy of
the message that arrives later finds it and is skipped. Its primary key is the
message id alone: the kit's message ids already differ per listener and per job
(:mod:`dramatiq_gp.names`). Rows are deleted once their retention ends, oldest
first, through the index on ``processed_at``.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

TABLE_NAME = "outbox_events"
INBOX_TABLE_NAME = "inbox_messages"
#: The channel the relays LISTEN on and dispatch NOTIFYs.
CHANNEL = "outbox_events"

_JSON = sa.JSON().with_variant(JSONB(), "postgresql")
_PENDING = "published_at IS NULL AND failed_at IS NULL"


def outbox_table(metadata: sa.MetaData, *, schema: str | None = None) -> sa.Table:
    """Add the outbox table to ``metadata`` (for Alembic autogenerate) and return it."""
    return sa.Table(
        TABLE_NAME,
        metadata,
        # The event (envelope) id: the relay enqueues the row under this message id.
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("event", sa.String(200), nullable=False),
        sa.Column("payload", _JSON, nullable=False),
        # W3C traceparent/tracestate of the dispatching code.
        sa.Column("trace_context", sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("available_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("published_at", sa.DateTime(timezone=True)),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text),
        # Set aside after too many failed attempts; listed and re-queued by hand.
        sa.Column("failed_at", sa.DateTime(timezone=True)),
        sa.Index(
            f"{TABLE_NAME}_pending",
            "available_at",
            postgresql_where=sa.text(_PENDING),
            sqlite_where=sa.text(_PENDING),
        ),
        sa.Index(f"{TABLE_NAME}_published", "published_at", postgresql_where=sa.text("published_at IS NOT NULL")),
        sa.Index(f"{TABLE_NAME}_failed", "failed_at", postgresql_where=sa.text("failed_at IS NOT NULL")),
        schema=schema,
        # Rows are inserted, updated once and deleted: vacuum early rather than bloat.
        postgresql_with={"autovacuum_vacuum_scale_factor": 0.02, "autovacuum_analyze_scale_factor": 0.02},
    )


def inbox_table(metadata: sa.MetaData, *, schema: str | None = None) -> sa.Table:
    """Add the inbox table to ``metadata`` (for Alembic autogenerate) and return it."""
    return sa.Table(
        INBOX_TABLE_NAME,
        metadata,
        # The message id (a listener's copy of an event, a job's firing): the key a redelivery finds.
        sa.Column("message_id", sa.String(200), primary_key=True),
        # Its task type, ``listener:<event>:<name>`` or ``job:<name>``: for people reading the table.
        sa.Column("task_type", sa.String(300), nullable=False),
        # The event's envelope id, where there is one (the key of an effect applied by hand).
        sa.Column("envelope_id", sa.String(200)),
        sa.Column("processed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Index(f"{INBOX_TABLE_NAME}_processed_at", "processed_at"),
        schema=schema,
        # Inserted once, deleted once: vacuum early rather than bloat.
        postgresql_with={"autovacuum_vacuum_scale_factor": 0.02, "autovacuum_analyze_scale_factor": 0.02},
    )


_METADATA = sa.MetaData()
#: The tables the kit itself reads and writes.
OUTBOX_EVENTS = outbox_table(_METADATA)
INBOX = inbox_table(_METADATA)


def migrate(bind: sa.Engine | sa.Connection) -> None:
    """Create the outbox and inbox tables and their indexes where they are missing; safe to run again."""
    _METADATA.create_all(bind, checkfirst=True)
