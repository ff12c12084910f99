"""Streamed publisher confirms: a batch published at once, then its confirms awaited together.

pika's ``BlockingChannel`` in confirm mode waits for each message's confirm before
the next ``basic_publish`` returns: a round trip to RabbitMQ (and, for a quorum
queue, a write to its replicas' log) per message, so an outbox relay moving a
batch of 500 waits 500 times. :class:`BatchPublisher` puts the channel in confirm
mode itself, publishes the whole batch, and then waits until RabbitMQ has
confirmed every delivery tag (it confirms several at once, ``multiple``).

The pika internals relied on (pika 1.3, pinned by ``tests/test_rabbitmq.py``):
``BlockingChannel._impl`` (the asynchronous ``pika.channel.Channel`` behind it) and
its ``confirm_delivery(ack_nack_callback, callback)``, ``basic_publish`` and
``add_on_return_callback``; ``BlockingConnection._flush_output(*waiters)``, which
runs the I/O until a waiter is true (as ``BlockingChannel`` waits for a confirm),
``BlockingConnection._impl.ioloop`` (``call_later``, ``remove_timeout``), and
``BlockingConnection._impl._terminate_stream(error)``, which drops the TCP stream
without the closing handshake (pika's own way out when heartbeats stop).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingConnection

#: How long a batch may wait for its confirms before it counts as not sent (``RABBITMQ_CONFIRM_TIMEOUT``).
CONFIRM_TIMEOUT_S = 10.0


class NotConfirmed(pika.exceptions.AMQPChannelError):  # type: ignore[misc]
    """RabbitMQ refused (nack) or could not route (return) a message of the batch, or never confirmed it."""


class NoReply(NotConfirmed):
    """RabbitMQ did not confirm within the timeout: a quorum queue without a majority of its nodes takes
    a message and neither confirms nor refuses it until the majority is back."""


class BatchPublisher:
    """A channel of ``connection`` in confirm mode, publishing batches and awaiting their confirms together.

    Parameters:
        connection: a thread's connection.
        timeout_s: how long a batch waits for its confirms (:class:`NoReply` after).
    """

    def __init__(self, connection: BlockingConnection, timeout_s: float = CONFIRM_TIMEOUT_S) -> None:
        self.connection = connection
        self.timeout_s = timeout_s
        self.channel = connection.channel()
        self._published = 0  # the last delivery tag handed out
        self._outstanding: set[int] = set()
        self._problems: list[str] = []
        selected: list[Any] = []
        self.channel._impl.confirm_delivery(ack_nack_callback=self._on_confirm, callback=selected.append)
        self.channel._impl.add_on_return_callback(self._on_return)
        self._wait(lambda: bool(selected), "confirm mode")

    @property
    def usable(self) -> bool:
        return bool(self.connection.is_open and self.channel.is_open)

    def publish(self, items: Sequence[tuple[str, bytes, pika.BasicProperties]]) -> None:
        """Publish each ``(queue, body, properties)`` and return once RabbitMQ has confirmed them all.

        Raises:
            NoReply: some were not confirmed within the timeout.
            NotConfirmed: a message was refused or could not be routed (its queue is gone).
            pika.exceptions.AMQPError: the channel or the connection closed first.
        """
        self._problems.clear()
        for queue, body, properties in items:
            self.channel._impl.basic_publish("", queue, body, properties, mandatory=True)
            self._published += 1
            self._outstanding.add(self._published)
        self._wait(lambda: not self._outstanding, f"the confirms of {len(items)} message(s)")
        if self._problems:
            raise NotConfirmed(f"{len(self._problems)} message(s) not taken: {self._problems[0]}")

    def close(self) -> None:
        if self.channel.is_open:
            self.channel.close()

    def _wait(self, done: Any, what: str) -> None:
        """Run the connection's I/O until ``done()``, the channel closes, or the timeout passes.

        ``process_data_events(time_limit)`` would run out its whole time limit: a
        confirm is handled by the channel, not dispatched to the blocking layer, so
        it does not end the wait. The blocking layer's own waits (a confirm, a
        declare) run ``_flush_output`` with a predicate, as this does.
        """
        expired: list[bool] = []
        timer = self.connection._impl.ioloop.call_later(self.timeout_s, lambda: expired.append(True))
        try:
            self.connection._flush_output(lambda: bool(done() or expired or self.channel.is_closed))
        finally:
            self.connection._impl.ioloop.remove_timeout(timer)
        if self.channel.is_closed:
            raise pika.exceptions.ChannelClosed(-1, f"the channel closed while waiting for {what}")
        if not done():
            error = NoReply(f"no reply from RabbitMQ to {what} within {self.timeout_s:g} s")
            self._abandon(error)
            raise error

    def _abandon(self, error: NoReply) -> None:
        """Drop the connection at once (its TCP stream), as pika does when heartbeats stop.

        Closing it would close this channel first, and RabbitMQ answers that close
        only once the channel's unconfirmed messages are settled: 63 s, measured,
        into a lost quorum, for every channel closed.
        """
        self.connection._impl._terminate_stream(error)
        with contextlib.suppress(pika.exceptions.AMQPError):
            self.connection._flush_output(lambda: self.connection.is_closed)

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tags = {t for t in self._outstanding if t <= method.delivery_tag} if method.multiple else {method.delivery_tag}
        self._outstanding -= tags
        if isinstance(method, pika.spec.Basic.Nack):
            self._problems.append(f"RabbitMQ refused {len(tags)} (nack)")

    def _on_return(self, _channel: Any, method: Any, _properties: Any, _body: bytes) -> None:
        # A return comes before the ack of the same message: it was confirmed, and went nowhere.
        self._problems.append(f"unroutable to queue {method.routing_key!r} ({method.reply_text})")
