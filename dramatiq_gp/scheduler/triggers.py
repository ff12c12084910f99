"""Triggers: when an entry's ticks fall, in APScheduler 3's trigger protocol.

APScheduler is the timer: every schedule entry is an APScheduler job, and its
trigger's ``get_next_fire_time(previous_fire_time, now)`` says when it fires next.

* A cron string (five fields, a descriptor, ``@every``) is the kit's own engine
  (:mod:`dramatiq_gp.scheduler.cron`) wrapped as a trigger, :class:`SpecTrigger`.
  Not APScheduler's ``CronTrigger``, which is not standard cron; measured on
  3.11.3 against the standard-cron vectors: it fires a fixed-time entry twice on
  autumn DST days, places spring-gap times an hour early, rejects valid specs such
  as ``5-6/3`` and Sunday-based weekday ranges, and counts weekdays from Monday.
* ``@every`` ticks at whole multiples of the interval since the Unix epoch, so
  every replica, and every leader after a takeover, computes the same ticks.
* Any APScheduler trigger object works as is (``IntervalTrigger``,
  ``CalendarIntervalTrigger``, ``DateTrigger``, ``OrTrigger``/``AndTrigger``...).
  A tick is claimed by its time, so a trigger whose times differ between processes
  (an ``IntervalTrigger`` without ``start_date`` counts from when each process
  started; ``jitter`` is random) can fire a tick twice, once per leader, around a
  takeover; give it a ``start_date`` and no jitter where that matters.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.interval import IntervalTrigger

from .cron import Cron, Every, Spec

_TICK = timedelta(microseconds=1)


class SpecTrigger(BaseTrigger):  # type: ignore[misc]
    """A cron spec, descriptor or ``@every`` of the kit's engine, evaluated in ``zone``, as an APScheduler trigger."""

    __slots__ = ("spec", "zone")

    def __init__(self, spec: Spec, zone: ZoneInfo) -> None:
        self.spec = spec
        self.zone = zone

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime:
        # APScheduler's contract: the first fire at or after ``now``, or right after
        # ``previous_fire_time`` when that is earlier (run times it missed).
        before_now = now.astimezone(UTC) - _TICK
        after = before_now if previous_fire_time is None else min(previous_fire_time, before_now)
        return self.spec.next_after(after, self.zone)

    def __str__(self) -> str:
        return self.spec.text

    def __repr__(self) -> str:
        return f"<SpecTrigger {self.spec.text!r} in {self.zone.key}>"


def just_after(instant: datetime) -> datetime:
    """A microsecond later, in UTC: in a local zone that would add wall time, and lose the fold of a repeated hour."""
    return instant.astimezone(UTC) + _TICK


def first_at_or_after(trigger: BaseTrigger, instant: datetime) -> datetime | None:
    """The trigger's first fire time at or after ``instant``; ``None`` if it fires no more."""
    fire: datetime | None = trigger.get_next_fire_time(None, instant)
    # A one-off trigger answers its date whatever the time; before ``instant`` it is behind us.
    while fire is not None and fire < instant:
        fire = following(trigger, fire)
    return fire


def following(trigger: BaseTrigger, fire: datetime) -> datetime | None:
    """The trigger's fire time right after ``fire``; ``None`` if it fires no more."""
    after: datetime | None = trigger.get_next_fire_time(fire, just_after(fire))
    return after


def upcoming(trigger: BaseTrigger, after: datetime, count: int) -> list[datetime]:
    """Up to ``count`` fire times strictly after ``after``."""
    times: list[datetime] = []
    fire = first_at_or_after(trigger, just_after(after))
    while fire is not None and len(times) < count:
        times.append(fire)
        fire = following(trigger, fire)
    return times


def interval_of(trigger: BaseTrigger) -> timedelta | None:
    """A fixed interval between the trigger's fires, if it has one (for Sentry's monitor schedule)."""
    if isinstance(trigger, SpecTrigger) and isinstance(trigger.spec, Every):
        return trigger.spec.interval
    if isinstance(trigger, IntervalTrigger):
        interval: timedelta = trigger.interval
        return interval
    return None


def crontab_of(trigger: BaseTrigger) -> str | None:
    """The trigger as a five-field cron spec, if it is one of the kit's (for Sentry's monitor schedule)."""
    if isinstance(trigger, SpecTrigger) and isinstance(trigger.spec, Cron):
        return trigger.spec.text
    return None
