"""What an operator can do to a running system, from ``dramatiq-gp`` or the dashboard.

Requeue or purge dead letters, replay a set-aside outbox event, pause or resume a
schedule entry. Each action is logged on ``dramatiq_gp.actions`` at INFO with who
did it and where from (``root (cli)``, ``alice (dashboard, 10.0.0.7)``), so the
log says who changed what, whichever way it was done.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import redis

from . import deadletters, keys

logger = logging.getLogger("dramatiq_gp.actions")


def _done(action: str, who: str, outcome: str) -> str:
    logger.info("%s by %s: %s", action, who, outcome)
    return outcome


def requeue_dead_letters(
    client: redis.Redis, namespace: str, queue: str, ids: Sequence[str] | None, *, who: str
) -> int:
    """Put the dead letters ``ids`` of ``queue`` (all of them when None) back on it; how many moved."""
    moved = deadletters.requeue(client, namespace, queue, ids)
    _done("dlq requeue", who, f"{moved} dead letter(s) of queue {queue} requeued")
    return moved


def purge_dead_letters(client: redis.Redis, namespace: str, queue: str, *, who: str) -> int:
    """Delete every dead letter of ``queue``; how many there were."""
    purged = deadletters.purge(client, namespace, queue)
    _done("dlq purge", who, f"{purged} dead letter(s) of queue {queue} deleted")
    return purged


def replay_event(engine: Any, event_id: str, *, who: str) -> bool:
    """Make the set-aside outbox event ``event_id`` pending again; False if there is no such event.

    Raises:
        ValueError: ``event_id`` is not a UUID.
    """
    from .outbox import retry_failed

    uuid.UUID(event_id)
    with engine.begin() as conn:
        if not retry_failed(conn, [event_id]):
            return False
    _done("outbox replay", who, f"event {event_id} pending again")
    return True


def pause_entry(client: redis.Redis, scheduler: keys.SchedulerKeys, entry: str, *, who: str) -> bool:
    """Pause schedule entry ``entry``: the leader passes over its ticks from the next; False if no such entry."""
    if not client.hexists(scheduler.entries, entry):
        return False
    paused = {"by": who, "at": datetime.now(UTC).isoformat(timespec="seconds")}
    client.hset(scheduler.paused, entry, json.dumps(paused))
    _done("schedule pause", who, f"entry {entry} paused")
    return True


def resume_entry(client: redis.Redis, scheduler: keys.SchedulerKeys, entry: str, *, who: str) -> bool:
    """Let a paused entry fire again from its next tick; False if it was not paused."""
    if not client.hdel(scheduler.paused, entry):
        return False
    _done("schedule resume", who, f"entry {entry} resumed")
    return True
