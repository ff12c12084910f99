"""The transactional outbox: events written in the application's transaction, relayed after commit.

* :func:`dramatiq_gp.dispatch(session_or_connection, event) <dramatiq_gp.dispatch>`
  writes the event as a row in the caller's transaction;
* :class:`Relay` (one per worker process, started by the Kit) moves committed
  rows to the queue;
* :func:`outbox_table` puts the table in your own metadata for Alembic, and
  :func:`migrate` (``dramatiq-gp migrate up``) creates it for everyone else.
"""

from .admin import FailedEvent, failed_events, retry_failed
from .relay import Relay
from .table import CHANNEL, OUTBOX_EVENTS, TABLE_NAME, migrate, outbox_table
from .write import set_notify, write

__all__ = [
    "CHANNEL",
    "OUTBOX_EVENTS",
    "TABLE_NAME",
    "FailedEvent",
    "Relay",
    "failed_events",
    "migrate",
    "outbox_table",
    "retry_failed",
    "set_notify",
    "write",
]
