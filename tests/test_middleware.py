"""Each public middleware in a plain broker's middleware list: it works there, or it refuses the broker in one line.

Dramatiq's stock ``RedisBroker`` and its ``StubBroker`` take the middleware that
need nothing of the kit's broker; the others refuse them when the worker boots,
naming themselves and the broker, and work on ``gp.RedisBroker`` built by hand.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import dramatiq
import pytest
import sqlalchemy as sa
from dramatiq.brokers.redis import RedisBroker as StockRedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Retries as DramatiqRetries
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import dramatiq_gp as gp
from helpers import close_broker, wait_for
from servers import OwnRedis

ROOT = Path(__file__).resolve().parent.parent


@gp.event("test.middleware.signed_up")
@dataclass(frozen=True)
class SignedUp:
    user_id: int


BrokerFactory = Callable[[list[dramatiq.Middleware]], dramatiq.Broker]


@pytest.fixture(params=["stub", "stock-redis"])
def plain_broker(request: pytest.FixtureRequest, redis_url: str, namespace: str) -> Iterator[BrokerFactory]:
    """Dramatiq's own brokers, with the given middleware after Dramatiq's defaults but Retries."""
    built: list[dramatiq.Broker] = []

    def make(middleware: list[dramatiq.Middleware]) -> dramatiq.Broker:
        if request.param == "stub":
            broker: dramatiq.Broker = StubBroker(middleware=middleware)
        else:
            broker = StockRedisBroker(url=redis_url, namespace=namespace, middleware=middleware)
        built.append(broker)
        return broker

    yield make
    for broker in built:
        close_broker(broker)


@pytest.fixture
def run_worker() -> Iterator[Callable[..., dramatiq.Worker]]:
    workers: list[dramatiq.Worker] = []

    def start(broker: dramatiq.Broker) -> dramatiq.Worker:
        broker.emit_after("process_boot")
        worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
        worker.start()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop(5_000)


def test_the_middleware_that_need_nothing_of_the_kit_work_on_dramatiqs_own_brokers(plain_broker, run_worker, caplog):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = gp.Registry()
    mails: list[int] = []
    registry.listen(SignedUp, lambda event: mails.append(event.user_id), name="welcome")
    closed: list[str] = []
    broker = plain_broker(
        [
            gp.Lifecycle().with_closer("mailer", lambda: closed.append("mailer")),
            gp.Tracing(provider),
            gp.QueueWeights({"default": 1}),
            gp.Listeners(registry),
            gp.TaskLog(),
            gp.PanicRecovery(),
            DramatiqRetries(max_retries=1, min_backoff=10, max_backoff=10),
        ]
    )
    panics: list[int] = []

    @dramatiq.actor(broker=broker, actor_name="exits_once")
    def exits_once() -> None:
        panics.append(1)
        if len(panics) == 1:
            sys.exit(3)  # PanicRecovery makes it an ordinary failure, which Retries retries

    caplog.set_level(logging.INFO)
    worker = run_worker(broker)
    assert isinstance(worker.work_queue, gp.WeightedQueue)
    for message in registry.fan_out(SignedUp(7), "envelope-1"):
        broker.enqueue(message)
    exits_once.send()
    wait_for(lambda: mails == [7] and len(panics) == 2)
    wait_for(lambda: any(r.getMessage().startswith("task done task_type=exits_once") for r in caplog.records))
    assert any(
        span.name == "process listener:test.middleware.signed_up:welcome" for span in exporter.get_finished_spans()
    )
    failed = [r for r in caplog.records if r.getMessage().startswith("task failed task_type=exits_once")]
    assert [r.will_retry for r in failed] == [True] and "HandlerPanic" in failed[0].error
    worker.stop(5_000)
    assert closed == ["mailer"]


@pytest.mark.parametrize(
    "make_middleware",
    [
        lambda engine: gp.IdempotentExecution(),
        lambda engine: gp.OverlapGuard(),
        lambda engine: gp.Retries(),
        lambda engine: gp.OutboxRelay(engine),
        lambda engine: gp.SchedulerLease(gp.Schedule().job("nightly", "@daily", lambda: None)),
        lambda engine: gp.QueueWeights({"default": 3}, strict=True),
    ],
    ids=["IdempotentExecution", "OverlapGuard", "Retries", "OutboxRelay", "SchedulerLease", "QueueWeights-strict"],
)
def test_a_middleware_that_needs_the_kits_broker_refuses_another_in_one_line_at_worker_boot(
    plain_broker, make_middleware
):
    engine = sa.create_engine("sqlite://")
    middleware = make_middleware(engine)
    broker = plain_broker([middleware])
    dramatiq.actor(lambda: None, broker=broker, actor_name="noop")
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    with pytest.raises(gp.BrokerMismatch) as refused:
        worker.start()
    message = str(refused.value)
    assert "\n" not in message
    kit_brokers = "dramatiq_gp.RedisBroker or dramatiq_gp.RabbitmqBroker"
    assert message.startswith(f"{type(middleware).__name__} needs {kit_brokers}, not dramatiq.brokers.")
    assert type(broker).__name__ in message
    assert not any(thread.is_alive() for thread in worker.workers)  # it never started processing


def test_the_refusal_is_one_line_and_exit_code_2_under_the_dramatiq_command(tmp_path, redis_url, namespace):
    app = tmp_path / "stock_app.py"
    app.write_text(
        "import dramatiq\nimport dramatiq_gp as gp\nfrom dramatiq.brokers.redis import RedisBroker\n"
        f"broker = RedisBroker(url={redis_url!r}, namespace={namespace!r}, middleware=[gp.TaskLog(), gp.Retries()])\n"
        "dramatiq.set_broker(broker)\ndramatiq.actor(lambda: None, actor_name='noop')\n"
    )
    command = [sys.executable, "-m", "dramatiq", "stock_app", "-p", "1", "-t", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    (line,) = [line for line in output.splitlines() if "start-up failed" in line]
    kit_brokers = "dramatiq_gp.RedisBroker or dramatiq_gp.RabbitmqBroker"
    assert f"Retries needs {kit_brokers}, not dramatiq.brokers.redis.RedisBroker" in line


def test_a_hand_built_broker_with_gp_retries_retries_and_loses_none_when_redis_goes_away(tmp_path, run_worker):
    server = OwnRedis(tmp_path / "redis")
    server.start()
    broker = gp.RedisBroker(
        url=server.url,
        middleware=[
            gp.Lifecycle(),
            gp.TaskLog(),
            gp.PanicRecovery(),
            gp.Retries(max_retries=3, min_backoff=100, max_backoff=100),
        ],
    )
    try:
        attempts: list[int] = []

        @dramatiq.actor(broker=broker, actor_name="fails_twice")
        def fails_twice() -> None:
            attempts.append(len(attempts) + 1)
            if len(attempts) == 1:
                server.stop()  # the retry goes out with the ack, whenever Redis takes it
                threading.Timer(1.0, server.start).start()
                raise ConnectionError("the first attempt fails as Redis goes away")
            if len(attempts) == 2:
                raise ValueError("the second attempt fails too")

        fails_twice.send()
        run_worker(broker)
        wait_for(lambda: len(attempts) == 3, timeout=30)
        time.sleep(0.5)
        assert attempts == [1, 2, 3]
    finally:
        broker.close()
        server.stop()


def test_default_middleware_is_the_kits_list_in_the_kits_order(clean_env, make_kit):
    kit = make_kit()
    names = [type(m).__name__ for m in gp.default_middleware(kit.settings)]
    assert names == [type(m).__name__ for m in kit.broker.middleware]
    assert names == [
        "GcFreeze",
        "SchedulerLease",
        "AsyncIO",
        "Lifecycle",
        "IdempotentExecution",
        "OverlapGuard",
        "Listeners",
        "TaskLog",
        "RecentFailures",
        "PanicRecovery",
        "AgeLimit",
        "TimeLimit",
        "ShutdownNotifications",
        "Callbacks",
        "Pipelines",
        "Retries",
    ]


def test_a_module_level_job_fires_in_a_real_worker_built_either_way(tmp_path, redis_url, namespace, rdb):
    for style in ("kit", "middleware"):
        prefix = f"{namespace}-{style}"
        env = {**os.environ, "REDIS_URL": redis_url, "VALKEY_NAMESPACE": prefix, "GP_TEST_STYLE": style}
        env.pop("DB_URL", None)
        log = tmp_path / f"{style}.log"
        command = [sys.executable, "-m", "dramatiq", "tests.apps.module_job_app", "-p", "1", "-t", "2"]
        with open(log, "w") as out:
            worker = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        ticks, async_ticks = f"{prefix}:test:ticks", f"{prefix}:test:async_ticks"
        try:
            wait_for(lambda: int(rdb.get(ticks) or 0) >= 2, timeout=30)  # noqa: B023 (used at once)
            wait_for(lambda: int(rdb.get(async_ticks) or 0) >= 2, timeout=30)  # noqa: B023
        finally:
            worker.terminate()
            worker.wait(30)
        assert worker.returncode == 0, log.read_text()
        assert "job:test.module.tick" in log.read_text()
        assert "job:test.module.async_tick" in log.read_text()
        for key in rdb.scan_iter(f"{prefix}:*"):
            rdb.delete(key)


def test_a_worker_freezes_what_it_holds_at_boot_out_of_garbage_collection_unless_told_not_to(
    tmp_path, redis_url, namespace, rdb
):
    for setting in ("true", "false"):
        prefix = f"{namespace}-{setting}"
        env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "VALKEY_NAMESPACE": prefix,
            "GP_TEST_STYLE": "kit",
            "WORKER_GC_FREEZE": setting,
        }
        env.pop("DB_URL", None)
        log = tmp_path / f"{setting}.log"
        command = [sys.executable, "-m", "dramatiq", "tests.apps.module_job_app", "-p", "1", "-t", "2"]
        with open(log, "w") as out:
            worker = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            # The second run, a second after the first: long after the worker booted.
            wait_for(lambda: int(rdb.get(f"{prefix}:test:ticks") or 0) >= 2, timeout=30)  # noqa: B023
        finally:
            worker.terminate()
            worker.wait(30)
        assert worker.returncode == 0, log.read_text()
        frozen, young = int(rdb.get(f"{prefix}:test:frozen")), int(rdb.get(f"{prefix}:test:young"))
        if setting == "true":
            assert frozen > 10_000, frozen  # the imports: modules, classes, functions
            assert young == gp.middleware.gc_freeze.YOUNG_THRESHOLD
        else:
            assert frozen == 0
            assert young < gp.middleware.gc_freeze.YOUNG_THRESHOLD  # CPython's own
        for key in rdb.scan_iter(f"{prefix}:*"):
            rdb.delete(key)


@gp.event("test.middleware.noted")
@dataclass(frozen=True)
class Noted:
    n: int


def test_a_hand_built_broker_says_what_was_registered_once_as_the_kit_does(
    clean_env, redis_url, namespace, run_worker, caplog
):
    registry = gp.Registry()
    registry.listen(Noted, lambda event: None, name="first")
    registry.listen(Noted, lambda event: None, name="second")
    broker = gp.RedisBroker(url=redis_url, namespace=namespace, middleware=gp.default_middleware(registry=registry))
    try:
        with caplog.at_level(logging.INFO, logger="dramatiq_gp"):
            run_worker(broker)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up: registered")]
        assert lines == ["start-up: registered 2 listener(s) for 1 event type(s), 0 schedule entries"]
    finally:
        broker.close()
