"""The operator's view of queues in Redis/Valkey (:class:`~dramatiq_gp.brokers.view.QueueView`).

A queue is Dramatiq's layout under the namespace (:mod:`dramatiq_gp.keys`); its dead
letters are ``<ns>:<queue>.XQ``, a sorted set of Redis message ids scored by when
each died, and ``<ns>:<queue>.XQ.msgs``, their messages; beside them the kit keeps
``<ns>:<queue>.XQ.why``, the reason of each it set aside as it came. Every read of them is
bounded by the page asked for (``ZREVRANGE`` and ``HMGET``), never by how many
there are, so a queue with 100,000 dead letters pages as fast as one with ten. Only
finding one by its message id rather than its Redis id reads them all (a page at a
time).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis

from .. import keys
from ..lua import scripts
from ..records import garbled, moment, raw_name, text, unreadable
from .view import DeadLetter, QueueView, letter, ready_at

_SCRIPTS = scripts(__file__)

#: Dead letters moved per Lua call when a whole queue's are requeued.
REQUEUE_BATCH = 1000


class RedisQueueView(QueueView):
    """Queues in the Redis/Valkey ``client``, under ``namespace``."""

    server = "Redis/Valkey"
    unreachable = (redis.RedisError,)

    def __init__(self, client: redis.Redis, namespace: str, where: str = "") -> None:
        super().__init__(where or f"namespace {namespace}")
        self.client, self.namespace = client, namespace

    def names(self, *, thorough: bool = False) -> list[str]:
        """The queues the workers recorded (``<ns>:gp:queues``); ``thorough`` adds those found by scanning the
        keyspace (a queue only sent to has no record). An empty queue has no keys to find; its record still
        names it."""
        ns = self.namespace
        names = {raw_name(name) for name in self.client.smembers(keys.declared_queues(ns))}
        if thorough:
            for key in self.client.scan_iter(keys.all_messages(ns), count=1000):
                name = raw_name(key)[len(ns) + 1 : -len(keys.MESSAGES)]
                names.add(name.removesuffix(".DQ").removesuffix(".XQ"))
            for key in self.client.scan_iter(keys.all_dead(ns), count=1000):
                names.add(raw_name(key)[len(ns) + 1 : -len(".XQ")])
        return sorted(n for n in names if not n.startswith("__"))

    def counts(self, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Messages ready, in flight (fetched, not yet acked), delayed and dead-lettered.

        Four O(1) commands per queue, all in one round trip. A name that is not UTF-8 is
        marked, and not counted: no Dramatiq queue has one (its names are ASCII), so
        something else wrote it.
        """
        names = self.names() if names is None else list(names)
        ns = self.namespace
        marks = {name: garbled(name) for name in names}
        with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                if not marks[name]:
                    pipe.llen(keys.queue(ns, name))
                    pipe.hlen(keys.messages(ns, name))
                    pipe.hlen(keys.delay_messages(ns, name))
                    pipe.zcard(keys.dead(ns, name))
            counted = iter(pipe.execute())
        queues = []
        for name in names:
            if marks[name]:
                queues.append({"name": marks[name], "ready": None, "in_flight": None, "delayed": None, "dead": None})
                continue
            ready, stored, delayed, dead = (next(counted) for _ in range(4))
            queues.append(
                {"name": name, "ready": ready, "in_flight": max(stored - ready, 0), "delayed": delayed, "dead": dead}
            )
        return queues

    def ready_since(self, names: Sequence[str]) -> dict[str, int]:
        """Exact: the message at the head of each queue's list, the next one fetched (``fetch.lua`` pops the
        left end, sends push on the right), for all the queues in two round trips (``LINDEX``, then ``HGET``)."""
        ns = self.namespace
        names = [name for name in names if not garbled(name)]
        with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.lindex(keys.queue(ns, name), 0)
            heads = pipe.execute()
        waiting = [(name, head) for name, head in zip(names, heads, strict=True) if head is not None]
        with self.client.pipeline(transaction=False) as pipe:
            for name, head in waiting:
                pipe.hget(keys.messages(ns, name), head)
            stored = pipe.execute()
        since = {}
        for (name, _), raw in zip(waiting, stored, strict=True):
            # None: fetched between the two round trips; the next scrape reads the new head.
            at = _ready_at(raw) if raw is not None else None
            if at is not None:
                since[name] = at
        return since

    def _dead_count(self, queue: str) -> int:
        return int(self.client.zcard(keys.dead(self.namespace, queue)))

    def _dead_letters(self, queue: str, *, offset: int, limit: int, pii: bool) -> list[DeadLetter]:
        """The most recent first: two round trips."""
        ns = self.namespace
        scored: Any = self.client.zrevrange(keys.dead(ns, queue), offset, offset + limit - 1, withscores=True)
        if not scored:
            return []
        members = [member for member, _ in scored]
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.dead_messages(ns, queue), members)
            pipe.hmget(keys.dead_reasons(ns, queue), members)
            data, reasons = pipe.execute()
        return [
            letter(queue, _id(member), moment(score, "score"), raw, pii, _text(why))
            for (member, score), raw, why in zip(scored, data, reasons, strict=True)
            if raw is not None  # expired between the two round trips
        ]

    def _dead_letter(self, queue: str, id: str, *, pii: bool) -> DeadLetter | None:
        ns = self.namespace
        for redis_id in self._resolve(queue, [id]):
            with self.client.pipeline(transaction=False) as pipe:
                pipe.zscore(keys.dead(ns, queue), redis_id)
                pipe.hget(keys.dead_messages(ns, queue), redis_id)
                pipe.hget(keys.dead_reasons(ns, queue), redis_id)
                score, raw, why = pipe.execute()
            if score is not None and raw is not None:
                return letter(queue, _id(redis_id), moment(score, "score"), raw, pii, _text(why))
        return None

    def _resolve(self, queue: str, ids: Sequence[str]) -> list[str | bytes]:
        """The Redis ids of the dead letters ``ids`` names: each a Redis id, or a message id.

        A dead letter is stored under the Redis id of the copy that died, which is not
        the one its producer got back once it was retried, held for an unknown task
        type or moved from a delay queue: each of those is a new copy with a new Redis
        id. Its message id stays the same through all of them, so an id that is not a
        Redis id is looked for as a message id, in one pass over the queue's dead
        letters (``HSCAN``, a page at a time: Redis is never blocked for the whole set).
        """
        if not ids:
            return []
        ns = self.namespace
        with self.client.pipeline(transaction=False) as pipe:
            for id in ids:
                pipe.zscore(keys.dead(ns, queue), id)
            found = pipe.execute()
        known: list[str | bytes] = [id for id, score in zip(ids, found, strict=True) if score is not None]
        wanted = {id for id, score in zip(ids, found, strict=True) if score is None}
        if not wanted:
            return known
        for member, raw in self.client.hscan_iter(keys.dead_messages(ns, queue), count=1000):
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            if not any(id in text for id in wanted):  # most are not: no JSON decode for them
                continue
            try:
                message_id = json.loads(text).get("message_id")
            except (ValueError, RecursionError, AttributeError):
                continue
            if message_id in wanted:
                known.append(member)  # as Redis holds it: one not UTF-8 is found by its message id alone
        return known

    def _requeue(self, queue: str, ids: Sequence[str] | None) -> int:
        """One Lua call per :data:`REQUEUE_BATCH`, each moving its batch atomically; the oldest first, so
        a whole queue's keep their order."""
        script = self.client.register_script(_SCRIPTS["requeue"])
        ns = self.namespace
        touched = [
            keys.dead(ns, queue),
            keys.dead_messages(ns, queue),
            keys.dead_reasons(ns, queue),
            keys.queue(ns, queue),
            keys.messages(ns, queue),
        ]
        if ids is not None:
            found = self._resolve(queue, ids)
            return sum(
                int(script(keys=touched, args=found[i : i + REQUEUE_BATCH]))
                for i in range(0, len(found), REQUEUE_BATCH)
            )
        moved = 0
        while True:
            batch: Any = self.client.zrange(touched[0], 0, REQUEUE_BATCH - 1)
            if not batch:
                return moved
            moved += int(script(keys=touched, args=batch))

    def _purge(self, queue: str) -> int:
        ns = self.namespace
        with self.client.pipeline() as pipe:
            pipe.zcard(keys.dead(ns, queue))
            pipe.unlink(keys.dead(ns, queue), keys.dead_messages(ns, queue), keys.dead_reasons(ns, queue))
            dead, _ = pipe.execute()
        return int(dead)


def _ready_at(raw: bytes | str) -> int | None:
    """When a stored message became ready; None for bytes that are not a message (its consumer sets them aside)."""
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return ready_at(message.get("message_timestamp"), message.get("options")) if isinstance(message, dict) else None


def _text(value: bytes | str | None) -> str | None:
    return None if value is None else text(value)


def _id(member: bytes | str) -> str:
    """A Redis id as it shows; one not UTF-8 (no broker wrote it) is marked, and its message id finds it."""
    try:
        return member.decode() if isinstance(member, bytes) else member
    except UnicodeDecodeError:
        return unreadable(f"id not UTF-8: {member!r}")
