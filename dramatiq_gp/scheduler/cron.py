"""Standard cron, in any time zone, with a written DST policy. Pure functions; no clocks.

Specs are the five standard fields (minute hour day-of-month month day-of-week)
with lists, ranges, steps and names (``jan``, ``mon``); 0 and 7 are Sunday; when
day-of-month and day-of-week are both restricted (neither is ``*``) a day matching
either matches. Descriptors: ``@yearly @annually @monthly @weekly @daily
@midnight @hourly``, and ``@every <duration>`` (``30m``, ``1h30m``, ``45s``), whose
ticks are whole multiples of the interval since the Unix epoch, so every replica
computes the same ticks whenever it started.

DST. A spec whose hour field is restricted (``30 2 * * *``) is *fixed-time*: it
fires once per local day at each listed time; a time inside the hour skipped in
spring fires at the transition, a time inside the hour repeated in autumn fires
at its first occurrence. A spec whose hour field is ``*`` or ``*/n`` is
*interval-like* and follows real elapsed time: skipped times do not fire, repeated
times fire twice. ``@every`` is pure elapsed time.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

from ..durations import EPOCH, MAX_AHEAD, parse_duration
from ..errors import GPError

DESCRIPTORS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTHS = {
    name: n
    for n, name in enumerate(["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], 1)
}
_WEEKDAYS = {name: n for n, name in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
#: name, lowest, highest, names
_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day-of-month", 1, 31, {}),
    ("month", 1, 12, _MONTHS),
    ("day-of-week", 0, 7, _WEEKDAYS),
)
_ITEM = re.compile(r"^(?:(\*)|([a-z0-9]+)(?:-([a-z0-9]+))?)(?:/(\d+))?$")
#: A day field spelled like this does not restrict, so the other day field alone decides.
_UNRESTRICTED = ("*", "*/1")
_DAYS_IN_MONTH = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
#: How far ahead a search looks before calling a spec one that never fires (covers leap days).
_SEARCH_DAYS = 366 * 8
#: More than any daylight-saving shift (the largest in use is 2 h).
_SHIFT = timedelta(hours=3)


class CronError(GPError, ValueError):
    """A spec that cannot be parsed; the message quotes the spec and the culprit."""


@dataclass(frozen=True)
class Cron:
    """A parsed five-field spec."""

    text: str
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    day_restricted: bool
    weekday_restricted: bool
    fixed_time: bool

    def next_after(self, after: datetime, zone: ZoneInfo) -> datetime:
        """The first fire strictly after ``after``, as an aware UTC datetime."""
        after = after.astimezone(UTC)
        return self._next_nearby(after, zone) or self._next_walked(after, zone)

    def _next_nearby(self, after: datetime, zone: ZoneInfo) -> datetime | None:
        """The next fire when it is less than ``_SHIFT`` away and the zone's offset holds until it; else None.

        With one offset throughout, wall time and instants run in step, so the first
        matching wall time after ``after``'s is the answer: no look behind or around
        the way :meth:`_next_walked` must for an offset change. That spares a leader
        firing thousands of frequent entries the walk's hundreds of conversions each.
        """
        local = after.astimezone(zone)
        offset, wall_after = local.utcoffset(), local.replace(tzinfo=None)
        limit = wall_after + _SHIFT
        day = wall_after.date()
        while datetime.combine(day, time()) <= limit:
            if self._matches(day):
                for hour in self.hours:
                    if datetime.combine(day, time(hour, 59)) <= wall_after:
                        continue
                    for minute in self.minutes:
                        wall = datetime.combine(day, time(hour, minute))
                        if wall <= wall_after:
                            continue
                        if wall > limit:
                            return None
                        first = wall.replace(tzinfo=zone, fold=0)
                        # Unambiguous, and at the offset of ``after``: no change lies in between (two changes
                        # less than _SHIFT apart that cancel out occur in no zone).
                        if first.utcoffset() != offset or wall.replace(tzinfo=zone, fold=1).utcoffset() != offset:
                            return None
                        return first.astimezone(UTC)
            day += timedelta(days=1)
        return None

    def _next_walked(self, after: datetime, zone: ZoneInfo) -> datetime:
        # Wall times are walked in order; an offset change moves an instant by at most
        # _SHIFT, so nothing earlier hides more than _SHIFT of wall time past the best so far.
        start = after.astimezone(zone).replace(tzinfo=None) - _SHIFT
        best: datetime | None = None
        best_wall = datetime.max - _SHIFT
        day = start.date()
        for _ in range(_SEARCH_DAYS):
            if self._matches(day):
                for hour in self.hours:
                    if datetime.combine(day, time(hour, 59)) < start:
                        continue
                    for minute in self.minutes:
                        wall = datetime.combine(day, time(hour, minute))
                        if wall > best_wall + _SHIFT:
                            return best  # type: ignore[return-value]
                        for instant in _resolve(wall, zone, self.fixed_time):
                            if instant > after and (best is None or instant < best):
                                best, best_wall = instant, wall
            day += timedelta(days=1)
        if best is not None:
            return best
        raise CronError(f"cron spec {self.text!r} never fires")

    def _matches(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        in_month = day.day in self.days
        on_weekday = day.isoweekday() % 7 in self.weekdays
        if self.day_restricted and self.weekday_restricted:
            return in_month or on_weekday
        return in_month and on_weekday


@dataclass(frozen=True)
class Every:
    """``@every <duration>``: ticks at whole multiples of the interval since the Unix epoch."""

    text: str
    interval: timedelta

    def next_after(self, after: datetime, zone: ZoneInfo) -> datetime:
        step = self.interval // timedelta(microseconds=1)
        elapsed = (after.astimezone(UTC) - EPOCH) // timedelta(microseconds=1)
        return EPOCH + timedelta(microseconds=(elapsed // step + 1) * step)

    @property
    def fixed_time(self) -> bool:
        return False


Spec = Cron | Every


def parse(text: str) -> Spec:
    """Parse a cron spec, descriptor or ``@every``.

    Raises:
        CronError: quoting the spec and naming the field, value and bound at fault.
    """
    spec = " ".join(text.split()).lower()
    if spec.startswith("@every"):
        try:
            interval = parse_duration(spec.removeprefix("@every").strip())
        except ValueError as exc:
            raise CronError(f"cron spec {text!r}: {exc}") from None
        if interval < timedelta(seconds=1):
            raise CronError(f"cron spec {text!r}: @every needs an interval of at least 1s")
        if interval > MAX_AHEAD:
            raise CronError(f"cron spec {text!r}: @every takes an interval of at most {MAX_AHEAD.days}d (100 years)")
        return Every(text, interval)
    if spec.startswith("@"):
        if spec not in DESCRIPTORS:
            raise CronError(f"cron spec {text!r}: unknown descriptor; use one of {', '.join(DESCRIPTORS)} or @every")
        spec = DESCRIPTORS[spec]
    parts = spec.split(" ")
    if len(parts) != 5:
        raise CronError(
            f"cron spec {text!r} has {len(parts)} fields; expected 5 (minute hour day-of-month month day-of-week)"
        )
    minutes, hours, days, months, weekdays = (
        _field(text, part, *definition) for part, definition in zip(parts, _FIELDS, strict=True)
    )
    weekdays = {0 if d == 7 else d for d in weekdays}
    cron = Cron(
        text=text,
        minutes=tuple(sorted(minutes)),
        hours=tuple(sorted(hours)),
        days=frozenset(days),
        months=frozenset(months),
        weekdays=frozenset(weekdays),
        day_restricted=parts[2] not in _UNRESTRICTED,
        weekday_restricted=parts[4] not in _UNRESTRICTED,
        fixed_time=not parts[1].startswith("*"),
    )
    if not cron.weekday_restricted and not any(d <= _DAYS_IN_MONTH[m - 1] for m in cron.months for d in cron.days):
        raise CronError(f"cron spec {text!r} never fires: no listed month has those days")
    return cron


def _field(spec: str, text: str, name: str, low: int, high: int, names: dict[str, int]) -> set[int]:
    values: set[int] = set()
    for item in text.split(","):
        match = _ITEM.match(item)
        if not match:
            raise CronError(f"cron spec {spec!r}: {name} item {item!r} is not a value, range, list or step")
        star, first, last, step_text = match.groups()

        def number(token: str) -> int:
            value = names.get(token) if token in names else int(token) if token.isdigit() else None
            if value is None:
                raise CronError(f"cron spec {spec!r}: {name} value {token!r} is not a number or name")
            if not low <= value <= high:
                raise CronError(f"cron spec {spec!r}: {name} value {value} is out of range {low}-{high}")
            return value

        step = int(step_text) if step_text else 1
        if step < 1:
            raise CronError(f"cron spec {spec!r}: {name} step must be at least 1")
        if star:
            start, stop = low, high
        else:
            start = number(first)
            # "5/15" means from 5 to the end, every 15.
            stop = number(last) if last else (high if step_text else start)
            if stop < start:
                raise CronError(f"cron spec {spec!r}: {name} range {item!r} runs backwards")
        values.update(range(start, stop + 1, step))
    return values


def _resolve(wall: datetime, zone: ZoneInfo, fixed_time: bool) -> list[datetime]:
    """The instants at which local wall time ``wall`` fires, under the DST policy above."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    if first == second:
        return [first]
    if first < second:  # repeated (autumn): the wall time happens twice
        return [first] if fixed_time else [first, second]
    # skipped (spring): fold=1 reads it with the new offset, fold=0 with the old
    return [_transition(second, first, zone)] if fixed_time else []


def _transition(before: datetime, after: datetime, zone: ZoneInfo) -> datetime:
    """The first second, between ``before`` and ``after``, that has the new UTC offset."""
    new_offset = after.astimezone(zone).utcoffset()
    low, high = int(before.timestamp()), math.ceil(after.timestamp())
    while high - low > 1:
        middle = (low + high) // 2
        if datetime.fromtimestamp(middle, zone).utcoffset() == new_offset:
            high = middle
        else:
            low = middle
    return datetime.fromtimestamp(high, UTC)
