"""Actor priority within one queue: the kit's Redis broker against Dramatiq's, at the same prefetch.

Dramatiq's own ``test_actors_can_prioritize_work``: a paused worker with one thread,
ten messages of a low-priority actor sent interleaved with ten of a high-priority
one, then the worker resumed. The order is strict (every high before any low) only
if the high ones are in the process's buffer before the lows get their turn: priority
orders what a process holds, on either broker. Each prefetch runs in a fresh process
(Dramatiq reads ``dramatiq_queue_prefetch`` at import); the report is how many runs of
``--runs`` came out strict, for each broker and prefetch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import uuid
from typing import Any

PREFETCHES = (2, 8, 12, 16, 32)


def run_child(kind: str, runs: int, redis_url: str) -> int:
    import logging

    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    import dramatiq_gp as gp

    logging.basicConfig(level=logging.WARNING)
    strict = 0
    for _ in range(runs):
        namespace = f"gpbench-{uuid.uuid4().hex[:8]}"
        broker: Any
        if kind == "dramatiq":
            broker = RedisBroker(url=redis_url, namespace=namespace)
        else:
            broker = gp.RedisBroker(url=redis_url, namespace=namespace, middleware=gp.default_middleware())
        calls: list[str] = []
        hi = dramatiq.actor(functools.partial(calls.append, "hi"), broker=broker, actor_name="hi", priority=0)
        lo = dramatiq.actor(functools.partial(calls.append, "lo"), broker=broker, actor_name="lo", priority=10)
        worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
        worker.start()
        worker.pause()
        for _ in range(10):
            lo.send()
            hi.send()
        worker.resume()
        broker.join(lo.queue_name)
        worker.join()
        worker.stop()
        broker.flush_all()
        broker.close()
        strict += calls == ["hi"] * 10 + ["lo"] * 10
    return strict


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks priority", description=__doc__)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--runs", type=int, default=10, help="runs per broker and prefetch")
    parser.add_argument("--child", choices=("dramatiq", "kit"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if args.child:
        print(json.dumps(run_child(args.child, args.runs, redis_url)))
        return 0
    report: dict[str, Any] = {"runs": args.runs, "strict": {"dramatiq": {}, "kit": {}}}
    for prefetch in PREFETCHES:
        for kind in ("dramatiq", "kit"):
            env = {**os.environ, "dramatiq_queue_prefetch": str(prefetch)}
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks", "priority", "--child", kind, "--runs", str(args.runs)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            report["strict"][kind][prefetch] = int(done.stdout.strip().splitlines()[-1])
        print(
            f"prefetch {prefetch}: strict order in {report['strict']['dramatiq'][prefetch]}/{args.runs} runs "
            f"with Dramatiq's broker, {report['strict']['kit'][prefetch]}/{args.runs} with the kit's",
            flush=True,
        )
    if args.json:
        print(json.dumps(report))
    return 0
