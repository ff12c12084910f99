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
from typing import Any
from uuid import uuid4

import dramatiq
import redis
from dramatiq import Middleware
from dramatiq.middleware import AgeLimit, Callbacks, Pipelines, Retries, ShutdownNotifications, TimeLimit

from . import telemetry
from .broker import Broker
from .errors import BrokerUnreachable, GPError
from .lifecycle import Closer, Closers, Lifecycle
from .middleware import IdempotentExecution, PanicRecovery, TaskLog
from .registry import Registry, default_registry
from .scheduler import Schedule
from .settings import Settings

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

    Raises:
        ConfigError: an environment variable is invalid.
    """

    def __init__(
        self,
        register: RegisterFunc | None = None,
        *,
        settings: Settings | None = None,
        registry: Registry | None = None,
        broker_options: Mapping[str, Any] | None = None,
        middleware: Sequence[Middleware] = (),
    ) -> None:
        global _current
        self.settings = settings if settings is not None else Settings.from_env()
        telemetry.bootstrap(self.settings.log)
        logger.info(
            "start-up: telemetry ready (log level %s)", logging.getLevelName(logging.getLogger().level)
        )
        self._closers = Closers()
        self.broker = self._build_broker(dict(broker_options or {}), middleware)
        self._closers.kit.append(("queue client", self.broker.client.connection_pool.disconnect))
        dramatiq.set_broker(self.broker)
        self.registry = registry if registry is not None else default_registry
        self.registry.bind(self.broker)
        self.schedule = Schedule()
        if register is not None:
            register(self.registry, self.schedule)
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

    def dispatch(self, event: object, *, envelope_id: str | None = None) -> str:
        """Fan ``event`` out to its listeners now (not transactional); returns the envelope id.

        Every listener's message is encoded before any is sent, and all are sent in
        one round trip or none are.

        Raises:
            EventError: ``event`` is not an event.
            EventEncodeError: its payload cannot be encoded; nothing was sent.
        """
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
            raise BrokerUnreachable(
                f"Redis/Valkey unreachable at {self.settings.queue.display()}: {exc}"
            ) from None
        logger.info("start-up: broker reachable at %s", self.settings.queue.display())

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
            check_connection=self.check_connection,
            closers=self._closers,
            shutdown_timeout_ms=_ms(worker.shutdown_timeout) if worker.shutdown_timeout is not None else None,
            queues=worker.queues,
        )
        # Order matters: Dramatiq runs before-hooks in this order and after-hooks in
        # reverse, so the lifecycle sees everything first and last, a duplicate is
        # skipped before anything logs it, and the task log reads Retries' verdict.
        idempotency = IdempotentExecution(
            client=client, key_prefix=f"{namespace}:gp:done:", retention_ms=_ms(worker.dedup_retention)
        )
        middleware: list[Middleware] = [
            lifecycle,
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
        return broker


def current_kit() -> Kit:
    """The last :class:`Kit` built in this process.

    Raises:
        GPError: none was built.
    """
    if _current is None:
        raise GPError("no dramatiq_gp.Kit has been built in this process; build one before dispatching")
    return _current


def dispatch(event: object, *, envelope_id: str | None = None) -> str:
    """Fan ``event`` out through the current :class:`Kit` (see :meth:`Kit.dispatch`)."""
    return current_kit().dispatch(event, envelope_id=envelope_id)
