"""What ``dramatiq-gp status`` and the dashboard show beside the queues and the schedule: the task types
skipped for want of a handler, and the outbox's backlog.

Nothing here writes: it is safe against production. The queues are the broker's view's
(:mod:`dramatiq_gp.brokers.view`), the schedule is :mod:`dramatiq_gp.scheduler.status`'s.
"""

from __future__ import annotations

from typing import Any

import redis

from . import keys
from .records import garbled, raw_name, readable, text

#: A worker process whose last heartbeat is older than this is gone (Dramatiq's default heartbeat timeout).
LIVE_MS = 60_000


def skipped_status(client: redis.Redis, namespace: str) -> dict[str, int | str]:
    """Per task type, the messages skipped for want of a handler (in the dead-letter sets, last 7 days).

    A task type that is not UTF-8, or a count that is not a whole number, is marked (no worker wrote it).
    """
    skipped = {}
    for task_type, count in client.hgetall(keys.skipped(namespace)).items():
        name = raw_name(task_type)
        skipped[garbled(name) or name] = readable(text(count), "count", int)
    return dict(sorted(skipped.items()))


def outbox_status(engine: Any) -> dict[str, Any]:
    """Due rows not yet relayed, how long the oldest of them has been due, delayed rows not yet due
    (``scheduled``: no lag), and rows set aside."""
    from .outbox.admin import backlog, set_aside_count

    pending, age, scheduled = backlog(engine)
    return {
        "pending": pending,
        "oldest_pending_age_s": round(age, 3) if age is not None else None,
        "scheduled": scheduled,
        "set_aside": set_aside_count(engine),
    }
