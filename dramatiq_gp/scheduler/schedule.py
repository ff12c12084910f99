"""The Schedule: built fluently in code, every method returns the schedule.

Two kinds of entries:

* an **event schedule** (:meth:`Schedule.every`, :meth:`~Schedule.daily_at`,
  :meth:`~Schedule.cron`): each firing dispatches the event afresh, fanned out to
  all its listeners exactly like a dispatch at run time (task type ``schedule:<event>``);
* a **job schedule** (:meth:`Schedule.job`): one named handler, no fan-out
  (task type ``job:<name>``).

Everything is checked as the entry is added: the spec, the zone, the name, the
handler's shape, the options; the error names the entry.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal, TypeAlias, overload
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.base import BaseTrigger

from ..aio import is_async
from ..durations import format_duration, parse_duration
from ..errors import EventEncodeError, EventError, GPError, one_line_at_start_up
from ..events import EventType, event_type
from ..names import NAME, event_actor, job_actor, schedule_actor
from ..settings import QUEUE_NAME
from .cron import CronError, parse
from .triggers import SpecTrigger, first_at_or_after, just_after

_HH_MM = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")

JobHandler = Callable[..., object]
#: When an entry fires: a cron spec (five fields, a descriptor, ``@every``) or an APScheduler trigger.
When: TypeAlias = str | BaseTrigger
#: What a job's run does while the entry's previous run is still running (``overlap=``).
Overlap: TypeAlias = Literal["allow", "skip", "wait"]
OVERLAPS = ("allow", "skip", "wait")
#: The message option that carries ``overlap=``: ``{"key": <entry>, "mode": "skip" | "wait"}``. The
#: message carries it, not only the actor, so every run of the entry honours it, whoever enqueued it.
OVERLAP_OPTION = "gp_overlap"


class ScheduleError(GPError, ValueError):
    """A schedule entry is malformed; the message names the entry."""


@dataclass(frozen=True)
class Entry:
    """One line of the schedule."""

    name: str
    #: When it fires: the kit's cron engine (:class:`SpecTrigger`) or any APScheduler trigger.
    trigger: BaseTrigger
    zone: ZoneInfo
    queue: str
    #: Options of the message enqueued at each firing (``max_retries``, ``time_limit``...).
    options: Mapping[str, Any]
    #: Event schedules: the event's type and encoded payload.
    event: EventType | None = None
    payload: Any = None
    #: Job schedules: the handler, and whether it takes the scheduled time.
    handler: JobHandler | None = None
    takes_time: bool = False
    #: Job schedules: an Engine or sessionmaker whose inbox transaction the handler runs in (it gets it last).
    inbox: Any = None
    #: Whether the entry gave its own zone (``tz=``) rather than the schedule's.
    fixed_zone: bool = False
    #: Stored entries (:mod:`.dynamic`) that dispatch an event: its wire name (the payload in ``payload``);
    #: each tick goes to the event's fan-out actor, as a dispatch from the outbox does.
    event_name: str | None = None
    #: Stored entries that send an actor of the application: its name, and its arguments.
    actor: str | None = None
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] | None = None

    @property
    def overlap(self) -> Overlap:
        """What a run does while the previous one is still running (``overlap=`` of :meth:`Schedule.job`)."""
        guard = self.options.get(OVERLAP_OPTION)
        return guard["mode"] if guard else "allow"

    @property
    def actor_name(self) -> str:
        if self.actor is not None:
            return self.actor
        if self.event_name is not None:
            return event_actor(self.event_name)
        return job_actor(self.name) if self.handler is not None else schedule_actor(self.event.name)  # type: ignore[union-attr]

    @property
    def text(self) -> str:
        """The trigger as written: the cron spec, or the APScheduler trigger's own description."""
        return str(self.trigger)

    def next_after(self, after: datetime) -> datetime | None:
        """The first fire strictly after ``after``; ``None`` when it fires no more."""
        return first_at_or_after(self.trigger, just_after(after))

    def inzone_named(self, zone: ZoneInfo) -> Entry:
        """This entry evaluated in ``zone``, unless it gave its own (``tz=``) or its trigger has its own."""
        if self.fixed_zone:
            return self
        trigger = SpecTrigger(self.trigger.spec, zone) if isinstance(self.trigger, SpecTrigger) else self.trigger
        return replace(self, trigger=trigger, zone=zone)


class Schedule:
    """What the elected leader fires. An empty schedule starts no leader election.

    Parameters:
        timezone: the IANA zone specs are evaluated in (``SCHEDULER_TIMEZONE``).
        known_options: option names a message may carry (the Kit passes the broker's).
    """

    @one_line_at_start_up
    def __init__(self, timezone: str = "UTC", *, known_options: set[str] | None = None) -> None:
        self.zone = zone_named(timezone, "the schedule")
        self._known_options = known_options
        self._entries: dict[str, Entry] = {}
        #: The first entry that sends each task type.
        self._senders: dict[str, Entry] = {}

    @one_line_at_start_up
    def every(self, interval: timedelta, event: object, *, name: str | None = None, **options: Any) -> Schedule:
        """Dispatch ``event`` every ``interval`` (ticks anchored to the Unix epoch)."""
        if not isinstance(interval, timedelta) or interval < timedelta(seconds=1):
            raise ScheduleError(f"schedule entry {name or _event_name(event)!r}: interval must be a timedelta >= 1s")
        return self._add_event(f"@every {format_duration(interval)}", event, name, None, options)

    @one_line_at_start_up
    def daily_at(
        self, at: str, event: object, *, name: str | None = None, tz: str | None = None, **options: Any
    ) -> Schedule:
        """Dispatch ``event`` every day at ``"HH:MM"`` local time (once per day across DST changes)."""
        match = _HH_MM.match(at) if isinstance(at, str) else None
        if not match:
            raise ScheduleError(f"schedule entry {name or _event_name(event)!r}: daily_at({at!r}) is not HH:MM")
        return self._add_event(f"{int(match[2])} {int(match[1])} * * *", event, name, tz, options)

    @one_line_at_start_up
    def cron(
        self, spec: When, event: object, *, name: str | None = None, tz: str | None = None, **options: Any
    ) -> Schedule:
        """Dispatch ``event`` whenever ``spec`` fires: a cron spec, or any APScheduler trigger."""
        return self._add_event(spec, event, name, tz, options)

    @overload
    def job(
        self,
        name: str,
        spec: When,
        handler: JobHandler,
        *,
        tz: str | None = None,
        inbox: Any = None,
        overlap: Overlap = "allow",
        **options: Any,
    ) -> Schedule: ...

    @overload
    def job(
        self,
        name: str,
        spec: When,
        handler: None = None,
        *,
        tz: str | None = None,
        inbox: Any = None,
        overlap: Overlap = "allow",
        **options: Any,
    ) -> Callable[[JobHandler], JobHandler]: ...

    @one_line_at_start_up
    def job(
        self,
        name: str,
        spec: When,
        handler: JobHandler | None = None,
        *,
        tz: str | None = None,
        inbox: Any = None,
        overlap: Overlap = "allow",
        **options: Any,
    ) -> Schedule | Callable[[JobHandler], JobHandler]:
        """Run ``handler`` (task ``job:<name>``) whenever ``spec`` fires; without a handler, a decorator.

        ``spec`` is a cron spec (standard five fields, a descriptor, ``@every``) or any
        APScheduler trigger (``IntervalTrigger(minutes=5, start_date=...)``,
        ``DateTrigger(...)``...). The handler takes no argument, or one: the scheduled
        time (an aware datetime in the entry's zone). What it raises is retried
        (``max_retries=`` to change the budget); options such as ``queue``,
        ``time_limit`` apply to each firing. With ``inbox=`` (a SQLAlchemy ``Engine``
        or ``sessionmaker``) the handler also takes, last, the inbox transaction of
        the firing: what it writes there is applied once per tick (see
        :func:`dramatiq_gp.inbox`).

        ``overlap=`` says what a run does while the entry's previous run is still
        running, in any worker process: ``"allow"`` (the default) runs it anyway,
        ``"skip"`` drops it (logged and counted), ``"wait"`` holds its worker thread
        until the previous run ends. It needs :class:`~dramatiq_gp.OverlapGuard` in
        the broker's middleware (the Kit's list has it); see ``docs/scheduling.md``.
        """
        if handler is None:

            def decorate(fn: JobHandler) -> JobHandler:
                self.job(name, spec, fn, tz=tz, inbox=inbox, overlap=overlap, **options)
                return fn

            return decorate
        if inbox is not None:
            from ..outbox.inbox import check_bind

            try:
                check_bind(inbox, f"schedule entry {name!r}", is_async=is_async(handler))
            except GPError as exc:
                raise ScheduleError(str(exc)) from None
        takes_time = _job_shape(name, handler, with_inbox=inbox is not None)
        if OVERLAP_OPTION in options:
            raise ScheduleError(f"schedule entry {name!r}: give overlap=, not {OVERLAP_OPTION}=")
        if overlap not in OVERLAPS:
            raise ScheduleError(
                f"schedule entry {name!r}: overlap={overlap!r} is not one of {', '.join(map(repr, OVERLAPS))}"
            )
        if overlap != "allow":
            options = {**options, OVERLAP_OPTION: {"key": name, "mode": overlap}}
        common = self._common(name, spec, tz, options)
        self._add(Entry(name=name, handler=handler, takes_time=takes_time, inbox=inbox, **common))
        return self

    @property
    def entries(self) -> tuple[Entry, ...]:
        return tuple(self._entries.values())

    @one_line_at_start_up
    def use_timezone(self, timezone: str) -> None:
        """Evaluate the entries that gave no ``tz=`` of their own in ``timezone`` (``SCHEDULER_TIMEZONE``)."""
        self.zone = zone_named(timezone, "the schedule")
        self._entries = {name: entry.inzone_named(self.zone) for name, entry in self._entries.items()}

    @one_line_at_start_up
    def check_options(self, known: set[str]) -> None:
        """Accept only ``known`` message options, from now on and in the entries already here.

        Raises:
            ScheduleError: an entry carries another option; the error names it.
        """
        self._known_options = known
        for entry in self._entries.values():
            check_known(entry.name, entry.options, known)

    def include(self, other: Schedule) -> None:
        """Add ``other``'s entries (the module-level ``@dramatiq_gp.job`` ones, say) to this schedule.

        Raises:
            ScheduleError: an entry name is taken here already.
        """
        for entry in other:
            self._add(entry.inzone_named(self.zone))

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def _add_event(
        self, spec: When, event: object, name: str | None, tz: str | None, options: dict[str, Any]
    ) -> Schedule:
        try:
            kind = event_type(event)
        except EventError as exc:
            raise ScheduleError(f"schedule entry {name or str(spec)!r}: {exc}") from None
        if isinstance(event, type):
            raise ScheduleError(f"schedule entry {name or kind.name!r}: give an event instance, not the class")
        name = name or kind.name
        if "overlap" in options or OVERLAP_OPTION in options:
            raise ScheduleError(
                f"schedule entry {name!r}: overlap= is for jobs: an event's listeners run as tasks of their own"
            )
        try:
            payload = kind.encode(event)
        except EventEncodeError as exc:
            raise ScheduleError(f"schedule entry {name!r}: {exc}") from None
        self._add(Entry(name=name, event=kind, payload=payload, **self._common(name, spec, tz, options)))
        return self

    def _common(self, name: str, spec: When, tz: str | None, options: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ScheduleError(f"schedule entry {name!r}: a name is letters, digits, '_', '.', '-'")
        zone = self.zone if tz is None else zone_named(tz, f"schedule entry {name!r}")
        if isinstance(spec, BaseTrigger):
            trigger = spec
        elif isinstance(spec, str):
            try:
                trigger = SpecTrigger(parse(spec), zone)
            except CronError as exc:
                raise ScheduleError(f"schedule entry {name!r}: {exc}") from None
        else:
            raise ScheduleError(f"schedule entry {name!r}: {spec!r} is neither a cron spec nor an APScheduler trigger")
        options = dict(options)
        queue = options.pop("queue", "default")
        if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
            raise ScheduleError(f"schedule entry {name!r}: {queue!r} is not a queue name")
        if self._known_options is not None:
            check_known(name, options, self._known_options)
        try:
            json.dumps(options)
        except TypeError as exc:
            raise ScheduleError(f"schedule entry {name!r}: options travel as JSON ({exc})") from None
        fixed = tz is not None or not isinstance(trigger, SpecTrigger)
        return {"trigger": trigger, "zone": zone, "fixed_zone": fixed, "queue": queue, "options": options}

    def _add(self, entry: Entry) -> None:
        if entry.name in self._entries:
            raise ScheduleError(f"schedule entry {entry.name!r} is defined twice; give one of them another name=")
        # One task type runs from one queue (a worker refuses it from any other).
        other = self._senders.setdefault(entry.actor_name, entry)
        if other.queue != entry.queue:
            raise ScheduleError(
                f"schedule entries {other.name!r} and {entry.name!r} both send task {entry.actor_name!r}, on "
                f"queues {other.queue!r} and {entry.queue!r}: a task runs from one queue only; give them one queue="
            )
        self._entries[entry.name] = entry


def check_known(name: str, options: Mapping[str, Any], known: set[str]) -> None:
    if OVERLAP_OPTION in options and OVERLAP_OPTION not in known:
        mode = options[OVERLAP_OPTION]["mode"]
        raise ScheduleError(
            f"schedule entry {name!r}: overlap={mode!r} needs dramatiq_gp.OverlapGuard in the broker's middleware"
        )
    if unknown := set(options) - known:
        raise ScheduleError(f"schedule entry {name!r}: unknown option(s) {', '.join(sorted(unknown))}")


def zone_named(name: str, where: str) -> ZoneInfo:
    """The IANA zone ``name``.

    Raises:
        ScheduleError: no such zone; the message starts with ``where``.
    """
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise ScheduleError(f"{where}: {name!r} is not an IANA time zone (e.g. UTC, Europe/Budapest)") from None


def _event_name(event: object) -> str:
    try:
        return event_type(event).name
    except EventError:
        return repr(event)


def _job_shape(name: str, handler: object, *, with_inbox: bool = False) -> bool:
    where = f"schedule entry {name!r}"
    if not callable(handler):
        raise ScheduleError(f"{where}: handler {handler!r} is not callable")
    signature = inspect.signature(handler)
    inbox = [None] if with_inbox else []  # the transaction comes last
    try:
        signature.bind(*inbox)
        return False
    except TypeError:
        pass
    try:
        signature.bind(None, *inbox)
        return True
    except TypeError:
        shape = f"{getattr(handler, '__name__', 'handler')}{signature}"
        wanted = (
            "the inbox transaction, or two (the scheduled time, then the transaction)"
            if with_inbox
            else "no argument, or one (the scheduled time)"
        )
        raise ScheduleError(f"{where}: the handler must take {wanted}, not {shape}") from None


#: The schedule module-level ``@dramatiq_gp.job`` functions join; the Kit and
#: :class:`~dramatiq_gp.SchedulerLease` fire it unless given another.
default_schedule = Schedule()


@one_line_at_start_up
def job(
    name: str,
    *,
    cron: str | None = None,
    every: str | timedelta | None = None,
    trigger: BaseTrigger | None = None,
    tz: str | None = None,
    inbox: Any = None,
    overlap: Overlap = "allow",
    **options: Any,
) -> Callable[[JobHandler], JobHandler]:
    """Decorator: run the function as the job ``name`` (task ``job:<name>``) on a schedule.

    Give one of ``cron`` (a cron spec, ``@daily``, ``@every 90s``...), ``every``
    (``"5m"`` or a ``timedelta``) or ``trigger`` (any APScheduler trigger, such as
    ``IntervalTrigger(minutes=5, start_date=...)``). Options (``inbox=``, ``overlap=`` too)
    as for :meth:`Schedule.job`. The entry joins :data:`default_schedule`, which every worker's Kit or
    :class:`~dramatiq_gp.SchedulerLease` fires::

        @dramatiq_gp.job("reports.nightly", cron="0 3 * * *", queue="reports")
        def nightly_report() -> None: ...

    Raises:
        ScheduleError: not exactly one of ``cron``, ``every`` and ``trigger``, or a bad entry.
    """
    if [cron, every, trigger].count(None) != 2:
        raise ScheduleError(f"schedule entry {name!r}: give one of cron=, every= and trigger=")
    spec: When
    if every is not None:
        interval = every if isinstance(every, timedelta) else _interval(name, every)
        if interval < timedelta(seconds=1):
            raise ScheduleError(f"schedule entry {name!r}: every= must be at least 1s")
        spec = f"@every {format_duration(interval)}"
    else:
        spec = cron if cron is not None else trigger

    def decorate(handler: JobHandler) -> JobHandler:
        default_schedule.job(name, spec, handler, tz=tz, inbox=inbox, overlap=overlap, **options)
        return handler

    return decorate


def _interval(name: str, text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise ScheduleError(f"schedule entry {name!r}: every={text!r}: {exc}") from None
