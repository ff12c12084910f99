"""Per-task log lines: started, done, failed, through stdlib logging, at Dramatiq's levels."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import dramatiq
import pytest
import redis
from dramatiq.rate_limits import RateLimitExceeded

import dramatiq_gp as gp
from helpers import wait_for

pytestmark = pytest.mark.usefixtures("broker")  # each test on Redis and on RabbitMQ


@gp.event("test.tasklog.job")
@dataclass(frozen=True)
class Job:
    fail: bool


def _records(caplog, logger="dramatiq_gp.tasks"):
    return [r for r in caplog.records if r.name == logger]


def _failing_after(n: int):
    calls: list[int] = []

    def handler(event: Job) -> None:
        calls.append(1)
        if event.fail and len(calls) <= n:
            raise RuntimeError("boom")

    return handler, calls


def test_a_task_logs_started_and_done_with_its_fields(make_kit, start_worker, caplog):
    caplog.set_level(logging.INFO)
    kit = make_kit(lambda registry, schedule: registry.listen(Job, lambda e: None, name="ok"))
    start_worker(kit)
    envelope_id = kit.dispatch(Job(fail=False))
    wait_for(lambda: len(_records(caplog)) == 2)
    started, done = _records(caplog)
    (task_id,) = [m.message_id for m in kit.registry.fan_out(Job(False), envelope_id)]
    assert started.levelno == logging.INFO
    assert started.getMessage() == f"task started task_type=listener:test.tasklog.job:ok task_id={task_id} attempt=1"
    assert (started.task_type, started.task_id, started.attempt) == (
        "listener:test.tasklog.job:ok",
        task_id,
        1,
    )
    assert done.getMessage().startswith(f"task done task_type=listener:test.tasklog.job:ok task_id={task_id} attempt=1")
    assert done.duration_ms >= 0


def test_the_started_and_done_records_are_those_logger_info_would_make(make_kit, start_worker, caplog):
    # The two lines are copied from a template record (cheaper than Logger.info): field for field
    # the same, but for the time and the thread, which are the worker thread's own.
    caplog.set_level(logging.INFO)
    kit = make_kit(lambda registry, schedule: registry.listen(Job, lambda e: None, name="ok"))
    start_worker(kit)
    kit.dispatch(Job(fail=False))
    wait_for(lambda: len(_records(caplog)) == 2)
    logger = logging.getLogger("dramatiq_gp.tasks")
    # The record's own, and those a formatter added ("message", "asctime") when a handler wrote it.
    own = {"created", "msecs", "relativeCreated", "thread", "threadName", "message", "asctime"}
    workers = {t.ident: t.name for t in threading.enumerate()}
    for record in _records(caplog):
        fields = {k: v for k, v in vars(record).items() if k in ("task_type", "task_id", "attempt", "duration_ms")}
        path, line, function, _ = logger.findCaller()
        made = logger.makeRecord(
            logger.name, record.levelno, path, line, record.msg, record.args, None, function, fields
        )
        assert {k: v for k, v in vars(record).items() if k not in own} == {
            k: v for k, v in vars(made).items() if k not in own
        }
        assert workers[record.thread] == record.threadName != threading.current_thread().name
        assert abs(record.created - made.created) < 30
        assert record.msecs == int((record.created - int(record.created)) * 1000)
        assert abs((record.relativeCreated - made.relativeCreated) - (record.created - made.created) * 1000) < 1


def test_a_replaced_record_factory_makes_every_task_line(make_kit, start_worker, caplog):
    caplog.set_level(logging.INFO)
    default = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = default(*args, **kwargs)
        record.made_by = "factory"
        return record

    logging.setLogRecordFactory(factory)
    try:
        kit = make_kit(lambda registry, schedule: registry.listen(Job, lambda e: None, name="ok"))
        start_worker(kit)
        kit.dispatch(Job(fail=False))
        wait_for(lambda: len(_records(caplog)) == 2)
    finally:
        logging.setLogRecordFactory(default)
    assert [getattr(r, "made_by", None) for r in _records(caplog)] == ["factory", "factory"]


def test_failures_log_an_error_saying_whether_they_will_be_retried(make_kit, start_worker, caplog):
    caplog.set_level(logging.INFO)
    handler, _ = _failing_after(10)
    kit = make_kit(
        lambda registry, schedule: registry.listen(Job, handler, name="bad", max_retries=1),
        env={"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"},
    )
    start_worker(kit)
    kit.dispatch(Job(fail=True))
    wait_for(lambda: len([r for r in _records(caplog) if r.levelno == logging.ERROR]) == 2)
    first, last = [r for r in _records(caplog) if r.levelno == logging.ERROR]
    assert (first.attempt, first.will_retry, first.error) == (1, True, "RuntimeError: boom")
    assert (last.attempt, last.will_retry) == (2, False)
    assert "will_retry=False error=RuntimeError: boom" in last.getMessage()
    assert last.exc_info is not None and last.exc_info[0] is RuntimeError
    # Dramatiq's own per-attempt error line, and its retry lines, are replaced by ours, not doubled.
    replaced = ("Failed to process message", "Retrying message", "Retries exceeded")
    assert not [r for r in caplog.records if r.getMessage().startswith(replaced)]


def test_log_level_warn_silences_the_per_task_info_lines(make_kit, start_worker, caplog):
    caplog.set_level(logging.INFO)
    handler, calls = _failing_after(1)
    kit = make_kit(
        lambda registry, schedule: registry.listen(Job, handler, name="quiet"),
        env={"LOG_LEVEL": "WARN", "WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"},
    )
    worker = start_worker(kit)
    kit.dispatch(Job(fail=True))
    wait_for(lambda: len(calls) == 2)
    worker.join()  # the second attempt processed, its lines logged (or not), and acked
    levels = [r.levelno for r in _records(caplog)]
    assert levels == [logging.ERROR]


class Expected(Exception):
    pass


def test_dramatiq_levels_an_expected_exception_at_info_and_a_rate_limit_miss_at_debug(make_kit, start_worker, caplog):
    caplog.set_level(logging.DEBUG)
    kit = make_kit(env={"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"})
    attempts: list[str] = []

    @dramatiq.actor(broker=kit.broker, throws=Expected)
    def expected() -> None:
        attempts.append("expected")
        raise Expected("as planned")

    @dramatiq.actor(broker=kit.broker, max_retries=1)
    def limited() -> None:
        attempts.append("limited")
        raise RateLimitExceeded("no slot")

    start_worker(kit)
    expected.send()
    limited.send()
    wait_for(lambda: len([r for r in _records(caplog) if r.getMessage().startswith("task failed")]) == 3)
    kit.broker.join("default", timeout=10_000)
    assert sorted(attempts) == ["expected", "limited", "limited"]  # the expected one is not retried

    failed = {r.task_type: r for r in _records(caplog) if r.getMessage().startswith("task failed task_type=expected")}
    (line,) = failed.values()
    assert line.levelno == logging.INFO and line.exc_info is None
    assert (line.expected, line.will_retry) == (True, False)
    assert "will_retry=False expected=True error=Expected: as planned" in line.getMessage()
    misses = [r for r in _records(caplog) if r.getMessage().startswith("task failed task_type=limited")]
    assert [(r.levelno, r.will_retry, r.exc_info) for r in misses] == [
        (logging.DEBUG, True, None),
        (logging.DEBUG, False, None),
    ]
    # Nothing at ERROR, and Dramatiq's own lines for both (which print the message's arguments) are replaced.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert not [r for r in caplog.records if r.getMessage().startswith(("Failed to process", "Rate limit exceeded"))]


def test_a_huge_exception_message_is_capped_in_the_line_and_its_traceback(make_kit, start_worker, caplog):
    # A 10 MB exception message once made two 10 MB log lines.
    from dramatiq_gp.telemetry import MAX_ERROR_CHARS, MAX_TRACEBACK_CHARS, TextFormatter, json_formatter

    def huge(event: Job) -> None:
        raise RuntimeError("start " + "x" * 10_000_000 + " end")

    caplog.set_level(logging.INFO)
    kit = make_kit(lambda registry, schedule: registry.listen(Job, huge, name="huge", max_retries=0))
    start_worker(kit)
    kit.dispatch(Job(fail=True))
    wait_for(lambda: [r for r in _records(caplog) if r.levelno == logging.ERROR])
    (failed,) = [r for r in _records(caplog) if r.levelno == logging.ERROR]
    assert failed.error.startswith("RuntimeError: start x") and failed.error.endswith("x end")
    assert "characters cut" in failed.error and len(failed.error) < MAX_ERROR_CHARS + 100
    for formatter in (TextFormatter(), json_formatter()):
        line = formatter.format(failed)
        assert len(line) < 2 * MAX_ERROR_CHARS + MAX_TRACEBACK_CHARS + 1_000, len(line)  # JSON: message and field
        assert "RuntimeError" in line and "characters cut" in line


def test_a_server_out_of_reach_is_one_warning_per_episode_without_a_traceback(make_kit, start_worker, caplog):
    """A node's failure made every fan-out in flight fail with an ERROR and a traceback, sixteen per failure."""
    caplog.set_level(logging.INFO)
    down = threading.Event()

    def handler(event: Job) -> None:
        if down.is_set():
            redis.Redis(port=1, socket_connect_timeout=1).ping()  # a server out of reach, for real

    kit = make_kit(
        lambda registry, schedule: registry.listen(Job, handler, name="sends", max_retries=50),
        env={"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"},
    )
    start_worker(kit)

    def failures() -> list[logging.LogRecord]:
        return [r for r in _records(caplog) if r.getMessage().startswith("task failed")]

    def done() -> int:
        return sum(r.getMessage().startswith("task done") for r in _records(caplog))

    for episode in range(2):
        down.set()
        before = len(failures())
        kit.dispatch(Job(fail=True))
        kit.dispatch(Job(fail=True))
        wait_for(lambda before=before: len(failures()) >= before + 3)
        # Taken while every attempt fails: once one succeeds, the next failure starts an episode.
        levels = [r.levelno for r in failures()[before:]]
        finished = done()
        down.clear()
        wait_for(lambda finished=finished: done() == finished + 2)
        assert levels[0] == logging.WARNING and set(levels[1:]) == {logging.INFO}, (episode, levels)
    assert all(r.exc_info is None and r.will_retry for r in failures())
    assert "error=ConnectionError: Error 111 connecting to localhost:1" in failures()[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
