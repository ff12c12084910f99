"""The ``outbox_events`` and ``inbox_messages`` tables, and the migration that creates them.

A row of the outbox is *pending* while ``published_at`` and ``failed_at`` are
both null; the relay claims pending rows whose ``available_at`` has come, oldest
first, through a partial index that holds only pending rows, so the index stays
small however many published rows wait for their retention to end.

A delayed event (``dispatch(..., delay=)`` or ``at=``) is a pending row whose
``available_at`` starts at its due time, which ``not_before`` keeps: the same
index serves the claim, which skips it until then, and the relays' "when is the
next row due" (its smallest key). ``available_at`` alone could not say which
rows are scheduled, as retry backoff moves it too, nor since when a due row is
late. ``not_before`` is null for every event dispatched without a delay.

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
        # The due time of a delayed event (null: at commit); added after the first release, see :func:`migrate`.
        sa.Column("not_before", sa.DateTime(timezone=True)),
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


#: Columns added to a table after its first release: :func:`migrate` adds them to a table created before.
ADDED_COLUMNS = {TABLE_NAME: ("not_before",)}


def migrate(bind: sa.Engine | sa.Connection) -> None:
    """Create the outbox and inbox tables, their indexes and later columns where missing; safe to run again."""
    if isinstance(bind, sa.Engine):
        with bind.begin() as conn:
            migrate(conn)
        return
    _METADATA.create_all(bind, checkfirst=True)
    for table, name in missing_columns(bind):
        column = _METADATA.tables[table].c[name]
        kind = column.type.compile(dialect=bind.dialect)
        # Two migrations racing: the second finds the column there (SQLite serialises them anyway).
        guard = " IF NOT EXISTS" if bind.dialect.name == "postgresql" else ""
        bind.execute(sa.text(f"ALTER TABLE {table} ADD COLUMN{guard} {name} {kind}"))


def outbox_problem(bind: sa.Engine | sa.Connection) -> str | None:
    """What keeps the kit from using the outbox table as it is, in one line ending in the fix; ``None`` if nothing."""
    if not sa.inspect(bind).has_table(TABLE_NAME):
        return f"outbox table {TABLE_NAME!r} is missing: run `dramatiq-gp migrate up`"
    missing = [name for table, name in missing_columns(bind) if table == TABLE_NAME]
    if missing:
        return (
            f"outbox table {TABLE_NAME!r} predates column(s) {', '.join(missing)} (delayed events): "
            "run `dramatiq-gp migrate up`"
        )
    return None


def missing_columns(bind: sa.Engine | sa.Connection) -> list[tuple[str, str]]:
    """The ``(table, column)`` of :data:`ADDED_COLUMNS` a present table lacks: ``dramatiq-gp migrate up`` adds them."""
    inspector = sa.inspect(bind)
    missing = []
    for table, names in ADDED_COLUMNS.items():
        if inspector.has_table(table):
            present = {column["name"] for column in inspector.get_columns(table)}
            missing += [(table, name) for name in names if name not in present]
    return missing
