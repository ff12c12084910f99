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

The Dramatiq internals relied on (Dramatiq 2.2, pinned by
``tests/test_rabbitmq.py``): ``RabbitmqBroker._build_queue_arguments`` and
``_declare_xq_queue``, ``consumer_class``, ``_RabbitmqConsumer`` (its constructor,
``__next__`` returning a ``_RabbitmqMessage`` with ``_tag``, ``ack``/``nack``
by ``_tag`` and ``known_tags``), and the worker settling a message through the
consumer its queue has *now* (``Worker.consumers[queue].consumer``).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from dramatiq.brokers.rabbitmq import DEAD_MESSAGE_TTL, _RabbitmqConsumer
from dramatiq.brokers.rabbitmq import RabbitmqBroker as DramatiqRabbitmqBroker
from dramatiq.common import xq_name

from ..errors import ConfigError

logger = logging.getLogger(__name__)

QueueType = Literal["quorum", "classic"]
QUEUE_TYPES: tuple[QueueType, ...] = ("quorum", "classic")


class RabbitmqBroker(DramatiqRabbitmqBroker):
    """Dramatiq's RabbitMQ broker with quorum queues and publisher confirms by default.

    Parameters:
        queue_type: ``"quorum"`` (replicated; the default) or ``"classic"``.
        confirm_delivery: wait for RabbitMQ's confirm of every send (default on).
        **options: :class:`dramatiq.brokers.rabbitmq.RabbitmqBroker`'s (``url``,
            ``middleware``, ``max_priority`` with classic queues, pika's parameters).

    Raises:
        ConfigError: an unknown ``queue_type``, or ``max_priority`` with quorum queues.
    """

    def __init__(self, *, queue_type: str = "quorum", confirm_delivery: bool = True, **options: Any) -> None:
        if queue_type not in QUEUE_TYPES:
            raise ConfigError(f"queue_type {queue_type!r}: expected one of {', '.join(QUEUE_TYPES)}")
        if queue_type == "quorum" and options.get("max_priority") is not None:
            raise ConfigError("max_priority needs queue_type='classic': quorum queues refuse x-max-priority")
        super().__init__(confirm_delivery=confirm_delivery, **options)
        self.queue_type: QueueType = queue_type

    @property
    def consumer_class(self) -> type[_Consumer]:
        return _Consumer

    def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
        arguments: dict[str, Any] = super()._build_queue_arguments(queue_name)  # type: ignore[no-untyped-call]
        arguments["x-queue-type"] = self.queue_type
        return arguments

    def _declare_xq_queue(self, queue_name: str) -> Any:
        # As Dramatiq's (a fixed TTL: messages expire head first), of the broker's queue type.
        return self.channel.queue_declare(
            queue=xq_name(queue_name),
            durable=True,
            arguments={"x-message-ttl": DEAD_MESSAGE_TTL, "x-queue-type": self.queue_type},
        )


class _Consumer(_RabbitmqConsumer):
    """Dramatiq's RabbitMQ consumer; a message is settled only on the channel that delivered it."""

    def __next__(self) -> Any:
        message = super().__next__()  # type: ignore[no-untyped-call]
        if message is not None:
            message._consumer = self
        return message

    def ack(self, message: Any) -> None:
        if self._delivered(message):
            super().ack(message)  # type: ignore[no-untyped-call]

    def nack(self, message: Any) -> None:
        if self._delivered(message):
            super().nack(message)  # type: ignore[no-untyped-call]

    def _delivered(self, message: Any) -> bool:
        if getattr(message, "_consumer", self) is self:
            return True
        # Its channel closed with the consumer that fetched it: RabbitMQ has put it back.
        logger.warning(
            "not settling message %s of queue %r: the channel that delivered it has closed, "
            "so RabbitMQ has put it back and it will run again",
            message.message_id, self.queue_name,
        )  # fmt: skip
        return False
