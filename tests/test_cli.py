"""The ``dramatiq-gp`` command: schedule preview, migrate status, status, help and errors."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from dramatiq import Message

import dramatiq_gp as gp
from apps.app_events import OrderPlaced
from dramatiq_gp.cli import main
from dramatiq_gp.outbox import OUTBOX_EVENTS
from helpers import BAD_SCHEDULER, publish_schedule, spoil_schedule, wait_for


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
    ("env", "args", "message"),
    [
        ({}, ["schedule", "next", "61 * * * *"], "cron spec '61 * * * *': minute value 61 is out of range 0-59"),
        ({}, ["schedule", "next", "0 3 * * *", "--tz", "Mars/Olympus"], "--tz 'Mars/Olympus' is not an IANA time zone"),
        ({}, ["schedule", "next", "no_such_entry"], "no schedule entry 'no_such_entry'"),
        ({}, ["outbox", "retry"], "give the event ids to retry, or --all"),
        ({}, ["outbox", "retry", "not-an-id"], "'not-an-id' is not an event id (a UUID"),
        ({}, ["outbox", "failed", "--limit", "x"], "Invalid value for '--limit': 'x' is not a valid integer."),
        ({}, ["statu"], "No such command 'statu'."),
        ({}, ["migrate", "status"], "no database configured: set DB_URL"),
        (
            {"DB_URL": "postgresql://app@127.0.0.1:1/app"},
            ["migrate", "status"],
            "database error at postgresql+psycopg://app@127.0.0.1:1/app: connection failed",
        ),
        (
            {"DB_URL": "postgresql://app@db/app", "DB_HOST": "db"},
            ["migrate", "status"],
            "invalid configuration: set either DB_URL or DB_HOST, not both",
        ),
        (
            {"VALKEY_TLS_CA_FILE": "/no/such/ca.pem"},
            ["status"],
            "invalid configuration: VALKEY_TLS_CA_FILE='/no/such/ca.pem': no such file",
        ),
    ],
)
def test_errors_are_one_line_and_non_zero(clean_env, env, args, message):
    for name, value in env.items():
        clean_env.setenv(name, value)
    # A process of its own: what a shell sees, log lines and warnings included.
    done = subprocess.run([sys.executable, "-m", "dramatiq_gp", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("Error: ") and message in line, line


def test_an_unreachable_redis_is_named_without_its_password(clean_env):
    clean_env.setenv("REDIS_URL", "redis://app:hunter2@127.0.0.1:1/0")
    result = run("status")
    assert result.exit_code == 1
    assert "Redis/Valkey unreachable at redis://app:***@127.0.0.1:1/0" in result.output
    assert "hunter2" not in result.output


def test_every_command_explains_itself_with_an_example():
    for args in (
        ["migrate", "up"],
        ["migrate", "status"],
        ["outbox", "failed"],
        ["outbox", "retry"],
        ["outbox", "replay"],
        ["outbox", "scheduled"],
        ["schedule", "next"],
        ["status"],
        ["dlq", "list"],
        ["dlq", "show"],
        ["dlq", "requeue"],
        ["dlq", "purge"],
    ):
        result = run(*args, "--help")
        assert result.exit_code == 0 and "Example" in result.output, args


def test_migrate_status_says_what_is_missing(clean_env, database_url):
    clean_env.setenv("DB_URL", database_url)
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {gp.outbox.TABLE_NAME}"))
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {gp.outbox.INBOX_TABLE_NAME}"))
    missing = run("migrate", "status")
    assert missing.exit_code == 1
    assert "outbox table 'outbox_events' is missing: run `dramatiq-gp migrate up`" in missing.output
    assert "inbox table 'inbox_messages' is missing: run `dramatiq-gp migrate up`" in missing.output
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
    assert scheduler["entries"][0]["trigger"] == "@every 1h"
    assert report["outbox"]["pending"] == 3 and report["outbox"]["set_aside"] == 0
    mail = next(q for q in report["queues"] if q["name"] == "mail")
    assert (mail["ready"], mail["in_flight"], mail["delayed"], mail["dead"]) == (2, 0, 1, 0)


def _set_aside(kit: gp.Kit, engine: sa.Engine, *order_ids: int) -> list[str]:
    """Outbox rows the relay sets aside at once (OUTBOX_MAX_ATTEMPTS=1): their event type is unknown here."""
    with engine.begin() as conn:
        ids = [gp.dispatch(conn, OrderPlaced(n)) for n in order_ids]
        conn.execute(sa.update(OUTBOX_EVENTS).where(OUTBOX_EVENTS.c.id.in_(ids)).values(event="test.cli.retired"))
    assert kit.relay.relay_once() == len(ids)
    return ids


def test_status_prints_one_line_per_scheduler_entry_outbox_and_queue(make_kit, engine, database_url, namespace, rdb):
    kit = make_kit(
        lambda registry, schedule: schedule.job("nightly", "0 3 * * *", lambda: None, tz="Europe/Budapest"),
        env={
            "SCHEDULER_LEASE_TTL": "3s",
            "DB_URL": database_url,
            "OUTBOX_MAX_ATTEMPTS": "1",
            "VALKEY_NAMESPACE": namespace,
        },
    )
    _set_aside(kit, engine, 1)
    with engine.begin() as conn:
        for n in range(2):
            gp.dispatch(conn, OrderPlaced(n))
        gp.dispatch(conn, OrderPlaced(2), delay=timedelta(hours=1))  # scheduled: not pending, no lag
    for n in range(2):
        kit.broker.enqueue(Message(queue_name="mail", actor_name="send", args=(n,), kwargs={}, options={}))
    kit.broker.enqueue(Message(queue_name="mail", actor_name="send", args=(9,), kwargs={}, options={}), delay=60_000)
    # The last tick that was due: a new leader has nothing to catch up, and "last" stays this.
    budapest = ZoneInfo("Europe/Budapest")
    last = datetime.now(budapest).replace(hour=3, minute=0, second=0, microsecond=0)
    if last > datetime.now(budapest):
        last -= timedelta(days=1)
    rdb.hset(f"{namespace}:scheduler:last_fired", "nightly", int(last.timestamp() * 1000))
    kit.scheduler.start()
    try:
        wait_for(lambda: kit.scheduler.lease.is_held(), timeout=10)
        result = run("status")
        asked = datetime.now(UTC)
    finally:
        kit.scheduler.stop()
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"scheduler {namespace}: ")))
    leader, entry = lines[start : start + 2]
    host, pid, epoch = socket.gethostname(), os.getpid(), kit.scheduler.lease.epoch
    prefix = f"scheduler {namespace}: leader {host} pid {pid} epoch {epoch}, lease until "
    assert leader.startswith(prefix), leader
    assert asked < datetime.fromisoformat(leader.removeprefix(prefix)) <= asked + timedelta(seconds=3)
    next_fire = last + timedelta(days=1)  # wall-clock arithmetic: 03:00 local whatever the offset
    # Both in the entry's zone: once, next was local and last UTC.
    assert entry == f"  nightly  0 3 * * * (Europe/Budapest)  next {next_fire.isoformat()}  last {last.isoformat()}"
    outbox = next(line for line in lines if line.startswith("outbox: "))
    assert re.fullmatch(r"outbox: 2 pending \(oldest \d+(\.\d+)? s\), 1 scheduled, 1 set aside", outbox), outbox
    assert [line for line in lines if line.startswith("queue ")] == [
        "queue mail: 2 ready, 0 in flight, 1 delayed, 0 dead"
    ]


def test_status_names_empty_queues_an_entry_never_fired_an_unknown_zone_and_no_oldest_when_nothing_waits(
    make_kit, engine, database_url, namespace, rdb
):
    kit = make_kit(
        lambda registry, schedule: schedule.job("yearly", "0 0 1 1 *", lambda: None),
        env={"SCHEDULER_LEASE_TTL": "3s", "DB_URL": database_url, "VALKEY_NAMESPACE": namespace},
    )
    rdb.sadd(f"{namespace}:gp:queues", "quiet")  # recorded by a worker's consumer, as the dashboard reads it
    other = f"{namespace}-other"  # another namespace's scheduler, published by a worker whose zones differ
    rdb.hset(f"{other}:scheduler:entries", "moon", "0 * * * *|Mars/Phobos")
    kit.scheduler.start()
    try:
        wait_for(lambda: kit.scheduler.lease.is_held(), timeout=10)
        result = run("status")
        report = json.loads(run("status", "--json").stdout)
    finally:
        kit.scheduler.stop()
        rdb.delete(f"{other}:scheduler:entries")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "queue quiet: 0 ready, 0 in flight, 0 delayed, 0 dead" in lines
    (yearly,) = [line for line in lines if line.startswith("  yearly ")]
    assert yearly.endswith("  last never"), yearly  # not the time the leader took over
    assert [e["last_fired"] for s in report["schedulers"] for e in s["entries"] if e["name"] == "yearly"] == [None]
    (moon,) = [line for line in lines if line.startswith("  moon ")]
    assert "(Mars/Phobos (unknown here: times in UTC))" in moon and "+00:00" in moon
    assert "outbox: 0 pending, 0 scheduled, 0 set aside" in lines  # not "oldest None s"


def test_dlq_list_without_a_queue_lists_every_queues_dead_letters(make_kit, rdb, namespace):
    make_kit(env={"VALKEY_NAMESPACE": namespace})
    assert run("dlq", "list").stdout == "no dead letters in any queue\n"
    for queue in ("alpha", "beta"):  # a dead letter as Dramatiq's Redis broker keeps one
        message = Message(
            queue_name=queue, actor_name="send", args=(), kwargs={}, options={"redis_message_id": f"{queue}-1"}
        )
        rdb.zadd(f"{namespace}:{queue}.XQ", {f"{queue}-1": 1_700_000_000_000})
        rdb.hset(f"{namespace}:{queue}.XQ.msgs", f"{queue}-1", message.encode())
        rdb.sadd(f"{namespace}:gp:queues", queue)
    result = run("dlq", "list")
    assert result.exit_code == 0, result.output
    headers = [line for line in result.stdout.splitlines() if line.startswith("queue ")]
    assert headers == ["queue alpha: 1 dead letter(s)", "queue beta: 1 dead letter(s)"]


def test_outbox_failed_json_prints_each_set_aside_event_as_one_object_per_line(make_kit, engine, database_url):
    kit = make_kit(env={"DB_URL": database_url, "OUTBOX_MAX_ATTEMPTS": "1"})
    set_aside = _set_aside(kit, engine, 7, 8)
    with engine.begin() as conn:
        gp.dispatch(conn, OrderPlaced(9))  # pending: not listed
    result = run("outbox", "failed", "--json")
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(e["id"] for e in events) == sorted(set_aside)
    for event in events:
        assert event["event"] == "test.cli.retired"
        assert event["attempts"] == 1
        assert event["last_error"] == "event type 'test.cli.retired' is unknown here (no class declares it)"
        assert event["payload"]["order_id"] in (7, 8)
        assert datetime.fromisoformat(event["created_at"]) <= datetime.fromisoformat(event["failed_at"])


def test_outbox_scheduled_lists_the_delayed_events_not_yet_due_soonest_first(make_kit, engine, database_url):
    make_kit(env={"DB_URL": database_url})
    with engine.begin() as conn:
        later = gp.dispatch(conn, OrderPlaced(1), delay=timedelta(days=2))
        sooner = gp.dispatch(conn, OrderPlaced(2), at=datetime.now(UTC) + timedelta(hours=1))
        gp.dispatch(conn, OrderPlaced(3))  # pending: not listed
        gp.dispatch(conn, OrderPlaced(4), at=datetime.now(UTC) - timedelta(hours=1))  # due: pending
    result = run("outbox", "scheduled", "--json")
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["id"] for e in events] == [sooner, later]
    assert set(events[0]) == {"id", "event", "created_at", "not_before"}  # never the payload
    due = datetime.fromisoformat(events[1]["not_before"]) - datetime.fromisoformat(events[1]["created_at"])
    assert timedelta(days=2) - timedelta(seconds=5) < due < timedelta(days=2) + timedelta(seconds=5)
    text = run("outbox", "scheduled", "--limit", "1").stdout.splitlines()
    assert len(text) == 1 and text[0].startswith(f"{sooner}  test.telemetry.order_placed  due=")


def test_outbox_retry_by_id_makes_just_that_event_pending_again(make_kit, engine, database_url):
    kit = make_kit(env={"DB_URL": database_url, "OUTBOX_MAX_ATTEMPTS": "1"})
    again, left = _set_aside(kit, engine, 1, 2)
    result = run("outbox", "retry", again)
    assert result.exit_code == 0, result.output
    assert result.stdout == "1 event(s) pending again\n"
    with engine.connect() as conn:
        rows = {str(row.id): row for row in conn.execute(sa.select(OUTBOX_EVENTS))}
    assert (rows[again].failed_at, rows[again].attempts, rows[again].last_error) == (None, 0, None)
    assert rows[left].failed_at is not None
    assert [json.loads(line)["id"] for line in run("outbox", "failed", "--json").stdout.splitlines()] == [left]
    # The relay picks it up again (and, its type still unknown, sets it aside again).
    assert kit.relay.relay_once() == 1
    assert run("outbox", "retry", "0b6c1f0e-4c5d-4d4e-9a53-2f1b2c3d4e5f").stdout == "0 event(s) pending again\n"


def test_outbox_replay_makes_one_set_aside_event_pending_again(make_kit, engine, database_url):
    kit = make_kit(env={"DB_URL": database_url, "OUTBOX_MAX_ATTEMPTS": "1"})
    again, left = _set_aside(kit, engine, 1, 2)
    result = run("outbox", "replay", again)
    assert (result.exit_code, result.stdout) == (0, f"event {again} pending again\n")
    assert [json.loads(line)["id"] for line in run("outbox", "failed", "--json").stdout.splitlines()] == [left]
    missing = run("outbox", "replay", again)  # pending now: not set aside
    assert (missing.exit_code, missing.output) == (1, f"Error: no set-aside event {again}\n")


def test_status_marks_a_queue_name_that_is_not_utf8_and_counts_the_others(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    rdb.sadd(f"{namespace}:gp:queues", "mail", b"caf\xe9")
    rdb.rpush(f"{namespace}:mail", "m1")
    rdb.hset(f"{namespace}:mail.msgs", "m1", "{}")
    garbled = f"{namespace}:gr\xfcn.XQ.msgs".encode("latin-1")  # found by scanning: a key no worker wrote
    rdb.hset(garbled, "x", "{}")

    def command(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "dramatiq_gp", *args], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        return done

    try:
        lines, report = command("status").stdout.splitlines(), json.loads(command("status", "--json").stdout)
        assert command("dlq", "list").stdout == "no dead letters in any queue\n"
    finally:
        rdb.delete(garbled)  # before the namespace's clean-up, whose client cannot decode its name
    assert "queue mail: 1 ready, 0 in flight, 0 delayed, 0 dead" in lines
    assert "queue (unreadable: name not UTF-8: b'caf\\xe9'): not counted" in lines
    assert "queue (unreadable: name not UTF-8: b'gr\\xfcn'): not counted" in lines
    queues = {q["name"]: q for q in report["queues"]}
    assert queues["(unreadable: name not UTF-8: b'caf\\xe9')"] == {
        "name": "(unreadable: name not UTF-8: b'caf\\xe9')",
        "ready": None,
        "in_flight": None,
        "delayed": None,
        "dead": None,
    }
    assert queues["mail"]["ready"] == 1


def _clean_run(*args: str) -> str:
    """What ``dramatiq-gp`` prints in a process of its own, which must exit 0 and print nothing on stderr."""
    done = subprocess.run([sys.executable, "-m", "dramatiq_gp", *args], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    return done.stdout


@pytest.mark.parametrize("case", BAD_SCHEDULER)
def test_status_marks_what_it_cannot_read_of_a_scheduler_and_shows_the_rest(case, clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    shown = spoil_schedule(rdb, publish_schedule(rdb, namespace), case)
    lines, report = _clean_run("status").splitlines(), json.loads(_clean_run("status", "--json"))
    (scheduler,) = [s for s in report["schedulers"] if s["namespace"] == namespace]
    assert json.dumps(shown, ensure_ascii=False)[1:-1] in json.dumps(scheduler, ensure_ascii=False)
    assert [e["name"] for e in scheduler["entries"]] == ["good", "odd"]
    if BAD_SCHEDULER[case][0] != "catchup":  # the text leaves the catch-up policy out
        assert any(shown in line for line in lines), lines
    assert any(line.startswith(f"scheduler {namespace}: leader lead-h") and " epoch 7" in line for line in lines)
    assert any(line.startswith("  good  0 3 * * * (UTC)  next ") for line in lines), lines


def test_status_marks_a_skipped_task_type_not_utf8_or_its_count_not_a_number_and_counts_the_others(
    clean_env, namespace, rdb
):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    rdb.hset(f"{namespace}:gp:skipped", mapping={"gone": 3, b"caf\xe9": 1, "odd": "abc"})
    lines, report = _clean_run("status").splitlines(), json.loads(_clean_run("status", "--json"))
    garbled = "(unreadable: name not UTF-8: b'caf\\xe9')"
    assert report["skipped_task_types"] == {garbled: 1, "gone": 3, "odd": "(unreadable: count='abc')"}
    assert f"skipped (no handler, kept as dead letters): {garbled}: 1" in lines
    assert "skipped (no handler, kept as dead letters): gone: 3" in lines
