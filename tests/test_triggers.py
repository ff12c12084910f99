"""Triggers: the kit's cron engine as an APScheduler trigger, APScheduler's own triggers, and both in real workers."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

import dramatiq_gp as gp
from apps.replica import Replica
from dramatiq_gp.scheduler.cron import parse
from dramatiq_gp.scheduler.triggers import SpecTrigger, first_at_or_after, following, upcoming
from helpers import wait_for

BUDAPEST = ZoneInfo("Europe/Budapest")


def _fires(trigger, start: datetime, end: datetime) -> list[datetime]:
    fires, fire = [], first_at_or_after(trigger, start)
    while fire is not None and fire < end:
        fires.append(fire)
        fire = following(trigger, fire)
    return fires


def test_a_cron_string_runs_as_a_trigger_with_the_kits_dst_policy_where_apschedulers_crontrigger_fires_twice():
    autumn = datetime(2026, 10, 25, tzinfo=BUDAPEST)  # 03:00 CEST goes back to 02:00 CET
    day = (autumn, autumn + timedelta(days=1))
    ours = _fires(SpecTrigger(parse("30 2 * * *"), BUDAPEST), *day)
    assert [f.astimezone(BUDAPEST).isoformat() for f in ours] == ["2026-10-25T02:30:00+02:00"]
    # Why the kit does not run cron strings through APScheduler's CronTrigger (3.11): twice that day.
    first, second = _fires(CronTrigger(hour=2, minute=30, timezone=BUDAPEST), *day)
    assert second.astimezone(UTC) - first.astimezone(UTC) == timedelta(hours=1)
    spring = datetime(2026, 3, 29, tzinfo=BUDAPEST)  # 02:00 CET jumps to 03:00 CEST
    (fire,) = _fires(SpecTrigger(parse("30 2 * * *"), BUDAPEST), spring, spring + timedelta(days=1))
    assert fire.astimezone(BUDAPEST).isoformat() == "2026-03-29T03:00:00+02:00"  # at the transition


def test_spec_trigger_follows_apschedulers_protocol_for_missed_and_next_runs():
    trigger = SpecTrigger(parse("@every 10s"), BUDAPEST)
    now = datetime(2026, 12, 1, 12, 0, 5, tzinfo=UTC)
    assert trigger.get_next_fire_time(None, now) == datetime(2026, 12, 1, 12, 0, 10, tzinfo=UTC)
    assert trigger.get_next_fire_time(None, now.replace(second=10)) == now.replace(second=10)  # at or after now
    missed = now - timedelta(minutes=1)
    assert trigger.get_next_fire_time(missed.replace(second=0), now) == missed.replace(second=10)  # from the previous
    assert str(trigger) == "@every 10s"


def test_apscheduler_triggers_are_entries_with_their_own_times():
    anchor = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
    schedule = gp.Schedule("Europe/Budapest")
    schedule.job("interval", IntervalTrigger(minutes=5, start_date=anchor), lambda: None)
    schedule.job("once", DateTrigger(run_date=anchor + timedelta(hours=1)), lambda: None)
    interval, once = schedule.entries
    assert interval.next_after(anchor + timedelta(minutes=7)) == anchor + timedelta(minutes=10)
    assert upcoming(interval.trigger, anchor, 3) == [anchor + timedelta(minutes=m) for m in (5, 10, 15)]
    assert once.next_after(anchor) == anchor + timedelta(hours=1)
    assert once.next_after(anchor + timedelta(hours=2)) is None  # a one-off is behind us
    assert interval.text.startswith("interval[0:05:00]")
    with pytest.raises(gp.ScheduleError, match="neither a cron spec nor an APScheduler trigger"):
        schedule.job("bad", 42, lambda: None)  # type: ignore[arg-type]


def test_an_interval_trigger_and_a_date_trigger_fire_through_real_workers_each_tick_once(
    tmp_path, clean_env, redis_url, namespace, rdb
):
    now = datetime.now(UTC).replace(microsecond=0)
    run_at = now + timedelta(seconds=6)
    env = {
        "REDIS_URL": redis_url,
        "VALKEY_NAMESPACE": namespace,
        "SCHEDULER_LEASE_TTL": "2s",
        "GP_TEST_ANCHOR": (now - timedelta(hours=1)).isoformat(),
        "GP_TEST_RUN_AT": run_at.isoformat(),
    }
    replicas = [Replica("tests.apps.triggers_app", env, tmp_path / f"replica-{i}.log") for i in range(2)]
    try:
        wait_for(lambda: all(r.started() for r in replicas), timeout=30)
        wait_for(lambda: rdb.llen(f"{namespace}:test:runs:once") == 1, timeout=30)
        wait_for(lambda: rdb.llen(f"{namespace}:test:runs:every_second") >= 8, timeout=30)
        time.sleep(1.5)
    finally:
        for replica in replicas:
            replica.stop()
    (once,) = rdb.lrange(f"{namespace}:test:runs:once", 0, -1)
    assert datetime.fromisoformat(once) == run_at
    ticks = [datetime.fromisoformat(t) for t in rdb.lrange(f"{namespace}:test:runs:every_second", 0, -1)]
    assert len(ticks) == len(set(ticks)), "a tick ran twice"
    ticks.sort()
    assert all(later - earlier == timedelta(seconds=1) for earlier, later in itertools.pairwise(ticks))
    assert all(tick.microsecond == 0 for tick in ticks)  # on the anchor's grid, whichever process led


def test_status_and_schedule_next_show_an_apscheduler_triggers_next_fires(tmp_path, make_kit, redis_url, namespace):
    anchor = datetime(2026, 1, 1, tzinfo=UTC)
    kit = make_kit(lambda r, s: s.job("warm", IntervalTrigger(minutes=5, start_date=anchor), lambda: None))
    assert kit.scheduler is not None
    kit.scheduler.start()
    try:
        wait_for(kit.scheduler.lease.is_held)
        env = {**os.environ, "REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace}
        env.pop("DB_URL", None)

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "dramatiq_gp", *args], cwd=tmp_path, env=env, capture_output=True, text=True
            )

        schedulers = json.loads(cli("status", "--json").stdout)["schedulers"]
        (entry,) = next(s["entries"] for s in schedulers if s["namespace"] == namespace)
        now = datetime.now(UTC)
        expected = upcoming(IntervalTrigger(minutes=5, start_date=anchor), now, 3)
        assert entry["trigger"].startswith("interval[0:05:00]")
        assert datetime.fromisoformat(entry["next_fire"]) == expected[0]
        published = cli("schedule", "next", "warm", "-n", "3", "--tz", "UTC")
        assert [datetime.fromisoformat(line) for line in published.stdout.split()] == expected
        (tmp_path / "my_triggers.py").write_text(
            "from datetime import datetime, timezone\nfrom apscheduler.triggers.interval import IntervalTrigger\n"
            "warm = IntervalTrigger(minutes=5, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc))\n"
        )
        imported = cli("schedule", "next", "my_triggers:warm", "-n", "3", "--tz", "UTC")
        assert [datetime.fromisoformat(line) for line in imported.stdout.split()] == expected, imported.stderr
        refused = cli("schedule", "next", "my_triggers:datetime")
        assert refused.returncode != 0 and refused.stderr.strip().count("\n") == 0
        assert "not an APScheduler trigger" in refused.stderr
    finally:
        kit.scheduler.stop()
