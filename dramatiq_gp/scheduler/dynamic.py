"""Schedules the application creates at run time: stored in Redis, fired by the leader from a due-time index.

A code entry exists because a module declared it; a **stored entry** exists because
the application (``kit.schedules.add(...)``) or an operator (``dramatiq-gp schedule
add``) wrote it: one digest per customer, each in the customer's zone. The leader
fires both with the same claim (``outlet/claim.lua``): every tick once, fenced by the
lease, paused and resumed by name, caught up under ``SCHEDULER_CATCHUP``.

**Why Redis, not PostgreSQL.** The lease, the claims and the last fired ticks are in
Redis already; an entry kept there is written, indexed and fenced in the same
server, by one Lua call, and survives what those survive (a restart with
persistence, a Sentinel failover). PostgreSQL is optional in the kit, and a
scheduler that needs two servers to fire has two ways to stop.

**Keys** (under ``<ns>:scheduler:``):

* ``dynamic``: name → the entry as JSON (:func:`encode`);
* ``due``: a sorted set, name → the ms of its next tick not yet fired. The leader
  reads only what is due (``ZRANGEBYSCORE -inf now``) and the head, never the whole
  set: 100,000 entries cost the leader nothing until they fire.
* ``names``: a sorted set of the names, every one at score 0, so that
  :meth:`Schedules.list` reads one page of them by name and prefix
  (``ZRANGEBYLEX``, O(log N) plus the page) where the hash could only be scanned
  whole. About 120 bytes an entry.

A code entry keeps its name: storing an entry under a name a worker published
(``<ns>:scheduler:entries``) or this process's schedule holds is refused.
"""

from __future__ import annotations

import builtins
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, Literal, cast
from zoneinfo import ZoneInfo

import redis
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger
from dramatiq import Actor

from .. import keys
from ..durations import EPOCH, MAX_AHEAD
from ..errors import EventEncodeError, EventError, PayloadMismatch
from ..events import event_type, event_type_named
from ..lua import scripts
from ..names import EVENT_QUEUE, NAME
from ..records import RECORD_DEPTH, TooDeep, check_depth, json_object, json_value, text, unreadable
from ..settings import QUEUE_NAME
from .cron import CronError, parse
from .schedule import OVERLAP_OPTION, OVERLAPS, Entry, Overlap, Schedule, ScheduleError, check_known, zone_named
from .targets import Checker, refuse_kit_task_type, refuse_options
from .triggers import SpecTrigger

logger = logging.getLogger(__name__)

_SCRIPTS = scripts(__file__)

#: The largest JSON an entry may take, so one entry cannot fill the server.
MAX_ENTRY_BYTES = 16_384

Added = Literal["added", "replaced"]


@dataclass(frozen=True)
class StoredEntry:
    """A stored entry as :meth:`Schedules.get` and :meth:`Schedules.list` return it."""

    name: str
    #: The trigger as written: a cron spec, ``@every``, ``interval[...]`` or ``date[...]``.
    trigger: str
    zone: str
    #: ``event`` (dispatched afresh at each tick) or ``actor`` (sent with its arguments); ``unreadable`` for
    #: a record that cannot be read (written by hand, by another version): its mark is the trigger.
    kind: Literal["event", "actor", "unreadable"]
    #: The event's wire name, or the actor's name.
    target: str
    #: The event's payload, or the actor's ``{"args": [...], "kwargs": {...}}``.
    data: Any
    queue: str
    options: Mapping[str, Any]
    #: The next tick not yet fired, in the entry's zone; ``None`` when it fires no more.
    next_fire: datetime | None = None


@dataclass(frozen=True)
class EventByName:
    """An event given by its wire name and payload, where its class is not loaded (``dramatiq-gp schedule add``)."""

    name: str
    data: Any


class Schedules:
    """Add, change and remove schedule entries at run time; the scheduler's leader fires them.

    Get it from the Kit (``kit.schedules``), which checks actors, queues and options
    against the application's broker, or build it on a Redis client alone (the CLI
    does), which checks only their shape.

    Parameters:
        client: the scheduler's Redis.
        namespace: the scheduler's namespace (``SCHEDULER_NAMESPACE``, by default ``VALKEY_NAMESPACE``).
        timezone: the zone of entries given no ``tz=`` (``SCHEDULER_TIMEZONE``).
        schedule: the code schedule, whose names stored entries may not take.
        broker: the application's broker, to check actors, queues and options against.
        warn_leaderless: log a warning (once) when an entry is stored while no leader runs; the CLI
            says so on its own output instead (:meth:`leader_runs`).
    """

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        *,
        timezone: str = "UTC",
        schedule: Schedule | None = None,
        broker: Any = None,
        warn_leaderless: bool = True,
    ) -> None:
        self.client, self.keys = client, keys.SchedulerKeys(namespace)
        self.zone = zone_named(timezone, "SCHEDULER_TIMEZONE")
        self._schedule, self._broker = schedule, broker
        # The published list read once per few seconds: a loop storing thousands of entries reads it once.
        self._targets = Checker(client, self.keys, broker, max_age_s=5.0)
        self._add = client.register_script(_SCRIPTS["add"])
        self._remove = client.register_script(_SCRIPTS["remove"])
        self._warned = not warn_leaderless

    def add(
        self,
        name: str,
        when: str | BaseTrigger,
        target: object,
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        tz: str | None = None,
        queue: str | None = None,
        replace: bool = False,
        overlap: Overlap = "allow",
        **options: Any,
    ) -> Added:
        """Store the entry ``name``: ``target`` fires whenever ``when`` does, from the next tick on.

        ``when`` is a cron spec (five fields, a descriptor, ``@every 90s``), an
        APScheduler ``IntervalTrigger`` (its ``start_date`` is stored, so every leader
        counts from the same instant) or ``DateTrigger``. ``target`` is an event
        instance (dispatched afresh at each tick, fanned out to its listeners) or a
        Dramatiq actor, or its name (sent with ``args`` and ``kwargs``). ``options``
        are message options (``max_retries``, ``time_limit``...).

        With ``replace=True`` an entry of that name is changed, and its ticks start
        again from the next one of the new trigger; without, an existing name is refused.
        ``overlap=`` (``"skip"``, ``"wait"``) keeps an actor's runs from overlapping, as
        for a code job (``docs/scheduling.md``, overlapping runs).

        Raises:
            ScheduleError: one line naming the entry and what is wrong with it.
        """
        where = f"schedule entry {name!r}"
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ScheduleError(f"{where}: a name is letters, digits, '_', '.', '-'")
        if self._schedule is not None and any(entry.name == name for entry in self._schedule):
            raise ScheduleError(f"{where} is defined in code: a stored entry may not take its name")
        zone = self.zone if tz is None else zone_named(tz, where)
        if OVERLAP_OPTION in options:
            raise ScheduleError(f"{where}: give overlap=, not {OVERLAP_OPTION}=")
        if overlap not in OVERLAPS:
            raise ScheduleError(f"{where}: overlap={overlap!r} is not one of {', '.join(map(repr, OVERLAPS))}")
        if overlap != "allow":
            options[OVERLAP_OPTION] = {"key": name, "mode": overlap}
        refuse_options(where, options)
        given = {"args": args, "kwargs": kwargs, "options": options}
        if isinstance(target, EventByName):
            given["data"] = target.data
        for part, value in given.items():  # before the checks that walk them, and json.dumps: both recurse
            try:
                check_depth(value)
            except TooDeep as exc:
                raise ScheduleError(f"{where}: {part}: {exc}") from None
        record = {"trigger": encode_trigger(when, zone, where), "zone": zone.key, "options": dict(options)}
        record.update(self._target(where, target, args, kwargs, queue))
        if overlap != "allow" and "event" in record:
            raise ScheduleError(f"{where}: overlap= is for an actor: an event's listeners run as tasks of their own")
        self._check_options(name, options)
        entry = decode(name, record)  # what the leader will read back, checked before it is written
        data = json.dumps(record, separators=(",", ":"))
        if len(data) > MAX_ENTRY_BYTES:
            raise ScheduleError(f"{where}: {len(data)} bytes as JSON, more than {MAX_ENTRY_BYTES}")
        due = entry.next_after(datetime.now(UTC))
        outcome = text(
            self._add(
                keys=[self.keys.dynamic, self.keys.due, self.keys.entries, self.keys.names],
                args=[name, data, "" if due is None else _ms(due), 1 if replace else 0],
            )
        )
        if outcome == "code":
            raise ScheduleError(f"{where} is a code entry a worker published: a stored entry may not take its name")
        if outcome == "exists":
            raise ScheduleError(f"{where} exists already: replace it to change it (replace=True, --replace)")
        if not self._warned and not self.leader_runs():
            self._warned = True  # once per process: a loop adding entries before the workers start says it once
            logger.warning(
                "%s stored, but no scheduler leader runs in namespace %s: it fires once a worker with a schedule, "
                "or with SCHEDULER_DYNAMIC=true, runs",
                where,
                self.keys.namespace,
            )
        return cast(Added, outcome)

    def leader_runs(self) -> bool:
        """Whether a scheduler leader holds the lease in this namespace now (one fires stored entries)."""
        return bool(self.client.exists(self.keys.lease))

    def remove(self, name: str) -> bool:
        """Remove the stored entry ``name``; its ticks stop at once. False if there is none."""
        return bool(
            self._remove(
                keys=[self.keys.dynamic, self.keys.due, self.keys.last_fired, self.keys.paused, self.keys.names],
                args=[name],
            )
        )

    def get(self, name: str) -> StoredEntry | None:
        """The stored entry ``name``, if there is one."""
        raw, due = self.client.hget(self.keys.dynamic, name), self.client.zscore(self.keys.due, name)
        return None if raw is None else _stored(name, raw, due)

    def list(self, prefix: str = "", *, limit: int = 100, after: str | None = None) -> builtins.list[StoredEntry]:
        """Up to ``limit`` stored entries whose name starts with ``prefix``, by name; with ``after``, those
        whose name comes after it: pass the last name of a page to get the next.

        A page costs two round trips whatever the number of entries (``ZRANGEBYLEX`` on the name index,
        then ``HMGET`` and ``ZMSCORE`` of that page). A record that cannot be read (written by hand, by
        another version) is listed with ``kind="unreadable"`` and its mark as its trigger.
        """
        # Names are ASCII (NAME): every one starting with the prefix sorts before the prefix and 0xff.
        low = f"({after}" if after is not None and after >= prefix else f"[{prefix}"
        names = [
            text(n)
            for n in self.client.zrangebylex(self.keys.names, low, f"[{prefix}".encode() + b"\xff", start=0, num=limit)
        ]
        if not names:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(self.keys.dynamic, names)
            pipe.zmscore(self.keys.due, names)
            raws, dues = pipe.execute()
        return [_stored(n, raw, due) for n, raw, due in zip(names, raws, dues, strict=True) if raw is not None]

    def next_due(self, count: int = 10) -> builtins.list[StoredEntry]:
        """The ``count`` stored entries that fire next."""
        heads = cast(builtins.list[tuple[Any, float]], self.client.zrange(self.keys.due, 0, count - 1, withscores=True))
        if not heads:
            return []
        raws = self.client.hmget(self.keys.dynamic, [n for n, _ in heads])
        return [_stored(text(n), raw, due) for (n, due), raw in zip(heads, raws, strict=True) if raw is not None]

    def __len__(self) -> int:
        return int(self.client.hlen(self.keys.dynamic))

    def __iter__(self) -> Iterator[str]:
        """The stored entries' names, in no order (a scan: it holds no lock on the server)."""
        return (text(n) for n, _ in self.client.hscan_iter(self.keys.dynamic, count=1000))

    def _target(
        self, where: str, target: object, args: Sequence[Any], kwargs: Mapping[str, Any] | None, queue: str | None
    ) -> dict[str, Any]:
        if isinstance(target, Actor | str):
            actor = self._targets.actor(where, target.actor_name if isinstance(target, Actor) else target)
            if queue is not None and queue != actor.queue:
                raise ScheduleError(
                    f"{where}: actor {actor.name!r} runs from queue {actor.queue!r} only (a worker refuses its "
                    f"messages on another), not {queue!r}"
                )
            actor.check_call(where, args, kwargs or {})
            return {"actor": actor.name, "args": list(args), "kwargs": dict(kwargs or {}), "queue": actor.queue}
        if args or kwargs:
            raise ScheduleError(f"{where}: args= and kwargs= are for an actor; an event carries its payload")
        if queue is not None:
            raise ScheduleError(f"{where}: queue= is for an actor; an event's listeners choose their own queues")
        if isinstance(target, EventByName):
            name, data = target.name, target.data
            own = event_type_named(name) if self._broker is not None else None
        else:
            try:
                own = event_type(target)
                if isinstance(target, type):
                    raise ScheduleError(f"{where}: give an event instance, not the class")
                name, data = own.name, own.encode(target)
            except (EventError, EventEncodeError) as exc:
                raise ScheduleError(
                    f"{where}: {exc} (the target is an event instance, an actor, or an actor's name)"
                ) from None
        self._targets.event(where, name).check_data(where, data)
        if own is not None:
            try:
                own.decode(data)
            except PayloadMismatch as exc:
                raise ScheduleError(f"{where}: {exc}") from None
        return {"event": name, "data": data, "queue": EVENT_QUEUE}

    def _check_options(self, name: str, options: Mapping[str, Any]) -> None:
        known = getattr(self._broker, "actor_options", None)
        if known is not None:
            check_known(name, options, known)


def encode_trigger(when: object, zone: ZoneInfo, where: str) -> Any:
    """``when`` as the JSON the entry keeps: a cron spec as written, or the fields of a storable trigger.

    Raises:
        ScheduleError: not a cron spec, an ``IntervalTrigger`` without jitter or a ``DateTrigger``.
    """
    if isinstance(when, str):
        try:
            return parse(when).text
        except CronError as exc:
            raise ScheduleError(f"{where}: {exc}") from None
    if isinstance(when, IntervalTrigger):
        if when.jitter:
            raise ScheduleError(f"{where}: a stored IntervalTrigger takes no jitter (each leader would draw its own)")
        end = when.end_date.isoformat() if when.end_date is not None else None
        return {"interval_s": when.interval.total_seconds(), "start": when.start_date.isoformat(), "end": end}
    if isinstance(when, DateTrigger):
        # Aware differences, as a date past 9999 in a zone east of UTC cannot even be shown in the entry's zone.
        if not EPOCH <= when.run_date <= datetime.now(UTC) + MAX_AHEAD:
            raise ScheduleError(f"{where}: a DateTrigger's date is from 1970 to 100 years ahead, not {when.run_date}")
        return {"date": when.run_date.isoformat()}
    raise ScheduleError(
        f"{where}: {when!r} cannot be stored: give a cron spec, @every, an IntervalTrigger or a DateTrigger"
    )


def decode(name: str, record: Mapping[str, Any]) -> Entry:
    """The entry a stored record describes, as the leader fires it.

    Raises:
        ScheduleError: the record cannot be read (written by hand, or by another version).
    """
    where = f"schedule entry {name!r}"
    try:
        zone = zone_named(record["zone"], where)
        trigger = _trigger(json.dumps(record["trigger"], sort_keys=True), zone.key)
        queue, options = record["queue"], record.get("options") or {}
        if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
            raise ScheduleError(f"{where}: {queue!r} is not a queue name")
        if not isinstance(options, dict):
            raise ScheduleError(f"{where}: its options are not a JSON object")
        refuse_options(where, options)
        common: dict[str, Any] = {"name": name, "trigger": trigger, "zone": zone, "queue": queue, "options": options}
        common["fixed_zone"] = True
        if "event" in record:
            return Entry(event_name=str(record["event"]), payload=record.get("data"), **common)
        args, kwargs = record.get("args") or [], record.get("kwargs") or {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ScheduleError(f"{where}: its args are not a JSON list, or its kwargs not an object")
        actor = str(record["actor"])
        refuse_kit_task_type(where, actor)
        return Entry(actor=actor, args=tuple(args), kwargs=kwargs, **common)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ScheduleError):
            raise
        raise ScheduleError(f"{where}: unreadable stored entry ({exc!r})") from None


def decode_raw(name: str, raw: bytes | str) -> Entry:
    """:func:`decode` of the JSON as Redis holds it."""
    try:
        record = json_value(raw, RECORD_DEPTH)
    except ValueError as exc:
        raise ScheduleError(f"schedule entry {name!r}: unreadable stored entry ({exc})") from None
    if not isinstance(record, dict):
        raise ScheduleError(f"schedule entry {name!r}: a stored entry is a JSON object")
    return decode(name, record)


@lru_cache(maxsize=4096)
def _trigger(encoded: str, zone_name: str) -> BaseTrigger:
    """The trigger of an encoded one, built once per spec and zone: 100,000 digests share a few hundred."""
    zone, spec = ZoneInfo(zone_name), json.loads(encoded)
    if isinstance(spec, str):
        return SpecTrigger(parse(spec), zone)
    if not isinstance(spec, dict):
        raise ValueError(f"trigger {spec!r}")
    if "date" in spec:
        return DateTrigger(datetime.fromisoformat(spec["date"]))
    end = spec.get("end")
    return IntervalTrigger(
        seconds=float(spec["interval_s"]),
        start_date=datetime.fromisoformat(spec["start"]),
        end_date=datetime.fromisoformat(end) if end else None,
        timezone=zone,
    )


def _stored(name: str, raw: bytes | str, due: float | None) -> StoredEntry:
    record = json_object(raw)
    if isinstance(record, str):
        return _unreadable(name, record)
    try:
        entry = decode(name, record)
    except ScheduleError as exc:
        why = str(exc).removeprefix(f"schedule entry {name!r}: ")
        if why.startswith("unreadable stored entry ("):
            why = why.removeprefix("unreadable stored entry (").removesuffix(")")
        return _unreadable(name, unreadable(why))
    is_event = entry.event_name is not None
    return StoredEntry(
        name=name,
        trigger=entry.text,
        zone=entry.zone.key,
        kind="event" if is_event else "actor",
        target=entry.event_name or entry.actor or "",
        data=record.get("data") if is_event else {"args": list(entry.args), "kwargs": dict(entry.kwargs or {})},
        queue=entry.queue,
        options=entry.options,
        next_fire=None if due is None else datetime.fromtimestamp(due / 1000, entry.zone),
    )


def _unreadable(name: str, mark: str) -> StoredEntry:
    """A record that cannot be read, listed with its mark so that the rest of its page still shows."""
    return StoredEntry(name, mark, "", "unreadable", "", None, "", {})


def _ms(instant: datetime) -> int:
    return round(instant.timestamp() * 1000)
