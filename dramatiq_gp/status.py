"""What an operator asks first, read from Redis and PostgreSQL only (``dramatiq-gp status``).

Nothing here writes: it is safe against production. The schedule's entries are
read from Redis, where each worker with a schedule publishes them, so the
command needs no application code.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import redis

from . import keys
from .records import readable, text, unreadable


def _name(value: bytes | str) -> str:
    """A queue's name as Redis holds it; one not UTF-8 keeps its bytes, as surrogates, for :func:`queue_counts`."""
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else value


def recorded_queues(client: redis.Redis, namespace: str) -> list[str]:
    """The queues the workers recorded (``<ns>:gp:queues``), sorted, as :func:`queue_counts` takes them."""
    return sorted(_name(name) for name in client.smembers(keys.declared_queues(namespace)))


def queue_status(client: redis.Redis, namespace: str) -> list[dict[str, Any]]:
    """Per queue the workers recorded (as the dashboard reads them) or found by scanning the keyspace: its counts.

    An empty queue has no keys to find; the recorded set still names it.
    """
    names = set(recorded_queues(client, namespace))
    for key in client.scan_iter(keys.all_messages(namespace), count=1000):
        name = _name(key)[len(namespace) + 1 : -len(keys.MESSAGES)]
        names.add(name.removesuffix(".DQ").removesuffix(".XQ"))
    for key in client.scan_iter(keys.all_dead(namespace), count=1000):
        names.add(_name(key)[len(namespace) + 1 : -len(".XQ")])
    return queue_counts(client, namespace, sorted(n for n in names if not n.startswith("__")))


def queue_counts(client: redis.Redis, namespace: str, names: list[str]) -> list[dict[str, Any]]:
    """Per queue of ``names``: messages ready, in flight (fetched, not yet acked), delayed and dead-lettered.

    Four O(1) commands per queue, all in one round trip. A name that is not UTF-8 is
    marked, and not counted: no Dramatiq queue has one (its names are ASCII), so
    something else wrote it.
    """
    garbled = {name: _garbled(name) for name in names}
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            if not garbled[name]:
                pipe.llen(keys.queue(namespace, name))
                pipe.hlen(keys.messages(namespace, name))
                pipe.hlen(keys.delay_messages(namespace, name))
                pipe.zcard(keys.dead(namespace, name))
        counts = iter(pipe.execute())
    queues = []
    for name in names:
        if garbled[name]:
            queues.append({"name": garbled[name], "ready": None, "in_flight": None, "delayed": None, "dead": None})
            continue
        ready, stored, delayed, dead = (next(counts) for _ in range(4))
        queues.append(
            {"name": name, "ready": ready, "in_flight": max(stored - ready, 0), "delayed": delayed, "dead": dead}
        )
    return queues


def _garbled(name: str) -> str:
    """The mark of a queue name that is not UTF-8 (see :func:`_name`), or ""."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return unreadable(f"name not UTF-8: {name.encode(errors='surrogateescape')!r}")
    return ""


#: A send to a queue unconfirmed this recently makes its counts unknown (a minute: the outbox relay and
#: a retried task try again well within it; a record left by a process since gone ages out).
UNCONFIRMED_RECENT_MS = 60_000
#: A worker process's record of what it holds is counted if its heartbeat is this recent.
HELD_RECENT_MS = 15_000


def rabbitmq_queue_status(urls: list[str], client: redis.Redis, namespace: str) -> list[dict[str, Any]]:
    """Per queue the kit declared on RabbitMQ: messages ready, in flight, delayed and dead-lettered, and consumers.

    AMQP tells only what waits on a queue; what the live worker processes hold
    (running, prefetched, or delayed and waiting in their memory until due) comes
    from the records their heartbeats write, and is added. A queue a send went
    unconfirmed to in the last minute has likely lost its quorum: RabbitMQ's
    counts for it are then stale or 0, so it is given as unknown (``None``), with
    ``unknown`` saying why.
    """
    import pika
    import pika.exceptions
    from dramatiq.common import dq_name, q_name, xq_name

    now = int(datetime.now(UTC).timestamp() * 1000)
    with client.pipeline(transaction=False) as pipe:
        pipe.smembers(keys.declared_queues(namespace))
        pipe.hgetall(keys.unconfirmed(namespace))
        pipe.zrangebyscore(keys.heartbeats(namespace), now - HELD_RECENT_MS, "+inf")
        declared, unconfirmed, live = pipe.execute()
    with client.pipeline(transaction=False) as pipe:
        for broker_id in live:
            pipe.hgetall(keys.held(namespace, text(broker_id)))
        records = pipe.execute()
    held: dict[str, int] = {}
    for record in records:
        for queue, n in record.items():
            if text(n).isdigit():
                held[text(queue)] = held.get(text(queue), 0) + int(n)
    since: dict[str, int] = {}
    for queue, at in unconfirmed.items():
        if text(at).isdigit() and int(at) >= now - UNCONFIRMED_RECENT_MS:
            family = q_name(text(queue))
            since[family] = max(since.get(family, 0), int(at))
    names = sorted(text(n) for n in declared)
    connection = pika.BlockingConnection([pika.URLParameters(url) for url in urls])
    try:
        channel = connection.channel()
        queues = []
        for name in names:
            counts = []
            for queue in (name, dq_name(name), xq_name(name)):
                try:
                    counts.append(channel.queue_declare(queue, passive=True).method)
                except pika.exceptions.ChannelClosedByBroker:  # deleted since: its channel is closed
                    channel = connection.channel()
                    counts.append(None)
            if counts[0] is None:
                continue
            ready, delayed, dead = (c.message_count if c is not None else 0 for c in counts)
            row = {
                "name": name,
                "ready": ready,
                "in_flight": held.get(name, 0),
                "delayed": delayed + held.get(dq_name(name), 0),
                "dead": dead,
                "consumers": counts[0].consumer_count,
                "unknown": None,
            }
            if name in since:
                at = datetime.fromtimestamp(since[name] / 1000, UTC).isoformat(timespec="seconds")
                row.update(
                    ready=None,
                    delayed=None,
                    dead=None,
                    unknown=f"a send to it went unconfirmed at {at}: its quorum is likely lost",
                )
            queues.append(row)
        return queues
    finally:
        connection.close()


def skipped_status(client: redis.Redis, namespace: str) -> dict[str, int | str]:
    """Per task type, the messages skipped for want of a handler (in the dead-letter sets, last 7 days).

    A task type that is not UTF-8, or a count that is not a whole number, is marked (no worker wrote it).
    """
    skipped = {}
    for task_type, count in client.hgetall(keys.skipped(namespace)).items():
        name = _name(task_type)
        skipped[_garbled(name) or name] = readable(text(count), "count", int)
    return dict(sorted(skipped.items()))


def outbox_status(engine: Any) -> dict[str, Any]:
    """Pending rows, the age of the oldest, and rows set aside."""
    from .outbox.admin import backlog, set_aside_count

    pending, age = backlog(engine)
    return {
        "pending": pending,
        "oldest_pending_age_s": round(age, 3) if age is not None else None,
        "set_aside": set_aside_count(engine),
    }
