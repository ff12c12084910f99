"""A worker SIGKILLed between its inbox commit and its ack: the redelivered copy is skipped, the effect applied once.

``tests.apps.inbox_app`` kills its own worker process from ``after_process_message``
of the listener's message: its inbox transaction (the effect row and the message
id) has committed, its ack has not been handed to Redis. A survivor that counts
a worker dead after 2 s takes the message back and runs it again. Without the
inbox that second run writes a second row (the gap issue 17 measured: 3 of 1,800
effects applied twice); with it, the copy finds its id, logs one line and is acked.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import sqlalchemy as sa

import dramatiq_gp as gp
from apps.replica import Replica
from dramatiq_gp.outbox import INBOX
from helpers import wait_for

EFFECTS = "inbox_kill_effects"
LISTENER = "listener:test.inbox_app.ordered:record"


@gp.event("test.inbox_app.ordered")  # the app's event, declared here too: the test process only dispatches it
@dataclass(frozen=True)
class Ordered:
    order: int


@pytest.mark.parametrize(
    "claim",
    [
        # Only the inbox between the redelivery and a second effect.
        pytest.param("0", id="inbox-alone"),
        # The default: the Redis claim is in play too. The dead worker's claim holds the copy back until
        # its 60 s lease runs out; then the inbox, not the claim, skips it (the claim was never marked done).
        pytest.param("1", id="with-the-redis-claim", marks=pytest.mark.slow),
    ],
)
def test_a_worker_killed_after_the_inbox_commit_and_before_the_ack_applies_the_effect_once(
    claim, tmp_path, clean_env, redis_url, namespace, rdb, engine, database_url
):
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE IF NOT EXISTS {EFFECTS} (id serial PRIMARY KEY, order_id int NOT NULL)"))
        conn.execute(sa.text(f"TRUNCATE {EFFECTS}, {INBOX.name}"))

    def effects() -> int:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(f"SELECT count(*) FROM {EFFECTS}")).scalar_one())

    def inbox_rows() -> list[str]:
        with engine.connect() as conn:
            return list(conn.execute(sa.select(INBOX.c.task_type)).scalars())

    def unacked() -> int:
        """The listener's message, until it is acked: on its queue or, deferred by the claim, on its delay queue."""
        return int(rdb.hlen(f"{namespace}:default.msgs")) + int(rdb.hlen(f"{namespace}:default.DQ.msgs"))

    env = {"REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace, "DB_URL": database_url, "GP_TEST_CLAIM": claim}
    victim = Replica("tests.apps.inbox_app", {**env, "GP_TEST_KILL_AFTER_COMMIT": "1"}, tmp_path / "victim.log")
    survivor = None
    try:
        wait_for(victim.started, timeout=30)
        with engine.begin() as conn:  # through the outbox: the victim's relay sends it, its worker fans it out
            event_id = gp.dispatch(conn, Ordered(42))
        assert victim.process.wait(30) != 0, "the victim was not killed"

        # The effect and the id committed together; the ack never left the dead worker.
        assert effects() == 1
        assert inbox_rows() == [LISTENER]
        assert unacked() == 1, "the listener's message was acked before the kill"

        survivor = Replica("tests.apps.inbox_app", {**env, "GP_TEST_HEARTBEAT_MS": "2000"}, tmp_path / "survivor.log")
        # The copy runs on the survivor and is acked (with the claim, once the dead worker's lease ran out).
        wait_for(lambda: unacked() == 0, timeout=120, interval=0.25)
        assert effects() == 1
        assert inbox_rows() == [LISTENER]
        message_id = gp.fan_out_id(event_id, LISTENER)
        skips = [line for line in survivor.log.splitlines() if "already applied" in line]
        assert len(skips) == 1 and f"task_id={message_id}" in skips[0], skips
        assert "Traceback" not in survivor.log
    finally:
        for replica in (victim, survivor):
            if replica is not None:
                replica.kill()
