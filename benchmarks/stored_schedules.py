"""``python -m benchmarks scheduler --dynamic N``: N entries stored at run time, fired through leader kills.

N entries (default 100,000: one digest per customer in 500 time zones) are stored
with ``gp.Schedules.add`` while three scheduler processes with an empty code
schedule and ``SCHEDULER_DYNAMIC=true`` contend for the lease. ``--burst`` of them
(default 2,000) fire every minute (``* * * * *``), all at the same instant; the rest
are daily digests at a random local time in their zone, so a few also fall in the
window. The leader is killed (SIGKILL) ``--failovers`` times, from the window's
second minute on, and restarted: mid-minute, and every second time a second or
two before a burst, so that the next leader fires that burst late.

Every tick due in the measured window must be on the queue exactly once.
Lateness is the message's timestamp (taken as the leader builds it) less its
tick, on the ticks away from a failover; the leader's CPU is read from
``/proc`` from the window's start to the first kill (the end, without one); Redis memory is
``used_memory`` before and after the entries were stored.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import time
import uuid
import zoneinfo
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import redis

import dramatiq_gp as gp
from devtools.scheduler_cluster import Cluster
from devtools.services import redis_url
from dramatiq_gp import keys
from dramatiq_gp.scheduler.targets import of_event

#: The burst entries' spec: every one fires at each minute's start.
BURST_SPEC = "* * * * *"


@gp.schedulable
@gp.event("bench.digest")
@dataclass(frozen=True)
class Digest:
    customer: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--burst", type=int, default=2000, help="stored entries firing together every minute")
    parser.add_argument("--zones", type=int, default=500)
    parser.add_argument("--minutes", type=int, default=4, help="the measured window, in whole minutes")


def run(args: argparse.Namespace) -> int:
    zones = sorted(zoneinfo.available_timezones() - {"Factory", "localtime"})[: args.zones]
    rng = random.Random(7)
    with redis_url() as url, tempfile.TemporaryDirectory() as logs:
        namespace = f"gpbench-{uuid.uuid4().hex[:8]}"
        env = {
            "REDIS_URL": url,
            "VALKEY_NAMESPACE": namespace,
            "GP_TEST_SPEC": "",
            "SCHEDULER_DYNAMIC": "true",
            "SCHEDULER_LEASE_TTL": f"{args.ttl}s",
            "SCHEDULER_CATCHUP": "all",
            "LOG_LEVEL": "WARNING",
        }
        cluster = Cluster(env, Path(logs), size=3)
        client = redis.Redis.from_url(url)
        memory_before = int(client.info("memory")["used_memory"])
        cluster.start()
        try:
            cluster.wait_for_leader()
            # The cluster's processes do not declare the event: published as a worker whose code has it would.
            target = of_event(gp.event_type(Digest))
            client.hset(keys.SchedulerKeys(namespace).schedulable, target.field, target.encode())
            schedules = gp.Schedules(client, namespace)
            started = time.perf_counter()
            for n in range(args.dynamic):
                zone = zones[n % len(zones)]
                spec = BURST_SPEC if n < args.burst else f"{rng.randrange(60)} {rng.randrange(24)} * * *"
                schedules.add(f"digest.{n}", spec, Digest(customer=n), tz=zone)
            add_s = time.perf_counter() - started
            memory_after = int(client.info("memory")["used_memory"])
            print(f"stored {args.dynamic} entries in {add_s:.1f} s", flush=True)

            # The window: from the next minute's start, for whole minutes.
            window_start = (int(time.time()) // 60 + 1) * 60 - 0.5
            time.sleep(max(0.0, window_start - time.time()))
            window_end = window_start + 60 * args.minutes
            cpu_from = {pid: _cpu_s(pid) for pid in cluster.pids()}
            cpu_wall, cpu_to = time.time(), None
            takeovers, windows = [], []
            # Mid-minute, and (every second kill) a second or two before a burst, which the next leader then fires.
            kill_at = [
                window_start + 60 * m + (rng.uniform(58, 59.5) if m % 2 == 0 else rng.uniform(20, 35))
                for m in range(1, args.minutes)
            ]
            for kill in kill_at[: args.failovers]:
                time.sleep(max(0.0, kill - time.time()))
                pid, _ = cluster.wait_for_leader()
                if cpu_to is None:
                    cpu_to = {p: _cpu_s(p) for p in cpu_from}
                    cpu_wall = time.time() - cpu_wall
                killed = time.time()
                index = cluster.index_of(pid)
                cluster.kill(index, signal.SIGKILL)
                cluster.wait_for_leader(other_than=pid, timeout=4 * args.ttl)
                took = int(cluster.client.hget(cluster.keys.leader, "acquired_at")) / 1000 - killed
                takeovers.append(took)
                windows.append((killed - 1, killed + took + 1))
                cluster.start(index)
                print(f"failover: takeover {took:.3f} s", flush=True)
            time.sleep(max(0.0, window_end + 5 - time.time()))
            if cpu_to is None:
                cpu_to = {p: _cpu_s(p) for p in cpu_from}
                cpu_wall = time.time() - cpu_wall
            leader_cpu = max(cpu_to[p] - cpu_from[p] for p in cpu_from)
            firings = [json.loads(m) for m in client.hvals(f"{namespace}:default.msgs")]
            entries = schedules.list("digest.", limit=args.dynamic)
        finally:
            cluster.stop()
            client.close()

    found: Counter[tuple[str, int]] = Counter()
    lateness, failover_lateness = [], []
    for message in firings:
        envelope = message["args"][0]
        tick_s = datetime.fromisoformat(envelope["scheduled_at"]).timestamp()
        if not window_start < tick_s <= window_end:
            continue
        found[(envelope["entry"], round(tick_s))] += 1
        late = message["message_timestamp"] - tick_s * 1000
        (failover_lateness if any(a <= tick_s <= b for a, b in windows) else lateness).append(late)
    expected = _expected(entries, window_start, window_end)
    summary = {
        "dynamic_entries": args.dynamic,
        "zones": len(zones),
        "burst": args.burst,
        "window_minutes": args.minutes,
        "ticks_expected": len(expected),
        "ticks_enqueued": len(found),
        "duplicate_ticks": sum(count - 1 for count in found.values()),
        "missed_ticks": len(expected - set(found)),
        "unexpected_ticks": len(set(found) - expected),
        "fire_lateness_ms_p50": round(statistics.median(lateness), 1),
        "fire_lateness_ms_p99": round(statistics.quantiles(lateness, n=100)[98], 1),
        "fire_lateness_ms_max": round(max(lateness), 1),
        "failover_lateness_ms_max": round(max(failover_lateness, default=0.0), 1),
        "failovers": len(takeovers),
        "takeover_s_max": round(max(takeovers, default=0.0), 3),
        "takeover_bound_s": round(args.ttl * 4 / 3 + 1, 3),
        "lease_ttl_s": args.ttl,
        "leader_cpu_pct": round(100 * leader_cpu / cpu_wall, 1),
        "redis_bytes_per_entry": round((memory_after - memory_before) / args.dynamic),
        "redis_entries_mb": round((memory_after - memory_before) / 2**20, 1),
        "adds_per_s": round(args.dynamic / add_s),
    }
    print(
        f"{summary['ticks_enqueued']}/{summary['ticks_expected']} ticks, {summary['duplicate_ticks']} duplicates, "
        f"{summary['missed_ticks']} missed; lateness p99 {summary['fire_lateness_ms_p99']} ms; "
        f"takeover max {summary['takeover_s_max']} s (bound {summary['takeover_bound_s']} s); "
        f"leader CPU {summary['leader_cpu_pct']}%; {summary['redis_bytes_per_entry']} B per entry in Redis"
    )
    if args.json:
        print(json.dumps(summary))
    return 0


def _expected(entries: list[gp.StoredEntry], start: float, end: float) -> set[tuple[str, int]]:
    """(entry, tick s) of every tick the stored entries have in (start, end]."""
    from dramatiq_gp.scheduler.cron import parse

    expected = set()
    after = datetime.fromtimestamp(start, UTC)
    for entry in entries:
        spec, zone = parse(entry.trigger), zoneinfo.ZoneInfo(entry.zone)
        tick = spec.next_after(after, zone)
        while tick.timestamp() <= end:
            expected.add((entry.name, round(tick.timestamp())))
            tick = spec.next_after(tick, zone)
    return expected


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
