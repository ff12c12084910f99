"""Outbox relay throughput: one relay, four relays racing, and the one-send-per-event baseline.

Every phase starts from the same number of committed events (256-byte payloads)
and relay processes that start together; the rate runs from when the first
relay starts until the last one is done. Duplicates and losses are counted by
message id on the queue.

``--broker rabbitmq`` runs the same phases with the queues on RabbitMQ
(``BROKER_URL``, ``--rabbitmq-url``): every publish confirmed, the relay's and the
baseline's alike. It empties and then deletes the queue ``default`` (and its delay
and dead-letter queues) on that RabbitMQ: never point it at one in use.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid

import redis
import sqlalchemy as sa

from benchmarks.outbox_common import (
    DEFAULT_RABBITMQ_URL,
    child,
    delete_rabbitmq_queues,
    insert_events,
    queued_ids,
    rabbitmq_queued_ids,
    scratch_database,
)
from devtools.services import services


def run_phase(
    mode: str, relays: int, events: int, db_url: str, redis_url: str, rabbitmq_url: str | None = None
) -> dict[str, float]:
    engine = sa.create_engine(db_url)
    ids = insert_events(engine, events)
    engine.dispose()
    namespace = f"gpbench-{uuid.uuid4().hex[:8]}"
    env = {"DB_URL": db_url, "REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace, "OUTBOX_RELAY": "true"}
    if rabbitmq_url is not None:
        env["BROKER_URL"] = rabbitmq_url
        rabbitmq_queued_ids(rabbitmq_url)  # an empty queue to start from
    processes = [child(mode, env) for _ in range(relays)]
    client = redis.Redis.from_url(redis_url)
    client.set(f"{namespace}:bench:go", 1)
    client.close()
    reports = []
    for process in processes:
        out, _ = process.communicate(timeout=600)
        reports.append(json.loads(out.strip().splitlines()[-1]))
    elapsed = max(r["done"] for r in reports) - min(r["first"] for r in reports)
    queued = queued_ids(redis_url, namespace) if rabbitmq_url is None else rabbitmq_queued_ids(rabbitmq_url)
    return {
        "per_s": events / elapsed,
        # The relays' own CPU per event: the rate also waits on PostgreSQL and the broker, on shared cores.
        "cpu_us": sum(r["cpu"] for r in reports) / events * 1e6,
        "duplicates": len(queued) - len(set(queued)),
        "lost": len(ids - set(queued)),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks relay", description=__doc__)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis")
    parser.add_argument("--rabbitmq-url", default=os.environ.get("RABBITMQ_URL", DEFAULT_RABBITMQ_URL))
    args = parser.parse_args(argv)
    rabbitmq_url = args.rabbitmq_url if args.broker == "rabbitmq" else None

    with services() as env, scratch_database(env["DB_URL"]) as db_url:
        redis_url = os.environ.get("REDIS_URL", env["REDIS_URL"])
        naive = run_phase("naive", 1, args.events, db_url, redis_url, rabbitmq_url)
        print(f"naive (one send per event): {naive['per_s']:8.0f} events/s", flush=True)
        one = run_phase("drain", 1, args.events, db_url, redis_url, rabbitmq_url)
        print(f"1 relay:                    {one['per_s']:8.0f} events/s, {one['cpu_us']:.0f} CPU µs/event", flush=True)
        four = run_phase("drain", 4, args.events, db_url, redis_url, rabbitmq_url)
        if rabbitmq_url is not None:
            delete_rabbitmq_queues(rabbitmq_url)
        print(f"4 relays:                   {four['per_s']:8.0f} events/s", flush=True)
    summary = {
        "broker": args.broker,
        "events": args.events,
        "events_per_s_1": round(one["per_s"]),
        "events_per_s_4": round(four["per_s"]),
        "cpu_us_per_event_1": round(one["cpu_us"], 1),
        "naive_per_s": round(naive["per_s"]),
        "duplicates": int(one["duplicates"] + four["duplicates"]),
        "lost": int(one["lost"] + four["lost"]),
    }
    print(
        f"1 relay / naive {summary['events_per_s_1'] / summary['naive_per_s']:.2f}x, "
        f"4 relays / 1 relay {summary['events_per_s_4'] / summary['events_per_s_1']:.2f}x, "
        f"duplicates {summary['duplicates']}, lost {summary['lost']}"
    )
    if args.json:
        print(json.dumps(summary))
    return 0
