"""Leader election with real processes: one leader, kill -9, SIGSTOP, Redis restarts, repeated failovers."""

from __future__ import annotations

import itertools
import signal
import time
from collections import Counter
from datetime import timedelta

import pytest

from devtools.scheduler_cluster import Cluster
from helpers import wait_for
from servers import OwnRedis

TTL = 2.0


@pytest.fixture
def cluster(tmp_path, clean_env, redis_url, namespace):
    clusters: list[Cluster] = []

    def make(size: int = 3, **env: str) -> Cluster:
        settings = {"REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace, "SCHEDULER_LEASE_TTL": f"{TTL}s", **env}
        clusters.append(Cluster(settings, tmp_path, size))
        clusters[-1].start()
        return clusters[-1]

    yield make
    for each in clusters:
        each.stop()


def _assert_every_tick_once(cluster: Cluster) -> int:
    firings = cluster.firings()
    ticks = [f.tick for f in firings]
    assert Counter(f.message_id for f in firings).most_common(1)[0][1] == 1, "a tick was enqueued twice"
    assert len(set(ticks)) == len(ticks)
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert all(gap == timedelta(seconds=1) for gap in gaps), [str(g) for g in gaps if g != timedelta(seconds=1)]
    return len(ticks)


def test_three_processes_elect_exactly_one_leader(cluster):
    nodes = cluster()
    pid, epoch = nodes.wait_for_leader()
    time.sleep(3 * TTL)
    assert nodes.leader() == (pid, epoch)
    leaders = [i for i in range(3) if "leadership acquired" in nodes.log(i)]
    assert leaders == [nodes.index_of(pid)]
    firers = [i for i in range(3) if "fired tick" in nodes.log(i)]
    assert firers == leaders
    assert _assert_every_tick_once(nodes) >= 4


def test_when_the_leader_is_killed_another_fires_within_ttl_and_a_renew_interval(cluster):
    # A takeover takes up to TTL + TTL/3 (2.7 s), long enough to miss two 1 s ticks;
    # catch-up ``all`` fires both, so every tick shows up exactly once.
    nodes = cluster(SCHEDULER_CATCHUP="all")
    pid, epoch = nodes.wait_for_leader()
    wait_for(lambda: len(nodes.firings()) >= 2)
    killed_at = time.time()
    nodes.kill(nodes.index_of(pid))
    _new_pid, new_epoch = nodes.wait_for_leader(other_than=pid, timeout=3 * TTL)
    takeover = time.time() - killed_at
    assert new_epoch > epoch
    assert takeover <= TTL + TTL / 3 + 0.5
    wait_for(lambda: nodes.firings()[-1].enqueued_ms / 1000 > killed_at + takeover, timeout=3)
    _assert_every_tick_once(nodes)


def test_a_paused_leader_does_not_fire_when_it_wakes_and_no_tick_is_duplicated(cluster):
    nodes = cluster(SCHEDULER_CATCHUP="all")  # see the kill test above
    pid, _epoch = nodes.wait_for_leader()
    wait_for(lambda: len(nodes.firings()) >= 2)
    index = nodes.index_of(pid)
    nodes.kill(index, signal.SIGSTOP)
    new_pid, _ = nodes.wait_for_leader(other_than=pid, timeout=3 * TTL)
    time.sleep(TTL)  # well past the paused leader's lease
    seen = len(nodes.log(index))
    nodes.kill(index, signal.SIGCONT)
    time.sleep(2 * TTL)
    woke = nodes.log(index)[seen:]
    assert "leadership lost" in woke
    assert "fired tick" not in woke
    assert nodes.leader()[0] == new_pid
    _assert_every_tick_once(nodes)


def test_leadership_recovers_after_a_redis_restart(tmp_path, cluster):
    server = OwnRedis(tmp_path / "redis")
    server.start()
    nodes = cluster(REDIS_URL=server.url)
    try:
        nodes.wait_for_leader()
        wait_for(lambda: nodes.firings(), timeout=5)
        server.restart(down_for=1.0)
        before = len(nodes.firings())
        wait_for(lambda: nodes.leader() is not None, timeout=4 * TTL)
        wait_for(lambda: len(nodes.firings()) > before + 2, timeout=4 * TTL)
    finally:
        nodes.stop()
        server.stop()


def test_repeated_failovers_enqueue_every_tick_exactly_once(cluster):
    nodes = cluster(SCHEDULER_CATCHUP="all")
    for _ in range(4):
        pid, _ = nodes.wait_for_leader()
        time.sleep(1.5)
        index = nodes.index_of(pid)
        nodes.kill(index)
        nodes.wait_for_leader(other_than=pid, timeout=3 * TTL)
        nodes.start(index)  # the killed replica comes back and contends again
    time.sleep(2)
    assert _assert_every_tick_once(nodes) >= 10
