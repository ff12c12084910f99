"""The parts of Dramatiq the kit relies on that Dramatiq does not promise, each pinned.

Every test here exercises Dramatiq itself, not the kit, against a real Redis: if a
new Dramatiq release renames, moves or changes one of them, its test fails and
names what the kit has to follow. docs/internals.md lists them with where the kit
uses each and why; ``make compat`` runs the suite against the oldest and the
newest supported Dramatiq.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import dramatiq.worker
import pytest
import redis
from dramatiq import Actor, Message, Middleware, Worker, cli
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import RedisBroker, _RedisConsumer
from dramatiq.common import compute_backoff, current_millis, dq_name, q_name
from dramatiq.errors import BrokerConnectionError, ConnectionClosed, DecodeError
from dramatiq.middleware import (
    AgeLimit,
    MiddlewareError,
    Retries,
    Shutdown,
    SkipMessage,
    TimeLimit,
    TimeLimitExceeded,
)
from dramatiq.rate_limits import RateLimitExceeded
from dramatiq.threading import Interrupt
from dramatiq.worker import ConsumerThread, WorkerThread, _WorkQueueItem

from dramatiq_gp.middleware import TaskLog, task_log
from helpers import wait_for
from servers import OwnRedis

Q = "internals"

Connect = Callable[..., RedisBroker]


@pytest.fixture
def connect(redis_url: str) -> Iterator[Connect]:
    """Build plain Dramatiq brokers (no middleware unless given) on a client of their own."""
    brokers: list[RedisBroker] = []

    def connect(namespace: str, *, cls: type[RedisBroker] = RedisBroker, url: str = redis_url, **options: Any):
        options.setdefault("middleware", [])
        broker = cls(client=redis.Redis.from_url(url), namespace=namespace, **options)
        brokers.append(broker)
        return broker

    yield connect
    for broker in brokers:
        broker.client.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    """A Redis of the test's own, to stop and start again under Dramatiq."""
    server = OwnRedis(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


def _message(actor_name: str = "probe", *args: Any, queue_name: str = Q, **options: Any) -> Message[Any]:
    return Message(queue_name=queue_name, actor_name=actor_name, args=args, kwargs={}, options=options)


def _declare(
    broker: RedisBroker, name: str, fn: Callable[..., Any], priority: int = 0, **options: Any
) -> Actor[Any, Any]:
    return Actor(fn, broker=broker, actor_name=name, queue_name=Q, priority=priority, options=options)


def _start(broker: RedisBroker, threads: int = 1) -> Worker:
    worker = Worker(broker, worker_threads=threads, worker_timeout=50)
    worker.start()
    return worker


def _dispatch_args(broker: RedisBroker, command: str, queue_name: str, *rest: Any, maintain: int = 0) -> list[Any]:
    """``dispatch.lua``'s arguments in the order the kit's broker passes them."""
    return [
        command,
        current_millis(),
        queue_name,
        broker.broker_id,
        broker.heartbeat_timeout,
        broker.dead_message_ttl,
        maintain,
        broker._max_unpack_size(),
        *rest,
    ]


class Signals(Middleware):
    """Records the hooks it sees, by name, with what a test wants to know at that moment."""

    def __init__(
        self, name: str = "", note: Callable[[str, Any], Any] | None = None, log: list[tuple[Any, ...]] | None = None
    ) -> None:
        self.name = name
        self.note = note or (lambda hook, message: None)
        #: (hook, name, note); middleware sharing one log show the order across them.
        self.seen: list[tuple[Any, ...]] = log if log is not None else []

    def _record(self, hook: str, message: Any = None) -> None:
        self.seen.append((hook, self.name, self.note(hook, message)))

    def after_process_boot(self, broker: Any) -> None:
        self._record("after_process_boot")

    def before_process_message(self, broker: Any, message: Any) -> None:
        self._record("before_process_message", message)

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None, exception: Any = None) -> None:
        self._record("after_process_message", message)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        self._record("after_skip_message", message)

    def before_ack(self, broker: Any, message: Any) -> None:
        self._record("before_ack", message)

    def after_ack(self, broker: Any, message: Any) -> None:
        self._record("after_ack", message)

    def before_nack(self, broker: Any, message: Any) -> None:
        self._record("before_nack", message)

    def after_nack(self, broker: Any, message: Any) -> None:
        self._record("after_nack", message)

    def hooks(self) -> list[str]:
        return [hook for hook, _, _ in self.seen]


# -- 1. _RedisConsumer -------------------------------------------------------------------------------------------------


class _ProbeConsumer(_RedisConsumer):
    def __init__(self, *args: Any) -> None:
        self.args = args
        super().__init__(*args)


class _ProbeConsumerBroker(RedisBroker):
    @property
    def consumer_class(self) -> type[_RedisConsumer]:
        return _ProbeConsumer


def test_redis_consumer_is_built_through_consumer_class_with_the_arguments_the_kit_subclass_takes(connect, namespace):
    broker = connect(namespace, cls=_ProbeConsumerBroker)
    consumer = broker.consume(Q, prefetch=5, timeout=100)

    assert isinstance(consumer, _ProbeConsumer)
    assert consumer.args == (broker, Q, 5, 100)
    assert (consumer.broker, consumer.queue_name, consumer.prefetch, consumer.timeout) == (broker, Q, 5, 100)
    assert consumer.misses == 0
    assert consumer.queued_message_ids == set()
    assert consumer.outstanding_message_count == 0
    # The kit's consumer keeps its own batch: its outstanding count is the ids it adds here.
    consumer.queued_message_ids.update({"a", "b"})
    assert consumer.outstanding_message_count == 2


def test_redis_consumer_settles_by_the_redis_message_id_and_forgets_the_message_id(connect, namespace, rdb):
    broker = connect(namespace)
    for n in range(3):
        broker.enqueue(_message("probe", n))
    consumer = broker.consume(Q, prefetch=3, timeout=100)
    done, dead, back = fetched = [next(consumer) for _ in range(3)]
    ids = [m.options["redis_message_id"] for m in fetched]
    acks = f"{namespace}:__acks__.{broker.broker_id}.{Q}"
    assert consumer.queued_message_ids == {m.message_id for m in fetched}
    assert rdb.smembers(acks) == set(ids)
    assert not set(ids) & {m.message_id for m in fetched}  # two different ids: Redis knows only the first

    consumer.ack(done)
    consumer.nack(dead)
    consumer.requeue([back])

    assert done.message_id not in consumer.queued_message_ids
    assert dead.message_id not in consumer.queued_message_ids
    assert rdb.smembers(acks) == set()
    assert rdb.lrange(f"{namespace}:{Q}", 0, -1) == [ids[2]]
    assert set(rdb.hkeys(f"{namespace}:{Q}.msgs")) == {ids[2]}
    assert rdb.zrange(f"{namespace}:{Q}.XQ", 0, -1) == [ids[1]]
    assert Message.decode(rdb.hget(f"{namespace}:{Q}.XQ.msgs", ids[1]).encode()).message_id == dead.message_id


# -- 2. RedisBroker's helpers and attributes ---------------------------------------------------------------------------


def test_redis_broker_keeps_the_attributes_and_helpers_the_kit_calls(connect, namespace):
    broker = connect(namespace, heartbeat_timeout=1234, dead_message_ttl=5678, maintenance_chance=1_000_000)
    never = connect(namespace, maintenance_chance=0)

    assert broker.namespace == namespace
    assert isinstance(broker.client, redis.Redis)
    assert (broker.heartbeat_timeout, broker.dead_message_ttl) == (1234, 5678)
    assert str(uuid.UUID(broker.broker_id)) == broker.broker_id
    assert broker.broker_id != never.broker_id
    unpack = broker._max_unpack_size()
    assert isinstance(unpack, int) and unpack > 0
    assert callable(broker.scripts["dispatch"])
    # Lua compares the flag with "1": it must be the int 1 or 0, and never 1 for a settling command.
    assert [broker._should_do_maintenance(c) for c in ("fetch", "enqueue", "ack", "nack")] == [1, 1, 0, 0]
    assert never._should_do_maintenance("fetch") == 0


def test_do_requeue_puts_fetched_delayed_ids_back_on_their_delay_queue(connect, namespace, rdb):
    broker = connect(namespace)
    sent = [broker.enqueue(_message("probe", n), delay=60_000) for n in range(2)]
    ids = [m.options["redis_message_id"] for m in sent]
    delayed = dq_name(Q)
    consumer = broker.consume(delayed, prefetch=2, timeout=100)
    assert {next(consumer).message_id, next(consumer).message_id} == {m.message_id for m in sent}
    assert rdb.llen(f"{namespace}:{delayed}") == 0

    broker.do_requeue(delayed, *ids)

    assert rdb.lrange(f"{namespace}:{delayed}", 0, -1) == ids
    assert rdb.smembers(f"{namespace}:__acks__.{broker.broker_id}.{delayed}") == set()


# -- 3. dispatch.lua's arguments and results ---------------------------------------------------------------------------


def test_dispatch_lua_enqueue_takes_the_arguments_the_kit_passes_in_a_pipeline(connect, namespace, rdb):
    broker = connect(namespace)
    messages = [_message("probe", n).copy(options={"redis_message_id": str(uuid.uuid4())}) for n in range(2)]
    with broker.client.pipeline(transaction=True) as pipe:
        for message in messages:
            rid = message.options["redis_message_id"]
            args = _dispatch_args(broker, "enqueue", Q, rid, message.encode())
            broker.scripts["dispatch"](keys=[namespace], args=args, client=pipe)
        assert rdb.llen(f"{namespace}:{Q}") == 0  # nothing until the pipeline runs
        pipe.execute()

    rids = [m.options["redis_message_id"] for m in messages]
    assert rdb.lrange(f"{namespace}:{Q}", 0, -1) == rids
    assert rdb.hget(f"{namespace}:{Q}.msgs", rids[0]) == messages[0].encode().decode()
    consumer = broker.consume(Q, prefetch=2, timeout=100)
    assert [next(consumer).message_id for _ in messages] == [m.message_id for m in messages]


def test_dispatch_lua_fetch_of_none_runs_only_the_maintenance_and_the_heartbeat(connect, namespace, rdb):
    """The kit fetches with its own ``fetch.lua`` (ids with the data) and calls ``dispatch.lua``
    for its maintenance alone, asking for no message."""
    broker = connect(namespace)
    sent = broker.enqueue(_message("probe", 1))
    dead_worker_acks = f"{namespace}:__acks__.dead-worker.{Q}"
    rdb.lpop(f"{namespace}:{Q}")
    rdb.sadd(dead_worker_acks, sent.options["redis_message_id"])
    rdb.zadd(f"{namespace}:__heartbeats__", {"dead-worker": 1})

    args = _dispatch_args(broker, "fetch", Q, 0, maintain=1)
    assert broker.scripts["dispatch"](keys=[namespace], args=args) == []

    assert rdb.lrange(f"{namespace}:{Q}", 0, -1) == [sent.options["redis_message_id"]]  # returned, not fetched
    assert not rdb.exists(dead_worker_acks)
    assert rdb.zscore(f"{namespace}:__heartbeats__", broker.broker_id) == args[1]


# -- 4. The key layout, and what each command and maintenance do to it -------------------------------------------------


def test_enqueue_lays_out_queue_delay_queue_and_heartbeat_keys_as_the_kit_reads_them(connect, namespace, rdb):
    broker = connect(namespace)
    before = current_millis()
    ready = broker.enqueue(_message("probe", 1))
    later = broker.enqueue(_message("probe", 2), delay=60_000)
    ns = namespace

    assert rdb.type(f"{ns}:{Q}") == "list" and rdb.type(f"{ns}:{Q}.msgs") == "hash"
    assert rdb.lrange(f"{ns}:{Q}", 0, -1) == [ready.options["redis_message_id"]]
    rid = later.options["redis_message_id"]
    assert rdb.lrange(f"{ns}:{Q}.DQ", 0, -1) == [rid]
    stored = Message.decode(rdb.hget(f"{ns}:{Q}.DQ.msgs", rid).encode())
    # The kit writes its own delayed copies (retries, deferrals) in this shape.
    assert stored.queue_name == f"{Q}.DQ" == dq_name(Q)
    assert before + 60_000 <= stored.options["eta"] <= current_millis() + 60_000
    assert stored.options["redis_message_id"] == rid != ready.options["redis_message_id"]
    beat = rdb.zscore(f"{ns}:__heartbeats__", broker.broker_id)
    assert beat is not None and before <= beat <= current_millis()


def test_a_fetched_message_stays_in_msgs_until_settled_and_a_nack_moves_it_to_the_canonical_xq(connect, namespace, rdb):
    broker = connect(namespace)
    broker.enqueue(_message("probe", 1))
    broker.enqueue(_message("probe", 2), delay=60_000)
    ns, bid = namespace, broker.broker_id
    ready, delayed = broker.consume(Q, 1, 100), broker.consume(f"{Q}.DQ", 1, 100)
    first, second = next(ready), next(delayed)
    rids = [first.options["redis_message_id"], second.options["redis_message_id"]]

    # ``dramatiq-gp status`` counts in flight as stored minus ready.
    assert rdb.hlen(f"{ns}:{Q}.msgs") - rdb.llen(f"{ns}:{Q}") == 1
    assert rdb.smembers(f"{ns}:__acks__.{bid}.{Q}") == {rids[0]}
    assert rdb.smembers(f"{ns}:__acks__.{bid}.{Q}.DQ") == {rids[1]}

    before = current_millis()
    ready.nack(first)
    delayed.nack(second)

    assert rdb.hlen(f"{ns}:{Q}.msgs") == 0 and rdb.hlen(f"{ns}:{Q}.DQ.msgs") == 0
    assert rdb.type(f"{ns}:{Q}.XQ") == "zset"
    assert set(rdb.zrange(f"{ns}:{Q}.XQ", 0, -1)) == set(rids)
    assert all(before <= score <= current_millis() for _, score in rdb.zrange(f"{ns}:{Q}.XQ", 0, -1, withscores=True))
    assert set(rdb.hkeys(f"{ns}:{Q}.XQ.msgs")) == set(rids)
    assert not rdb.exists(f"{ns}:{Q}.DQ.XQ")


def test_a_message_written_with_hset_and_rpush_alone_is_fetched(connect, namespace, rdb):
    """The scheduler's firing writes the queue's hash and list itself, in its own Lua call."""
    broker = connect(namespace)
    rid = str(uuid.uuid4())
    message = _message("probe", "tick", redis_message_id=rid)
    rdb.hset(f"{namespace}:{Q}.msgs", rid, message.encode())
    rdb.rpush(f"{namespace}:{Q}", rid)

    fetched = next(broker.consume(Q, 1, 100))

    assert fetched.message_id == message.message_id
    assert fetched.options["redis_message_id"] == rid


def test_maintenance_returns_a_dead_workers_unacked_messages_once_its_heartbeat_is_older_than_the_timeout(
    connect, namespace, rdb
):
    dead = connect(namespace)
    live = connect(namespace, heartbeat_timeout=300)
    sent = [dead.enqueue(_message("probe", n)) for n in range(2)]
    consumer = dead.consume(Q, 2, 100)
    assert len([next(consumer) for _ in sent]) == 2
    dead_acks = f"{namespace}:__acks__.{dead.broker_id}.{Q}"
    maintain = live.scripts["dispatch"]

    assert maintain(keys=[namespace], args=_dispatch_args(live, "fetch", Q, 5, maintain=1)) == []
    assert rdb.scard(dead_acks) == 2
    time.sleep(0.4)
    returned = maintain(keys=[namespace], args=_dispatch_args(live, "fetch", Q, 5, maintain=1))

    assert sorted(Message.decode(data).message_id for data in returned) == sorted(m.message_id for m in sent)
    assert not rdb.exists(dead_acks)
    assert rdb.zscore(f"{namespace}:__heartbeats__", dead.broker_id) is None


def test_maintenance_purges_dead_letters_older_than_the_dead_message_ttl(connect, namespace, rdb):
    broker = connect(namespace, dead_message_ttl=300)
    for n in range(2):
        broker.enqueue(_message("probe", n))
    consumer = broker.consume(Q, 2, 100)
    old, new = next(consumer), next(consumer)
    consumer.nack(old)
    time.sleep(0.4)
    consumer.nack(new)

    broker.scripts["dispatch"](keys=[namespace], args=_dispatch_args(broker, "fetch", Q, 1, maintain=1))

    kept = [new.options["redis_message_id"]]
    assert rdb.zrange(f"{namespace}:{Q}.XQ", 0, -1) == kept
    assert rdb.hkeys(f"{namespace}:{Q}.XQ.msgs") == kept


# -- 5. Worker ---------------------------------------------------------------------------------------------------------


class HeapQueue(queue.Queue[Any]):
    """A work queue built as the kit's WeightedQueue is: queue.Queue's storage hooks over a heap."""

    def _init(self, maxsize: int) -> None:
        self.items: list[Any] = []
        self.puts: list[Any] = []
        self.gets: list[tuple[bool, float | None]] = []

    def _qsize(self) -> int:
        return len(self.items)

    def _put(self, item: Any) -> None:
        self.puts.append(item)
        heapq.heappush(self.items, item)

    def _get(self) -> Any:
        return heapq.heappop(self.items)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        self.gets.append((block, timeout))
        return super().get(block, timeout)


class InstallsQueue(Middleware):
    def __init__(self, prefetch: int | None = None) -> None:
        self.queue = HeapQueue()
        self.prefetch = prefetch

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        worker.work_queue = self.queue

    def after_consumer_thread_boot(self, broker: Any, thread: Any) -> None:
        if self.prefetch is not None and thread.queue_name == Q:
            thread.prefetch = self.prefetch


class _RecordsConsume(RedisBroker):
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.consumed: list[tuple[str, int, Any]] = []

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> Any:
        consumer = super().consume(queue_name, prefetch, timeout)
        self.consumed.append((queue_name, prefetch, consumer))
        return consumer


def test_worker_threads_take_the_work_queue_and_prefetch_set_in_the_boot_hooks(connect, namespace):
    installs, signals = InstallsQueue(prefetch=3), Signals()
    broker = connect(namespace, cls=_RecordsConsume, middleware=[installs, signals])
    ran: list[str] = []
    _declare(broker, "probe", lambda n: ran.append(n), priority=5)
    worker = _start(broker, threads=2)
    try:
        sent = broker.enqueue(_message("probe", "a"))
        wait_for(lambda: ran == ["a"])
        work_queue = installs.queue

        assert set(worker.consumers) == {Q, f"{Q}.DQ"}
        assert all(isinstance(c, ConsumerThread) and c.work_queue is work_queue for c in worker.consumers.values())
        assert len(worker.workers) == 2
        assert all(isinstance(t, WorkerThread) and t.work_queue is work_queue for t in worker.workers)
        assert [(name, prefetch) for name, prefetch, _ in broker.consumed if name == Q] == [(Q, 3)]
        item = work_queue.puts[0]
        assert isinstance(item, _WorkQueueItem) and isinstance(item.message, MessageProxy)
        assert (item.priority, item.message.message_id) == (5, sent.message_id)
        assert (True, 0.05) in work_queue.gets  # worker threads block for up to worker_timeout

        worker._add_worker()
        assert len(worker.workers) == 3
        assert worker.workers[-1].is_alive() and worker.workers[-1].work_queue is work_queue
        assert worker.worker_threads == 2 and worker.consumer_whitelist is None
    finally:
        worker.stop(timeout=5000)
    assert "after_process_boot" not in signals.hooks()  # only the dramatiq command emits it
    assert Worker(broker, queues={Q}).consumer_whitelist == {Q}


def test_work_queue_items_order_by_priority_then_arrival():
    messages = [MessageProxy(_message("probe", n)) for n in range(3)]
    items = [_WorkQueueItem(5, messages[0]), _WorkQueueItem(1, messages[1]), _WorkQueueItem(5, messages[2])]
    assert [item.message for item in sorted(items)] == [messages[1], messages[0], messages[2]]


def test_worker_stop_takes_a_timeout_and_requeues_what_waits_in_the_work_queue_with_non_blocking_gets(
    connect, namespace, rdb
):
    installs = InstallsQueue()
    broker = connect(namespace, middleware=[installs])
    started, release, ran = threading.Event(), threading.Event(), []

    def hold(n: int) -> None:
        started.set()
        release.wait(10)
        ran.append(n)

    _declare(broker, "hold", hold)
    worker = _start(broker, threads=1)
    stopping = threading.Thread(target=worker.stop, kwargs={"timeout": 5000})
    try:
        first, waiting = broker.enqueue(_message("hold", 1)), broker.enqueue(_message("hold", 2))
        started.wait(10)
        wait_for(lambda: installs.queue.qsize() == 1)
        stopping.start()
        # The worker thread is told to stop while it still runs the first message.
        wait_for(lambda: not worker.workers[0].running)
    finally:
        release.set()
        if stopping.ident is None:
            stopping.start()
        stopping.join(10)

    assert not stopping.is_alive()
    assert ran == [1]
    assert rdb.lrange(f"{namespace}:{Q}", 0, -1) == [waiting.options["redis_message_id"]]
    assert rdb.smembers(f"{namespace}:__acks__.{broker.broker_id}.{Q}") == set()
    assert not rdb.hexists(f"{namespace}:{Q}.msgs", first.options["redis_message_id"])
    assert (False, None) in installs.queue.gets


# -- 6. ConsumerThread -------------------------------------------------------------------------------------------------


def test_consumer_thread_drops_its_delayed_messages_on_a_connection_error_and_builds_a_new_consumer(
    connect, own_redis, monkeypatch
):
    monkeypatch.setattr(dramatiq.worker, "CONSUMER_RESTART_DELAY_SECS", 0.05)
    broker = connect("own", cls=_RecordsConsume, url=own_redis.url)
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    rid = broker.enqueue(_message("probe", 1), delay=60_000).options["redis_message_id"]
    delayed = dq_name(Q)
    thread = ConsumerThread(
        broker=broker, queue_name=delayed, prefetch=10, work_queue=queue.PriorityQueue(), worker_timeout=50
    )
    thread.start()
    try:
        wait_for(lambda: thread.delay_queue.qsize() == 1)
        held, first_consumer = thread.delay_queue, thread.consumer

        own_redis.stop()
        wait_for(lambda: thread.delay_queue is not held)
        own_redis.start()
        back = current_millis()
        wait_for(lambda: (client.zscore("own:__heartbeats__", broker.broker_id) or 0) >= back)

        assert thread.is_alive()
        assert thread.consumer is not first_consumer
        assert len(broker.consumed) >= 2
        assert thread.delay_queue.qsize() == 0
        # Stranded: still this process's, and not on the delay queue for anyone to fetch.
        assert client.smembers(f"own:__acks__.{broker.broker_id}.{delayed}") == {rid}
        assert client.lrange(f"own:{delayed}", 0, -1) == []
    finally:
        thread.stop()
        thread.join(5)
        client.close()


def test_a_consumer_threads_connection_errors_go_to_its_logger_and_task_log_says_each_outage_once(
    connect, own_redis, monkeypatch, caplog
):
    # Dramatiq logs each failed reconnect CRITICAL, and "Restarting consumer" at INFO, every second.
    monkeypatch.setattr(dramatiq.worker, "CONSUMER_RESTART_DELAY_SECS", 0.05)
    monkeypatch.setattr(task_log, "OUTAGE_QUIET_S", 1.0)
    broker = connect("own", cls=_RecordsConsume, url=own_redis.url)
    thread = ConsumerThread(
        broker=broker, queue_name=Q, prefetch=10, work_queue=queue.PriorityQueue(), worker_timeout=50
    )
    assert thread.logger.name == f"dramatiq.worker.ConsumerThread({Q})"
    TaskLog().after_consumer_thread_boot(broker, thread)
    caplog.set_level(logging.DEBUG, logger=thread.logger.name)

    def lost() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.msg == "Consumer encountered a connection error: %s"]

    thread.start()
    try:
        for outage in (1, 2):
            own_redis.stop()
            wait_for(lambda errors=3 * outage: len(lost()) >= errors)
            own_redis.start()
            # Consuming again: quiet for longer than OUTAGE_QUIET_S, so the next error is another outage.
            wait_for(lambda: time.time() - lost()[-1].created > 1.1, timeout=15)
    finally:
        thread.stop()
        thread.join(5)
    levels = [r.levelname for r in lost()]
    assert levels.count("WARNING") == 2 and levels[0] == "WARNING", levels
    assert set(levels) == {"WARNING", "INFO"}
    restarting = [r.levelname for r in caplog.records if r.msg.startswith("Restarting consumer")]
    assert restarting.count("INFO") == 2 and set(restarting) == {"INFO", "DEBUG"}, restarting


class _SignalsWithEnqueue(Signals):
    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self._record("after_enqueue", message)


def test_a_due_delayed_message_is_enqueued_on_its_queue_then_the_delayed_copy_acked(connect, namespace, rdb):
    signals = _SignalsWithEnqueue()
    broker = connect(namespace, middleware=[signals])
    delayed = dq_name(Q)
    rid = str(uuid.uuid4())
    # Written as the kit's broker writes a retry or a deferral: straight to the delay queue.
    copy = _message("probe", 1, queue_name=delayed, redis_message_id=rid, eta=current_millis() + 100)
    rdb.hset(f"{namespace}:{delayed}.msgs", rid, copy.encode())
    rdb.rpush(f"{namespace}:{delayed}", rid)
    thread = ConsumerThread(
        broker=broker, queue_name=delayed, prefetch=10, work_queue=queue.PriorityQueue(), worker_timeout=50
    )
    thread.start()
    try:
        wait_for(lambda: rdb.llen(f"{namespace}:{Q}") == 1 and rdb.hlen(f"{namespace}:{delayed}.msgs") == 0)
    finally:
        thread.stop()
        thread.join(5)

    due = Message.decode(rdb.hget(f"{namespace}:{Q}.msgs", rdb.lindex(f"{namespace}:{Q}", 0)).encode())
    assert (due.queue_name, due.message_id) == (Q, copy.message_id)
    assert "eta" not in due.options and due.options["redis_message_id"] != rid
    assert rdb.smembers(f"{namespace}:__acks__.{broker.broker_id}.{delayed}") == set()
    assert signals.hooks() == ["after_enqueue", "before_ack", "after_ack"]


def test_post_process_message_retries_an_ack_until_redis_answers_again(connect, own_redis, monkeypatch):
    monkeypatch.setattr(dramatiq.worker, "POST_PROCESS_MESSAGE_RETRY_DELAY_SECS", 0.05)
    signals = Signals()
    broker = connect("own", url=own_redis.url, middleware=[signals])
    broker.enqueue(_message("probe", 1))
    thread = ConsumerThread(
        broker=broker, queue_name=Q, prefetch=1, work_queue=queue.PriorityQueue(), worker_timeout=50
    )
    thread.consumer = broker.consume(Q, 1, 50)
    message = next(thread.consumer)

    own_redis.stop()
    settling = threading.Thread(target=thread.post_process_message, args=(message,))
    settling.start()
    time.sleep(0.3)
    assert settling.is_alive()
    own_redis.start()
    settling.join(10)

    assert not settling.is_alive()
    assert signals.hooks().count("after_ack") == 1
    client = redis.Redis.from_url(own_redis.url)
    assert client.hlen(f"own:{Q}.msgs") == 0 and client.scard(f"own:__acks__.{broker.broker_id}.{Q}") == 0
    client.close()


# -- 7. Log lines ------------------------------------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, Any, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.name, record.msg, record.args))


@pytest.fixture
def dramatiq_log() -> Iterator[_Records]:
    """Dramatiq's records as Dramatiq made them.

    The kit's TaskLog filters some of them out of the worker logger for the whole
    process and its NoPayloads rewrites their arguments on the root handlers; a
    handler on the ``dramatiq`` logger, with the worker logger's filters lifted,
    sees them before either.
    """
    records = _Records()
    top, worker_logger = logging.getLogger("dramatiq"), logging.getLogger("dramatiq.worker.WorkerThread")
    saved = top.level, worker_logger.level, worker_logger.filters[:]
    top.setLevel(logging.DEBUG)
    top.addHandler(records)
    worker_logger.setLevel(logging.NOTSET)
    worker_logger.filters.clear()
    yield records
    top.removeHandler(records)
    top.setLevel(saved[0])
    worker_logger.setLevel(saved[1])
    worker_logger.filters[:] = saved[2]


class _SkipsTheSkipped(Middleware):
    def before_process_message(self, broker: Any, message: Any) -> None:
        if message.actor_name == "skipped":
            raise SkipMessage()


def test_worker_thread_logs_the_lines_the_kit_filters_and_rewrites(connect, namespace, rdb, dramatiq_log):
    broker = connect(namespace, middleware=[_SkipsTheSkipped(), Retries(max_retries=0)])

    def fails(secret: str) -> None:
        raise ValueError(secret)

    def expected(secret: str) -> None:
        raise KeyError(secret)

    def limited(secret: str) -> None:
        raise RateLimitExceeded("over the limit")

    _declare(broker, "fails", fails)
    _declare(broker, "expected", expected, throws=KeyError)
    _declare(broker, "limited", limited)
    _declare(broker, "skipped", lambda secret: None)
    talker = _declare(broker, "talks", lambda secret: None)
    actor_log = _Records()
    talker.logger.addHandler(actor_log)
    talker.logger.setLevel(logging.DEBUG)
    worker = _start(broker)
    try:
        for name in ("fails", "expected", "limited", "skipped", "talks"):
            broker.enqueue(_message(name, f"secret-{name}"))
        wait_for(lambda: rdb.hlen(f"{namespace}:{Q}.msgs") == 0 and rdb.llen(f"{namespace}:{Q}") == 0)
    finally:
        worker.stop(timeout=5000)
        talker.logger.removeHandler(actor_log)
        talker.logger.setLevel(logging.NOTSET)

    def logged(line: str, actor_name: str) -> list[tuple[str, Any]]:
        return [
            (name, args)
            for name, msg, args in dramatiq_log.seen
            if msg == line and isinstance(args[0], MessageProxy) and args[0].actor_name == actor_name
        ]

    expected_lines = {
        "Failed to process message %s with unhandled exception.": "fails",
        "Failed to process message %s with expected exception %s.": "expected",
        "Rate limit exceeded in message %s: %s.": "limited",
        "Message %s was skipped.": "skipped",
        "Received message %s with id %r.": "talks",
    }
    for line, actor_name in expected_lines.items():
        found = logged(line, actor_name)
        assert len(found) == 1, line
        logger_name, args = found[0]
        assert logger_name == "dramatiq.worker.WorkerThread"
        # The message itself is the argument, and it prints its payload: why the kit rewrites these lines.
        assert f"secret-{actor_name}" in str(args[0])
    assert logged("Failed to process message %s with expected exception %s.", "expected")[0][1][1] == "KeyError"
    assert [args for _, msg, args in actor_log.seen if msg == "Received args=%r kwargs=%r."] == [
        (("secret-talks",), {})
    ]


def test_retries_logs_its_retry_and_exhaustion_lines_on_its_own_logger(connect, namespace, caplog, monkeypatch):
    # TaskLog filters these two lines by their text on this logger: its `task failed` says the same.
    monkeypatch.setattr(logging.getLogger("dramatiq.middleware.retries.Retries"), "filters", [])  # a TaskLog's
    broker = connect(namespace, middleware=[Retries(min_backoff=10, max_backoff=10)])
    broker.declare_queue(Q)

    @dramatiq.actor(broker=broker, queue_name=Q, max_retries=1)
    def fails() -> None:
        raise RuntimeError("boom")

    fails.send()
    worker = Worker(broker, worker_threads=1, worker_timeout=100)
    with caplog.at_level(logging.INFO, logger="dramatiq.middleware.retries.Retries"):
        worker.start()
        try:
            wait_for(lambda: any(r.msg == "Retries exceeded for message %r." for r in caplog.records), timeout=10)
        finally:
            worker.stop(1_000)
    lines = [(r.name, r.msg) for r in caplog.records if r.name.startswith("dramatiq.middleware.retries")]
    assert ("dramatiq.middleware.retries.Retries", "Retrying message %r in %d milliseconds.") in lines
    assert ("dramatiq.middleware.retries.Retries", "Retries exceeded for message %r.") in lines


# -- 8. The dramatiq command -------------------------------------------------------------------------------------------

PROBE_APP = """
import os
import sys

import dramatiq
from dramatiq import Middleware, cli
from dramatiq.brokers.redis import RedisBroker

MODE = os.environ["PROBE_MODE"]


def note(line):
    with open(os.environ["PROBE_TRACE"], "a") as trace:
        trace.write(line + "\\n")


def booting():
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is cli.worker_process.__code__:
            return True
        frame = frame.f_back
    return False


note(f"imported in worker_process={booting()}")
if MODE == "import":
    raise SystemExit(cli.RET_IMPORT)


class Probe(Middleware):
    def after_process_boot(self, broker):
        if MODE == "group":
            import multiprocessing

            note(f"group {multiprocessing.parent_process().pid}")
            return
        note("after_process_boot")
        if MODE == "process_boot":
            raise SystemExit(cli.RET_CONNECT)

    def before_worker_boot(self, broker, worker):
        note(f"before_worker_boot in worker_process={booting()}")
        if MODE == "worker_boot":
            raise SystemExit(cli.RET_IMPORT)
        stop = worker.stop

        def stop_with_note(timeout=600_000):
            note(f"stop timeout={timeout}")
            stop(timeout=timeout)

        worker.stop = stop_with_note

    def after_worker_boot(self, broker, worker):
        note("after_worker_boot")
        if MODE == "signal":
            import signal

            dramatiqs = signal.getsignal(signal.SIGTERM)
            note(f"handler {dramatiqs.__module__}:{dramatiqs.__qualname__}")

            def on_term(signum, frame):
                while frame is not None and frame.f_code is not cli.worker_process.__code__:
                    frame = frame.f_back
                local = frame.f_locals
                note(f"signal in worker_process: timeout={local['args'].worker_shutdown_timeout} "
                     f"worker={type(local['worker']).__name__} broker={type(local['broker']).__name__}")
                dramatiqs(signum, frame)

            signal.signal(signal.SIGTERM, on_term)


# `dramatiq probe_app`, with no `:variable`, runs the global broker, as `dramatiq app.worker` runs the Kit's.
dramatiq.set_broker(
    RedisBroker(url=os.environ["REDIS_URL"], namespace=os.environ["PROBE_NAMESPACE"], middleware=[Probe()])
)
"""


def _dramatiq_command(
    tmp_path: Path, namespace: str, redis_url: str, mode: str, *, processes: int = 1, args: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    (tmp_path / "probe_app.py").write_text(PROBE_APP)
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
        "PROBE_MODE": mode,
        "PROBE_TRACE": str(tmp_path / "trace"),
        "PROBE_NAMESPACE": namespace,
        "REDIS_URL": redis_url,
    }
    command = [
        sys.executable,
        "-m",
        "dramatiq",
        "probe_app",
        "--processes",
        str(processes),
        "--threads",
        "1",
        "--worker-shutdown-timeout",
        "1234",
        *args,
    ]
    with open(tmp_path / "log", "wb") as log:
        # A session of its own, so a failed test can end the worker processes too, not only the parent.
        return subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _end(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _trace(tmp_path: Path) -> list[str]:
    path = tmp_path / "trace"
    return path.read_text().splitlines() if path.exists() else []


def test_the_cli_exit_codes_the_kit_raises_are_import_2_and_connect_3():
    assert (cli.RET_IMPORT, cli.RET_CONNECT) == (2, 3)


@pytest.mark.parametrize(
    ("mode", "code", "trace"),
    [
        ("import", 2, ["imported in worker_process=True"]),
        ("process_boot", 3, ["imported in worker_process=True", "after_process_boot"]),
        (
            "worker_boot",
            2,
            ["imported in worker_process=True", "after_process_boot", "before_worker_boot in worker_process=True"],
        ),
    ],
)
def test_a_system_exit_while_a_worker_process_boots_becomes_the_commands_exit_code(
    tmp_path, namespace, redis_url, mode, code, trace
):
    process = _dramatiq_command(tmp_path, namespace, redis_url, mode)
    try:
        assert process.wait(60) == code, (tmp_path / "log").read_text()
    finally:
        _end(process)
    # The application is imported, and the worker booted, under worker_process (the kit's one-line start-up
    # errors look for its frame); after_process_boot comes right after the import, before the worker.
    assert _trace(tmp_path) == trace


def test_the_cli_stops_the_worker_through_its_stop_attribute_with_the_shutdown_timeout(tmp_path, namespace, redis_url):
    process = _dramatiq_command(tmp_path, namespace, redis_url, "run")
    try:
        wait_for(lambda: "after_worker_boot" in _trace(tmp_path), timeout=30)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, (tmp_path / "log").read_text()
    finally:
        _end(process)
    assert _trace(tmp_path) == [
        "imported in worker_process=True",
        "after_process_boot",
        "before_worker_boot in worker_process=True",
        "after_worker_boot",
        "stop timeout=1234",
    ]


def test_the_worker_processs_sigterm_handler_and_the_locals_of_the_frame_it_interrupts(tmp_path, namespace, redis_url):
    # Lifecycle takes over this handler (by its name) and stops the worker from it with these locals;
    # a second SIGTERM to Dramatiq's handler kills the process at once (RET_KILLED), without a stop.
    process = _dramatiq_command(tmp_path, namespace, redis_url, "signal")
    try:
        wait_for(lambda: "after_worker_boot" in _trace(tmp_path), timeout=30)
        time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, (tmp_path / "log").read_text()
    finally:
        _end(process)
    assert _trace(tmp_path)[-3:] == [
        "handler dramatiq.cli:worker_process.<locals>.termhandler",
        "signal in worker_process: timeout=1234 worker=Worker broker=RedisBroker",
        "stop timeout=1234",
    ]


@pytest.mark.parametrize("start", ["default", "--use-spawn"])
def test_the_cli_starts_each_worker_process_as_a_multiprocessing_child_of_its_main_process(
    tmp_path, namespace, redis_url, start
):
    # The kit names a group's directory after parent_process().pid, which every worker process of it agrees on.
    args = () if start == "default" else (start,)
    process = _dramatiq_command(tmp_path, namespace, redis_url, "group", processes=2, args=args)

    def groups() -> list[str]:
        return [line for line in _trace(tmp_path) if line.startswith("group ")]

    try:
        wait_for(lambda: len(groups()) == 2, timeout=30)
    finally:
        _end(process)
    assert groups() == [f"group {process.pid}"] * 2


def test_a_consumer_thread_stops_through_its_stop_attribute_and_holds_its_consumer(connect, namespace):
    broker = connect(namespace)
    broker.declare_queue(Q)
    stopped: list[bool] = []
    worker = Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        thread = worker.consumers[Q]  # and its delay queue's
        wait_for(lambda: thread.consumer is not None)
        stop = thread.stop

        def noted_stop() -> None:
            stopped.append(True)
            stop()

        thread.stop = noted_stop  # type: ignore[method-assign]
    finally:
        worker.stop(1_000)
    assert stopped == [True]
    assert not thread.is_alive()


# -- 9. Hooks, retries and the order of a message's processing ---------------------------------------------------------


class _Raises(Middleware):
    def __init__(self, error: BaseException, seen: list[str]) -> None:
        self.error, self.seen = error, seen

    def before_ack(self, broker: Any, message: Any) -> None:
        self.seen.append("before raises")
        raise self.error

    def after_ack(self, broker: Any, message: Any) -> None:
        self.seen.append("after raises")
        raise self.error


class _Notes(Middleware):
    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen

    def before_ack(self, broker: Any, message: Any) -> None:
        self.seen.append(f"before {self.name}")

    def after_ack(self, broker: Any, message: Any) -> None:
        self.seen.append(f"after {self.name}")


def test_emit_before_reraises_only_middleware_errors_and_emit_after_swallows_exceptions_in_reverse_order(
    connect, namespace
):
    seen: list[str] = []

    def broker_with(error: BaseException) -> RedisBroker:
        seen.clear()
        return connect(namespace, middleware=[_Notes("a", seen), _Raises(error, seen), _Notes("c", seen)])

    broker = broker_with(ValueError("swallowed"))
    broker.emit_before("ack", None)
    broker.emit_after("ack", None)
    assert seen == ["before a", "before raises", "before c", "after c", "after raises", "after a"]

    broker = broker_with(SkipMessage())
    with pytest.raises(SkipMessage):
        broker.emit_before("ack", None)
    assert seen == ["before a", "before raises"]
    assert issubclass(SkipMessage, MiddlewareError)

    # What the kit's lifecycle raises from after_process_boot to end a booting worker process.
    broker = broker_with(SystemExit(3))
    with pytest.raises(SystemExit):
        broker.emit_after("ack", None)
    assert seen == ["after c", "after raises"]


def test_a_skip_from_before_process_message_runs_every_after_skip_message_in_reverse_then_acks(connect, namespace, rdb):
    class Skips(Signals):
        def before_process_message(self, broker: Any, message: Any) -> None:
            super().before_process_message(broker, message)
            raise SkipMessage()

    log: list[tuple[Any, ...]] = []
    broker = connect(namespace, middleware=[Signals("a", log=log), Skips("b", log=log), Signals("c", log=log)])
    ran: list[int] = []
    _declare(broker, "probe", ran.append)
    worker = _start(broker)
    try:
        broker.enqueue(_message("probe", 1))
        wait_for(lambda: ("after_ack", "a", None) in log)
    finally:
        worker.stop(timeout=5000)

    assert ran == []
    assert [(hook, name) for hook, name, _ in log] == [
        ("before_process_message", "a"),
        ("before_process_message", "b"),
        ("after_skip_message", "c"),
        ("after_skip_message", "b"),
        ("after_skip_message", "a"),
        ("before_ack", "a"),
        ("before_ack", "b"),
        ("before_ack", "c"),
        ("after_ack", "c"),
        ("after_ack", "b"),
        ("after_ack", "a"),
    ]
    assert rdb.hlen(f"{namespace}:{Q}.msgs") == 0


def test_a_failed_attempt_is_settled_after_every_after_process_message_then_its_exception_cleared(
    connect, namespace, rdb
):
    def note(hook: str, message: Any) -> Any:
        proxies.append(message)
        return (message.failed, getattr(message, "_exception", None) is not None)

    proxies: list[Any] = []
    signals = Signals(note=note)
    # Listed before Retries, so its after-hooks run after Retries' (reverse order).
    broker = connect(namespace, middleware=[signals, Retries(max_retries=0)])

    def fails(n: int) -> None:
        raise ValueError(n)

    _declare(broker, "fails", fails)
    worker = _start(broker)
    try:
        sent = broker.enqueue(_message("fails", 1))
        wait_for(lambda: "after_nack" in signals.hooks())
        proxy = proxies[0]
        wait_for(lambda: getattr(proxy, "_exception", None) is None)
    finally:
        worker.stop(timeout=5000)

    # (hook, failed, exception still stuffed in the message)
    assert [(hook, note) for hook, _, note in signals.seen] == [
        ("before_process_message", (False, False)),
        ("after_process_message", (True, True)),
        ("before_nack", (True, True)),
        ("after_nack", (True, True)),
    ]
    assert all(p is proxy for p in proxies)
    assert rdb.zrange(f"{namespace}:{Q}.XQ", 0, -1) == [sent.options["redis_message_id"]]


class _RecordsEnqueue(RedisBroker):
    def __init__(self, *, send: bool = True, **options: Any) -> None:
        super().__init__(**options)
        self.send = send
        self.enqueued: list[tuple[Any, int | None]] = []

    def enqueue(self, message: Any, *, delay: int | None = None) -> Any:
        self.enqueued.append((message, delay))
        return super().enqueue(message, delay=delay) if self.send else message


def test_retries_reads_throws_from_the_message_options_first_then_the_actor_options(connect, namespace):
    # Exception classes in options cannot be encoded: this broker records what it would send.
    broker = connect(namespace, cls=_RecordsEnqueue, send=False, middleware=[Retries()])
    _declare(broker, "throws_key", lambda: None, throws=KeyError)
    retries = Retries(max_retries=5)

    def attempt(exception: BaseException, **options: Any) -> MessageProxy:
        proxy = MessageProxy(_message("throws_key", **options))
        retries.after_process_message(broker, proxy, exception=exception)
        return proxy

    by_message = attempt(ValueError(), throws=ValueError)
    by_actor = attempt(KeyError())
    message_wins = attempt(KeyError(), throws=ValueError)

    assert by_message.failed and "retries" not in by_message.options
    assert by_actor.failed and "retries" not in by_actor.options
    assert not message_wins.failed and message_wins.options["retries"] == 1
    assert [message for message, _ in broker.enqueued] == [message_wins]


def test_age_limit_fails_and_skips_a_message_past_max_age_from_its_options_its_actor_or_its_default(connect, namespace):
    # The kit's Retries says why in the dead letter by the same rule (AgeLimit says so only in its log).
    broker = connect(namespace)
    _declare(broker, "aged", lambda: None, max_age=1_000)
    _declare(broker, "ageless", lambda: None)
    limit = AgeLimit(max_age=60_000)
    assert limit.max_age == 60_000

    def check(actor: str, age_ms: int, **options: Any) -> bool:
        message = _message(actor, **options)._replace(message_timestamp=current_millis() - age_ms)
        proxy = MessageProxy(message)
        try:
            limit.before_process_message(broker, proxy)
        except SkipMessage:
            assert proxy.failed
            return True
        assert not proxy.failed
        return False

    assert check("aged", 2_000) and not check("aged", 500)  # the actor's
    assert not check("aged", 2_000, max_age=5_000) and check("aged", 6_000, max_age=5_000)  # the message's first
    assert check("ageless", 61_000) and not check("ageless", 59_000)  # the middleware's default


def test_retries_sends_the_retry_as_the_same_proxy_updated_in_place_through_the_brokers_enqueue(
    connect, namespace, rdb
):
    broker = connect(namespace, cls=_RecordsEnqueue, middleware=[Retries()])
    _declare(broker, "probe", lambda: None)
    retries = Retries(max_retries=1, min_backoff=100, max_backoff=100)
    proxy = MessageProxy(_message("probe"))

    retries.after_process_message(broker, proxy, exception=ValueError("first"))

    assert len(broker.enqueued) == 1
    sent, delay = broker.enqueued[0]
    assert sent is proxy and not proxy.failed
    assert proxy.options["retries"] == 1 and delay is not None and 0 < delay <= 100
    stored = rdb.hvals(f"{namespace}:{Q}.DQ.msgs")
    assert [Message.decode(data.encode()).options["retries"] for data in stored] == [1]

    try:
        raise ValueError("second")
    except ValueError as exc:  # the worker calls the after-hooks inside its except block
        retries.after_process_message(broker, proxy, exception=exc)
    assert proxy.failed and len(broker.enqueued) == 1
    # Giving up, it still counts the attempt and keeps its traceback on the proxy: the kit's nack keeps the
    # dead letter as the proxy is then, so it says why it died.
    assert proxy.options["retries"] == 2 and proxy.options["traceback"].strip().endswith("ValueError: second")


def test_an_actor_calls_the_fn_that_after_declare_actor_left_on_it(connect, namespace):
    class Wraps(Middleware):
        def after_declare_actor(self, broker: Any, actor: Any) -> None:
            inner = actor.fn
            actor.fn = lambda *args, **kwargs: ("wrapped", inner(*args, **kwargs))

    broker = connect(namespace, middleware=[Wraps()])
    actor = _declare(broker, "double", lambda n: n * 2)
    assert actor(21) == ("wrapped", 42)


def test_dramatiqs_own_interrupts_are_base_exceptions_under_interrupt():
    assert issubclass(TimeLimitExceeded, Interrupt) and issubclass(Shutdown, Interrupt)
    assert not issubclass(Interrupt, Exception)


# -- 10. Messages, proxies, errors and queue names ---------------------------------------------------------------------


def test_message_proxy_reads_through_to_its_message_and_keeps_its_own_attributes():
    message = Message(queue_name=Q, actor_name="probe", args=(1,), kwargs={"k": 2}, options={"x": 1})
    proxy = MessageProxy(message)

    assert (proxy.message_id, proxy.args, proxy.kwargs, proxy.queue_name) == (message.message_id, (1,), {"k": 2}, Q)
    assert proxy.options is message.options
    proxy.options["y"] = 2
    assert message.options == {"x": 1, "y": 2}
    proxy._gp_settle_plan = "plan"
    assert proxy._gp_settle_plan == "plan" and not hasattr(message, "_gp_settle_plan")
    assert proxy.failed is False
    proxy.fail()
    assert proxy.failed is True
    assert str(proxy) == str(message) == "probe(1, k=2)"


def test_message_copy_merges_options_and_keeps_the_id():
    message = _message("probe", 1, x=1, y=2)
    copy = MessageProxy(message).copy(queue_name=f"{Q}.DQ", options={"y": 3, "z": 4})

    assert isinstance(copy, Message)
    assert copy.options == {"x": 1, "y": 3, "z": 4}
    assert message.options == {"x": 1, "y": 2}
    assert (copy.message_id, copy.queue_name) == (message.message_id, f"{Q}.DQ")


def test_message_decode_wraps_any_error_in_decode_error_with_the_cause():
    """The kit names the cause of an undecodable message by ``type(error.error).__name__``."""
    for data, cause in [(b"not json", DecodeError), (b'{"queue_name": "q"}', KeyError), (b"[1]", TypeError)]:
        with pytest.raises(DecodeError) as caught:
            Message.decode(data)
        assert isinstance(caught.value.error, cause), data
        assert caught.value.__cause__ is caught.value.error


def test_the_connection_errors_the_kit_raises_are_the_ones_dramatiq_catches():
    assert issubclass(ConnectionClosed, BrokerConnectionError)
    assert str(ConnectionClosed(redis.ConnectionError("gone"))) == "gone"


def test_queue_name_helpers_and_backoff_behave_as_the_kits_keys_and_polling_expect():
    assert (q_name(Q), q_name(f"{Q}.DQ"), q_name(f"{Q}.XQ")) == (Q, Q, Q)
    assert (dq_name(Q), dq_name(f"{Q}.DQ")) == (f"{Q}.DQ", f"{Q}.DQ")
    misses, backoff = compute_backoff(0, max_backoff=100)
    assert misses == 1 and 0 <= backoff <= 100
    assert compute_backoff(40, max_backoff=100)[1] <= 100
    assert abs(current_millis() - time.time() * 1000) < 1000


def test_an_async_actor_runs_on_the_event_loop_thread_in_a_copy_of_the_worker_threads_context():
    from contextvars import ContextVar

    from dramatiq.asyncio import EventLoopThread, get_event_loop_thread
    from dramatiq.brokers.stub import StubBroker
    from dramatiq.middleware import AsyncIO

    seen: ContextVar[str] = ContextVar("seen", default="the loop thread's")
    observed: list[tuple[str, bool]] = []

    class SetsInWorkerThread(Middleware):
        def before_process_message(self, broker: Any, message: Any) -> None:
            seen.set(f"worker thread's {message.message_id}")

    broker = StubBroker(middleware=[AsyncIO(), SetsInWorkerThread()])

    async def read() -> None:
        observed.append((seen.get(), isinstance(threading.current_thread(), EventLoopThread)))
        seen.set("changed in the task")

    actor = Actor(read, broker=broker, actor_name="read", queue_name="default", priority=0, options={})
    worker = Worker(broker, worker_threads=1)
    worker.start()
    assert get_event_loop_thread() is not None
    message = actor.send()
    broker.join("default")
    worker.join()
    worker.stop()
    assert observed == [(f"worker thread's {message.message_id}", True)]
    assert get_event_loop_thread() is None  # AsyncIO's after_worker_shutdown cleared it


def test_the_worker_holds_its_threads_and_time_limit_reads_the_message_then_the_actor_then_its_default(
    connect, namespace
):
    broker = connect(namespace, middleware=[TimeLimit(time_limit=7_000)])
    limits = next(m for m in broker.middleware if isinstance(m, TimeLimit))
    assert limits.time_limit == 7_000
    _declare(broker, "limited", lambda: None, time_limit=3_000)
    _declare(broker, "unlimited", lambda: None)
    worker = Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        assert len(worker.workers) == 2 and all(isinstance(t, WorkerThread) for t in worker.workers)
        assert all(t.is_alive() for t in worker.workers)
        assert {q for q in worker.consumers if not q.endswith(".DQ")} == {Q}
        assert all(isinstance(t, ConsumerThread) and t.is_alive() for t in worker.consumers.values())
    finally:
        worker.stop()
    assert not any(t.is_alive() for t in [*worker.workers, *worker.consumers.values()])
    # The limit TimeLimit applies, as the kit reads it: the message's, else the actor's, else its default.
    for actor_name, options, expected in [
        ("limited", {"time_limit": 500}, 500),
        ("limited", {}, 3_000),
        ("unlimited", {}, 7_000),
    ]:
        message = _message(actor_name, **options)
        actor = broker.get_actor(actor_name)
        read = message.options.get("time_limit") or actor.options.get("time_limit", limits.time_limit)
        assert read == expected
    assert "time_limit" in TimeLimit().actor_options


LOGGING_PROBE_APP = """
import logging, os, sys
import dramatiq
from dramatiq import cli
from dramatiq.brokers.redis import RedisBroker

frame = sys._getframe()
while frame is not None and frame.f_code is not cli.worker_process.__code__:
    frame = frame.f_back
handler = logging.getLogger().handlers[0]
stream = handler.stream
with open(os.environ["PROBE_TRACE"], "w") as trace:
    print(f"handler {type(handler).__module__}.{type(handler).__qualname__}", file=trace)
    print(f"stream {type(stream).__module__}.{type(stream).__qualname__} fd={stream.fileno() > 2}", file=trace)
    print(f"sys.stderr is the stream: {sys.stderr is stream}", file=trace)
    print(f"args.log_file {frame.f_locals['args'].log_file}", file=trace)
stream.write("a line through the pipe\\n")
dramatiq.set_broker(RedisBroker(url=os.environ["REDIS_URL"], namespace=os.environ["PROBE_NAMESPACE"]))
"""


def test_a_worker_process_logs_through_a_streamable_pipe_the_parent_writes_to_the_log_file(
    tmp_path, namespace, redis_url
):
    # The kit's telemetry.direct_stream: it recognises the CLI's pipe by its class, finds the
    # command's --log-file in worker_process's `args` local, and writes there itself.
    (tmp_path / "logging_probe.py").write_text(LOGGING_PROBE_APP)
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
        "PROBE_TRACE": str(tmp_path / "trace"),
        "PROBE_NAMESPACE": namespace,
        "REDIS_URL": redis_url,
    }
    log = tmp_path / "dramatiq.log"
    command = [sys.executable, "-m", "dramatiq", "logging_probe", "-p", "1", "-t", "1", "--log-file", str(log)]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: log.exists() and "Worker process is ready for action." in log.read_text(), timeout=30)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        _end(process)
    assert _trace(tmp_path) == [
        "handler logging.StreamHandler",
        "stream dramatiq.compat.StreamablePipe fd=True",
        "sys.stderr is the stream: True",
        f"args.log_file {log}",
    ]
    assert "a line through the pipe" in log.read_text()
    assert cli.fork_process.__code__.co_varnames[0] == "args"  # the fork processes' frame has it too


def test_dramatiq_reads_its_prefetch_variable_into_queue_prefetch(monkeypatch):
    # The kit's Redis consumer grows its prefetch only when this global is 0 (the variable unset).
    from dramatiq.brokers.stub import StubBroker

    assert int(os.environ.get("dramatiq_queue_prefetch", 0)) == dramatiq.worker.QUEUE_PREFETCH  # noqa: SIM112 (Dramatiq's spelling)
    monkeypatch.setattr(dramatiq.worker, "QUEUE_PREFETCH", 0)
    assert Worker(StubBroker(), worker_threads=3).queue_prefetch == 6
    monkeypatch.setattr(dramatiq.worker, "QUEUE_PREFETCH", 5)
    assert Worker(StubBroker(), worker_threads=3).queue_prefetch == 5
