"""Runs of a schedule entry asked for by hand: one now, or the ticks of a past window (a backfill).

The operator's tools (``dramatiq-gp schedule run|backfill``, the dashboard) read Redis,
not the application's code. So every worker publishes, beside each entry's trigger, its
firing :class:`Template` (``<ns>:scheduler:templates``): what a firing enqueues apart
from its id and time. The leader builds its ticks' messages from the same template
(:func:`tick_message`), so a message built here cannot drift from the leader's.

**Run now** (:func:`run_message`): one message with an id of its own (a random UUID,
never a tick's), ``scheduled_at`` the time of the request, and ``"manual": true`` and
``"id"`` in the firing (a job's inbox keys its transaction by that id, not by a tick's).
It runs whether or not the entry is paused: it was asked for by name.

**Backfill** (:func:`backfill_ticks`): the ticks of a window, under the message ids the
leader gives them (:func:`~dramatiq_gp.names.tick_message_id`). What a tick is
(:func:`tick_states`):

* ``ran``: its message id has a done mark, so it completed within
  ``WORKER_DEDUP_RETENTION`` (24 h by default);
* ``fired``: its claim key (``<ns>:scheduler:tick:<entry>:<ms>``) exists: the leader
  enqueued it (the key lives ``SCHEDULER_CATCHUP_GRACE`` + 1 min), or a backfill did
  (the key lives the retention); it is queued, running, retrying or dead;
* ``will run``: neither. A tick older than both (its run completed more than the
  retention ago, or its claim lapsed with no done mark) cannot be told from one that
  never ran: it shows, and runs, as ``will run``.

A backfill claims each tick with ``SET NX`` on the leader's own claim key, so the
leader, another backfill or a repeat cannot enqueue it again; the claim lives a minute
until its message is sent, then the retention (``settle.lua``), or is given up if the
send fails. A copy enqueued all the same (a claim that lapsed) carries the tick's
message id, and idempotent execution runs one.

An entry on an APScheduler trigger publishes only its trigger's description, from which
its past ticks cannot be computed: a backfill needs the trigger object itself.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import redis
from apscheduler.triggers.base import BaseTrigger
from dramatiq import Message

from .. import keys
from ..brokers.done_marks import are_done
from ..lua import scripts
from ..names import tick_message_id
from .cron import CronError, parse
from .dynamic import decode_raw
from .schedule import Entry, ScheduleError
from .targets import Checker
from .triggers import SpecTrigger, first_at_or_after, following

_SCRIPTS = scripts(__file__)

#: The most ticks one backfill enqueues: a longer window is refused, to be done a part at a time.
MAX_BACKFILL = 1000
#: How long a backfill's claim lives until its message is sent (a backfill that died meanwhile frees the tick).
PENDING_MS = 60_000

RAN, FIRED, WILL_RUN = "ran", "fired", "will run"


@dataclass(frozen=True)
class Template:
    """What a firing of entry ``name`` enqueues, apart from its message id and scheduled time."""

    name: str
    #: The trigger as written (:attr:`Entry.text`): a cron string, or an APScheduler trigger's description.
    trigger: str
    zone: ZoneInfo
    queue: str
    actor: str
    options: Mapping[str, Any]
    #: Event entries: the event's name and encoded payload.
    event: str | None = None
    data: Any = None
    #: Stored entries that send an actor of the application: its arguments (the message's, not a firing's).
    args: tuple[Any, ...] | None = None
    kwargs: Mapping[str, Any] | None = None
    #: Stored entries: their trigger itself, from which a backfill computes past ticks (not published: stored).
    stored_trigger: BaseTrigger | None = None

    @classmethod
    def of(cls, entry: Entry, *, stored: bool = False) -> Template:
        event = entry.event.name if entry.event is not None else entry.event_name
        return cls(
            entry.name,
            entry.text,
            entry.zone,
            entry.queue,
            entry.actor_name,
            entry.options,
            event,
            entry.payload,
            entry.args if entry.actor is not None else None,
            entry.kwargs,
            entry.trigger if stored else None,
        )

    def encode(self) -> str:
        fields: dict[str, Any] = {"trigger": self.trigger, "zone": self.zone.key, "queue": self.queue}
        fields.update(actor=self.actor, options=dict(self.options))
        if self.event is not None:
            fields.update(event=self.event, data=self.data)
        return json.dumps(fields)

    @classmethod
    def decode(cls, name: str, raw: bytes | str) -> Template:
        """Raises: ScheduleError: not a template this version writes (the message names the entry)."""
        try:
            fields = json.loads(raw)
            event = fields.get("event")
            return cls(
                name,
                fields["trigger"],
                ZoneInfo(fields["zone"]),
                fields["queue"],
                fields["actor"],
                dict(fields["options"]),
                event,
                fields["data"] if event is not None else None,
            )
        except (ValueError, TypeError, KeyError, ZoneInfoNotFoundError) as exc:
            raise ScheduleError(f"schedule entry {name!r}: its published template cannot be read ({exc!r})") from None

    def message(self, message_id: str, scheduled_at: datetime, **marks: Any) -> Message[Any]:
        """The firing for ``scheduled_at`` under ``message_id``; ``marks`` join the firing's fields (an
        actor's stored entry sends the actor's own arguments: no firing, no marks)."""
        firing: dict[str, Any] = {"entry": self.name, "scheduled_at": scheduled_at.astimezone(self.zone).isoformat()}
        if self.event is not None:
            firing.update(id=message_id, event=self.event, data=self.data)
        firing.update(marks)
        return Message(
            queue_name=self.queue,
            actor_name=self.actor,
            args=(firing,) if self.args is None else self.args,
            kwargs=dict(self.kwargs or {}),
            options=dict(self.options),
            message_id=message_id,
            message_timestamp=int(time.time() * 1000),
        )


def tick_message(template: Template, tick: datetime) -> Message[Any]:
    """The message of ``tick``, as the leader enqueues it and a backfill does."""
    return template.message(tick_message_id(template.name, tick), tick)


def run_message(template: Template, now: datetime | None = None) -> Message[Any]:
    """A run of the entry now, besides its ticks: an id of its own, and marked as asked for by hand."""
    message_id = str(uuid.uuid4())
    return template.message(message_id, now or datetime.now(UTC), id=message_id, manual=True)


def template(client: redis.Redis, scheduler: keys.SchedulerKeys, name: str) -> Template | None:
    """The template of entry ``name``, as its workers published it; ``None`` when no worker published the entry.

    The one place a template is looked up: a code entry's, as its workers published it, or an entry stored
    at run time (:mod:`.dynamic`), built from what is stored.

    Raises:
        ScheduleError: the entry is published without a template (its workers predate it), or an unreadable one.
    """
    with client.pipeline(transaction=False) as pipe:
        pipe.hget(scheduler.templates, name)
        pipe.hexists(scheduler.entries, name)
        pipe.hget(scheduler.dynamic, name)
        raw, published, stored = pipe.execute()
    if raw is not None:
        return Template.decode(name, raw)
    if stored is not None:
        entry = decode_raw(name, stored)
        Checker(client, scheduler).entry(entry)  # stored before its target was marked, or since unmarked
        return Template.of(entry, stored=True)
    if published:
        raise ScheduleError(
            f"schedule entry {name!r} was published by workers older than `schedule run`, with no template to "
            "build its message from: restart them on this version"
        )
    return None


def backfill_ticks(
    template: Template, start: datetime, end: datetime, trigger: BaseTrigger | None = None
) -> list[datetime]:
    """The ticks of the entry from ``start`` to ``end``, both included.

    ``trigger``: the entry's APScheduler trigger, whose past ticks Redis cannot tell; a
    cron entry needs none (its published text is enough).

    Raises:
        ScheduleError: an APScheduler entry and no ``trigger`` (or another one), or more than :data:`MAX_BACKFILL`.
    """
    where = f"schedule entry {template.name!r}"
    trigger = trigger or template.stored_trigger
    if trigger is not None:
        if str(trigger) != template.trigger:
            raise ScheduleError(f"{where} fires on {template.trigger!r}: the trigger given is {str(trigger)!r}")
    else:
        try:
            trigger = SpecTrigger(parse(template.trigger), template.zone)
        except CronError:
            raise ScheduleError(
                f"{where} fires on an APScheduler trigger ({template.trigger}), whose past ticks cannot be computed "
                "from Redis: give the trigger object with --trigger module:attribute"
            ) from None
    ticks: list[datetime] = []
    tick = first_at_or_after(trigger, start)
    while tick is not None and tick <= end:
        if len(ticks) == MAX_BACKFILL:
            raise ScheduleError(
                f"{where} has more than {MAX_BACKFILL} ticks from {start.isoformat()} to {end.isoformat()}: "
                "backfill a shorter window, a part at a time"
            )
        ticks.append(tick)
        tick = following(trigger, tick)
    return ticks


def tick_states(
    client: redis.Redis, scheduler: keys.SchedulerKeys, namespace: str, name: str, ticks: Sequence[datetime]
) -> list[str]:
    """Each tick's :data:`RAN`, :data:`FIRED` or :data:`WILL_RUN` (see the module's docstring); ``namespace``:
    the queues' namespace, where the done marks are."""
    with client.pipeline(transaction=False) as pipe:
        for tick in ticks:
            pipe.exists(scheduler.tick(name, _ms(tick)))
        claimed = pipe.execute()
    done = are_done(client, namespace, [tick_message_id(name, tick) for tick in ticks])
    return [RAN if ran else FIRED if fired else WILL_RUN for fired, ran in zip(claimed, done, strict=True)]


def claim_ticks(
    client: redis.Redis, scheduler: keys.SchedulerKeys, name: str, ticks: Sequence[datetime], token: str
) -> list[bool]:
    """Claim each tick on the leader's own claim key, for :data:`PENDING_MS`; which this call claimed."""
    with client.pipeline(transaction=False) as pipe:
        for tick in ticks:
            pipe.set(scheduler.tick(name, _ms(tick)), token, nx=True, px=PENDING_MS)
        return [bool(claimed) for claimed in pipe.execute()]


def settle_claims(
    client: redis.Redis,
    scheduler: keys.SchedulerKeys,
    name: str,
    ticks: Sequence[datetime],
    token: str,
    keep_ms: int,
) -> None:
    """Keep the claims ``token`` holds on ``ticks`` for ``keep_ms`` (their messages were sent), or give them up
    (0: they were not)."""
    if ticks:
        tick_keys = [scheduler.tick(name, _ms(tick)) for tick in ticks]
        client.eval(_SCRIPTS["settle"], len(tick_keys), *tick_keys, token, keep_ms)


def is_paused(client: redis.Redis, scheduler: keys.SchedulerKeys, name: str) -> bool:
    return bool(client.hexists(scheduler.paused, name))


def _ms(instant: datetime) -> int:
    return round(instant.timestamp() * 1000)
