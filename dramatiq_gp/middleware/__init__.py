"""The kit's processing middleware, one concern per module.

``Sentry`` lives in :mod:`dramatiq_gp.middleware.sentry`, imported only when
sentry-sdk (the ``sentry`` extra) is installed.
"""

from .idempotency import ClaimUnavailable, IdempotentExecution
from .metrics import Metrics
from .panic import PanicRecovery
from .queue_weights import QueueWeights, WeightedQueue
from .retries import Retries
from .task_log import TaskLog
from .tracing import Tracing

__all__ = [
    "ClaimUnavailable",
    "IdempotentExecution",
    "Metrics",
    "PanicRecovery",
    "QueueWeights",
    "Retries",
    "TaskLog",
    "Tracing",
    "WeightedQueue",
]
