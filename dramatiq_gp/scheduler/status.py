"""What ``dramatiq-gp status`` and the dashboard show of the scheduler, read from Redis only.

Each worker with a schedule publishes its entries (and APScheduler triggers' next fires),
so nothing here needs the application's code.
"""

from __future__ import annotations

import json
import operator
import reprlib
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import redis

from .. import keys
from ..records import field, json_object, moment, seconds, string, text, unreadable
from .cron import CronError, parse

#: How many next fires each entry shows.
NEXT_FIRES = 3


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
            "host": field(info, "host", str),
            "pid": field(info, "pid", int),
            "epoch": field(info, "epoch", int),
            "expires_at": (now + timedelta(milliseconds=ttl_ms)).isoformat(),
        }
    code = sorted(client.hgetall(scheduler.entries).items(), key=lambda item: text(item[0]))
    names = [key for key, _ in code]
    last: dict[Any, Any] = {}
    published: dict[Any, Any] = {}
    paused: dict[Any, Any] = {}
    if names:  # only the code entries' fields: these hashes hold the stored entries' too, which may be 100,000
        with client.pipeline(transaction=False) as pipe:
            for fields in (scheduler.last_fired, scheduler.upcoming, scheduler.paused):
                pipe.hmget(fields, names)
            last, published, paused = (dict(zip(names, values, strict=True)) for values in pipe.execute())
    entries = []
    for key, trigger_zone in code:
        name = text(key)
        trigger, _, zone = text(trigger_zone).rpartition("|")
        last_ms = moment(text(last[key]), "last_fired") if last.get(key) is not None else None
        try:
            where = ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError):
            # Published by a worker whose tz database knows it (another namespace, another image): the
            # entry still shows, in UTC, and says so.
            where, zone = ZoneInfo("UTC"), f"{zone} (unknown here: times in UTC)"
        fires = _next_fires(trigger, where, published.get(key), now, NEXT_FIRES)
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
                "paused": paused_by(paused[key]) if paused.get(key) is not None else None,
            }
        )
    catchup = client.get(scheduler.catchup)
    return {
        "namespace": scheduler.namespace,
        "leader": leader,
        "entries": entries,
        "stored": _stored(client, scheduler),
        "catchup": _catchup(catchup) if catchup is not None else None,
    }


def _stored(client: redis.Redis, scheduler: keys.SchedulerKeys) -> dict[str, Any]:
    """How many entries are stored at run time, and the next few to fire (not the whole set: it may hold 100,000)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.hlen(scheduler.dynamic)
        pipe.zrange(scheduler.due, 0, NEXT_FIRES - 1, withscores=True)
        count, heads = pipe.execute()
    return {
        "count": count,
        "next_ms": [int(ms) for _, ms in heads],
        "next": [
            {"name": text(name), "next_fire": datetime.fromtimestamp(ms / 1000, UTC).isoformat()} for name, ms in heads
        ],
    }


def paused_by(raw: bytes | str) -> dict[str, Any] | str:
    """Who paused an entry and when; the mark of what cannot be read of it (the entry is paused all the same:
    the leader asks whether it is in the hash, not what it holds)."""
    recorded = json_object(raw)
    if isinstance(recorded, str):
        return recorded
    return {"by": field(recorded, "by", string), "at": field(recorded, "at", string)}


def _catchup(raw: bytes | str) -> dict[str, Any] | str:
    """The catch-up policy the workers published, each field of another type marked."""
    recorded = json_object(raw)
    if isinstance(recorded, str):
        return recorded
    catchup = {
        "policy": field(recorded, "policy", string),
        "grace_s": field(recorded, "grace_s", seconds),
        "max": field(recorded, "max", operator.index),
    }
    if "misfire_threshold_s" in recorded:  # workers before SCHEDULER_MISFIRE_THRESHOLD did not write it
        catchup["misfire_threshold_s"] = field(recorded, "misfire_threshold_s", seconds)
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
