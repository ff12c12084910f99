"""What an operator can do to a running system, from ``dramatiq-gp`` or the dashboard.

Requeue or purge dead letters, replay a set-aside outbox event, send a new listener
the events committed before it was live, pause or resume a schedule entry, run one
now or backfill the ticks of a past window, store or remove one at run time. Each
action is logged on ``dramatiq_gp.actions`` at INFO with who did it and where from
(``root (cli)``, ``alice (dashboard, 10.0.0.7)``), so the log says who changed
what, whichever way it was done.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

import redis
from dramatiq import Message

from . import keys
from .brokers.base import KitBroker
from .brokers.view import QueueView
from .scheduler import manual
from .scheduler.dynamic import Schedules, StoredEntry
from .telemetry import printable

#: Events sent per round trip by :func:`backfill_listener`.
BACKFILL_BATCH = 500

logger = logging.getLogger("dramatiq_gp.actions")


def _done(action: str, who: str, outcome: str) -> str:
    # Escaped: a newline in a name given by a request would otherwise write a line of its own.
    logger.info("%s by %s: %s", action, printable(who), printable(outcome))
    return outcome


def requeue_dead_letters(queues: QueueView, queue: str, ids: Sequence[str] | None, *, who: str) -> int:
    """Put the dead letters ``ids`` of ``queue`` (all of them when None) back on it; how many moved."""
    moved = queues.requeue(queue, ids)
    _done("dlq requeue", who, f"{moved} dead letter(s) of queue {queue} requeued")
    return moved


def purge_dead_letters(queues: QueueView, queue: str, *, who: str) -> int:
    """Delete every dead letter of ``queue``; how many there were."""
    purged = queues.purge(queue)
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


def backfill_listener(
    engine: Any, broker: KitBroker, task_type: str, since: datetime, until: datetime | None = None, *, who: str
) -> tuple[int, datetime | None]:
    """Send listener ``task_type`` its copy of every published outbox event of its event type committed
    from ``since`` (to ``until``) and still kept (``OUTBOX_RETENTION``).

    A fan-out reaches the listeners live when it runs; this gives a listener a deploy
    added the events before that. The copies carry the fan-out's message ids, so one
    the listener handled already (within ``WORKER_DEDUP_RETENTION``, or through its
    inbox) is skipped. Returns how many were sent, and when the oldest event of that
    type still kept was committed (``None`` when none is).

    Raises:
        ValueError: ``task_type`` is not ``listener:<event>:<name>``.
        LookupError: no live worker declares that listener (so its queue is unknown).
    """
    import sqlalchemy as sa

    from .names import fan_out_id
    from .outbox.table import OUTBOX_EVENTS

    kind, _, rest = task_type.partition(":")
    event, _, name = rest.partition(":")
    if kind != "listener" or not event or not name:
        raise ValueError(f"{task_type!r} is not a listener's task type (listener:<event>:<name>)")
    spec = broker.client.hget(keys.listeners(broker.namespace), task_type)
    if spec is None:
        raise LookupError(f"no live worker declares {task_type}: start a worker that has it first")
    queue = json.loads(spec)["queue"]
    rows = OUTBOX_EVENTS.c
    kept = sa.and_(rows.event == event, rows.published_at.is_not(None))
    window = sa.and_(kept, rows.created_at >= since, *([rows.created_at < until] if until is not None else []))
    sent, after = 0, None
    with engine.connect() as conn:
        oldest = conn.execute(sa.select(sa.func.min(rows.created_at)).where(kept)).scalar_one()
        while True:
            page = sa.select(rows.id, rows.created_at, rows.payload).where(window)
            if after is not None:
                page = page.where(sa.tuple_(rows.created_at, rows.id) > sa.tuple_(*after))
            batch = conn.execute(page.order_by(rows.created_at, rows.id).limit(BACKFILL_BATCH)).all()
            if not batch:
                break
            broker.enqueue_many(
                [
                    Message(
                        queue_name=queue,
                        actor_name=task_type,
                        kwargs={},
                        options={},
                        args=({"id": str(row.id), "event": event, "data": row.payload},),
                        message_id=fan_out_id(str(row.id), task_type),
                    )
                    for row in batch
                ]
            )
            sent += len(batch)
            after = (batch[-1].created_at, batch[-1].id)
    _done("outbox backfill", who, f"{sent} event(s) of {event} since {since.isoformat()} sent to {task_type}")
    return sent, oldest


def pause_entry(client: redis.Redis, scheduler: keys.SchedulerKeys, entry: str, *, who: str) -> bool:
    """Pause schedule entry ``entry`` (in code or stored): the leader passes over its ticks from the next;
    False if no such entry."""
    if not client.hexists(scheduler.entries, entry) and not client.hexists(scheduler.dynamic, entry):
        return False
    paused = {"by": who, "at": datetime.now(UTC).isoformat(timespec="seconds")}
    client.hset(scheduler.paused, entry, json.dumps(paused))
    _done("schedule pause", who, f"entry {entry} paused")
    return True


def add_entry(schedules: Schedules, name: str, when: Any, target: Any, *, who: str, **options: Any) -> StoredEntry:
    """Store the schedule entry ``name`` (see :meth:`Schedules.add <dramatiq_gp.Schedules.add>`); as stored.

    Raises:
        ScheduleError: the entry is refused; the message names it and why.
    """
    outcome = schedules.add(name, when, target, **options)
    entry = schedules.get(name)
    assert entry is not None
    # In full, whatever the PII setting: what an entry runs, and with what, is what the audit is for.
    if entry.kind == "event":
        call = f"data {json.dumps(entry.data)}"
    else:
        call = f"args {json.dumps(entry.data['args'])}, kwargs {json.dumps(entry.data['kwargs'])}"
    _done(
        "schedule add",
        who,
        f"entry {name} {outcome}: {entry.trigger} ({entry.zone}), {entry.kind} {entry.target} on queue {entry.queue}, "
        f"{call}, options {json.dumps(dict(entry.options))}",
    )
    return entry


def remove_entry(schedules: Schedules, name: str, *, who: str) -> bool:
    """Remove the stored schedule entry ``name``; False if there is none."""
    if not schedules.remove(name):
        return False
    _done("schedule remove", who, f"entry {name} removed")
    return True


def resume_entry(client: redis.Redis, scheduler: keys.SchedulerKeys, entry: str, *, who: str) -> bool:
    """Let a paused entry fire again from its next tick; False if it was not paused."""
    if not client.hdel(scheduler.paused, entry):
        return False
    _done("schedule resume", who, f"entry {entry} resumed")
    return True


class Run(NamedTuple):
    """A run of a schedule entry asked for by hand: its message id, its queue, and whether the entry is paused."""

    message_id: str
    queue: str
    paused: bool


def run_entry(broker: KitBroker, scheduler: keys.SchedulerKeys, entry: str, *, who: str) -> Run | None:
    """Enqueue one run of schedule entry ``entry`` now, with an id of its own; ``None`` if no such entry.

    A paused entry runs all the same (it was asked for by name); its ticks go on being passed over.

    Raises:
        ScheduleError: the entry's template cannot be had (its workers predate it, or it is unreadable).
    """
    template = manual.template(broker.client, scheduler, entry)
    if template is None:
        return None
    message = manual.run_message(template)
    broker.enqueue(message)
    paused = manual.is_paused(broker.client, scheduler, entry)
    note = " (paused: run all the same)" if paused else ""
    _done("schedule run", who, f"entry {entry} run now as message {message.message_id}{note}")
    return Run(message.message_id, template.queue, paused)


def backfill_entry(
    broker: KitBroker,
    scheduler: keys.SchedulerKeys,
    template: manual.Template,
    ticks: Sequence[datetime],
    *,
    keep_ms: int,
    who: str,
) -> tuple[int, int]:
    """Enqueue the ``ticks`` of ``template``'s entry, each under its tick's message id, unless claimed already.

    Each is claimed first on the leader's own claim key, so a tick the leader, another
    backfill or a repeat of this one enqueues is not enqueued again; a claim is kept
    ``keep_ms`` once its message is sent, and given up if the send fails. Returns how
    many were enqueued, and how many were claimed by someone else meanwhile.
    """
    name, client = template.name, broker.client
    token = f"backfill/{uuid.uuid4()}"
    claimed = manual.claim_ticks(client, scheduler, name, ticks, token)
    mine = [tick for tick, ours in zip(ticks, claimed, strict=True) if ours]
    try:
        if mine:
            broker.enqueue_many([manual.tick_message(template, tick) for tick in mine])
    except BaseException:
        manual.settle_claims(client, scheduler, name, mine, token, 0)
        raise
    manual.settle_claims(client, scheduler, name, mine, token, keep_ms)
    taken = len(ticks) - len(mine)
    window = f"from {ticks[0].isoformat()} to {ticks[-1].isoformat()}" if ticks else "(no tick)"
    meanwhile = f", {taken} claimed meanwhile" if taken else ""
    _done("schedule backfill", who, f"{len(mine)} tick(s) of entry {name} {window} enqueued{meanwhile}")
    return len(mine), taken
