"""The schedule runner in one process, against real Redis: firing, retries, fan-out, catch-up, fencing."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

import dramatiq_gp as gp
from dramatiq_gp.names import tick_message_id
from helpers import wait_for


@gp.event("test.scheduler.tick")
@dataclass(frozen=True)
class Tock:
    label: str = "tock"


def _queued(rdb, namespace, queue="default"):
    return [json.loads(v) for v in rdb.hvals(f"{namespace}:{queue}.msgs")]


@pytest.fixture
def runner_kit(make_kit):
    kits: list[gp.Kit] = []

    def make(register, env=None, **kwargs):
        kit = make_kit(register, env={"SCHEDULER_LEASE_TTL": "1500ms", **(env or {})}, **kwargs)
        kits.append(kit)
        return kit

    yield make
    for kit in kits:
        if kit.scheduler is not None:
            kit.scheduler.stop()


def test_an_empty_schedule_starts_no_election(make_kit, rdb, namespace):
    kit = make_kit()
    assert kit.scheduler is None
    assert list(rdb.scan_iter(f"{namespace}:scheduler:*")) == []


def test_the_leader_fires_a_job_each_tick_under_the_ticks_id(runner_kit, rdb, namespace):
    kit = runner_kit(lambda registry, schedule: schedule.job("heartbeat", "@every 1s", lambda: None, queue="jobs"))
    kit.scheduler.start()
    wait_for(lambda: len(_queued(rdb, namespace, "jobs")) >= 3, timeout=10)
    fired = _queued(rdb, namespace, "jobs")
    for message in fired:
        assert message["actor_name"] == "job:heartbeat"
        tick = datetime.fromisoformat(message["args"][0]["scheduled_at"])
        assert tick.microsecond == 0
        assert message["message_id"] == tick_message_id("heartbeat", tick)
    status = kit.scheduler.status()
    assert status["this_process_leads"] is True
    assert status["leader"]["epoch"] >= 1
    (entry,) = status["entries"]
    assert entry["name"] == "heartbeat" and entry["trigger"] == "@every 1s" and entry["last_fired"] is not None
    assert entry["next_fire"] > entry["last_fired"]
    kit.scheduler.stop()
    assert rdb.exists(f"{namespace}:scheduler:lease") == 0  # released at once


def test_a_job_that_raises_is_retried_with_its_scheduled_time(runner_kit, start_worker):
    calls: list[datetime] = []

    def flaky(scheduled_at: datetime) -> None:
        calls.append(scheduled_at)
        if len(calls) == 1:
            raise RuntimeError("database blip")

    kit = runner_kit(
        lambda registry, schedule: schedule.job("report", "@every 1s", flaky, max_retries=2, tz="Europe/Budapest"),
        env={"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"},
    )
    start_worker(kit)  # starts the runner too
    wait_for(lambda: len(calls) >= 3, timeout=10)
    assert calls[0] == calls[1]  # the retry is the same firing
    assert calls[0].tzinfo is not None and calls[0].utcoffset() in (timedelta(hours=1), timedelta(hours=2))


def test_a_scheduled_event_fans_out_and_a_retried_firing_runs_no_listener_twice(runner_kit, start_worker, caplog):
    runs: Counter[str] = Counter()
    lock = threading.Lock()

    def listener(name: str):
        def handle(event: Tock) -> None:
            with lock:
                runs[name] += 1

        return handle

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        registry.listen(Tock, listener("a"), name="a")
        registry.listen(Tock, listener("b"), name="b", queue="other")
        schedule.every(timedelta(seconds=1), Tock())

    kit = runner_kit(register, env={"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"})
    # The first fan-out reaches Redis and then fails, so the firing is retried.
    real_enqueue_many, failed = kit.broker.enqueue_many, []

    def enqueue_then_fail(messages, **options):
        sent = real_enqueue_many(messages, **options)
        if not failed and messages[0].actor_name.startswith("listener:"):
            failed.append(1)
            raise ConnectionError("lost the reply")
        return sent

    kit.broker.enqueue_many = enqueue_then_fail
    caplog.set_level(logging.INFO)
    start_worker(kit)
    wait_for(lambda: runs["a"] >= 3 and runs["b"] >= 3, timeout=15)
    kit.scheduler.stop()
    time.sleep(0.5)
    fired = len({r.getMessage() for r in caplog.records if "fired test.scheduler.tick" in r.getMessage()})
    assert failed
    assert runs["a"] == runs["b"] == fired  # one run per listener per firing, retry included


def test_a_scheduled_event_listener_knows_the_tick_it_was_fired_for(runner_kit, start_worker):
    seen: list[gp.Envelope] = []

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        registry.listen(Tock, lambda event: seen.append(gp.current_envelope()), name="a")
        schedule.every(timedelta(seconds=1), Tock())

    kit = runner_kit(register)
    start_worker(kit)
    wait_for(lambda: len(seen) >= 2, timeout=10)
    kit.scheduler.stop()
    first = seen[0]
    assert first.event == "test.scheduler.tick"
    assert first.scheduled_at is not None and first.scheduled_at.microsecond == 0
    assert first.id == tick_message_id("test.scheduler.tick", first.scheduled_at)
    assert len({e.id for e in seen}) == len(seen)


@pytest.mark.parametrize(
    ("policy", "threshold", "expected"),
    [("none", "1s", 1), ("latest", "1s", 2), ("all", "1s", 11), ("none", "", 11)],
    ids=["none", "latest", "all", "none-within-the-default-threshold"],
)
def test_a_new_leader_catches_up_missed_ticks_by_policy(policy, threshold, expected, runner_kit, rdb, namespace):
    # A 1 s misfire threshold leaves the tick of the current second on time (it fires under any
    # policy) and the ten before it misfired (the policy's); the default 60 s one, all eleven on time.
    kit = runner_kit(
        lambda registry, schedule: schedule.job("every_second", "@every 1s", lambda: None),
        env={"SCHEDULER_CATCHUP": policy, **({"SCHEDULER_MISFIRE_THRESHOLD": threshold} if threshold else {})},
    )
    # The last leader fired its last tick 10.5 s before the current second: 11 ticks were missed.
    last = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=10, milliseconds=500)
    rdb.hset(f"{namespace}:scheduler:last_fired", "every_second", int(last.timestamp() * 1000))
    started = datetime.now(UTC)
    kit.scheduler.start()
    wait_for(lambda: kit.scheduler.lease.is_held())
    wait_for(lambda: any(m["args"][0]["scheduled_at"] > started.isoformat() for m in _queued(rdb, namespace)), 5)
    late = [m for m in _queued(rdb, namespace) if datetime.fromisoformat(m["args"][0]["scheduled_at"]) < started]
    assert len(late) == expected
    if policy == "latest":
        ticks = sorted(datetime.fromisoformat(m["args"][0]["scheduled_at"]) for m in late)
        assert ticks[0] > started - timedelta(seconds=2)


def test_missed_ticks_older_than_the_grace_are_never_fired(runner_kit, rdb, namespace):
    kit = runner_kit(
        lambda registry, schedule: schedule.job("every_second", "@every 1s", lambda: None),
        env={"SCHEDULER_CATCHUP": "all", "SCHEDULER_CATCHUP_GRACE": "3s"},
    )
    rdb.hset(f"{namespace}:scheduler:last_fired", "every_second", int(time.time() * 1000) - 60_000)
    started = datetime.now(UTC)
    kit.scheduler.start()
    wait_for(lambda: any(m["args"][0]["scheduled_at"] > started.isoformat() for m in _queued(rdb, namespace)), 5)
    late = [m for m in _queued(rdb, namespace) if datetime.fromisoformat(m["args"][0]["scheduled_at"]) < started]
    assert 2 <= len(late) <= 3


def test_a_leader_that_lost_the_lease_fires_nothing_even_if_it_tries(runner_kit, rdb, namespace):
    kit = runner_kit(lambda registry, schedule: schedule.job("j", "@every 1s", lambda: None))
    runner = kit.scheduler
    runner.start()
    wait_for(runner.lease.is_held)
    wait_for(lambda: _queued(rdb, namespace), timeout=5)
    runner._stop.set()  # freeze the timer, keep the lease thread
    runner._thread.join()
    before = len(_queued(rdb, namespace))
    rdb.set(f"{namespace}:scheduler:lease", "999/someone-else")  # a new leader took over meanwhile
    entry = runner.schedule.entries[0]
    next_tick = entry.next_after(datetime.now(UTC) + timedelta(seconds=5))
    assert runner._fire(entry, next_tick) is False
    assert len(_queued(rdb, namespace)) == before
    wait_for(lambda: not runner.lease.is_held(), timeout=5)  # the renewal noticed too


def test_a_firing_that_finds_the_lease_gone_gives_up_leading_instead_of_retrying_at_once(
    runner_kit, rdb, namespace, caplog
):
    # The default 15 s lease: the next renewal, which would notice, is up to 5 s away.
    kit = runner_kit(
        lambda registry, schedule: schedule.job("j", "@every 1s", lambda: None), env={"SCHEDULER_LEASE_TTL": "15s"}
    )
    runner = kit.scheduler
    runner.start()
    wait_for(lambda: _queued(rdb, namespace), timeout=5)
    epoch = runner.lease.epoch
    with caplog.at_level(logging.WARNING, logger="dramatiq_gp"):
        rdb.delete(f"{namespace}:scheduler:lease")  # Redis lost the key (restarted without persistence, failed over)
        wait_for(lambda: not runner.lease.is_held(), timeout=3)
        time.sleep(1)
        refused = [r for r in caplog.records if "no longer holds the lease" in r.getMessage()]
        assert len(refused) == 1, len(refused)  # not a Lua call and a warning in a loop until the renewal
    wait_for(lambda: runner.lease.is_held() and runner.lease.epoch > epoch, timeout=10)  # it contends again
    fired = len(_queued(rdb, namespace))
    wait_for(lambda: len(_queued(rdb, namespace)) > fired, timeout=5)


def test_two_namespaces_on_one_redis_elect_independently(runner_kit, rdb, namespace):
    one = runner_kit(lambda r, s: s.job("j", "@every 1s", lambda: None), env={"SCHEDULER_NAMESPACE": f"{namespace}-a"})
    two = runner_kit(lambda r, s: s.job("j", "@every 1s", lambda: None), env={"SCHEDULER_NAMESPACE": f"{namespace}-b"})
    one.scheduler.start()
    two.scheduler.start()
    wait_for(lambda: one.scheduler.lease.is_held() and two.scheduler.lease.is_held())
    same = runner_kit(lambda r, s: s.job("j", "@every 1s", lambda: None), env={"SCHEDULER_NAMESPACE": f"{namespace}-a"})
    same.scheduler.start()
    time.sleep(1)
    assert not same.scheduler.lease.is_held()
    for key in rdb.scan_iter(f"{namespace}-*"):
        rdb.delete(key)


def _ticks_queued(rdb, namespace) -> list[datetime]:
    return sorted(datetime.fromisoformat(m["args"][0]["scheduled_at"]) for m in _queued(rdb, namespace, "jobs"))


def test_a_paused_entry_fires_nothing_until_resumed_and_its_pause_is_not_caught_up(
    runner_kit, rdb, namespace, clean_env
):
    from click.testing import CliRunner

    from dramatiq_gp.cli import main

    kit = runner_kit(
        lambda registry, schedule: schedule.job("heartbeat", "@every 1s", lambda: None, queue="jobs"),
        env={"SCHEDULER_CATCHUP": "all"},
    )
    kit.scheduler.start()
    wait_for(lambda: len(_ticks_queued(rdb, namespace)) >= 2, timeout=10)
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    paused = CliRunner().invoke(main, ["schedule", "pause", "heartbeat"])
    assert paused.exit_code == 0, paused.output
    paused_at = datetime.now(UTC)
    (entry,) = kit.scheduler.status()["entries"]
    assert entry["paused"]["by"].endswith("(cli)")
    time.sleep(3)
    assert max(_ticks_queued(rdb, namespace)) < paused_at  # from its next tick on, none fired
    assert CliRunner().invoke(main, ["schedule", "resume", "heartbeat"]).exit_code == 0
    resumed_at = datetime.now(UTC)
    wait_for(lambda: max(_ticks_queued(rdb, namespace)) > resumed_at, timeout=10)
    # The ticks of the pause were passed over, not caught up later.
    assert [t for t in _ticks_queued(rdb, namespace) if paused_at < t < resumed_at - timedelta(seconds=1)] == []
    assert kit.scheduler.status()["entries"][0]["paused"] is None

    unknown = CliRunner().invoke(main, ["schedule", "pause", "nightly"])
    assert unknown.exit_code == 1 and "no schedule entry 'nightly' in scheduler" in unknown.output
    not_paused = CliRunner().invoke(main, ["schedule", "resume", "heartbeat"])
    assert (not_paused.exit_code, not_paused.output) == (1, "Error: schedule entry 'heartbeat' is not paused\n")


@pytest.mark.parametrize("asked", [None, logging.INFO], ids=["default", "asked-for-info"])
def test_apschedulers_info_lines_stay_quiet_unless_its_level_was_set(asked, runner_kit, caplog, monkeypatch):
    # About seven INFO lines per start ("Adding job tentatively", "Scheduler started"...), in every process.
    apscheduler = logging.getLogger("apscheduler")
    monkeypatch.setattr(apscheduler, "level", asked if asked is not None else logging.NOTSET)
    caplog.set_level(logging.INFO)
    kit = runner_kit(lambda registry, schedule: schedule.job("quiet", "@every 1s", lambda: None, queue="jobs"))
    kit.scheduler.start()
    wait_for(lambda: "leadership acquired" in caplog.text, timeout=10)
    kit.scheduler.stop()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("apscheduler") and r.levelno < logging.WARNING]
    if asked is None:
        assert said == [] and apscheduler.level == logging.WARNING
    else:
        assert "Scheduler started" in said and apscheduler.level == logging.INFO
