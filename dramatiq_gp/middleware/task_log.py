"""Task logs: ``task started``, ``task done``, ``task failed``, one line each, through stdlib logging.

Dramatiq logs each failure, and each skip, with a line of its own; this
middleware replaces those lines (it filters them out of Dramatiq's worker
logger) with lines that carry the task type, id, attempt, duration and whether
the failure will be retried, at Dramatiq's levels: ERROR with the traceback for
an unexpected failure, INFO without one for an exception the actor ``throws``
(expected, not retried), DEBUG for a rate-limit miss; and WARNING without one for
an event payload set aside (:class:`~dramatiq_gp.PayloadMismatch`: it names the fields). A failure
that will be retried because a server was out of reach (the broker, Redis/Valkey: a
fan-out's send during a node's failure) is one WARNING without a traceback, and
the next ones INFO, until a task succeeds again: sixteen tracebacks per node
failure said nothing the first line did not. Likewise a consumer that lost its
connection: Dramatiq logs it CRITICAL, and "Restarting consumer" at INFO, every
second of the outage (ten CRITICAL lines per worker per node failure); here the
first of an outage is a WARNING and the rest INFO and DEBUG, until the consumer
has gone :data:`OUTAGE_QUIET_S` without one. Every other Dramatiq log
line is kept. The fields are also passed as ``extra`` so a structured formatter
can use them. ``LOG_LEVEL=WARN`` silences the INFO lines.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from time import perf_counter, time
from typing import Any

import redis
from dramatiq import Broker, Middleware, Retry
from dramatiq.broker import MessageProxy
from dramatiq.errors import BrokerConnectionError
from dramatiq.rate_limits import RateLimitExceeded

from ..errors import PayloadMismatch
from ..errortext import ErrorText
from .lifecycle import PUT_BACK_ATTR
from .retries import expected_failure

_STARTED_ATTR = "_gp_started"


class _ReplacedByTaskLog(logging.Filter):
    LINES = frozenset(
        {
            "Message %s was skipped.",
            "Failed to process message %s with unhandled exception.",
            "Failed to process message %s with expected exception %s.",
            "Rate limit exceeded in message %s: %s.",
            # Dramatiq's Retries (the kit's too): `task failed ... will_retry=` says the same.
            "Retrying message %r in %d milliseconds.",
            "Retries exceeded for message %r.",
        }
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.LINES


#: A consumer's connection errors this far apart are two outages, each worth a WARNING.
OUTAGE_QUIET_S = 30.0


class _ConsumerOutage(logging.Filter):
    """One consumer thread's connection errors: the first of an outage a WARNING, the rest quieter."""

    LOST = "Consumer encountered a connection error: %s"
    RESTARTING = "Restarting consumer in %0.2f seconds."

    def __init__(self) -> None:
        super().__init__()
        self._last = -OUTAGE_QUIET_S
        self._said = False  # this outage was logged already

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == self.LOST:
            self._said = record.created - self._last < OUTAGE_QUIET_S
            self._last = record.created
            record.levelno = logging.INFO if self._said else logging.WARNING
        elif record.msg == self.RESTARTING and self._said:
            record.levelno = logging.DEBUG
        else:
            return True
        record.levelname = logging.getLevelName(record.levelno)
        return record.levelno >= logging.getLogger(record.name).getEffectiveLevel()


def _this_module(stack_info: bool = False, stacklevel: int = 1) -> tuple[str, int, str, str | None]:
    return __file__, 0, "TaskLog", None


class _Records:
    """The task log's INFO lines: records copied from a template, not built by ``Logger.info``.

    Every line comes from one place (``_this_module``), so two records of one level
    in one process differ only in their time, thread, message, arguments and fields.
    ``LogRecord.__init__`` works the rest out again each time (the file name and
    module from the path, the process and its name), about a quarter of a line's CPU
    at two lines a task: here one record per level and process is made by
    ``Logger.makeRecord`` and copied, with those fields set, and handed to
    ``Logger.handle`` (the logger's filters, then its handlers, as ``Logger.info``
    does). Only while the record factory is logging's own: a replaced one
    (``logging.setLogRecordFactory``, as OpenTelemetry's logging instrumentation
    does) gets every line through ``Logger.log``. tests/test_task_log.py pins that
    both make the same record.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._templates: dict[int, tuple[int, dict[str, Any]]] = {}  # level: (pid, the record's __dict__)

    def log(self, level: int, msg: str, args: tuple[Any, ...], fields: dict[str, Any]) -> None:
        logger = self.logger
        if logging.getLogRecordFactory() is not logging.LogRecord:
            logger.log(level, msg, *args, extra=fields)
            return
        pid = os.getpid()
        template = self._templates.get(level)
        if template is None or template[0] != pid:  # a forked process: its own pid and process name
            path, line, function, _ = _this_module()
            record = logger.makeRecord(logger.name, level, path, line, "", (), None, function)
            template = self._templates[level] = (pid, record.__dict__)
        state = template[1].copy()
        now = time()
        state["msg"], state["args"] = msg, args
        state["relativeCreated"] += (now - state["created"]) * 1000
        state["created"], state["msecs"] = now, int((now - int(now)) * 1000) + 0.0
        if state["thread"] is not None:  # logging.logThreads
            state["thread"], state["threadName"] = threading.get_ident(), threading.current_thread().name
        state.update(fields)
        record = logging.LogRecord.__new__(logging.LogRecord)
        record.__dict__ = state
        logger.handle(record)


class TaskLog(Middleware):
    """Logs each task's start and outcome.

    Hooks: ``before_process_message``, ``after_process_message`` (listed before
    :class:`Retries`, it reads its verdict) and ``after_skip_message``; it filters
    Dramatiq's own per-task lines out of ``dramatiq.worker.WorkerThread``, and its
    retry lines out of ``dramatiq.middleware.retries.Retries``; and
    ``after_consumer_thread_boot``, to quiet a consumer thread's connection errors
    (a filter on the thread's ``logger``, a Dramatiq internal). Works on
    any broker.

    Parameters:
        logger_name: where the lines go (default ``dramatiq_gp.tasks``).
    """

    def __init__(self, *, logger_name: str = "dramatiq_gp.tasks") -> None:
        self.logger = logging.getLogger(logger_name)
        #: A task failed (and will be retried) because a server was out of reach, and none succeeded since.
        self._out_of_reach = False
        # Every line comes from this module: skip logging's walk up the stack for it.
        self.logger.findCaller = _this_module  # type: ignore[method-assign]
        self._records = _Records(self.logger)
        for name in ("dramatiq.worker.WorkerThread", "dramatiq.middleware.retries.Retries"):
            replaced = logging.getLogger(name)
            if not any(isinstance(f, _ReplacedByTaskLog) for f in replaced.filters):
                replaced.addFilter(_ReplacedByTaskLog())

    def after_consumer_thread_boot(self, broker: Broker, thread: Any) -> None:
        # Dramatiq's consumer thread logs through ``thread.logger``, ``dramatiq.worker.ConsumerThread(<queue>)``.
        if not any(isinstance(f, _ConsumerOutage) for f in thread.logger.filters):
            thread.logger.addFilter(_ConsumerOutage())

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        attempt = message.options.get("retries", 0) + 1
        setattr(message, _STARTED_ATTR, (perf_counter(), attempt))
        if self.logger.isEnabledFor(logging.INFO):
            actor_name, message_id = message.actor_name, message.message_id
            self._records.log(
                logging.INFO,
                "task started task_type=%s task_id=%s attempt=%d",
                (actor_name, message_id, attempt),
                {"task_type": actor_name, "task_id": message_id, "attempt": attempt},
            )

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        started = getattr(message, _STARTED_ATTR, None)
        if started is None:
            return
        if exception is None and self._out_of_reach:
            self._out_of_reach = False
        if exception is None and not self.logger.isEnabledFor(logging.INFO):
            return  # the common case under LOG_LEVEL=WARN: nothing to build
        duration_ms = (perf_counter() - started[0]) * 1000
        fields = {
            "task_type": message.actor_name,
            "task_id": message.message_id,
            "attempt": started[1],
            "duration_ms": round(duration_ms, 2),
        }
        if exception is None:
            self._records.log(
                logging.INFO,
                "task done task_type=%s task_id=%s attempt=%d duration_ms=%.2f",
                (fields["task_type"], fields["task_id"], started[1], duration_ms),
                fields,
            )
            return
        if getattr(message, PUT_BACK_ATTR, False):
            # A coroutine cancelled at shutdown after its message went back to the queue: it runs again.
            self.logger.warning(
                "task put back task_type=%s task_id=%s attempt=%d duration_ms=%.2f: cancelled at the drain timeout",
                message.actor_name,
                message.message_id,
                started[1],
                duration_ms,
                extra=fields,
            )
            return
        # Retries has already decided by now (its after-hook runs before ours) and
        # fails the message when the budget is spent.
        fields["will_retry"] = will_retry = not message.failed
        # Its type alone over OTLP unless PII is sent: the message may be anyone's data (errortext.without_messages).
        fields["error"] = error = ErrorText(exception)
        if isinstance(exception, Retry):
            self.logger.info(
                "task retry requested task_type=%s task_id=%s attempt=%d will_retry=%s",
                message.actor_name,
                message.message_id,
                started[1],
                will_retry,
                extra=fields,
            )
            return
        if isinstance(exception, RateLimitExceeded):
            level, exc_info = logging.DEBUG, None
        elif isinstance(exception, PayloadMismatch):
            level, exc_info = logging.WARNING, None
        elif expected_failure(broker, message, exception):
            level, exc_info = logging.INFO, None
            fields["expected"] = True
        elif will_retry and out_of_reach(exception):
            level, exc_info = (logging.INFO if self._out_of_reach else logging.WARNING), None
            self._out_of_reach = True
        else:
            level, exc_info = logging.ERROR, exception
        if self.logger.isEnabledFor(level):
            self.logger.log(
                level,
                "task failed task_type=%s task_id=%s attempt=%d duration_ms=%.2f will_retry=%s%s error=%s",
                message.actor_name,
                message.message_id,
                started[1],
                duration_ms,
                will_retry,
                " expected=True" if fields.get("expected") else "",
                error,
                exc_info=exc_info,
                extra=fields,
            )

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        started = getattr(message, _STARTED_ATTR, None)
        if started is not None:
            self.logger.warning(
                "task skipped task_type=%s task_id=%s attempt=%d",
                message.actor_name,
                message.message_id,
                started[1],
                extra={"task_type": message.actor_name, "task_id": message.message_id, "attempt": started[1]},
            )


def out_of_reach(exception: BaseException) -> bool:
    """Whether ``exception`` says a server (the broker, Redis/Valkey) could not be reached, rather than a bug."""
    if isinstance(exception, BrokerConnectionError | redis.ConnectionError | redis.TimeoutError | ConnectionError):
        return True
    pika = sys.modules.get("pika.exceptions")  # loaded only with RabbitMQ
    return pika is not None and isinstance(exception, pika.AMQPConnectionError | pika.AMQPChannelError)
