"""The kit as Dramatiq middleware: one class per concern, and :func:`default_middleware`, the kit's list.

Each works in a broker's middleware list on its own, and says in its docstring
which hooks it uses and what it needs. Those that rely on the kit's Redis
protocol (:class:`IdempotentExecution`, :class:`OverlapGuard`, :class:`Retries`, :class:`OutboxRelay`,
:class:`SchedulerLease`, :class:`RecentFailures`, strict :class:`QueueWeights`) refuse any broker but
the kit's (:class:`dramatiq_gp.RedisBroker`, :class:`dramatiq_gp.RabbitmqBroker`) when the worker boots,
in one line naming both.

``Sentry`` lives in :mod:`dramatiq_gp.middleware.sentry`, imported only when
sentry-sdk (the ``sentry`` extra) is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from dramatiq import Middleware
from dramatiq.middleware import AgeLimit, Callbacks, Pipelines, ShutdownNotifications, TimeLimit

from ..aio import AsyncIO
from ..errors import one_line_at_start_up
from ..registry import Registry, default_registry
from ..scheduler import Entry, Schedule, default_schedule
from ..settings import Settings
from ..telemetry import Telemetry
from .failures import RecentFailures
from .gc_freeze import GcFreeze
from .idempotency import ClaimUnavailable, IdempotentExecution
from .lifecycle import Lifecycle
from .listeners import Listeners
from .metrics import Metrics
from .outbox_relay import OutboxRelay
from .overlap import OverlapGuard, OverlapUnavailable
from .panic import PanicRecovery
from .queue_weights import QueueWeights, WeightedQueue
from .retries import Retries
from .scheduler_lease import SchedulerLease
from .task_log import TaskLog
from .tracing import Tracing

if TYPE_CHECKING:
    import sqlalchemy as sa

__all__ = [
    "AsyncIO",
    "ClaimUnavailable",
    "GcFreeze",
    "IdempotentExecution",
    "Lifecycle",
    "Listeners",
    "Metrics",
    "OutboxRelay",
    "OverlapGuard",
    "OverlapUnavailable",
    "PanicRecovery",
    "QueueWeights",
    "RecentFailures",
    "Retries",
    "SchedulerLease",
    "TaskLog",
    "Tracing",
    "WeightedQueue",
    "default_middleware",
]


@one_line_at_start_up
def default_middleware(
    settings: Settings | None = None,
    *,
    registry: Registry | None = None,
    schedule: Schedule | None = None,
    engine: sa.Engine | None = None,
    telemetry: Telemetry | None = None,
) -> list[Middleware]:
    """The kit's middleware, in the order it runs them, configured from ``settings``.

    The order matters: Dramatiq runs before-hooks in list order and after-hooks in
    reverse. :class:`GcFreeze` comes first, so it freezes what every other
    ``after_worker_boot`` started. The producers come next, so they stop before in-flight tasks drain;
    then the lifecycle, which sees every message first and last; tracing and
    Sentry, so every message, a skipped duplicate too, gets a span and a scope, and
    a retry is sent from inside its span; :class:`OverlapGuard` comes after
    :class:`IdempotentExecution` (a duplicate is settled there, never waits) and
    before the task log and ``TimeLimit`` (a wait is in neither the logged duration
    nor the time limit); the task log, metrics and Sentry read ``Retries``'
    verdict, which comes last. :class:`AsyncIO` (the event-loop
    thread ``async def`` listeners and jobs run on) comes just before the
    lifecycle, so its loop stops only after the drain. Dramatiq's own ``AgeLimit``,
    ``TimeLimit``, ``ShutdownNotifications``, ``Callbacks`` and ``Pipelines`` are
    in it; its ``Retries`` is replaced by the kit's.

    Parameters:
        settings: default :meth:`Settings.from_env`.
        registry: the listeners; the module-level ``@dramatiq_gp.listener`` ones by default.
        schedule: the entries; the module-level ``@dramatiq_gp.job`` ones by default.
        engine: the database of the outbox; one is built from ``DB_*`` when they
            are set (and disposed of at shutdown). With one, each worker process
            relays the outbox (unless ``OUTBOX_RELAY=false``).
        telemetry: default one built from ``settings`` (which configures logging).

    Raises:
        ConfigError: an environment variable is invalid.
    """
    settings = settings if settings is not None else Settings.from_env()
    telemetry = telemetry if telemetry is not None else Telemetry(settings, namespace=settings.redis.namespace)
    registry = registry if registry is not None else default_registry
    schedule = schedule if schedule is not None else default_schedule
    worker = settings.worker
    lifecycle = Lifecycle(
        telemetry=telemetry,
        shutdown_timeout_ms=_ms(worker.shutdown_timeout) if worker.shutdown_timeout is not None else None,
        display=settings.redis.display(),
        health_interval=worker.health_interval,
        health_port=worker.health_port,
        health_host=worker.health_host,
    )
    producers: list[Middleware] = [
        SchedulerLease(
            schedule, registry=registry, settings=settings.scheduler, tracer_provider=telemetry.tracer_provider
        )
    ]
    if engine is None and settings.db.configured:
        engine = settings.db.engine()
        lifecycle.closers.kit.append(("outbox database", engine.dispose))
    if engine is not None:
        lifecycle.with_health_check("database", _pinger(engine))
        from ..outbox import set_notify

        set_notify(settings.outbox.notify)
        if settings.outbox.relay:
            producers.append(OutboxRelay(engine, settings=settings.outbox))
    return [
        # First, so its after_worker_boot runs last (after-hooks run in reverse) and freezes what the others started.
        *([GcFreeze()] if worker.gc_freeze else []),
        *producers,
        # Before the lifecycle, so the loop stops after the drain has put back and cancelled
        # what did not finish (after-hooks run in reverse). Always here: an async listener or
        # job may be registered after the broker is built, and an idle loop costs one thread.
        AsyncIO(),
        lifecycle,
        *(
            [Tracing(telemetry.tracer_provider, send_default_pii=settings.sentry.send_default_pii)]
            if telemetry.tracing
            else []
        ),
        *_sentry(settings, telemetry, schedule),
        *([Metrics()] if telemetry.metrics else []),
        *([QueueWeights(worker.queues, strict=worker.strict_priority)] if worker.queues else []),
        IdempotentExecution(retention_ms=_ms(worker.dedup_retention)),
        OverlapGuard(lease_ms=_ms(settings.scheduler.overlap_lease), namespace=settings.scheduler.namespace),
        Listeners(registry, retirement=worker.listener_retirement),
        TaskLog(),
        RecentFailures(),
        PanicRecovery(),
        AgeLimit(),
        TimeLimit(),
        ShutdownNotifications(),
        Callbacks(),
        Pipelines(),
        Retries(
            max_retries=worker.max_retries, min_backoff=_ms(worker.min_backoff), max_backoff=_ms(worker.max_backoff)
        ),
    ]


def _sentry(settings: Settings, telemetry: Telemetry, schedule: Schedule) -> list[Middleware]:
    if not telemetry.sentry:
        return []
    from .sentry import Sentry

    def job_entry(name: str) -> Entry | None:
        return next((entry for entry in schedule if entry.name == name and entry.handler), None)

    sentry = settings.sentry
    return [Sentry(send_default_pii=sentry.send_default_pii, job_entry=job_entry if sentry.crons else None)]


def _pinger(engine: sa.Engine) -> Callable[[], None]:
    def ping() -> None:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    return ping


def _ms(value: timedelta) -> int:
    return int(value.total_seconds() * 1000)
