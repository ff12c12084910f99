"""Redis/Valkey behind Sentinel: the kit follows a failover, and no tick runs twice or never.

A primary, two replicas and three Sentinels run as real ``redis-server`` processes
(:mod:`sentinels`); two ``dramatiq`` replicas of ``tests.apps.sentinel_app`` find the
primary through ``VALKEY_SENTINELS``. The primary is killed with ``kill -9`` while an
``@every 1s`` job fires and a producer sends a steady stream of idempotent messages;
every run is recorded in PostgreSQL, out of the failover's reach.

What the kit guarantees is asserted: every tick runs once (the claim reaches a
replica before its message is pushed), and the workers, the scheduler and the
producer carry on against the new primary without a restart. What asynchronous
replication may cost the messages themselves is measured and printed, not
asserted: a message whose enqueue, fetch or done mark the old primary had not
yet passed on can be lost or run twice.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
import redis
import sqlalchemy as sa
from dramatiq import Message

import dramatiq_gp as gp
from apps.replica import Replica
from devtools.sentinels import SentinelGroup, redis_server
from dramatiq_gp.settings import RedisSettings
from helpers import close_broker, wait_for

pytestmark = pytest.mark.skipif(redis_server() is None, reason="no redis-server on PATH (Sentinel mode needs it)")

SENTINEL_RUNS = """
CREATE TABLE IF NOT EXISTS sentinel_runs (
    namespace text NOT NULL, kind text NOT NULL, key text NOT NULL, pid integer NOT NULL,
    ran_at timestamptz NOT NULL DEFAULT clock_timestamp()
)"""
#: Idempotent messages sent per second, before, during and after the failover.
RATE = 50
#: How long the kit keeps running after the kill (the failover itself takes about 3 s of it).
AFTER_KILL_S = 15
SECOND = timedelta(seconds=1)


class Producer(threading.Thread):
    """Sends ``sentinel.item(n)`` for n = 0, 1, 2... at :data:`RATE`; an enqueue that fails is sent again, same id."""

    def __init__(self, broker: gp.RedisBroker) -> None:
        super().__init__(name="producer", daemon=True)
        self.broker = broker
        self.stop = threading.Event()
        #: The items whose enqueue the primary acknowledged, and when.
        self.sent: list[tuple[int, float]] = []
        self.errors = 0

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            message = Message(
                queue_name="default",
                actor_name="sentinel.item",
                args=(n,),
                kwargs={},
                options={},
                message_id=str(uuid.uuid4()),
            )
            while not self.stop.is_set():
                try:
                    self.broker.enqueue(message)
                except redis.RedisError:
                    self.errors += 1
                    time.sleep(0.05)
                    continue
                self.sent.append((n, time.time()))
                n += 1
                break
            self.stop.wait(1 / RATE)


def _runs(ledger: sa.Engine, namespace: str, kind: str) -> Counter[str]:
    query = sa.text("SELECT key FROM sentinel_runs WHERE namespace = :namespace AND kind = :kind")
    with ledger.connect() as conn:
        return Counter(key for (key,) in conn.execute(query, {"namespace": namespace, "kind": kind}))


def test_a_failover_under_load_runs_every_tick_once_and_the_kit_follows_the_new_primary(
    tmp_path, clean_env, namespace, database_url, capsys
):
    clean_env.delenv("REDIS_URL")  # the Sentinels name the primary
    group = SentinelGroup(tmp_path / "redis")
    ledger = sa.create_engine(database_url)
    replicas: list[Replica] = []
    producer: Producer | None = None
    broker = None
    try:
        group.start()
        with ledger.begin() as conn:
            conn.execute(sa.text(SENTINEL_RUNS))
        env = {
            "VALKEY_SENTINELS": group.sentinels_env,
            "VALKEY_NAMESPACE": namespace,
            "GP_TEST_LEDGER": database_url,
            "SCHEDULER_LEASE_TTL": "3s",
            "WORKER_MIN_BACKOFF": "100ms",
            "WORKER_MAX_BACKOFF": "1s",
        }
        replicas = [Replica("tests.apps.sentinel_app", env, tmp_path / f"replica-{i}.log", threads=4) for i in range(2)]
        settings = RedisSettings(sentinels=group.sentinels_env, namespace=namespace)
        broker = gp.RedisBroker(client=settings.client(socket_connect_timeout=5), namespace=namespace, middleware=[])
        for replica in replicas:
            wait_for(replica.started, timeout=30)
        producer = Producer(broker)
        producer.start()
        wait_for(lambda: sum(_runs(ledger, namespace, "tick").values()) >= 3, timeout=30)
        time.sleep(1)

        old = group.primary()
        group.kill(old)
        killed_at = time.time()
        new = group.wait_for_failover(old)
        failover_s = time.time() - killed_at
        time.sleep(max(0.0, killed_at + AFTER_KILL_S - time.time()))
        producer.stop.set()
        producer.join(10)
        stopped_at = datetime.now(UTC)

        # Every tick due by the stop has run (those of the failover late), and the items have drained.
        def ticks_caught_up() -> bool:
            ticks = [datetime.fromisoformat(key) for key in _runs(ledger, namespace, "tick")]
            return max(ticks) >= stopped_at

        wait_for(ticks_caught_up, timeout=20, interval=0.2)
        sent = {n for n, _ in producer.sent}
        items_ran = lambda: set(map(int, _runs(ledger, namespace, "item")))  # noqa: E731
        deadline, last_count, last_change = time.monotonic() + 20, -1, time.monotonic()
        while time.monotonic() < deadline and not sent <= items_ran():
            count = len(items_ran())
            if count != last_count:
                last_count, last_change = count, time.monotonic()
            elif time.monotonic() - last_change > 5:
                break  # nothing more is coming: what has not run is lost
            time.sleep(0.2)
        time.sleep(1)  # give a stray second run the chance to show

        ticks = _runs(ledger, namespace, "tick")
        times = {datetime.fromisoformat(key): count for key, count in ticks.items()}
        first = min(times)
        due = [first + n * SECOND for n in range(int((stopped_at - first) / SECOND) + 1)]
        missed = [t.isoformat() for t in due if t not in times]
        twice = {t.isoformat(): c for t, c in times.items() if c > 1}
        items = _runs(ledger, namespace, "item")
        items_twice = sum(1 for count in items.values() if count > 1)
        lost = sorted(sent - set(map(int, items)))
        after = [n for n, at in producer.sent if at > killed_at + failover_s]
        with capsys.disabled():
            print(
                f"\nsentinel failover (kill -9 of the primary, {RATE} msg/s): new primary in {failover_s:.1f} s; "
                f"ticks: {len(due)} due, {len(twice)} ran twice, {len(missed)} missed; "
                f"idempotent messages: {len(sent)} enqueued ({producer.errors} enqueue errors, retried), "
                f"{items_twice} ran twice, {len(lost)} lost"
            )

        assert new != old
        assert not twice, ("ticks ran twice", twice)
        assert not missed, ("ticks never ran", missed)
        assert len(due) >= AFTER_KILL_S
        # The producer and the workers followed the new primary, without a restart.
        assert len(after) >= RATE * (AFTER_KILL_S - failover_s) / 2, len(after)
        assert set(after) <= set(map(int, items)), "messages sent to the new primary did not run"
        for replica in replicas:
            assert replica.process.poll() is None, replica.log
    finally:
        if producer is not None:
            producer.stop.set()
            producer.join(10)
        for replica in replicas:
            replica.kill()
        if broker is not None:
            close_broker(broker)
        group.stop()
        ledger.dispose()
