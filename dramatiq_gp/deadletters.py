"""Dead letters on Redis: read a page of them, look at one, requeue them, purge them.

A queue's dead letters are Dramatiq's: ``<ns>:<queue>.XQ``, a sorted set of Redis
message ids scored by when each died, and ``<ns>:<queue>.XQ.msgs``, their messages
(see :mod:`dramatiq_gp.keys`). Every read here is bounded by the page asked for
(``ZREVRANGE`` and ``HMGET``), never by how many there are, so a queue with
100,000 dead letters pages as fast as one with ten. Only finding one by its
message id rather than its Redis id reads them all (a page at a time).

A dead letter is shown by its Redis message id (the handle ``show`` and ``requeue``
take; they take its message id too, :func:`resolve`), with its message id, task
type, retries, age and why it died: the reason the kit gave it
(``gp_dead_letter_reason``: an unknown task type, a malformed message) or the
exception its last attempt raised (the broker keeps the dead letter as that attempt
left it, with Dramatiq's traceback). Its arguments may hold personal data, so they
are shown only when asked for with ``pii=True`` (``SENTRY_SEND_DEFAULT_PII``, the
rule Sentry follows), and ``[Filtered]`` otherwise.

Requeuing moves a dead letter back to the end of its queue as it is, with its
message id, so idempotent execution still skips it if a copy already completed. It
keeps its retry count: a message that used up its retries gets one more attempt.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from . import keys
from .brokers.base import DEAD_LETTER_REASON
from .lua import scripts
from .records import moment, unreadable

_SCRIPTS = scripts(__file__)

#: Dead letters moved per Lua call when a whole queue's are requeued.
REQUEUE_BATCH = 1000
FILTERED = "[Filtered]"


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter, as ``dramatiq-gp dlq`` and the dashboard show it."""

    id: str  #: its Redis message id: the handle to show or requeue it by (its mark when it is not UTF-8)
    queue: str
    dead_at_ms: int | str  #: when it died (its score), or its mark when that is no time (``inf``)
    message_id: str | None  #: None for bytes that never were a message (set aside as undecodable)
    task_type: str | None
    attempts: int | str  #: the failed attempts (Dramatiq's ``retries`` as its last attempt left it), or its mark
    reason: str | None
    args: Any
    kwargs: Any

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "queue": self.queue,
            "dead_at_ms": self.dead_at_ms,
            "message_id": self.message_id,
            "task_type": self.task_type,
            "attempts": self.attempts,
            "reason": self.reason,
            "args": self.args,
            "kwargs": self.kwargs,
        }


def count(client: redis.Redis, namespace: str, queue: str) -> int:
    return int(client.zcard(keys.dead(namespace, queue)))


def page(
    client: redis.Redis, namespace: str, queue: str, *, offset: int = 0, limit: int = 50, pii: bool = False
) -> list[DeadLetter]:
    """Dead letters of ``queue``, the most recent first, from ``offset``: two Redis commands."""
    scored: Any = client.zrevrange(keys.dead(namespace, queue), offset, offset + limit - 1, withscores=True)
    if not scored:
        return []
    data: Any = client.hmget(keys.dead_messages(namespace, queue), [member for member, _ in scored])
    return [
        _letter(queue, _id(member), moment(score, "score"), raw, pii)
        for (member, score), raw in zip(scored, data, strict=True)
        if raw is not None  # expired between the two commands
    ]


def get(client: redis.Redis, namespace: str, queue: str, id: str, *, pii: bool = False) -> DeadLetter | None:
    """The dead letter ``id`` of ``queue`` (its Redis id, or the message id its producer got back), or None."""
    for redis_id in resolve(client, namespace, queue, [id]):
        with client.pipeline(transaction=False) as pipe:
            pipe.zscore(keys.dead(namespace, queue), redis_id)
            pipe.hget(keys.dead_messages(namespace, queue), redis_id)
            score, raw = pipe.execute()
        if score is not None and raw is not None:
            return _letter(queue, _id(redis_id), moment(score, "score"), raw, pii)
    return None


def resolve(client: redis.Redis, namespace: str, queue: str, ids: Sequence[str]) -> list[str | bytes]:
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
    with client.pipeline(transaction=False) as pipe:
        for id in ids:
            pipe.zscore(keys.dead(namespace, queue), id)
        found = pipe.execute()
    known: list[str | bytes] = [id for id, score in zip(ids, found, strict=True) if score is not None]
    wanted = {id for id, score in zip(ids, found, strict=True) if score is None}
    if not wanted:
        return known
    for member, raw in client.hscan_iter(keys.dead_messages(namespace, queue), count=1000):
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


def requeue(client: redis.Redis, namespace: str, queue: str, ids: Sequence[str] | None = None) -> int:
    """Move the dead letters ``ids`` (all of the queue's, when None) back to ``queue``; how many moved."""
    script = client.register_script(_SCRIPTS["requeue"])
    touched = [
        keys.dead(namespace, queue),
        keys.dead_messages(namespace, queue),
        keys.queue(namespace, queue),
        keys.messages(namespace, queue),
    ]
    if ids is not None:
        found = resolve(client, namespace, queue, ids)
        return sum(
            int(script(keys=touched, args=found[i : i + REQUEUE_BATCH])) for i in range(0, len(found), REQUEUE_BATCH)
        )
    moved = 0
    while True:
        batch: Any = client.zrange(touched[0], 0, REQUEUE_BATCH - 1)  # the oldest first: they keep their order
        if not batch:
            return moved
        moved += int(script(keys=touched, args=batch))


def purge(client: redis.Redis, namespace: str, queue: str) -> int:
    """Delete every dead letter of ``queue``; how many there were."""
    with client.pipeline() as pipe:
        pipe.zcard(keys.dead(namespace, queue))
        pipe.unlink(keys.dead(namespace, queue), keys.dead_messages(namespace, queue))
        dead, _ = pipe.execute()
    return int(dead)


def _letter(queue: str, id: str, dead_at_ms: int | str, raw: bytes | str, pii: bool) -> DeadLetter:
    try:
        message = json.loads(raw)
        options = message["options"] if isinstance(message.get("options"), dict) else {}
    except (ValueError, AttributeError, RecursionError):
        return DeadLetter(
            id, queue, dead_at_ms, None, None, 0, "cannot decode it (set aside as it came)", FILTERED, FILTERED
        )
    reason = options.get(DEAD_LETTER_REASON)
    if reason is None and isinstance(options.get("traceback"), str):
        reason = _exception_line(options["traceback"])
    retries = options.get("retries", 0)
    # A message whose retries is no whole number was set aside as malformed: it still lists, marked.
    attempts = retries if type(retries) is int else unreadable(f"retries={reprlib.repr(retries)}")
    return DeadLetter(
        id,
        queue,
        dead_at_ms,
        _str(message.get("message_id")),
        _str(message.get("actor_name")),
        attempts,
        reason,
        message.get("args") if pii else FILTERED,
        message.get("kwargs") if pii else FILTERED,
    )


def _exception_line(traceback: str) -> str:
    """The first line of the exception a traceback ends with: ``Type: message``.

    Not the last line: an exception's message can run on (SQLAlchemy's ends with a
    link, and carries the statement and its parameters in between).
    """
    lines = traceback.rstrip().splitlines()
    if not lines:
        return unreadable("empty traceback")
    last_frame = max((i for i, line in enumerate(lines) if line.startswith('  File "')), default=-1)
    return next((line for line in lines[last_frame + 1 :] if line and not line.startswith(" ")), lines[-1])


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _id(member: bytes | str) -> str:
    """A Redis id as it shows; one not UTF-8 (no broker wrote it) is marked, and its message id finds it."""
    try:
        return member.decode() if isinstance(member, bytes) else member
    except UnicodeDecodeError:
        return unreadable(f"id not UTF-8: {member!r}")
