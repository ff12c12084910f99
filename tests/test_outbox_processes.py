"""The outbox with real relay processes: racing, killed with -9, and through server restarts."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

import dramatiq_gp as gp
from apps.app_events import Numbered
from dramatiq_gp.outbox import OUTBOX_EVENTS
from helpers import wait_for
from servers import OwnPostgres, OwnRedis

ROOT = Path(__file__).resolve().parent.parent
T = OUTBOX_EVENTS.c


def _insert(engine: sa.Engine, count: int) -> set[str]:
    rows = [{"id": uuid.uuid4(), "event": "test.app.numbered", "payload": {"n": n}} for n in range(count)]
    with engine.begin() as conn:
        conn.execute(OUTBOX_EVENTS.insert(), rows)
    return {str(row["id"]) for row in rows}


def _relay(mode: str, env: dict[str, str]) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "tests.apps.relay_proc", mode]
    return subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_ready(relay: subprocess.Popen[str]) -> None:
    assert relay.stdout is not None
    seen = []
    for line in relay.stdout:
        if line.strip() == "relay ready":
            return
        seen.append(line)
    raise AssertionError(f"the relay exited with {relay.wait()}: {''.join(seen)}")


def _queued_ids(client: redis.Redis, namespace: str) -> list[str]:
    return [json.loads(v)["message_id"] for v in client.hvals(f"{namespace}:default.msgs")]


def _pending(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        query = sa.select(sa.func.count()).where(T.published_at.is_(None), T.failed_at.is_(None))
        return int(conn.execute(query).scalar_one())


@pytest.fixture
def relay_env(clean_env, database_url, namespace, redis_url):
    return {"DB_URL": database_url, "VALKEY_NAMESPACE": namespace, "REDIS_URL": redis_url, "OUTBOX_RELAY": "true"}


def test_four_relay_processes_racing_over_20000_events_enqueue_each_exactly_once(engine, relay_env, rdb, namespace):
    ids = _insert(engine, 20_000)
    relays = [_relay("drain", {**relay_env, "OUTBOX_BATCH_SIZE": "200"}) for _ in range(4)]
    for relay in relays:
        out, _ = relay.communicate(timeout=180)
        assert relay.returncode == 0, out
    queued = _queued_ids(rdb, namespace)
    assert len(queued) == 20_000
    assert Counter(queued).most_common(1)[0][1] == 1
    assert set(queued) == ids
    assert _pending(engine) == 0


@pytest.mark.usefixtures("broker")  # the relay pipelines its batches: a kill may land between its stages
def test_kill_9_mid_batch_repeatedly_loses_nothing_and_runs_no_listener_twice(
    make_kit, engine, relay_env, start_worker, caplog
):
    runs: Counter[int] = Counter()
    lock = threading.Lock()

    def record(event: Numbered) -> None:
        with lock:
            runs[event.n] += 1

    consumer = make_kit(lambda registry, schedule: registry.listen(Numbered, record), env={"OUTBOX_RELAY": "false"})
    caplog.set_level(logging.INFO, logger="dramatiq_gp.middleware")
    start_worker(consumer, threads=8)
    count = 3000
    _insert(engine, count)
    env = {**relay_env, "OUTBOX_BATCH_SIZE": "100", "GP_TEST_PAUSE_AFTER_ENQUEUE": "0.05"}
    for _ in range(8):
        relay = _relay("drain", env)
        _wait_ready(relay)
        time.sleep(random.uniform(0.15, 0.5))
        relay.send_signal(signal.SIGKILL)
        relay.communicate()
    final = _relay("drain", relay_env)
    final.communicate(timeout=120)
    assert _pending(engine) == 0
    wait_for(lambda: len(runs) == count, timeout=120)
    time.sleep(1)  # give a stray duplicate the chance to run
    assert set(runs) == set(range(count))
    assert max(runs.values()) == 1
    # The kills did leave duplicates on the queue; idempotent execution absorbed them.
    absorbed = [r for r in caplog.records if "already completed" in r.getMessage() or "deferred" in r.getMessage()]
    assert absorbed


def test_postgres_and_redis_restarts_during_relaying_lose_nothing(tmp_path, clean_env, namespace):
    postgres, queue = OwnPostgres(tmp_path / "pg"), OwnRedis(tmp_path / "redis")
    postgres.start()
    queue.start()
    engine = sa.create_engine(postgres.url, pool_pre_ping=True)
    relay = None
    try:
        gp.outbox.migrate(engine)
        env = {"DB_URL": postgres.url, "REDIS_URL": queue.url, "VALKEY_NAMESPACE": namespace}
        relay = _relay("serve", {**env, "OUTBOX_POLL_INTERVAL_MAX": "200ms"})
        _wait_ready(relay)

        stop = threading.Event()

        def produce() -> None:
            n = 0
            while not stop.is_set():
                try:
                    with engine.begin() as conn:
                        gp.dispatch(conn, Numbered(n))
                    n += 1
                except sa.exc.OperationalError:
                    time.sleep(0.05)  # the database is restarting; the application retries
                time.sleep(0.005)

        producer = threading.Thread(target=produce)
        producer.start()
        time.sleep(1.0)
        postgres.restart(down_for=0.5)
        time.sleep(1.0)
        queue.restart(down_for=0.5)
        time.sleep(1.0)
        stop.set()
        producer.join()

        wait_for(lambda: _pending(engine) == 0, timeout=30)
        with engine.connect() as conn:
            committed = {str(i) for i in conn.execute(sa.select(T.id)).scalars()}
        client = redis.Redis.from_url(queue.url)
        queued = set(_queued_ids(client, namespace))
        client.close()
        assert len(committed) > 200
        assert committed <= queued
    finally:
        if relay is not None:
            relay.send_signal(signal.SIGTERM)
            out, _ = relay.communicate(timeout=30)
        engine.dispose()
        postgres.stop()
        queue.stop()
    assert "outbox relay cannot reach the database, retrying" in out  # PostgreSQL went first
    assert "outbox relay cannot reach Redis/Valkey, retrying" in out
    assert "outbox relay reconnected" in out
