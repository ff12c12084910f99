"""The soak's score tables, apart from the worker so the driver can read them without building a Kit."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()
#: One row per OrderPlaced envelope the ``audit`` listener applied, with how many times it was applied.
audit = sa.Table(
    "soak_audit", metadata,
    sa.Column("envelope_id", sa.String, primary_key=True),
    sa.Column("order_id", sa.BigInteger, nullable=False),
    sa.Column("runs", sa.Integer, nullable=False, server_default="1"),
)  # fmt: skip
#: One row per tick of each ``@every 1s`` entry (the job and the event), with how many times it ran.
ticks = sa.Table(
    "soak_ticks", metadata,
    sa.Column("entry", sa.String, primary_key=True),
    sa.Column("tick", sa.DateTime(timezone=True), primary_key=True),
    sa.Column("runs", sa.Integer, nullable=False, server_default="1"),
)  # fmt: skip
