"""Cron conformance: random specs against croniter, and DST cases worked out by hand."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter

from dramatiq_gp.scheduler.cron import CronError, parse

MONTH_NAMES = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
DAY_NAMES = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]


def _item(rng: random.Random, low: int, high: int, names: list[str] | None) -> str:
    def value(lo: int = low, hi: int = high) -> str:
        n = rng.randint(lo, hi)
        if names and rng.random() < 0.3 and n - low < len(names):
            return names[n - low]
        return str(n)

    kind = rng.choice(["value", "range", "step", "range-step", "list"])
    # croniter reads a one-value range ("17-17") as "*", so ranges here have two ends.
    a = rng.randint(low, high - 1)
    if kind == "value":
        return value()
    if kind == "range":
        return f"{a}-{rng.randint(a + 1, high)}"
    if kind == "step":  # "*/1" is "*", which croniter reads two ways in day fields
        return f"*/{rng.randint(2, max(2, (high - low) // 2))}"
    if kind == "range-step":
        return f"{a}-{rng.randint(a + 1, high)}/{rng.randint(1, 5)}"
    return ",".join(sorted({value() for _ in range(rng.randint(2, 4))}, key=lambda v: v))


def random_spec(rng: random.Random) -> str:
    fields = [(0, 59, None), (0, 23, None), (1, 31, None), (1, 12, MONTH_NAMES), (0, 6, DAY_NAMES)]
    parts = ["*" if rng.random() < 0.35 else _item(rng, *f) for f in fields]
    if parts[4] == "0" and rng.random() < 0.5:
        parts[4] = "7"  # Sunday, spelled the other way
    return " ".join(parts)


def _fires(spec: str, start: datetime, zone: ZoneInfo, count: int) -> list[datetime]:
    parsed, out, t = parse(spec), [], start
    for _ in range(count):
        t = parsed.next_after(t, zone)
        out.append(t)
    return out


def _croniter_fires(spec: str, start: datetime, zone: ZoneInfo, count: int) -> list[datetime]:
    it = croniter(spec, start.astimezone(zone))
    return [it.get_next(datetime).astimezone(UTC) for _ in range(count)]


def _near_dst(instant: datetime, zone: ZoneInfo) -> bool:
    # No zone changes its offset twice within two days.
    day = timedelta(hours=26)
    return (instant - day).astimezone(zone).utcoffset() != (instant + day).astimezone(zone).utcoffset()


@pytest.mark.parametrize("zone_name", ["UTC", "Asia/Tokyo", "Europe/Budapest", "America/New_York"])
def test_next_fire_agrees_with_croniter_over_thousands_of_random_specs(zone_name):
    rng = random.Random(f"cron-{zone_name}")
    zone = ZoneInfo(zone_name)
    compared = 0
    for _ in range(1500):
        spec = random_spec(rng)
        try:
            parse(spec)
        except CronError:
            continue  # e.g. only days a month never has; croniter searches forever there
        start = datetime(2020, 1, 1, tzinfo=UTC) + timedelta(seconds=rng.randint(0, 8 * 365 * 86400))
        ours = _fires(spec, start, zone, 4)
        theirs = _croniter_fires(spec, start, zone, 4)
        for a, b in zip(ours, theirs, strict=True):
            if _near_dst(a, zone) or _near_dst(b, zone):
                break  # DST days follow our own policy, checked below
            assert a == b, (spec, start, zone_name, ours, theirs)
            compared += 1
    assert compared > 4000


@pytest.mark.parametrize(
    ("spec", "zone", "start", "expected"),
    [
        # Europe/Budapest: 2026-03-29 02:00 CET -> 03:00 CEST; 2026-10-25 03:00 CEST -> 02:00 CET
        ("30 2 * * *", "Europe/Budapest", "2026-03-28T12:00Z", ["03-29 03:00 CEST", "03-30 02:30 CEST"]),
        ("*/30 * * * *", "Europe/Budapest", "2026-03-29T00:10Z", ["03-29 01:30 CET", "03-29 03:00 CEST"]),
        ("30 2 * * *", "Europe/Budapest", "2026-10-24T12:00Z", ["10-25 02:30 CEST", "10-26 02:30 CET"]),
        (
            "*/30 * * * *",
            "Europe/Budapest",
            "2026-10-24T23:40Z",
            ["10-25 02:00 CEST", "10-25 02:30 CEST", "10-25 02:00 CET", "10-25 02:30 CET", "10-25 03:00 CET"],
        ),
        (
            "0 * * * *",
            "Europe/Budapest",
            "2026-10-24T23:30Z",
            ["10-25 02:00 CEST", "10-25 02:00 CET", "10-25 03:00 CET"],
        ),
        # America/New_York: 2026-03-08 02:00 EST -> 03:00 EDT; 2026-11-01 02:00 EDT -> 01:00 EST
        ("15 2 * * *", "America/New_York", "2026-03-07T12:00Z", ["03-08 03:00 EDT", "03-09 02:15 EDT"]),
        ("0 1 * * *", "America/New_York", "2026-10-31T12:00Z", ["11-01 01:00 EDT", "11-02 01:00 EST"]),
        (
            "30 * * * *",
            "America/New_York",
            "2026-11-01T04:00Z",
            ["11-01 00:30 EDT", "11-01 01:30 EDT", "11-01 01:30 EST"],
        ),
        # Australia/Lord_Howe, a 30-minute shift: 2026-04-05 02:00 -> 01:30; 2026-10-04 02:00 -> 02:30
        ("45 1 * * *", "Australia/Lord_Howe", "2026-04-04T02:00Z", ["04-05 01:45 +11", "04-06 01:45 +1030"]),
        (
            "*/15 1 * * *",
            "Australia/Lord_Howe",
            "2026-04-04T14:20Z",
            ["04-05 01:30 +11", "04-05 01:45 +11", "04-06 01:00 +1030"],
        ),
        (
            "*/15 * * * *",
            "Australia/Lord_Howe",
            "2026-04-04T14:20Z",
            ["04-05 01:30 +11", "04-05 01:45 +11", "04-05 01:30 +1030", "04-05 01:45 +1030", "04-05 02:00 +1030"],
        ),
        ("15 2 * * *", "Australia/Lord_Howe", "2026-10-03T02:00Z", ["10-04 02:30 +11", "10-05 02:15 +11"]),
        ("0 * * * *", "Australia/Lord_Howe", "2026-10-03T14:10Z", ["10-04 01:00 +1030", "10-04 03:00 +11"]),
    ],
)
def test_dst_policy(spec, zone, start, expected):
    tz = ZoneInfo(zone)
    fires = _fires(spec, datetime.fromisoformat(start), tz, len(expected))
    assert [f.astimezone(tz).strftime("%m-%d %H:%M %Z") for f in fires] == expected


def test_descriptors_and_sunday_spelled_two_ways():
    start = datetime(2026, 1, 1, 12, tzinfo=UTC)
    assert _fires("@daily", start, ZoneInfo("UTC"), 1) == _fires("0 0 * * *", start, ZoneInfo("UTC"), 1)
    assert _fires("@midnight", start, ZoneInfo("UTC"), 1) == _fires("@daily", start, ZoneInfo("UTC"), 1)
    assert _fires("@yearly", start, ZoneInfo("UTC"), 1) == [datetime(2027, 1, 1, tzinfo=UTC)]
    assert _fires("@annually", start, ZoneInfo("UTC"), 1) == [datetime(2027, 1, 1, tzinfo=UTC)]
    assert _fires("@monthly", start, ZoneInfo("UTC"), 1) == [datetime(2026, 2, 1, tzinfo=UTC)]
    assert _fires("@hourly", start, ZoneInfo("UTC"), 1) == [datetime(2026, 1, 1, 13, tzinfo=UTC)]
    sundays = [_fires(s, start, ZoneInfo("UTC"), 3) for s in ("0 0 * * 0", "0 0 * * 7", "0 0 * * sun", "@weekly")]
    assert all(f == sundays[0] for f in sundays)
    assert all(d.isoweekday() == 7 for d in sundays[0])


def test_day_of_month_or_day_of_week_when_both_are_restricted():
    fires = _fires("0 0 13 * fri", datetime(2026, 2, 1, tzinfo=UTC), ZoneInfo("UTC"), 4)
    assert [f.strftime("%a %d") for f in fires] == ["Fri 06", "Fri 13", "Fri 20", "Fri 27"]
    fires = _fires("0 0 13 * fri", datetime(2026, 3, 10, tzinfo=UTC), ZoneInfo("UTC"), 2)
    assert [f.strftime("%a %d") for f in fires] == ["Fri 13", "Fri 20"]
    fires = _fires("0 0 12 * mon", datetime(2026, 1, 1, tzinfo=UTC), ZoneInfo("UTC"), 2)
    assert [f.strftime("%a %d") for f in fires] == ["Mon 05", "Mon 12"]


def test_every_is_anchored_to_the_epoch_so_replicas_agree():
    spec = parse("@every 45s")
    a = spec.next_after(datetime(2026, 5, 1, 10, 0, 7, tzinfo=UTC), ZoneInfo("UTC"))
    b = spec.next_after(datetime(2026, 5, 1, 10, 0, 31, 123456, tzinfo=UTC), ZoneInfo("Asia/Tokyo"))
    assert a == b
    assert a.timestamp() % 45 == 0
    assert parse("@every 1h30m").next_after(a, ZoneInfo("UTC")).timestamp() % 5400 == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("* * * *", "has 4 fields; expected 5"),
        ("60 * * * *", "minute value 60 is out of range 0-59"),
        ("* 24 * * *", "hour value 24 is out of range 0-23"),
        ("* * 0 * *", "day-of-month value 0 is out of range 1-31"),
        ("* * * 13 *", "month value 13 is out of range 1-12"),
        ("* * * * 8", "day-of-week value 8 is out of range 0-7"),
        ("* * * foo *", "month value 'foo' is not a number or name"),
        ("5-1 * * * *", "minute range '5-1' runs backwards"),
        ("*/0 * * * *", "minute step must be at least 1"),
        ("0 0 L * *", "day-of-month value 'l' is not a number or name"),
        ("0 0 30 2 *", "never fires"),
        ("@often", "unknown descriptor"),
        ("@every soon", "is not a duration"),
        ("@every 500ms", "at least 1s"),
    ],
)
def test_bad_specs_name_the_culprit(spec, message):
    with pytest.raises(CronError) as raised:
        parse(spec)
    assert message in str(raised.value)
    assert repr(spec) in str(raised.value)


def test_the_shortcut_for_a_fire_nearby_agrees_with_the_walk_around_every_offset_change():
    """``Cron._next_nearby`` (no offset change before the next fire) answers as the full walk does, or not at all."""
    import zoneinfo

    rng = random.Random(2)
    zones = sorted(zoneinfo.available_timezones() - {"Factory", "localtime"})[::12]
    specs = [parse(s) for s in ("* * * * *", "*/7 1-3 * * *", "30 1 * * *", "0 2 * * *", "45 2 * * *", "0,30 * * * *")]
    answered = 0
    for key in zones:
        zone = ZoneInfo(key)
        hour, offset = datetime(2026, 1, 1, tzinfo=UTC), None
        while hour.year < 2027:
            hour += timedelta(hours=1)
            if offset is not None and hour.astimezone(zone).utcoffset() != offset:
                for _ in range(20):
                    after = hour + timedelta(seconds=rng.randrange(-5 * 3600, 5 * 3600))
                    for spec in specs:
                        nearby = spec._next_nearby(after, zone)
                        if nearby is not None:
                            answered += 1
                            assert nearby == spec._next_walked(after, zone), (spec.text, key, after)
            offset = hour.astimezone(zone).utcoffset()
    assert answered > 1000
