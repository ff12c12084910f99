"""The kit's processing middleware, one concern per module."""

from .idempotency import ClaimUnavailable, IdempotentExecution
from .panic import PanicRecovery
from .task_log import TaskLog

__all__ = ["ClaimUnavailable", "IdempotentExecution", "PanicRecovery", "TaskLog"]
