"""The kit's RabbitMQ broker: Dramatiq's, with replicated queues and acks that land where they belong.

:class:`RabbitmqBroker` takes the arguments of
:class:`dramatiq.brokers.rabbitmq.RabbitmqBroker`, and keeps its queue names and
message format, so stock Dramatiq producers see the same queues. On top of it:

* Queues (each queue, its delay queue ``.DQ`` and its dead-letter queue ``.XQ``)
  are declared as **quorum queues** by default: replicated over the cluster's
  nodes, they survive the loss of a minority of them. ``queue_type="classic"``
  declares Dramatiq's classic ones. Quorum queues refuse ``x-max-priority``, so
  ``max_priority`` needs classic queues, and is refused in one line otherwise.
* **Publisher confirms** are on by default (``confirm_delivery=True``): a send
  returns once RabbitMQ has taken the message, not when it left the socket.
  :meth:`RabbitmqBroker.enqueue_many` (the outbox relay's) publishes a batch at
  once and then awaits all its confirms (:mod:`~dramatiq_gp.brokers.publisher`).
* **No send waits forever.** Dramatiq's ``enqueue`` waits for its confirm without
  a limit, and a quorum queue that lost the majority of its nodes neither
  confirms nor refuses: a web request sending a task hung for as long as the
  outage. Every send here (one message, a batch, a retry's copy, a dead letter)
  waits at most ``confirm_timeout_ms`` (``RABBITMQ_CONFIRM_TIMEOUT``), then fails
  with :class:`~dramatiq_gp.errors.ConfirmTimeout` naming the queue. The first
  such failure of a queue is logged once, with its cause, and recorded in
  Redis/Valkey for ``dramatiq-gp status``; the first confirm after it is logged
  as the recovery.
* **An ack or nack goes to the channel that delivered the message**, or nowhere.
  Delivery tags are numbered per channel from 1; after a reconnect Dramatiq acks
  a message fetched on the old channel with the *new* consumer, where the same
  tag may name a different message, which is then acked without having run.
  RabbitMQ put the old channel's unacked messages back when it closed, so
  there is nothing left to settle for them.

* **A dead letter is published, confirmed, then the message acked.** Dramatiq nacks
  a message that failed for good (and the consumer a malformed one) into its
  dead-letter queue through RabbitMQ's dead-letter exchange, which quorum queues
  do at most once: a dead letter moved while a node fails can be lost. Here its
  copy is published to ``<queue>.XQ`` and confirmed before the message is acked,
  as the kit's own dead letters (unknown task types) always were.
* It is a :class:`~dramatiq_gp.brokers.base.KitBroker`: ``client`` is the Redis/Valkey
  beside it for the coordination state (idempotency claims and done marks). A
  message is settled with its :class:`~dramatiq_gp.brokers.base.SettlePlan` in
  this order: its copy published and confirmed, its idempotency outcome written
  to Redis (``rabbitmq/record.lua``), then its ack; the settles of one window
  (``WORKER_SETTLE_WINDOW``) together. The acks wait for the window once more on
  the consumer's connection, and its settled prefix goes as one ``basic.ack``
  with ``multiple``. An ack whose only write is its outcome skips the settler's
  thread: the consumer's thread writes its window's outcomes, then acks them.
  ``docs/life-of-a-message.md`` follows a
  message through it, and says what a ``kill -9`` at each step does.
* A consumer takes every message pika already holds when one arrives, and hands
  them to the middleware's ``after_fetch`` together (one round trip for their
  idempotency claims). One whose actor is declared on another queue is
  dead-lettered with the reason: a worker runs a message only from its actor's queue.
* **Sending to a queue is not consuming it.** Dramatiq declares the queue of every
  message it sends, and its worker starts a consumer for every queue declared, so a
  worker that fans an event out to a listener only another worker has (on a queue of
  its own) would consume that queue and hold messages it cannot run. A queue no
  actor here uses is created on the server for the send, and left out of
  ``queues``.

The Dramatiq internals relied on (Dramatiq 2.2, pinned by ``tests/test_rabbitmq.py``
and ``tests/test_rabbitmq_acks.py``): ``enqueue``'s steps, which :meth:`RabbitmqBroker.enqueue`
repeats with its own publish (the delay queue's copy with its ``eta``, ``declare_queue``
with ``ensure``, the hooks around the publish, ``MAX_ENQUEUE_ATTEMPTS`` on a closed
connection), ``RabbitmqBroker._build_queue_arguments`` and
``_declare_xq_queue``, ``declare_queue`` (its ``ensure`` flag) with ``queues``,
``queues_pending`` and ``_ensure_queue``, ``consumer_class``, ``_RabbitmqConsumer`` (its
constructor, of ``(broker, queue_name, prefetch, timeout)``, setting ``connection``,
``channel``, ``iterator`` and ``known_tags``; ``close``, which runs the connection's
pending callbacks before it closes), ``_RabbitmqMessage(redelivered, tag, message)`` and its ``_tag``, and
the worker settling a message through the consumer its queue has *now*
(``Worker.consumers[queue].consumer``), which is why a message carries the
consumer that delivered it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Literal
from uuid import uuid4

import pika
import pika.exceptions
import redis
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.rabbitmq import DEAD_MESSAGE_TTL, MAX_ENQUEUE_ATTEMPTS, _RabbitmqConsumer, _RabbitmqMessage
from dramatiq.brokers.rabbitmq import RabbitmqBroker as DramatiqRabbitmqBroker
from dramatiq.common import current_millis, dq_name, q_name, xq_name
from dramatiq.errors import ConnectionClosed, DecodeError

from .. import keys
from ..errors import BrokerUnreachable, ConfigError, ConfirmTimeout, QuorumLost
from ..lua import scripts
from ..names import is_delay_queue
from ..settings import settle_window_ms_from_env
from .base import (
    DEAD_LETTER_REASON,
    KitBroker,
    Settle,
    check_delay,
    decode_cause,
    keep_failure_reason,
    malformed,
    malformed_reason,
    plan_of,
)
from .done_marks import with_library
from .publisher import CONFIRM_TIMEOUT_S, BatchPublisher, NoReply, NotConfirmed
from .settler import Settler
from .view import ready_at

logger = logging.getLogger(__name__)

_SCRIPTS = scripts(__file__)
_SCRIPTS["record"] = with_library(_SCRIPTS["record"])

#: How often a consumer records its process's heartbeat, and the messages settled since, in Redis for the dashboard.
BEAT_EVERY_S = 5.0
#: How long the record of a queue whose sends went unconfirmed is kept, for ``dramatiq-gp status``.
UNCONFIRMED_KEPT_MS = 3_600_000
#: How many settle windows an ack that no multiple ack can cover yet waits for one to, before it goes alone.
ACK_WAIT_WINDOWS = 3
#: On a message whose dead letter is published: acked, counted as dead.
_DEAD_LETTERED_ATTR = "_gp_dead_lettered"
#: On a message acked with a retry's copy published: counted as retried, not done.
_RETRIED_ATTR = "_gp_retried"

QueueType = Literal["quorum", "classic"]
QUEUE_TYPES: tuple[QueueType, ...] = ("quorum", "classic")


class RabbitmqBroker(KitBroker, DramatiqRabbitmqBroker):
    """Dramatiq's RabbitMQ broker with quorum queues and publisher confirms by default.

    Parameters:
        client: the coordination Redis/Valkey (default: one on 127.0.0.1:6379).
        namespace: the prefix of the kit's keys in it.
        unknown_task_grace_ms: how long messages for a task type no actor here
            handles are held before they are skipped (``WORKER_UNKNOWN_TASK_GRACE``).
        queue_type: ``"quorum"`` (replicated; the default) or ``"classic"``.
        confirm_delivery: wait for RabbitMQ's confirm of every send (default on).
        settle_window_ms: how long the settles of finished messages are collected to
            be written together; 0 settles each at once. Not given: ``WORKER_SETTLE_WINDOW``,
            as the Kit passes it.
        confirm_timeout_ms: how long a send waits for RabbitMQ's confirm before it
            fails with :class:`~dramatiq_gp.errors.ConfirmTimeout` (``RABBITMQ_CONFIRM_TIMEOUT``).
        **options: :class:`dramatiq.brokers.rabbitmq.RabbitmqBroker`'s (``url``,
            ``middleware``, ``max_priority`` with classic queues, pika's parameters).

    Raises:
        ConfigError: an unknown ``queue_type``, ``max_priority`` with quorum queues, or an
            invalid ``WORKER_*`` variable when the settle window is not given.
    """

    #: A quorum queue delivers as acks come back through the Raft log, which on a slow disk
    #: stalls for tens of ms at times; the Redis consumer fetches again at half its buffer.
    #: Measured on a 2-core machine, 2 ms tasks on 8 threads with ``default:3,mail:1``:
    #: with 16 a stall emptied ``default``'s buffer in 1 run of 3 (0.64 to 0.70 of the starts
    #: went to ``default`` instead of 0.75); with 32, in none of 6.
    prefetch_per_thread = 32
    #: The queues are on RabbitMQ: a claimed tick is kept in Redis until its publish is confirmed.
    queues_in_client = False
    #: No Dramatiq maintenance runs on RabbitMQ to drop a dead worker's heartbeat: a starting consumer does.
    heartbeat_retention_ms = 3_600_000

    def __init__(
        self,
        *,
        client: redis.Redis | None = None,
        namespace: str = "dramatiq",
        unknown_task_grace_ms: int = 300_000,
        queue_type: str = "quorum",
        confirm_delivery: bool = True,
        settle_window_ms: float | None = None,
        confirm_timeout_ms: float = CONFIRM_TIMEOUT_S * 1000,
        **options: Any,
    ) -> None:
        if queue_type not in QUEUE_TYPES:
            raise ConfigError(f"queue_type {queue_type!r}: expected one of {', '.join(QUEUE_TYPES)}")
        if queue_type == "quorum" and options.get("max_priority") is not None:
            raise ConfigError("max_priority needs queue_type='classic': quorum queues refuse x-max-priority")
        #: Queues created on the server for a send only: no actor here uses them, so no consumer reads them.
        self._sent_only: set[str] = set()
        super().__init__(confirm_delivery=confirm_delivery, **options)
        self.queue_type: QueueType = queue_type
        self.client = client if client is not None else redis.Redis()
        self.namespace = namespace
        self.unknown_task_grace_ms = unknown_task_grace_ms
        self.confirm_timeout_s = confirm_timeout_ms / 1000
        #: Queue → when (monotonic) its sends stopped being confirmed in time, until one is again.
        self._unconfirmed: dict[str, float] = {}
        self._unconfirmed_lock = threading.Lock()
        #: This worker process, in the heartbeats and worker records the dashboard reads (as Dramatiq's Redis broker).
        self.broker_id = str(uuid4())
        self._start_worker_record()
        self._record = self.client.register_script(_SCRIPTS["record"])
        self._beat_at = 0.0
        self._counts: dict[str, int] = {}  #: ``<queue>:done|retried|dead`` settled since the last beat
        self._counts_lock = threading.Lock()
        #: The open consumers, whose unsettled deliveries the beat records (what AMQP does not count).
        self._consumers: weakref.WeakSet[_Consumer] = weakref.WeakSet()
        if settle_window_ms is None:
            settle_window_ms = settle_window_ms_from_env()
        if settle_window_ms > 0:
            self.settler = Settler(
                self._write_settles,
                self._give_up_settles,
                window_s=settle_window_ms / 1000,
                retry_on=(ConnectionClosed,),
            )

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Dramatiq's ``enqueue``, whose wait for the confirm ends after ``confirm_timeout_ms``.

        Raises:
            QuorumLost: RabbitMQ did not confirm in time (:class:`ConfirmTimeout`; not tried again: each
                try would wait as long), or cannot declare the queue.
            ConnectionClosed: the connection closed on every attempt.
            DispatchError: ``delay`` is longer than :data:`~.base.MAX_DELAY_MS`; nothing was sent.
        """
        check_delay(message, delay)
        if not self.confirm_delivery:
            return super().enqueue(message, delay=delay)
        canonical = message.queue_name
        if delay is not None:
            message = message.copy(queue_name=dq_name(canonical), options={"eta": current_millis() + delay})
        attempts = 0
        while True:
            try:
                self.declare_queue(canonical, ensure=True)
                self.emit_before("enqueue", message, delay)
                self._confirmed([message])
                self.emit_after("enqueue", message, delay)
                return message
            except (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError, ConnectionClosed) as exc:
                if not isinstance(exc, ConnectionClosed):  # the declare's
                    del self.connection
                attempts += 1
                if isinstance(exc, QuorumLost) or attempts >= MAX_ENQUEUE_ATTEMPTS:
                    self.send_failed(message, exc)
                    if isinstance(exc, ConnectionClosed):
                        raise
                    raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
            except BaseException as exc:
                self.send_failed(message, exc)
                raise

    def _confirmed(self, messages: Sequence[Message[Any]], encoded: Sequence[bytes] | None = None) -> None:
        """Publish ``messages`` (sent as ``encoded`` where given) on this thread's :class:`BatchPublisher`, confirmed.

        Raises:
            ConfirmTimeout: not confirmed within ``confirm_timeout_ms`` (logged once per queue and outage).
            ConnectionClosed: the connection or the channel closed, or a message was refused or unroutable.
        """
        bodies = encoded if encoded is not None else [message.encode() for message in messages]
        self._confirmed_bodies(
            [
                (message.queue_name, body, message.options.get("broker_priority"))
                for message, body in zip(messages, bodies, strict=True)
            ]
        )

    def _confirmed_bodies(
        self, items: Sequence[tuple[str, bytes, int | None]], headers: dict[str, Any] | None = None
    ) -> None:
        """:meth:`_confirmed` for ``(queue, body, priority)`` items, each with ``headers``."""
        try:
            self._batch_publisher().publish(items, headers)
        except (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as exc:
            del self.connection  # the next caller opens new ones (the publisher's channel goes with it)
            if isinstance(exc, NoReply):
                raise self._no_confirm(sorted({queue for queue, _, _ in items})) from None
            if isinstance(exc, NotConfirmed):  # a queue may be gone: declare them again
                self.queues_pending.update(q_name(queue) for queue, _, _ in items)
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        if self._unconfirmed:
            self._confirmed_again({queue for queue, _, _ in items})

    def _no_confirm(self, queues: list[str]) -> QuorumLost:
        """The error for sends to ``queues`` left unconfirmed; the first of an outage logged, and recorded."""
        named = ", ".join(repr(queue) for queue in queues)
        return self._no_quorum(
            queues,
            ConfirmTimeout(  # type: ignore[no-untyped-call]
                f"RabbitMQ at {self._where()} did not confirm a send to queue {named} within "
                f"{self.confirm_timeout_s:g} s (RABBITMQ_CONFIRM_TIMEOUT): the queue has likely lost its quorum "
                "(a majority of its nodes down); it may still be delivered once they are back"
            ),
        )

    def _no_quorum(self, queues: list[str], error: QuorumLost) -> QuorumLost:
        """``error``, for ``queues``; the first of an outage logged, and recorded for ``dramatiq-gp status``."""
        with self._unconfirmed_lock:
            new = [queue for queue in queues if queue not in self._unconfirmed]
            for queue in new:
                self._unconfirmed[queue] = time.monotonic()
        if new:
            logger.warning("%s; sends to it fail until it confirms again", error)
        at = current_millis()
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for queue in queues:
                    pipe.hset(keys.unconfirmed(self.namespace), queue, at)
                pipe.pexpire(keys.unconfirmed(self.namespace), UNCONFIRMED_KEPT_MS)
                pipe.execute()
        except redis.RedisError as exc:  # only status reads it: the send's own error matters
            logger.warning("could not record the unconfirmed queue(s) for dramatiq-gp status: %s", exc)
        return error

    def _confirmed_again(self, queues: set[str]) -> None:
        with self._unconfirmed_lock:
            back = {queue: self._unconfirmed.pop(queue) for queue in queues if queue in self._unconfirmed}
        for queue, since in back.items():
            logger.warning("RabbitMQ confirms sends to queue %r again, after %.1f s", queue, time.monotonic() - since)
        if back:
            with contextlib.suppress(redis.RedisError):  # kept for a while only: status stops believing it
                self.client.hdel(keys.unconfirmed(self.namespace), *back)

    def enqueue_many(
        self, messages: Sequence[Message[Any]], *, encoded: Sequence[bytes] | None = None
    ) -> list[Message[Any]]:
        """Publish ``messages`` at once and return when RabbitMQ has confirmed them all (:mod:`.publisher`).

        ``encoded`` (each message's ``encode()``) is sent as it is where no middleware has a
        ``before_enqueue`` hook, which could change a message (tracing adds its context).

        Raises:
            ConnectionClosed: some were not confirmed (every one is reported as not
                sent; the caller sends the batch again, copies sharing their ids).
        """
        if len(messages) <= 1:
            return [self.enqueue(message) for message in messages]
        for message in messages:
            self.emit_before("enqueue", message, None)
        queues = {q_name(message.queue_name) for message in messages}
        if self.hooks("before_enqueue"):
            encoded = None
        try:
            for queue in queues:
                self.declare_queue(queue, ensure=True)
            self._confirmed(messages, encoded)
        except (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as exc:
            del self.connection  # the next caller opens new ones (the publisher's channel goes with it)
            for message in messages:
                self.send_failed(message, exc)
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        except BaseException as exc:
            for message in messages:
                self.send_failed(message, exc)
            raise
        for message in messages:
            self.emit_after("enqueue", message, None)
        return list(messages)

    def _batch_publisher(self) -> BatchPublisher:
        """This thread's :class:`BatchPublisher`, on this thread's connection."""
        publisher: BatchPublisher | None = getattr(self.state, "publisher", None)
        if publisher is None or not publisher.usable or publisher.connection is not self.connection:
            publisher = self.state.publisher = BatchPublisher(self.connection, self.confirm_timeout_s)
        return publisher

    def beat(self, *, now: bool = False) -> None:
        """Record this process's heartbeat, the messages settled since, and what it holds, every :data:`BEAT_EVERY_S`.

        For the dashboard's worker list and throughput: on Redis, Dramatiq's fetch
        records the heartbeat and ``settle.lua`` counts. What this process holds
        unsettled, per queue (running or prefetched; on a delay queue, the delayed
        messages waiting in its memory until they are due), is what RabbitMQ's counts
        leave out: ``dramatiq-gp status`` adds it. So is when the last message each
        consumer received became ready (``<ns>:gp:fetched``), which AMQP cannot tell
        without taking the next one: ``dramatiq-gp exporter`` estimates the oldest
        ready message's age from it. One round trip per beat, none per message. Only
        the operator's tools read them: a failure is logged, not raised, and the
        counts wait for the next beat.
        """
        if not now and time.monotonic() < self._beat_at:
            return
        self._beat_at = time.monotonic() + BEAT_EVERY_S
        with self._counts_lock:
            counts, self._counts = self._counts, {}
        at = current_millis()
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.zadd(keys.heartbeats(self.namespace), {self.broker_id: at})
                throughput = keys.throughput(self.namespace, at // 60_000)
                for field, n in counts.items():
                    pipe.hincrby(throughput, field, n)
                if counts:
                    pipe.pexpire(throughput, 7_200_000)
                consumed = {c.queue_name for c in list(self._consumers) if not is_delay_queue(c.queue_name)}
                if consumed:  # again: a Redis/Valkey that lost its data would list none until a restart
                    pipe.sadd(keys.declared_queues(self.namespace), *consumed)
                held_key = keys.held(self.namespace, self.broker_id)
                pipe.delete(held_key)
                held = self.held()
                if held:
                    pipe.hset(held_key, items=[part for pair in held.items() for part in pair])
                    pipe.pexpire(held_key, int(3 * BEAT_EVERY_S * 1000))
                fetched = self._fetched()
                if fetched:
                    pipe.hset(keys.fetched(self.namespace), items=[part for pair in fetched.items() for part in pair])
                pipe.execute()
        except redis.RedisError as exc:
            with self._counts_lock:
                for field, n in counts.items():
                    self._counts[field] = self._counts.get(field, 0) + n
            logger.warning("could not record this worker's heartbeat and throughput for the dashboard: %s", exc)

    def _fetched(self) -> dict[str, int]:
        """Per queue (a delay queue apart), when the last message a consumer received since the last beat became
        ready; a consumer that received none since leaves its queue to the processes that did."""
        fetched: dict[str, int] = {}
        for consumer in list(self._consumers):
            last = consumer.last_received
            if last is None or last is consumer.last_recorded:
                continue
            consumer.last_recorded = last
            at = ready_at(last.message_timestamp, last.options)
            if at is not None:
                fetched[consumer.queue_name] = at
        return fetched

    def held(self) -> dict[str, int]:
        """Per queue (a delay queue apart), the messages this process's consumers hold unsettled."""
        held: dict[str, int] = {}
        for consumer in list(self._consumers):
            if consumer.known_tags:
                held[consumer.queue_name] = held.get(consumer.queue_name, 0) + len(consumer.known_tags)
        return held

    def count_settled(self, queue_name: str, settles: Sequence[tuple[Any, str]]) -> None:
        """Count ``(message, command)`` settled, for the next beat."""
        queue = q_name(queue_name)
        with self._counts_lock:
            for message, command in settles:
                if command == "requeue":
                    continue
                kind = "dead" if command == "nack" else ("retried" if message.__dict__.get(_RETRIED_ATTR) else "done")
                field = f"{queue}:{kind}"
                self._counts[field] = self._counts.get(field, 0) + 1

    def settle(self, queue_name: str, message: MessageProxy, command: str) -> None:
        """Ack, nack or requeue ``message`` now (see :meth:`_write_settles`).

        Raises:
            ConnectionClosed: RabbitMQ or Redis did not take a step; the message stays
                unacked (Dramatiq tries again; a closed channel gives it back).
        """
        self._write_settles([(queue_name, message, command)])

    def settle_soon(self, queue_name: str, message: MessageProxy, command: str) -> None:
        """:meth:`settle` in the next batch of the settle window; a plain ack straight to its consumer.

        A message with nothing to record or publish costs no round trip to settle,
        so collecting it would only add the hand-over to the settler's thread: its
        consumer's connection collects it (:meth:`_Consumer.ack_on_channel`). So does
        an ack whose only write is its idempotency outcome: the connection's thread
        writes the outcomes of its window in one call, then acks them
        (:meth:`_Consumer.record_and_ack`). What publishes a copy, and every nack,
        goes through the settler.
        """
        consumer: _Consumer | None = getattr(message, "_consumer", None)
        if consumer is not None and command == "ack":
            plan = plan_of(message)
            if plan is None:
                consumer.ack_on_channel([(message, command)])
                return
            if plan.copy is None and self.settler is not None:
                consumer.record_and_ack(message)
                return
        super().settle_soon(queue_name, message, command)

    def _record_plans(self, messages: Iterable[MessageProxy]) -> None:
        """Write the idempotency outcomes of ``messages`` to Redis in one call (``record.lua``).

        The script reads the claim keys joined by line breaks: one holding a line break
        (a message id can) is written in a call of its own.

        Raises:
            ConnectionClosed: Redis did not take it (written twice, an outcome is the same).
        """
        plans = [plan for plan in map(plan_of, messages) if plan is not None and plan.key]
        batches = [[plan for plan in plans if "\n" not in plan.key]]
        batches += [[plan] for plan in plans if "\n" in plan.key]
        prefix = keys.done_marks(self.namespace)
        for batch in batches:
            if not batch:
                continue
            try:
                self._record(
                    args=[
                        prefix,
                        "".join(plan.outcome[0] for plan in batch),  # "d"one or "r"elease
                        "\n".join(plan.key for plan in batch),
                        "\n".join(plan.token for plan in batch),
                        "\n".join(str(plan.retention_ms) for plan in batch),
                        b"".join(plan.mark for plan in batch),
                    ]
                )
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

    def _write_settles(self, batch: Sequence[Settle]) -> None:
        """Settle ``batch``: every copy published and confirmed, then every outcome in one call, then the acks.

        Raises:
            ConnectionClosed: RabbitMQ or Redis did not take a step, and nothing after
                it happened. The batch can be written again: a copy already
                confirmed is not sent twice, and an outcome written twice is the same.
        """
        for queue_name, message, command in batch:
            if command == "nack" and self.confirm_delivery and not message.__dict__.get(_DEAD_LETTERED_ATTR):
                keep_failure_reason(message)
                self._publish(message.copy(queue_name=xq_name(q_name(queue_name))))  # raises, as a copy's does
                setattr(message, _DEAD_LETTERED_ATTR, True)
            plan = plan_of(message)
            if plan is None or plan.copy is None:
                continue
            copy = plan.copy
            if command != "requeue":
                self._publish(copy)  # raises, keeping the copy for the batch tried again
                setattr(message, _RETRIED_ATTR, True)
            # Sent, or put back as it was (it runs again itself): the batch tried again sends no copy.
            plan.copy = None
            if command == "requeue":
                self.send_failed(copy, None)
            else:
                self.emit_after("enqueue", copy, plan.delay_ms)
        self._record_plans(message for _, message, _ in batch)
        by_consumer: dict[_Consumer, list[tuple[Any, str]]] = {}
        for _, message, command in batch:
            consumer: _Consumer | None = getattr(message, "_consumer", None)
            if consumer is not None:
                by_consumer.setdefault(consumer, []).append((message, command))
        for consumer, settles in by_consumer.items():
            consumer.ack_on_channel(settles)

    def _give_up_settles(self, batch: Sequence[Settle], error: BaseException) -> None:
        """A batch that can never be written: its unsent copies reported, its messages put back to run again."""
        for _, message, _ in batch:
            plan = plan_of(message)
            if plan is not None and plan.copy is not None:
                self.send_failed(plan.copy, error)
            consumer: _Consumer | None = getattr(message, "_consumer", None)
            if consumer is not None:
                with contextlib.suppress(ConnectionClosed):  # its channel is gone, which puts it back
                    consumer.ack_on_channel([(message, "requeue")])

    def _publish(self, copy: Message[Any]) -> None:
        """Publish an already announced ``copy`` on its queue, confirmed (within ``confirm_timeout_ms``)."""
        try:
            self.declare_queue(q_name(copy.queue_name), ensure=True)
            if self.confirm_delivery:
                self._confirmed([copy])
            else:
                self.channel.basic_publish(
                    exchange="",
                    routing_key=copy.queue_name,
                    body=copy.encode(),
                    properties=pika.BasicProperties(delivery_mode=2, priority=copy.options.get("broker_priority")),
                )
        except (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as exc:
            del self.connection  # the next caller opens new ones
            self.send_failed(copy, exc)
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        except BaseException as exc:
            self.send_failed(copy, exc)
            raise

    def ping_queues(self) -> None:
        # Opens this thread's connection, or reaches the server on the one it has: the health checks
        # ask again every interval, and a connection that broke must not pass for one that answers.
        try:
            self.connection.process_data_events(0)
        except pika.exceptions.AMQPError as exc:
            del self.connection  # the next ping connects anew
            raise BrokerUnreachable(f"RabbitMQ unreachable at {self._where()}: {exc!r}") from None

    def queues_where(self) -> str:
        return f"RabbitMQ {self._where()}"

    def _where(self) -> str:
        parameters = self.parameters if isinstance(self.parameters, list) else [self.parameters]
        return ";".join(f"{p.host}:{p.port}" for p in parameters)

    def dead_letter(self, queue_name: str, message: MessageProxy, reason: str) -> None:
        """Move ``message`` to its queue's dead-letter queue, ``reason`` in its options, counted per task type."""
        kept = message.copy(queue_name=xq_name(q_name(queue_name)), options={DEAD_LETTER_REASON: reason})
        self._publish(kept)
        skipped = keys.skipped(self.namespace)
        try:
            with self.client.pipeline() as pipe:
                pipe.hincrby(skipped, message.actor_name, 1)
                pipe.pexpire(skipped, DEAD_MESSAGE_TTL)
                pipe.execute()
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        self.settle(queue_name, message, "ack")

    def close(self) -> None:
        super().close()
        self.beat(now=True)  # the last counts
        self.client.close()

    @property
    def consumer_class(self) -> type[_Consumer]:
        return _Consumer

    def declare_queue(self, queue_name: str, *, ensure: bool = False) -> None:
        """Dramatiq's, except that a queue only sent to (``ensure``, and no actor here on it) is not
        consumed: it is created on the server without joining ``queues``, whose every
        member the worker consumes."""
        canonical = q_name(queue_name)
        try:
            if ensure and canonical not in self.queues:
                if canonical not in self._sent_only:
                    self._sent_only.add(canonical)
                    self.queues_pending.add(canonical)
                self._ensure_queue(canonical)  # type: ignore[no-untyped-call]
                return
            super().declare_queue(queue_name, ensure=ensure)
        except ConnectionClosed as exc:
            if "cluster_not_formed" not in str(exc):
                raise
            # A quorum queue declared while the majority of its nodes is down.
            raise self._no_quorum(
                [canonical],
                QuorumLost(  # type: ignore[no-untyped-call]
                    f"RabbitMQ at {self._where()} cannot declare queue {canonical!r}: it has lost its quorum "
                    "(cluster_not_formed: a majority of its nodes down)"
                ),
            ) from None

    def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
        arguments: dict[str, Any] = super()._build_queue_arguments(queue_name)  # type: ignore[no-untyped-call]
        arguments["x-queue-type"] = self.queue_type
        return arguments

    def _declare_queue(self, queue_name: str) -> Any:
        declared = super()._declare_queue(queue_name)  # type: ignore[no-untyped-call]
        try:
            self.client.sadd(keys.declared_queues(self.namespace), queue_name)
        except redis.RedisError as exc:
            # Only `dramatiq-gp status` reads it; a send must not fail for it.
            logger.warning("could not record queue %r for dramatiq-gp status in Redis: %s", queue_name, exc)
        return declared

    def _declare_xq_queue(self, queue_name: str) -> Any:
        # As Dramatiq's (a fixed TTL: messages expire head first), of the broker's queue type.
        return self.channel.queue_declare(
            queue=xq_name(queue_name),
            durable=True,
            arguments={"x-message-ttl": DEAD_MESSAGE_TTL, "x-queue-type": self.queue_type},
        )


class _Consumer(_RabbitmqConsumer):
    """Dramatiq's RabbitMQ consumer, reading what has arrived at once, settling on the channel that delivered it.

    Every message pika holds when one arrives is taken with it and handed to the
    middleware's ``after_fetch`` together, as the Redis consumer hands a fetched
    batch: the idempotency claims of those messages take one round trip, and
    strict queue weights learn whether the queue still has a backlog (a wait that
    ends with nothing, after ``worker_timeout``, says it has none).
    """

    broker: RabbitmqBroker

    def __init__(self, broker: RabbitmqBroker, queue_name: str, prefetch: int, timeout: int) -> None:
        super().__init__(broker, queue_name, prefetch, timeout)  # type: ignore[no-untyped-call]
        #: RabbitMQ delivers no more than the prefetch unacked: acks waiting for their window hold deliveries
        #: back, so half of it waiting goes at once (as the Redis consumer fetches again at half its buffer).
        self._send_at = max(1, prefetch // 2)
        self._ready: deque[Any] = deque()
        #: ``(delivery tag, "ack"|"nack"|"requeue")`` to send on the channel at its thread's next turn, in order.
        self._to_settle: list[tuple[int, str]] = []
        #: Acks whose idempotency outcome the connection's thread writes to Redis first (:meth:`record_and_ack`);
        #: their tags stay in ``known_tags`` until it is written, so no multiple ack covers them before.
        self._to_record: list[Any] = []
        #: Guards ``_to_settle`` and ``_to_record`` with ``known_tags``: a tag leaves it as it joins ``_to_settle``.
        self._settle_lock = threading.Lock()
        #: The tags of ``known_tags`` in delivery order (and some settled ones, dropped as the front is read).
        self._delivered: deque[int] = deque()
        #: How long the first settle waits in ``_to_settle`` for others to go with it: the settle window.
        self._window_s = self.broker.settler.window_s if self.broker.settler is not None else 0.0
        #: Acked tags above the oldest unsettled one, waiting to be covered by a multiple ack: tag → windows
        #: waited (the connection's thread's alone, as ``_timer``: whether a send is due at the window's end).
        self._waiting: dict[int, int] = {}
        self._timer = False
        #: The last message received (delay queues: never), and the one the beat last recorded: see ``_fetched``.
        self.last_received: Message[Any] | None = None
        self.last_recorded: Message[Any] | None = None
        self.broker._consumers.add(self)
        #: Whether this is a delay queue's consumer, and the queue whose actors run from it.
        self._delayed, self._home = is_delay_queue(self.queue_name), q_name(self.queue_name)
        if not self._delayed:
            self.broker.register_consumer(self.queue_name)

    def __next__(self) -> Any:
        # Called at least every worker_timeout, busy or idle: the heartbeat's clock.
        self.broker.beat()
        if self._ready:
            return self._ready.popleft()
        accepted = []
        for method, body in self._arrived():
            message = self._accept(method, body)
            if message is not None:
                accepted.append(message)
        for hook in self.broker.hooks("after_fetch"):
            hook(self.broker, self.queue_name, accepted)
        if not accepted:
            return None
        self._ready.extend(accepted[1:])
        return accepted[0]

    def _arrived(self) -> list[tuple[Any, bytes]]:
        """The next message (waiting up to the timeout), and every one pika already holds after it."""
        try:
            method, _properties, body = next(self.iterator)
            if method is None:
                return []
            arrived = [(method, body)]
            for _ in range(self.channel.get_waiting_message_count()):
                method, _properties, body = next(self.iterator)  # there: no wait
                arrived.append((method, body))
            return arrived
        except (AssertionError, pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as exc:
            if getattr(exc, "reply_code", None) == 404:  # the queue is gone: declare it again
                self.broker.queues_pending.add(q_name(self.queue_name))
            # What arrived with it is unacked on this channel, which closes with the consumer: it comes back.
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

    def _accept(self, method: Any, body: bytes) -> Any:
        """The message for the worker threads, or None: set aside (undecodable, malformed) or held (unknown type).

        Dramatiq logs a traceback for an undecodable message, and takes a malformed
        one to a worker thread; here it goes to the dead-letter queue with one error line.
        """
        try:
            decoded = Message.decode(body)
            problem = malformed(decoded)
        except DecodeError as exc:
            problem = f"cannot decode it ({decode_cause(exc)})"
        if problem:
            # Unsettled until its copy is confirmed and it is acked: no ack of a later tag may cover it.
            self.known_tags.add(method.delivery_tag)
            self._delivered.append(method.delivery_tag)
            # The bytes stay out of the line (they may be a payload); the dead-letter queue keeps them.
            logger.error(
                "a message on queue %r is malformed: %s; moved to the dead-letter queue", self.queue_name, problem
            )
            self._set_aside(method.delivery_tag, body, malformed_reason(problem))
            return None
        message: Any = _RabbitmqMessage(method.redelivered, method.delivery_tag, decoded)  # type: ignore[no-untyped-call]
        self.known_tags.add(method.delivery_tag)
        self._delivered.append(method.delivery_tag)
        message._consumer = self
        if not self._delayed:
            self.last_received = decoded  # what the beat records: one assignment, no work per message
        return message if self.broker.admit(self, message, self._home, self._delayed) else None

    def _set_aside(self, tag: int, body: bytes, reason: str) -> None:
        """Publish ``body`` to the dead-letter queue, ``reason`` in a header, confirmed, then ack it (a nack's dead
        letter may be lost)."""
        if self.broker.confirm_delivery:
            queue = xq_name(q_name(self.queue_name))
            self.broker.declare_queue(q_name(self.queue_name), ensure=True)
            # As it came: it may be no message. Raises ConnectionClosed: it stays unacked, and comes back.
            self.broker._confirmed_bodies([(queue, body, None)], {DEAD_LETTER_REASON: reason})
            command = "ack"
        else:
            command = "nack"
        with self._settle_lock:
            self.known_tags.discard(tag)
            self._to_settle.append((tag, command))
        self._send_settles()  # this is the connection's thread

    def wake(self) -> None:
        """End the wait for messages now: the worker is stopping this consumer.

        pika's connection is this consumer's thread's alone, so the cancel runs
        there, from the wait it ends; pika gives back what it held undelivered,
        and the consumer's iterator ends.
        """
        with contextlib.suppress(pika.exceptions.AMQPError):  # closed: the wait has ended already
            self.connection.add_callback_threadsafe(self._cancel)

    def _cancel(self) -> None:
        with contextlib.suppress(pika.exceptions.AMQPError):  # closed meanwhile: it gave back what it held
            self.channel.cancel()

    def ack(self, message: Any) -> None:
        self.broker.settle_soon(self.queue_name, message, "ack")

    def nack(self, message: Any) -> None:
        self.broker.settle_soon(self.queue_name, message, "nack")

    def dead_letter(self, message: Any, reason: str) -> None:
        self.broker.dead_letter(self.queue_name, message, reason)

    def requeue(self, messages: Iterable[Any]) -> None:
        """Put back what the worker fetched and did not start; a claimed one's claim is released first.

        Dramatiq's is a no-op (a closing channel gives its unacked messages back),
        but a message claimed as it was fetched would then wait for its claim to lapse.
        """
        for message in messages:
            if plan_of(message) is not None:
                self.broker.settle(self.queue_name, message, "requeue")

    def close(self) -> None:
        """Hand over the pending settles first: a graceful stop leaves nothing to run again.

        What waits for its window is sent with the callbacks Dramatiq's ``close`` runs before it closes.
        """
        self.broker.flush_settles(retry=False)
        self._window_s = 0.0
        with contextlib.suppress(pika.exceptions.AMQPError):  # closed: nothing it held is acked, all comes back
            self.connection.add_callback_threadsafe(self._send_settles)
        self.broker._consumers.discard(self)
        super().close()  # type: ignore[no-untyped-call]

    def ack_on_channel(self, settles: Sequence[tuple[Any, str]]) -> None:
        """Ack, nack (to the dead-letter queue) or put back (``"requeue"``) messages this consumer delivered.

        The last step of a settle. The connection is this consumer's thread's, so they
        wait in ``_to_settle`` for its turn: the thread that adds the first of them wakes
        it (``add_callback_threadsafe``), which sends them once the settle window has
        passed, with those added meanwhile; half the prefetch waiting is sent at once.
        """
        if self.connection.is_closed:
            # Its channel closed with it: RabbitMQ has put the messages back.
            logger.warning(
                "not settling %d message(s) of queue %r (%s): the channel that delivered them has closed, "
                "so RabbitMQ has put them back and they will run again",
                len(settles),
                self.queue_name,
                ", ".join(message.message_id for message, _ in settles),
            )
            return
        settled = []
        with self._settle_lock:
            before = len(self._to_settle) + len(self._to_record)
            for message, command in settles:
                tag = message._tag
                if tag not in self.known_tags:
                    logger.warning(
                        "not settling message %s of queue %r: already settled", message.message_id, self.queue_name
                    )
                    continue
                self.known_tags.discard(tag)
                acked = command == "ack" or message.__dict__.get(_DEAD_LETTERED_ATTR)
                self._to_settle.append((tag, "ack" if acked else command))
                settled.append((message, command))
            after = before + len(settled)
        self.broker.count_settled(self.queue_name, settled)
        self._hand_over(before, after)

    def record_and_ack(self, message: Any) -> None:
        """Ack ``message`` once its idempotency outcome is in Redis, both from the connection's thread.

        It waits with the acks of its window (:meth:`ack_on_channel`); at the window's end the
        connection's thread writes the outcomes of all that wait in one call, then acks them with
        the rest: one thread and one wait per window, where the settler's thread would add
        another of each. Should Redis not take them, they go to the settler, which tries again.
        """
        if self.connection.is_closed:
            self.ack_on_channel([(message, "ack")])  # logs that it is not settled
            return
        with self._settle_lock:
            if message._tag not in self.known_tags:
                logger.warning(
                    "not settling message %s of queue %r: already settled", message.message_id, self.queue_name
                )
                return
            before = len(self._to_settle) + len(self._to_record)
            self._to_record.append(message)
        self._hand_over(before, before + 1)

    def _hand_over(self, before: int, after: int) -> None:
        """Wake the connection's thread for what waits: at once at half the prefetch, else after the window."""
        if before < self._send_at <= after:
            send = self._send_settles
        elif before == 0 < after:
            send = self._send_soon
        else:
            return  # a hand-over is on its way and takes these too
        try:
            self.connection.add_callback_threadsafe(send)
        except (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

    def _record(self) -> None:
        """Write the outcomes waiting in ``_to_record`` in one call, and move their acks to ``_to_settle``."""
        with self._settle_lock:
            messages, self._to_record = self._to_record, []
        try:
            self.broker._record_plans(messages)
        except Exception:  # the settler retries it, logs, or gives up, as with its own batches
            settler = self.broker.settler
            assert settler is not None  # record_and_ack is used with a settle window only
            for message in messages:
                settler.add((self.queue_name, message, "ack"))
            return
        settles = [(message, "ack") for message in messages]
        with self._settle_lock:
            for message, _ in settles:
                self.known_tags.discard(message._tag)
                self._to_settle.append((message._tag, "ack"))
        self.broker.count_settled(self.queue_name, settles)

    def _send_soon(self) -> None:
        """On the connection's thread: send what waits in ``_to_settle`` once the settle window has passed."""
        if not self._window_s:
            self._send_settles()
        elif not self._timer:
            self._timer = True
            self.connection.call_later(self._window_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = False
        self._send_settles()

    def _send_settles(self) -> None:
        """Send what waits in ``_to_settle``, on the connection's thread.

        The acks below the oldest tag still unsettled go as one ``basic.ack`` with
        ``multiple``: every tag under it is settled, in this batch or on the wire
        already (a tag leaves ``known_tags`` only as its settle joins ``_to_settle``,
        under one lock, and batches are sent in order). Nacks go first, one each,
        so the multiple ack never covers a message meant for the dead-letter queue
        or to go back. An ack above the oldest unsettled tag waits up to
        :data:`ACK_WAIT_WINDOWS` windows more to be covered the same way (most are:
        the oldest finishes meanwhile), then goes on its own.
        """
        if self._to_record:
            self._record()
        with self._settle_lock:
            batch, self._to_settle = self._to_settle, []
            delivered = self._delivered
            while delivered and delivered[0] not in self.known_tags:
                delivered.popleft()
            oldest = delivered[0] if delivered else None
        waiting, self._waiting = self._waiting, {}
        upto = 0
        for tag, command in batch:
            if command != "ack":
                self.channel.basic_nack(tag, requeue=command == "requeue")
            else:
                waiting[tag] = 0
        for tag, windows in waiting.items():
            if oldest is None or tag < oldest:
                upto = max(upto, tag)
            elif self._window_s and windows < ACK_WAIT_WINDOWS:
                self._waiting[tag] = windows + 1
            else:
                self.channel.basic_ack(tag)
        if upto:
            self.channel.basic_ack(upto, multiple=True)
        if self._waiting and not self._timer:
            self._timer = True
            self.connection.call_later(self._window_s, self._on_timer)
