"""The Kit: a preset of the kit's middleware on its broker, configured from the environment.

An application's ``app/worker.py``::

    import dramatiq_gp as gp

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        listeners.register(registry, deps)

    kit = gp.Kit(register).with_closer("database", engine.dispose)
    broker = kit.broker

and ``dramatiq app.worker`` runs it. The Kit builds a :class:`~dramatiq_gp.RedisBroker`
from ``VALKEY_*``/``REDIS_URL``, or with ``BROKER_URL`` set a
:class:`~dramatiq_gp.RabbitmqBroker` (Redis/Valkey then keeps the coordination
state), with :func:`~dramatiq_gp.default_middleware`, the same list a hand-built
broker can take, and adds what the middleware list cannot
hold: the register callback, a schedule of its own (which takes in the
module-level ``@dramatiq_gp.job`` entries), the application's closers, and
:meth:`Kit.dispatch`. Dramatiq imports that module in every worker process, so
everything here is built in the process that uses it; threads start from
Dramatiq's boot hooks, never at import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, overload
from uuid import uuid4

import dramatiq
import redis
from dramatiq import Middleware
from dramatiq.middleware import AsyncIO as DramatiqAsyncIO
from opentelemetry import trace

from .brokers.base import KitBroker
from .brokers.kinds import broker_for
from .errors import BrokerUnreachable, DispatchError, GPError, one_line_at_start_up
from .middleware import Lifecycle, OutboxRelay, SchedulerLease, default_middleware
from .middleware.lifecycle import Closer
from .registry import Registry, default_registry
from .scheduler import Runner, Schedule, Schedules, default_schedule
from .settings import Settings
from .telemetry import Telemetry

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session

    from .outbox import Relay


RegisterFunc = Callable[[Registry, Schedule], None]
M = TypeVar("M", bound=Middleware)
C = TypeVar("C", bound=Callable[[], object])

#: Seconds to wait for Redis to accept a connection before calling it unreachable.
CONNECT_TIMEOUT_S = 5

_current: Kit | None = None


class Kit:
    """Builds a worker's broker with the kit's middleware, listeners, schedule and closers.

    Parameters:
        register: called once with the registry and the schedule; each module of the
            application adds its listeners and jobs there, with its dependencies.
        settings: defaults to :meth:`Settings.from_env`.
        registry: defaults to the one module-level ``@dramatiq_gp.listener`` functions join.
        broker_options: extra keyword arguments for :class:`~dramatiq_gp.RedisBroker`, or
            :class:`~dramatiq_gp.RabbitmqBroker` with ``BROKER_URL`` set (``namespace``,
            ``client``, and that Dramatiq broker's, such as Redis's ``heartbeat_timeout``).
        middleware: extra Dramatiq middleware, added after the kit's own (an ``AsyncIO``
            of the application's replaces the kit's, so there is one event loop).
        engine: the database holding the outbox; defaults to one built from ``DB_*``.
            With a database, :meth:`dispatch` goes through the outbox and each worker
            process runs a relay (unless ``OUTBOX_RELAY=false``).
        tracer_provider: where the kit's spans go; defaults to the global one
            (installed from ``OTEL_*`` in each worker process, or by the application).

    Raises:
        ConfigError: an environment variable is invalid.
    """

    @one_line_at_start_up
    def __init__(
        self,
        register: RegisterFunc | None = None,
        *,
        settings: Settings | None = None,
        registry: Registry | None = None,
        broker_options: Mapping[str, Any] | None = None,
        middleware: Sequence[Middleware] = (),
        engine: sa.Engine | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        global _current
        self.settings = settings if settings is not None else Settings.from_env()
        options = dict(broker_options or {})
        namespace = options.setdefault("namespace", self.settings.redis.namespace)
        self.telemetry = Telemetry(self.settings, namespace=namespace, tracer_provider=tracer_provider)
        self.registry = registry if registry is not None else default_registry
        self.schedule = Schedule(self.settings.scheduler.timezone)
        self.schedule.include(default_schedule)
        self.engine = engine if engine is not None else self._database()
        stack = default_middleware(
            self.settings, registry=self.registry, schedule=self.schedule, engine=self.engine, telemetry=self.telemetry
        )
        self.lifecycle = _find(stack, Lifecycle)
        if engine is None and self.engine is not None:
            self.lifecycle.closers.kit.append(("outbox database", self.engine.dispose))
        if any(isinstance(m, DramatiqAsyncIO) for m in middleware):  # one event loop: the application's
            stack = [m for m in stack if not isinstance(m, DramatiqAsyncIO)]
        self.broker = self._build_broker(options, [*stack, *middleware])
        self.lifecycle.closers.kit.append(("queue client", self.broker.client.connection_pool.disconnect))
        dramatiq.set_broker(self.broker)
        self.registry.bind(self.broker)
        self.schedule.check_options(self.broker.actor_options)
        if register is not None:
            register(self.registry, self.schedule)
        #: The schedule runner of this process (``None`` for an empty schedule without ``SCHEDULER_DYNAMIC``,
        #: which starts no election).
        self.scheduler: Runner | None = _find(stack, SchedulerLease).bind(self.broker)
        relay = next((m for m in stack if isinstance(m, OutboxRelay)), None)
        #: The outbox relay of this process, if it has a database and ``OUTBOX_RELAY`` is on.
        self.relay: Relay | None = relay.bind(self.broker) if relay is not None else None
        self.registry.announce(len(self.schedule))
        _current = self

    @functools.cached_property
    def schedules(self) -> Schedules:
        """The schedule entries stored at run time (:class:`~dramatiq_gp.Schedules`), checked against this broker."""
        return Schedules(
            self.broker.client,
            self.settings.scheduler.namespace or self.broker.namespace,
            timezone=self.settings.scheduler.timezone,
            schedule=self.schedule,
            broker=self.broker,
        )

    def with_closer(self, name: str, close: Closer) -> Kit:
        """Run ``close()`` at shutdown, after in-flight tasks drained (last added, first run)."""
        self.lifecycle.with_closer(name, close)
        return self

    def health_check(self, check: C) -> C:
        """Count each worker process ready only while ``check()`` passes: returns without raising, and not ``False``.

        Run every ``WORKER_HEALTH_INTERVAL`` on a thread of its own, beside the kit's
        (Redis/Valkey, the broker, the database); used as a decorator::

            @kit.health_check
            def search_index() -> None:
                search.ping()
        """
        self.lifecycle.with_health_check(getattr(check, "__name__", repr(check)), check)
        return check

    @overload
    def dispatch(
        self,
        event: object,
        /,
        *,
        envelope_id: str | None = None,
        delay: timedelta | None = None,
        at: datetime | None = None,
    ) -> str: ...

    @overload
    def dispatch(
        self,
        target: Session | sa.Connection,
        event: object,
        /,
        *,
        envelope_id: str | None = None,
        delay: timedelta | None = None,
        at: datetime | None = None,
    ) -> str: ...

    def dispatch(
        self, *args: Any, envelope_id: str | None = None, delay: timedelta | None = None, at: datetime | None = None
    ) -> str:
        """Dispatch an event to its listeners; returns the envelope (event) id.

        ``dispatch(session_or_connection, event)`` writes it to the outbox in that
        transaction: nothing is sent unless it commits. ``dispatch(event)`` goes
        through the outbox in a transaction of its own when the kit has a database,
        and straight to the queue otherwise (every listener's message encoded
        before any is sent, then sent as one batch: on Redis in one round trip,
        all or none).

        ``delay=timedelta(...)`` or ``at=datetime`` (aware) holds the event in the
        outbox until then (see docs/outbox.md, "Delayed and timed events"): it needs
        the database, never the queue.

        Raises:
            EventError: ``event`` is not an event.
            EventEncodeError: its payload cannot be encoded; nothing was written or sent.
            DispatchError: a bad ``delay``/``at``, or one without a database; nothing was written or sent.
        """
        if len(args) == 2:
            return _write_outbox(args[0], args[1], envelope_id, delay, at)
        (event,) = args
        if self.engine is not None:
            with self.engine.begin() as conn:
                return _write_outbox(conn, event, envelope_id, delay, at)
        if delay is not None or at is not None:
            raise DispatchError(
                "a delayed dispatch waits in the outbox: it needs a database (DB_URL), or a session to write it in"
            )
        envelope_id = envelope_id or str(uuid4())
        messages = self.registry.fan_out(event, envelope_id)
        if messages:
            self.broker.enqueue_many(messages)
        return envelope_id

    def check_connection(self) -> None:
        """PING the broker.

        Raises:
            BrokerUnreachable: naming the address (password redacted).
        """
        try:
            self.broker.client.ping()
        except redis.RedisError as exc:
            raise BrokerUnreachable(f"Redis/Valkey unreachable at {self.settings.redis.display()}: {exc}") from None
        self.broker.ping_queues()

    def _database(self) -> sa.Engine | None:
        if not self.settings.db.configured:
            return None  # SQLAlchemy is not even imported without a database
        return self.settings.db.engine()

    def _build_broker(self, options: dict[str, Any], middleware: list[Middleware]) -> KitBroker:
        client = options.pop("client", None) or self.settings.redis.client(
            socket_connect_timeout=CONNECT_TIMEOUT_S, health_check_interval=30
        )
        worker = self.settings.worker
        options.setdefault("unknown_task_grace_ms", int(worker.unknown_task_grace.total_seconds() * 1000))
        options.setdefault("settle_window_ms", worker.settle_window.total_seconds() * 1000)
        return broker_for(self.settings, client, middleware, **options)


def _find(middleware: Sequence[Middleware], kind: type[M]) -> M:
    return next(m for m in middleware if isinstance(m, kind))


def current_kit() -> Kit:
    """The last :class:`Kit` built in this process.

    Raises:
        GPError: none was built.
    """
    if _current is None:
        raise GPError("no dramatiq_gp.Kit has been built in this process; build one before dispatching")
    return _current


@overload
def dispatch(
    event: object, /, *, envelope_id: str | None = None, delay: timedelta | None = None, at: datetime | None = None
) -> str: ...


@overload
def dispatch(
    target: Session | sa.Connection,
    event: object,
    /,
    *,
    envelope_id: str | None = None,
    delay: timedelta | None = None,
    at: datetime | None = None,
) -> str: ...


def dispatch(
    *args: Any, envelope_id: str | None = None, delay: timedelta | None = None, at: datetime | None = None
) -> str:
    """Dispatch an event (see :meth:`Kit.dispatch`), at once or, with ``delay``/``at``, once due.

    ``dispatch(session_or_connection, event)`` needs no Kit: it only writes the
    outbox row, so a web application can call it with just its events imported.
    ``dispatch(event)`` goes through the last Kit built in this process.
    """
    if len(args) == 2:
        return _write_outbox(args[0], args[1], envelope_id, delay, at)
    return current_kit().dispatch(*args, envelope_id=envelope_id, delay=delay, at=at)


async def dispatch_async(
    target: AsyncSession | AsyncConnection,
    event: object,
    /,
    *,
    envelope_id: str | None = None,
    delay: timedelta | None = None,
    at: datetime | None = None,
) -> str:
    """``await gp.dispatch_async(session, event)``: :func:`dispatch` into an async SQLAlchemy transaction.

    Writes the outbox row in the transaction of ``target`` (an ``AsyncSession`` or
    ``AsyncConnection``, e.g. on ``create_async_engine("postgresql+psycopg://...")``),
    exactly as the sync form does: nothing is sent unless it commits, and the
    relays are NOTIFYed at commit, and ``delay``/``at`` hold it until then. Needs no
    Kit. Returns the event id.

    Raises:
        EventError: ``event`` is not an event.
        EventEncodeError: its payload cannot be encoded; nothing was written.
        DispatchError: a bad ``delay``/``at``; nothing was written.
    """
    from .outbox import write_async

    return await write_async(target, event, envelope_id=envelope_id, delay=delay, at=at)


def _write_outbox(
    target: Session | sa.Connection,
    event: object,
    envelope_id: str | None,
    delay: timedelta | None,
    at: datetime | None,
) -> str:
    from .outbox import write

    return write(target, event, envelope_id=envelope_id, delay=delay, at=at)
