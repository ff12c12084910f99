"""The transactional outbox against real PostgreSQL and Redis: dispatch, relay, NOTIFY, poison rows."""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import redis
import sqlalchemy as sa
from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy.orm import Session

import dramatiq_gp as gp
from dramatiq_gp.outbox import OUTBOX_EVENTS
from dramatiq_gp.outbox.relay import Relay
from helpers import wait_for

T = OUTBOX_EVENTS.c


@gp.event("test.outbox.paid")
@dataclass(frozen=True)
class Paid:
    invoice: int


@gp.event("test.outbox.thanked")
@dataclass(frozen=True)
class Thanked:
    invoice: int


@gp.event("test.outbox.loose")
@dataclass(frozen=True)
class Loose:
    value: Any


def _queued(rdb, namespace: str, queue: str = "default") -> list[dict[str, Any]]:
    return [json.loads(v) for v in rdb.hvals(f"{namespace}:{queue}.msgs")]


def _rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(sa.select(OUTBOX_EVENTS).order_by(T.created_at)).all()


@pytest.fixture
def outbox_kit(make_kit, engine):
    """A kit on the test database whose relay we drive by hand (no worker, no thread)."""

    def make(register=None, env=None):
        return make_kit(register, env=env, engine=engine)

    return make


@pytest.mark.parametrize("style", ["session", "connection"])
def test_rollback_means_the_event_never_existed(style, outbox_kit, engine, rdb, namespace):
    kit = outbox_kit()
    if style == "session":
        with Session(engine) as session:
            gp.dispatch(session, Paid(1))
            session.rollback()
    else:
        with engine.connect() as conn:
            gp.dispatch(conn, Paid(1))
            conn.rollback()
    assert _rows(engine) == []
    assert kit.relay.relay_once() == 0
    assert _queued(rdb, namespace) == []


@pytest.mark.parametrize("style", ["session", "connection"])
def test_a_committed_event_is_relayed_under_its_own_id(style, outbox_kit, engine, rdb, namespace):
    kit = outbox_kit()
    if style == "session":
        with Session(engine) as session, session.begin():
            event_id = gp.dispatch(session, Paid(7))
            assert kit.relay.relay_once() == 0  # nothing is visible before commit
    else:
        with engine.begin() as conn:
            event_id = kit.dispatch(conn, Paid(7))
    assert _queued(rdb, namespace) == []
    assert kit.relay.relay_once() == 1
    (message,) = _queued(rdb, namespace)
    assert message["message_id"] == event_id
    assert message["actor_name"] == "event:test.outbox.paid"
    (envelope,) = message["args"]
    (row,) = _rows(engine)
    # ``at``: when the event was written, for a listener retired since (see subscriptions).
    written = int(row.created_at.timestamp() * 1000)
    assert envelope == {"id": event_id, "event": "test.outbox.paid", "data": {"invoice": 7}, "at": written}
    assert row.published_at is not None
    assert kit.relay.relay_once() == 0


def test_an_engine_given_to_the_kit_turns_the_outbox_on_and_wins_over_db_url(make_kit, engine, rdb, namespace):
    # Nothing listens at DB_URL's address: a kit that built an engine from it would fail to relay.
    kit = make_kit(engine=engine, env={"DB_URL": "postgresql://nobody@127.0.0.1:1/elsewhere"})
    assert kit.engine is engine and kit.relay is not None and kit.relay.engine is engine
    # The application's engine is the application's to dispose of.
    assert "outbox database" not in [name for name, _ in kit.lifecycle.closers.kit]

    event_id = kit.dispatch(Paid(8))  # through the outbox, in a transaction of its own
    assert _queued(rdb, namespace) == []
    assert kit.relay.relay_once() == 1
    assert [message["message_id"] for message in _queued(rdb, namespace)] == [event_id]


def test_an_encoding_error_raises_at_dispatch_and_writes_nothing(outbox_kit, engine):
    outbox_kit()
    with Session(engine) as session, session.begin(), pytest.raises(gp.EventEncodeError):
        gp.dispatch(session, Loose(object()))
    assert _rows(engine) == []


def test_events_committed_out_of_order_are_all_delivered(outbox_kit, engine, rdb, namespace):
    kit = outbox_kit()
    first = engine.connect()
    first_id = gp.dispatch(first, Paid(1))  # written first, committed last
    with engine.begin() as second:
        second_id = gp.dispatch(second, Paid(2))
    assert kit.relay.relay_once() == 1
    first.commit()
    first.close()
    assert kit.relay.relay_once() == 1
    assert sorted(m["message_id"] for m in _queued(rdb, namespace)) == sorted([first_id, second_id])


def test_end_to_end_through_a_worker_and_a_listener_that_dispatches(make_kit, engine, start_worker):
    paid: list[Paid] = []
    thanked: list[Thanked] = []
    envelopes: list[gp.Envelope] = []

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        def on_paid(event: Paid) -> None:
            paid.append(event)
            with engine.begin() as conn:  # the listener's own transaction
                gp.dispatch(conn, Thanked(event.invoice))

        def collect(event: Thanked) -> None:
            envelopes.append(gp.current_envelope())
            thanked.append(event)

        registry.listen(Paid, on_paid)
        registry.listen(Thanked, collect, queue="other")

    kit = make_kit(register, engine=engine)
    start_worker(kit)
    with Session(engine) as session, session.begin():
        gp.dispatch(session, Paid(3))
    wait_for(lambda: thanked == [Thanked(3)])
    assert paid == [Paid(3)]
    # The kit's own dispatch is outbox-backed too when it has a database.
    kit.dispatch(Thanked(4))
    wait_for(lambda: thanked == [Thanked(3), Thanked(4)])
    assert all(row.published_at is not None for row in _rows(engine))
    # A relayed event's envelope id is its outbox row's id.
    assert {e.id for e in envelopes} == {str(row.id) for row in _rows(engine) if row.event == "test.outbox.thanked"}


def test_a_poison_row_is_set_aside_without_holding_back_the_rest(outbox_kit, engine, rdb, namespace, caplog):
    kit = outbox_kit(env={"OUTBOX_MAX_ATTEMPTS": "2"})
    with engine.begin() as conn:
        conn.execute(OUTBOX_EVENTS.insert().values(id=uuid.uuid4(), event="test.outbox.nobody", payload={}))
        conn.execute(OUTBOX_EVENTS.insert().values(id=uuid.uuid4(), event="test.outbox.paid", payload={"x": 1}))
        good = [gp.dispatch(conn, Paid(n)) for n in range(3)]
    assert kit.relay.relay_once() == 5
    assert sorted(m["message_id"] for m in _queued(rdb, namespace)) == sorted(good)
    bad = [row for row in _rows(engine) if row.published_at is None]
    assert {row.attempts for row in bad} == {1}
    assert sorted(row.last_error for row in bad) == [
        "event 'test.outbox.paid' does not fit this version's Paid: field 'invoice': Field required",
        "event type 'test.outbox.nobody' is unknown here (no class declares it)",
    ]
    assert kit.relay.relay_once() == 0  # backing off

    with engine.begin() as conn:  # time passes
        conn.execute(sa.update(OUTBOX_EVENTS).values(available_at=sa.func.now() - sa.text("interval '1 second'")))
    assert kit.relay.relay_once() == 2
    with engine.connect() as conn:
        failed = gp.outbox.failed_events(conn)
    assert sorted(e.event for e in failed) == ["test.outbox.nobody", "test.outbox.paid"]
    assert "is unknown here" in next(e.last_error for e in failed if e.event == "test.outbox.nobody")
    assert "set aside after 2 attempts" in caplog.text

    with engine.begin() as conn:
        assert gp.outbox.retry_failed(conn, [failed[0].id]) == 1
    assert {row.failed_at is None for row in _rows(engine) if row.id == failed[0].id} == {True}


def test_an_event_name_with_a_newline_stays_on_its_log_line(outbox_kit, engine, caplog):
    # Logged with %s, a row's event name written by hand could forge a line of its own.
    kit = outbox_kit(env={"OUTBOX_MAX_ATTEMPTS": "1"})
    forged = "test.outbox.nobody\n[ERROR] outbox relay: all rows lost"
    with engine.begin() as conn:
        conn.execute(OUTBOX_EVENTS.insert().values(id=uuid.uuid4(), event=forged, payload={}))
    with caplog.at_level(logging.WARNING, logger="dramatiq_gp"):
        assert kit.relay.relay_once() == 1
    (line,) = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert "\n" not in line and "(test.outbox.nobody\\n[ERROR] outbox relay: all rows lost)" in line


DEEP = "[" * 3000 + "]" * 3000  # read by json.loads, it raises RecursionError


@pytest.mark.parametrize(
    ("payload", "trace_context", "reason"),
    [
        (f'{{"invoice": 1, "x": {DEEP}}}', None, "its payload cannot be read as JSON (RecursionError)"),
        ('{"invoice": 1}', f'{{"a": {DEEP}}}', "its trace_context cannot be read as JSON (RecursionError)"),
        ("[1, 2]", None, "its payload is a JSON list, not an object"),
        ('"paid"', None, "its payload is a JSON str, not an object"),
        ("null", None, "its payload is a JSON NoneType, not an object"),
        ('{"invoice": 1}', "[1]", "its trace_context is a JSON list, not an object"),
    ],
    ids=["deep-payload", "deep-trace-context", "list", "string", "json-null", "trace-context-list"],
)
def test_a_row_that_can_never_be_sent_is_set_aside_at_once_alone_and_the_batch_goes_on(
    outbox_kit, engine, rdb, namespace, caplog, payload, trace_context, reason
):
    # A row nested ~3,000 deep once failed the whole batch as the driver decoded it: never set aside, a
    # traceback every 5 s, and no event moved.
    kit = outbox_kit()
    bad = uuid.uuid4()
    with engine.begin() as conn:
        good = [gp.dispatch(conn, Paid(n)) for n in range(2)]
        conn.execute(
            sa.text(
                "INSERT INTO outbox_events (id, event, payload, trace_context) "
                "VALUES (:id, 'test.outbox.paid', CAST(:payload AS jsonb), CAST(:trace AS jsonb))"
            ),
            {"id": bad, "payload": payload, "trace": trace_context},
        )
        good += [gp.dispatch(conn, Paid(n)) for n in range(2, 4)]
    with caplog.at_level(logging.ERROR):
        assert kit.relay.relay_once() == 5
    assert sorted(m["message_id"] for m in _queued(rdb, namespace)) == sorted(good)
    with engine.connect() as conn:  # not the payload: the driver could not decode it either
        (row,) = conn.execute(sa.select(T.id, T.failed_at, T.last_error).where(T.published_at.is_(None))).all()
    assert row.id == bad and row.failed_at is not None and row.last_error == reason  # at once: no retry in vain
    assert f"outbox event {bad} (test.outbox.paid) set aside: {reason}" in caplog.text
    assert "Traceback" not in caplog.text
    assert kit.relay.relay_once() == 0


def test_one_notify_per_transaction_and_none_when_switched_off(outbox_kit, engine, database_url):
    listener = psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True)
    listener.execute(f"LISTEN {gp.outbox.CHANNEL}")

    def notifications() -> int:
        return sum(1 for _ in listener.notifies(timeout=0.3))

    outbox_kit()
    with Session(engine) as session, session.begin():
        for n in range(5):
            gp.dispatch(session, Paid(n))
    with engine.begin() as conn:
        gp.dispatch(conn, Paid(9))
    assert notifications() == 2

    outbox_kit(env={"OUTBOX_NOTIFY": "false"})
    with engine.begin() as conn:
        gp.dispatch(conn, Paid(10))
    assert notifications() == 0
    listener.close()


@pytest.mark.parametrize("notify", ["true", "false"])
def test_the_relay_thread_delivers_with_and_without_notify(notify, outbox_kit, engine, rdb, namespace):
    kit = outbox_kit(env={"OUTBOX_NOTIFY": notify, "OUTBOX_POLL_INTERVAL_MAX": "200ms"})
    kit.relay.start()
    try:
        time.sleep(0.5)  # idle: the relay backs off to its longest poll interval
        started = time.monotonic()
        with engine.begin() as conn:
            event_id = gp.dispatch(conn, Paid(1))
        wait_for(lambda: [m["message_id"] for m in _queued(rdb, namespace)] == [event_id], timeout=5)
        latency = time.monotonic() - started
    finally:
        kit.relay.stop()
        kit.relay.close()
    assert latency < (0.1 if notify == "true" else 1.0)


def test_the_backlog_gauges_read_only_while_the_relay_runs_and_hold_no_dropped_relay(outbox_kit, engine):
    # The meter outlives relays; a gauge that kept one alive, or read through its engine
    # after the closers disposed it, left a connection open until the garbage collector
    # found it (a ResourceWarning in whatever test ran then).
    kit = outbox_kit()
    relay = kit.relay
    with engine.begin() as conn:
        gp.dispatch(conn, Paid(1))
    assert relay._observe_backlog() == []  # not started
    relay.start()
    try:
        assert [o.value for o in relay._observe_backlog()] in ([1], [0])
    finally:
        relay.stop()
        relay.close()
    assert relay._observe_backlog() == relay._observe_oldest_age() == []

    dropped = weakref.ref(Relay(engine=engine, broker=kit.broker, settings=kit.settings.outbox))
    gc.collect()
    assert dropped() is None


def test_retention_zero_deletes_rows_as_they_are_published(outbox_kit, engine, rdb, namespace):
    kit = outbox_kit(env={"OUTBOX_RETENTION": "0"})
    with engine.begin() as conn:
        gp.dispatch(conn, Paid(1))
    assert kit.relay.relay_once() == 1
    assert _rows(engine) == []
    assert len(_queued(rdb, namespace)) == 1


def test_published_rows_are_purged_after_their_retention(outbox_kit, engine):
    kit = outbox_kit(env={"OUTBOX_RETENTION": "1h"})
    with engine.begin() as conn:
        for n in range(3):
            gp.dispatch(conn, Paid(n))
    kit.relay.relay_once()
    assert kit.relay.purge() == 0
    with engine.begin() as conn:
        conn.execute(sa.update(OUTBOX_EVENTS).values(published_at=sa.func.now() - sa.text("interval '2 hours'")))
        gp.dispatch(conn, Paid(4))  # pending: never purged
    assert kit.relay.purge() == 3
    assert len(_rows(engine)) == 1


def test_the_dispatching_trace_context_is_stored_and_travels_with_the_event(outbox_kit, engine, rdb, namespace):
    kit = outbox_kit()
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("http request") as span, engine.begin() as conn:
        gp.dispatch(conn, Paid(1))
    trace_id = format(span.get_span_context().trace_id, "032x")
    (row,) = _rows(engine)
    assert trace_id in row.trace_context["traceparent"]
    kit.relay.relay_once()
    (message,) = _queued(rdb, namespace)
    assert message["options"]["gp_trace_origin"] == row.trace_context


def test_the_relay_encodes_each_message_byte_for_byte_as_dramatiq_would(outbox_kit, engine):
    # The relay builds the dict Message.encode would (without its per-field introspection), and a
    # broker may send those bytes as they are: they must be Dramatiq's own encoding of the message.
    kit = outbox_kit()
    tracer = TracerProvider().get_tracer("test")
    with engine.begin() as conn:
        gp.dispatch(conn, Paid(1))
    with tracer.start_as_current_span("http request"), engine.begin() as conn:
        gp.dispatch(conn, Loose({"nested": ["é", 1.5, None]}))
    sent: list[tuple[Any, Any]] = []
    enqueue_many = kit.broker.enqueue_many

    def recording(messages: Any, **options: Any) -> Any:
        sent.append((list(messages), options.get("encoded")))
        return enqueue_many(messages, **options)

    kit.broker.enqueue_many = recording
    assert kit.relay.relay_once() == 2
    ((messages, encoded),) = sent
    assert encoded == [message.encode() for message in messages]
    assert {bool(message.options) for message in messages} == {False, True}  # with and without a trace context


def test_relays_racing_in_threads_publish_each_event_once(outbox_kit, engine, rdb, namespace):
    kit = outbox_kit(env={"OUTBOX_BATCH_SIZE": "50"})
    with engine.begin() as conn:
        ids = [gp.dispatch(conn, Paid(n)) for n in range(1000)]
    relays = [gp.outbox.Relay(engine=engine, broker=kit.broker, settings=kit.settings.outbox) for _ in range(4)]

    def drain(relay: gp.outbox.Relay) -> None:
        while relay.relay_once():
            pass

    threads = [threading.Thread(target=drain, args=(relay,)) for relay in relays]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    queued = [m["message_id"] for m in _queued(rdb, namespace)]
    assert len(queued) == len(set(queued)) == 1000
    assert set(queued) == set(ids)


def _claimable(engine: sa.Engine) -> int:
    """Pending rows another relay could claim now (none held by an open transaction)."""
    with engine.begin() as conn:
        pending = sa.select(T.id).where(T.published_at.is_(None), T.failed_at.is_(None))
        return len(conn.execute(pending.with_for_update(skip_locked=True)).all())


def test_a_busy_relay_pipelines_its_batches_marking_each_only_after_its_enqueue(outbox_kit, engine, rdb, namespace):
    kit = outbox_kit(env={"OUTBOX_BATCH_SIZE": "50"})
    with engine.begin() as conn:
        ids = {gp.dispatch(conn, Paid(n)) for n in range(1000)}
    relay, enqueue_many = kit.relay, kit.broker.enqueue_many
    marked_at_send, stages = [], set()

    def enqueue_checking(messages, **options):
        batch = [uuid.UUID(m.message_id) for m in messages]
        with engine.connect() as conn:
            marked = sa.select(sa.func.count()).where(T.id.in_(batch), T.published_at.is_not(None))
            marked_at_send.append(conn.execute(marked).scalar_one())
        return enqueue_many(messages, **options)

    def claim_noting(conn):
        stages.add((threading.current_thread().name, threading.current_thread().daemon))
        return Relay._claim(relay, conn)

    kit.broker.enqueue_many = enqueue_checking
    relay._claim = claim_noting
    assert sum(iter(relay.relay_batches, 0)) == 1000
    assert marked_at_send and set(marked_at_send) == {0}  # no row marked before its enqueue
    # The batches after the first were claimed while one was sent, by a thread that cannot hold up an exit.
    assert ("gp-outbox-claim", True) in stages
    queued = [m["message_id"] for m in _queued(rdb, namespace)]
    assert len(queued) == len(set(queued)) == 1000
    assert set(queued) == ids
    assert all(row.published_at is not None for row in _rows(engine))
    assert engine.pool.checkedout() == 0


def test_a_send_failing_in_the_pipeline_leaves_its_batch_and_the_one_claimed_ahead_pending(
    outbox_kit, engine, rdb, namespace
):
    kit = outbox_kit(env={"OUTBOX_BATCH_SIZE": "50"})
    with engine.begin() as conn:
        ids = {gp.dispatch(conn, Paid(n)) for n in range(300)}
    enqueue_many, calls = kit.broker.enqueue_many, []

    def failing_third(messages, **options):
        calls.append(len(messages))
        if len(calls) == 3:
            raise redis.ConnectionError("the broker went away")
        return enqueue_many(messages, **options)

    kit.broker.enqueue_many = failing_third
    with pytest.raises(redis.ConnectionError):
        kit.relay.relay_batches()
    # The two batches sent were committed; the failed one and the one claimed ahead rolled back, unlocked.
    assert sum(row.published_at is not None for row in _rows(engine)) == 100
    assert _claimable(engine) == 200
    assert engine.pool.checkedout() == 0
    assert len(_queued(rdb, namespace)) == 100
    kit.broker.enqueue_many = enqueue_many
    assert sum(iter(kit.relay.relay_batches, 0)) == 200
    queued = [m["message_id"] for m in _queued(rdb, namespace)]
    assert len(queued) == len(set(queued)) == 300
    assert set(queued) == ids


def test_a_pool_that_cannot_lend_a_second_connection_in_time_is_said_once_and_relayed_one_batch_at_a_time(
    make_kit, engine, rdb, namespace, caplog
):
    one = sa.create_engine(engine.url, pool_size=1, max_overflow=0, pool_timeout=0.3)
    try:
        kit = make_kit(env={"OUTBOX_BATCH_SIZE": "10"}, engine=one)
        with one.begin() as conn:
            ids = {gp.dispatch(conn, Paid(n)) for n in range(45)}
        enqueue_many = kit.broker.enqueue_many

        def slow(messages, **options):
            # Longer than the pool's timeout: the claim ahead cannot have the one connection in time.
            time.sleep(0.5)
            return enqueue_many(messages, **options)

        kit.broker.enqueue_many = slow
        caplog.set_level(logging.WARNING, logger="dramatiq_gp.outbox")
        assert sum(iter(kit.relay.relay_batches, 0)) == 45
        said = [r for r in caplog.records if "lends it no second connection" in r.getMessage()]
        assert len(said) == 1
        queued = [m["message_id"] for m in _queued(rdb, namespace)]
        assert len(queued) == len(set(queued)) == 45
        assert set(queued) == ids
    finally:
        one.dispose()


def test_sqlite_works_for_a_single_relay(make_kit, tmp_path, rdb, namespace):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'demo.db'}")
    gp.outbox.migrate(engine)
    kit = make_kit(engine=engine)
    with Session(engine) as session, session.begin():
        event_id = gp.dispatch(session, Paid(1))
    assert kit.relay.relay_once() == 1
    assert [m["message_id"] for m in _queued(rdb, namespace)] == [event_id]
    assert kit.relay.relay_once() == 0
    engine.dispose()


def test_the_command_line_migrates_lists_and_retries(clean_env, database_url, engine):
    from click.testing import CliRunner

    from dramatiq_gp.cli import main

    run = CliRunner().invoke
    clean_env.setenv("DB_URL", database_url)
    assert run(main, ["migrate", "up"]).exit_code == 0
    assert run(main, ["migrate", "up"]).exit_code == 0  # again: nothing to do
    with engine.begin() as conn:
        conn.execute(
            OUTBOX_EVENTS.insert().values(
                id=uuid.uuid4(), event="x.y", payload={}, failed_at=sa.func.now(), last_error="boom", attempts=10
            )
        )
    failed = run(main, ["outbox", "failed"])
    assert failed.exit_code == 0 and "x.y  attempts=10" in failed.output
    retried = run(main, ["outbox", "retry", "--all"])
    assert retried.exit_code == 0 and "1 event(s) pending again" in retried.output
    clean_env.delenv("DB_URL")
    missing = run(main, ["outbox", "failed"])
    assert missing.exit_code == 1 and "set DB_URL" in missing.output
