"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import functools
import http.cookiejar
import json
import logging
import os
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
from sentry_sdk.envelope import Envelope
from sentry_sdk.transport import Transport

import dramatiq_gp as gp
from dramatiq_gp import keys

#: The RabbitMQ the tests use (``RABBITMQ_URL``; the local one by default).
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
#: Its vhost, as ``rabbitmqctl -p`` takes it.
RABBITMQ_VHOST = urllib.parse.unquote(urlsplit(RABBITMQ_URL).path.removeprefix("/")) or "/"


#: The prefixes of every variable the kit reads: a test's environment starts without them.
KIT_PREFIXES = (
    "WORKER_",
    "VALKEY_",
    "REDIS_",
    "LOG_",
    "SCHEDULER_",
    "OUTBOX_",
    "DB_",
    "OTEL_",
    "SENTRY_",
    "BROKER_",
    "RABBITMQ_",
    "DASHBOARD_",
)


@dataclass
class Reply:
    status: int
    body: str
    url: str
    headers: Any


class Browser:
    """A cookie-keeping HTTP client (urllib), enough to follow the dashboard's forms."""

    def __init__(self, base: str, headers: dict[str, str] | None = None) -> None:
        self.base = base
        self.headers = headers or {}
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))

    def open(self, path: str, form: dict[str, Any] | None = None) -> Reply:
        data = urllib.parse.urlencode(form, doseq=True).encode() if form is not None else None
        request = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            with self.opener.open(request, timeout=10) as response:
                return Reply(response.status, response.read().decode(), response.url, response.headers)
        except urllib.error.HTTPError as exc:
            with exc:
                return Reply(exc.code, exc.read().decode(), exc.url, exc.headers)

    def csrf(self, path: str) -> str:
        match = re.search(r'name="csrf" value="([^"]+)"', self.open(path).body)
        assert match, f"no form on {path}"
        return match.group(1)


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
    options = {
        "redis_message_id": id,
        "retries": 1,
        "traceback": 'Traceback (most recent call last):\n  File "x.py", line 1, in charge\n'
        "RuntimeError: the card was declined\n",
        **options,
    }
    return (
        f'{{"queue_name": "default", "actor_name": "charge", "args": {args}, "kwargs": {{}}, '
        f'"options": {json.dumps(options)}, "message_id": "m-{id}", "message_timestamp": 0}}'
    )


def bury(
    client: Any, namespace: str, queue: str, id: str | bytes, stored: str | bytes, score: float = 1_700_000_000_000
) -> None:
    """A dead letter ``id`` of ``queue`` stored as ``stored``, dead since ``score``, written straight into Redis."""
    client.zadd(keys.dead(namespace, queue), {id: score})
    client.hset(keys.dead_messages(namespace, queue), id, stored)


#: One bad dead letter per way each once broke its whole page: its Redis id, its stored message, its score (when it
#: died), what shows for it.
BAD_DEAD_LETTERS = {
    "too-deep": (
        "deep",
        stored_dead_letter("deep", "[" * 10_000 + "]" * 10_000),
        1_700_000_000_000,
        "cannot decode it",
    ),
    "retries-not-a-number": (
        "abc",
        stored_dead_letter("abc", retries="abc"),
        1_700_000_000_000,
        "(unreadable: retries='abc')",
    ),
    "empty-traceback": (
        "blank",
        stored_dead_letter("blank", traceback=""),
        1_700_000_000_000,
        "(unreadable: empty traceback)",
    ),
    "slash-in-id": (
        "a/b ?#%41",
        stored_dead_letter("a/b ?#%41"),
        1_700_000_000_000,
        "RuntimeError: the card was declined",
    ),
    "score-inf": ("inf", stored_dead_letter("inf"), float("inf"), "(unreadable: score=inf)"),
    "score-minus-inf": ("neg-inf", stored_dead_letter("neg-inf"), float("-inf"), "(unreadable: score=-inf)"),
}


def publish_schedule(client: Any, namespace: str) -> keys.SchedulerKeys:
    """A scheduler as its leader and workers publish it, written straight into Redis: a leader holding the lease,
    the catch-up policy, entry ``good`` (a cron string, last fired) and ``odd`` (another trigger, its next fires
    published)."""
    scheduler = keys.SchedulerKeys(namespace)
    client.hset(scheduler.entries, mapping={"good": "0 3 * * *|UTC", "odd": "every full moon|UTC"})
    client.hset(scheduler.leader, mapping={"host": "lead-host", "pid": 4242, "epoch": 7})
    client.set(scheduler.lease, "7/token", px=60_000)
    client.set(
        scheduler.catchup, json.dumps({"policy": "latest", "grace_s": 3600.0, "max": 5, "misfire_threshold_s": 60.0})
    )
    client.hset(scheduler.last_fired, "good", 1_700_000_000_000)
    client.hset(scheduler.upcoming, "odd", json.dumps(["2999-01-01T00:00:00+00:00"]))
    return scheduler


#: One bad scheduler record per way each once failed the scheduler page and `dramatiq-gp status`: the key (its
#: :class:`keys.SchedulerKeys` property), the field (None: the key's own value), what is written there (None:
#: the field deleted), and what shows for it.
BAD_SCHEDULER = {
    "paused-not-json": ("paused", "odd", "{not json", "(unreadable: not JSON)"),
    "paused-fields": ("paused", "odd", '{"by": 7}', "(unreadable: by=7)"),
    "upcoming-not-json": ("upcoming", "odd", "[not json", "(unreadable: upcoming='[not json')"),
    "upcoming-not-times": ("upcoming", "odd", "[5]", "(unreadable: upcoming='[5]')"),
    "catchup-not-json": ("catchup", None, "{not json", "(unreadable: not JSON)"),
    "catchup-fields": ("catchup", None, '{"policy": "all", "grace_s": "abc", "max": 5}', "(unreadable: grace_s='abc')"),
    "last-fired-not-a-number": ("last_fired", "good", "abc", "(unreadable: last_fired='abc')"),
    "last-fired-out-of-range": ("last_fired", "good", "9" * 20, f"(unreadable: last_fired='{'9' * 20}')"),
    "leader-no-pid": ("leader", "pid", None, "(unreadable: no pid)"),
    "leader-pid-not-a-number": ("leader", "pid", "abc", "(unreadable: pid='abc')"),
    "leader-host-not-utf8": ("leader", "host", b"lead-h\xffst", "lead-h\\xffst"),  # escaped, as a worker's id is
}


def publish_schedulable(
    client: Any, namespace: str, *, actors: dict[str, str] | None = None, events: tuple[str, ...] = ()
) -> None:
    """Publish ``actors`` (name → queue, taking any arguments) and ``events`` (taking any data) as schedulable,
    as a worker whose code marks them does: what a ``Schedules`` built without the code checks against."""
    from dramatiq_gp.scheduler.targets import Target

    anything = (("args", "VAR_POSITIONAL", False), ("kwargs", "VAR_KEYWORD", False))
    targets = [Target("actor", name, queue, anything) for name, queue in (actors or {}).items()]
    targets += [Target("event", name, "default") for name in events]
    client.hset(keys.SchedulerKeys(namespace).schedulable, mapping={t.field: t.encode() for t in targets})


def spoil_schedule(client: Any, scheduler: keys.SchedulerKeys, case: str) -> str:
    """Write the bad record of ``BAD_SCHEDULER[case]``; what shows for it."""
    key, field, value, shown = BAD_SCHEDULER[case]
    name = getattr(scheduler, key)
    if field is None:
        client.set(name, value)
    elif value is None:
        client.hdel(name, field)
    else:
        client.hset(name, field, value)
    return shown


class SentryRecorder(Transport):
    """A Sentry transport that keeps the events it would send."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []

    def capture_envelope(self, envelope: Envelope) -> None:
        event = envelope.get_event()
        if event is not None:
            self.events.append(event)
