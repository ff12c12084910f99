"""Building a Schedule: the fluent API and the errors that name the entry."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest

import dramatiq_gp as gp


@gp.event("test.schedule.sync_inventory")
@dataclass(frozen=True)
class SyncInventory:
    pass


@gp.event("test.schedule.digest_due")
@dataclass(frozen=True)
class DigestDue:
    size: int = 10


@gp.event("test.schedule.any")
@dataclass(frozen=True)
class AnyPayload:
    value: Any


def report() -> None:
    pass


def test_every_method_returns_the_schedule_and_names_default_sensibly():
    schedule = (
        gp.Schedule("Europe/Budapest")
        .every(timedelta(minutes=15), SyncInventory())
        .daily_at("06:30", DigestDue(), queue="mail")
        .cron("0 8 * * mon", DigestDue(5), name="monday_digest", tz="America/New_York", max_retries=3, queue="mail")
        .job("shop.nightly_sales_report", "0 3 * * *", report, time_limit=60_000)
    )
    entries = {entry.name: entry for entry in schedule}
    assert len(schedule) == 4
    assert entries["test.schedule.sync_inventory"].text == "@every 15m"
    assert entries["test.schedule.sync_inventory"].actor_name == "schedule:test.schedule.sync_inventory"
    assert entries["test.schedule.digest_due"].text == "30 6 * * *"
    assert entries["test.schedule.digest_due"].queue == "mail"
    assert entries["monday_digest"].zone.key == "America/New_York"
    assert entries["monday_digest"].options == {"max_retries": 3}
    assert entries["monday_digest"].payload == {"size": 5}
    assert entries["shop.nightly_sales_report"].actor_name == "job:shop.nightly_sales_report"
    assert entries["shop.nightly_sales_report"].zone.key == "Europe/Budapest"


def test_the_decorator_form_registers_a_job_and_keeps_the_function():
    schedule = gp.Schedule()

    @schedule.job("reports.weekly", "@weekly", queue="reports")
    def weekly(scheduled_at: datetime) -> None:
        pass

    (entry,) = schedule
    assert (entry.name, entry.queue, entry.takes_time, entry.handler) == ("reports.weekly", "reports", True, weekly)


def _bad_handler(a: int, b: int) -> None:
    pass


async def _async_handler(a: int, b: int) -> None:
    pass


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda s: s.cron("0 25 * * *", SyncInventory()), "'test.schedule.sync_inventory': cron spec '0 25 * * *'"),
        (lambda s: s.cron("@daily", SyncInventory(), tz="Mars/Olympus"), "'Mars/Olympus' is not an IANA time zone"),
        (
            lambda s: s.every(timedelta(minutes=1), SyncInventory()).every(timedelta(hours=1), SyncInventory()),
            "'test.schedule.sync_inventory' is defined twice",
        ),
        (lambda s: s.job("x", "@hourly", _bad_handler), "'x': the handler must take no argument, or one"),
        (lambda s: s.job("x", "@hourly", _async_handler), "'x': the handler must take no argument, or one"),
        (lambda s: s.job("x", "@hourly", "report"), "schedule entry 'x': handler 'report' is not callable"),
        (lambda s: s.job("has space", "@hourly", report), "schedule entry 'has space': a name is"),
        (lambda s: s.daily_at("6:75", DigestDue()), "daily_at('6:75') is not HH:MM"),
        (lambda s: s.every(timedelta(milliseconds=10), DigestDue()), "interval must be a timedelta >= 1s"),
        (lambda s: s.cron("@daily", DigestDue), "give an event instance, not the class"),
        (lambda s: s.cron("@daily", {"not": "an event"}), "is not an event type"),
        (lambda s: s.cron("@daily", AnyPayload(object())), "cannot encode event 'test.schedule.any'"),
        (lambda s: s.job("x", "@hourly", report, queue="no spaces"), "'no spaces' is not a queue name"),
        (lambda s: s.job("x", "@hourly", report, retry_when=lambda n, e: True), "options travel as JSON"),
    ],
)
def test_bad_entries_are_refused_naming_the_entry(build, message):
    with pytest.raises(gp.ScheduleError) as raised:
        build(gp.Schedule())
    assert message in str(raised.value)


def test_options_are_checked_against_what_the_broker_knows(make_kit):
    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        schedule.job("x", "@hourly", report, max_retrys=3)

    with pytest.raises(gp.ScheduleError, match=r"schedule entry 'x': unknown option.s. max_retrys"):
        make_kit(register)


def test_a_bad_default_zone_is_a_config_error(clean_env):
    clean_env.setenv("SCHEDULER_TIMEZONE", "Europe/Atlantis")
    with pytest.raises(gp.ConfigError, match="SCHEDULER_TIMEZONE='Europe/Atlantis'"):
        gp.Settings.from_env()


def test_entries_sending_one_task_on_two_queues_are_refused_in_one_line():
    # A worker runs a message only from its actor's queue: the second entry's ticks would all be set aside.
    schedule = gp.Schedule().daily_at("06:30", DigestDue(), queue="mail")
    with pytest.raises(gp.ScheduleError) as refused:
        schedule.cron("0 8 * * mon", DigestDue(5), name="monday_digest")
    assert str(refused.value) == (
        "schedule entries 'test.schedule.digest_due' and 'monday_digest' both send task "
        "'schedule:test.schedule.digest_due', on queues 'mail' and 'default': a task runs from one queue only; "
        "give them one queue="
    )
    schedule.cron("0 8 * * mon", DigestDue(5), name="monday_digest", queue="mail")
    assert len(schedule) == 2
