"""The inbox against real PostgreSQL and Redis: an effect and its message id commit together, once.

Duplicates are made the way production makes them: the same message enqueued
again under its id (as a relay re-sending a batch does, or a killed worker's
unacknowledged message coming back). The listeners here opt out of the Redis
claim (``idempotent=False``) where a test must show the inbox alone catches the
copy; ``tests/test_inbox_kill.py`` kills a real worker between commit and ack.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import dramatiq
import pytest
import sqlalchemy as sa
from dramatiq.middleware import CurrentMessage
from sqlalchemy.orm import Session, sessionmaker

import dramatiq_gp as gp
from dramatiq_gp.names import tick_message_id
from dramatiq_gp.outbox import INBOX, OUTBOX_EVENTS, prune_inbox
from dramatiq_gp.settings import Settings, WorkerSettings, inbox_retention_floor, longest_retry_span
from helpers import delayed, messages_of, wait_for

EFFECTS = sa.Table(
    "test_inbox_effects",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("what", sa.String(100), nullable=False),
)


@gp.event("test.inbox.ordered")
@dataclass(frozen=True)
class Ordered:
    order: int


@gp.event("test.inbox.invoiced")
@dataclass(frozen=True)
class Invoiced:
    order: int


@pytest.fixture
def db(engine: sa.Engine) -> sa.Engine:
    """The test database with an empty inbox and an empty effects table."""
    EFFECTS.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {INBOX.name}, {EFFECTS.name}"))
    return engine


def _effects(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(EFFECTS.c.what).order_by(EFFECTS.c.id)).scalars())


def _inbox(engine: sa.Engine) -> list[sa.Row[tuple[str, str, str | None]]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(INBOX.c.message_id, INBOX.c.task_type, INBOX.c.envelope_id)))


def _deliver(kit: gp.Kit, event: object, envelope_id: str) -> list[dramatiq.Message[object]]:
    """Enqueue ``event``'s listener messages under their deterministic ids (again, if called again)."""
    messages = kit.registry.fan_out(event, envelope_id)
    kit.broker.enqueue_many(messages)
    return messages


@pytest.mark.usefixtures("broker")
def test_the_effect_and_the_message_id_commit_together_and_a_redelivered_copy_is_skipped_once(
    make_kit, start_worker, db, caplog
):
    kit = make_kit(engine=db)

    def record(event: Ordered, conn: sa.Connection) -> None:
        conn.execute(EFFECTS.insert().values(what=f"order {event.order}"))

    kit.registry.listen(Ordered, record, name="record", inbox=db, idempotent=False)
    worker = start_worker(kit)
    envelope_id = str(uuid.uuid4())
    [message] = _deliver(kit, Ordered(7), envelope_id)
    wait_for(lambda: _effects(db) == ["order 7"])
    assert _inbox(db) == [(message.message_id, "listener:test.inbox.ordered:record", envelope_id)]

    caplog.set_level(logging.INFO)
    _deliver(kit, Ordered(7), envelope_id)  # the same id: a relay's re-send, a killed worker's message
    kit.broker.join("default")
    worker.join()
    assert _effects(db) == ["order 7"]
    skipped = messages_of(caplog, "dramatiq_gp.inbox", logging.WARNING)
    task = f"task_type=listener:test.inbox.ordered:record task_id={message.message_id}"
    assert skipped == [f"task skipped: already applied (inbox) {task}"]
    # The skipped copy ended as done, not failed: no retry, no error line.
    assert not messages_of(caplog, "dramatiq_gp.tasks", logging.ERROR)
    assert delayed(kit) == 0


@pytest.mark.usefixtures("broker")
def test_a_failure_rolls_back_the_effect_and_the_id_and_the_retry_applies_it_once(make_kit, start_worker, db):
    kit = make_kit(engine=db)
    attempts: list[int] = []

    def flaky(event: Ordered, conn: sa.Connection) -> None:
        conn.execute(EFFECTS.insert().values(what=f"order {event.order}"))
        attempts.append(1)
        if len(attempts) == 1:
            assert len(_inbox(db)) == 0, "the id is visible before the transaction committed"
            raise ConnectionError("the mail server hung up after the row was written")

    kit.registry.listen(Ordered, flaky, name="flaky", inbox=db, idempotent=False, min_backoff=10, max_backoff=10)
    start_worker(kit)
    _deliver(kit, Ordered(1), str(uuid.uuid4()))
    wait_for(lambda: len(attempts) == 2)
    kit.broker.join("default")
    assert _effects(db) == ["order 1"]
    assert len(_inbox(db)) == 1


@pytest.mark.usefixtures("broker")
def test_the_context_manager_keys_the_transaction_by_the_running_message_and_takes_a_session(
    make_kit, start_worker, db
):
    kit = make_kit(engine=db)
    sessions = sessionmaker(db)
    after_commit: list[int] = []

    def record(event: Ordered) -> None:
        with gp.inbox(sessions) as session:
            assert isinstance(session, Session)
            session.execute(EFFECTS.insert().values(what=f"order {event.order}"))
        after_commit.append(event.order)  # skipped with the block on a duplicate

    kit.registry.listen(Ordered, record, name="record_cm", idempotent=False)
    worker = start_worker(kit)
    envelope_id = str(uuid.uuid4())
    [message] = _deliver(kit, Ordered(3), envelope_id)
    wait_for(lambda: _effects(db) == ["order 3"])
    _deliver(kit, Ordered(3), envelope_id)
    kit.broker.join("default")
    worker.join()
    assert _effects(db) == ["order 3"]
    assert after_commit == [3]
    assert _inbox(db) == [(message.message_id, "listener:test.inbox.ordered:record_cm", envelope_id)]


@pytest.mark.usefixtures("broker")
def test_a_chain_listener_event_listener_is_exactly_once_end_to_end(make_kit, start_worker, db, rdb, namespace):
    """Ordered -> invoice (writes Invoiced to the outbox in its inbox transaction) -> book (inbox)."""
    kit = make_kit(engine=db, env={"OUTBOX_RELAY": "false"})
    invoiced = threading.Event()

    def invoice(event: Ordered, conn: sa.Connection) -> None:
        conn.execute(EFFECTS.insert().values(what=f"invoice {event.order}"))
        gp.dispatch(conn, Invoiced(event.order))  # a new envelope id each run: only the inbox keeps it single

    def book(event: Invoiced, conn: sa.Connection) -> None:
        conn.execute(EFFECTS.insert().values(what=f"booked {event.order}"))
        invoiced.set()

    kit.registry.listen(Ordered, invoice, name="invoice", inbox=db, idempotent=False)
    kit.registry.listen(Invoiced, book, name="book", inbox=db, idempotent=False)
    worker = start_worker(kit)
    envelope_id = str(uuid.uuid4())
    for _ in range(3):  # the first delivery and two copies
        _deliver(kit, Ordered(5), envelope_id)
        kit.broker.join("default")
        worker.join()
    relay = gp.OutboxRelay(db).bind(kit.broker)
    for _ in range(2):  # the relay sends the Invoiced event twice, as one killed before its commit would
        with db.begin() as conn:
            conn.execute(sa.update(OUTBOX_EVENTS).values(published_at=None))
        assert relay.relay_once() == 1
        kit.broker.join("default")
        worker.join()
    assert invoiced.is_set()
    assert sorted(_effects(db)) == ["booked 5", "invoice 5"]
    with db.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(OUTBOX_EVENTS)).scalar_one() == 1
    assert sorted(row.task_type for row in _inbox(db)) == [
        "listener:test.inbox.invoiced:book",
        "listener:test.inbox.ordered:invoice",
    ]


@pytest.mark.usefixtures("broker")
def test_a_job_and_a_plain_actor_use_the_context_manager_with_their_own_message_ids(make_kit, start_worker, db):
    ran = []

    def nightly() -> None:
        with gp.inbox(db) as conn:
            conn.execute(EFFECTS.insert().values(what="nightly"))
        ran.append(1)

    kit = make_kit(
        lambda registry, schedule: schedule.job("test.inbox.nightly", "0 3 * * *", nightly),
        engine=db,
        middleware=[CurrentMessage()],
    )

    @dramatiq.actor(broker=kit.broker, actor_name="plain_effect")
    def plain_effect(n: int) -> None:
        with gp.inbox(db) as conn:
            conn.execute(EFFECTS.insert().values(what=f"plain {n}"))

    worker = start_worker(kit)
    message = plain_effect.message(1)
    for _ in range(2):
        kit.broker.enqueue(message)
        kit.broker.join("default")
        worker.join()
    assert _effects(db) == ["plain 1"]
    assert _inbox(db) == [(message.message_id, "plain_effect", None)]

    # A job's firing, twice, as the scheduler builds it: keyed by the tick's message id.
    assert kit.scheduler is not None
    [entry] = kit.schedule.entries
    tick = datetime(2026, 12, 1, 3, tzinfo=UTC)
    for _ in range(2):
        kit.broker.enqueue(kit.scheduler._message(entry, tick))
        kit.broker.join("default")
        worker.join()
    assert ran == [1]
    assert _effects(db) == ["plain 1", "nightly"]
    assert (tick_message_id("test.inbox.nightly", tick), "job:test.inbox.nightly", None) in _inbox(db)


def test_outside_a_message_the_context_manager_says_what_it_needs(db):
    with pytest.raises(RuntimeError, match="inside a listener or a job"):
        gp.inbox(db)


@pytest.mark.parametrize(
    ("inbox", "handler", "error"),
    [
        ("postgresql://db/app", lambda event, conn: None, "inbox= takes a SQLAlchemy Engine or sessionmaker, not str"),
        (None, lambda event: None, "the handler must take two arguments: the event and the inbox transaction"),
        (sessionmaker(), lambda event, conn: None, "inbox= takes a sessionmaker bound to an Engine"),
    ],
)
def test_a_bad_inbox_or_handler_is_refused_at_registration_naming_the_listener(inbox, handler, error, db):
    with pytest.raises(gp.RegistrationError) as refused:
        gp.Registry().listen(Ordered, handler, name="bad", inbox=inbox if inbox is not None else db)
    assert str(refused.value).startswith("listener 'bad' of event 'test.inbox.ordered': ")
    assert error in str(refused.value)


def test_expired_rows_are_pruned_in_limited_batches_and_recent_ones_kept(make_kit, db):
    with db.begin() as conn:
        conn.execute(
            INBOX.insert(),
            [
                {"message_id": f"old-{n}", "task_type": "job:x", "processed_at": datetime.now(UTC) - timedelta(days=5)}
                for n in range(7)
            ],
        )
        conn.execute(INBOX.insert(), [{"message_id": f"new-{n}", "task_type": "job:x"} for n in range(3)])
    assert prune_inbox(db, timedelta(days=4), batch=5) == 5
    assert prune_inbox(db, timedelta(days=4), batch=5) == 2
    assert prune_inbox(db, timedelta(days=4), batch=5) == 0
    assert sorted(row.message_id for row in _inbox(db)) == ["new-0", "new-1", "new-2"]

    # The relay prunes with the configured retention.
    kit = make_kit(engine=db, env={"OUTBOX_INBOX_RETENTION": "3d", "OUTBOX_RELAY": "true"})
    assert kit.relay is not None and kit.relay.inbox_retention == timedelta(days=3)
    with db.begin() as conn:
        conn.execute(
            sa.update(INBOX)
            .where(INBOX.c.message_id == "new-0")
            .values(processed_at=sa.func.now() - timedelta(days=3, minutes=1))
        )
    assert kit.relay.prune_inbox() == 1
    assert sorted(row.message_id for row in _inbox(db)) == ["new-1", "new-2"]


def test_the_inbox_retention_defaults_past_the_retry_budget_and_a_shorter_one_is_refused(clean_env):
    worker = WorkerSettings()
    assert longest_retry_span(worker) == timedelta(days=2, hours=16, minutes=15, seconds=45)
    assert inbox_retention_floor(worker) == longest_retry_span(worker)
    assert Settings.from_env().outbox.inbox_retention == timedelta(days=4)
    clean_env.setenv("WORKER_MAX_RETRIES", "3")
    assert Settings.from_env().outbox.inbox_retention == timedelta(days=2)  # the dedup retention's day, plus one
    clean_env.setenv("OUTBOX_INBOX_RETENTION", "12h")
    with pytest.raises(
        gp.ConfigError, match=r"^invalid configuration: OUTBOX_INBOX_RETENTION='12h': must be at least 1d "
    ):
        Settings.from_env()


@pytest.mark.usefixtures("broker")
def test_a_job_with_inbox_gets_the_transaction_last_and_applies_each_tick_once(make_kit, start_worker, db):
    def report(scheduled_at: datetime, conn: sa.Connection) -> None:
        conn.execute(EFFECTS.insert().values(what=f"report {scheduled_at:%H:%M}"))

    kit = make_kit(
        lambda registry, schedule: schedule.job("test.inbox.report", "0 3 * * *", report, inbox=db), engine=db
    )
    worker = start_worker(kit)
    assert kit.scheduler is not None
    [entry] = kit.schedule.entries
    for tick in [datetime(2026, 12, 1, 3, tzinfo=UTC)] * 2 + [datetime(2026, 12, 2, 3, tzinfo=UTC)]:
        kit.broker.enqueue(kit.scheduler._message(entry, tick))
        kit.broker.join("default")
        worker.join()
    assert _effects(db) == ["report 03:00", "report 03:00"]  # one per tick: the second copy of the first skipped
    assert len(_inbox(db)) == 2

    with pytest.raises(gp.ScheduleError, match=r"^schedule entry 'bad': inbox= takes a SQLAlchemy Engine"):
        gp.Schedule().job("bad", "@daily", report, inbox="postgresql://db/app")
    with pytest.raises(gp.ScheduleError, match=r"the handler must take the inbox transaction, or two"):
        gp.Schedule().job("bad", "@daily", lambda: None, inbox=db)
