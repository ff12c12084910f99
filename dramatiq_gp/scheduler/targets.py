"""What a stored schedule entry may target: the actors and events the application marked schedulable.

A stored entry is data that makes the workers run code: whoever stores one chooses
what runs, with which arguments, at every tick. So it may target only what the
application's code allows, marked with :func:`schedulable`:

* an **actor** marked ``@dramatiq_gp.schedulable``, sent on the queue it is declared
  on (never another: a worker refuses a message from a queue its actor is not on),
  with arguments its function accepts;
* an **event** class marked the same way, with data that has the fields it requires
  and no field it lacks;
* never one of the kit's own task types (``listener:``, ``event:``, ``schedule:``,
  ``job:``): those run a listener on an envelope or a job on a firing, whose shape
  only the kit builds.

Every worker that runs a scheduler **publishes** the targets its code marks
(``<ns>:scheduler:schedulable``: kind and name → queue and parameters, as JSON) and
withdraws those it declares unmarked, so the dashboard and ``dramatiq-gp schedule
add``, which do not load the application's code, check against the same list. The
leader checks again before firing, against its own code where it declares the target
and against the published list where it does not: an entry stored before its target
was marked, after it was unmarked, or written into Redis by hand is passed over, said
once.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import redis
from dramatiq import Actor, Broker

from .. import keys
from ..events import EventType, event_type_named
from ..names import EVENT_QUEUE
from ..records import text
from .schedule import OVERLAP_OPTION, Entry, ScheduleError

#: The task types the kit declares itself: a stored entry never targets one.
KIT_TASK_TYPES = ("listener:", "event:", "schedule:", "job:")

#: The message options a stored entry may carry: Dramatiq's budgets and limits, and the kit's ``overlap=``.
#: Others are refused (Dramatiq's ``on_success``/``on_failure``/``pipe_target`` would run another actor, or
#: send a message the entry spells out, when its run ends).
STORED_OPTIONS = frozenset({"max_retries", "min_backoff", "max_backoff", "time_limit", "max_age", OVERLAP_OPTION})

#: The attribute :func:`schedulable` sets on an actor or an event class.
_MARK = "__gp_schedulable__"

Kind = Literal["actor", "event"]


@dataclass(frozen=True)
class Target:
    """A schedulable actor or event, as the workers publish it."""

    kind: Kind
    name: str
    #: The queue its messages go to: the actor's own; the fan-out's for an event.
    queue: str
    #: An actor's parameters: ``(name, kind, has a default)``, the kind as :class:`inspect.Parameter` names it.
    params: tuple[tuple[str, str, bool], ...] = ()
    #: An event's fields, and those of them it requires; ``None`` when its schema cannot be told.
    fields: tuple[str, ...] | None = None
    required: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """Its field in the published hash: actors and events are named apart."""
        return f"{self.kind}:{self.name}"

    def encode(self) -> str:
        return json.dumps(
            {"queue": self.queue, "params": self.params, "fields": self.fields, "required": self.required},
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, field: str, raw: bytes | str) -> Target | None:
        """The target a published field describes; ``None`` for one this version cannot read."""
        kind, _, name = field.partition(":")
        try:
            record = json.loads(raw)
            fields = record.get("fields")
            return cls(
                cast(Kind, kind),
                name,
                str(record["queue"]),
                tuple((str(n), str(k), bool(d)) for n, k, d in record.get("params") or ()),
                None if fields is None else tuple(map(str, fields)),
                tuple(map(str, record.get("required") or ())),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    def check_call(self, where: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Raises: ScheduleError: the actor's function does not take ``args`` and ``kwargs``."""
        parameters = [
            inspect.Parameter(
                name, getattr(inspect.Parameter, kind), default=None if default else inspect.Parameter.empty
            )
            for name, kind, default in self.params
        ]
        try:
            inspect.Signature(parameters).bind(*args, **kwargs)
        except TypeError as exc:
            shape = ", ".join(name for name, _, _ in self.params)
            raise ScheduleError(f"{where}: actor {self.name!r} ({shape}) cannot take these arguments: {exc}") from None

    def check_data(self, where: str, data: Any) -> None:
        """Raises: ScheduleError: ``data`` lacks a field the event requires, or has one it does not know."""
        if self.fields is None:
            return
        if not isinstance(data, dict):
            raise ScheduleError(f"{where}: event {self.name!r} takes a JSON object of its fields")
        if missing := [f for f in self.required if f not in data]:
            raise ScheduleError(f"{where}: event {self.name!r} requires field(s) {', '.join(missing)}")
        if unknown := [str(f)[:60] for f in data if f not in self.fields]:
            known = ", ".join(self.fields) or "none"
            raise ScheduleError(f"{where}: event {self.name!r} has no field(s) {', '.join(unknown)} (it has {known})")


def schedulable(target: Any) -> Any:
    """Mark an actor or an event class as a target of stored schedule entries; returns it unchanged.

    Stored entries (``kit.schedules.add``, ``dramatiq-gp schedule add``, the
    dashboard) may target only what is marked: a decorator above ``@dramatiq.actor``
    or ``@dramatiq_gp.event``, or a call on either::

        @dramatiq_gp.schedulable
        @dramatiq.actor(queue_name="reports")
        def send_statement(customer_id: int) -> None: ...

    Raises:
        ScheduleError: ``target`` is neither, or one of the kit's own task types.
    """
    if isinstance(target, Actor):
        if target.actor_name.startswith(KIT_TASK_TYPES):
            raise ScheduleError(f"{target.actor_name!r} is one of the kit's own task types: it cannot be scheduled")
    elif not (isinstance(target, type) and isinstance(target.__dict__.get("__gp_event__"), EventType)):
        raise ScheduleError(
            f"schedulable() takes a Dramatiq actor or a class decorated with @dramatiq_gp.event, not {target!r}"
        )
    setattr(target, _MARK, True)
    return target


def is_schedulable(target: object) -> bool:
    """Whether ``target`` (an actor, or an event class) was marked with :func:`schedulable`."""
    owner = target if isinstance(target, type) else None
    if owner is not None:
        return bool(owner.__dict__.get(_MARK))  # a subclass of a marked event is an event of its own
    return bool(getattr(target, _MARK, False))


@functools.lru_cache(maxsize=4096)
def of_actor(actor: Actor[Any, Any]) -> Target:
    """What ``actor`` publishes: its queue and its function's parameters (computed once: the leader asks at
    every firing)."""
    try:
        signature = inspect.signature(actor.fn)
    except (TypeError, ValueError):  # a builtin without one: any call is left to the actor
        params: tuple[tuple[str, str, bool], ...] = (("args", "VAR_POSITIONAL", False), ("kw", "VAR_KEYWORD", False))
    else:
        params = tuple(
            (p.name, p.kind.name, p.default is not inspect.Parameter.empty) for p in signature.parameters.values()
        )
    return Target("actor", actor.actor_name, actor.queue_name, params)


@functools.lru_cache(maxsize=4096)
def of_event(kind: EventType) -> Target:
    """What an event type publishes: its fields, and those it requires, from its JSON schema (computed once)."""
    try:
        schema = kind.adapter.json_schema()
        fields: tuple[str, ...] | None = tuple(schema.get("properties", ())) if schema["type"] == "object" else None
        required = tuple(schema.get("required", ()))
    except Exception:  # a type pydantic cannot describe: its data is checked by its listeners only
        fields, required = None, ()
    return Target("event", kind.name, EVENT_QUEUE, fields=fields, required=required)


def marked(broker: Broker, events: Iterable[EventType]) -> tuple[list[Target], list[str]]:
    """The targets ``broker``'s actors and ``events`` mark, and the published fields of those they leave unmarked."""
    found: list[Target] = []
    unmarked: list[str] = []
    for actor in broker.actors.values():
        if actor.actor_name.startswith(KIT_TASK_TYPES):
            continue
        if is_schedulable(actor):
            found.append(of_actor(actor))
        else:
            unmarked.append(f"actor:{actor.actor_name}")
    for kind in events:
        if is_schedulable(kind.cls):
            found.append(of_event(kind))
        else:
            unmarked.append(f"event:{kind.name}")
    return found, unmarked


def publish(client: redis.Redis, scheduler: keys.SchedulerKeys, broker: Broker, events: Iterable[EventType]) -> None:
    """Publish what this process's code marks schedulable, and withdraw what it declares unmarked."""
    found, unmarked = marked(broker, events)
    with client.pipeline(transaction=True) as pipe:
        if unmarked:
            pipe.hdel(scheduler.schedulable, *unmarked)
        if found:
            pipe.hset(scheduler.schedulable, mapping={t.field: t.encode() for t in found})
        pipe.execute()


def published(client: redis.Redis, scheduler: keys.SchedulerKeys) -> dict[str, Target]:
    """The targets the workers publish, by field (``actor:<name>``, ``event:<name>``); a kit task type written
    there by hand is left out."""
    found = {}
    for raw_field, raw in client.hgetall(scheduler.schedulable).items():
        field = text(raw_field)
        target = Target.decode(field, raw)
        if target is not None and not (target.kind == "actor" and target.name.startswith(KIT_TASK_TYPES)):
            found[field] = target
    return found


def refuse_kit_task_type(where: str, actor: str) -> None:
    """Raises: ScheduleError: ``actor`` is one of the kit's own task types."""
    if actor.startswith(KIT_TASK_TYPES):
        raise ScheduleError(f"{where}: {actor!r} is one of the kit's own task types, never a stored entry's target")


def refuse_options(where: str, options: Mapping[str, Any]) -> None:
    """Raises: ScheduleError: an option a stored entry may not carry (:data:`STORED_OPTIONS`)."""
    if refused := sorted(str(o)[:60] for o in options if o not in STORED_OPTIONS):
        allowed = ", ".join(sorted(o for o in STORED_OPTIONS if o != OVERLAP_OPTION))
        raise ScheduleError(f"{where}: option(s) {', '.join(refused)} cannot be stored (only {allowed})")


class Checker:
    """Which targets a process may store or fire: its own code's where it declares the target, else the published.

    Parameters:
        client: the scheduler's Redis, where the published list is.
        scheduler: its keys.
        broker: the application's broker, whose actors (and this process's events) are its own code; ``None``
            where the code is not loaded (the CLI, the dashboard).
        max_age_s: how long a published list read is used again (the leader reads it once per few seconds,
            not once per firing).
    """

    def __init__(
        self, client: redis.Redis, scheduler: keys.SchedulerKeys, broker: Broker | None = None, *, max_age_s: float = 0
    ) -> None:
        self.client, self.keys, self.broker, self.max_age_s = client, scheduler, broker, max_age_s
        self._read: tuple[float, dict[str, Target]] | None = None

    def actor(self, where: str, name: str) -> Target:
        """The schedulable actor ``name``.

        Raises:
            ScheduleError: a kit task type, or an actor that is not schedulable (or not known at all).
        """
        refuse_kit_task_type(where, name)
        own = self.broker.actors.get(name) if self.broker is not None else None
        if own is not None:
            if not is_schedulable(own):
                raise ScheduleError(f"{where}: actor {name!r} is not schedulable: {_HOW}")
            return of_actor(own)
        found = self.published().get(f"actor:{name}")
        if found is None:
            raise ScheduleError(f"{where}: no worker publishes an actor {name!r} as schedulable: {_HOW}")
        return found

    def event(self, where: str, name: str) -> Target:
        """The schedulable event ``name``.

        Raises:
            ScheduleError: an event that is not schedulable (or not known at all).
        """
        own = event_type_named(name) if self.broker is not None else None
        if own is not None:
            if not is_schedulable(own.cls):
                raise ScheduleError(f"{where}: event {name!r} is not schedulable: {_HOW}")
            return of_event(own)
        found = self.published().get(f"event:{name}")
        if found is None:
            raise ScheduleError(f"{where}: no worker publishes an event {name!r} as schedulable: {_HOW}")
        return found

    def entry(self, entry: Entry) -> None:
        """Check a stored entry's target before it fires or runs: it may have been stored before its target was
        marked, after it was unmarked, or written into Redis by hand.

        Raises:
            ScheduleError: its target is not (or no longer) schedulable, or it goes to another queue than its actor's.
        """
        where = f"schedule entry {entry.name!r}"
        if entry.event_name is not None:
            self.event(where, entry.event_name)
            return
        actor = self.actor(where, entry.actor_name)
        if entry.queue != actor.queue:
            raise ScheduleError(
                f"{where}: goes to queue {entry.queue!r}, but actor {actor.name!r} runs from {actor.queue!r}"
            )

    def published(self) -> dict[str, Target]:
        """The targets the workers publish (read again once older than ``max_age_s``)."""
        now = time.monotonic()
        if self._read is None or now - self._read[0] > self.max_age_s:
            self._read = (now, published(self.client, self.keys))
        return self._read[1]


_HOW = "mark it with @dramatiq_gp.schedulable in the application's code and run a worker on that code"
