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

import contextlib
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
import redis
import sqlalchemy as sa
from dramatiq import Message

import dramatiq_gp as gp
from apps.replica import Replica
from devtools.asgi import serving
from devtools.sentinels import SentinelGroup, redis_server
from dramatiq_gp import keys
from dramatiq_gp.dashboard import create_app
from dramatiq_gp.errors import ConfigError
from dramatiq_gp.scheduler.outlet import Tick, TickNotDurable, outlet_for, replicas_to_wait_for
from dramatiq_gp.settings import RedisSettings
from helpers import close_broker, wait_for
from servers import OwnRedis

needs_redis_server = pytest.mark.skipif(
    redis_server() is None, reason="no redis-server on PATH (Sentinel mode needs it)"
)

SENTINEL_RUNS = """
CREATE TABLE IF NOT EXISTS sentinel_runs (
    namespace text NOT NULL, kind text NOT NULL, key text NOT NULL, pid integer NOT NULL,
    ran_at timestamptz NOT NULL DEFAULT clock_timestamp()
)"""
#: Idempotent messages sent per second, before, during and after the failover.
RATE = 50
#: How long the kit keeps running after the kill (the failover itself takes about 3 s of it).
AFTER_KILL_S = 15
#: How long before the kill the replicas get nothing from the primary, in the test that makes them lag.
LAG_S = 2.5
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


@needs_redis_server
@pytest.mark.parametrize(
    ("lease_ttl", "lag_s"), [("15s", 0.0), ("3s", LAG_S)], ids=["kill", "kill-while-the-replicas-lag"]
)
def test_a_failover_under_load_runs_every_tick_once_and_the_kit_follows_the_new_primary(
    lease_ttl, lag_s, tmp_path, clean_env, namespace, database_url, capsys
):
    # "kill": the primary is killed while its replicas keep up (on loopback they are microseconds
    # behind); the default 15 s lease outlasts the failover, so the leader carries on, from what the
    # new primary holds. "kill-while-the-replicas-lag": for LAG_S before the kill the replicas get
    # nothing (as behind a slow link), so the failover loses the last LAG_S of writes: the ticks
    # claimed then (none sent: no replica acknowledged them) and the messages' enqueues, fetches and
    # done marks; a 3 s lease runs out during the failover, and a new leader catches up.
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
            "SCHEDULER_LEASE_TTL": lease_ttl,
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
        held_at = time.time()
        if lag_s:
            assert group.proxy is not None
            group.proxy.hold()
            time.sleep(lag_s)
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
                f"\nsentinel failover (kill -9 of the primary, replicas {lag_s} s behind, {RATE} msg/s, "
                f"{lease_ttl} lease): "
                f"new primary in {failover_s:.1f} s; "
                f"ticks: {len(due)} due, {len(twice)} ran twice, {len(missed)} missed; "
                f"idempotent messages: {len(sent)} enqueued ({producer.errors} enqueue errors, retried), "
                f"{items_twice} ran twice, {len(lost)} lost"
                + (f" (twice: {sorted(twice)}, held at {held_at:.1f}, killed at {killed_at:.1f})" if twice else "")
            )

        assert new != old
        # With the replicas lagging, a tick pushed in the lag (its claim replicated, its push and its done mark
        # not) runs again: the next leader sends the claim it finds unsent (docs/guarantees.md, Failover). None
        # other may run twice, and none with the replicas keeping up.
        window = (held_at - 1.5, killed_at) if lag_s else (0.0, 0.0)
        outside = {
            t: c for t, c in twice.items() if not window[0] <= datetime.fromisoformat(t).timestamp() <= window[1]
        }
        assert not outside and len(twice) <= 1, ("ticks ran twice", twice, window)
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


# -- the settings -----------------------------------------------------------------------------


@pytest.fixture
def env(clean_env):
    clean_env.delenv("REDIS_URL")
    return clean_env


def test_the_sentinel_settings_and_how_they_show(env):
    env.setenv("VALKEY_SENTINELS", " sentinel-1:26379, [::1]:26380 ")
    env.setenv("VALKEY_SENTINEL_MASTER", "queues")
    env.setenv("VALKEY_SENTINEL_PASSWORD", "s3ntinel-secret")
    env.setenv("VALKEY_USERNAME", "app")
    env.setenv("VALKEY_PASSWORD", "data-secret")
    env.setenv("VALKEY_DB", "2")
    settings = gp.Settings.from_env()
    queue = settings.redis
    assert queue.sentinels == (("sentinel-1", 26379), ("::1", 26380))
    assert queue.display() == "redis+sentinel://app:***@sentinel-1:26379,[::1]:26380/queues/2"
    with pytest.raises(ConfigError, match="VALKEY_SENTINELS is set"):
        queue.connection_url()
    assert settings.scheduler.claim_replicas is None  # decided from the client: 1 behind Sentinel


@pytest.mark.parametrize(
    ("variables", "error"),
    [
        ({"VALKEY_SENTINELS": "sentinel-1"}, "VALKEY_SENTINELS='sentinel-1': entry 'sentinel-1' is not host:port"),
        ({"VALKEY_SENTINELS": "a:1,a:1"}, "VALKEY_SENTINELS='a:1,a:1': entry 'a:1' is listed twice"),
        ({"VALKEY_SENTINELS": "::1:26379"}, "put an IPv6 address in brackets"),
        ({"VALKEY_SENTINELS": "a:99999"}, "entry 'a:99999' is not host:port"),
        ({"VALKEY_SENTINELS": ""}, "VALKEY_SENTINELS='': expected host:port pairs"),
        (
            {"VALKEY_SENTINELS": "a:1", "REDIS_URL": "redis://:hunter22@cache:6379/0"},
            "set either VALKEY_SENTINELS or REDIS_URL, not both",
        ),
        ({"VALKEY_SENTINELS": "a:1", "VALKEY_ADDR": "cache:6379"}, "set either VALKEY_SENTINELS or VALKEY_ADDR"),
        ({"VALKEY_SENTINEL_PASSWORD": "hunter22"}, "VALKEY_SENTINEL_PASSWORD set without VALKEY_SENTINELS"),
        ({"VALKEY_SENTINELS": "a:1", "VALKEY_SENTINEL_MASTER": "my master"}, "VALKEY_SENTINEL_MASTER='my master'"),
        ({"VALKEY_SENTINELS": "a:1", "VALKEY_TLS_INSECURE": "true"}, "VALKEY_TLS_INSECURE set but the connection"),
        # Credentials written into the list: refused, and never echoed.
        ({"VALKEY_SENTINELS": "app:hunter22@a:1"}, "VALKEY_SENTINELS='***@a:1': give host:port pairs only"),
        ({"SCHEDULER_CLAIM_REPLICAS": "-1"}, "SCHEDULER_CLAIM_REPLICAS='-1'"),
    ],
)
def test_bad_sentinel_settings_are_one_line_naming_the_variable_never_the_password(env, variables, error):
    for name, value in variables.items():
        env.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        gp.Settings.from_env()
    message = str(caught.value)
    assert error in message
    assert "\n" not in message
    assert "hunter22" not in message


@needs_redis_server
def test_a_client_from_the_settings_follows_a_failover_and_closes_every_socket(tmp_path, env):
    group = SentinelGroup(tmp_path / "redis", replicas=1)
    try:
        group.start()
        settings = RedisSettings(sentinels=group.sentinels_env)
        client = settings.client(socket_connect_timeout=5)
        client.set("before", "1")
        assert client.wait(1, 1000) == 1
        assert replicas_to_wait_for(client, None) == 1
        assert replicas_to_wait_for(client, 0) == 0
        old = group.primary()
        group.kill(old)
        new = group.wait_for_failover(old)
        # The pool asks the Sentinels again once its connection to the old primary fails.
        wait_for(lambda: _set_ok(client), timeout=10)
        assert client.connection_pool.master_address == ("127.0.0.1", new)
        assert client.get("before") == b"1"
        client.close()
        sentinels = client.connection_pool.sentinel_manager.sentinels
        assert all(not s.connection_pool._in_use_connections for s in sentinels)
        assert all(c._sock is None for s in sentinels for c in s.connection_pool._available_connections)
    finally:
        group.stop()


@needs_redis_server
def test_no_primary_found_says_in_one_short_line_which_sentinels_were_asked_and_what_each_answered(tmp_path, env):
    # redis-py's own message held the repr of each Sentinel's client: 2.4 KB on one line for two Sentinels.
    group = SentinelGroup(tmp_path / "redis", replicas=0, sentinels=1)
    try:
        group.start()
        (port,) = group.sentinel_ports
        env.setenv("VALKEY_SENTINELS", f"127.0.0.1:1,127.0.0.1:{port}")
        env.setenv("VALKEY_SENTINEL_MASTER", "elsewhere")  # the Sentinel watches only mymaster
        why = (
            "no primary 'elsewhere' found: 127.0.0.1:1: Error 111 connecting to 127.0.0.1:1. Connection refused.; "
            f"127.0.0.1:{port}: answered, with no primary 'elsewhere' that is up"
        )
        where = f"redis+sentinel://127.0.0.1:1,127.0.0.1:{port}/elsewhere/0"
        done = subprocess.run(
            [sys.executable, "-m", "dramatiq_gp", "status"], capture_output=True, text=True, timeout=60
        )
        assert (done.returncode, done.stdout) == (1, "")
        assert done.stderr == f"Error: Redis/Valkey unreachable at {where}: {why}\n"
        with serving(create_app()) as base:
            assert _get(base + "/dead-letters") == (503, f"Redis/Valkey unreachable at {where}: {why}")
    finally:
        group.stop()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as refused:
        with refused:
            return refused.code, refused.read().decode()


def _set_ok(client: redis.Redis) -> bool:
    try:
        return bool(client.set("after", "1"))
    except redis.RedisError:
        return False


# -- a claim that no replica acknowledged -------------------------------------------------------


def test_a_tick_no_replica_acknowledged_is_kept_and_sent_once_a_replica_has_it(tmp_path, namespace):
    # A lone primary, told to wait for one replica: the claim is made, nothing is pushed.
    primary, replica = OwnRedis(tmp_path / "primary"), OwnRedis(tmp_path / "replica")
    primary.start()
    client = redis.Redis.from_url(primary.url)
    broker = gp.RedisBroker(client=client, namespace=namespace, middleware=[])
    try:
        scheduler_keys = keys.SchedulerKeys(namespace)
        outlet = outlet_for(broker, scheduler_keys, 60_000, replicas=1, wait_ms=100)
        client.set(scheduler_keys.lease, "1/token")
        queue = keys.queue(namespace, "default")

        def tick(second: int) -> Tick:
            message = Message(
                queue_name="default", actor_name="job", args=(), kwargs={}, options={}, message_id=f"tick-{second}"
            )
            return Tick("entry", second * 1000, message, "1/token")

        assert outlet.fire(tick(1)) == "not_durable"
        assert client.llen(queue) == 0
        assert client.hkeys(scheduler_keys.unpublished) == [b"entry:1000"]
        with pytest.raises(TickNotDurable, match="0 of the 1 replica"):
            outlet.recover()
        assert client.llen(queue) == 0

        replica.start()
        redis.Redis.from_url(replica.url).replicaof("127.0.0.1", primary.port)
        wait_for(lambda: client.info("replication")["connected_slaves"] == 1, timeout=10)
        # Fired again by the same leader (a retry whose reply was lost): still its claim, sent once.
        assert outlet.fire(tick(1)) == "fired"
        outlet.recover()
        assert outlet.fire(tick(1)) == "deduplicated"
        assert outlet.fire(tick(2)) == "fired"
        pushed = [
            Message.decode(client.hget(keys.messages(namespace, "default"), i)) for i in client.lrange(queue, 0, -1)
        ]
        assert [m.message_id for m in pushed] == ["tick-1", "tick-2"]
        assert client.lrange(queue, 0, -1) == [m.options["redis_message_id"].encode() for m in pushed]
        assert client.hlen(scheduler_keys.unpublished) == 0
    finally:
        close_broker(broker)
        _stop(replica, primary)


def test_a_tick_kept_by_an_earlier_leader_is_enqueued_by_the_next_once_a_replica_has_it(tmp_path, namespace):
    primary, replica = OwnRedis(tmp_path / "primary"), OwnRedis(tmp_path / "replica")
    primary.start()
    replica.start()
    client = redis.Redis.from_url(primary.url)
    redis.Redis.from_url(replica.url).replicaof("127.0.0.1", primary.port)
    broker = gp.RedisBroker(client=client, namespace=namespace, middleware=[])
    try:
        wait_for(lambda: client.info("replication")["connected_slaves"] == 1, timeout=10)
        scheduler_keys = keys.SchedulerKeys(namespace)
        message = Message(queue_name="default", actor_name="job", args=(), kwargs={}, options={}, message_id="t")
        client.hset(scheduler_keys.unpublished, "entry:1000", message.encode())  # as a PublishOutlet leaves it
        outlet = outlet_for(broker, scheduler_keys, 60_000, replicas=1, wait_ms=1000)
        outlet.recover()
        outlet.recover()
        queue = keys.queue(namespace, "default")
        assert client.llen(queue) == 1
        [redis_id] = client.lrange(queue, 0, -1)
        assert (
            Message.decode(client.hget(keys.messages(namespace, "default"), redis_id)).options["redis_message_id"]
            == redis_id.decode()
        )
    finally:
        close_broker(broker)
        _stop(replica, primary)


def _stop(*servers: OwnRedis) -> None:
    """Stop each server, killing one that does not stop: a replica's SIGTERM during the AOF rewrite that
    follows its first sync can hang (redis-server 6.2), so each waits for the rewrite to end first."""
    for server in servers:
        with contextlib.suppress(redis.RedisError), redis.Redis(port=server.port, socket_timeout=1) as client:
            wait_for(lambda c=client: not int(c.info("persistence")["aof_rewrite_in_progress"]), timeout=5)
        try:
            server.stop()
        except subprocess.TimeoutExpired:
            assert server.process is not None
            server.process.kill()
            server.process.wait()
