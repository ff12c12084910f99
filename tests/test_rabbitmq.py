"""The kit's RabbitMQ broker against the real local RabbitMQ (skipped, in one line, without one)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import dramatiq
import pika
import pika.exceptions
import pytest
import redis
import sqlalchemy as sa
from click.testing import CliRunner
from dramatiq.brokers.rabbitmq import DEAD_MESSAGE_TTL
from dramatiq.cli import RET_CONNECT
from dramatiq.common import dq_name, xq_name
from dramatiq.errors import ConnectionClosed

import dramatiq_gp as gp
from dramatiq_gp import keys
from dramatiq_gp.brokers import done_marks
from dramatiq_gp.brokers.publisher import BatchPublisher, NotConfirmed
from dramatiq_gp.brokers.rabbitmq import RabbitmqBroker
from dramatiq_gp.brokers.rabbitmq_view import RabbitmqQueueView
from dramatiq_gp.cli import main as cli_main
from dramatiq_gp.names import EVENT_QUEUE, tick_message_id
from dramatiq_gp.outbox import OUTBOX_EVENTS
from dramatiq_gp.outbox.relay import Relay
from dramatiq_gp.settings import OutboxSettings, SchedulerSettings
from helpers import RABBITMQ_URL as URL
from helpers import rabbitmq_unreachable, wait_for

pytestmark = pytest.mark.skipif(rabbitmq_unreachable(URL) is not None, reason=rabbitmq_unreachable(URL) or "")


@pytest.fixture
def queue_name() -> Iterator[str]:
    """A queue of this test's own; it, its delay queue and its dead-letter queue are deleted afterwards."""
    name = f"gp-test-{uuid.uuid4().hex[:8]}"
    yield name
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        channel = connection.channel()
        for queue in (name, dq_name(name), xq_name(name)):
            channel.queue_delete(queue)
    finally:
        connection.close()


@pytest.fixture
def make_broker() -> Iterator[Any]:
    brokers: list[RabbitmqBroker] = []

    def make(**options: Any) -> RabbitmqBroker:
        options.setdefault("middleware", [])
        broker = RabbitmqBroker(url=URL, **options)
        brokers.append(broker)
        return broker

    yield make
    for broker in brokers:
        broker.close()


def _is_quorum(queue: str, arguments: dict[str, Any]) -> bool:
    """Whether ``queue`` is a quorum queue: re-declaring it with ``arguments`` as one is refused otherwise."""
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        connection.channel().queue_declare(queue=queue, durable=True, arguments={**arguments, "x-queue-type": "quorum"})
        return True
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 406 and "x-queue-type" in exc.reply_text, exc
        return False
    finally:
        if connection.is_open:
            connection.close()


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_each_queue_delay_queue_and_dead_letter_queue_is_of_the_brokers_type(queue_type, make_broker, queue_name):
    broker = make_broker(queue_type=queue_type)
    broker.declare_queue(queue_name, ensure=True)
    dead_letters = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": xq_name(queue_name)}
    found = [
        _is_quorum(queue_name, dead_letters),
        _is_quorum(dq_name(queue_name), dead_letters),
        _is_quorum(xq_name(queue_name), {"x-message-ttl": DEAD_MESSAGE_TTL}),
    ]
    assert found == [queue_type == "quorum"] * 3


def test_a_worker_sending_to_a_queue_none_of_its_actors_use_does_not_consume_it(make_broker, queue_name):
    # A fan-out to a listener only another worker has: the queue is created for the send (Dramatiq
    # declares it, through declare_queue(ensure=True) and _ensure_queue), but a worker consumes
    # every queue in `queues`, so it must stay out of them.
    broker = make_broker()
    dramatiq.actor(lambda: None, broker=broker, actor_name="here", queue_name=f"{queue_name}-here")
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        message = dramatiq.Message(queue_name=queue_name, actor_name="elsewhere", args=(), kwargs={}, options={})
        broker.enqueue(message)
        broker.enqueue_many([message.copy(message_id=str(uuid.uuid4())) for _ in range(2)])
        time.sleep(0.3)
        assert queue_name not in broker.queues and queue_name not in worker.consumers
        assert broker.get_queue_message_counts(queue_name)[0] == 3
    finally:
        worker.stop()
        for name in (f"{queue_name}-here", dq_name(f"{queue_name}-here"), xq_name(f"{queue_name}-here")):
            broker.channel.queue_delete(name)


def test_a_message_sent_with_a_confirm_runs_in_a_worker_and_is_acked(make_broker, queue_name):
    broker = make_broker()
    ran = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.probe")
    def probe(n: int) -> None:
        assert n == 7
        ran.set()

    probe.send(7)
    assert broker.get_queue_message_counts(queue_name)[0] == 1
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        assert ran.wait(10)
        wait_for(lambda: broker.get_queue_message_counts(queue_name) == (0, 0, 0))
    finally:
        worker.stop()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"queue_type": "mirrored"}, "queue_type 'mirrored': expected one of quorum, classic"),
        ({"max_priority": 10}, "max_priority needs queue_type='classic': quorum queues refuse x-max-priority"),
    ],
)
def test_a_queue_type_it_cannot_declare_is_refused_in_one_line(options, error):
    with pytest.raises(gp.ConfigError) as raised:
        RabbitmqBroker(url=URL, middleware=[], **options)
    assert str(raised.value) == error


def test_an_ack_from_a_closed_channel_never_lands_on_the_message_with_its_tag_on_the_new_one(
    make_broker, queue_name, caplog
):
    # Delivery tags restart at 1 on every channel. Dramatiq acks through the consumer its
    # queue has now, so after a reconnect the old channel's tag 1 named another message,
    # which was acked without having run.
    broker = make_broker()

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.probe")
    def probe(n: int) -> None: ...

    for n in range(3):
        probe.send(n)
    first = broker.consume(queue_name, prefetch=1, timeout=1000)
    stale = next(m for m in first if m is not None)
    first.close()  # the connection drops: RabbitMQ puts the message back
    second = broker.consume(queue_name, prefetch=3, timeout=1000)
    fetched = [next(m for m in second if m is not None) for _ in range(3)]
    assert stale._tag in {m._tag for m in fetched}  # the same number now names one of these
    second.ack(stale)
    second.close()
    wait_for(lambda: broker.get_queue_message_counts(queue_name)[0] == 3)  # none acked: none ran
    assert "the channel that delivered them has closed" in caplog.text


def test_a_failed_idempotent_attempt_is_retried_through_the_delay_queue_and_a_copy_is_skipped(
    make_broker, queue_name, redis_url, namespace, caplog
):
    # The kit's Retries and Idempotency on RabbitMQ: the retry copy is published (and
    # confirmed) before the failed attempt is acked, the done mark written before the
    # second attempt's ack, and a later copy of the message skipped.
    broker = make_broker(
        client=redis.Redis.from_url(redis_url),
        namespace=namespace,
        middleware=[gp.IdempotentExecution(), gp.Retries(min_backoff=200, max_backoff=200)],
    )
    attempts: list[int] = []

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.flaky", idempotent=True)
    def flaky() -> None:
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails")

    message = flaky.send()
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        wait_for(lambda: attempts == [1, 2], timeout=15)
        wait_for(lambda: broker.get_queue_message_counts(queue_name) == (0, 0, 0))
        broker.enqueue(message)  # the same message again, as a redelivery would bring it
        wait_for(lambda: "already completed" in caplog.text, timeout=10)
        wait_for(lambda: broker.get_queue_message_counts(queue_name) == (0, 0, 0))
    finally:
        worker.stop()
    assert attempts == [1, 2]
    assert done_marks.is_done(broker.client, namespace, message.message_id)
    assert broker.client.get(keys.claim_prefix(namespace) + message.message_id) is None


def test_an_id_holding_a_line_break_is_claimed_and_recorded_on_its_own_beside_a_batch(
    make_broker, queue_name, redis_url, namespace, caplog
):
    # The claim and record scripts read a batch's keys joined by line breaks: an id holding
    # one goes in a call of its own, and every message still runs once and is marked done.
    broker = make_broker(
        client=redis.Redis.from_url(redis_url),
        namespace=namespace,
        middleware=[gp.IdempotentExecution()],
        settle_window_ms=200,
    )
    runs: list[int] = []
    ids = [f"line\nbreak-{uuid.uuid4().hex}", *(str(uuid.uuid4()) for _ in range(5)), f"two\nlines\n{uuid.uuid4()}"]
    together = threading.Barrier(len(ids))  # all end in one settle window: one record call holds them all

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.once", idempotent=True)
    def once(n: int) -> None:
        runs.append(n)
        if len(runs) <= len(ids):
            together.wait(5)

    messages = [once.message(n).copy(message_id=message_id) for n, message_id in enumerate(ids)]
    for message in messages:
        broker.enqueue(message)
    worker = dramatiq.Worker(broker, worker_threads=len(ids), worker_timeout=100)
    worker.start()
    try:
        wait_for(lambda: sorted(runs) == list(range(len(ids))), timeout=15)
        wait_for(lambda: all(done_marks.are_done(broker.client, namespace, ids)))
        wait_for(lambda: broker.get_queue_message_counts(queue_name) == (0, 0, 0))
        for message in messages:  # copies: skipped, every one
            broker.enqueue(message)
        wait_for(lambda: caplog.text.count("already completed") == len(ids), timeout=10)
        wait_for(lambda: broker.get_queue_message_counts(queue_name) == (0, 0, 0))
    finally:
        worker.stop()
    assert sorted(runs) == list(range(len(ids)))
    assert [broker.client.get(keys.claim_prefix(namespace) + message_id) for message_id in ids] == [None] * len(ids)


@gp.event("test.rabbitmq.paid")
@dataclass(frozen=True)
class Paid:
    order_id: int


def test_the_outbox_relay_marks_rows_published_once_rabbitmq_confirmed_them(make_broker, engine, redis_url, namespace):
    broker = make_broker(client=redis.Redis.from_url(redis_url), namespace=namespace)
    broker.declare_queue(EVENT_QUEUE, ensure=True)
    broker.flush(EVENT_QUEUE)
    try:
        with engine.begin() as conn:
            ids = {gp.dispatch(conn, Paid(n)) for n in range(20)}
        relay = Relay(engine=engine, broker=broker, settings=OutboxSettings(batch_size=8))
        assert sum(iter(relay.relay_once, 0)) == 20
        with engine.connect() as conn:
            pending = conn.execute(sa.select(OUTBOX_EVENTS.c.id).where(OUTBOX_EVENTS.c.published_at.is_(None))).all()
        assert pending == []
        assert broker.get_queue_message_counts(EVENT_QUEUE)[0] == 20
        got = []
        while (fetched := broker.channel.basic_get(EVENT_QUEUE, auto_ack=True))[0] is not None:
            got.append(dramatiq.Message.decode(fetched[2]).message_id)
        assert sorted(got) == sorted(ids)
    finally:
        broker.channel.queue_delete(EVENT_QUEUE)
        broker.channel.queue_delete(dq_name(EVENT_QUEUE))
        broker.channel.queue_delete(xq_name(EVENT_QUEUE))


def _scheduled_broker(make_broker, redis_url, namespace, queue_name, schedule):
    return make_broker(
        client=redis.Redis.from_url(redis_url),
        namespace=namespace,
        middleware=[
            gp.SchedulerLease(schedule, settings=SchedulerSettings(lease_ttl="2s", catchup="all")),
            gp.IdempotentExecution(),
            gp.Retries(min_backoff=100, max_backoff=100),
        ],
    )


def test_a_job_fires_every_tick_once_through_rabbitmq(make_broker, redis_url, namespace, queue_name, rdb):
    ticks: list[datetime] = []
    schedule = gp.Schedule().job(f"{queue_name}.beat", "@every 1s", ticks.append, queue=queue_name)
    broker = _scheduled_broker(make_broker, redis_url, namespace, queue_name, schedule)
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        wait_for(lambda: len(ticks) >= 4, timeout=20)
    finally:
        worker.stop()
    assert len(ticks) == len(set(ticks))
    assert all(b - a == timedelta(seconds=1) for a, b in zip(sorted(ticks), sorted(ticks)[1:], strict=False))
    assert rdb.hlen(keys.SchedulerKeys(namespace).unpublished) == 0


def test_a_tick_claimed_by_a_leader_that_died_before_the_confirm_is_published_by_the_next(
    make_broker, redis_url, namespace, queue_name, rdb, caplog
):
    ticks: list[datetime] = []
    name = f"{queue_name}.nightly"
    schedule = gp.Schedule().job(name, "0 3 * * *", ticks.append, queue=queue_name)
    broker = _scheduled_broker(make_broker, redis_url, namespace, queue_name, schedule)
    # What claim.lua leaves when the leader dies before RabbitMQ confirmed the tick's message.
    tick = datetime(2026, 12, 2, 3, tzinfo=UTC)
    message = dramatiq.Message(
        queue_name=queue_name,
        actor_name=f"job:{name}",
        args=({"entry": name, "scheduled_at": tick.isoformat()},),
        kwargs={},
        options={},
        message_id=tick_message_id(name, tick),
    )
    unpublished = keys.SchedulerKeys(namespace).unpublished
    rdb.hset(unpublished, f"{name}:{int(tick.timestamp() * 1000)}", message.encode())
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        wait_for(lambda: ticks == [tick], timeout=20)
    finally:
        worker.stop()
    assert rdb.hlen(unpublished) == 0
    assert "claimed but not confirmed by the leader that claimed it" in caplog.text


@pytest.fixture
def default_queues() -> Iterator[None]:
    """The kit's listeners use the queue ``default``: emptied before, deleted after."""
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        channel = connection.channel()
        for queue in (EVENT_QUEUE, dq_name(EVENT_QUEUE), xq_name(EVENT_QUEUE)):
            channel.queue_delete(queue)
        yield
        for queue in (EVENT_QUEUE, dq_name(EVENT_QUEUE), xq_name(EVENT_QUEUE)):
            channel.queue_delete(queue)
    finally:
        connection.close()


def test_broker_url_puts_the_kits_queues_on_rabbitmq_and_listeners_run_there(
    make_kit, start_worker, default_queues, rdb, namespace
):
    seen: list[int] = []
    kit = make_kit(
        lambda registry, schedule: registry.listen(Paid, lambda event: seen.append(event.order_id), name="seen"),
        env={"BROKER_URL": URL},
    )
    assert isinstance(kit.broker, RabbitmqBroker) and kit.broker.queue_type == "quorum"
    assert kit.broker.confirm_timeout_s == 10  # RABBITMQ_CONFIRM_TIMEOUT's default
    kit.check_connection()
    kit.dispatch(Paid(1))
    assert kit.broker.get_queue_message_counts(EVENT_QUEUE)[0] == 1
    assert rdb.llen(f"{namespace}:{EVENT_QUEUE}") == 0  # not on Redis
    start_worker(kit)
    kit.dispatch(Paid(2))
    wait_for(lambda: sorted(seen) == [1, 2])
    wait_for(lambda: kit.broker.get_queue_message_counts(EVENT_QUEUE) == (0, 0, 0))


def test_only_broker_url_moves_the_queues_to_rabbitmq_not_a_rabbitmq_url_set_for_something_else(clean_env):
    # A common name in an environment (this suite's own, a compose file's): it moved the queues to RabbitMQ.
    clean_env.setenv("RABBITMQ_URL", URL)
    assert gp.Settings.from_env().rabbitmq.url is None
    clean_env.setenv("BROKER_URL", URL)
    assert gp.Settings.from_env().rabbitmq.url is not None


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"BROKER_URL": "http://127.0.0.1:5672"}, "BROKER_URL='http://127.0.0.1:5672' has scheme 'http'"),
        ({"BROKER_URL": URL, "RABBITMQ_QUEUE_TYPE": "mirrored"}, "RABBITMQ_QUEUE_TYPE='mirrored'"),
        ({"BROKER_URL": URL, "RABBITMQ_CONFIRM_TIMEOUT": "soon"}, "RABBITMQ_CONFIRM_TIMEOUT='soon'"),
        ({"BROKER_URL": URL, "RABBITMQ_CONFIRM_TIMEOUT": "10ms"}, "RABBITMQ_CONFIRM_TIMEOUT='10ms'"),
    ],
)
def test_a_bad_broker_setting_is_one_line_naming_it(env, error, clean_env):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(gp.ConfigError) as raised:
        gp.Settings.from_env()
    assert error in str(raised.value) and "\n" not in str(raised.value)


def test_an_undecodable_or_malformed_message_goes_to_the_dead_letter_queue_in_one_line(make_broker, queue_name, caplog):
    broker = make_broker()
    ran: list[int] = []

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.probe")
    def probe(n: int) -> None:
        ran.append(n)

    broker.declare_queue(queue_name, ensure=True)
    garbage = [
        b"\xff not json",
        b'{"queue_name": 1}',
        json.dumps(
            {
                "queue_name": queue_name,
                "actor_name": f"{queue_name}.probe",
                "args": [],
                "kwargs": [],
                "options": {},
                "message_id": "m",
                "message_timestamp": 0,
            }
        ).encode(),
    ]
    for body in garbage:
        broker.channel.basic_publish("", queue_name, body, pika.BasicProperties(delivery_mode=2))
    probe.send(1)
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        wait_for(lambda: ran == [1])
        wait_for(lambda: broker.get_queue_message_counts(queue_name) == (0, 0, 3))
    finally:
        worker.stop()
    lines = [r for r in caplog.records if "is malformed" in r.getMessage()]
    assert [r.getMessage().split(": ", 1)[1] for r in lines] == [
        "cannot decode it (UnicodeDecodeError); moved to the dead-letter queue",
        "cannot decode it (KeyError); moved to the dead-letter queue",
        "its kwargs is not a dict; moved to the dead-letter queue",
    ]
    assert all(r.exc_info is None for r in lines)
    assert "Failed to decode" not in caplog.text


def _first_dead_letter(queue_name: str) -> bytes:
    """The body of the first message in ``queue_name``'s dead-letter queue, taken off it."""
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        _, _, body = connection.channel().basic_get(xq_name(queue_name), auto_ack=True)
    finally:
        connection.close()
    return bytes(body)


@pytest.mark.parametrize("kind", ["failed", "malformed"])
def test_a_dead_letter_is_published_and_confirmed_never_dropped_by_the_dead_letter_exchange(
    kind, make_broker, queue_name
):
    # RabbitMQ's dead-letter exchange moves a nacked message at most once from a quorum queue:
    # with its dead-letter queue unavailable (here: deleted), a nacked message was gone.
    broker = make_broker(middleware=[dramatiq.middleware.Retries()])

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.fails", max_retries=0)
    def fails() -> None:
        raise RuntimeError("for good")

    broker.declare_queue(queue_name, ensure=True)
    broker.channel.queue_delete(xq_name(queue_name))
    if kind == "failed":
        sent = fails.send().message_id
    else:
        broker.channel.basic_publish("", queue_name, b"\xff not json", pika.BasicProperties(delivery_mode=2))
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        wait_for(lambda: broker.get_queue_message_counts(queue_name) == (0, 0, 1), timeout=15)
    finally:
        worker.stop()
    body = _first_dead_letter(queue_name)
    if kind == "failed":
        kept = dramatiq.Message.decode(body)
        assert (kept.message_id, kept.queue_name) == (sent, xq_name(queue_name))
        assert "RuntimeError: for good" in kept.options["traceback"]
    else:
        assert body == b"\xff not json"


def test_a_task_type_no_worker_knows_is_held_then_skipped_to_the_dead_letter_queue(
    make_broker, queue_name, redis_url, namespace, caplog
):
    broker = make_broker(client=redis.Redis.from_url(redis_url), namespace=namespace, unknown_task_grace_ms=600)

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.known")
    def known() -> None: ...

    stranger = dramatiq.Message(
        queue_name=queue_name, actor_name=f"{queue_name}.unknown", args=(), kwargs={}, options={}
    )
    broker.enqueue(stranger)
    caplog.set_level(logging.INFO, logger="dramatiq_gp.brokers.base")
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        wait_for(lambda: broker.get_queue_message_counts(queue_name) == (0, 0, 1), timeout=15)
    finally:
        worker.stop()
    assert "holding its messages for up to 0 s" in caplog.text
    assert "task skipped: no handler registered for task type" in caplog.text
    body = _first_dead_letter(queue_name)
    kept = dramatiq.Message.decode(body)
    assert kept.message_id == stranger.message_id
    assert "within 600ms (WORKER_UNKNOWN_TASK_GRACE)" in kept.options["gp_dead_letter_reason"]
    assert broker.client.hget(keys.skipped(namespace), stranger.actor_name) == b"1"


def test_a_rabbitmq_that_does_not_answer_is_one_line_at_start_up(make_kit, caplog):
    kit = make_kit(env={"BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F"})
    with pytest.raises(gp.BrokerUnreachable, match=r"^RabbitMQ unreachable at 127\.0\.0\.1:1: "):
        kit.check_connection()
    with pytest.raises(SystemExit) as exited:
        kit.broker.emit_after("process_boot")
    assert exited.value.code == RET_CONNECT
    (line,) = [r.getMessage() for r in caplog.records if "start-up failed" in r.getMessage()]
    assert line.startswith("start-up failed: RabbitMQ unreachable at 127.0.0.1:1: ")


def test_the_start_up_line_says_where_the_queues_are_and_where_redis_is(make_kit, caplog):
    # It said "broker reachable at redis://..." on a RabbitMQ worker.
    kit = make_kit(env={"BROKER_URL": URL})
    with caplog.at_level(logging.INFO):
        kit.broker.emit_after("process_boot")
    (line,) = [r.getMessage() for r in caplog.records if "broker reachable" in r.getMessage()]
    rabbitmq = urllib.parse.urlsplit(URL)
    where = f"RabbitMQ {rabbitmq.hostname}:{rabbitmq.port or 5672}"
    assert line.startswith(f"start-up: broker reachable at {where}; Redis/Valkey at ")


def test_status_reads_the_queue_depths_from_rabbitmq(make_kit, default_queues, clean_env, namespace):
    kit = make_kit(
        lambda registry, schedule: registry.listen(Paid, lambda event: None, name="seen"), env={"BROKER_URL": URL}
    )
    for n in range(3):
        kit.dispatch(Paid(n))
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    done = CliRunner().invoke(cli_main, ["status"])
    assert done.exit_code == 0, done.output
    assert "queue default: 3 ready, 0 in flight, 0 delayed, 0 dead, 0 consumers (RabbitMQ)" in done.output.splitlines()
    report = json.loads(CliRunner().invoke(cli_main, ["status", "--json"]).output)
    (default,) = [q for q in report["queues"] if q["name"] == EVENT_QUEUE]
    assert default == {
        "name": "default",
        "ready": 3,
        "in_flight": 0,
        "delayed": 0,
        "dead": 0,
        "consumers": 0,
        "unknown": None,
    }

    clean_env.setenv("BROKER_URL", "amqp://guest:guest@127.0.0.1:1/%2F")
    done = CliRunner().invoke(cli_main, ["status"])
    assert done.exit_code == 1
    assert done.output.splitlines()[-1].startswith("Error: RabbitMQ unreachable at amqp://guest:***@127.0.0.1:1/")


def test_status_counts_the_delayed_messages_and_the_running_ones_a_worker_holds_in_memory(
    make_broker, queue_name, redis_url, namespace
):
    # RabbitMQ counts only what waits on a queue: a worker holds a delayed message, unacked,
    # until it is due, and status showed 0 delayed with 20 pending.
    broker = make_broker(client=redis.Redis.from_url(redis_url), namespace=namespace)
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.slow")
    def slow() -> None:
        release.wait(30)

    for _ in range(20):
        slow.send_with_options(delay=600_000)
    slow.send()
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:

        def counted() -> dict[str, Any]:
            return next(
                q for q in RabbitmqQueueView([URL], broker.client, namespace).counts() if q["name"] == queue_name
            )

        wait_for(lambda: (counted()["delayed"], counted()["in_flight"]) == (20, 1), timeout=15)
        assert broker.get_queue_message_counts(queue_name)[:2] == (0, 0)  # what AMQP alone says
    finally:
        release.set()
        worker.stop()


def test_the_broker_is_gp_rabbitmq_broker():
    assert gp.RabbitmqBroker is RabbitmqBroker


def test_a_retry_copy_rabbitmq_did_not_take_is_sent_when_the_settle_is_tried_again(
    make_broker, queue_name, redis_url, namespace
):
    # The failed attempt stays unacked until its retry copy is confirmed; Dramatiq tries
    # the settle again, and the copy must still be there to send.
    broker = make_broker(client=redis.Redis.from_url(redis_url), namespace=namespace)

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.probe")
    def probe() -> None: ...

    probe.send()
    consumer = broker.consume(queue_name, prefetch=1, timeout=1000)
    message = next(m for m in consumer if m is not None)
    broker.redeliver_later(message, 60_000)
    broker.channel.queue_delete(dq_name(queue_name))  # the copy cannot be routed: not confirmed
    with pytest.raises(ConnectionClosed):
        broker.settle(queue_name, message, "ack")
    broker.settle(queue_name, message, "ack")  # its queue declared again, the copy sent, then the ack
    consumer.close()
    assert broker.get_queue_message_counts(queue_name) == (0, 1, 0)


def test_a_stop_puts_back_what_was_fetched_and_not_started_with_its_claim_released(
    make_broker, queue_name, redis_url, namespace, caplog
):
    # Idempotent messages are claimed as they are fetched; the ones still waiting for a
    # thread when the worker stops go back with their claims released, so the next worker
    # runs them at once rather than deferring them until the claims lapse (a minute).
    broker = make_broker(
        client=redis.Redis.from_url(redis_url), namespace=namespace, middleware=[gp.IdempotentExecution()]
    )
    ran: list[int] = []
    started = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.slow", idempotent=True)
    def slow(n: int) -> None:
        started.set()
        time.sleep(0.3)
        ran.append(n)

    for n in range(10):
        slow.send(n)
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    assert started.wait(10)
    worker.stop()
    left = 10 - len(ran)
    assert left >= 5  # most were fetched (prefetched) and never started
    assert broker.get_queue_message_counts(queue_name)[0] == left  # put back
    worker = dramatiq.Worker(broker, worker_threads=4, worker_timeout=100)
    worker.start()
    try:
        wait_for(lambda: len(ran) == 10, timeout=10)
    finally:
        worker.stop()
    assert sorted(ran) == list(range(10))
    assert "another copy is running" not in caplog.text


def test_a_batch_is_published_at_once_and_returns_when_every_message_is_confirmed(make_broker, queue_name):
    broker = make_broker()

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.probe")
    def probe(n: int) -> None: ...

    messages = [probe.message(n) for n in range(500)]
    assert broker.enqueue_many(messages) == messages
    assert broker.get_queue_message_counts(queue_name)[0] == 500  # confirmed: every one is on the queue
    consumer = broker.consume(queue_name, prefetch=500, timeout=1000)
    received = [next(consumer).message_id for _ in range(500)]
    consumer.close()
    assert received == [m.message_id for m in messages]  # in order


def test_the_publisher_writes_the_frames_pika_would_for_every_body_size_and_priority():
    """BatchPublisher marshals a batch itself (one write, not three sends a message): byte for byte pika's."""
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        publisher = BatchPublisher(connection)
        step = connection._impl._body_max_length
        number = publisher.channel.channel_number
        reason = {"gp_dead_letter_reason": "malformed"}  # a set-aside dead letter's
        cases = [(b"", None, None), (b"{}", 3, None), (b"x" * (2 * step + 5), None, None), (b"y" * step, 0, None)]
        for body, priority, headers in [*cases, (b"z", None, reason), (b"z", 3, reason), (b"z", None, None)]:
            publish = pika.spec.Basic.Publish(exchange="", routing_key="gp-q", mandatory=True)
            properties = pika.BasicProperties(delivery_mode=2, priority=priority, headers=headers)
            expected = [
                pika.frame.Method(number, publish).marshal(),
                pika.frame.Header(number, len(body), properties).marshal(),
                *(pika.frame.Body(number, body[i : i + step]).marshal() for i in range(0, len(body), step)),
            ]
            assert b"".join(publisher._frames("gp-q", body, priority, headers)) == b"".join(expected)
    finally:
        connection.close()


def test_a_batch_of_bodies_over_the_frame_size_arrives_whole_and_in_order(queue_name):
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        channel = connection.channel()
        channel.queue_declare(queue_name, durable=True, arguments={"x-queue-type": "quorum"})
        publisher = BatchPublisher(connection)
        big = connection._impl._body_max_length * 2 + 7
        bodies = [bytes([65 + n]) * (big if n % 2 else n + 1) for n in range(20)]
        publisher.publish([(queue_name, body, None) for body in bodies])
        publisher.publish([(queue_name, b"after", None)])  # delivery tags go on counting
        received = []
        while (got := channel.basic_get(queue_name, auto_ack=True))[0] is not None:
            received.append((got[2], got[1].delivery_mode))
        assert received == [(body, 2) for body in [*bodies, b"after"]]
    finally:
        connection.close()


def test_a_nack_in_the_middle_of_a_batch_fails_the_whole_batch(queue_name):
    """RabbitMQ refuses what a full queue cannot take (``reject-publish``): the batch is reported not sent (the
    relay then keeps all its rows), though the messages before the refusal are on the queue."""
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        connection.channel().queue_declare(queue_name, arguments={"x-max-length": 3, "x-overflow": "reject-publish"})
        publisher = BatchPublisher(connection)
        with pytest.raises(NotConfirmed, match=r"refused \d+ \(nack\)"):
            publisher.publish([(queue_name, b"%d" % n, None) for n in range(6)])
        assert connection.channel().queue_declare(queue_name, passive=True).method.message_count == 3
    finally:
        connection.close()


def test_a_batch_is_sent_as_the_caller_encoded_it_unless_a_before_enqueue_hook_may_have_changed_it(
    make_broker, queue_name
):
    """The relay encodes each row's message to find one that cannot be; the broker sends those bytes."""

    class Stamp(dramatiq.Middleware):
        def before_enqueue(self, broker, message, delay):
            message.options["stamp"] = 1

    for middleware, stamped in (([], False), ([Stamp()], True)):
        broker = make_broker(middleware=middleware)
        broker.declare_queue(queue_name, ensure=True)
        messages = [dramatiq.Message(queue_name, f"{queue_name}.probe", (n,), {}, {}) for n in range(3)]
        # Marked, so which bytes went out shows: the caller's, or the message encoded again after the hook.
        encoded = [m.copy(options={"caller": True}).encode() for m in messages]
        broker.enqueue_many(messages, encoded=encoded)
        got = []
        while (fetched := broker.channel.basic_get(queue_name, auto_ack=True))[0] is not None:
            got.append(dramatiq.Message.decode(fetched[2]))
        assert [m.message_id for m in got] == [m.message_id for m in messages]
        assert all(("stamp" in m.options) is stamped and ("caller" in m.options) is not stamped for m in got)


def test_a_batch_rabbitmq_did_not_take_is_reported_unsent_and_goes_through_when_sent_again(
    make_broker, queue_name, caplog
):
    unsent: list[str] = []

    class Spy(dramatiq.Middleware):
        def after_send_failed(self, broker, message, error):
            unsent.append(message.message_id)

    broker = make_broker(middleware=[Spy()])

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"{queue_name}.probe")
    def probe(n: int) -> None: ...

    messages = [probe.message(n) for n in range(3)]
    broker.enqueue_many(messages)
    broker.channel.queue_delete(queue_name)  # the broker still takes it for declared: unroutable
    with pytest.raises(ConnectionClosed):
        broker.enqueue_many(messages)
    assert unsent == [m.message_id for m in messages]
    broker.enqueue_many(messages)  # declared again, then sent
    assert broker.get_queue_message_counts(queue_name)[0] == 3


def test_outside_the_worker_pika_prints_nothing_and_status_with_rabbitmq_down_one_line(clean_env, redis_url, namespace):
    """Dramatiq's CLI quiets pika in its workers only: a producer printed 125 pika lines, status 7 and a traceback."""
    env = {**os.environ, "REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace, "LOG_LEVEL": "INFO"}
    producer = (
        "import dramatiq, dramatiq_gp as gp\n"
        "kit = gp.Kit(registry=gp.Registry())\n"
        f"send = dramatiq.actor(lambda: None, broker=kit.broker, actor_name='noop', queue_name={EVENT_QUEUE!r})\n"
        "for _ in range(3):\n"
        "    send.send()\n"
        "kit.broker.close()\n"
    )
    sent = subprocess.run(
        [sys.executable, "-c", producer], env={**env, "BROKER_URL": URL}, capture_output=True, text=True, timeout=60
    )
    assert sent.returncode == 0, sent.stderr
    assert "pika" not in sent.stderr and "Traceback" not in sent.stderr, sent.stderr
    assert "start-up: registered" in sent.stderr  # the kit's own INFO lines still show

    down = {**env, "BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}
    status = subprocess.run(
        [sys.executable, "-m", "dramatiq_gp", "status"], env=down, capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 1
    errors = [line for line in status.stderr.splitlines() if "[INFO]" not in line]
    assert len(errors) == 1 and errors[0].startswith("Error: RabbitMQ unreachable at amqp://guest:***@127.0.0.1:1/")
