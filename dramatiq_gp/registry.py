"""Listeners and the fan-out of an event to them.

Each listener is its own Dramatiq actor, ``listener:<event>:<listener>``, on its
own queue with its own options, so each runs as its own message and is retried
on its own. Fanning an envelope out builds one message per listener whose id is
derived from the envelope id and the actor name: fanning the same envelope out
again yields the same ids, which the idempotent-execution middleware turns into
no-ops.

A direct dispatch fans out at once. An event coming from the outbox arrives as
one ``event:<event>`` message (its id is the event id); that actor, declared
with the first listener of the event, does the fan-out in whichever worker picks
it up, so a relay needs no listeners and a retried fan-out duplicates nothing.

Bound to one of the kit's brokers, a fan-out reaches the listeners of this
registry and those every live worker process has declared
(:mod:`dramatiq_gp.subscriptions`): a listener a rolling deploy adds gets the events
an old worker fans out too.

A listener registered with ``inbox=`` runs in an inbox transaction
(:mod:`dramatiq_gp.exactly_once`): its handler gets the transaction as a second
argument, and its message id commits with what the handler writes there.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from dramatiq import Actor, Broker, Message

from .aio import is_async, require_event_loop
from .errors import RegistrationError, one_line_at_start_up
from .events import EventType, event_type
from .exactly_once import Running, run_handler, run_handler_async
from .names import EVENT_QUEUE, NAME, event_actor, fan_out_id, listener_actor
from .settings import QUEUE_NAME
from .subscriptions import Subscriptions

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Envelope:
    """What a listener may know of the event it handles, besides the event itself."""

    #: The same for every listener and every redelivery of one event: the key that
    #: makes a listener's side effect idempotent (a unique column, a dedup key).
    id: str
    #: The event's wire name.
    event: str
    #: For an event fired by the schedule: the tick it was fired for.
    scheduled_at: datetime | None = None


_envelope: ContextVar[Mapping[str, Any] | None] = ContextVar("dramatiq_gp_envelope", default=None)


def current_envelope() -> Envelope:
    """The envelope of the event the calling listener is handling.

    Raises:
        RuntimeError: called outside a listener.
    """
    envelope = _envelope.get()
    if envelope is None:
        raise RuntimeError("current_envelope() is only available inside a listener")
    scheduled_at = envelope.get("scheduled_at")
    return Envelope(
        id=envelope["id"],
        event=envelope["event"],
        scheduled_at=datetime.fromisoformat(scheduled_at) if scheduled_at else None,
    )


@dataclass(frozen=True)
class Listener:
    """One handler for one event type, with the options its messages carry."""

    event: EventType
    name: str
    handler: Callable[..., object]
    queue: str = "default"
    priority: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    #: An Engine or sessionmaker: the handler runs in an inbox transaction on it.
    inbox: Any = None

    @property
    def actor_name(self) -> str:
        return listener_actor(self.event.name, self.name)


class Registry:
    """The listeners of one application, and the actors that run them.

    Register with :meth:`listen` (handlers that close over dependencies) or the
    :meth:`listener` decorator (module-level functions). Once bound to a broker,
    each new listener is declared as an actor at once.
    """

    def __init__(self) -> None:
        self._by_event: dict[str, list[Listener]] = {}
        self._actor_names: set[str] = set()
        self._broker: Broker | None = None
        self._lock = threading.Lock()
        #: The listeners the live worker processes declared, once bound to one of the kit's brokers.
        self.subscriptions: Subscriptions | None = None
        self._announced = False

    @one_line_at_start_up
    def listen(
        self,
        event_cls: type[Any],
        handler: Callable[..., object],
        *,
        name: str | None = None,
        queue: str = "default",
        priority: int = 0,
        inbox: Any = None,
        **options: Any,
    ) -> Listener:
        """Run ``handler(event)`` for every ``event_cls`` dispatched; an ``async def`` handler is awaited.

        An async handler runs on Dramatiq's event-loop thread (:mod:`dramatiq_gp.aio`):
        the broker needs Dramatiq's ``AsyncIO`` middleware, which the kit's list has.

        Parameters:
            name: the listener's stable name (default: the handler's ``__name__``);
                it is part of the actor name, so renaming it orphans queued messages.
            queue: the queue its messages go to.
            inbox: a SQLAlchemy ``Engine`` (the handler gets a ``Connection``) or
                ``sessionmaker`` (a ``Session``), or for an async handler an ``AsyncEngine``
                or ``async_sessionmaker``: ``handler(event, conn)`` runs in a
                transaction that records the message id in the inbox, so what it
                writes there is applied exactly once (see :func:`dramatiq_gp.inbox`).
            **options: Dramatiq actor options (``max_retries``, ``time_limit``, ...).

        Raises:
            RegistrationError: bad name, queue, handler, inbox or option, or a duplicate.
        """
        kind = event_type(event_cls)
        name = name or str(getattr(handler, "__name__", ""))
        where = f"listener {name!r} of event {kind.name!r}"
        if not NAME.fullmatch(name):
            raise RegistrationError(f"{where}: give it a name= made of letters, digits, '_', '.', '-'")
        if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
            raise RegistrationError(f"{where}: {queue!r} is not a queue name")
        if inbox is not None:
            from .outbox.inbox import check_bind

            check_bind(inbox, where, is_async=is_async(handler))
        _check_handler(where, handler, with_inbox=inbox is not None)
        listener = Listener(kind, name, handler, queue, priority, dict(options), inbox)
        with self._lock:
            taken = self._by_event.setdefault(kind.name, [])
            if any(other.name == name for other in taken):
                raise RegistrationError(f"{where} is registered twice; give one of them another name=")
            taken.append(listener)
            self._actor_names.add(listener.actor_name)
            if self._broker is not None:
                self._declare(listener, self._broker)
        return listener

    def listener(self, event_cls: type[Any], **options: Any) -> Callable[[F], F]:
        """Decorator form of :meth:`listen`; the function itself is returned unchanged."""

        def decorate(handler: F) -> F:
            self.listen(event_cls, handler, **options)
            return handler

        return decorate

    def announce(self, schedule_entries: int) -> None:
        """Log ``start-up: registered N listener(s)...`` once: by the Kit, or by a hand-built broker's worker."""
        if self._announced:
            return
        self._announced = True
        listeners = self.listeners()
        logging.getLogger("dramatiq_gp.kit").info(
            "start-up: registered %d listener(s) for %d event type(s), %d schedule entr%s",
            len(listeners),
            len({listener.event.name for listener in listeners}),
            schedule_entries,
            "y" if schedule_entries == 1 else "ies",
        )

    def listeners(self, event_cls: type[Any] | None = None) -> tuple[Listener, ...]:
        """The listeners of ``event_cls``, or all of them."""
        with self._lock:
            if event_cls is not None:
                return tuple(self._by_event.get(event_type(event_cls).name, ()))
            return tuple(listener for group in self._by_event.values() for listener in group)

    def bind(self, broker: Broker) -> None:
        """Declare every listener as an actor on ``broker``, and later ones as they come.

        On one of the kit's brokers, fan-outs reach the listeners the live worker
        processes declared in its Redis/Valkey as well.
        """
        from .brokers.base import KitBroker

        with self._lock:
            if isinstance(broker, KitBroker) and broker is not self._broker:
                self.subscriptions = Subscriptions(broker.client, broker.namespace)
            self._broker = broker
            for group in self._by_event.values():
                for listener in group:
                    if listener.actor_name not in broker.actors:
                        self._declare(listener, broker)

    def fan_out(self, event: object, envelope_id: str) -> list[Message[Any]]:
        """One message per listener of ``event``, with ids derived from ``envelope_id``.

        Raises:
            EventError: ``event`` is not an event.
            EventEncodeError: its payload cannot be encoded.
        """
        kind = event_type(event)
        envelope: dict[str, Any] = {"id": envelope_id, "event": kind.name, "data": kind.encode(event)}
        return self.messages_for(envelope)

    def messages_for(self, envelope: Mapping[str, Any]) -> list[Message[Any]]:
        """The listener messages of an envelope (``id``, ``event``, ``data``, and ``at``, the ms the
        outbox wrote it, if known): this registry's listeners, then the others the live workers
        declared, and those retired since ``at``.

        Raises:
            redis.RedisError: the declared listeners could not be read (a fan-out is retried).
        """
        event, envelope_id = envelope["event"], envelope["id"]
        targets = [(listener.actor_name, listener.queue) for listener in self._by_event.get(event, ())]
        if self.subscriptions is not None:
            written = envelope.get("at")
            declared = self.subscriptions.of(event, written if isinstance(written, int) else None)
            targets += [(name, queue) for name, queue in declared if name not in self._actor_names]
        return [
            Message(
                queue_name=queue,
                actor_name=actor_name,
                args=(envelope,),
                kwargs={},
                options={},
                message_id=fan_out_id(envelope_id, actor_name),
            )
            for actor_name, queue in targets
        ]

    def _declare(self, listener: Listener, broker: Broker) -> None:
        unknown = set(listener.options) - broker.actor_options
        if unknown:
            raise RegistrationError(
                f"listener {listener.actor_name!r}: unknown option(s) {', '.join(sorted(unknown))}; "
                f"known: {', '.join(sorted(broker.actor_options))}"
            )
        decode, handler, actor_name, bind = listener.event.decode, listener.handler, listener.actor_name, listener.inbox

        def run(envelope: dict[str, Any]) -> None:
            token = _envelope.set(envelope)
            try:
                run_handler(Running(actor_name, envelope["id"]), bind, handler, decode(envelope["data"]))
            finally:
                _envelope.reset(token)

        async def run_async(envelope: dict[str, Any]) -> None:
            # Dramatiq runs this on its event-loop thread, in a copy of the worker
            # thread's context (the middleware's span, scope...): what it sets here
            # stays in this message's task.
            _envelope.set(envelope)
            await run_handler_async(Running(actor_name, envelope["id"]), bind, handler, decode(envelope["data"]))

        fn: Callable[..., Any] = run_async if is_async(handler) else run
        if fn is run_async:
            require_event_loop(broker, f"listener {actor_name!r}")
        fn.__module__ = getattr(handler, "__module__", None) or __name__
        fn.__name__ = fn.__qualname__ = listener.name
        idempotent = idempotent_option(broker)
        Actor(
            fn,
            broker=broker,
            actor_name=listener.actor_name,
            queue_name=listener.queue,
            priority=listener.priority,
            options={**idempotent, **listener.options},
        )
        fan_out_actor = event_actor(listener.event.name)
        if fan_out_actor not in broker.actors:

            def fan_out(envelope: dict[str, Any]) -> None:
                send_all(broker, self.messages_for(envelope))

            Actor(
                fan_out, broker=broker, actor_name=fan_out_actor, queue_name=EVENT_QUEUE, priority=0, options=idempotent
            )


def idempotent_option(broker: Broker) -> dict[str, Any]:
    """``idempotent=True`` for the kit's actors, where the broker has :class:`~dramatiq_gp.IdempotentExecution`."""
    return {"idempotent": True} if "idempotent" in broker.actor_options else {}


def send_all(broker: Broker, messages: Sequence[Message[Any]]) -> None:
    """Send ``messages``: as one batch on the kit's brokers (``enqueue_many``); one by one on another."""
    if not messages:
        return
    enqueue_many = getattr(broker, "enqueue_many", None)
    if enqueue_many is not None:
        enqueue_many(messages)
        return
    for message in messages:
        broker.enqueue(message)


def _check_handler(where: str, handler: object, *, with_inbox: bool = False) -> None:
    if not callable(handler):
        raise RegistrationError(f"{where}: handler {handler!r} is not callable")
    try:
        inspect.signature(handler).bind(*([object()] * (2 if with_inbox else 1)))
    except TypeError as exc:
        shape = "two arguments: the event and the inbox transaction" if with_inbox else "the event as its one argument"
        raise RegistrationError(f"{where}: the handler must take {shape} ({exc})") from None
    except ValueError:  # builtins without a signature
        pass


#: The registry module-level ``@dramatiq_gp.listener`` functions join; a Kit uses it unless given another.
default_registry = Registry()


def listener(event_cls: type[Any], **options: Any) -> Callable[[F], F]:
    """Register a module-level function as a listener of ``event_cls`` (see :meth:`Registry.listen`)."""
    return default_registry.listener(event_cls, **options)
