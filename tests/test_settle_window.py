"""Coalesced settles: a window's acks go to Redis in one call, a stop writes them, a kill -9 loses none.

On RabbitMQ: a window's idempotency outcomes go to Redis in one call, and a stop acks
what is waiting for its window (it does not come back).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

import dramatiq_gp as gp
from apps.replica import Replica
from dramatiq_gp.brokers import rabbitmq as rabbitmq_broker
from dramatiq_gp.brokers.redis import _SCRIPTS
from dramatiq_gp.errors import ConfigError
from helpers import RABBITMQ_URL, close_broker, rabbitmq_unreachable, wait_for
from servers import OwnRedis


def _settle_calls(server: OwnRedis, run: Callable[[], None], script: str = _SCRIPTS["settle"]) -> int:
    """How many times ``run()`` made Redis run ``script`` (the kit's settle script; seen through MONITOR)."""
    sha = hashlib.sha1(script.encode()).hexdigest()
    client = redis.Redis.from_url(server.url)
    seen: list[str] = []
    with client.monitor() as monitor:
        stop = threading.Event()

        def watch() -> None:
            for command in monitor.listen():
                if stop.is_set():
                    return
                seen.append(command["command"])

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        run()
        stop.set()
        client.ping()  # one more command, so the watcher wakes and sees the stop
        watcher.join(5)
    client.close()
    # A set: redis-py repeats a call Redis answered with NOSCRIPT (before the script was loaded) word for word.
    return len({command for command in seen if command.startswith(f"EVALSHA {sha}")})


def _twenty_settled(server: OwnRedis, kit: Any, start_worker: Any, script: str, **options: Any) -> int:
    """Run 20 quick messages of an actor with ``options`` to the end; how many calls of ``script`` settled them."""
    ran: list[int] = []

    @dramatiq.actor(broker=kit.broker, actor_name="quick", **options)
    def quick(n: int) -> None:
        ran.append(n)

    for n in range(20):
        quick.send(n)

    def run_all() -> None:
        worker = start_worker(kit)
        wait_for(lambda: len(ran) == 20)
        worker.stop()

    calls = _settle_calls(server, run_all, script)
    assert sorted(ran) == list(range(20))
    return calls


@pytest.mark.parametrize(("window", "most_calls"), [("300ms", 2), ("0", 20)])
def test_the_acks_of_one_window_go_to_redis_in_one_call(window, most_calls, tmp_path, make_kit, start_worker):
    server = OwnRedis(tmp_path / "redis")
    server.start()
    try:
        kit = make_kit(env={"REDIS_URL": server.url, "WORKER_SETTLE_WINDOW": window})
        calls = _twenty_settled(server, kit, start_worker, _SCRIPTS["settle"])
        # Each message settled on its own without a window; a handful of calls at most with one.
        assert 1 <= calls <= most_calls, calls
        if window == "0":
            assert calls == 20, calls
        assert kit.broker.client.hlen(f"{kit.broker.namespace}:default.msgs") == 0
    finally:
        server.stop()


def test_a_stop_writes_the_settles_still_waiting_for_their_window(make_kit, start_worker, rdb, namespace):
    kit = make_kit(env={"WORKER_SETTLE_WINDOW": "1s"})
    ran = threading.Event()

    @dramatiq.actor(broker=kit.broker, actor_name="quick")
    def quick() -> None:
        ran.set()

    quick.send()
    worker = start_worker(kit)
    assert ran.wait(10)
    time.sleep(0.1)  # it is done, its ack waits for the window
    assert rdb.hlen(f"{namespace}:default.msgs") == 1
    worker.stop()
    assert rdb.hlen(f"{namespace}:default.msgs") == 0
    assert not list(rdb.scan_iter(f"{namespace}:__acks__.*"))


def test_a_worker_killed_within_its_window_runs_those_messages_again_and_loses_none(
    tmp_path, clean_env, redis_url, namespace, rdb
):
    env = {"REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace}
    runs_key = f"{namespace}:test:runs"

    def runs() -> list[dict[str, Any]]:
        return [json.loads(run) for run in rdb.lrange(runs_key, 0, -1)]

    victim = Replica("tests.apps.settle_app", {**env, "WORKER_SETTLE_WINDOW": "1s"}, tmp_path / "victim.log")
    survivor = None
    producer = RedisBroker(url=redis_url, namespace=namespace)
    try:
        wait_for(victim.started, timeout=30)
        for actor, n in (("ok", 0), ("fails", 1)):
            producer.enqueue(Message(queue_name="default", actor_name=actor, args=(n,), kwargs={}, options={}))
        wait_for(lambda: len(runs()) == 2, interval=0.01)
        # Both are done (one failed: its retry goes out with its ack); their settles wait for the window.
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait(30)
        victim_pid = runs()[0]["pid"]
        [acks] = rdb.scan_iter(f"{namespace}:__acks__.*")
        assert rdb.scard(acks) == 2, "a settle reached Redis before the kill: the window did not hold"
        assert rdb.hlen(f"{namespace}:default.msgs") == 2
        assert rdb.llen(f"{namespace}:default.DQ") == 0, "the retry went out without its ack"

        # A survivor that counts a worker dead after 2 s takes both back: each runs again (the
        # failing one fails once more there, then its retry succeeds), and nothing is left over.
        survivor = Replica("tests.apps.settle_app", {**env, "GP_TEST_HEARTBEAT_MS": "2000"}, tmp_path / "survivor.log")

        def again() -> Counter[str]:
            return Counter(run["actor"] for run in runs() if run["pid"] != victim_pid)

        wait_for(lambda: again() == Counter({"ok": 1, "fails": 2}), timeout=60)
        wait_for(lambda: rdb.hlen(f"{namespace}:default.msgs") == 0 and rdb.llen(f"{namespace}:default.DQ") == 0)
        time.sleep(1)  # give a stray extra run the chance to show
        assert again() == Counter({"ok": 1, "fails": 2})
        assert not rdb.exists(acks)
    finally:
        close_broker(producer)
        for replica in (victim, survivor):
            if replica is not None:
                replica.kill()


def test_a_stop_while_redis_is_away_does_not_wait_for_it(tmp_path, make_kit, start_worker, caplog):
    server = OwnRedis(tmp_path / "redis")
    server.start()
    try:
        kit = make_kit(env={"REDIS_URL": server.url, "WORKER_SETTLE_WINDOW": "1s"})
        ran = threading.Event()

        @dramatiq.actor(broker=kit.broker, actor_name="quick")
        def quick() -> None:
            ran.set()

        quick.send()
        worker = start_worker(kit)
        assert ran.wait(10)
        server.stop()  # its ack is still waiting for the window
        started = time.monotonic()
        worker.stop(timeout=30_000)
        kit.broker.close()
        assert time.monotonic() - started < 10
        assert "could not be written as the broker closed" in caplog.text
    finally:
        server.stop()


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
# With a window: the first, one for what RabbitMQ delivered after it began, and the stop's.
@pytest.mark.parametrize(("window", "most_calls"), [("300ms", 3), ("0", 20)])
def test_on_rabbitmq_the_outcomes_of_one_window_go_to_redis_in_one_call(
    broker, window, most_calls, tmp_path, make_kit, start_worker
):
    server = OwnRedis(tmp_path / "redis")
    server.start()
    try:
        kit = make_kit(env={"REDIS_URL": server.url, "WORKER_SETTLE_WINDOW": window})
        calls = _twenty_settled(server, kit, start_worker, rabbitmq_broker._SCRIPTS["record"], idempotent=True)
        assert 1 <= calls <= most_calls, calls
        if window == "0":
            assert calls == 20, calls
        assert kit.broker.get_queue_message_counts("default") == (0, 0, 0)  # none put back
    finally:
        server.stop()


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_on_rabbitmq_a_stop_acks_what_waits_for_its_window(broker, make_kit, start_worker, namespace):
    # A window longer than WORKER_SETTLE_WINDOW allows, and than rabbitmqctl takes to start.
    kit = make_kit(broker_options={"namespace": namespace, "settle_window_ms": 10_000})
    ran: list[int] = []

    @dramatiq.actor(broker=kit.broker, actor_name="quick", idempotent=True)
    def quick() -> None:
        ran.append(1)

    quick.send()
    worker = start_worker(kit)
    wait_for(lambda: ran == [1])
    time.sleep(0.1)
    # Done; its outcome and its ack wait on its consumer's connection, unacked, not on the settler.
    assert kit.broker.held() == {"default": 1}
    assert kit.broker.settler is not None and kit.broker.settler.pending == 0
    worker.stop()
    assert kit.broker.settler.pending == 0
    # Acked: a channel closing with it unacked would have put it back.
    assert kit.broker.get_queue_message_counts("default") == (0, 0, 0)
    assert ran == [1]


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_a_broker_built_directly_reads_worker_settle_window_as_the_kit_does(kind, clean_env, redis_url, namespace):
    def build(**options: Any) -> Any:
        if kind == "redis":
            return gp.RedisBroker(url=redis_url, namespace=namespace, **options)
        reason = rabbitmq_unreachable(RABBITMQ_URL)
        if reason is not None:
            pytest.skip(reason)
        client = redis.Redis.from_url(redis_url)
        return rabbitmq_broker.RabbitmqBroker(url=RABBITMQ_URL, client=client, namespace=namespace, **options)

    clean_env.setenv("WORKER_SETTLE_WINDOW", "0")
    unbatched = build()
    assert unbatched.settler is None  # the setting, not the argument's old default of 1 ms
    clean_env.setenv("WORKER_SETTLE_WINDOW", "7ms")
    windowed, given = build(), build(settle_window_ms=0)
    assert windowed.settler is not None and windowed.settler.window_s == pytest.approx(0.007)
    assert given.settler is None  # an argument wins over the environment
    clean_env.setenv("WORKER_SETTLE_WINDOW", "soon")
    with pytest.raises(ConfigError) as refused:
        build()
    assert "WORKER_SETTLE_WINDOW" in str(refused.value) and "\n" not in str(refused.value)
    for broker in (unbatched, windowed, given):
        close_broker(broker)


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_on_rabbitmq_an_outcome_redis_did_not_take_is_written_by_the_settler_before_its_ack(
    broker, tmp_path, make_kit, start_worker, namespace
):
    # The consumer's connection writes a window's outcomes itself; with Redis away it hands them to the settler.
    server = OwnRedis(tmp_path / "redis")
    server.start()
    try:
        kit = make_kit(env={"REDIS_URL": server.url}, broker_options={"namespace": namespace, "settle_window_ms": 500})
        ran: list[int] = []

        @dramatiq.actor(broker=kit.broker, actor_name="quick", idempotent=True)
        def quick() -> None:
            ran.append(1)

        sent = quick.send()
        worker = start_worker(kit)
        wait_for(lambda: ran == [1])
        server.stop()  # before the window ends: the connection's write fails
        assert kit.broker.settler is not None
        wait_for(lambda: kit.broker.settler.pending == 1, timeout=10)
        time.sleep(0.5)
        assert kit.broker.held() == {"default": 1}  # not acked without its done mark
        server.start()
        wait_for(lambda: kit.broker.settler.pending == 0 and kit.broker.held() == {}, timeout=10)
        kit.broker.enqueue(sent)  # a copy of the id: its done mark is in Redis, so it is skipped
        wait_for(lambda: kit.broker.get_queue_message_counts("default") == (0, 0, 0) and kit.broker.held() == {})
        time.sleep(0.2)
        worker.stop()
        assert ran == [1]
    finally:
        server.stop()
