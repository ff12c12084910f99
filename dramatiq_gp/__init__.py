"""dramatiq-gp: Dramatiq as a complete background-work chassis, as a middleware bundle.

Everything an application uses is importable from here: the broker and the
middleware (listed in a broker's middleware list, or all at once with
:func:`default_middleware`), the :class:`Kit` preset, events, listeners, the
schedule and the errors.
"""

import importlib
from typing import Any

from .brokers.redis import RedisBroker
from .errors import (
    AlreadyApplied,
    BrokerMismatch,
    BrokerUnreachable,
    ConfigError,
    ConfirmTimeout,
    DispatchError,
    EventEncodeError,
    EventError,
    GPError,
    HandlerPanic,
    PayloadMismatch,
    QuorumLost,
    RegistrationError,
)
from .events import event, event_type
from .exactly_once import inbox
from .kit import Kit, RegisterFunc, dispatch, dispatch_async
from .middleware import (
    AsyncIO,
    GcFreeze,
    IdempotentExecution,
    Lifecycle,
    Listeners,
    Metrics,
    OutboxRelay,
    OverlapGuard,
    PanicRecovery,
    QueueWeights,
    RecentFailures,
    Retries,
    SchedulerLease,
    TaskLog,
    Tracing,
    WeightedQueue,
    default_middleware,
)
from .names import fan_out_id
from .registry import Envelope, Registry, current_envelope, listener
from .scheduler import CronError, Schedule, ScheduleError, Schedules, StoredEntry, job, schedulable
from .settings import Settings
from .telemetry import Telemetry

__all__ = [
    "AlreadyApplied",
    "AsyncIO",
    "BrokerMismatch",
    "BrokerUnreachable",
    "ConfigError",
    "ConfirmTimeout",
    "CronError",
    "DispatchError",
    "Envelope",
    "EventEncodeError",
    "EventError",
    "GPError",
    "GcFreeze",
    "HandlerPanic",
    "IdempotentExecution",
    "Kit",
    "Lifecycle",
    "Listeners",
    "Metrics",
    "OutboxRelay",
    "OverlapGuard",
    "PanicRecovery",
    "PayloadMismatch",
    "QueueWeights",
    "QuorumLost",
    "RecentFailures",
    "RedisBroker",
    "RegisterFunc",
    "RegistrationError",
    "Registry",
    "Retries",
    "Schedule",
    "ScheduleError",
    "SchedulerLease",
    "Schedules",
    "Settings",
    "StoredEntry",
    "TaskLog",
    "Telemetry",
    "Tracing",
    "WeightedQueue",
    "current_envelope",
    "default_middleware",
    "dispatch",
    "dispatch_async",
    "event",
    "event_type",
    "fan_out_id",
    "inbox",
    "job",
    "listener",
    "outbox",
    "schedulable",
]


def __getattr__(name: str) -> Any:
    # The outbox brings SQLAlchemy and psycopg; a worker without a database never loads them.
    if name == "outbox":
        return importlib.import_module(f"{__name__}.outbox")
    # RabbitMQ brings pika (the rabbitmq extra); a Redis-only application never loads it.
    if name == "RabbitmqBroker":
        return importlib.import_module(f"{__name__}.brokers.rabbitmq").RabbitmqBroker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
