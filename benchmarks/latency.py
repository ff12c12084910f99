"""Commit-to-enqueue latency of the outbox at a steady offered load, with NOTIFY and with polling only.

A producer commits one event per transaction at ``--rate`` events/s (each
transaction NOTIFYs when NOTIFY is on) while a relay process runs its ordinary
loop; the latency of an event is the time from its commit returning to the
relay's enqueue of it returning (same machine, same clock).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid

import sqlalchemy as sa

import dramatiq_gp as gp
from benchmarks.outbox_common import PAYLOAD, Blob, child, queued_ids, scratch_database
from devtools.services import services


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def run_phase(notify: bool, rate: int, seconds: float, db_url: str, redis_url: str) -> list[float]:
    namespace = f"gpbench-{uuid.uuid4().hex[:8]}"
    fd, record = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env = {
        "DB_URL": db_url,
        "REDIS_URL": redis_url,
        "VALKEY_NAMESPACE": namespace,
        "OUTBOX_RELAY": "true",
        "OUTBOX_NOTIFY": str(notify).lower(),
        "GP_BENCH_RECORD": record,
    }
    relay = child("serve", env)
    gp.outbox.set_notify(notify)
    engine = sa.create_engine(db_url, pool_size=2)
    committed: dict[str, float] = {}
    interval = 1 / rate
    next_at = time.perf_counter()
    deadline = next_at + seconds
    while next_at < deadline:
        with engine.begin() as conn:
            event_id = gp.dispatch(conn, Blob(PAYLOAD["data"]))
        committed[event_id] = time.time()
        next_at += interval
        time.sleep(max(0.0, next_at - time.perf_counter()))
    time.sleep(1.5)  # the last events
    relay.communicate(timeout=60)  # closing its stdin stops it
    engine.dispose()
    with open(record) as file:
        enqueued = dict(json.load(file))
    os.unlink(record)
    queued_ids(redis_url, namespace)  # clears the queue
    missing = set(committed) - set(enqueued)
    if missing:
        raise RuntimeError(f"{len(missing)} committed events were not enqueued")
    return [(enqueued[i] - committed[i]) * 1000 for i in committed]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks latency", description=__doc__)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--rate", type=int, default=500, help="events committed per second")
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args(argv)
    results = {}
    with services() as env, scratch_database(env["DB_URL"]) as db_url:
        for notify in (True, False):
            latencies = run_phase(notify, args.rate, args.seconds, db_url, env["REDIS_URL"])
            name = "notify" if notify else "poll"
            results[f"{name}_p50_ms"] = round(_percentile(latencies, 50), 2)
            results[f"{name}_p99_ms"] = round(_percentile(latencies, 99), 2)
            print(
                f"{name:>6}: p50 {results[f'{name}_p50_ms']:7.2f} ms, p99 {results[f'{name}_p99_ms']:7.2f} ms "
                f"over {len(latencies)} events at {args.rate}/s",
                flush=True,
            )
    if args.json:
        print(json.dumps({**results, "rate": args.rate}))
    return 0
