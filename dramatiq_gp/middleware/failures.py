"""Recent failures: the latest failed attempts, kept in Redis for the dashboard.

Logs and Sentry hold every failure, but an operator looking at a queue wants the
last few at hand, next to the dead letters. Each failed attempt is pushed to
``<ns>:gp:failures`` (:func:`dramatiq_gp.keys.failures`), capped at ``keep``:
when it failed, the queue, task type, message id, attempt, whether it will be
retried, and the exception's type and first line. The arguments are never kept
(they may hold personal data); the exception's message is, as Sentry sends it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy
from dramatiq.common import current_millis, q_name
from dramatiq.rate_limits import RateLimitExceeded

from .. import keys
from ..brokers.base import kit_broker
from ..errors import one_line_at_start_up
from .lifecycle import PUT_BACK_ATTR
from .retries import expected_failure

#: Characters of the exception's first line kept.
ERROR_CHARS = 300


class RecentFailures(Middleware):
    """Keeps the latest failed attempts in Redis (see the module docstring).

    Hooks: ``before_worker_boot`` (refuses any broker but the kit's, whose Redis
    it writes to) and ``after_process_message`` (listed before :class:`Retries`,
    it reads its verdict). One round trip per failure; none for a success.

    Parameters:
        keep: how many failures the list holds.
    """

    def __init__(self, *, keep: int = 200) -> None:
        self.keep = keep
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")

    @one_line_at_start_up
    def before_worker_boot(self, broker: Broker, worker: Any) -> None:
        kit_broker(broker, self)

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        if exception is None or isinstance(exception, RateLimitExceeded) or getattr(message, PUT_BACK_ATTR, False):
            return
        lines = str(exception).strip().splitlines()
        failure = {
            "at_ms": current_millis(),
            "queue": q_name(message.queue_name),
            "task_type": message.actor_name,
            "message_id": message.message_id,
            "attempt": _attempt(broker, message, exception),
            "will_retry": not message.failed,
            "error": f"{type(exception).__name__}: {lines[0] if lines else ''}"[:ERROR_CHARS],
        }
        kit = kit_broker(broker, self)
        key = keys.failures(kit.namespace)
        try:
            with kit.client.pipeline(transaction=False) as pipe:
                pipe.lpush(key, json.dumps(failure))
                pipe.ltrim(key, 0, self.keep - 1)
                pipe.execute()
        except redis.RedisError as exc:
            # Only the dashboard reads it: the message's own outcome is not at stake.
            self.logger.warning(
                "could not record a failure of message %s for the dashboard: %s", message.message_id, exc
            )


def _attempt(broker: Broker, message: MessageProxy, exception: BaseException) -> int:
    """Which attempt failed: ``Retries``, whose after-hook ran first, counted it, unless the actor ``throws`` it."""
    retries = int(message.options.get("retries", 0))
    return retries + 1 if expected_failure(broker, message, exception) else max(retries, 1)
