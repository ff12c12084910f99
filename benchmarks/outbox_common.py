"""What the outbox benchmarks share: a scratch database, the event, the child relay processes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
import sqlalchemy as sa

import dramatiq_gp as gp
from dramatiq_gp.outbox import OUTBOX_EVENTS

ROOT = Path(__file__).resolve().parent.parent


@gp.event("benchmarks.blob")
@dataclass(frozen=True)
class Blob:
    data: str


#: Makes the stored payload ({"data": "..."}) 256 bytes of JSON.
PAYLOAD = {"data": "x" * 244}


@contextlib.contextmanager
def scratch_database(server_url: str) -> Iterator[str]:
    """A new database with the outbox table, dropped afterwards."""
    server = sa.make_url(server_url)
    name = f"gpbench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    url = server.set(database=name).render_as_string(hide_password=False)
    engine = sa.create_engine(url)
    gp.outbox.migrate(engine)
    engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


def insert_events(engine: sa.Engine, count: int) -> set[str]:
    """Commit ``count`` events at once (the relay benchmark starts from a full table)."""
    rows = [{"id": uuid.uuid4(), "event": "benchmarks.blob", "payload": PAYLOAD} for _ in range(count)]
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {gp.outbox.TABLE_NAME}"))
        for start in range(0, count, 5000):
            conn.execute(OUTBOX_EVENTS.insert(), rows[start : start + 5000])
    return {str(row["id"]) for row in rows}


def queued_ids(redis_url: str, namespace: str) -> list[str]:
    client = redis.Redis.from_url(redis_url)
    try:
        return [json.loads(v)["message_id"] for v in client.hvals(f"{namespace}:default.msgs")]
    finally:
        for key in client.scan_iter(f"{namespace}:*", count=1000):
            client.delete(key)
        client.close()


DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def rabbitmq_queued_ids(url: str) -> list[str]:
    """The message ids on RabbitMQ's queue ``default``, which this empties."""
    import pika
    import pika.exceptions

    from dramatiq_gp.names import EVENT_QUEUE

    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        ids = []
        try:
            while (got := channel.basic_get(EVENT_QUEUE, auto_ack=True))[0] is not None:
                ids.append(json.loads(got[2])["message_id"])
        except pika.exceptions.ChannelClosedByBroker:  # not declared yet: nothing on it
            pass
        return ids
    finally:
        if connection.is_open:
            connection.close()


def delete_rabbitmq_queues(url: str, queue: str | None = None) -> None:
    """Delete ``queue`` (the events' queue by default) and its delay and dead-letter queues."""
    import pika
    from dramatiq.common import dq_name, xq_name

    from dramatiq_gp.names import EVENT_QUEUE

    queue = queue or EVENT_QUEUE
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for name in (queue, dq_name(queue), xq_name(queue)):
            channel.queue_delete(name)
    finally:
        connection.close()


def child(mode: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """Start ``python -m benchmarks.outbox_child <mode>``; it prints ``ready`` when set up."""
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.outbox_child", mode],
        cwd=ROOT,
        env={**os.environ, **env},
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == "ready":
            return process
    raise RuntimeError(f"benchmark child {mode!r} exited with {process.wait()}")
