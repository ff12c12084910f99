"""overlap= on job entries: a run skips, or waits for, the same entry's run still going in any worker process.

The process tests run two ``dramatiq tests.apps.overlap_app`` replicas: an
``@every 1s`` job whose runs take longer than that, recording each start and end
in Redis. The in-process tests hold an entry's lease by hand to see what a run
does then, whoever enqueued it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime

import dramatiq
import pytest
from dramatiq import Message
from telemetry_worker import free_port

import dramatiq_gp as gp
from apps.replica import Replica
from dramatiq_gp import actions
from dramatiq_gp.keys import SchedulerKeys
from dramatiq_gp.names import tick_message_id
from dramatiq_gp.scheduler import OVERLAP_OPTION
from helpers import messages_of, wait_for

ENTRY = "test.slow"


@dataclass
class Run:
    tick: str
    pid: int
    ppid: int
    started: float
    finished: float | None


@pytest.fixture
def replicas(tmp_path, clean_env, redis_url, namespace):
    """Start ``count`` replicas of the overlap app with ``overlap`` and ``env``; all are killed at the end."""
    started: list[Replica] = []

    def start(overlap: str, count: int = 2, threads: int = 2, **env: str) -> list[Replica]:
        settings = {
            "REDIS_URL": redis_url,
            "VALKEY_NAMESPACE": namespace,
            "GP_TEST_OVERLAP": overlap,
            "SCHEDULER_LEASE_TTL": "2s",
            **env,
        }
        new = [
            Replica("tests.apps.overlap_app", settings, tmp_path / f"replica-{len(started) + i}.log", threads=threads)
            for i in range(count)
        ]
        started.extend(new)
        for replica in new:
            wait_for(replica.started, timeout=30)
        return new

    yield start
    for replica in started:
        replica.kill()


def _runs(rdb, namespace) -> list[Run]:
    """Every run the job recorded, in the order they started."""
    runs: dict[tuple[str, int], Run] = {}
    for raw in rdb.lrange(f"{namespace}:test:runs", 0, -1):
        record = json.loads(raw)
        key = (record["tick"], record["pid"])
        if record["event"] == "started":
            runs[key] = Run(record["tick"], record["pid"], record["ppid"], record["at"], None)
        else:
            runs[key].finished = record["at"]
    return sorted(runs.values(), key=lambda run: run.started)


def _overlapping(runs: list[Run]) -> list[tuple[Run, Run]]:
    """The pairs of runs where one started before the run before it finished."""
    found, last = [], None
    for run in runs:
        if last is not None and (last.finished is None or run.started < last.finished):
            found.append((last, run))
        if last is None or last.finished is None or (run.finished or float("inf")) > last.finished:
            last = run
    return found


def _logs(nodes: list[Replica]) -> str:
    return "".join(node.log for node in nodes)


def _fired(nodes: list[Replica]) -> list[str]:
    """The ticks of the entry the leaders fired, as the job sees them."""
    return re.findall(rf"fired {re.escape(ENTRY)} scheduled_at=(\S+)", _logs(nodes))


def _pause_and_count(rdb, namespace, nodes: list[Replica]) -> list[str]:
    actions.pause_entry(rdb, SchedulerKeys(namespace), ENTRY, who="test")
    time.sleep(1.5)  # a tick fired as the pause landed is logged by now
    return _fired(nodes)


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return ""


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_skip_never_runs_an_entry_twice_at_once_across_processes_and_logs_and_counts_each_skipped_tick(
    replicas, rdb, namespace, tmp_path
):
    port = free_port()
    nodes = replicas(
        "skip",
        OTEL_METRICS_EXPORTER="prometheus",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
        OTEL_METRIC_EXPORT_INTERVAL="300",
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "metrics"),
    )
    wait_for(lambda: sum(run.finished is not None for run in _runs(rdb, namespace)) >= 3, timeout=40)
    fired = _pause_and_count(rdb, namespace, nodes)

    def skipped() -> list[str]:
        return re.findall(rf"run skipped: {re.escape(ENTRY)} is still running \(run (\S+)\)", _logs(nodes))

    # Every tick fired either ran or was skipped.
    wait_for(lambda: len(_runs(rdb, namespace)) + len(skipped()) == len(fired), timeout=15)
    wait_for(lambda: all(run.finished is not None for run in _runs(rdb, namespace)), timeout=10)
    runs = _runs(rdb, namespace)
    assert not _overlapping(runs)
    assert len(skipped()) >= 2, _logs(nodes)
    # Each skip names the run holding the entry: the message of a tick that ran.
    assert set(skipped()) <= {tick_message_id(ENTRY, datetime.fromisoformat(run.tick)) for run in runs}
    assert len({run.tick for run in runs}) == len(runs)
    skipped_total = f'dramatiq_gp_scheduler_overlaps_total{{entry="{ENTRY}",outcome="skipped"}}'
    wait_for(lambda: _sample(_scrape(port), skipped_total) == len(skipped()), timeout=15)
    assert not rdb.exists(SchedulerKeys(namespace).running(ENTRY))  # the last run freed the entry


def test_wait_runs_every_tick_one_after_the_other_and_loses_none(replicas, rdb, namespace):
    nodes = replicas("wait", GP_TEST_RUN_S="1.5")
    wait_for(lambda: len(_fired(nodes)) >= 4, timeout=40)  # a backlog of waiting runs by now
    fired = _pause_and_count(rdb, namespace, nodes)

    def all_ran() -> bool:
        runs = _runs(rdb, namespace)
        return len(runs) == len(fired) and all(run.finished is not None for run in runs)

    wait_for(all_ran, timeout=1.5 * len(fired) + 15)
    runs = _runs(rdb, namespace)
    assert not _overlapping(runs)
    assert sorted(datetime.fromisoformat(run.tick) for run in runs) == sorted(map(datetime.fromisoformat, fired))
    logs = _logs(nodes)
    assert f"run waiting: {ENTRY} is still running" in logs
    assert "run started after waiting" in logs
    assert "run skipped" not in logs


def test_a_run_killed_mid_way_frees_the_entry_for_another_process_within_the_lease(replicas, rdb, namespace):
    lease_s = 3.0
    nodes = replicas("skip", SCHEDULER_OVERLAP_LEASE=f"{lease_s:g}s")
    victim_run = wait_for(lambda: next(iter(_runs(rdb, namespace)), None), timeout=40)
    victim = next(node for node in nodes if node.process.pid == victim_run.ppid)
    time.sleep(max(0.0, victim_run.started + 1.0 - time.time()))  # a second into its 2.5 s
    killed_at = time.time()
    victim.kill()
    assert next(run for run in _runs(rdb, namespace) if run.tick == victim_run.tick).finished is None

    def next_run() -> Run | None:
        return next((run for run in _runs(rdb, namespace) if run.started > killed_at), None)

    after = wait_for(next_run, timeout=lease_s + 10)
    survivor = next(node for node in nodes if node is not victim)
    assert after.ppid == survivor.process.pid
    # The dead run's lease held the entry until it lapsed (renewed every second, so 2 to 3 s after
    # the kill), and the first tick after that ran.
    assert 1.5 <= after.started - killed_at <= lease_s + 2, after.started - killed_at
    assert f"run skipped: {ENTRY} is still running" in survivor.log


def test_allow_keeps_running_every_tick_even_while_the_previous_run_goes_on(replicas, rdb, namespace):
    nodes = replicas("allow", count=1, threads=4)
    wait_for(lambda: len(_runs(rdb, namespace)) >= 3, timeout=40)
    assert _overlapping(_runs(rdb, namespace))
    assert "run skipped" not in _logs(nodes)


# -- in one process, the lease held by hand ----------------------------------------------------


def _firing() -> dict[str, str]:
    return {"entry": "test.report", "scheduled_at": datetime.now(UTC).isoformat()}


@pytest.mark.usefixtures("broker")
def test_a_run_enqueued_by_anyone_honours_the_entrys_overlap_and_a_free_entry_runs(
    make_kit, start_worker, rdb, namespace, caplog
):
    runs: list[str] = []
    kit = make_kit(
        lambda registry, schedule: schedule.job("test.report", "@yearly", lambda: runs.append("ran"), overlap="skip")
    )
    start_worker(kit)
    running = SchedulerKeys(namespace).running("test.report")
    rdb.set(running, "another-run", px=60_000)
    caplog.set_level(logging.INFO)
    # Sent as an operator would ("run now"): without the message option, the actor's applies.
    kit.broker.actors["job:test.report"].send(_firing())
    wait_for(lambda: messages_of(caplog, "dramatiq_gp.middleware.overlap", logging.WARNING))
    (line,) = messages_of(caplog, "dramatiq_gp.middleware.overlap", logging.WARNING)
    assert line.startswith("run skipped: test.report is still running (run another-run) task_type=job:test.report")
    time.sleep(0.3)
    assert runs == []
    assert rdb.get(running) == "another-run"  # a skipped run leaves the holder's lease alone
    rdb.delete(running)
    kit.broker.actors["job:test.report"].send(_firing())
    wait_for(lambda: runs == ["ran"])
    wait_for(lambda: not rdb.exists(running))


def test_the_message_carries_the_option_to_any_actor_and_waits_for_the_entry(
    make_kit, start_worker, rdb, namespace, caplog
):
    kit = make_kit()
    ran: list[float] = []
    dramatiq.actor(lambda: ran.append(time.time()), broker=kit.broker, actor_name="plain_report")
    start_worker(kit)
    running = SchedulerKeys(namespace).running("tenant-7.digest")
    rdb.set(running, "another-run", px=60_000)
    threading.Timer(1.0, rdb.delete, [running]).start()
    freed_at = time.time() + 1.0
    caplog.set_level(logging.INFO)
    guard = {OVERLAP_OPTION: {"key": "tenant-7.digest", "mode": "wait"}}
    kit.broker.actors["plain_report"].send_with_options(**guard)
    wait_for(lambda: ran, timeout=5)
    assert ran[0] >= freed_at - 0.05
    assert any(m.startswith("run waiting: tenant-7.digest") for m in messages_of(caplog, "dramatiq_gp.middleware"))


@pytest.mark.usefixtures("broker")
def test_a_failed_run_frees_the_entry_so_its_retry_runs_and_a_crashed_runs_own_copy_takes_its_lease(
    make_kit, start_worker, rdb, namespace
):
    attempts: list[str] = []

    def flaky() -> None:
        attempts.append("attempt")
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails")

    kit = make_kit(
        lambda registry, schedule: schedule.job("test.flaky", "@yearly", flaky, overlap="wait", max_retries=1),
        env={"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "50ms"},
    )
    start_worker(kit)
    running = SchedulerKeys(namespace).running("test.flaky")
    kit.broker.actors["job:test.flaky"].send(_firing())
    wait_for(lambda: len(attempts) == 2, timeout=10)  # the retry did not wait for its own failed attempt
    wait_for(lambda: not rdb.exists(running))

    # The lease still names a message whose run died: that message, delivered again, is that run.
    message = Message(
        queue_name="default", actor_name="job:test.flaky", args=(_firing(),), kwargs={}, options={}, message_id="m-1"
    )
    rdb.set(running, "m-1", px=60_000)
    kit.broker.enqueue(message)
    wait_for(lambda: len(attempts) == 3, timeout=5)
    wait_for(lambda: not rdb.exists(running))


def test_a_waiting_run_goes_back_to_its_queue_when_the_worker_stops(make_kit, start_worker, rdb, namespace, caplog):
    runs: list[str] = []

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        schedule.job("test.queued", "@yearly", lambda: runs.append("ran"), overlap="wait")

    kit = make_kit(register)
    worker = start_worker(kit)
    running = SchedulerKeys(namespace).running("test.queued")
    rdb.set(running, "another-run", px=60_000)
    caplog.set_level(logging.INFO)
    kit.broker.actors["job:test.queued"].send(_firing())
    wait_for(lambda: any(m.startswith("run waiting: test.queued") for m in messages_of(caplog, "dramatiq_gp")))
    stopping = time.monotonic()
    worker.stop(10_000)
    assert time.monotonic() - stopping < 3  # the wait did not hold the drain to its timeout
    assert runs == []
    assert any(m.startswith("run put back: the worker is stopping") for m in messages_of(caplog, "dramatiq_gp"))
    # Back on its queue, due in a second: the next worker runs it once the entry is free.
    rdb.delete(running)
    start_worker(make_kit(register))
    wait_for(lambda: runs == ["ran"], timeout=10)


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (
            lambda s: s.job("nightly", "@daily", lambda: None, overlap="never"),
            "schedule entry 'nightly': overlap='never' is not one of 'allow', 'skip', 'wait'",
        ),
        (
            lambda s: s.job("nightly", "@daily", lambda: None, gp_overlap={"key": "x", "mode": "skip"}),
            "schedule entry 'nightly': give overlap=, not gp_overlap=",
        ),
        (
            lambda s: s.daily_at("03:00", _Nightly(), overlap="skip"),
            "schedule entry 'test.overlap.nightly': overlap= is for jobs: an event's listeners run as tasks of their "
            "own",
        ),
        (
            lambda s: gp.job("nightly", cron="@daily", overlap="sometimes")(lambda: None),
            "schedule entry 'nightly': overlap='sometimes' is not one of 'allow', 'skip', 'wait'",
        ),
    ],
    ids=["bad value", "raw option", "event entry", "module-level"],
)
def test_a_bad_overlap_is_refused_in_one_line_naming_the_entry(build, error):
    with pytest.raises(gp.ScheduleError) as refused:
        build(gp.Schedule())
    assert str(refused.value) == error


@gp.event("test.overlap.nightly")
@dataclass(frozen=True)
class _Nightly:
    pass


def test_the_entry_says_its_overlap_and_a_broker_without_the_guard_refuses_it(make_kit):
    schedule = gp.Schedule().job("a", "@daily", lambda: None).job("b", "@daily", lambda: None, overlap="wait")
    assert [entry.overlap for entry in schedule] == ["allow", "wait"]
    assert "gp_overlap" not in schedule.entries[0].options  # "allow" adds nothing to the messages
    with pytest.raises(gp.ScheduleError) as refused:
        schedule.check_options({"max_retries", "idempotent"})
    assert (
        str(refused.value)
        == "schedule entry 'b': overlap='wait' needs dramatiq_gp.OverlapGuard in the broker's middleware"
    )
    kit = make_kit(lambda registry, schedule: schedule.job("c", "@daily", lambda: None, overlap="skip"))
    assert kit.broker.actors["job:c"].options["gp_overlap"] == {"key": "c", "mode": "skip"}
