"""The transactional outbox and inbox: events written in the application's transaction, relayed
after commit; message ids written in the handler's transaction, so an effect is applied once.

* :func:`dramatiq_gp.dispatch(session_or_connection, event) <dramatiq_gp.dispatch>`
  writes the event as a row in the caller's transaction;
* :class:`Relay` (one per worker process, started by the Kit) moves committed
  rows to the queue;
* :func:`outbox_table` puts the table in your own metadata for Alembic, and
  :func:`migrate` (``dramatiq-gp migrate up``) creates it for everyone else;
* :func:`inbox_table` is the inbox's table (:func:`migrate` creates it too), and
  :func:`prune_inbox` deletes its expired rows, a batch at a time (the relays do).
"""

from .admin import FailedEvent, ScheduledEvent, failed_events, retry_failed, scheduled_events
from .inbox import prune as prune_inbox
from .relay import Relay
from .table import CHANNEL, INBOX, INBOX_TABLE_NAME, OUTBOX_EVENTS, TABLE_NAME, inbox_table, migrate, outbox_table
from .write import set_notify, write, write_async

__all__ = [
    "CHANNEL",
    "INBOX",
    "INBOX_TABLE_NAME",
    "OUTBOX_EVENTS",
    "TABLE_NAME",
    "FailedEvent",
    "Relay",
    "ScheduledEvent",
    "failed_events",
    "inbox_table",
    "migrate",
    "outbox_table",
    "prune_inbox",
    "retry_failed",
    "scheduled_events",
    "set_notify",
    "write",
    "write_async",
]
