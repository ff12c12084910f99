"""The operator's view of queues on RabbitMQ (:class:`~dramatiq_gp.brokers.view.QueueView`).

The queues the kit declared are recorded in Redis (``<ns>:gp:queues``); their
counts come from AMQP (a passive declare of each queue, its ``.DQ`` and its
``.XQ``), plus what the live worker processes hold, from their records in Redis.

A queue's dead letters are the messages of its ``<queue>.XQ`` queue, in the order
they died. AMQP reads a queue only from its head, so the view reads them with
``basic.get`` on a channel of its own and never acknowledges what it only looked
at: closing the channel puts those back where they were. Reading them is bounded
by how far into the queue the page or the id lies. Requeuing publishes a dead
letter to its queue, waits for RabbitMQ's confirm, and only then acknowledges it
on the ``.XQ``: a failure leaves it a dead letter, never lost (at worst, requeued
and still listed).

Each look counts as a delivery on a quorum queue (``x-delivery-count``), and
RabbitMQ drops a message returned more times than its delivery limit (20 by
default since RabbitMQ 4.0). So a dead letter looked at :data:`REFRESH_AT` times
is written anew at the end of its ``.XQ`` (published, confirmed, then the old copy
acknowledged): looking never loses one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pika
import pika.exceptions
import redis
from dramatiq import Message
from dramatiq.common import dq_name, q_name, xq_name
from dramatiq.errors import DecodeError

from .. import keys
from ..records import text
from .base import DEAD_LETTER_REASON
from .view import DeadLetter, QueueView, letter

#: A send to a queue unconfirmed this recently makes its counts unknown (a minute: the outbox relay and
#: a retried task try again well within it; a record left by a process since gone ages out).
UNCONFIRMED_RECENT_MS = 60_000
#: A worker process's record of what it holds is counted if its heartbeat is this recent.
HELD_RECENT_MS = 15_000
#: A dead letter delivered this many times (each look is one) is written anew, its count back at 0.
REFRESH_AT = 10
#: What shows for when a dead letter died: RabbitMQ does not keep it.
DIED_UNKNOWN = "unknown (RabbitMQ keeps no time of death)"

#: What :meth:`RabbitmqQueueView._pass` does with a dead letter it read.
KEEP, REQUEUE = "keep", "requeue"


class RabbitmqQueueView(QueueView):
    """Queues on the RabbitMQ nodes ``urls``, recorded in the Redis/Valkey ``client`` under ``namespace``."""

    server = "RabbitMQ"
    counts_consumers = True
    unreachable = (pika.exceptions.AMQPError,)

    def __init__(self, urls: list[str], client: redis.Redis, namespace: str, where: str = "") -> None:
        super().__init__(where or f"namespace {namespace}")
        self.urls, self.client, self.namespace = urls, client, namespace

    @contextmanager
    def _connected(self) -> Iterator[pika.BlockingConnection]:
        """A connection of this call's own (pika's are not for sharing between threads: the dashboard's are many)."""
        connection = pika.BlockingConnection([pika.URLParameters(url) for url in self.urls])
        try:
            yield connection
        finally:
            if connection.is_open:
                connection.close()

    def names(self, *, thorough: bool = False) -> list[str]:
        """The queues the kit declared (every worker and sender records what it declares: nothing to search)."""
        return sorted(text(name) for name in self.client.smembers(keys.declared_queues(self.namespace)))

    def counts(self, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Also ``consumers``, and ``unknown``: why the counts cannot be known now, else None.

        AMQP tells only what waits on a queue; what the live worker processes hold
        (running, prefetched, or delayed and waiting in their memory until due) comes
        from the records their heartbeats write, and is added. A queue a send went
        unconfirmed to in the last minute has likely lost its quorum: RabbitMQ's
        counts for it are then stale or 0, so they are given as unknown (``None``),
        with ``unknown`` saying why. A queue deleted since it was recorded is left out.
        """
        ns = self.namespace
        now = int(datetime.now(UTC).timestamp() * 1000)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.unconfirmed(ns))
            pipe.zrangebyscore(keys.heartbeats(ns), now - HELD_RECENT_MS, "+inf")
            unconfirmed, live = pipe.execute()
        with self.client.pipeline(transaction=False) as pipe:
            for broker_id in live:
                pipe.hgetall(keys.held(ns, text(broker_id)))
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
        queues = []
        with self._connected() as connection:
            counted = [
                (name, [_declared(connection, queue) for queue in (name, dq_name(name), xq_name(name))])
                for name in (self.names() if names is None else names)
            ]
        for name, counts in counted:
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

    def ready_since(self, names: Sequence[str]) -> dict[str, int]:
        """An estimate: when the last message a worker received from each queue became ready, as the worker
        processes record it every beat (``<ns>:gp:fetched``), one Redis command for all.

        AMQP cannot look at a queue's head without taking the message, and giving it back
        counts as a delivery on a quorum queue (which drops a message delivered too
        often), so nothing here looks. The message at the head came after the last one
        received, so when the queue has messages ready this time is no later than its
        head's: the age from it is an upper bound, close while messages arrive and are
        taken steadily (too old by at most the gap between two sends plus a beat,
        :data:`~dramatiq_gp.brokers.rabbitmq.BEAT_EVERY_S`), and growing while no worker
        takes any. A queue no worker has received from yet is left out.
        """
        names = list(names)
        if not names:
            return {}
        recorded = self.client.hmget(keys.fetched(self.namespace), names)
        return {name: int(text(at)) for name, at in zip(names, recorded, strict=True) if text(at).isdigit()}

    def _dead_count(self, queue: str) -> int:
        with self._connected() as connection:
            declared = _declared(connection, xq_name(queue))
        return int(declared.message_count) if declared is not None else 0

    def _dead_letters(self, queue: str, *, offset: int, limit: int, pii: bool) -> list[DeadLetter]:
        """The oldest first (AMQP reads a queue from its head): reads ``offset + limit`` of them."""
        seen: list[DeadLetter] = []

        def look(found: DeadLetter) -> str | None:
            seen.append(found)
            return None if len(seen) < offset + limit else KEEP

        self._pass(queue, look, pii)
        return seen[offset : offset + limit]

    def _dead_letter(self, queue: str, id: str, *, pii: bool) -> DeadLetter | None:
        """Reads up to the one with message id ``id``."""
        found: list[DeadLetter] = []

        def look(dead: DeadLetter) -> str | None:
            if dead.message_id != id:
                return None
            found.append(dead)
            return KEEP

        self._pass(queue, look, pii)
        return found[0] if found else None

    def _requeue(self, queue: str, ids: Sequence[str] | None) -> int:
        """Reads every dead letter of the queue once (only as many as there were when it started)."""
        wanted = None if ids is None else set(ids)
        moved = 0

        def choose(dead: DeadLetter) -> str | None:
            nonlocal moved
            if wanted is None or dead.message_id in wanted:
                moved += 1
                return REQUEUE
            return None

        self._pass(queue, choose, pii=False)
        return moved

    def _purge(self, queue: str) -> int:
        with self._connected() as connection:
            try:
                return int(connection.channel().queue_purge(xq_name(queue)).method.message_count)
            except pika.exceptions.ChannelClosedByBroker:  # no such queue
                return 0

    def _pass(self, queue: str, choose: Callable[[DeadLetter], str | None], pii: bool) -> None:
        """Read ``queue``'s dead letters from the head, each handed to ``choose``: None reads on (the letter
        stays where it is), :data:`KEEP` stops there, :data:`REQUEUE` sends it back to ``queue`` and reads on.

        Only the dead letters there when the pass starts are read. Every one read and not requeued goes back
        to its place when the connection closes.
        """
        xq = xq_name(queue)
        with self._connected() as connection:
            channel = connection.channel()
            try:
                there = channel.queue_declare(xq, passive=True).method.message_count
            except pika.exceptions.ChannelClosedByBroker:  # no such queue: no dead letters
                return
            channel.confirm_delivery()
            for _ in range(there):
                method, properties, body = channel.basic_get(xq, auto_ack=False)
                if method is None:
                    return
                dead = letter(queue, "", DIED_UNKNOWN, body, pii, _set_aside_reason(properties))
                dead = replace(dead, id=dead.message_id or "")  # on RabbitMQ its handle is its message id
                choice = choose(dead)
                if choice == REQUEUE:
                    _publish(channel, queue, properties, _for_queue(body, queue), requeued=True)
                    channel.basic_ack(method.delivery_tag)
                    continue
                if int((properties.headers or {}).get("x-delivery-count", 0)) + 1 >= REFRESH_AT:
                    # Looked at often: written anew at the end, so RabbitMQ's delivery limit never drops it.
                    _publish(channel, xq, properties, body)
                    channel.basic_ack(method.delivery_tag)
                if choice == KEEP:
                    return


def _declared(connection: pika.BlockingConnection, queue: str) -> Any:
    """The passive declare's answer for ``queue`` (its counts), or None when there is no such queue."""
    channel = connection.channel()
    try:
        return channel.queue_declare(queue, passive=True).method
    except pika.exceptions.ChannelClosedByBroker:  # no such queue: RabbitMQ closed the channel
        return None
    finally:
        if channel.is_open:
            channel.close()


def _publish(channel: Any, queue: str, properties: Any, body: bytes, *, requeued: bool = False) -> None:
    """Publish ``body`` to ``queue``, persistent, and wait for RabbitMQ's confirm (raises without it).

    ``requeued``: back to its queue, without the reason it was set aside (set aside again, it gets its own).
    """
    dropped = ("x-delivery-count", DEAD_LETTER_REASON) if requeued else ("x-delivery-count",)
    headers = {k: v for k, v in (properties.headers or {}).items() if k not in dropped}
    channel.basic_publish(
        exchange="",
        routing_key=queue,
        body=body,
        properties=pika.BasicProperties(delivery_mode=2, priority=properties.priority, headers=headers or None),
        mandatory=True,
    )


def _set_aside_reason(properties: Any) -> str | None:
    """Why the consumer set a dead letter aside as it came (its header), or None."""
    why = (properties.headers or {}).get(DEAD_LETTER_REASON)
    return text(why) if why is not None else None


def _for_queue(body: bytes, queue: str) -> bytes:
    """A dead letter's message as its queue takes it back: Dramatiq retries a message on the queue it names."""
    try:
        return Message.decode(body).copy(queue_name=queue).encode()
    except DecodeError:
        return body  # bytes that never were a message: set aside again when fetched, as before
