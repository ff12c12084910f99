"""dramatiq-gp: Dramatiq as a complete background-work chassis.

Everything an application uses is importable from here.
"""

import importlib
from typing import Any

from .broker import Broker
from .errors import (
    BrokerUnreachable,
    ConfigError,
    EventEncodeError,
    EventError,
    GPError,
    HandlerPanic,
    RegistrationError,
)
from .events import EventType, event, event_type
from .kit import Kit, RegisterFunc, current_kit, dispatch
from .middleware import (
    ClaimUnavailable,
    IdempotentExecution,
    Metrics,
    PanicRecovery,
    QueueWeights,
    Retries,
    TaskLog,
    Tracing,
    WeightedQueue,
)
from .registry import Envelope, Listener, Registry, current_envelope, default_registry, fan_out_id, listener
from .scheduler import CronError, Schedule, ScheduleError
from .settings import (
    DatabaseSettings,
    LogSettings,
    OtelSettings,
    OutboxSettings,
    QueueSettings,
    SchedulerSettings,
    SentrySettings,
    Settings,
    WorkerSettings,
)
from .telemetry import Telemetry

__all__ = [
    "Broker",
    "BrokerUnreachable",
    "ClaimUnavailable",
    "ConfigError",
    "CronError",
    "DatabaseSettings",
    "Envelope",
    "EventEncodeError",
    "EventError",
    "EventType",
    "GPError",
    "HandlerPanic",
    "IdempotentExecution",
    "Kit",
    "Listener",
    "LogSettings",
    "Metrics",
    "OtelSettings",
    "OutboxSettings",
    "PanicRecovery",
    "QueueSettings",
    "QueueWeights",
    "RegisterFunc",
    "RegistrationError",
    "Registry",
    "Retries",
    "Schedule",
    "ScheduleError",
    "SchedulerSettings",
    "SentrySettings",
    "Settings",
    "TaskLog",
    "Telemetry",
    "Tracing",
    "WeightedQueue",
    "WorkerSettings",
    "current_envelope",
    "current_kit",
    "default_registry",
    "dispatch",
    "event",
    "event_type",
    "fan_out_id",
    "listener",
    "outbox",
]


def __getattr__(name: str) -> Any:
    # The outbox brings SQLAlchemy and psycopg; a worker without a database never loads them.
    if name == "outbox":
        return importlib.import_module(f"{__name__}.outbox")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
