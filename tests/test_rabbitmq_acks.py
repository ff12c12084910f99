"""Acks on RabbitMQ sent in batches: one ``basic.ack`` with ``multiple`` for a window's settled prefix.

A worker's settles wait up to the settle window on its consumer's connection, then
go together; what a kill within the window leaves unacked comes back and runs
again, what a stop finds waiting is acked, and no ack lands twice or on a message
that has not finished, whatever order the threads finish in.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from typing import Any

import dramatiq
import pika
import pytest
from dramatiq import Message

import dramatiq_gp as gp
from apps.replica import Replica
from helpers import RABBITMQ_URL, wait_for


def _ready_count(queue: str) -> int:
    """Messages ready on ``queue`` (AMQP counts neither those a consumer holds nor those acked)."""
    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_a_worker_killed_within_its_window_runs_its_unacked_messages_again_and_loses_none(
    broker, tmp_path, redis_url, namespace, rdb
):
    env = {"REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace, "BROKER_URL": RABBITMQ_URL}
    runs_key = f"{namespace}:test:runs"

    def runs() -> list[dict[str, Any]]:
        return [json.loads(run) for run in rdb.lrange(runs_key, 0, -1)]

    # 8 threads: a prefetch of at least 16, whose half (sent without waiting for the window) is more than runs here.
    victim = Replica("tests.apps.settle_app", {**env, "WORKER_SETTLE_WINDOW": "1s"}, tmp_path / "victim.log", threads=8)
    survivor = None
    producer = gp.RabbitmqBroker(url=RABBITMQ_URL, namespace=namespace, middleware=[])
    try:
        wait_for(victim.started, timeout=30)
        # One batch, so that all run well within one window.
        producer.enqueue_many(
            [
                Message(queue_name="default", actor_name="fails" if n == 3 else "ok", args=(n,), kwargs={}, options={})
                for n in range(4)
            ]
        )
        wait_for(lambda: len(runs()) == 4, interval=0.01)
        # All ran; their acks (and the failed one's retry copy) wait for the window.
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait(30)
        victim_pid = runs()[0]["pid"]
        # The connection closed with them unacked: RabbitMQ put every one back, and no retry copy went out.
        wait_for(lambda: _ready_count("default") == 4)
        assert _ready_count("default.DQ") == 0

        survivor = Replica("tests.apps.settle_app", env, tmp_path / "survivor.log")

        def again() -> Counter[str]:
            return Counter(run["actor"] for run in runs() if run["pid"] != victim_pid)

        # Each runs again once (the failing one fails once more there, then its retry succeeds).
        wait_for(lambda: again() == Counter({"ok": 3, "fails": 2}), timeout=60)
        wait_for(lambda: _ready_count("default") == 0 and _ready_count("default.DQ") == 0)
        time.sleep(1)  # give a stray extra run the chance to show
        assert again() == Counter({"ok": 3, "fails": 2})
        assert sorted(run["n"] for run in runs() if run["pid"] != victim_pid and run["actor"] == "ok") == list(range(3))
    finally:
        producer.close()
        for replica in (victim, survivor):
            if replica is not None:
                replica.kill()


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_a_stop_acks_the_plain_acks_waiting_for_their_window(broker, make_kit, start_worker, namespace):
    kit = make_kit(broker_options={"namespace": namespace, "settle_window_ms": 10_000})
    ran: list[int] = []

    @dramatiq.actor(broker=kit.broker, actor_name="quick")
    def quick(n: int) -> None:
        ran.append(n)

    for n in range(3):
        quick.send(n)
    worker = start_worker(kit)
    wait_for(lambda: len(ran) == 3)
    time.sleep(0.1)
    # Not idempotent: nothing to write to Redis, so their acks wait on the consumer's connection.
    assert sum(len(consumer._to_settle) for consumer in list(kit.broker._consumers)) == 3
    worker.stop()
    # Acked: a channel closing with them unacked would have put them back.
    assert kit.broker.get_queue_message_counts("default") == (0, 0, 0)
    assert _ready_count("default") == 0
    assert sorted(ran) == [0, 1, 2]


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_acks_finished_in_any_order_land_once_each_and_never_on_a_running_message(
    broker, make_kit, start_worker, namespace, caplog
):
    kit = make_kit(broker_options={"namespace": namespace, "settle_window_ms": 5})
    ran: Counter[int] = Counter()
    lock = threading.Lock()
    release = threading.Event()

    @dramatiq.actor(broker=kit.broker, actor_name="mixed", max_retries=0)
    def mixed(n: int) -> None:
        with lock:
            ran[n] += 1
        if n == 0:
            release.wait(20)  # the oldest delivery holds the front while the others settle
        if n % 7 == 3:
            raise ValueError("fails for good: dead-lettered")

    total = 200
    for n in range(total):
        mixed.send(n)
    worker = start_worker(kit, threads=8)
    wait_for(lambda: len(ran) == total, timeout=30)
    time.sleep(0.3)
    # Every later one has finished; none is acked past the running first one, and nothing came back.
    assert _ready_count("default") == 0
    release.set()
    failed = sum(1 for n in range(total) if n % 7 == 3)
    wait_for(lambda: _ready_count("default.XQ") == failed)
    time.sleep(0.1)
    worker.stop()  # what was still unacked would come back as its channel closes
    # An ack landing twice would have closed the channel (PRECONDITION_FAILED) and run its messages again.
    assert set(ran.values()) == {1}, {n: c for n, c in ran.items() if c != 1}
    assert _ready_count("default") == 0
    assert _ready_count("default.XQ") == failed
    assert "PRECONDITION_FAILED" not in caplog.text
    assert "Consumer encountered" not in caplog.text
