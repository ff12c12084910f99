"""What an operator asks first, read from Redis and PostgreSQL only (``dramatiq-gp status``).

Nothing here writes: it is safe against production. The schedule's entries are
read from Redis, where each worker with a schedule publishes them, so the
command needs no application code.
"""

from __future__ import annotations

import json
import operator
import reprlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import redis

from . import keys
from .scheduler.cron import CronError, parse

#: How many next fires each entry shows.
NEXT_FIRES = 3


def text(value: Any) -> str:
    """A Redis reply as text."""
    # Bytes no worker wrote (not UTF-8) show escaped, rather than fail the report.
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else str(value)


#: How every mark of :func:`unreadable` starts.
MARK = "(unreadable: "


def unreadable(reason: str) -> str:
    """What shows in place of a record or field that cannot be read, so that the rest around it still shows."""
    return f"{MARK}{reason})"


def json_object(raw: bytes | str) -> dict[str, Any] | str:
    """The JSON object a worker wrote, or the mark in its place (written by hand, by another version)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return unreadable("not JSON")
    return value if isinstance(value, dict) else unreadable("not a JSON object")


def moment(ms: Any, label: str) -> int | str:
    """``ms``, a time in ms since the epoch, as a whole number; its mark when it is no time a page can show
    (``'abc'``, ``inf``, past the year 9999)."""
    try:
        datetime.fromtimestamp(int(ms) / 1000, UTC)
    except (TypeError, ValueError, OverflowError, OSError):
        return unreadable(f"{label}={reprlib.repr(ms)}")
    return int(ms)


def _read(value: Any, label: str, read: Callable[[Any], Any]) -> Any:
    """``value`` as ``read`` reads it, or the mark in its place: of another type (written by hand, by another
    version)."""
    try:
        return read(value)
    except (TypeError, ValueError, OverflowError):
        return unreadable(f"{label}={reprlib.repr(value)}")


def _field(record: dict[str, Any], name: str, read: Callable[[Any], Any]) -> Any:
    """``record[name]`` as ``read`` reads it, or the mark in its place: missing, or of another type."""
    return _read(record[name], name, read) if name in record else unreadable(f"no {name}")


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(value)
    return value


def _seconds(value: Any) -> Any:
    timedelta(seconds=value)  # what the page makes of it: raises for a string, inf, NaN, 1e300
    return value


def _name(value: bytes | str) -> str:
    """A queue's name as Redis holds it; one not UTF-8 keeps its bytes, as surrogates, for :func:`queue_counts`."""
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else value


def recorded_queues(client: redis.Redis, namespace: str) -> list[str]:
    """The queues the workers recorded (``<ns>:gp:queues``), sorted, as :func:`queue_counts` takes them."""
    return sorted(_name(name) for name in client.smembers(keys.declared_queues(namespace)))


def scheduler_status(client: redis.Redis, scheduler: keys.SchedulerKeys, now: datetime | None = None) -> dict[str, Any]:
    """The leader (host, pid, epoch, lease expiry) and each published entry's next and last fire.

    What cannot be read (written by hand, by another version) is marked in its place, and the rest still shows.
    """
    now = now or datetime.now(UTC)
    info = {text(k): text(v) for k, v in client.hgetall(scheduler.leader).items()}
    ttl_ms = client.pttl(scheduler.lease)
    leader = None
    if info and ttl_ms > 0:
        leader = {
            "host": _field(info, "host", str),
            "pid": _field(info, "pid", int),
            "epoch": _field(info, "epoch", int),
            "expires_at": (now + timedelta(milliseconds=ttl_ms)).isoformat(),
        }
    last = {text(k): moment(text(v), "last_fired") for k, v in client.hgetall(scheduler.last_fired).items()}
    published = {text(k): v for k, v in client.hgetall(scheduler.upcoming).items()}
    paused = {text(k): _paused(v) for k, v in client.hgetall(scheduler.paused).items()}
    entries = []
    for name, trigger_zone in sorted((text(k), text(v)) for k, v in client.hgetall(scheduler.entries).items()):
        trigger, _, zone = trigger_zone.rpartition("|")
        last_ms = last.get(name)
        try:
            where = ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError):
            # Published by a worker whose tz database knows it (another namespace, another image): the
            # entry still shows, in UTC, and says so.
            where, zone = ZoneInfo("UTC"), f"{zone} (unknown here: times in UTC)"
        fires = _next_fires(trigger, where, published.get(name), now, NEXT_FIRES)
        # Every time of an entry in its own zone; the last fired is None until it first fires.
        entries.append(
            {
                "name": name,
                "trigger": trigger,
                "zone": zone,
                "next_fire": fires[0] if fires else None,
                "next_fires": fires,
                "last_fired": datetime.fromtimestamp(last_ms / 1000, where).isoformat()
                if isinstance(last_ms, int)
                else last_ms,
                "paused": paused.get(name),
            }
        )
    catchup = client.get(scheduler.catchup)
    return {
        "namespace": scheduler.namespace,
        "leader": leader,
        "entries": entries,
        "catchup": _catchup(catchup) if catchup is not None else None,
    }


def _paused(raw: bytes | str) -> dict[str, Any] | str:
    """Who paused an entry and when; the mark of what cannot be read of it (the entry is paused all the same:
    the leader asks whether it is in the hash, not what it holds)."""
    recorded = json_object(raw)
    if isinstance(recorded, str):
        return recorded
    return {"by": _field(recorded, "by", _string), "at": _field(recorded, "at", _string)}


def _catchup(raw: bytes | str) -> dict[str, Any] | str:
    """The catch-up policy the workers published, each field of another type marked."""
    recorded = json_object(raw)
    if isinstance(recorded, str):
        return recorded
    catchup = {
        "policy": _field(recorded, "policy", _string),
        "grace_s": _field(recorded, "grace_s", _seconds),
        "max": _field(recorded, "max", operator.index),
    }
    if "misfire_threshold_s" in recorded:  # workers before SCHEDULER_MISFIRE_THRESHOLD did not write it
        catchup["misfire_threshold_s"] = _field(recorded, "misfire_threshold_s", _seconds)
    return catchup


def _next_fires(trigger: str, zone: ZoneInfo, published: bytes | str | None, now: datetime, count: int) -> list[str]:
    """A cron string's next fires, computed here; another trigger's, as the workers published them (or their mark)."""
    try:
        spec = parse(trigger)
    except CronError:
        try:
            times = [datetime.fromisoformat(at) for at in json.loads(published or "[]")]
            return [at.astimezone(zone).isoformat() for at in times if at > now][:count]
        except (ValueError, TypeError, OverflowError, RecursionError):
            return [unreadable(f"upcoming={reprlib.repr(text(published))}")]
    fires = [spec.next_after(now, zone)]
    while len(fires) < count:
        fires.append(spec.next_after(fires[-1], zone))
    return [at.astimezone(zone).isoformat() for at in fires]


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
        skipped[_garbled(name) or name] = _read(text(count), "count", int)
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
