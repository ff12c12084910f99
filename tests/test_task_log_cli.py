"""The task log through the real ``dramatiq`` command: each worker process writes its lines itself.

Dramatiq's CLI relays every line of its worker processes through a pipe to the
parent (``dramatiq.compat.StreamablePipe``); the kit replaces that stream, in each
worker process, with :class:`dramatiq_gp.telemetry.DirectStream` on the command's
log destination (``--log-file``, or the stderr it inherited), found through the
``args`` of Dramatiq's ``cli.worker_process``. These run real commands.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

from dramatiq_gp.middleware.lifecycle import DUPLICATE_SIGNAL_S
from helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent


class Command:
    """``dramatiq tests.apps.log_app -p 1 -t 4 ...``, its own output (stdout and stderr) in ``output``."""

    def __init__(self, env: dict[str, str], *args: str, output: Path | int) -> None:
        command = [sys.executable, "-m", "dramatiq", "tests.apps.log_app", "-p", "1", "-t", "4", *args]
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(open(output, "w")) if isinstance(output, Path) else output
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self, *, twice: bool = False, timeout: float = 30) -> int:
        self.process.send_signal(signal.SIGTERM)
        if twice:
            time.sleep(DUPLICATE_SIGNAL_S + 0.2)  # sooner, the kit takes it for the same stop delivered twice
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def env(clean_env: pytest.MonkeyPatch, redis_url: str, namespace: str) -> dict[str, str]:
    return {"REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace}


@pytest.fixture
def start(tmp_path: Path, env: dict[str, str]) -> Iterator[Any]:
    commands: list[Command] = []

    def run(*args: str, output: int | None = None, **more: str) -> Command:
        command = Command({**env, **more}, *args, output=tmp_path / "output.txt" if output is None else output)
        commands.append(command)
        return command

    yield run
    for command in commands:
        command.kill()


@pytest.fixture
def send(redis_url: str, namespace: str) -> Iterator[Any]:
    broker = RedisBroker(url=redis_url, namespace=namespace)

    def send(actor: str, *args: Any) -> str:
        message = Message(queue_name="default", actor_name=actor, args=args, kwargs={}, options={})
        return str(broker.enqueue(message).message_id)

    yield send
    broker.close()


def _count(redis_url: str, namespace: str, name: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.get(f"{namespace}:test:{name}") or 0)
    finally:
        client.close()


def _started(path: Path) -> bool:
    return path.exists() and "consumers started" in path.read_text()


def test_the_worker_writes_its_lines_to_the_log_file_itself_and_every_one_is_there_after_sigterm(
    start, send, tmp_path, redis_url, namespace
):
    log = tmp_path / "dramatiq.log"
    command = start("--log-file", str(log))
    wait_for(lambda: _started(log), timeout=30)
    send("says", 10)
    ids = [send("quick", n) for n in range(200)]
    wait_for(lambda: _count(redis_url, namespace, "quick") == 200, timeout=30)
    assert command.stop() == 0  # at once: the last lines are still queued in the worker

    text = log.read_text()
    assert "root handler writes to DirectStream" in text
    for message_id in ids:
        assert f"task started task_type=quick task_id={message_id} attempt=1" in text
        assert re.search(f"task done task_type=quick task_id={message_id} attempt=1 duration_ms=", text)
    # The parent's lines still come through the CLI's pipe, into the same file; every line is whole.
    assert "Dramatiq '" in text and "is booting up" in text
    assert "Worker has been shut down." in text
    lines = text.splitlines()
    assert all(line.startswith("[") for line in lines), [line for line in lines if not line.startswith("[")][:3]


def test_a_task_that_ends_during_the_graceful_stop_is_logged(start, send, tmp_path, redis_url, namespace):
    log = tmp_path / "dramatiq.log"
    command = start("--log-file", str(log))
    wait_for(lambda: _started(log), timeout=30)
    message_id = send("sleepy", 1.0)
    wait_for(lambda: _count(redis_url, namespace, "sleepy") == 1)
    assert command.stop() == 0
    assert re.search(f"task done task_type=sleepy task_id={message_id} attempt=1 duration_ms=", log.read_text())


def test_a_second_sigterm_still_writes_the_queued_lines(start, send, tmp_path, redis_url, namespace):
    log = tmp_path / "dramatiq.log"
    command = start("--log-file", str(log), GP_TEST_LOG_HOLD_S="60")  # nothing written but by the exit
    ids = [send("quick", n) for n in range(20)]
    wait_for(lambda: _count(redis_url, namespace, "quick") == 20, timeout=30)
    send("sleepy", 30.0)
    wait_for(lambda: _count(redis_url, namespace, "sleepy") == 1)
    assert "task done task_type=quick" not in log.read_text()  # held, as the test asked
    command.stop(twice=True)
    text = log.read_text()
    assert "Killing worker process" in text
    for message_id in ids:
        assert f"task done task_type=quick task_id={message_id}" in text


def test_a_failure_is_written_at_once_with_its_trace_id_and_the_lines_before_it(
    start, send, tmp_path, collector, redis_url, namespace
):
    log = tmp_path / "dramatiq.log"
    start("--log-file", str(log), GP_TEST_LOG_HOLD_S="60", OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint)
    quick_id = send("quick", 1)
    wait_for(lambda: _count(redis_url, namespace, "quick") == 1, timeout=30)
    failed_id = send("fails", "now")
    failed = f"task failed task_type=fails task_id={failed_id}"
    line = wait_for(
        lambda: next((x for x in log.read_text().splitlines() if failed in x), None),
        timeout=5,  # not the 60 s the INFO lines are held
    )
    assert "[ERROR]" in line and "will_retry=False" in line and "failed on purpose: now" in line
    assert re.search(r" trace_id=[0-9a-f]{32} span_id=[0-9a-f]{16}", line)
    text = log.read_text()
    assert text.index(f"task done task_type=quick task_id={quick_id}") < text.index(line)  # in order


def test_log_level_warn_silences_the_task_lines_through_the_command(start, send, tmp_path, redis_url, namespace):
    log = tmp_path / "dramatiq.log"
    command = start("--log-file", str(log), LOG_LEVEL="WARN")
    wait_for(lambda: log.exists() and "Dramatiq '" in log.read_text(), timeout=30)
    wait_for(lambda: _count(redis_url, namespace, "quick") == 0 and send("quick", 1))
    failed_id = send("fails", "quiet")
    wait_for(lambda: f"task failed task_type=fails task_id={failed_id}" in log.read_text(), timeout=30)
    assert _count(redis_url, namespace, "quick") == 1
    assert command.stop() == 0
    text = log.read_text()
    assert "task started" not in text and "task done" not in text


def test_without_a_log_file_the_worker_writes_to_the_stderr_it_inherited(start, send, tmp_path, redis_url, namespace):
    output = tmp_path / "output.txt"
    command = start()
    wait_for(lambda: _started(output), timeout=30)
    send("says", 10)
    message_id = send("quick", 1)
    wait_for(lambda: _count(redis_url, namespace, "quick") == 1)
    assert command.stop() == 0
    text = output.read_text()
    assert "root handler writes to DirectStream" in text
    assert f"task done task_type=quick task_id={message_id}" in text


def test_to_a_pipe_lines_stay_whole_and_a_line_longer_than_pipe_buf_goes_through_the_cli(
    start, send, redis_url, namespace
):
    read, write = os.pipe()
    command = start(output=write)
    os.close(write)
    received = bytearray()

    def drain() -> None:  # as a log collector reads a container's output: all along, so the pipe never fills
        while chunk := os.read(read, 65536):
            received.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    wait_for(lambda: b"consumers started" in received, timeout=30)
    send("says", 10_000)
    ids = [send("quick", n) for n in range(300)]
    wait_for(lambda: _count(redis_url, namespace, "quick") == 300, timeout=30)
    assert command.stop() == 0
    reader.join(10)
    os.close(read)
    text = received.decode()
    assert "root handler writes to DirectStream" in text
    assert "long line " + "x" * 10_000 + " end" in text
    lines = text.splitlines()
    assert all(line.startswith("[") for line in lines), [line[:80] for line in lines if not line.startswith("[")][:3]
    assert all(f"task done task_type=quick task_id={message_id}" in text for message_id in ids)


def test_a_process_forked_by_a_task_writes_its_own_lines_once_and_not_the_workers_again(
    start, send, tmp_path, redis_url, namespace
):
    log = tmp_path / "dramatiq.log"
    command = start("--log-file", str(log), GP_TEST_LOG_HOLD_S="60")  # the worker's lines wait, queued, at the fork
    ids = [send("quick", n) for n in range(10)]
    wait_for(lambda: _count(redis_url, namespace, "quick") == 10, timeout=30)
    send("forks")
    wait_for(lambda: _count(redis_url, namespace, "forks") == 1, timeout=30)
    assert "a line from a forked child" in log.read_text()  # the child's exit wrote it
    assert command.stop() == 0
    text = log.read_text()
    assert text.count("a line from a forked child") == 1
    for message_id in ids:
        assert text.count(f"task done task_type=quick task_id={message_id}") == 1
