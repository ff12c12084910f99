"""The shop's tables."""

from __future__ import annotations

import sqlalchemy as sa

import dramatiq_gp as gp

metadata = sa.MetaData()

orders = sa.Table(
    "shop_orders",
    metadata,
    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("customer_email", sa.String(320), nullable=False),
    sa.Column("total_cents", sa.BigInteger, nullable=False),
    sa.Column("placed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
)

sent_emails = sa.Table(
    "shop_sent_emails",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
    # One mail per purpose: a listener that runs twice does not mail twice.
    sa.Column("dedup_key", sa.String(200), nullable=False, unique=True),
    sa.Column("recipient", sa.String(320), nullable=False),
    sa.Column("subject", sa.String(200), nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("sent_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
)

sales = sa.Table(
    "shop_sales",
    metadata,
    sa.Column("order_id", sa.BigInteger, primary_key=True),
    sa.Column("total_cents", sa.BigInteger, nullable=False),
    sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
)

# The outbox and the inbox live in the shop's own metadata, so one create_all (or Alembic) makes them.
outbox_events = gp.outbox.outbox_table(metadata)
inbox_messages = gp.outbox.inbox_table(metadata)
