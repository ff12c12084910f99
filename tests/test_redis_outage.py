"""A Redis outage in the middle of the worker's own bookkeeping loses no message."""

from __future__ import annotations

import json
import queue
import threading
import time

import dramatiq
import pytest
import redis
from dramatiq.worker import ConsumerThread

import dramatiq_gp as gp
from helpers import wait_for
from servers import OwnRedis


def test_a_retry_that_comes_due_while_redis_is_down_still_runs(tmp_path, make_kit, start_worker):
    server = OwnRedis(tmp_path / "redis")
    server.start()
    try:
        kit = make_kit(env={"REDIS_URL": server.url, "WORKER_MIN_BACKOFF": "1500ms", "WORKER_MAX_BACKOFF": "1500ms"})
        attempts: list[float] = []

        @dramatiq.actor(broker=kit.broker, actor_name="flaky", max_retries=3)
        def flaky() -> None:
            attempts.append(time.monotonic())
            if len(attempts) == 1:
                raise ConnectionError("the first attempt fails")

        flaky.send()
        start_worker(kit)
        wait_for(lambda: len(attempts) == 1)
        time.sleep(0.3)  # the retry now waits in the delay consumer's memory, due within 1.5 s
        server.restart(down_for=2.5)  # it comes due while Redis is away
        wait_for(lambda: len(attempts) == 2, timeout=30)
    finally:
        server.stop()


def test_a_retry_is_not_lost_when_redis_goes_away_as_the_attempt_fails(tmp_path, make_kit, start_worker):
    # Dramatiq sends a retry from after_process_message; when that send failed it was
    # logged and swallowed, and the failed attempt was acked once Redis came back.
    server = OwnRedis(tmp_path / "redis")
    server.start()
    try:
        kit = make_kit(env={"REDIS_URL": server.url, "WORKER_MIN_BACKOFF": "100ms", "WORKER_MAX_BACKOFF": "100ms"})
        attempts: list[int] = []

        @dramatiq.actor(broker=kit.broker, actor_name="fails_as_redis_stops", max_retries=3)
        def fails_as_redis_stops() -> None:
            attempts.append(len(attempts) + 1)
            if len(attempts) == 1:
                server.stop()  # the retry is sent and the attempt acked while Redis is away
                threading.Timer(1.0, server.start).start()
                raise ConnectionError("the first attempt fails")

        fails_as_redis_stops.send()
        start_worker(kit)
        # Dramatiq retries the ack every 5 s until Redis is back; the retry goes with it.
        wait_for(lambda: len(attempts) == 2, timeout=30)
    finally:
        server.stop()


def test_a_dead_workers_unacked_messages_come_back_soon_after_its_heartbeat_times_out(
    make_kit, start_worker, namespace
):
    # Dramatiq returns them on 0.1% of commands; the kit's consumers make sure of it.
    kit = make_kit(broker_options={"namespace": namespace, "heartbeat_timeout": 1000})
    ran: list[int] = []

    @dramatiq.actor(broker=kit.broker, actor_name="orphaned")
    def orphaned(n: int) -> None:
        ran.append(n)

    for n in range(5):
        orphaned.send(n)
    # Another worker fetches them, then dies without a word.
    dead = gp.RedisBroker(client=kit.broker.client, namespace=kit.broker.namespace, middleware=[])
    assert len(dead.do_fetch("default", 10)) == 5
    started = time.monotonic()
    start_worker(kit)
    wait_for(lambda: sorted(ran) == [0, 1, 2, 3, 4], timeout=10)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(("command", "ready", "delayed"), [("ack", 0, 1), ("requeue", 1, 0)])
def test_a_retry_goes_out_with_the_ack_and_not_with_a_put_back(command, ready, delayed, make_kit, rdb, namespace):
    # A put-back (the drain deadline) races the end of the attempt: the message runs again, not also its retry.
    kit = make_kit()

    @dramatiq.actor(broker=kit.broker, actor_name="settled")
    def settled() -> None: ...

    settled.send()
    consumer = kit.broker.consume("default", prefetch=1, timeout=100)
    message = next(m for m in consumer if m is not None)
    kit.broker.redeliver_later(message, 60_000)
    kit.broker.settle("default", message, command)
    consumer.close()
    assert (rdb.llen(f"{namespace}:default"), rdb.hlen(f"{namespace}:default.DQ.msgs")) == (ready, delayed)
    assert rdb.llen(f"{namespace}:default.DQ") == delayed


def test_a_delay_consumer_whose_due_message_cannot_be_enqueued_survives_and_loses_nothing(
    tmp_path, make_kit, monkeypatch, caplog
):
    # Redis went away between a fetch and a due message's move to its queue. Dramatiq took
    # the redis error for an unexpected one, its clean-up failed the same way putting back
    # the other delayed messages, and the consumer thread ended: in the soak, a Redis
    # restart left delayed retries in a live worker's unsettled set for good.
    monkeypatch.setattr(dramatiq.worker, "CONSUMER_RESTART_DELAY_SECS", 0.05)
    server = OwnRedis(tmp_path / "redis")
    server.start()
    thread = None
    try:
        kit = make_kit(env={"REDIS_URL": server.url})
        ns = kit.broker.namespace

        @dramatiq.actor(broker=kit.broker, actor_name="later")
        def later(n: int) -> None: ...

        later.send_with_options(args=(1,), delay=1_500)
        later.send_with_options(args=(2,), delay=600_000)
        # Two held with prefetch 2: the consumer waits for room and makes no Redis call, so
        # the first thing to meet the outage is the due message's enqueue.
        thread = ConsumerThread(
            broker=kit.broker, queue_name="default.DQ", prefetch=2, work_queue=queue.PriorityQueue(), worker_timeout=100
        )
        thread.start()
        wait_for(lambda: thread.delay_queue.qsize() == 2)
        server.stop()
        time.sleep(2.0)  # the first falls due while Redis is away
        server.start()
        client = redis.Redis.from_url(server.url, decode_responses=True)
        try:
            wait_for(lambda: client.llen(f"{ns}:default") == 1, timeout=15)
            assert thread.is_alive()
            due = json.loads(client.hget(f"{ns}:default.msgs", client.lindex(f"{ns}:default", 0)))
            assert due["args"] == [1]
            wait_for(lambda: thread.delay_queue.qsize() == 1)  # the other, fetched again, waits its turn
        finally:
            client.close()
        assert not [r for r in caplog.records if "unexpected error" in r.getMessage()]
    finally:
        if thread is not None:
            thread.stop()
            thread.join(5)
        server.stop()
