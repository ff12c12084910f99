"""The ``dramatiq-gp`` command: schedule preview, migrate status, status, help and errors."""

from __future__ import annotations

import json
import os
import socket
from datetime import datetime

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from dramatiq import Message

import dramatiq_gp as gp
from apps.app_events import OrderPlaced
from dramatiq_gp.cli import main
from helpers import wait_for


def run(*args: str) -> click.testing.Result:
    return CliRunner().invoke(main, list(args))


def test_schedule_next_previews_a_spec_in_a_zone():
    result = run("schedule", "next", "30 6 * * 1-5", "-n", "3", "--tz", "Europe/Budapest")
    assert result.exit_code == 0, result.output
    times = [datetime.fromisoformat(line) for line in result.output.splitlines()]
    assert len(times) == 3 and times == sorted(times)
    assert all((t.hour, t.minute, t.isoweekday() <= 5) == (6, 30, True) for t in times)
    assert all(t.utcoffset() is not None and t.utcoffset().total_seconds() in (3600, 7200) for t in times)


def test_schedule_next_finds_an_entry_a_worker_published(make_kit, clean_env, namespace):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    kit = make_kit(
        lambda registry, schedule: schedule.job("nightly_report", "0 3 * * *", lambda: None, tz="America/New_York"),
        env={"SCHEDULER_LEASE_TTL": "1500ms"},
    )
    kit.scheduler.start()
    try:
        result = run("schedule", "next", "nightly_report", "-n", "2")
    finally:
        kit.scheduler.stop()
    assert result.exit_code == 0, result.output
    times = [datetime.fromisoformat(line) for line in result.output.splitlines()]
    assert [(t.hour, t.minute) for t in times] == [(3, 0), (3, 0)]
    assert times[0].utcoffset().total_seconds() in (-5 * 3600, -4 * 3600)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["schedule", "next", "61 * * * *"], "cron spec '61 * * * *'"),
        (["schedule", "next", "0 3 * * *", "--tz", "Mars/Olympus"], "--tz 'Mars/Olympus' is not an IANA time zone"),
        (["schedule", "next", "no_such_entry"], "no schedule entry 'no_such_entry'"),
        (["outbox", "retry"], "give the event ids to retry, or --all"),
        (["migrate", "status"], "no database configured: set DB_URL"),
    ],
)
def test_errors_are_one_line_and_non_zero(clean_env, args, message):
    result = run(*args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_an_unreachable_redis_is_named_without_its_password(clean_env):
    clean_env.setenv("REDIS_URL", "redis://app:hunter2@127.0.0.1:1/0")
    result = run("status")
    assert result.exit_code == 1
    assert "Redis/Valkey unreachable at redis://app:***@127.0.0.1:1/0" in result.output
    assert "hunter2" not in result.output


def test_every_command_explains_itself_with_an_example():
    for args in (["migrate", "up"], ["migrate", "status"], ["outbox", "failed"], ["outbox", "retry"],
                 ["schedule", "next"], ["status"]):  # fmt: skip
        result = run(*args, "--help")
        assert result.exit_code == 0 and "Example" in result.output, args


def test_migrate_status_says_what_is_missing(clean_env, database_url):
    clean_env.setenv("DB_URL", database_url)
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {gp.outbox.TABLE_NAME}"))
    missing = run("migrate", "status")
    assert missing.exit_code == 1 and "is missing: run `dramatiq-gp migrate up`" in missing.output
    assert run("migrate", "up").exit_code == 0
    assert run("migrate", "status").exit_code == 0
    engine.dispose()


def test_status_reports_the_leader_the_outbox_backlog_and_the_queues(make_kit, engine, database_url, namespace):
    kit = make_kit(
        lambda registry, schedule: schedule.job("heartbeat", "@every 1h", lambda: None),
        env={
            "SCHEDULER_LEASE_TTL": "3s",
            "DB_URL": database_url,
            "OUTBOX_RELAY": "false",
            "VALKEY_NAMESPACE": namespace,
        },
    )
    with engine.begin() as conn:
        for n in range(3):
            gp.dispatch(conn, OrderPlaced(n))
    for n in range(2):
        kit.broker.enqueue(Message(queue_name="mail", actor_name="send", args=(n,), kwargs={}, options={}))
    kit.broker.enqueue(Message(queue_name="mail", actor_name="send", args=(9,), kwargs={}, options={}), delay=60_000)
    kit.scheduler.start()
    try:
        wait_for(lambda: kit.scheduler.lease.is_held(), timeout=10)
        result = run("status", "--json")
    finally:
        kit.scheduler.stop()
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    (scheduler,) = [s for s in report["schedulers"] if s["namespace"] == namespace]
    leader = scheduler["leader"]
    assert (leader["host"], leader["pid"]) == (socket.gethostname(), os.getpid())
    assert leader["epoch"] == kit.scheduler.lease.epoch
    assert [e["name"] for e in scheduler["entries"]] == ["heartbeat"]
    assert scheduler["entries"][0]["spec"] == "@every 1h"
    assert report["outbox"]["pending"] == 3 and report["outbox"]["set_aside"] == 0
    mail = next(q for q in report["queues"] if q["name"] == "mail")
    assert (mail["ready"], mail["in_flight"], mail["delayed"], mail["dead"]) == (2, 0, 1, 0)
