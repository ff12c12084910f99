"""Start-up and shutdown order, checked on a real ``dramatiq`` command, and how soon a stop ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dramatiq_gp as gp
from apps.app_events import Slow
from helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent


class Dramatiq:
    """A ``dramatiq tests.apps.lifecycle_app`` process whose log and trace we can read."""

    def __init__(
        self, tmp_path: Path, namespace: str, env: dict[str, str], processes: int = 1, args: tuple[str, ...] = ()
    ) -> None:
        self.trace_file = tmp_path / "trace.txt"
        self.log_file = tmp_path / "log.txt"
        self.trace_file.touch()
        full_env = {
            **os.environ,
            "GP_TEST_TRACE": str(self.trace_file),
            "GP_TEST_NAMESPACE": namespace,
            **env,
        }
        command = [
            sys.executable,
            "-m",
            "dramatiq",
            "tests.apps.lifecycle_app",
            "-p",
            str(processes),
            "-t",
            "2",
            *args,
        ]
        with open(self.log_file, "a") as log:
            # A session of its own: a test can signal its whole process group, as systemd does.
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def log(self) -> str:
        return self.log_file.read_text()

    @property
    def trace(self) -> list[str]:
        return self.trace_file.read_text().splitlines()

    def wait(self, timeout: float = 30) -> int:
        return self.process.wait(timeout)

    def worker_pid(self) -> int:
        """The pid of its one worker process."""
        found = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout.split()
        assert len(found) == 1, found
        return int(found[0])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie its parent has not reaped yet counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return True


#: The margin docs/lifecycle.md promises past WORKER_SHUTDOWN_TIMEOUT, from SIGTERM to the worker process's exit.
MARGIN_S = 0.5


def _stop_time(worker: Dramatiq, signum: signal.Signals = signal.SIGTERM, group: bool = False) -> float:
    """Seconds from ``signum`` (to the ``dramatiq`` parent, or to its process group) to its worker process's exit."""
    pid = worker.worker_pid()
    signalled = time.monotonic()
    if group:
        os.killpg(worker.process.pid, signum)
    else:
        worker.process.send_signal(signum)
    wait_for(lambda: _exited(pid), timeout=30, interval=0.002)
    took = time.monotonic() - signalled
    print(f"stop: {took:.3f} s from {signum.name} to the worker process's exit")
    return took


@pytest.fixture
def run_dramatiq(tmp_path: Path, namespace: str, clean_env) -> Iterator:
    started: list[Dramatiq] = []

    def run(env: dict[str, str] | None = None, processes: int = 1, args: tuple[str, ...] = ()) -> Dramatiq:
        started.append(Dramatiq(tmp_path, namespace, env or {}, processes, args))
        return started[-1]

    yield run
    for process in started:
        process.kill()


def _in_order(text: str, *fragments: str) -> None:
    positions = [text.find(fragment) for fragment in fragments]
    assert all(p >= 0 for p in positions), [f for f, p in zip(fragments, positions, strict=True) if p < 0]
    assert positions == sorted(positions), list(zip(fragments, positions, strict=True))


def _producer(make_kit) -> gp.Kit:
    return make_kit(lambda registry, schedule: registry.listen(Slow, lambda e: None, name="slow"))


def test_sigterm_drains_the_running_listener_then_runs_closers_lifo(run_dramatiq, make_kit):
    worker = run_dramatiq()
    wait_for(lambda: "start-up: consumers started" in worker.log, timeout=30)
    _producer(make_kit).dispatch(Slow(1.5))
    wait_for(lambda: worker.trace == ["listener started"])

    worker.process.send_signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert worker.trace == ["listener started", "listener finished", "closer second", "closer first"]
    _in_order(
        worker.log,
        "start-up: logging ready",
        "start-up: registered 1 listener(s) for 1 event type(s), 0 schedule entries",
        "start-up: broker reachable at ",
        "start-up: consumers started on default with 2 threads",
        "task started task_type=listener:test.app.slow:slow",
        "shutdown: draining in-flight tasks (up to 10m)",
        "task done task_type=listener:test.app.slow:slow",
        "shutdown: in-flight tasks drained",
        "shutdown: running closers",
        "shutdown: closed queue client",
        "closer 'broken' failed; running the rest",
        "shutdown: closed second",
        "shutdown: closed first",
        "shutdown: flushing telemetry",
    )
    for step in ("start-up: broker reachable", "shutdown: draining", "shutdown: running closers"):
        assert worker.log.count(step) == 1, step


def test_what_outlives_the_shutdown_timeout_goes_back_to_its_queue(run_dramatiq, make_kit, rdb, namespace):
    worker = run_dramatiq({"WORKER_SHUTDOWN_TIMEOUT": "500ms"})
    wait_for(lambda: "start-up: consumers started" in worker.log, timeout=30)
    _producer(make_kit).dispatch(Slow(30))
    wait_for(lambda: worker.trace == ["listener started"])

    worker.process.send_signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert worker.trace == ["listener started", "closer second", "closer first"]
    assert "shutdown: draining in-flight tasks (up to 500ms)" in worker.log
    assert "1 task(s) still running at the drain timeout went back to their queues" in worker.log
    # Back on the queue at once, not after the 60 s heartbeat timeout, and its claim freed.
    assert rdb.llen(f"{namespace}:default") == 1
    assert list(rdb.scan_iter(f"{namespace}:gp:done:*")) == []


@pytest.mark.usefixtures("broker")
def test_sigterm_to_exit_within_the_timeout_and_margin_and_the_cut_task_runs_once_elsewhere(run_dramatiq, make_kit):
    # WORKER_SHUTDOWN_TIMEOUT=1s and a 3 s task: the drain ends 1 s after the signal (not after the
    # command's next one-second check), the task goes back to its queue and the process exits at once.
    worker = run_dramatiq({"WORKER_SHUTDOWN_TIMEOUT": "1s"})
    wait_for(lambda: "start-up: consumers started" in worker.log, timeout=30)
    _producer(make_kit).dispatch(Slow(3))
    wait_for(lambda: worker.trace == ["listener started"])

    stopped_in = _stop_time(worker)
    assert 1.0 <= stopped_in < 1.0 + MARGIN_S, stopped_in
    assert worker.wait() == 0
    assert worker.trace == ["listener started", "closer second", "closer first"]  # cut, never finished here
    assert "1 task(s) still running at the drain timeout went back to their queues" in worker.log

    again = run_dramatiq()
    wait_for(lambda: "listener finished" in worker.trace, timeout=30)
    time.sleep(0.5)
    assert worker.trace.count("listener started") == 2 and worker.trace.count("listener finished") == 1
    again.process.send_signal(signal.SIGTERM)
    assert again.wait() == 0


def test_the_commands_own_shutdown_timeout_counts_from_the_signal_too(run_dramatiq, make_kit):
    worker = run_dramatiq(args=("--worker-shutdown-timeout", "700"))
    wait_for(lambda: "start-up: consumers started" in worker.log, timeout=30)
    _producer(make_kit).dispatch(Slow(3))
    wait_for(lambda: worker.trace == ["listener started"])

    stopped_in = _stop_time(worker)
    assert 0.7 <= stopped_in < 0.7 + MARGIN_S, stopped_in
    assert "shutdown: draining in-flight tasks (up to 700ms)" in worker.log


def test_a_sigterm_to_the_whole_process_group_drains_once_instead_of_killing(run_dramatiq, make_kit):
    # systemd (KillMode=control-group) and `kill -TERM -<pgid>` signal every process: the worker gets the
    # SIGTERM and the dramatiq parent's copy of it, which Dramatiq alone takes as a second signal: kill now.
    worker = run_dramatiq({"WORKER_SHUTDOWN_TIMEOUT": "10s"})
    wait_for(lambda: "start-up: consumers started" in worker.log, timeout=30)
    _producer(make_kit).dispatch(Slow(1))
    wait_for(lambda: worker.trace == ["listener started"])

    stopped_in = _stop_time(worker, group=True)
    assert worker.wait() == 0
    assert worker.trace == ["listener started", "listener finished", "closer second", "closer first"]
    assert stopped_in < 1.0 + MARGIN_S, stopped_in
    assert "Killing worker process" not in worker.log


def test_the_schedule_runner_and_the_relay_stop_beside_the_drain_within_the_same_bound(
    run_dramatiq, make_kit, database_url
):
    worker = run_dramatiq({"WORKER_SHUTDOWN_TIMEOUT": "1s", "GP_TEST_CRON": "0 0 1 1 *", "DB_URL": database_url})
    wait_for(lambda: "start-up: outbox relay started" in worker.log, timeout=30)
    wait_for(lambda: "leadership acquired" in worker.log, timeout=30)
    _producer(make_kit).dispatch(Slow(3))
    wait_for(lambda: worker.trace == ["listener started"])

    stopped_in = _stop_time(worker)
    assert 1.0 <= stopped_in < 1.0 + MARGIN_S, stopped_in
    assert worker.wait() == 0
    # Both stopped on threads of their own while the task drained, and before the closers.
    for producer in ("schedule runner", "outbox relay"):
        _in_order(
            worker.log, f"shutdown: stopping {producer}", f"shutdown: {producer} stopped", "shutdown: running closers"
        )
    _in_order(worker.log, "leadership released", "1 task(s) still running at the drain timeout went back")


def test_sigterm_drains_a_running_async_listener_too(run_dramatiq, make_kit):
    worker = run_dramatiq({"GP_TEST_ASYNC": "1"})
    wait_for(lambda: "start-up: consumers started" in worker.log, timeout=30)
    _producer(make_kit).dispatch(Slow(1.5))
    wait_for(lambda: worker.trace == ["listener started"])

    worker.process.send_signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert worker.trace == ["listener started", "listener finished", "closer second", "closer first"]
    _in_order(
        worker.log,
        "shutdown: draining in-flight tasks",
        "task done task_type=listener:test.app.slow:slow",
        "shutdown: in-flight tasks drained",
        "shutdown: running closers",
    )


def test_an_async_listener_outliving_the_shutdown_timeout_is_cancelled_put_back_and_runs_again_once(
    run_dramatiq, make_kit, rdb, namespace
):
    worker = run_dramatiq({"GP_TEST_ASYNC": "1", "WORKER_SHUTDOWN_TIMEOUT": "500ms"})
    wait_for(lambda: "start-up: consumers started" in worker.log, timeout=30)
    _producer(make_kit).dispatch(Slow(30))
    wait_for(lambda: worker.trace == ["listener started"])

    worker.process.send_signal(signal.SIGTERM)
    assert worker.wait() == 0
    # Cancelled after it was put back, and its clean-up ran before the closers.
    assert worker.trace == ["listener started", "listener cancelled", "closer second", "closer first"]
    _in_order(
        worker.log,
        "1 task(s) still running at the drain timeout went back to their queues",
        "shutdown: cancelled 1 coroutine(s) still running at the drain timeout",
        "shutdown: running closers",
    )
    # Its worker thread ends the attempt as put back, not as a failure.
    assert "task put back task_type=listener:test.app.slow:slow" in worker.log
    assert "task failed" not in worker.log and "Traceback" not in worker.log.split("this closer fails")[-1]
    assert rdb.llen(f"{namespace}:default") == 1
    assert list(rdb.scan_iter(f"{namespace}:gp:done:*")) == []

    again = run_dramatiq({"GP_TEST_ASYNC": "1"})
    wait_for(lambda: worker.trace.count("listener finished") == 1, timeout=30)
    wait_for(lambda: rdb.llen(f"{namespace}:default") == 0)
    again.process.send_signal(signal.SIGTERM)
    assert again.wait() == 0
    assert worker.trace.count("listener started") == 2  # the first attempt and the copy put back: once each
    assert "task done task_type=listener:test.app.slow:slow" in again.log


def test_redis_down_at_start_up_exits_non_zero_with_one_line_naming_the_address(run_dramatiq):
    worker = run_dramatiq({"REDIS_URL": "redis://127.0.0.1:1/0"}, processes=2)
    code = worker.wait(60)
    assert code == 3
    failures = [line for line in worker.log.splitlines() if "start-up failed" in line]
    # One line per worker process that got that far (the CLI stops the others once one exits).
    assert 1 <= len(failures) <= 2
    assert "Redis/Valkey unreachable at redis://127.0.0.1:1/0" in failures[0]
    assert "Traceback" not in worker.log


@pytest.mark.parametrize(
    ("env", "culprit"),
    [
        ({"WORKER_QUEUES": "default:x"}, "WORKER_QUEUES='default:x'"),
        ({"SCHEDULER_TIMEZONE": "Mars/Phobos"}, "SCHEDULER_TIMEZONE='Mars/Phobos'"),
        ({"GP_TEST_CRON": "61 * * * *"}, "'61 * * * *'"),
        ({"GP_TEST_EVENT_NAME": "shop:order"}, "event name 'shop:order'"),
        # Each of these three was a traceback from the library that first read it.
        ({"DB_URL": "mysql://u:hunter2@db/shop"}, "DB_URL='mysql://u:***@db/shop': the outbox needs PostgreSQL"),
        (
            {"BROKER_URL": "amqp://guest:guest@127.0.0.1:1/?password=hunter2"},
            "BROKER_URL='amqp://guest:***@127.0.0.1:1/?password=***' cannot be read: Unknown URL parameter: 'password'",
        ),
        (
            {"REDIS_URL": "redis://:hunter2@127.0.0.1:1/0?bogus=1"},
            "REDIS_URL='redis://:***@127.0.0.1:1/0?bogus=1' cannot be read: unknown URL parameter 'bogus'",
        ),
    ],
    ids=[
        "bad-variable",
        "bad-zone",
        "bad-cron-spec",
        "bad-event-at-import",
        "db-mysql",
        "amqp-password",
        "redis-param",
    ],
)
def test_a_deliberate_start_up_error_is_one_line_and_a_non_zero_exit(run_dramatiq, env, culprit):
    worker = run_dramatiq(env)
    assert worker.wait(60) == 2  # the dramatiq command's code for a module that failed to import
    lines = [line for line in worker.log.splitlines() if line.strip()]
    assert "Traceback" not in worker.log and "hunter2" not in worker.log
    (failure,) = [line for line in lines if "start-up failed" in line]
    assert "[ERROR]" in failure and culprit in failure, failure
    # Nothing else alarming but the dramatiq command's own line saying a worker process exited.
    alarms = [line for line in lines if any(level in line for level in ("[WARNING]", "[ERROR]", "[CRITICAL]"))]
    assert [line for line in alarms if line != failure and "[dramatiq.MainProcess]" not in line] == [], lines


@pytest.mark.usefixtures("broker")
def test_a_woken_consumer_ends_its_wait_for_messages_at_once(make_kit):
    # Dramatiq stops a consumer thread after the drain and waits for it to notice, which it does when
    # its wait for messages ends: up to worker_timeout later. Woken, the wait ends now.
    kit = _producer(make_kit)
    consumer = kit.broker.consume("default", prefetch=2, timeout=5_000)
    ended = threading.Event()

    def consume() -> None:
        with contextlib.suppress(StopIteration):
            while next(consumer) is None and not woken.is_set():
                pass
        ended.set()

    woken = threading.Event()
    thread = threading.Thread(target=consume)
    thread.start()
    try:
        time.sleep(2)  # idle long enough for Redis's polls to back off past a second
        assert not ended.is_set()
        woken_at = time.monotonic()
        woken.set()
        consumer.wake()
        assert ended.wait(5)
        assert time.monotonic() - woken_at < 0.3
    finally:
        woken.set()
        consumer.wake()
        thread.join(10)
        consumer.close()
