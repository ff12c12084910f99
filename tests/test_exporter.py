"""``dramatiq-gp exporter``: a real exporter process, scraped over HTTP, against real Redis, RabbitMQ and PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dramatiq
import pytest
import sqlalchemy as sa
from dramatiq.common import current_millis

import dramatiq_gp as gp
from dramatiq_gp import keys
from dramatiq_gp.brokers.kinds import view_for
from dramatiq_gp.brokers.redis_view import RedisQueueView
from dramatiq_gp.endpoint import MAX_CONNECTIONS
from dramatiq_gp.exporter import MAX_QUEUES, METRICS
from dramatiq_gp.scheduler.dynamic import EventByName
from helpers import publish_schedulable, wait_for

#: What a scrape gives: metric name → its label pairs → value.
Scraped = dict[str, dict[frozenset[tuple[str, str]], float]]


@contextlib.contextmanager
def exporter(**env: str) -> Iterator[str]:
    """A ``dramatiq-gp exporter`` process on a free port, with this test's environment and ``env``; its URL."""
    with exporter_process(**env) as (_, base):
        yield base


@contextlib.contextmanager
def exporter_process(**env: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """:func:`exporter`, with its process."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dramatiq_gp", "exporter", "--host", "127.0.0.1", "--port", "0"],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        served = re.match(r"exporter on http://127\.0\.0\.1:(\d+)/metrics reading ", line)
        assert served, f"{line!r} {process.communicate(timeout=10)}"
        yield process, f"http://127.0.0.1:{served[1]}"
    finally:
        process.terminate()
        process.communicate(timeout=10)


def scrape(base: str) -> Scraped:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        body = response.read().decode()
    scraped: Scraped = {}
    for line in body.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        assert name in METRICS, line
        pairs = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
        scraped.setdefault(name, {})[pairs] = float(value)
    return scraped


def value(scraped: Scraped, name: str, **labels: str) -> float | None:
    return scraped.get(name, {}).get(frozenset(labels.items()))


def queue(scraped: Scraped, system: str, name: str) -> dict[str, float | None]:
    """A queue's numbers in a scrape: each state's count, and the oldest ready message's ``age``."""
    where = {"messaging_system": system, "messaging_destination_name": name}
    counts = {state: value(scraped, "dramatiq_gp_queue_messages", **where, state=state) for state in STATES}
    return {**counts, "age": value(scraped, "dramatiq_gp_queue_oldest_ready_age_seconds", **where)}


STATES = ("ready", "delayed", "in_flight", "dead")


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_each_queue_counts_its_messages_by_state_and_the_age_of_its_oldest_ready_one(
    broker, make_kit, start_worker, namespace, rdb
):
    release = threading.Event()
    # A worker takes one message from qa, then stops: on RabbitMQ it recorded when that one became ready.
    taker = make_kit(env={"VALKEY_NAMESPACE": namespace})
    dramatiq.actor(broker=taker.broker, actor_name="work", queue_name="qa")(lambda: None)
    taker.broker.emit_after("process_boot")  # as start_worker does, but stopped here rather than at the end
    first = dramatiq.Worker(taker.broker, worker_threads=1, worker_timeout=100)
    first.start()
    taker.broker.get_actor("work").send()
    wait_for(lambda: rdb.smembers(keys.declared_queues(namespace)) >= {"qa"} and _empty(taker, "qa"))
    if broker == "rabbitmq":
        wait_for(lambda: rdb.hexists(keys.fetched(namespace), "qa"))
    first.stop()

    kit = make_kit(env={"VALKEY_NAMESPACE": namespace})

    @dramatiq.actor(broker=kit.broker, actor_name="work", queue_name="qa")
    def work() -> None:
        pass

    @dramatiq.actor(broker=kit.broker, actor_name="charge", queue_name="qb", max_retries=0)
    def charge() -> None:
        raise RuntimeError("the card was declined")

    @dramatiq.actor(broker=kit.broker, actor_name="slow")
    def slow() -> None:
        release.wait(30)

    sent_from = time.time()
    for _ in range(3):
        work.send()
    sent_until = time.time()
    for _ in range(2):
        work.send_with_options(delay=600_000)
    charge.send()
    slow.send()
    try:
        start_worker(kit, queues={"default", "qb"})
        with exporter() as base:
            time.sleep(1.5)  # the oldest ready message of qa waits at least this long
            scraped = wait_for(
                lambda: (
                    (s := scrape(base))
                    and queue(s, broker, "default")["in_flight"] == 1
                    and queue(s, broker, "qb")["dead"] == 1
                    and s
                )
            )
            before = time.time()
            age = queue(scrape(base), broker, "qa")["age"]
            after = time.time()
            assert age >= before - sent_until > 1.5
            if broker == "redis":  # exact: from when the head of the list was sent
                assert age <= after - sent_from
            assert {**queue(scraped, broker, "qa"), "age": None} == {
                "ready": 3,
                "delayed": 2,
                "in_flight": 0,
                "dead": 0,
                "age": None,
            }
            assert queue(scraped, broker, "qb") == {"ready": 0, "delayed": 0, "in_flight": 0, "dead": 1, "age": 0}
            assert queue(scraped, broker, "default") == {
                "ready": 0,
                "delayed": 0,
                "in_flight": 1,
                "dead": 0,
                "age": 0,
            }
            up = {dict(labels)["source"]: v for labels, v in scraped["dramatiq_gp_exporter_source_up"].items()}
            assert up == ({"redis": 1} if broker == "redis" else {"redis": 1, "rabbitmq": 1})
    finally:
        release.set()


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_on_rabbitmq_a_queue_no_worker_took_from_yet_ages_from_when_the_exporter_first_saw_it_waiting(
    broker, make_kit, namespace
):
    kit = make_kit(env={"VALKEY_NAMESPACE": namespace})
    work = dramatiq.actor(broker=kit.broker, actor_name="work")(lambda: None)
    work.send()  # a sender records the queue it declares: listed, with no worker's record
    with exporter() as base:
        first = queue(scrape(base), broker, "default")
        time.sleep(1)
        later = queue(scrape(base), broker, "default")
    assert first["ready"] == later["ready"] == 1
    assert later["age"] >= first["age"] + 1


def _empty(kit: gp.Kit, queue_name: str) -> bool:
    (row,) = view_for(kit.settings, kit.broker.client).counts([queue_name])
    return row["ready"] == 0 and row["in_flight"] == 0


def test_on_redis_a_message_counts_from_when_it_became_due_and_only_the_head_is_read(make_kit, namespace):
    kit = make_kit(env={"VALKEY_NAMESPACE": namespace})

    @dramatiq.actor(broker=kit.broker, actor_name="work")
    def work() -> None:
        pass

    now = current_millis()
    # Sent a minute ago, due ten seconds ago (a retry, a delayed message moved back): ten seconds old.
    retried = work.message().copy(message_timestamp=now - 60_000, options={"eta": now - 10_000})
    kit.broker.enqueue(retried)
    kit.broker.enqueue(work.message().copy(message_timestamp=now - 120_000))  # behind it: not the head
    view = RedisQueueView(kit.broker.client, namespace)
    since = view.ready_since(["default", "empty"])
    assert since == {"default": now - 10_000}


def test_the_outbox_backlog_its_lag_and_the_events_set_aside_come_from_postgresql(
    clean_env, namespace, engine, database_url
):
    table = gp.outbox.OUTBOX_EVENTS
    now = datetime.now(UTC)
    rows = [  # created how long ago, due in how long (delayed), published, set aside
        (30, None, None, None),
        (5, None, None, None),
        (60, None, now, None),
        (90, None, None, now),
        (600, 3600, None, None),  # scheduled: no lag, its own number
        (500, -10, None, None),  # delayed, due 10 s ago: late since then, not since written
    ]
    with engine.begin() as conn:
        conn.execute(
            sa.insert(table),
            [
                {
                    "id": uuid.uuid4(),
                    "event": "e",
                    "payload": {},
                    "created_at": now - timedelta(seconds=ago),
                    "not_before": None if due is None else now + timedelta(seconds=due),
                    "available_at": now if due is None else now + timedelta(seconds=due),
                    "published_at": published,
                    "failed_at": failed,
                }
                for ago, due, published, failed in rows
            ],
        )
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with exporter(DB_URL=database_url) as base:
        scraped = scrape(base)
    assert value(scraped, "dramatiq_gp_outbox_pending_events") == 3
    assert 30 <= value(scraped, "dramatiq_gp_outbox_lag_seconds") < 60
    assert value(scraped, "dramatiq_gp_outbox_scheduled_events") == 1
    assert value(scraped, "dramatiq_gp_outbox_set_aside_events") == 1
    assert value(scraped, "dramatiq_gp_exporter_source_up", source="postgresql") == 1
    with engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.published_at.is_(None)).values(published_at=now))
    with exporter(DB_URL=database_url) as base:
        scraped = scrape(base)
    assert value(scraped, "dramatiq_gp_outbox_pending_events") == 0
    assert value(scraped, "dramatiq_gp_outbox_lag_seconds") == 0
    assert value(scraped, "dramatiq_gp_outbox_scheduled_events") == 0


def test_without_a_database_there_are_no_outbox_series(clean_env, namespace):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with exporter() as base:
        scraped = scrape(base)
    assert not any(name.startswith("dramatiq_gp_outbox_") for name in scraped)
    assert value(scraped, "dramatiq_gp_exporter_source_up", source="postgresql") is None


def test_the_scheduler_leader_the_time_without_one_and_each_entry(clean_env, namespace, rdb):
    scheduler = keys.SchedulerKeys(namespace)
    rdb.set(scheduler.lease, "1/token", px=60_000)
    rdb.hset(scheduler.leader, mapping={"host": "web-1", "pid": 42, "epoch": 1, "acquired_ms": current_millis()})
    rdb.hset(scheduler.entries, mapping={"nightly": "0 3 * * *|Europe/Paris", "hourly": "@hourly|UTC"})
    rdb.hset(scheduler.last_fired, "nightly", 1_700_000_000_000)
    rdb.hset(scheduler.paused, "hourly", json.dumps({"by": "ops (cli)", "at": "2026-01-01T00:00:00+00:00"}))
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    clean_env.setenv("SCHEDULER_LEASE_TTL", "20s")
    with exporter() as base:
        led = scrape(base)
        rdb.delete(scheduler.lease)  # the leader died: its lease ran out
        first = scrape(base)
        time.sleep(1)
        later = scrape(base)
        rdb.set(scheduler.lease, "2/token", px=60_000)
        again = scrape(base)
    assert value(led, "dramatiq_gp_scheduler_leader_present") == 1
    assert value(led, "dramatiq_gp_scheduler_leaderless_seconds") == 0
    assert value(led, "dramatiq_gp_scheduler_lease_ttl_seconds") == 20
    assert value(led, "dramatiq_gp_schedule_last_fire_timestamp_seconds", entry="nightly") == 1_700_000_000
    assert value(led, "dramatiq_gp_schedule_last_fire_timestamp_seconds", entry="hourly") is None  # never fired
    assert value(led, "dramatiq_gp_schedule_paused", entry="hourly") == 1
    assert value(led, "dramatiq_gp_schedule_paused", entry="nightly") == 0
    assert value(first, "dramatiq_gp_scheduler_leader_present") == 0
    assert (
        value(later, "dramatiq_gp_scheduler_leaderless_seconds")
        >= value(first, "dramatiq_gp_scheduler_leaderless_seconds") + 1
    )
    assert value(again, "dramatiq_gp_scheduler_leader_present") == 1
    assert value(again, "dramatiq_gp_scheduler_leaderless_seconds") == 0


def test_stored_entries_are_counted_with_how_far_behind_the_earliest_is(clean_env, namespace, rdb):
    scheduler = keys.SchedulerKeys(namespace)
    publish_schedulable(rdb, namespace, events=("digest.due",))
    schedules = gp.Schedules(rdb, namespace, warn_leaderless=False)
    for n in range(3):
        schedules.add(f"digest.{n}", "0 8 * * *", EventByName("digest.due", {"customer": n}))
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with exporter() as base:
        waiting = scrape(base)
        rdb.zadd(scheduler.due, {"digest.1": current_millis() - 30_000})  # no leader fired it 30 s ago
        behind = scrape(base)
    assert value(waiting, "dramatiq_gp_scheduler_stored_entries") == 3
    assert value(waiting, "dramatiq_gp_scheduler_stored_overdue_seconds") == 0
    # Stored entries alone are a schedule: a deployment with no leader to fire them is leaderless.
    assert value(waiting, "dramatiq_gp_scheduler_leader_present") == 0
    assert 30 <= value(behind, "dramatiq_gp_scheduler_stored_overdue_seconds") < 60
    assert value(behind, "dramatiq_gp_schedule_paused", entry="digest.1") is None  # no series per stored entry


def test_each_live_worker_process_s_health_and_a_stale_record_counts_as_down(clean_env, namespace, rdb):
    now = current_millis()

    def health(alive: bool, ready: bool, at_ms: int, pid: int, **interval: int) -> str:
        record = {"alive": alive, "ready": ready, "failing": [], "at_ms": at_ms, "host": "h1", "pid": pid}
        return json.dumps({**record, **interval})

    live = {"w-ready": now, "w-draining": now, "w-stale": now, "w-silent": now, "w-slow": now}
    rdb.zadd(keys.heartbeats(namespace), live)
    rdb.zadd(keys.heartbeats(namespace), {"w-gone": now - 120_000})  # no heartbeat for two minutes: not listed
    rdb.hset(
        keys.health(namespace),
        mapping={
            "w-ready": health(True, True, now, 1),
            "w-draining": health(True, False, now, 2),
            "w-stale": health(True, True, now - 10_000, 3),  # three intervals (3 s) without a new judgement
            # Judged every 5 s by its own WORKER_HEALTH_INTERVAL: 10 s is two of its intervals, still fresh.
            "w-slow": health(True, True, now - 10_000, 5, interval_ms=5_000),
            "w-gone": health(True, True, now, 4),
            "w-garbled": "not json",
        },
    )
    rdb.zadd(keys.heartbeats(namespace), {"w-garbled": now})
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    clean_env.setenv("WORKER_HEALTH_INTERVAL", "1s")
    with exporter() as base:
        scraped = scrape(base)

    def state(worker: str, pid: str, host: str = "h1") -> tuple[float | None, float | None]:
        labels = {"worker": worker, "host": host, "pid": pid}
        return value(scraped, "dramatiq_gp_worker_alive", **labels), value(
            scraped, "dramatiq_gp_worker_ready", **labels
        )

    assert state("w-ready", "1") == (1, 1)
    assert state("w-draining", "2") == (1, 0)
    assert state("w-stale", "3") == (0, 0)
    assert state("w-slow", "5") == (1, 1)
    assert state("w-garbled", "None", "None") == (0, 0)
    # No heartbeat (gone), or no health record (silent: a version that writes none): no series.
    assert len(scraped["dramatiq_gp_worker_alive"]) == len(scraped["dramatiq_gp_worker_ready"]) == 5


def test_a_source_out_of_reach_is_0_and_left_out_while_the_rest_serve(clean_env, namespace, engine, database_url):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with exporter(REDIS_URL=f"redis://127.0.0.1:{_closed_port()}/0", DB_URL=database_url) as base:
        scraped = scrape(base)
    assert value(scraped, "dramatiq_gp_exporter_source_up", source="redis") == 0
    assert value(scraped, "dramatiq_gp_exporter_source_up", source="postgresql") == 1
    assert value(scraped, "dramatiq_gp_outbox_pending_events") == 0
    assert not any(name.startswith(("dramatiq_gp_queue_", "dramatiq_gp_scheduler_leader")) for name in scraped)
    assert not any(name.startswith(("dramatiq_gp_schedule_", "dramatiq_gp_worker_")) for name in scraped)


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_a_rabbitmq_out_of_reach_is_0_while_redis_serves(broker, clean_env, namespace, rdb):
    rdb.sadd(keys.declared_queues(namespace), "default")
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with exporter(BROKER_URL=f"amqp://guest:guest@127.0.0.1:{_closed_port()}/%2F") as base:
        scraped = scrape(base)
    assert value(scraped, "dramatiq_gp_exporter_source_up", source="rabbitmq") == 0
    assert value(scraped, "dramatiq_gp_exporter_source_up", source="redis") == 1
    assert "dramatiq_gp_queue_messages" not in scraped
    # No schedule published: no election, and no leader series to say "leaderless".
    assert "dramatiq_gp_scheduler_leader_present" not in scraped


def test_only_metrics_is_served(clean_env, namespace):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with exporter() as base, pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/", timeout=10)
    refused.value.close()
    assert refused.value.code == 404


def test_bad_settings_and_a_port_taken_end_it_in_one_line(clean_env, namespace):
    command = [sys.executable, "-m", "dramatiq_gp", "exporter", "--host", "127.0.0.1"]
    bad = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={**os.environ, "SCHEDULER_LEASE_TTL": "0s"}
    )
    assert bad.returncode == 1
    assert bad.stderr.splitlines() == ["Error: invalid configuration: SCHEDULER_LEASE_TTL must be at least 1s"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run([*command, "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert busy.returncode == 1
    assert busy.stderr.splitlines() == [f"Error: cannot serve on 127.0.0.1:{port}: Address already in use"]


def test_recorded_names_off_the_queue_grammar_are_left_out_and_a_scrape_counts_at_most_max_queues(
    clean_env, namespace, rdb
):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    recorded = keys.declared_queues(namespace)
    # Anyone who may write to Redis can add to the set the workers record their queues in.
    rdb.sadd(recorded, "mail", "bad\rname", "two words", "mail.XQ", "__acks__")

    def served(scraped: Scraped) -> set[str]:
        return {dict(labels)["messaging_destination_name"] for labels in scraped["dramatiq_gp_queue_messages"]}

    with exporter() as base:
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            assert b"\r" not in response.read()
        scraped = scrape(base)
        assert served(scraped) == {"mail"}
        assert value(scraped, "dramatiq_gp_exporter_queues_left_out") == 4
        rdb.sadd(recorded, *(f"junk{i}" for i in range(2 * MAX_QUEUES)))
        scraped = scrape(base)
    assert 0 < len(served(scraped)) <= MAX_QUEUES
    assert value(scraped, "dramatiq_gp_exporter_queues_left_out") == 2 * MAX_QUEUES + 5 - len(served(scraped))


def test_idle_connections_hold_a_bounded_number_of_threads_while_a_scrape_is_answered(clean_env, namespace):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with exporter_process() as (process, base):
        port = int(base.rpartition(":")[2])
        threads = _threads(process.pid)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3 * MAX_CONNECTIONS)]
        try:
            assert value(scrape(base), "dramatiq_gp_exporter_source_up", source="redis") == 1
            assert _threads(process.pid) <= threads + MAX_CONNECTIONS
            cut = [connection for connection in idle[: 2 * MAX_CONNECTIONS] if connection.recv(1) == b""]
            assert len(cut) == 2 * MAX_CONNECTIONS  # the oldest, at once, to make room for newer ones
        finally:
            for connection in idle:
                connection.close()


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))
