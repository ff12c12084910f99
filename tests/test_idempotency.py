"""Duplicates of one message id run once, never overlap, and retries still run."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import pytest

import dramatiq_gp as gp
from dramatiq_gp.brokers import done_marks
from helpers import dead, messages_of, ready, wait_for


@gp.event("test.idem.ping")
@dataclass(frozen=True)
class Ping:
    n: int


def _kit_with(make_kit, handler, env=None, **options):
    return make_kit(lambda registry, schedule: registry.listen(Ping, handler, name="handler", **options), env=env)


@pytest.mark.usefixtures("broker")
def test_a_duplicate_of_a_completed_message_is_skipped_with_one_warning(make_kit, start_worker, caplog):
    runs: list[int] = []
    kit = _kit_with(make_kit, lambda event: runs.append(event.n))
    start_worker(kit)
    kit.dispatch(Ping(1), envelope_id="env-1")
    wait_for(lambda: runs == [1])

    caplog.set_level(logging.INFO)
    kit.dispatch(Ping(1), envelope_id="env-1")
    wait_for(lambda: messages_of(caplog, "dramatiq_gp", logging.WARNING))
    time.sleep(0.2)
    assert runs == [1]
    warnings = messages_of(caplog, "", logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "already completed" in warnings[0]
    assert "listener:test.idem.ping:handler" in warnings[0]


@pytest.mark.usefixtures("broker")
def test_two_concurrent_copies_of_one_id_never_overlap(make_kit, start_worker, caplog):
    spans: list[tuple[float, float]] = []

    def slow(event: Ping) -> None:
        started = time.monotonic()
        time.sleep(0.5)
        spans.append((started, time.monotonic()))

    kit = _kit_with(make_kit, slow)
    kit.dispatch(Ping(1), envelope_id="env-same")
    kit.dispatch(Ping(1), envelope_id="env-same")
    assert ready(kit) == 2
    start_worker(kit, threads=4)
    # The second copy is deferred while the first runs, then skipped as done.
    wait_for(lambda: "task skipped: already completed" in caplog.text, 15)
    time.sleep(0.2)
    assert len(spans) == 1


@pytest.mark.usefixtures("broker")
def test_a_retry_of_the_same_id_still_runs(make_kit, start_worker):
    attempts: list[int] = []

    def fails_once(event: Ping) -> None:
        attempts.append(event.n)
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails")

    kit = _kit_with(make_kit, fails_once, env={"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"})
    kit.dispatch(Ping(5))
    start_worker(kit)
    wait_for(lambda: len(attempts) == 2)
    time.sleep(0.2)
    assert attempts == [5, 5]


@pytest.mark.usefixtures("broker")
def test_completion_is_remembered_for_the_retention_window_and_claims_are_released(
    make_kit, start_worker, rdb, namespace, caplog
):
    runs: list[int] = []
    finish = threading.Event()

    def handler(event: Ping) -> None:
        runs.append(event.n)
        finish.wait(5)

    kit = _kit_with(make_kit, handler, env={"WORKER_DEDUP_RETENTION": "4s"})
    idem = next(m for m in kit.broker.middleware if isinstance(m, gp.IdempotentExecution))
    kit.dispatch(Ping(1), envelope_id="kept")
    start_worker(kit)
    wait_for(lambda: runs == [1])
    (message_id,) = [m.message_id for m in kit.registry.fan_out(Ping(1), "kept")]
    claim = f"{namespace}:gp:done:{message_id}"
    # While it runs, the attempt holds a claim: its own token, for one lease, renewed by the worker.
    assert rdb.get(claim) is not None
    assert 0 < rdb.pttl(claim) <= idem.lease_ms
    assert list(idem._running) == [claim]
    assert not done_marks.is_done(rdb, namespace, message_id)

    finish.set()
    wait_for(lambda: done_marks.is_done(rdb, namespace, message_id))
    completed = time.monotonic()
    assert rdb.exists(claim) == 0
    wait_for(lambda: not idem._running)  # nothing left to renew

    # Inside the retention, up to its last moment: a copy is skipped.
    time.sleep(3.6)
    kit.dispatch(Ping(1), envelope_id="kept")
    wait_for(lambda: "task skipped: already completed" in caplog.text)
    assert time.monotonic() - completed < 4
    assert runs == [1]

    # Kept a quarter of the retention longer at most (its slice expires whole): then a copy runs.
    wait_for(lambda: not done_marks.is_done(rdb, namespace, message_id), timeout=3)
    assert 4 <= time.monotonic() - completed <= 5.2
    assert list(rdb.scan_iter(f"{namespace}:gp:marks:*:*", count=1000)) == []  # nothing held
    kit.dispatch(Ping(1), envelope_id="kept")
    wait_for(lambda: runs == [1, 1])
    wait_for(lambda: done_marks.is_done(rdb, namespace, message_id))


@pytest.mark.usefixtures("broker")
def test_a_done_mark_left_by_the_version_before_still_skips_a_copy(make_kit, start_worker, rdb, namespace, caplog):
    """Before the packed marks, a done mark was ``"done"`` under the claim's key: a rolling upgrade keeps it."""
    runs: list[int] = []
    kit = _kit_with(make_kit, lambda event: runs.append(event.n))
    (message_id,) = [m.message_id for m in kit.registry.fan_out(Ping(7), "upgraded")]
    rdb.set(f"{namespace}:gp:done:{message_id}", "done", px=60_000)  # as the kit before wrote it
    kit.dispatch(Ping(7), envelope_id="upgraded")
    kit.dispatch(Ping(8), envelope_id="new")
    start_worker(kit)
    wait_for(lambda: "task skipped: already completed" in caplog.text and runs == [8])
    time.sleep(0.2)
    assert runs == [8]


@pytest.mark.usefixtures("broker")
def test_done_marks_take_about_twenty_bytes_each_in_compact_shards(make_kit, start_worker, rdb, namespace):
    """The sizing docs/capacity.md gives: a few thousand marks, their memory, and their encoding."""
    kit = _kit_with(make_kit, lambda event: None, env={"WORKER_DEDUP_RETENTION": "1h"})
    count = 3000
    for n in range(count):
        kit.dispatch(Ping(n))
    start_worker(kit, threads=8)

    def marked() -> int:
        return sum(rdb.hlen(k) for k in rdb.scan_iter(f"{namespace}:gp:marks:*:*:*:*", count=1000))

    # None ready and no claim held also holds while RabbitMQ's deliveries are on their way to the worker.
    wait_for(lambda: ready(kit) == 0 and not rdb.keys(f"{namespace}:gp:done:*") and marked() >= count, timeout=60)
    marks = [k for k in rdb.scan_iter(f"{namespace}:gp:marks:*:*:*:*", count=1000)]
    assert sum(rdb.hlen(k) for k in marks) == count
    assert {rdb.object("encoding", k) for k in marks} <= {"listpack", "ziplist"}
    used = sum(rdb.memory_usage(k, samples=0) for k in rdb.scan_iter(f"{namespace}:gp:marks:*", count=1000))
    assert used / count <= 40, used / count


@pytest.mark.usefixtures("broker")
def test_a_failed_attempt_releases_its_claim(make_kit, start_worker, rdb, namespace):
    def always_fails(event: Ping) -> None:
        raise RuntimeError("no")

    kit = _kit_with(make_kit, always_fails, max_retries=0)
    envelope_id = kit.dispatch(Ping(1))
    start_worker(kit)
    wait_for(lambda: dead(kit) == 1)
    (message_id,) = [m.message_id for m in kit.registry.fan_out(Ping(1), envelope_id)]
    assert rdb.exists(f"{namespace}:gp:done:{message_id}") == 0
    assert not done_marks.is_done(rdb, namespace, message_id)


@pytest.mark.usefixtures("broker")
def test_a_long_task_keeps_its_claim_past_the_lease(make_kit, start_worker, caplog):
    runs: list[float] = []

    def slow(event: Ping) -> None:
        runs.append(time.monotonic())
        time.sleep(1.2)

    kit = _kit_with(make_kit, slow)
    idem = next(m for m in kit.broker.middleware if isinstance(m, gp.IdempotentExecution))
    idem.lease_ms = 300  # renewed every 100 ms
    kit.dispatch(Ping(1), envelope_id="long")
    start_worker(kit, threads=4)
    wait_for(lambda: runs)
    time.sleep(0.6)  # twice the lease: only renewal keeps the claim alive now
    kit.dispatch(Ping(1), envelope_id="long")
    # Deferred while the first runs (had its claim lapsed, it would run now), then skipped as done.
    wait_for(lambda: "task skipped: already completed" in caplog.text, 15)
    time.sleep(0.3)
    assert len(runs) == 1


@pytest.mark.usefixtures("broker")
def test_plain_actors_are_not_checked(make_kit, start_worker, rdb, namespace):
    import dramatiq

    kit = make_kit()
    runs: list[int] = []

    @dramatiq.actor(broker=kit.broker, queue_name="plain")
    def plain(n: int) -> None:
        runs.append(n)

    message = plain.message(1)
    kit.broker.enqueue(message)
    kit.broker.enqueue(message)
    start_worker(kit)
    wait_for(lambda: len(runs) == 2)
    assert list(rdb.scan_iter(f"{namespace}:gp:[cd]*", count=1000)) == []


def test_messages_claimed_but_not_started_at_shutdown_are_requeued_with_their_claims_freed(make_kit, rdb, namespace):
    import dramatiq

    started: list[int] = []

    def slow(event: Ping) -> None:
        started.append(event.n)
        time.sleep(0.5)

    kit = _kit_with(make_kit, slow)
    envelopes = [kit.dispatch(Ping(n)) for n in range(2)]
    kit.broker.emit_after("process_boot")
    worker = dramatiq.Worker(kit.broker, worker_threads=1, worker_timeout=100)
    worker.start()
    wait_for(lambda: started)
    # Both were fetched and claimed in one batch (prefetch is twice the threads); one is running.
    assert len(list(rdb.scan_iter(f"{namespace}:gp:done:*", count=1000))) == 2
    worker.stop(5000)
    assert len(started) == 1
    assert rdb.llen(f"{namespace}:default") == 1
    assert len(list(rdb.scan_iter(f"{namespace}:gp:done:*", count=1000))) == 0
    ids = [m.message_id for n in range(2) for m in kit.registry.fan_out(Ping(n), envelopes[n])]
    assert [done_marks.is_done(rdb, namespace, i) for i in ids] == [n in started for n in range(2)]

    again = dramatiq.Worker(kit.broker, worker_threads=2, worker_timeout=100)
    again.start()
    try:
        wait_for(lambda: len(started) == 2, timeout=3)  # not deferred behind a stale claim
    finally:
        again.stop(5000)
    assert sorted(started) == [0, 1]
