"""The worker chassis: one object that builds the broker, the registry and the schedule.

An application's ``app/worker.py``::

    import dramatiq_gp as gp

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        listeners.register(registry, deps)

    kit = gp.Kit(register).with_closer("database", engine.dispose)
    broker = kit.broker

and ``dramatiq app.worker`` runs it. Dramatiq imports that module in every worker
process, so everything here is built in the process that uses it; threads start
from Dramatiq's boot hooks, never at import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload
from uuid import uuid4

import dramatiq
import redis
from dramatiq import Middleware
from dramatiq.middleware import AgeLimit, Callbacks, Pipelines, ShutdownNotifications, TimeLimit
from opentelemetry import trace

from .broker import Broker
from .errors import BrokerUnreachable, GPError, one_line_at_start_up
from .lifecycle import Closer, Closers, Lifecycle, Producer
from .middleware import IdempotentExecution, Metrics, PanicRecovery, QueueWeights, Retries, TaskLog, Tracing
from .registry import Registry, default_registry
from .scheduler import Runner, Schedule
from .scheduler.schedule import Entry
from .settings import Settings
from .telemetry import Telemetry, configure_logging

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    from .outbox import Relay

logger = logging.getLogger(__name__)

RegisterFunc = Callable[[Registry, Schedule], None]

#: Seconds to wait for Redis to accept a connection before calling it unreachable.
CONNECT_TIMEOUT_S = 5

_current: Kit | None = None


def _ms(value: Any) -> int:
    return int(value.total_seconds() * 1000)


class Kit:
    """Builds and runs a worker: broker, middleware, listeners, schedule and closers.

    Parameters:
        register: called once with the registry and the schedule; each module of the
            application adds its listeners and jobs there, with its dependencies.
        settings: defaults to :meth:`Settings.from_env`.
        registry: defaults to the one module-level ``@dramatiq_gp.listener`` functions join.
        broker_options: extra keyword arguments for Dramatiq's ``RedisBroker``
            (``namespace``, ``heartbeat_timeout``, ``client``...).
        middleware: extra Dramatiq middleware, added after the kit's own.
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
        configure_logging(self.settings.log, send_default_pii=self.settings.sentry.send_default_pii)
        namespace = (broker_options or {}).get("namespace") or self.settings.queue.namespace
        self.telemetry = Telemetry(self.settings, namespace=namespace, tracer_provider=tracer_provider)
        logger.info(
            "start-up: logging ready (level %s, %s); tracing %s, metrics %s, Sentry %s",
            logging.getLevelName(logging.getLogger().level), self.settings.log.format,
            *("on" if on else "off" for on in (self.telemetry.tracing, self.telemetry.metrics, self.telemetry.sentry)),
        )  # fmt: skip
        self._closers = Closers()
        self._producers: list[Producer] = []
        self.broker = self._build_broker(dict(broker_options or {}), middleware)
        self._closers.kit.append(("queue client", self.broker.client.connection_pool.disconnect))
        dramatiq.set_broker(self.broker)
        self.engine, self.relay = self._build_outbox(engine)
        self.registry = registry if registry is not None else default_registry
        self.registry.bind(self.broker)
        self.schedule = Schedule(self.settings.scheduler.timezone, known_options=self.broker.actor_options)
        if register is not None:
            register(self.registry, self.schedule)
        self.scheduler = self._build_scheduler()
        listeners = self.registry.listeners()
        logger.info(
            "start-up: registered %d listener(s) for %d event type(s), %d schedule entr%s",
            len(listeners), len({listener.event.name for listener in listeners}),
            len(self.schedule), "y" if len(self.schedule) == 1 else "ies",
        )  # fmt: skip
        _current = self

    def with_closer(self, name: str, close: Closer) -> Kit:
        """Run ``close()`` at shutdown, after in-flight tasks drained (last added, first run)."""
        self._closers.app.append((name, close))
        return self

    @overload
    def dispatch(self, event: object, /, *, envelope_id: str | None = None) -> str: ...

    @overload
    def dispatch(self, target: Session | sa.Connection, event: object, /, *, envelope_id: str | None = None) -> str: ...

    def dispatch(self, *args: Any, envelope_id: str | None = None) -> str:
        """Dispatch an event to its listeners; returns the envelope (event) id.

        ``dispatch(session_or_connection, event)`` writes it to the outbox in that
        transaction: nothing is sent unless it commits. ``dispatch(event)`` goes
        through the outbox in a transaction of its own when the kit has a database,
        and straight to the queue otherwise (every listener's message encoded
        before any is sent, all sent in one round trip or none).

        Raises:
            EventError: ``event`` is not an event.
            EventEncodeError: its payload cannot be encoded; nothing was written or sent.
        """
        if len(args) == 2:
            return _write_outbox(args[0], args[1], envelope_id)
        (event,) = args
        if self.engine is not None:
            with self.engine.begin() as conn:
                return _write_outbox(conn, event, envelope_id)
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
            raise BrokerUnreachable(f"Redis/Valkey unreachable at {self.settings.queue.display()}: {exc}") from None
        logger.info("start-up: broker reachable at %s", self.settings.queue.display())

    def _build_outbox(self, engine: sa.Engine | None) -> tuple[sa.Engine | None, Relay | None]:
        if engine is None and not self.settings.db.configured:
            return None, None  # SQLAlchemy is not even imported without a database
        import sqlalchemy as sa

        from .outbox import Relay, set_notify

        if engine is None:
            db = self.settings.db
            engine = sa.create_engine(db.sqlalchemy_url(), pool_size=db.pool_size, pool_pre_ping=True)
            self._closers.kit.append(("outbox database", engine.dispose))
        set_notify(self.settings.outbox.notify)
        if not self.settings.outbox.relay:
            return engine, None
        relay = Relay(engine=engine, broker=self.broker, settings=self.settings.outbox)
        self._producers.append(relay)
        self._closers.kit.append((relay.name, relay.close))
        return engine, relay

    def _build_scheduler(self) -> Runner | None:
        if not self.schedule:  # an empty schedule starts no leader election
            return None
        runner = Runner(
            schedule=self.schedule,
            broker=self.broker,
            registry=self.registry,
            settings=self.settings.scheduler,
            namespace=self.settings.scheduler.namespace or self.broker.namespace,
            tracer_provider=self.telemetry.tracer_provider,
        )
        self._producers.insert(0, runner)  # stops first: no firing while the relay winds down
        return runner

    def _build_broker(self, options: dict[str, Any], extra: Sequence[Middleware]) -> Broker:
        worker, queue = self.settings.worker, self.settings.queue
        client = options.pop("client", None) or redis.Redis.from_url(
            queue.connection_url(),
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            health_check_interval=30,
            **queue.client_options(),
        )
        namespace = options.setdefault("namespace", queue.namespace)
        lifecycle = Lifecycle(
            telemetry=self.telemetry,
            check_connection=self.check_connection,
            producers=self._producers,
            closers=self._closers,
            shutdown_timeout_ms=_ms(worker.shutdown_timeout) if worker.shutdown_timeout is not None else None,
        )
        # Order matters: Dramatiq runs before-hooks in this order and after-hooks in
        # reverse, so the lifecycle sees everything first and last, every message
        # (a skipped duplicate too) gets a span and a Sentry scope, a retry is sent
        # from inside its span, and the task log, metrics and Sentry read Retries' verdict.
        idempotency = IdempotentExecution(
            client=client, key_prefix=f"{namespace}:gp:done:", retention_ms=_ms(worker.dedup_retention)
        )
        tracing = Tracing(self.telemetry.tracer_provider) if self.telemetry.tracing else None
        middleware: list[Middleware] = [
            lifecycle,
            *([tracing] if tracing else []),
            *self._sentry_middleware(),
            *([Metrics()] if self.telemetry.metrics else []),
            *([QueueWeights(worker.queues, strict=worker.strict_priority)] if worker.queues else []),
            idempotency,
            TaskLog(),
            PanicRecovery(),
            AgeLimit(),
            TimeLimit(),
            ShutdownNotifications(),
            Callbacks(),
            Pipelines(),
            Retries(
                max_retries=worker.max_retries,
                min_backoff=_ms(worker.min_backoff),
                max_backoff=_ms(worker.max_backoff),
            ),
            *extra,
        ]
        broker = Broker(
            client=client,
            middleware=middleware,
            unknown_task_grace_ms=_ms(worker.unknown_task_grace),
            **options,
        )
        broker.on_fetch = idempotency.claim
        if tracing is not None:
            broker.on_send_failed = tracing.send_failed
        return broker

    def _sentry_middleware(self) -> list[Middleware]:
        if not self.telemetry.sentry:
            return []
        from .middleware.sentry import Sentry

        def job_entry(name: str) -> Entry | None:
            return next((entry for entry in self.schedule if entry.name == name and entry.handler), None)

        sentry = self.settings.sentry
        return [Sentry(send_default_pii=sentry.send_default_pii, job_entry=job_entry if sentry.crons else None)]


def current_kit() -> Kit:
    """The last :class:`Kit` built in this process.

    Raises:
        GPError: none was built.
    """
    if _current is None:
        raise GPError("no dramatiq_gp.Kit has been built in this process; build one before dispatching")
    return _current


@overload
def dispatch(event: object, /, *, envelope_id: str | None = None) -> str: ...


@overload
def dispatch(target: Session | sa.Connection, event: object, /, *, envelope_id: str | None = None) -> str: ...


def dispatch(*args: Any, envelope_id: str | None = None) -> str:
    """Dispatch an event (see :meth:`Kit.dispatch`).

    ``dispatch(session_or_connection, event)`` needs no Kit: it only writes the
    outbox row, so a web application can call it with just its events imported.
    ``dispatch(event)`` goes through the last Kit built in this process.
    """
    if len(args) == 2:
        return _write_outbox(args[0], args[1], envelope_id)
    return current_kit().dispatch(*args, envelope_id=envelope_id)


def _write_outbox(target: Session | sa.Connection, event: object, envelope_id: str | None) -> str:
    from .outbox import write

    return write(target, event, envelope_id=envelope_id)
