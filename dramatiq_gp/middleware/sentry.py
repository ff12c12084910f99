"""Sentry: an isolated scope per message, the final failure reported once, Crons check-ins for jobs.

Sentry's own Dramatiq integration reports every failed attempt (through
Dramatiq's error log line), treats ``Retry`` as an error in some versions, sends
message arguments regardless of ``send_default_pii`` and never flushes before a
worker process exits. This middleware replaces it:

* each message runs in its own isolation scope with no breadcrumbs from before,
  tagged with its task type, queue, message id, attempt and trace id;
* a failure is reported once, when Retries gives up, never for an attempt that
  will be retried, never for ``Retry``, never for an exception the actor
  ``throws`` (an expected outcome, as Dramatiq and Sentry's integration treat it);
* arguments and stack-frame local variables go with the event only when
  ``send_default_pii`` is on;
* a scheduled job reports Sentry Crons check-ins (in progress, then ok or
  error), with its schedule as the monitor's configuration.

The event of a final failure leaves out the frames still running when it is
built (Dramatiq's worker loop): reading their locals would pin the exception in a
reference cycle (see :func:`_returned_frames`).

A message's scopes are forked as ``sentry_sdk.isolation_scope()`` forks them, the
current scope and the isolation scope each with ``Scope.fork``, made current with
``Scope.set_current_scope`` and ``Scope.set_isolation_scope``, the old ones set back
after; without its generator, which cost about a fifth of the middleware's time per
message. tests/test_sentry.py pins that the two agree. With no active client (Sentry
not initialised), a message gets no scope at all.
"""

from __future__ import annotations

import math
import re
import sys
import time
import uuid
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import sentry_sdk
from dramatiq import Broker, Middleware, Retry
from dramatiq.broker import MessageProxy
from opentelemetry import trace
from sentry_sdk import Scope
from sentry_sdk.crons import capture_checkin
from sentry_sdk.crons.consts import MonitorStatus
from sentry_sdk.utils import event_from_exception

from ..names import job_name
from ..scheduler.cron import DESCRIPTORS
from ..scheduler.schedule import Entry
from ..scheduler.triggers import crontab_of, interval_of
from ..tracecontext import DELIVERY
from .retries import expected_failure

_STATE = "_gp_sentry"
_SLUG = re.compile(r"[^a-z0-9_-]+")
#: Namespace of check-in ids (uuid5 of the message id), so every attempt of one run shares one.
CHECK_IN_NAMESPACE = uuid.UUID("3c8a2f1e-6b7d-5c4e-9f10-2a3b4c5d6e7f")


def monitor_slug(entry_name: str) -> str:
    """Sentry's slug rules: lower case, digits, ``-`` and ``_``, at most 50 characters."""
    return _SLUG.sub("-", entry_name.lower()).strip("-")[:50] or "job"


def monitor_config(entry: Entry) -> dict[str, Any] | None:
    """The entry's schedule in Sentry's monitor configuration; ``None`` for a trigger Sentry cannot describe.

    Sentry knows crontabs and fixed intervals; a check-in without a configuration
    still reaches a monitor created in Sentry by hand.
    """
    config: dict[str, Any] = {"timezone": entry.zone.key}
    interval, crontab = interval_of(entry.trigger), crontab_of(entry.trigger)
    if interval is not None:
        # Sentry's shortest interval unit is the minute.
        config["schedule"] = {
            "type": "interval",
            "unit": "minute",
            "value": max(1, math.ceil(interval.total_seconds() / 60)),
        }
    elif crontab is not None:
        text = " ".join(crontab.split()).lower()
        config["schedule"] = {"type": "crontab", "value": DESCRIPTORS.get(text, text)}
    else:
        return None
    return config


class Sentry(Middleware):
    """Per-message Sentry scopes, final-failure reports and Crons check-ins.

    Hooks: ``before_process_message``, ``after_process_message`` (listed before
    :class:`Retries`, it reads its verdict) and ``after_skip_message``. Works on
    any broker; needs sentry-sdk (the ``sentry`` extra) and an initialised client.

    Parameters:
        send_default_pii: attach message arguments and local variables to events.
        job_entry: finds the schedule entry of a ``job:<name>`` message (for its
            check-ins); ``None`` turns check-ins off.
    """

    def __init__(self, *, send_default_pii: bool = False, job_entry: Callable[[str], Entry | None] | None = None):
        self.send_default_pii = send_default_pii
        self.job_entry = job_entry

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        client = sentry_sdk.get_client()
        if not client.is_active():
            return  # no client (not initialised, or closed): nothing would be sent
        # What sentry_sdk.isolation_scope() does, without its generator: both scopes forked, the old
        # ones put back after (see the module docstring).
        current, isolation = Scope.get_current_scope(), Scope.get_isolation_scope()
        scope = isolation.fork()
        Scope.set_current_scope(current.fork())
        Scope.set_isolation_scope(scope)
        scope.clear_breadcrumbs()
        actor_name = message.actor_name
        tags = {
            "task_type": actor_name,
            "queue": message.queue_name,
            "message_id": message.message_id,
            "attempt": message.options.get("retries", 0) + 1,
        }
        trace_id = _trace_id(message)
        if trace_id:
            tags["trace_id"] = trace_id
        scope.set_tags(tags)
        if self.send_default_pii:
            context = {**tags, "args": list(message.args), "kwargs": dict(message.kwargs)}
        else:
            context = {**tags, "args": "[Filtered]", "kwargs": "[Filtered]"}
        scope.set_context("dramatiq", context)
        scope.set_transaction_name(actor_name)
        transaction: Any = None
        if client.options.get("traces_sample_rate") is not None:
            continued = sentry_sdk.continue_trace(
                _sentry_headers(message), op="queue.process", name=message.actor_name, source="task"
            )
            continued.set_data("messaging.message.id", message.message_id)
            continued.set_data("messaging.destination.name", message.queue_name)
            transaction = sentry_sdk.start_transaction(continued)
            transaction.__enter__()
        check_in = self._check_in(message, MonitorStatus.IN_PROGRESS)
        setattr(message, _STATE, ((current, isolation), scope, transaction, check_in))

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        state = getattr(message, _STATE, None)
        if state is None:
            return
        delattr(message, _STATE)
        previous, scope, transaction, check_in = state
        try:
            if exception is not None and _final(broker, message, exception):
                options = sentry_sdk.get_client().options
                if not self.send_default_pii:
                    options = {**options, "include_local_variables": False}
                event, hint = event_from_exception(
                    _returned_frames(exception),
                    client_options=options,
                    mechanism={"type": "dramatiq", "handled": False},
                )
                scope.capture_event(event, hint=hint)
            if check_in is not None:
                if exception is None:
                    self._check_in(message, MonitorStatus.OK, check_in)
                elif message.failed:
                    self._check_in(message, MonitorStatus.ERROR, check_in)
            if transaction is not None:
                transaction.set_status("ok" if exception is None else "internal_error")
                transaction.__exit__(None, None, None)
        finally:
            _restore(previous)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        state = getattr(message, _STATE, None)
        if state is None:
            return
        delattr(message, _STATE)
        previous, _, transaction, _ = state
        try:
            if transaction is not None:
                transaction.__exit__(None, None, None)
        finally:
            _restore(previous)

    def _check_in(
        self, message: MessageProxy, status: str, check_in: tuple[str, str, float] | None = None
    ) -> tuple[str, str, float] | None:
        if self.job_entry is None:
            return None
        name = job_name(message.actor_name)
        if name is None:
            return None
        entry = self.job_entry(name)
        if entry is None:
            return None
        slug = monitor_slug(entry.name)
        if check_in is None:
            check_in_id = uuid.uuid5(CHECK_IN_NAMESPACE, message.message_id).hex
            capture_checkin(slug, check_in_id, status, monitor_config=monitor_config(entry))  # type: ignore[arg-type]
            return slug, check_in_id, time.monotonic()
        slug, check_in_id, started = check_in
        capture_checkin(slug, check_in_id, status, duration=time.monotonic() - started)
        return check_in


def _restore(previous: tuple[Scope, Scope]) -> None:
    """Put back the current and isolation scopes a message's forks replaced."""
    Scope.set_current_scope(previous[0])
    Scope.set_isolation_scope(previous[1])


def _final(broker: Broker, message: MessageProxy, exception: BaseException) -> bool:
    """Retries gave up: not a ``Retry``, not an exception the actor ``throws``."""
    return message.failed and not isinstance(exception, Retry) and not expected_failure(broker, message, exception)


def _returned_frames(exception: BaseException) -> tuple[type[BaseException], BaseException, TracebackType | None]:
    """The exception with the frames of its traceback that are still running left out.

    The first ones are Dramatiq's worker loop, inside the ``except`` block that
    caught it. Building an event reads each frame's locals, and in a running frame
    that stores a snapshot of them in the frame, the exception included: a
    reference cycle that would keep it, its traceback and every local alive until
    the cyclic garbage collector ran. Dramatiq frees it at once, and so must we.
    """
    running = set()  # ids, not frames: a set holding this very frame would be a cycle of its own
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    tb = exception.__traceback__
    while tb is not None and id(tb.tb_frame) in running:
        tb = tb.tb_next
    return type(exception), exception, tb


def _trace_id(message: MessageProxy) -> str | None:
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        return format(context.trace_id, "032x")
    traceparent = (message.options.get(DELIVERY) or {}).get("traceparent", "")
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 else None


def _sentry_headers(message: MessageProxy) -> dict[str, str]:
    """The message's W3C context as Sentry's ``sentry-trace`` header: one trace id in both tools."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        sampled = "1" if context.trace_flags.sampled else "0"
        return {"sentry-trace": f"{context.trace_id:032x}-{context.span_id:016x}-{sampled}"}
    parts = (message.options.get(DELIVERY) or {}).get("traceparent", "").split("-")
    if len(parts) == 4:
        return {"sentry-trace": f"{parts[1]}-{parts[2]}-{'1' if parts[3].endswith('1') else '0'}"}
    return {}
