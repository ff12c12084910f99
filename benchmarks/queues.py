"""Queue weights: the share each queue gets with both backlogged, strict priority, and what weighting costs.

One worker process with 8 threads, queues ``default`` and ``mail`` both pre-filled,
``WORKER_QUEUES=default:3,mail:1``. Each variant runs in a fresh process:

* ``weighted`` with 2 ms and with 50 ms tasks: the share of ``default`` among the
  messages started in a window after the first 16 (those are whatever the
  consumers' first fetches brought in), while both queues still have a backlog;
* ``strict`` (``WORKER_STRICT_PRIORITY=true``, 2 ms tasks): how many ``mail``
  messages started while ``default`` still had messages left to start;
* ``plain``: the 2 ms run through the kit without ``WORKER_QUEUES`` (Dramatiq's own
  consumption), against which ``weighted``'s throughput is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

WARM_UP = 16


def run_variant(variant: str, seconds: float, backlog: int, window: int, redis_url: str) -> dict[str, Any]:
    import logging

    import dramatiq
    import redis

    import dramatiq_gp as gp

    logging.basicConfig(level=logging.WARNING)
    namespace = f"gpbench-{uuid.uuid4().hex[:8]}"
    os.environ["REDIS_URL"] = redis_url
    if variant != "plain":
        os.environ["WORKER_QUEUES"] = "default:3,mail:1"
    if variant == "strict":
        os.environ["WORKER_STRICT_PRIORITY"] = "true"
    os.environ["LOG_LEVEL"] = "WARN"
    kit = gp.Kit(registry=gp.Registry(), broker_options={"namespace": namespace})
    order: list[str] = []
    lock = threading.Lock()

    def task(queue_name: str) -> Any:
        def run(n: int) -> None:
            with lock:
                order.append(queue_name)
            time.sleep(seconds)

        return run

    actors = {
        q: dramatiq.actor(task(q), broker=kit.broker, actor_name=f"t_{q}", queue_name=q) for q in ("default", "mail")
    }
    for q in ("mail", "default"):
        messages = [actors[q].message(n) for n in range(backlog)]
        for start in range(0, backlog, 500):
            kit.broker.enqueue_many(messages[start : start + 500])
    kit.broker.emit_after("process_boot")
    worker = dramatiq.Worker(kit.broker, worker_threads=8, worker_timeout=100)
    started = time.perf_counter()
    worker.start()
    total = 2 * backlog
    while len(order) < total:
        time.sleep(0.002)
    elapsed = time.perf_counter() - started
    worker.stop()
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{namespace}:*", count=1000):
        client.delete(key)
    measured = order[WARM_UP : WARM_UP + window]
    last_default = max(i for i, q in enumerate(order) if q == "default")
    return {
        "share_default": measured.count("default") / len(measured),
        "msgs_per_s": total / elapsed,
        "strict_violations": order[:last_default].count("mail"),
    }


def _child(variant: str, seconds: float, backlog: int, window: int) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "queues",
        "--variant",
        variant,
        "--seconds",
        str(seconds),
        "--backlog",
        str(backlog),
        "--window",
        str(window),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ.copy())
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks queues", description=__doc__)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", choices=("weighted", "strict", "plain"), help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=0.002, help=argparse.SUPPRESS)
    parser.add_argument("--backlog", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.seconds, args.backlog, args.window, redis_url)))
        return 0

    shares_2ms, shares_50ms, violations, weighted_rates, plain_rates = [], [], [], [], []
    for round_ in range(1, args.rounds + 1):
        short = _child("weighted", 0.002, 3000, 2000)
        long = _child("weighted", 0.05, 400, 300)
        strict = _child("strict", 0.002, 2000, 1000)
        plain = _child("plain", 0.002, 3000, 2000)
        shares_2ms.append(short["share_default"])
        shares_50ms.append(long["share_default"])
        violations.append(strict["strict_violations"])
        weighted_rates.append(short["msgs_per_s"])
        plain_rates.append(plain["msgs_per_s"])
        print(
            f"round {round_}: share default 2 ms {short['share_default']:.3f}, 50 ms {long['share_default']:.3f}; "
            f"strict violations {strict['strict_violations']}; "
            f"weighted {short['msgs_per_s']:.0f} msg/s, plain {plain['msgs_per_s']:.0f} msg/s "
            f"(plain share {plain['share_default']:.3f})",
            flush=True,
        )

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    summary = {
        "share_default_2ms": round(median(shares_2ms), 3),
        "share_default_50ms": round(median(shares_50ms), 3),
        "strict_violations": max(violations),
        "throughput_ratio": round(median(weighted_rates) / median(plain_rates), 3),
        "weighted_msgs_per_s": round(median(weighted_rates)),
        "plain_msgs_per_s": round(median(plain_rates)),
        "rounds": args.rounds,
        "threads": 8,
    }
    print(
        f"share default {summary['share_default_2ms']} (2 ms), {summary['share_default_50ms']} (50 ms); "
        f"strict violations {summary['strict_violations']}; throughput weighted/plain {summary['throughput_ratio']}"
    )
    if args.json:
        print(json.dumps(summary))
    return 0
