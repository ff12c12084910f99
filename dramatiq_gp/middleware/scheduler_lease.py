"""The schedule as a middleware: fired by the one worker process that holds the Redis lease."""

from __future__ import annotations

import logging

from dramatiq import Broker, Worker
from opentelemetry import trace

from ..brokers.base import KitBroker, kit_broker
from ..errors import one_line_at_start_up
from ..registry import Registry, default_registry
from ..scheduler import Runner, Schedule, default_schedule
from ..settings import SchedulerSettings, Settings
from .lifecycle import Producer


class SchedulerLease(Producer):
    """Contends for the scheduler's Redis lease in every worker process; the holder fires the schedule.

    See :mod:`dramatiq_gp.scheduler.lease` and :mod:`dramatiq_gp.scheduler.runner`:
    one holder at a time, fenced by epochs, every tick claimed and enqueued in one
    Lua call. An empty schedule starts no election at all, unless ``SCHEDULER_DYNAMIC``
    asks this worker to fire the entries stored at run time (:mod:`dramatiq_gp.scheduler.dynamic`).

    Hooks: ``before_worker_boot`` (refuses a broker not of the kit's: on
    :class:`dramatiq_gp.RedisBroker` the firing writes to the queues in its Lua
    call, elsewhere the broker publishes what the firing claimed; declares
    the ``job:<name>`` and ``schedule:<event>`` actors, so their queues are
    consumed), ``after_worker_boot`` (contends and starts the timer) and
    ``before_worker_shutdown`` (stops firing and releases the lease at once, on
    a thread of its own beside the drain: see :class:`~dramatiq_gp.middleware.lifecycle.Producer`).

    Parameters:
        schedule: the entries; module-level ``@dramatiq_gp.job`` ones by default.
        registry: the listeners scheduled events fan out to; module-level ones by default.
        settings: ``SCHEDULER_*``; read from the environment when not given.
        tracer_provider: where each firing's root span goes; ``None`` means the global provider.
    """

    name = "schedule runner"

    @one_line_at_start_up
    def __init__(
        self,
        schedule: Schedule | None = None,
        *,
        registry: Registry | None = None,
        settings: SchedulerSettings | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.settings = settings if settings is not None else Settings.from_env().scheduler
        self.schedule = schedule if schedule is not None else default_schedule
        self.registry = registry if registry is not None else default_registry
        self.tracer_provider = tracer_provider
        self.runner: Runner | None = None

    def bind(self, broker: KitBroker) -> Runner | None:
        """The runner firing ``schedule`` into ``broker`` (built once); ``None`` for an empty schedule
        without ``SCHEDULER_DYNAMIC``."""
        if self.runner is None and (self.schedule or self.settings.dynamic):
            self.schedule.use_timezone(self.settings.timezone)
            self.schedule.check_options(broker.actor_options)
            self.runner = Runner(
                schedule=self.schedule,
                broker=broker,
                registry=self.registry,
                settings=self.settings,
                namespace=self.settings.namespace or broker.namespace,
                tracer_provider=self.tracer_provider,
            )
        return self.runner

    @one_line_at_start_up
    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        if self.schedule or self.settings.dynamic:
            self.bind(kit_broker(broker, self))

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        if self.runner is not None:
            self.runner.start()
            self.logger.info("start-up: %s started", self.name)

    def producing(self) -> bool:
        return self.runner is not None

    def stop_producing(self) -> None:
        assert self.runner is not None
        self.runner.stop()
