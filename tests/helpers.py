"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa

import dramatiq_gp as gp
from dramatiq_gp import keys

#: The RabbitMQ the tests use (``RABBITMQ_URL``; the local one by default).
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def close_broker(broker: Any) -> None:
    """Close ``broker`` and its Redis connections: Dramatiq's own ``RedisBroker.close()`` leaves them open (and
    so does its client's ``close()``, the pool not being the client's own), and a connection left to the garbage
    collector warns of its socket in whichever test collects it."""
    broker.close()
    client = getattr(broker, "client", None)
    if client is not None:
        client.connection_pool.disconnect()


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll ``condition`` until it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {condition}")
        time.sleep(interval)


def messages_of(caplog: pytest.LogCaptureFixture, logger: str, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(logger) and r.levelno >= level]


@contextlib.contextmanager
def own_database(server_url: str) -> Iterator[str]:
    """The URL of a new, empty database on the PostgreSQL server at ``server_url``, dropped afterwards."""
    server = sa.make_url(server_url)
    name = f"gpt_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


@functools.cache
def rabbitmq_unreachable(url: str = RABBITMQ_URL) -> str | None:
    """Why the RabbitMQ at ``url`` cannot be used (``no RabbitMQ at 127.0.0.1:5672``), or None if it answers."""
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=1).close()
    except OSError:
        return f"no RabbitMQ at {parts.netloc.split('@')[-1]}"
    return None


def ready(kit: gp.Kit, queue_name: str = "default") -> int:
    """How many messages wait in ``queue_name`` to be fetched, on either broker."""
    if isinstance(kit.broker, gp.RabbitmqBroker):
        return kit.broker.get_queue_message_counts(queue_name)[0]
    return int(kit.broker.client.llen(keys.queue(kit.broker.namespace, queue_name)))


def delayed(kit: gp.Kit, queue_name: str = "default") -> int:
    """How many messages wait in the delay queue of ``queue_name``.

    On RabbitMQ only those no worker has fetched: a worker holds the ones it fetched until they are due.
    """
    if isinstance(kit.broker, gp.RabbitmqBroker):
        return kit.broker.get_queue_message_counts(queue_name)[1]
    return int(kit.broker.client.zcard(keys.delay_queue(kit.broker.namespace, queue_name)))


def dead(kit: gp.Kit, queue_name: str = "default") -> int:
    """How many messages the dead-letter queue of ``queue_name`` holds, on either broker."""
    if isinstance(kit.broker, gp.RabbitmqBroker):
        return kit.broker.get_queue_message_counts(queue_name)[2]
    return int(kit.broker.client.zcard(keys.dead(kit.broker.namespace, queue_name)))


def stored_dead_letter(id: str, args: str = '["c1"]', **options: Any) -> str:
    """The message of dead letter ``id`` as Dramatiq's Redis broker stores it; ``args`` as JSON text (it may be
    deeper than ``json.dumps`` goes)."""
    options = {"redis_message_id": id, "retries": 1,
               "traceback": 'Traceback (most recent call last):\n  File "x.py", line 1, in charge\n'
                            "RuntimeError: the card was declined\n", **options}  # fmt: skip
    return (f'{{"queue_name": "default", "actor_name": "charge", "args": {args}, "kwargs": {{}}, '
            f'"options": {json.dumps(options)}, "message_id": "m-{id}", "message_timestamp": 0}}')  # fmt: skip


def bury(client: Any, namespace: str, queue: str, id: str, stored: str | bytes) -> None:
    """A dead letter ``id`` of ``queue`` stored as ``stored``, written straight into Redis."""
    client.zadd(keys.dead(namespace, queue), {id: 1_700_000_000_000})
    client.hset(keys.dead_messages(namespace, queue), id, stored)


#: One bad dead letter per way each once broke its whole page: its Redis id, its stored message, what shows for it.
BAD_DEAD_LETTERS = {
    "too-deep": ("deep", stored_dead_letter("deep", "[" * 10_000 + "]" * 10_000), "cannot decode it"),
    "retries-not-a-number": ("abc", stored_dead_letter("abc", retries="abc"), "(unreadable: retries='abc')"),
    "empty-traceback": ("blank", stored_dead_letter("blank", traceback=""), "(unreadable: empty traceback)"),
    "slash-in-id": ("a/b ?#%41", stored_dead_letter("a/b ?#%41"), "RuntimeError: the card was declined"),
}
