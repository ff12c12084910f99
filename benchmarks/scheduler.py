"""Scheduler failover: takeover time, and every tick enqueued exactly once through repeated kill -9s.

Three scheduler processes share one Redis (``SCHEDULER_LEASE_TTL=3``,
``SCHEDULER_CATCHUP=all``) and a ``@every 1s`` job. The current leader is killed
with SIGKILL again and again (then restarted, so three keep contending). Takeover
runs from the kill until another process holds the lease (the time it wrote when
it took it). Every tick from the first to the last must be on the queue exactly
once; fire lateness is measured on the ticks away from any failover.

``--graceful``: the leader is stopped with SIGTERM instead, as a deploy does, under
the default settings (a 15 s lease, ``SCHEDULER_CATCHUP=latest``): the hand-over.

``--dynamic N``: N entries stored at run time instead (see :mod:`benchmarks.stored_schedules`).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks import stored_schedules
from devtools.scheduler_cluster import Cluster
from devtools.services import redis_url


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks scheduler", description=__doc__)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--failovers", type=int, default=10)
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--graceful", action="store_true", help="SIGTERM the leader under the default settings")
    parser.add_argument("--dynamic", type=int, metavar="N", help="N entries stored at run time instead of one job")
    stored_schedules.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.dynamic:
        if args.failovers == parser.get_default("failovers"):
            args.failovers = args.minutes - 1
        return stored_schedules.run(args)
    if args.graceful:
        args.ttl = 15.0
    signal_sent = signal.SIGTERM if args.graceful else signal.SIGKILL

    with redis_url() as url, tempfile.TemporaryDirectory() as logs:
        env = {"REDIS_URL": url, "VALKEY_NAMESPACE": f"gpbench-{uuid.uuid4().hex[:8]}"}
        if not args.graceful:
            env.update(SCHEDULER_LEASE_TTL=f"{args.ttl}s", SCHEDULER_CATCHUP="all")
        cluster = Cluster(env, Path(logs), size=3)
        cluster.start()
        takeovers, windows = [], []
        try:
            cluster.wait_for_leader()
            time.sleep(3)
            for n in range(1, args.failovers + 1):
                pid, _ = cluster.wait_for_leader()
                time.sleep(random.uniform(2.0, 3.0))
                index = cluster.index_of(pid)
                killed = time.time()
                cluster.kill(index, signal_sent)
                cluster.wait_for_leader(other_than=pid, timeout=4 * args.ttl)
                took = int(cluster.client.hget(cluster.keys.leader, "acquired_at")) / 1000 - killed
                takeovers.append(took)
                windows.append((killed - 1, killed + took + 1))
                cluster.start(index)
                print(f"failover {n}: takeover {took:.3f} s", flush=True)
            time.sleep(3)
            firings = cluster.firings()
        finally:
            cluster.stop()

    ticks = sorted({f.tick for f in firings})
    expected = int((ticks[-1] - ticks[0]).total_seconds()) + 1
    steady = [
        f.enqueued_ms - f.tick.timestamp() * 1000
        for f in firings
        if not any(a <= f.tick.timestamp() <= b for a, b in windows)
    ]
    summary = {
        "stop": signal_sent.name,
        "failovers": len(takeovers),
        "takeover_s_max": round(max(takeovers), 3),
        "takeover_s_p50": round(statistics.median(takeovers), 3),
        "lease_ttl_s": args.ttl,
        "ticks_expected": expected,
        "ticks_enqueued": len(ticks),
        "duplicate_ticks": len(firings) - len(ticks),
        "missed_ticks": expected - len(ticks),
        "fire_lateness_ms_p99": round(statistics.quantiles(steady, n=100)[98], 1),
        # The ticks around each failover: how late the new leader fired them.
        "failover_lateness_ms_max": round(
            max(
                (
                    f.enqueued_ms - f.tick.timestamp() * 1000
                    for f in firings
                    if any(a <= f.tick.timestamp() <= b for a, b in windows)
                ),
                default=0.0,
            ),
            1,
        ),
    }
    print(
        f"takeover max {summary['takeover_s_max']} s (bound {args.ttl + args.ttl / 3 + 1:.1f} s), "
        f"ticks {summary['ticks_enqueued']}/{expected}, duplicates {summary['duplicate_ticks']}, "
        f"lateness p99 {summary['fire_lateness_ms_p99']} ms"
    )
    if args.json:
        print(json.dumps(summary))
    return 0
