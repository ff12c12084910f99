"""Delayed and timed events: ``dispatch(..., delay=)`` / ``at=`` through the outbox, with real worker processes.

``tests.apps.delay_app`` is a worker with a relay in its process (``DB_URL`` set)
and one listener that records, in Redis, when each event reached it: the times
asserted below are the listener's own. A delayed event is an outbox row whose
``available_at`` and ``not_before`` are its due time, so it commits or rolls back
with the caller's transaction, survives any process, and reaches no broker
before it is due.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import dramatiq
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import dramatiq_gp as gp
from apps.app_events import Numbered
from apps.replica import Replica
from dramatiq_gp.brokers.kinds import view_for
from dramatiq_gp.names import EVENT_QUEUE
from dramatiq_gp.outbox import OUTBOX_EVENTS
from dramatiq_gp.status import outbox_status
from dramatiq_gp.tracecontext import ORIGIN
from helpers import delayed, own_database, ready, wait_for

ROOT = Path(__file__).resolve().parent.parent
T = OUTBOX_EVENTS.c
#: How late a due event may reach its listener. The relay publishes it within milliseconds of its time (the test
#: below holds it to 0.5 s); the rest is the broker's delivery: an idle Redis worker polls its queues up to a second
#: apart (RabbitMQ pushes: tens of milliseconds), then one fan-out and one listener run.
LATENESS_S = 2.0


def _arrivals(rdb: redis.Redis, namespace: str) -> list[dict]:
    return [json.loads(item) for item in rdb.lrange(f"{namespace}:test:arrivals", 0, -1)]


def _row(engine: sa.Engine, event_id: str) -> sa.Row:
    with engine.connect() as conn:
        return conn.execute(sa.select(OUTBOX_EVENTS).where(T.id == event_id)).one()


def _worker(tmp_path: Path, database_url: str, redis_url: str, namespace: str, name: str = "worker") -> Replica:
    env = {"REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace, "DB_URL": database_url}
    replica = Replica("tests.apps.delay_app", env, tmp_path / f"{name}.log")
    wait_for(replica.started, timeout=30)
    return replica


@pytest.mark.usefixtures("broker")
def test_a_delayed_event_arrives_after_its_time_once_committed_and_never_when_rolled_back(
    tmp_path, clean_env, engine, database_url, redis_url, namespace, rdb
):
    worker = _worker(tmp_path, database_url, redis_url, namespace)
    try:
        with engine.begin() as conn:
            delayed_id = gp.dispatch(conn, Numbered(1), delay=timedelta(seconds=2))
        at = datetime.now(UTC) + timedelta(seconds=2.5)
        with engine.begin() as conn:
            timed_id = gp.dispatch(conn, Numbered(2), at=at)
        with pytest.raises(RuntimeError), engine.begin() as conn:
            gp.dispatch(conn, Numbered(3), delay=timedelta(seconds=1))
            raise RuntimeError("the order was not placed")

        async def dispatch_async() -> str:
            async_engine = create_async_engine(database_url)
            try:
                async with AsyncSession(async_engine) as session, session.begin():
                    return await gp.dispatch_async(session, Numbered(4), delay=timedelta(seconds=2))
            finally:
                await async_engine.dispose()

        async_id = asyncio.run(dispatch_async())
        due = {n: _row(engine, i).not_before.timestamp() for n, i in ((1, delayed_id), (2, timed_id), (4, async_id))}
        assert due[2] == pytest.approx(at.timestamp(), abs=0.001)

        wait_for(lambda: len(_arrivals(rdb, namespace)) >= 3, timeout=30, interval=0.05)
        time.sleep(1.5)  # time for the rolled-back one, or a second copy, to show up if it could
        arrivals = {a["n"]: a for a in _arrivals(rdb, namespace)}
        assert sorted(arrivals) == [1, 2, 4]  # 3 rolled back: it never existed
        assert len(_arrivals(rdb, namespace)) == 3  # each once
        for n, event_id in ((1, delayed_id), (2, timed_id), (4, async_id)):
            assert arrivals[n]["id"] == event_id  # the envelope id dispatch returned, as without a delay
            assert due[n] <= arrivals[n]["arrived"] < due[n] + LATENESS_S, (n, arrivals[n]["arrived"] - due[n])
        assert "Traceback" not in worker.log
    finally:
        worker.kill()


def test_a_worker_and_relay_killed_before_the_due_time_still_deliver_it_once_after(
    tmp_path, clean_env, engine, database_url, redis_url, namespace, rdb
):
    first = _worker(tmp_path, database_url, redis_url, namespace, "first")
    second = None
    try:
        with engine.begin() as conn:
            event_id = gp.dispatch(conn, Numbered(7), delay=timedelta(seconds=4))
        time.sleep(0.5)  # the relay saw it, and left it: not yet due
        assert _row(engine, event_id).published_at is None
        first.kill()  # kill -9: the relay and the worker together
        second = _worker(tmp_path, database_url, redis_url, namespace, "second")
        due = _row(engine, event_id).not_before.timestamp()
        wait_for(lambda: _arrivals(rdb, namespace), timeout=30, interval=0.05)
        time.sleep(1.5)
        (arrival,) = _arrivals(rdb, namespace)
        assert arrival["id"] == event_id
        assert arrival["arrived"] >= due
        assert arrival["pid"] != first.process.pid
    finally:
        for replica in (first, second):
            if replica is not None:
                replica.kill()


@pytest.mark.usefixtures("broker")
def test_a_delay_of_days_stays_a_row_in_the_table_and_puts_nothing_on_the_broker(
    tmp_path, clean_env, make_kit, engine, database_url, redis_url, namespace, rdb
):
    worker = _worker(tmp_path, database_url, redis_url, namespace)
    try:
        with engine.begin() as conn:
            later = gp.dispatch(conn, Numbered(1), delay=timedelta(days=2))
            gp.dispatch(conn, Numbered(2))  # committed with it: the relays ran a round over both
        wait_for(lambda: _arrivals(rdb, namespace), timeout=30, interval=0.05)
        time.sleep(1.0)  # a few more rounds
        assert [a["n"] for a in _arrivals(rdb, namespace)] == [2]
        row = _row(engine, later)
        assert row.published_at is None and row.failed_at is None and row.attempts == 0
        assert row.not_before - datetime.now(UTC) > timedelta(days=1, hours=23)
        kit = make_kit()  # the same broker as the worker's, to count its queues
        assert ready(kit, EVENT_QUEUE) == 0 and delayed(kit, EVENT_QUEUE) == 0
        if not isinstance(kit.broker, gp.RabbitmqBroker):  # on Redis also none fetched and unacked
            assert rdb.hlen(f"{namespace}:{EVENT_QUEUE}.msgs") == 0
        # Waiting by design is no lag: its own number, apart from the backlog.
        assert outbox_status(engine) == {"pending": 0, "oldest_pending_age_s": None, "scheduled": 1, "set_aside": 0}
    finally:
        worker.kill()


def test_the_relay_wakes_when_the_next_delayed_row_falls_due_not_at_its_poll_interval(
    make_kit, engine, database_url, namespace, rdb
):
    kit = make_kit(env={"DB_URL": database_url, "OUTBOX_POLL_INTERVAL_MIN": "30s", "OUTBOX_POLL_INTERVAL_MAX": "30s"})
    assert kit.relay is not None
    kit.relay.start()
    try:
        time.sleep(0.3)  # idle, asleep for 30 s unless woken
        with engine.begin() as conn:  # its NOTIFY wakes the relay: nothing is due, it sleeps until 1.5 s from now
            event_id = gp.dispatch(conn, Numbered(1), delay=timedelta(seconds=1.5))
        due = _row(engine, event_id).not_before.timestamp()
        wait_for(lambda: rdb.hlen(f"{namespace}:{EVENT_QUEUE}.msgs") == 1, timeout=10, interval=0.01)
        sent = time.time()
        assert due <= sent < due + 0.5
    finally:
        kit.relay.stop()


def test_a_delayed_row_is_relayed_as_an_immediate_one_would_be(make_kit, engine, database_url, namespace, rdb):
    kit = make_kit(env={"DB_URL": database_url})
    assert kit.relay is not None
    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with engine.begin() as conn:
        event_id = gp.outbox.write(
            conn,
            Numbered(5),
            envelope_id="6f1c1e8a-1b2c-4d5e-8f90-123456789abc",
            trace_context=carrier,
            delay=timedelta(seconds=0.4),
        )
    assert event_id == "6f1c1e8a-1b2c-4d5e-8f90-123456789abc"
    assert kit.relay.relay_once() == 0  # not yet due
    assert rdb.hlen(f"{namespace}:{EVENT_QUEUE}.msgs") == 0
    time.sleep(0.5)
    assert kit.relay.relay_once() == 1
    (stored,) = rdb.hvals(f"{namespace}:{EVENT_QUEUE}.msgs")
    message = json.loads(stored)
    assert message["message_id"] == event_id  # the fan-out ids derive from it, as without a delay
    assert message["options"][ORIGIN] == carrier  # the trace continues from the dispatching code
    envelope = message["args"][0]
    due = _row(engine, event_id).not_before
    # Written, for the fan-out, when it fell due: it reaches whoever listens then.
    assert envelope == {
        "id": event_id,
        "event": "test.app.numbered",
        "data": {"n": 5},
        "at": int(due.timestamp() * 1000),
    }


def test_retention_never_deletes_a_row_not_yet_sent(make_kit, engine, database_url):
    kit = make_kit(env={"DB_URL": database_url, "OUTBOX_RETENTION": "1ms"})
    assert kit.relay is not None
    with engine.begin() as conn:
        event_id = gp.dispatch(conn, Numbered(1), delay=timedelta(hours=1))
        conn.execute(sa.update(OUTBOX_EVENTS).values(created_at=sa.func.now() - timedelta(days=30)))
    kit.relay.purge()
    assert _row(engine, event_id).published_at is None


TOO_FAR = "is more than 36525 days (100 years) ahead, the furthest a dispatch may be due"


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"delay": timedelta(seconds=-1)}, "dispatch delay= must not be negative, got -1 s"),
        ({"delay": 5}, "dispatch delay= takes a datetime.timedelta, not int 5"),
        (
            {"at": datetime(2030, 1, 1, 9)},
            "dispatch at= takes an aware datetime (with a tzinfo), not the naive 2030-01-01T09:00:00",
        ),
        ({"at": "2030-01-01T09:00:00Z"}, "dispatch at= takes a datetime.datetime, not str '2030-01-01T09:00:00Z'"),
        ({"delay": timedelta(1), "at": datetime(2030, 1, 1, tzinfo=UTC)}, "dispatch takes delay= or at=, not both"),
        # Each of these three was a raw OverflowError.
        ({"delay": timedelta.max}, f"dispatch delay={timedelta.max} {TOO_FAR}"),
        (
            {"at": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-14)))},
            f"dispatch at=9999-12-31T23:00:00-14:00 {TOO_FAR}",
        ),
        (
            {"at": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14)))},
            "dispatch at=0001-01-01T00:00:00+14:00 is before 1970: give a time from 1970 on (a past one means now)",
        ),
        ({"delay": timedelta(days=36_525, seconds=1)}, f"dispatch delay=36525 days, 0:00:01 {TOO_FAR}"),
    ],
)
def test_a_delay_or_time_it_cannot_keep_is_refused_in_one_line_and_nothing_is_written(engine, options, error):
    with pytest.raises(gp.DispatchError) as refused, engine.begin() as conn:
        gp.dispatch(conn, Numbered(1), **options)
    assert str(refused.value) == error
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(OUTBOX_EVENTS)).scalar_one() == 0


def test_a_time_past_or_a_zero_delay_means_now_and_100_years_ahead_is_kept(engine):
    with engine.begin() as conn:
        past = gp.dispatch(conn, Numbered(1), at=datetime.now(UTC) - timedelta(hours=1))
        zero = gp.dispatch(conn, Numbered(2), delay=timedelta(0))
        epoch = gp.dispatch(conn, Numbered(3), at=datetime(1970, 1, 1, tzinfo=UTC))
        furthest = gp.dispatch(conn, Numbered(4), delay=timedelta(days=36_525))
    assert [_row(engine, event_id).not_before for event_id in (past, zero, epoch)] == [None, None, None]
    assert _row(engine, furthest).not_before.year == datetime.now(UTC).year + 100
    assert outbox_status(engine)["pending"] == 3


@pytest.mark.usefixtures("broker")
def test_a_message_sent_with_a_delay_past_7_days_is_refused_in_one_line_and_not_sent(make_kit, namespace):
    kit = make_kit(env={"VALKEY_NAMESPACE": namespace})

    @dramatiq.actor(broker=kit.broker, actor_name="remind")
    def remind() -> None:
        pass

    for delay in (timedelta.max, timedelta(days=8), float("nan")):
        with pytest.raises(gp.DispatchError) as refused:
            remind.send_with_options(delay=delay)
        ms = int(delay.total_seconds() * 1000) if isinstance(delay, timedelta) else delay
        assert str(refused.value) == (
            f"remind sent with delay={ms} ms: more than 604800000 ms (7 days), the longest a message waits in a "
            "worker; a longer wait belongs in the outbox (dispatch with delay=)"
        )
    remind.send_with_options(delay=timedelta(days=7))
    assert [q["delayed"] for q in view_for(kit.settings, kit.broker.client).counts(["default"])] == [1]


def test_a_kit_without_a_database_refuses_a_delayed_dispatch(make_kit):
    kit = make_kit()
    with pytest.raises(
        gp.DispatchError, match=r"a delayed dispatch waits in the outbox: it needs a database \(DB_URL\)"
    ):
        kit.dispatch(Numbered(1), delay=timedelta(minutes=5))


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dramatiq_gp", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_migrate_up_brings_an_outbox_table_from_before_delayed_events_up_to_date(
    clean_env, service_env, make_kit, caplog
):
    with own_database(service_env["DB_URL"]) as url:
        engine = sa.create_engine(url)
        try:
            # The table as the release before delayed events created it, with an event pending in it.
            gp.outbox.migrate(engine)
            with engine.begin() as conn:
                conn.execute(sa.text("ALTER TABLE outbox_events DROP COLUMN not_before"))
                waiting = gp.dispatch(conn, Numbered(1))  # the dispatch of before still works
            env = {**os.environ, "DB_URL": url}

            status = _cli("migrate", "status", env=env)
            assert status.returncode == 1
            assert status.stdout == (
                "outbox table present; missing column(s) not_before: run `dramatiq-gp migrate up`\n"
            )
            with pytest.raises(gp.DispatchError) as refused, engine.begin() as conn:
                gp.dispatch(conn, Numbered(2), delay=timedelta(seconds=1))
            assert str(refused.value) == (
                "the outbox table 'outbox_events' predates delayed events (no not_before column): "
                "run `dramatiq-gp migrate up`"
            )

            # A relay on it says so in one line, and waits.
            kit = make_kit(env={"DB_URL": url})
            assert kit.relay is not None
            caplog.set_level("INFO", logger="dramatiq_gp.outbox")
            kit.relay.start()
            try:
                wait_for(lambda: any("outbox relay waiting" in r.getMessage() for r in caplog.records))
                time.sleep(0.5)
                said = [r for r in caplog.records if r.name.startswith("dramatiq_gp.outbox")]
                assert [r.getMessage() for r in said] == [
                    "outbox relay waiting: outbox table 'outbox_events' predates column(s) not_before "
                    "(delayed events): run `dramatiq-gp migrate up`"
                ]
                assert said[0].exc_info is None

                migrated = _cli("migrate", "up", env=env)
                assert migrated.returncode == 0, migrated.stderr
                assert _cli("migrate", "status", env=env).returncode == 0
                # The relay carries on with what waited, and delayed dispatches work.
                wait_for(lambda: _row(engine, waiting).published_at is not None, timeout=15)
                assert any(r.getMessage() == "outbox table migrated, relaying" for r in caplog.records)
            finally:
                kit.relay.stop()
            with engine.begin() as conn:
                later = gp.dispatch(conn, Numbered(3), delay=timedelta(hours=1))
            assert _row(engine, later).not_before is not None
            assert _cli("migrate", "up", env=env).returncode == 0  # again: nothing to do
        finally:
            engine.dispose()
