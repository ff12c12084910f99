"""Async listeners and jobs on Dramatiq's event-loop thread, and ``dispatch_async``; real Redis and PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import dramatiq
import psycopg
import pytest
import sentry_sdk
import sqlalchemy as sa
from dramatiq.asyncio import EventLoopThread, get_event_loop_thread
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import AsyncIO, Retries
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

import dramatiq_gp as gp
from dramatiq_gp.middleware.sentry import Sentry
from helpers import SentryRecorder, wait_for


@gp.event("test.async.order_placed")
@dataclass(frozen=True)
class OrderPlaced:
    order_id: int


FAST_RETRIES = {"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"}


@pytest.mark.usefixtures("broker")
def test_an_async_listener_fans_out_beside_a_sync_one_and_is_retried_on_its_own(make_kit, start_worker):
    runs: Counter[str] = Counter()
    loop_threads: set[threading.Thread] = set()

    async def notify(event: OrderPlaced) -> None:
        runs["notify"] += 1
        loop_threads.add(threading.current_thread())
        await asyncio.sleep(0.01)
        if runs["notify"] == 1:
            raise ConnectionError("the HTTP endpoint blinked")

    def ledger(event: OrderPlaced) -> None:
        runs["ledger"] += 1

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        registry.listen(OrderPlaced, notify, name="notify", max_retries=3)
        registry.listen(OrderPlaced, ledger, name="ledger")

    kit = make_kit(register, env=FAST_RETRIES)
    start_worker(kit, threads=2)
    kit.dispatch(OrderPlaced(1))
    wait_for(lambda: runs["notify"] == 2 and runs["ledger"] == 1)
    kit.broker.join("default")
    assert runs == {"notify": 2, "ledger": 1}  # the retry re-ran the async listener only
    (loop_thread,) = loop_threads
    assert isinstance(loop_thread, EventLoopThread)  # Dramatiq's event-loop thread, not a worker thread
    assert loop_thread.daemon  # gp.AsyncIO's: a process told twice to stop does not wait for it


@pytest.mark.usefixtures("broker")
def test_two_async_listeners_interleaving_on_one_loop_each_see_their_own_envelope_and_span(make_kit, start_worker):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    both_inside = threading.Barrier(2, timeout=10)
    seen: list[tuple[str, str, int, int]] = []
    loops: set[int] = set()

    def listener(name: str) -> Any:
        async def handle(event: OrderPlaced) -> None:
            loops.add(id(asyncio.get_running_loop()))
            before = gp.current_envelope().id, trace.get_current_span().get_span_context().span_id
            # Both coroutines are suspended here at once, on the one loop, before either reads again.
            await asyncio.get_running_loop().run_in_executor(None, both_inside.wait)
            await asyncio.sleep(0.05 if name == "a" else 0)
            after = gp.current_envelope().id, trace.get_current_span().get_span_context().span_id
            assert before == after
            seen.append((name, after[0], after[1], event.order_id))

        return handle

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        registry.listen(OrderPlaced, listener("a"), name="a", queue="qa")
        registry.listen(OrderPlaced, listener("b"), name="b", queue="qb")

    kit = make_kit(register, tracer_provider=provider)
    kit.dispatch(OrderPlaced(7))
    other = kit.dispatch(OrderPlaced(8))
    start_worker(kit, threads=4)
    wait_for(lambda: len(seen) == 4, timeout=15)
    kit.broker.join("qa")
    kit.broker.join("qb")

    assert len(loops) == 1
    process_spans = {
        span.context.span_id: span for span in exporter.get_finished_spans() if span.name.startswith("process ")
    }
    assert len({span_id for _, _, span_id, _ in seen}) == 4
    for name, envelope_id, span_id, order_id in seen:
        span = process_spans[span_id]  # the coroutine ran inside its own message's CONSUMER span
        assert span.name == f"process listener:test.async.order_placed:{name}"
        assert span.attributes["messaging.message.id"] == gp.fan_out_id(envelope_id, span.name.split(" ", 1)[1])
        assert (envelope_id == other) == (order_id == 8)


@pytest.mark.usefixtures("broker")
def test_an_async_job_fired_by_the_scheduler_gets_its_tick(make_kit, start_worker):
    ticks: list[datetime] = []

    async def report(scheduled_at: datetime) -> None:
        await asyncio.sleep(0)
        ticks.append(scheduled_at)

    kit = make_kit(
        lambda registry, schedule: schedule.job("async.report", "@every 1s", report, queue="jobs"),
        env={"SCHEDULER_LEASE_TTL": "1500ms"},
    )
    start_worker(kit)
    try:
        wait_for(lambda: len(ticks) >= 2, timeout=15)
    finally:
        assert kit.scheduler is not None
        kit.scheduler.stop()
    assert ticks[0].tzinfo is not None and ticks[0].microsecond == 0
    assert len(set(ticks)) == len(ticks)  # each tick once


@pytest.mark.usefixtures("broker")
def test_a_time_limit_cancels_the_coroutine_and_the_attempt_is_retried(make_kit, start_worker):
    attempts: list[str] = []

    async def slow(event: OrderPlaced) -> None:
        try:
            await asyncio.sleep(0 if attempts else 30)
            attempts.append("finished")
        except asyncio.CancelledError:
            attempts.append("cancelled")
            raise

    kit = make_kit(
        lambda registry, schedule: registry.listen(OrderPlaced, slow, name="slow", time_limit=300), env=FAST_RETRIES
    )
    start_worker(kit)
    kit.dispatch(OrderPlaced(3))
    wait_for(lambda: attempts == ["cancelled", "finished"], timeout=15)


def test_an_async_listener_with_an_async_inbox_applies_its_effect_once(database_url, engine):
    effects = sa.Table("async_effects", sa.MetaData(), sa.Column("order_id", sa.Integer))
    effects.metadata.drop_all(engine)
    effects.metadata.create_all(engine)
    async_engine = create_async_engine(database_url)
    registry = gp.Registry()

    async def record(event: OrderPlaced, conn: Any) -> None:
        await conn.execute(effects.insert().values(order_id=event.order_id))

    async def settle(event: OrderPlaced) -> None:
        async with gp.inbox(async_sessionmaker(async_engine)) as session:
            await session.execute(effects.insert().values(order_id=-event.order_id))

    registry.listen(OrderPlaced, record, name="record", inbox=async_engine)
    registry.listen(OrderPlaced, settle, name="settle")
    broker = StubBroker(middleware=[gp.AsyncIO(), gp.Listeners(registry)])
    broker.emit_after("process_boot")
    worker = dramatiq.Worker(broker, worker_threads=1)
    worker.start()
    envelope_id = str(uuid.uuid4())
    try:
        for _ in range(2):  # a redelivered copy of each message
            for message in registry.fan_out(OrderPlaced(5), envelope_id):
                broker.enqueue(message)
            broker.join("default", fail_fast=True)
            worker.join()
    finally:
        loop = get_event_loop_thread()
        assert loop is not None
        loop.run_coroutine(async_engine.dispose())  # its connections belong to that loop
        worker.stop()
    with engine.connect() as conn:
        assert sorted(conn.execute(sa.select(effects.c.order_id)).scalars()) == [-5, 5]
    effects.metadata.drop_all(engine)


def test_async_handlers_are_refused_where_they_cannot_run(engine, database_url):
    async def handle(event: OrderPlaced) -> None:
        pass

    registry = gp.Registry()
    with pytest.raises(gp.RegistrationError, match="async handler's inbox= takes an AsyncEngine"):
        registry.listen(OrderPlaced, handle, name="handle", inbox=engine)
    async_engine = create_async_engine(database_url)
    with pytest.raises(gp.RegistrationError, match="a plain handler's inbox= takes an Engine"):
        registry.listen(OrderPlaced, lambda event, conn: None, name="plain", inbox=async_engine)
    with pytest.raises(gp.ScheduleError, match="async handler's inbox= takes an AsyncEngine"):
        gp.Schedule().job("async.job", "@hourly", handle, inbox=engine)

    registry.listen(OrderPlaced, handle, name="handle")
    with pytest.raises(gp.RegistrationError, match=r"listener 'listener:test.async.order_placed:handle' is async: add"):
        registry.bind(StubBroker(middleware=[gp.Listeners(registry)]))


async def _dispatch(async_engine: Any, order_id: int, *, commit: bool, style: str) -> str:
    if style == "session":
        async with AsyncSession(async_engine) as session:
            event_id = await gp.dispatch_async(session, OrderPlaced(order_id))
            await gp.dispatch_async(session, OrderPlaced(order_id + 100))
            await (session.commit() if commit else session.rollback())
        return event_id
    async with async_engine.connect() as conn:
        event_id = await gp.dispatch_async(conn, OrderPlaced(order_id))
        await gp.dispatch_async(conn, OrderPlaced(order_id + 100))
        await (conn.commit() if commit else conn.rollback())
    return event_id


@pytest.mark.parametrize("style", ["session", "connection"])
def test_dispatch_async_writes_in_the_callers_transaction_commit_and_rollback(style, engine, database_url):
    listener = psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True)
    listener.execute(f"LISTEN {gp.outbox.CHANNEL}")
    async_engine = create_async_engine(database_url)
    gp.outbox.set_notify(True)

    async def scenario() -> tuple[str, str]:
        try:
            rolled_back = await _dispatch(async_engine, 1, commit=False, style=style)
            committed = await _dispatch(async_engine, 2, commit=True, style=style)
            return rolled_back, committed
        finally:
            await async_engine.dispose()

    rolled_back, committed = asyncio.run(scenario())
    with engine.connect() as conn:
        rows = conn.execute(sa.select(gp.outbox.OUTBOX_EVENTS.c.id, gp.outbox.OUTBOX_EVENTS.c.payload)).all()
    assert sorted(row.payload["order_id"] for row in rows) == [2, 102]  # the rolled-back pair never existed
    assert committed in {str(row.id) for row in rows} and rolled_back not in {str(row.id) for row in rows}
    assert sum(1 for _ in listener.notifies(timeout=0.3)) == 1  # once, at the commit
    listener.close()
    with pytest.raises(gp.EventError):
        asyncio.run(gp.dispatch_async(None, object()))  # type: ignore[arg-type]


@pytest.mark.usefixtures("broker")
def test_an_event_dispatched_async_reaches_an_async_listener_through_the_relay(
    make_kit, start_worker, engine, database_url
):
    got: list[int] = []

    async def handle(event: OrderPlaced) -> None:
        got.append(event.order_id)

    kit = make_kit(lambda registry, schedule: registry.listen(OrderPlaced, handle, name="handle"), engine=engine)
    start_worker(kit)
    async_engine = create_async_engine(database_url)

    async def place() -> None:
        async with AsyncSession(async_engine) as session, session.begin():
            await gp.dispatch_async(session, OrderPlaced(11))
        await async_engine.dispose()

    asyncio.run(place())
    wait_for(lambda: got == [11], timeout=15)


def test_an_async_listener_runs_in_its_messages_sentry_scope_and_its_final_failure_is_one_event():
    recorder = SentryRecorder()
    sentry_sdk.init(dsn="https://key@o1.ingest.sentry.io/1", transport=recorder)
    tags: list[dict[str, Any]] = []

    async def charge(event: OrderPlaced) -> None:
        await asyncio.sleep(0)
        tags.append(dict(sentry_sdk.get_isolation_scope()._tags))
        raise RuntimeError("the payment SDK is down")

    try:
        registry = gp.Registry()
        registry.listen(OrderPlaced, charge, name="charge")
        broker = StubBroker(
            middleware=[AsyncIO(), Sentry(), gp.Listeners(registry), gp.PanicRecovery(), Retries(max_retries=0)]
        )
        broker.emit_after("process_boot")
        worker = dramatiq.Worker(broker, worker_threads=1)
        worker.start()
        (message,) = registry.fan_out(OrderPlaced(9), str(uuid.uuid4()))
        broker.enqueue(message)
        broker.join("default", fail_fast=False)
        worker.join()
        worker.stop()
    finally:
        sentry_sdk.flush()
        sentry_sdk.get_global_scope().set_client(None)
    assert tags == [{**tags[0], "message_id": message.message_id, "task_type": message.actor_name, "attempt": 1}]
    (event,) = recorder.events
    assert event["tags"]["message_id"] == message.message_id
    assert event["exception"]["values"][-1]["type"] == "RuntimeError"


@pytest.mark.usefixtures("broker")
def test_an_async_listener_is_logged_and_a_duplicate_copy_never_reaches_it(make_kit, start_worker, caplog):
    runs: list[str] = []

    async def welcome(event: OrderPlaced) -> None:
        runs.append(gp.current_envelope().id)

    kit = make_kit(lambda registry, schedule: registry.listen(OrderPlaced, welcome, name="welcome"))
    start_worker(kit)
    envelope_id = str(uuid.uuid4())
    with caplog.at_level(logging.INFO, logger="dramatiq_gp"):
        kit.dispatch(OrderPlaced(4), envelope_id=envelope_id)
        wait_for(lambda: runs == [envelope_id])
        kit.broker.join("default")
        kit.dispatch(OrderPlaced(4), envelope_id=envelope_id)  # the same fan-out ids again
        wait_for(lambda: "already completed (duplicate)" in caplog.text)
        kit.broker.join("default")
    assert runs == [envelope_id]
    task_lines = [r.getMessage().split(" task_id=")[0] for r in caplog.records if r.name == "dramatiq_gp.tasks"]
    actor = "listener:test.async.order_placed:welcome"
    assert task_lines[:2] == [f"task started task_type={actor}", f"task done task_type={actor}"]
