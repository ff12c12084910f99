"""Metrics: each message's outcome, processing time and queue wait, and each message sent.

Counted per queue and task type (see :mod:`dramatiq_gp.metrics` for the list).
The outcome of a failure is read after Retries has decided, so a failure that
will be retried counts as ``retried`` and only the last one as ``failed``.
"""

from __future__ import annotations

import time
from typing import Any

from dramatiq import Broker, Message, Middleware, Retry
from dramatiq.broker import MessageProxy
from dramatiq.common import q_name

from ..metrics import instruments
from .tracing import error_type

_STARTED = "_gp_metrics_started"


class Metrics(Middleware):
    """Records the kit's message instruments.

    Hooks: ``after_enqueue``, ``before_process_message``, ``after_process_message``
    (listed before :class:`Retries`, it reads its verdict) and ``after_skip_message``.
    Works on any broker.
    """

    def __init__(self) -> None:
        self.instruments = instruments()

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        self.instruments.sent.add(
            1, {"messaging.destination.name": q_name(message.queue_name), "task_type": message.actor_name}
        )

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        now = time.time()
        enqueued_ms = message.options.get("eta") or message.message_timestamp
        attributes = {"queue": message.queue_name, "task_type": message.actor_name}
        self.instruments.queue_wait.record(max(0.0, now - enqueued_ms / 1000), attributes)
        setattr(message, _STARTED, time.perf_counter())

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        started = getattr(message, _STARTED, None)
        if started is None:
            return
        duration = {"messaging.destination.name": message.queue_name, "task_type": message.actor_name}
        if exception is None:
            outcome = "done"
        else:
            outcome = "failed" if message.failed else "retried"
            if not isinstance(exception, Retry):
                duration["error.type"] = error_type(exception)
        self.instruments.process_duration.record(time.perf_counter() - started, duration)
        self.instruments.messages.add(
            1, {"queue": message.queue_name, "task_type": message.actor_name, "outcome": outcome}
        )

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self.instruments.messages.add(
            1, {"queue": message.queue_name, "task_type": message.actor_name, "outcome": "skipped"}
        )
