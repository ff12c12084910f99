"""An event another version of the application wrote, read by a real worker of this version.

``tests.apps.compat_app`` declares each case's event as this version has it; the
test sends each one in the shape another version wrote it, both ways it can
arrive: as an outbox row that version's transaction committed (this worker's relay
reads it), and as the ``event:`` message that version's relay sent (this worker's
fan-out and listener read it). Each is read, or set aside with a reason naming the
field (or the event type); none is retried in vain, lost, or logged with its values.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from dramatiq import Message

import dramatiq_gp as gp
from apps.replica import Replica
from dramatiq_gp.brokers.redis_view import RedisQueueView
from dramatiq_gp.outbox import OUTBOX_EVENTS
from helpers import wait_for

#: Each case: the event as the other version wrote it, and what this version makes of it.
WRITTEN = {
    "test.compat.added": {"user_id": 1, "email": "one@example.com"},
    "test.compat.extra": {"user_id": 2, "email": "two@example.com", "referrer": "newsletter"},
    "test.compat.default_removed": {"user_id": 3, "email": "three@example.com"},
    "test.compat.required_removed": {"user_id": 4},
    "test.compat.required_added": {"user_id": 5, "email": "five@example.com"},
    "test.compat.renamed_v2": {"user_id": 6},
}
READ = {
    "test.compat.added": {"user_id": 1, "email": "one@example.com", "referrer": ""},
    "test.compat.extra": {"user_id": 2, "email": "two@example.com"},
    "test.compat.default_removed": {"user_id": 3, "email": "three@example.com", "plan": "free"},
}
SET_ASIDE = {
    "test.compat.required_removed": "event 'test.compat.required_removed' does not fit this version's "
    "RequiredRemoved: field 'email': Field required",
    "test.compat.required_added": "event 'test.compat.required_added' does not fit this version's "
    "RequiredAdded: field 'country': Field required",
}


@pytest.fixture
def worker(tmp_path: Path, namespace: str, database_url: str, engine: sa.Engine, clean_env) -> Iterator[Replica]:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE IF NOT EXISTS compat_runs (namespace text, event text, fields jsonb)"))
    env = {
        "VALKEY_NAMESPACE": namespace,
        "DB_URL": database_url,
        "OUTBOX_MAX_ATTEMPTS": "1",
        "WORKER_UNKNOWN_TASK_GRACE": "1s",
        "OUTBOX_POLL_INTERVAL_MAX": "100ms",
    }
    replica = Replica("tests.apps.compat_app", env, tmp_path / "worker.log")
    wait_for(replica.started, timeout=30)
    yield replica
    replica.kill()


def _runs(engine: sa.Engine, namespace: str) -> list[tuple[str, dict]]:
    query = sa.text("SELECT event, fields FROM compat_runs WHERE namespace = :namespace ORDER BY event")
    with engine.connect() as conn:
        return [(event, fields) for event, fields in conn.execute(query, {"namespace": namespace})]


def test_an_event_another_version_wrote_is_read_or_set_aside_naming_the_field(worker, engine, namespace, make_kit):
    with engine.begin() as conn:
        conn.execute(
            OUTBOX_EVENTS.insert(),
            [{"id": uuid.uuid4(), "event": name, "payload": payload} for name, payload in WRITTEN.items()],
        )
    kit = make_kit()
    kit.broker.enqueue_many(
        [
            Message(
                queue_name="default",
                actor_name=f"event:{name}",
                kwargs={},
                options={},
                args=({"id": str(uuid.uuid4()), "event": name, "data": payload},),
            )
            for name, payload in WRITTEN.items()
        ]
    )

    # Read: once through the outbox, once fanned out by the other version.
    expected = sorted([(name, fields) for name, fields in READ.items()] * 2)
    wait_for(lambda: _runs(engine, namespace) == expected, timeout=30)

    # Set aside by the relay: the row, with the reason.
    with engine.connect() as conn:
        wait_for(lambda: len(gp.outbox.failed_events(conn)) == 3, timeout=30)
        failed = {row.event: row.last_error for row in gp.outbox.failed_events(conn)}
    assert set(failed) == {*SET_ASIDE, "test.compat.renamed_v2"}
    for name, reason in SET_ASIDE.items():
        assert reason in failed[name]
    assert "event type 'test.compat.renamed_v2' is unknown here" in failed["test.compat.renamed_v2"]

    # Set aside by the listener: its first attempt fails, and goes to the dead letters with the reason.
    client = kit.broker.client
    wait_for(lambda: RedisQueueView(client, namespace).dead_count("compat") == 2, timeout=30)
    dead = {letter.reason: letter for letter in RedisQueueView(client, namespace).dead_letters("compat")}
    for reason in SET_ASIDE.values():
        (letter,) = [letter for text, letter in dead.items() if reason in (text or "")]
        assert letter.attempts == 1
    # The renamed event: no worker here has its fan-out; held for the grace, then set aside.
    wait_for(lambda: RedisQueueView(client, namespace).dead_count("default") == 1, timeout=30)
    (renamed,) = RedisQueueView(client, namespace).dead_letters("default")
    assert renamed.reason == (
        "no handler for task type 'event:test.compat.renamed_v2' within 1s (WORKER_UNKNOWN_TASK_GRACE)"
    )

    log = worker.log
    for reason in SET_ASIDE.values():
        assert f"will_retry=False error=PayloadMismatch: {reason}" in log
    assert "Traceback" not in log
    for payload in WRITTEN.values():
        assert all(str(value) not in log for key, value in payload.items() if key != "user_id"), "a value was logged"
