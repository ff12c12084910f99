"""Run now and backfill (``dramatiq-gp schedule run|backfill``, the dashboard's Run now), against real workers.

The workers are ``dramatiq tests.apps.manual_app`` replicas: an ``@every 1s`` job and an
hourly event, each run recorded in Redis with the message id it ran under.
"""

from __future__ import annotations

import html
import json
import logging
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from click.testing import CliRunner, Result
from test_dashboard import Browser

from apps.replica import Replica
from devtools.asgi import serving
from dramatiq_gp import actions, keys
from dramatiq_gp.brokers.kinds import broker_for
from dramatiq_gp.cli import main
from dramatiq_gp.dashboard import create_app
from dramatiq_gp.names import tick_message_id
from dramatiq_gp.scheduler import manual
from dramatiq_gp.settings import Settings
from helpers import wait_for

EVERY, REPORT = "test.every", "test.report"
RUN_LINE = re.compile(r"^entry (\S+) run now: message (\S+) enqueued on queue (\S+)$", re.M)


def cli(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=input)


def runs(rdb, namespace: str, entry: str | None = None) -> list[dict]:
    recorded = [json.loads(raw) for raw in rdb.lrange(f"{namespace}:test:runs", 0, -1)]
    return [run for run in recorded if entry is None or run["entry"] == entry]


def ticks_ran(rdb, namespace: str) -> list[datetime]:
    """The ticks of test.every that ran (a run by hand's time is no whole second: left out)."""
    return [
        datetime.fromisoformat(run["scheduled_at"])
        for run in runs(rdb, namespace, EVERY)
        if run["message_id"] == tick_message_id(EVERY, datetime.fromisoformat(run["scheduled_at"]))
    ]


@pytest.fixture
def worker(tmp_path: Path, clean_env, namespace):
    """A replica of manual_app on this test's namespace (and the broker the environment names), started."""
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    env = {"VALKEY_NAMESPACE": namespace, "GP_TEST_QUEUE": f"q-{namespace}"}
    replica = Replica("tests.apps.manual_app", env, tmp_path / "worker.log")
    try:
        wait_for(replica.started, timeout=30)
        yield replica
    finally:
        replica.kill()


@pytest.mark.usefixtures("broker")
def test_run_now_enqueues_one_run_with_an_id_of_its_own_that_a_worker_runs_while_the_ticks_go_on(
    worker, rdb, namespace
):
    wait_for(lambda: len(ticks_ran(rdb, namespace)) >= 2, timeout=20)
    asked_at = datetime.now(UTC)
    done = cli("schedule", "run", EVERY)
    assert done.exit_code == 0, done.output
    entry, run_id, queue = RUN_LINE.search(done.output).groups()
    assert (entry, queue) == (EVERY, f"q-{namespace}")

    (run,) = wait_for(lambda: [r for r in runs(rdb, namespace, EVERY) if r["message_id"] == run_id], timeout=15)
    scheduled_at = datetime.fromisoformat(run["scheduled_at"])
    assert abs(scheduled_at - asked_at) < timedelta(seconds=2)  # its time is the request's
    # Its id is its own: neither the id of the time it carries as a tick, nor any tick's that ran.
    assert run_id != tick_message_id(EVERY, scheduled_at)
    assert run_id not in {tick_message_id(EVERY, tick) for tick in ticks_ran(rdb, namespace)}
    # The ticks go on, each under its tick's id, and the run by hand ran once.
    wait_for(lambda: max(ticks_ran(rdb, namespace)) > scheduled_at + timedelta(seconds=1), timeout=10)
    assert [r["message_id"] for r in runs(rdb, namespace, EVERY)].count(run_id) == 1

    # An event entry: the listeners get an envelope whose id is the run's.
    done = cli("schedule", "run", REPORT)
    assert done.exit_code == 0, done.output
    _, report_id, _ = RUN_LINE.search(done.output).groups()
    (report,) = wait_for(lambda: runs(rdb, namespace, REPORT), timeout=15)
    assert report["message_id"] == report_id
    assert abs(datetime.fromisoformat(report["scheduled_at"]) - datetime.now(UTC)) < timedelta(seconds=5)


def test_run_now_runs_a_paused_entry_all_the_same_and_it_stays_paused(worker, rdb, namespace):
    wait_for(lambda: ticks_ran(rdb, namespace), timeout=20)
    assert cli("schedule", "pause", EVERY).exit_code == 0
    time.sleep(1.5)  # a tick the leader fired before the pause may still be running
    paused_at = len(ticks_ran(rdb, namespace))

    done = cli("schedule", "run", EVERY)
    assert done.exit_code == 0, done.output
    _, run_id, _ = RUN_LINE.search(done.output).groups()
    assert f"entry {EVERY} is paused: run all the same, as asked; its ticks are still passed over" in done.output
    wait_for(lambda: [r for r in runs(rdb, namespace, EVERY) if r["message_id"] == run_id], timeout=15)
    time.sleep(1.5)
    assert len(ticks_ran(rdb, namespace)) == paused_at  # still paused: no tick ran
    assert rdb.hexists(keys.SchedulerKeys(namespace).paused, EVERY)


def test_backfill_enqueues_only_the_ticks_that_did_not_run_and_again_nothing(worker, rdb, namespace):
    # A real leader fires some ticks; a pause passes over three or so; the leader fires more after it.
    wait_for(lambda: len(ticks_ran(rdb, namespace)) >= 3, timeout=20)
    assert cli("schedule", "pause", EVERY).exit_code == 0
    time.sleep(3.5)
    assert cli("schedule", "resume", EVERY).exit_code == 0
    resumed = datetime.now(UTC)
    wait_for(lambda: len([t for t in ticks_ran(rdb, namespace) if t > resumed]) >= 2, timeout=10)
    ran = sorted(ticks_ran(rdb, namespace))
    window = [ran[0] + timedelta(seconds=n) for n in range((ran[-1] - ran[0]).seconds + 1)]
    passed_over = [tick for tick in window if tick not in ran]
    assert len(passed_over) >= 2, (ran, window)
    scheduler = keys.SchedulerKeys(namespace)
    # Each run's done mark is written as it is settled, a moment after the run recorded itself.
    wait_for(lambda: manual.tick_states(rdb, scheduler, namespace, EVERY, ran) == [manual.RAN] * len(ran), timeout=5)
    span = ["--from", ran[0].isoformat(), "--to", ran[-1].isoformat()]

    preview = cli("schedule", "backfill", EVERY, *span, "--dry-run")
    assert preview.exit_code == 0, preview.output
    lines = preview.output.splitlines()
    assert lines[0] == (
        f"backfill of entry {EVERY} (@every 1s, UTC) from {ran[0].isoformat()} to {ran[-1].isoformat()}:"
    )
    assert lines[1 : len(window) + 1] == [
        f"  {tick.isoformat()}  {'will run' if tick in passed_over else 'ran'}" for tick in window
    ]
    assert lines[len(window) + 1] == f"{len(window)} tick(s): {len(ran)} ran, 0 fired, {len(passed_over)} will run"
    assert lines[-1] == f"dry run: {len(passed_over)} tick(s) would be enqueued, none was"
    declined = cli("schedule", "backfill", EVERY, *span, input="n\n")
    assert declined.exit_code == 1 and "Aborted!" in declined.output
    assert not any(rdb.exists(scheduler.tick(EVERY, int(t.timestamp() * 1000))) for t in passed_over)

    done = cli("schedule", "backfill", EVERY, *span, input="y\n")
    assert done.exit_code == 0, done.output
    assert f"enqueue {len(passed_over)} tick(s) of entry {EVERY}? [y/N]: y" in done.output
    assert done.output.endswith(f"{len(passed_over)} tick(s) of entry {EVERY} enqueued\n")
    wait_for(lambda: set(passed_over) <= set(ticks_ran(rdb, namespace)), timeout=15)
    time.sleep(1)
    in_window = [tick for tick in ticks_ran(rdb, namespace) if ran[0] <= tick <= ran[-1]]
    assert sorted(in_window) == window  # every tick of the window once: none of the leader's again

    again = cli("schedule", "backfill", EVERY, *span, "--yes")
    assert again.exit_code == 0, again.output
    assert f"{len(window)} tick(s): " in again.output and ", 0 will run" in again.output
    assert again.output.endswith("nothing to enqueue: every tick of the window ran or was fired\n")

    # Past the preview, the claims themselves: the leader's ticks and the backfilled ones are all taken.
    settings = Settings.from_env()
    template = manual.template(rdb, scheduler, EVERY)
    broker = broker_for(settings, settings.redis.client(), middleware=[])
    try:
        assert actions.backfill_entry(broker, scheduler, template, window, keep_ms=60_000, who="test") == (
            0,
            len(window),
        )
    finally:
        broker.close()
        broker.client.close()


def _publish(rdb, namespace: str, trigger: str = "0 * * * *") -> keys.SchedulerKeys:
    """An hourly job entry in Budapest, as a worker publishes it."""
    scheduler = keys.SchedulerKeys(namespace)
    template = manual.Template("test.hourly", trigger, ZoneInfo("Europe/Budapest"), "jobs", "job:test.hourly", {})
    rdb.hset(scheduler.entries, "test.hourly", f"{trigger}|Europe/Budapest")
    rdb.hset(scheduler.templates, "test.hourly", template.encode())
    return scheduler


def test_the_preview_marks_each_tick_and_says_what_cannot_be_told_apart(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    scheduler = _publish(rdb, namespace)
    fired = datetime(2025, 1, 1, 1, 0, tzinfo=UTC)  # 02:00 in Budapest
    rdb.set(scheduler.tick("test.hourly", int(fired.timestamp() * 1000)), "7/leader", px=60_000)

    done = cli("schedule", "backfill", "test.hourly", "--from", "2025-01-01T00:00:00Z", "--to", "2025-01-01T03:00Z")
    assert done.exit_code == 1 and done.stderr == "Aborted!\n", done.output  # no answer to the prompt: no
    lines = done.stdout.splitlines()
    assert lines[:6] == [
        "backfill of entry test.hourly (0 * * * *, Europe/Budapest) from 2025-01-01T01:00:00+01:00 to "
        "2025-01-01T04:00:00+01:00:",
        "  2025-01-01T01:00:00+01:00  will run",
        "  2025-01-01T02:00:00+01:00  fired",
        "  2025-01-01T03:00:00+01:00  will run",
        "  2025-01-01T04:00:00+01:00  will run",
        "4 tick(s): 0 ran, 1 fired, 3 will run",
    ]
    assert lines[6].startswith("ticks before ") and lines[6].endswith(
        "are older than WORKER_DEDUP_RETENTION (1d): one that ran then left no mark, and runs again"
    )
    assert lines[7:] == ["enqueue 3 tick(s) of entry test.hourly? [y/N]: "]
    assert not rdb.exists(scheduler.tick("test.hourly", int(fired.timestamp() * 1000) + 3_600_000))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "nope"], "no schedule entry 'nope' in scheduler {ns} (`dramatiq-gp status` lists them)"),
        (
            ["backfill", "nope", "--from", "2h"],
            "no schedule entry 'nope' in scheduler {ns} (`dramatiq-gp status` lists",
        ),
        (["backfill", "test.hourly", "--from", "1h", "--to", "2h"], "the window is reversed or empty"),
        (["backfill", "test.hourly", "--from", "1h", "--to", "2999-01-01T00:00Z"], "is in the future: the ticks to"),
        (["backfill", "test.hourly", "--from", "2025-01-01T00:10Z", "--to", "2025-01-01T00:50Z"], "has no tick from"),
        (["backfill", "test.hourly", "--from", "2000-01-01T00:00Z", "--to", "1h"], "has more than 1000 ticks from"),
        (["backfill", "test.hourly", "--from", "soon"], "--from 'soon': expected an ISO time"),
        # Each of these three was a raw OverflowError.
        (["backfill", "test.hourly", "--from", "0001-01-01"], "--from '0001-01-01': expected a time from 1970 to 9998"),
        (["backfill", "test.hourly", "--from", "999999999d"], "--from '999999999d': expected a time from 1970 to"),
        (["backfill", "test.hourly", "--from", "1e20"], "--from '1e20': expected an ISO time"),
        (
            ["backfill", "test.hourly", "--from", "1h", "--to", "9999-12-31T23:00-14:00"],
            "--to '9999-12-31T23:00-14:00': expected a time from 1970 to 9998",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_1(args, message, clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    _publish(rdb, namespace)
    done = cli("schedule", *args)
    assert done.exit_code == 1, done.output
    assert done.output.startswith("Error: ") and done.output.count("\n") == 1, done.output
    assert message.format(ns=namespace) in done.output


def test_an_apscheduler_entrys_backfill_needs_its_trigger_and_only_its_own(clean_env, namespace, rdb, tmp_path):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    _publish(rdb, namespace, trigger="interval[1:00:00]")
    done = cli("schedule", "backfill", "test.hourly", "--from", "5h", "--dry-run")
    assert done.exit_code == 1
    assert done.output == (
        "Error: schedule entry 'test.hourly' fires on an APScheduler trigger (interval[1:00:00]), whose past ticks "
        "cannot be computed from Redis: give the trigger object with --trigger module:attribute\n"
    )
    (tmp_path / "triggers_mod.py").write_text(
        "from datetime import datetime, timezone\n"
        "from apscheduler.triggers.interval import IntervalTrigger\n"
        "start = datetime(2025, 1, 1, tzinfo=timezone.utc)\n"
        "hourly = IntervalTrigger(hours=1, start_date=start)\n"
        "daily = IntervalTrigger(days=1, start_date=start)\n"
    )
    clean_env.chdir(tmp_path)
    other = cli("schedule", "backfill", "test.hourly", "--from", "5h", "--trigger", "triggers_mod:daily")
    assert other.exit_code == 1 and "the trigger given is 'interval[1 day, 0:00:00]'" in other.output
    done = cli("schedule", "backfill", "test.hourly", "--from", "5h", "--trigger", "triggers_mod:hourly", "--dry-run")
    assert done.exit_code == 0, done.output
    assert "5 tick(s): 0 ran, 0 fired, 5 will run" in done.output


def test_the_dashboards_run_now_is_confirmed_logged_with_who_and_refused_read_only(worker, rdb, namespace, caplog):
    wait_for(lambda: ticks_ran(rdb, namespace), timeout=20)
    with serving(create_app()) as base:
        browser = Browser(base)
        page = browser.open("/scheduler").body
        assert re.search(rf'action="[^"]*/scheduler/{re.escape(EVERY)}/run"', page) and ">Run now</button>" in page
        token = browser.csrf("/scheduler")
        assert browser.open(f"/scheduler/{EVERY}/run", {"csrf": "forged", "confirmed": "yes"}).status == 403
        confirm = browser.open(f"/scheduler/{EVERY}/run", {"csrf": token})
        assert confirm.status == 200 and f"Run {EVERY} now?" in html.unescape(confirm.body)
        time.sleep(0.5)
        assert not [r for r in runs(rdb, namespace, EVERY) if r["message_id"] not in _tick_ids(rdb, namespace)]

        with caplog.at_level(logging.INFO, logger="dramatiq_gp.actions"):
            done = browser.open(f"/scheduler/{EVERY}/run", {"csrf": token, "confirmed": "yes"})
        assert done.status == 200 and done.url.endswith("/scheduler")
        run_id = re.search(rf"entry {re.escape(EVERY)} run now: message (\S+?)<", done.body).group(1)
        wait_for(lambda: [r for r in runs(rdb, namespace, EVERY) if r["message_id"] == run_id], timeout=15)
    assert [r.getMessage() for r in caplog.records if r.name == "dramatiq_gp.actions"] == [
        f"schedule run by anonymous (dashboard, 127.0.0.1): entry {EVERY} run now as message {run_id}"
    ]

    with serving(create_app(read_only=True)) as base:
        browser = Browser(base)
        assert "Run now" not in browser.open("/scheduler").body
        refused = browser.open(f"/scheduler/{EVERY}/run", {"confirmed": "yes"})
        assert refused.status == 403 and "read-only" in refused.body


def _tick_ids(rdb, namespace: str) -> set[str]:
    return {tick_message_id(EVERY, tick) for tick in ticks_ran(rdb, namespace)}
