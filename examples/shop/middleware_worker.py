"""The shop's worker built as a middleware list, without the Kit: ``dramatiq examples.shop.middleware_worker``.

It runs the same shop as ``worker.py``: the kit's broker, and the kit's
middleware written out one by one, the way a Dramatiq application lists its own.
``gp.default_middleware(...)`` returns the same list in the same order.
"""

from __future__ import annotations

import dramatiq
from dramatiq.middleware import AgeLimit, Callbacks, Pipelines, ShutdownNotifications, TimeLimit

import dramatiq_gp as gp

from . import jobs, listeners
from .deps import Dependencies

deps = Dependencies.from_env()
settings = gp.Settings.from_env()  # WORKER_*, REDIS_URL / VALKEY_*, LOG_*, OTEL_*, SENTRY_*...

registry = gp.Registry()
listeners.register(registry, deps)
schedule = gp.Schedule(settings.scheduler.timezone)
jobs.register(schedule, deps)

broker = gp.RedisBroker(
    url=settings.redis.connection_url(),
    namespace=settings.redis.namespace,
    middleware=[
        gp.SchedulerLease(schedule, registry=registry, settings=settings.scheduler),
        gp.OutboxRelay(deps.engine, settings=settings.outbox),
        gp.Lifecycle(telemetry=gp.Telemetry(settings)).with_closer("database", deps.engine.dispose),
        gp.IdempotentExecution(),
        gp.Listeners(registry),
        gp.TaskLog(),
        gp.PanicRecovery(),
        AgeLimit(),
        TimeLimit(),
        ShutdownNotifications(),
        Callbacks(),
        Pipelines(),
        gp.Retries(max_retries=25, min_backoff=15_000, max_backoff=4 * 3_600_000),
    ],
)
dramatiq.set_broker(broker)  # `dramatiq examples.shop.middleware_worker` runs the global broker
