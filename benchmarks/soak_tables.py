"""The soak's score tables and versions, apart from the worker so the driver can read them without building a Kit."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()
#: One row per OrderPlaced envelope the ``audit`` listener applied, with how many times it was applied.
audit = sa.Table(
    "soak_audit",
    metadata,
    sa.Column("envelope_id", sa.String, primary_key=True),
    sa.Column("order_id", sa.BigInteger, nullable=False),
    sa.Column("runs", sa.Integer, nullable=False, server_default="1"),
)
#: One row per tick of each ``@every 1s`` entry (the job and the event), with how many times it ran.
ticks = sa.Table(
    "soak_ticks",
    metadata,
    sa.Column("entry", sa.String, primary_key=True),
    sa.Column("tick", sa.DateTime(timezone=True), primary_key=True),
    sa.Column("runs", sa.Integer, nullable=False, server_default="1"),
)
#: One row per ``soak.parcel`` envelope each of its listeners applied, with how many times (``--deploys``).
deliveries = sa.Table(
    "soak_deliveries",
    metadata,
    sa.Column("listener", sa.String, primary_key=True),
    sa.Column("envelope_id", sa.String, primary_key=True),
    sa.Column("order_id", sa.BigInteger, nullable=False),
    sa.Column("runs", sa.Integer, nullable=False, server_default="1"),
)

#: From this version on, ``soak.parcel`` has a ``weight_g`` field (the deploy that adds a field).
FIELD_ADDED_IN = 3


def parcel_listeners(version: int) -> list[str]:
    """The listeners of ``soak.parcel`` in ``version``: ``label`` always; deploy ``k`` adds ``l<k>`` and
    retires ``l<k-2>``."""
    return ["label", *[f"l{k}" for k in (version - 1, version) if k >= 1]]
