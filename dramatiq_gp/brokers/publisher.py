"""Streamed publisher confirms: a batch published at once, then its confirms awaited together.

pika's ``BlockingChannel`` in confirm mode waits for each message's confirm before
the next ``basic_publish`` returns: a round trip to RabbitMQ (and, for a quorum
queue, a write to its replicas' log) per message, so an outbox relay moving a
batch of 500 waits 500 times. :class:`BatchPublisher` puts the channel in confirm
mode itself, publishes the whole batch, and then waits until RabbitMQ has
confirmed every delivery tag (it confirms several at once, ``multiple``).

The batch goes out as one write. pika's ``basic_publish`` hands each of a
message's three frames (method, header, body) to its transport separately, and
the transport sends each with a ``send`` of its own: 1,500 system calls for a
batch of 500, each a TCP segment RabbitMQ reads on its own, which took 60% of
the relay's CPU. :class:`BatchPublisher` marshals the frames itself, from parts
built once (a queue's publish method frame, the properties of each priority),
and writes the batch's bytes to the transport at once.

The pika internals relied on (pika 1.3, pinned by ``tests/test_rabbitmq.py``):
``BlockingChannel._impl`` (the asynchronous ``pika.channel.Channel`` behind it) and
its ``confirm_delivery(ack_nack_callback, callback)`` and
``add_on_return_callback``; ``BlockingConnection._flush_output(*waiters)``, which
runs the I/O until a waiter is true (as ``BlockingChannel`` waits for a confirm),
``BlockingConnection._impl.ioloop`` (``call_later``, ``remove_timeout``),
``BlockingConnection._impl._terminate_stream(error)``, which drops the TCP stream
without the closing handshake (pika's own way out when heartbeats stop),
``BlockingConnection._impl._output_marshaled_frames(frames)``, which hands marshaled
bytes to the transport and counts them, and ``_body_max_length``, the largest
body frame payload the connection negotiated (its ``frame_max`` less 8 bytes).
The frames are those of ``Connection._send_message`` (``pika.frame``'s
``Method``, ``Header`` and ``Body``), byte for byte: a test compares them.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from typing import Any

import pika
import pika.exceptions
import pika.frame
import pika.spec
from pika.adapters.blocking_connection import BlockingConnection

#: How long a batch may wait for its confirms before it counts as not sent (``RABBITMQ_CONFIRM_TIMEOUT``).
CONFIRM_TIMEOUT_S = 10.0


#: Every message persistent, as Dramatiq's; a priority where the sender gave one.
_DELIVERY_MODE = 2
_FRAME_END = bytes([pika.spec.FRAME_END])
#: A frame's header: its type, channel and payload size (``pika.frame.Frame._marshal``).
_FRAME_HEAD = struct.Struct(">BHI")
#: A content header's start: the class id, the weight (0) and the body size (``pika.frame.Header.marshal``).
_CONTENT_HEAD = struct.Struct(">HxxQ")


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
        self._floor = 1  # the lowest tag a multiple confirm has not yet covered
        self._outstanding: set[int] = set()
        self._problems: list[str] = []
        self._number: int = self.channel.channel_number
        self._body_max: int = connection._impl._body_max_length
        #: A queue's marshaled publish method frame; a priority's encoded properties.
        self._methods: dict[str, bytes] = {}
        self._properties: dict[int | None, bytes] = {}
        selected: list[Any] = []
        self.channel._impl.confirm_delivery(ack_nack_callback=self._on_confirm, callback=selected.append)
        self.channel._impl.add_on_return_callback(self._on_return)
        self._wait(lambda: bool(selected), "confirm mode")

    @property
    def usable(self) -> bool:
        return bool(self.connection.is_open and self.channel.is_open)

    def publish(self, items: Sequence[tuple[str, bytes, int | None]], headers: dict[str, Any] | None = None) -> None:
        """Publish each ``(queue, body, priority)`` and return once RabbitMQ has confirmed them all.

        ``headers``: AMQP headers for each of them (a dead letter's reason; the relay's batches have none).

        Raises:
            NoReply: some were not confirmed within the timeout.
            NotConfirmed: a message was refused or could not be routed (its queue is gone).
            pika.exceptions.AMQPError: the channel or the connection closed first.
        """
        if not self.channel.is_open:
            raise pika.exceptions.ChannelWrongStateError("the publisher's channel is closed")
        if not self.connection.is_open:
            raise pika.exceptions.ConnectionWrongStateError("the publisher's connection is closed")
        self._problems.clear()
        frames: list[bytes] = []
        for queue, body, priority in items:
            frames += self._frames(queue, body, priority, headers)
        first = self._published + 1
        self._published += len(items)
        self._outstanding.update(range(first, self._published + 1))
        if frames:
            self.connection._impl._output_marshaled_frames([b"".join(frames)])
        self._wait(lambda: not self._outstanding, f"the confirms of {len(items)} message(s)")
        if self._problems:
            raise NotConfirmed(f"{len(self._problems)} message(s) not taken: {self._problems[0]}")

    def _frames(self, queue: str, body: bytes, priority: int | None, headers: dict[str, Any] | None) -> list[bytes]:
        """The frames ``basic_publish(exchange="", routing_key=queue, mandatory=True)`` would send."""
        method = self._methods.get(queue)
        if method is None:
            publish = pika.spec.Basic.Publish(exchange="", routing_key=queue, mandatory=True)
            method = self._methods[queue] = pika.frame.Method(self._number, publish).marshal()
        if headers:
            with_headers = pika.spec.BasicProperties(delivery_mode=_DELIVERY_MODE, priority=priority, headers=headers)
            properties = b"".join(with_headers.encode())
        else:
            cached = self._properties.get(priority)
            if cached is None:
                encoded = pika.spec.BasicProperties(delivery_mode=_DELIVERY_MODE, priority=priority).encode()
                cached = self._properties[priority] = b"".join(encoded)
            properties = cached
        size = len(body)
        header = _CONTENT_HEAD.pack(pika.spec.BasicProperties.INDEX, size) + properties
        frames = [method, _FRAME_HEAD.pack(pika.spec.FRAME_HEADER, self._number, len(header)), header, _FRAME_END]
        step = self._body_max
        for start in range(0, size, step):
            chunk = body[start : start + step]
            frames += (_FRAME_HEAD.pack(pika.spec.FRAME_BODY, self._number, len(chunk)), chunk, _FRAME_END)
        return frames

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
        before = len(self._outstanding)
        if method.multiple:
            # Every tag below the floor is confirmed: each multiple confirm walks only the tags new to it.
            self._outstanding.difference_update(range(self._floor, method.delivery_tag + 1))
            self._floor = max(self._floor, method.delivery_tag + 1)
        else:
            self._outstanding.discard(method.delivery_tag)
        if isinstance(method, pika.spec.Basic.Nack):
            self._problems.append(f"RabbitMQ refused {before - len(self._outstanding)} (nack)")

    def _on_return(self, _channel: Any, method: Any, _properties: Any, _body: bytes) -> None:
        # A return comes before the ack of the same message: it was confirmed, and went nowhere.
        self._problems.append(f"unroutable to queue {method.routing_key!r} ({method.reply_text})")
