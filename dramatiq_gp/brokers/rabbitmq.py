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
* **An ack or nack goes to the channel that delivered the message**, or nowhere.
  Delivery tags are numbered per channel from 1; after a reconnect Dramatiq acks
  a message fetched on the old channel with the *new* consumer, where the same
  tag may name a different message, which is then acked without having run.
  RabbitMQ put the old channel's unacked messages back when it closed, so
  there is nothing left to settle for them.

* It is a :class:`~dramatiq_gp.brokers.base.KitBroker`: ``client`` is the Redis/Valkey
  beside it for the coordination state (idempotency claims and done marks). A
  message is settled in this order: a retry's or deferral's copy is published to
  the delay queue and confirmed, then the idempotency outcome is written to
  Redis (``rabbitmq/record.lua``), then the message is acked. A crash in between
  leaves the message unacked, so it comes back: at least once, never lost.

The Dramatiq internals relied on (Dramatiq 2.2, pinned by
``tests/test_rabbitmq.py``): ``RabbitmqBroker._build_queue_arguments`` and
``_declare_xq_queue``, ``consumer_class``, ``_RabbitmqConsumer`` (its constructor,
``__next__`` returning a ``_RabbitmqMessage`` with ``_tag``, ``ack``/``nack``
by ``_tag`` and ``known_tags``), and the worker settling a message through the
consumer its queue has *now* (``Worker.consumers[queue].consumer``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

import pika
import pika.exceptions
import redis
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.rabbitmq import DEAD_MESSAGE_TTL, _RabbitmqConsumer, _RabbitmqMessage
from dramatiq.brokers.rabbitmq import RabbitmqBroker as DramatiqRabbitmqBroker
from dramatiq.common import q_name, xq_name
from dramatiq.errors import ConnectionClosed, DecodeError

from .. import keys
from ..errors import BrokerUnreachable, ConfigError
from ..lua import scripts
from .base import DEAD_LETTER_REASON, KitBroker, decode_cause, malformed, settlement

logger = logging.getLogger(__name__)

_SCRIPTS = scripts(__file__)

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
        **options: :class:`dramatiq.brokers.rabbitmq.RabbitmqBroker`'s (``url``,
            ``middleware``, ``max_priority`` with classic queues, pika's parameters).

    Raises:
        ConfigError: an unknown ``queue_type``, or ``max_priority`` with quorum queues.
    """

    def __init__(
        self,
        *,
        client: redis.Redis | None = None,
        namespace: str = "dramatiq",
        unknown_task_grace_ms: int = 300_000,
        queue_type: str = "quorum",
        confirm_delivery: bool = True,
        **options: Any,
    ) -> None:
        if queue_type not in QUEUE_TYPES:
            raise ConfigError(f"queue_type {queue_type!r}: expected one of {', '.join(QUEUE_TYPES)}")
        if queue_type == "quorum" and options.get("max_priority") is not None:
            raise ConfigError("max_priority needs queue_type='classic': quorum queues refuse x-max-priority")
        super().__init__(confirm_delivery=confirm_delivery, **options)
        self.queue_type: QueueType = queue_type
        self.client = client if client is not None else redis.Redis()
        self.namespace = namespace
        self.unknown_task_grace_ms = unknown_task_grace_ms
        self._record = self.client.register_script(_SCRIPTS["record"])

    def enqueue_many(self, messages: Sequence[Message[Any]]) -> list[Message[Any]]:
        """Enqueue ``messages`` one by one, each confirmed by RabbitMQ before the next."""
        return [self.enqueue(message) for message in messages]

    def settle(self, queue_name: str, message: MessageProxy, command: str) -> None:
        """Ack, nack or requeue ``message``: its copy confirmed first, then its outcome recorded, then it.

        Raises:
            ConnectionClosed: RabbitMQ or Redis did not take a step; the message stays
                unacked (Dramatiq tries again; a closed channel gives it back).
        """
        plan = settlement(message)
        if plan is not None and plan.redeliver is not None:
            copy = plan.redeliver
            if command != "requeue":
                self._publish(copy)  # raises, keeping the copy for the settle tried again
            # Sent, or put back as it was (it runs again itself): a settle tried again sends no copy.
            plan.redeliver = None
            if command == "requeue":
                self.send_failed(copy, None)
            else:
                self.emit_after("enqueue", copy, plan.delay_ms)
        if plan is not None and plan.key:
            try:
                self._record(keys=[plan.key], args=[plan.outcome, plan.token, plan.retention_ms])
            except redis.ConnectionError as exc:
                raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        consumer: _Consumer | None = getattr(message, "_consumer", None)
        if consumer is not None:
            consumer.settle_on_channel(message, command)

    def settle_soon(self, queue_name: str, message: MessageProxy, command: str) -> None:
        self.settle(queue_name, message, command)

    def flush_settles(self, *, retry: bool = True) -> bool:
        return True

    def _publish(self, copy: Message[Any]) -> None:
        """Publish an already announced ``copy`` on its queue, confirmed."""
        try:
            self.declare_queue(q_name(copy.queue_name), ensure=True)
            self.channel.basic_publish(
                exchange="",
                routing_key=copy.queue_name,
                body=copy.encode(),
                properties=pika.BasicProperties(delivery_mode=2, priority=copy.options.get("broker_priority")),
                mandatory=self.confirm_delivery,
            )
        except (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as exc:
            del self.connection  # the next caller opens new ones
            if isinstance(exc, pika.exceptions.UnroutableError):  # its queue is gone: declare it again
                self.queues_pending.add(q_name(copy.queue_name))
            self.send_failed(copy, exc)
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        except BaseException as exc:
            self.send_failed(copy, exc)
            raise

    def ping_queues(self) -> None:
        try:
            self.connection  # noqa: B018 (opens this thread's connection)
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnreachable(f"RabbitMQ unreachable at {self._where()}: {exc!r}") from None

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
        self.client.close()

    @property
    def consumer_class(self) -> type[_Consumer]:
        return _Consumer

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
    """Dramatiq's RabbitMQ consumer, settling through the broker, on the channel that delivered the message."""

    broker: RabbitmqBroker

    def __next__(self) -> Any:
        """Dramatiq's, except that a message that cannot be decoded or is malformed goes to the
        dead-letter queue with one error line (Dramatiq logs a traceback, and takes a malformed
        one to a worker thread)."""
        try:
            method, _properties, body = next(self.iterator)
            if method is None:
                return None
        except (AssertionError, pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as exc:
            if getattr(exc, "reply_code", None) == 404:  # the queue is gone: declare it again
                self.broker.queues_pending.add(q_name(self.queue_name))
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        try:
            message: Any = _RabbitmqMessage(method.redelivered, method.delivery_tag, Message.decode(body))  # type: ignore[no-untyped-call]
            problem = malformed(message)
        except DecodeError as exc:
            problem = f"cannot decode it ({decode_cause(exc)})"
        if problem:
            # The bytes stay out of the line (they may be a payload); the dead-letter queue keeps them.
            logger.error(
                "a message on queue %r is malformed: %s; moved to the dead-letter queue", self.queue_name, problem
            )
            self._nack(method.delivery_tag)  # type: ignore[no-untyped-call]
            return None
        self.known_tags.add(method.delivery_tag)
        message._consumer = self
        if not self.queue_name.endswith(".DQ") and message.actor_name not in self.broker.actors:
            # Delayed messages are only parked in the consumer; they are checked when they come due.
            self.broker.hold_or_skip_unknown(self, message)
            return None
        return message

    def ack(self, message: Any) -> None:
        self.broker.settle(self.queue_name, message, "ack")

    def nack(self, message: Any) -> None:
        self.broker.settle(self.queue_name, message, "nack")

    def dead_letter(self, message: Any, reason: str) -> None:
        self.broker.dead_letter(self.queue_name, message, reason)

    def settle_on_channel(self, message: Any, command: str) -> None:
        """Ack, nack (to the dead-letter queue) or put back ``message``, which this consumer delivered."""
        if self.connection.is_closed:
            # Its channel closed with it: RabbitMQ has put the message back.
            logger.warning(
                "not settling message %s of queue %r: the channel that delivered it has closed, "
                "so RabbitMQ has put it back and it will run again",
                message.message_id, self.queue_name,
            )  # fmt: skip
            return
        if command == "ack":
            super().ack(message)  # type: ignore[no-untyped-call]
        elif command == "nack":
            super().nack(message)  # type: ignore[no-untyped-call]
        else:
            try:
                self.known_tags.discard(message._tag)
                self.connection.add_callback_threadsafe(partial(self.channel.basic_nack, message._tag, requeue=True))
            except (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as exc:
                raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
