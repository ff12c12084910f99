"""Retries whose retry is sent together with the ack of the failed attempt.

Dramatiq's :class:`dramatiq.middleware.Retries` enqueues the retry from
``after_process_message``. When Redis is unreachable at that moment the enqueue
raises, the broker logs and swallows it as it does any hook's error, and the
worker then acks the failed attempt as soon as Redis is back: the message is
gone and its retry never existed. (The soak lost whole orders that way, an
outbox event's fan-out failing as Redis restarted.)

Here the retry is handed to the kit's broker instead, which puts it in the message's
settle plan and sends it with the ack
(:meth:`dramatiq_gp.brokers.base.KitBroker.redeliver_later`): on Redis in the same
Lua call, on RabbitMQ published and confirmed before the ack. The failed attempt
is never acked without its retry sent (``docs/life-of-a-message.md``).

A :class:`~dramatiq_gp.PayloadMismatch` (an event written by another version of the
application, which this one's class cannot read) is never retried: no retry can
change the payload. The message fails at once, to its dead-letter queue, with the
error that names the fields.

Every message it lets fail for good says why in its dead letter
(``gp_dead_letter_reason``): the exception its actor ``throws``, or what failed it
before it ran (``AgeLimit``'s ``max_age``); Dramatiq's policy keeps the traceback of
a retried attempt, which says why for the others.
"""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq import Worker
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import current_millis
from dramatiq.middleware import AgeLimit

from ..brokers.base import DEAD_LETTER_REASON, kit_broker
from ..errors import PayloadMismatch, one_line_at_start_up


def expected_failure(broker: Broker, message: MessageProxy, exception: BaseException) -> bool:
    """Whether ``exception`` is one the actor ``throws``: an expected outcome, failed at once, never retried.

    Dramatiq logs it at INFO without a traceback and Sentry's own integration does
    not report it; the kit's task log and Sentry middleware do the same.
    """
    actor = broker.actors.get(message.actor_name)
    throws: Any = message.options.get("throws") or (actor.options.get("throws") if actor is not None else None)
    return bool(throws) and isinstance(exception, throws)


class Retries(dramatiq.middleware.Retries):
    """Dramatiq's retry policy (``max_retries``, backoff, ``retry_when``, ``throws``,
    ``on_retry_exhausted``), with each retry sent atomically with the ack.

    Hooks: ``before_worker_boot`` (refuses any broker but the kit's, which carries
    the retry with the ack) and ``after_process_message``. Takes
    Dramatiq's ``Retries`` arguments; use it instead of Dramatiq's, not beside it.
    """

    @one_line_at_start_up
    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        kit_broker(broker, self)

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        if exception is None:
            return
        if isinstance(exception, PayloadMismatch):
            # The dead letter says why, as the kit's own set-asides do; its one attempt counts.
            message.options["retries"] = message.options.get("retries", 0) + 1
            message.options[DEAD_LETTER_REASON] = f"{type(exception).__name__}: {exception}"
            message.fail()
            return
        if expected_failure(broker, message, exception):
            # Dramatiq fails it without a traceback: the dead letter would not say why.
            message.options[DEAD_LETTER_REASON] = (
                f"{type(exception).__name__}: {exception} (one its actor throws: not retried)"
            )
        super().after_process_message(  # type: ignore[no-untyped-call]
            _SendWithAck(kit_broker(broker, self), message), message, result=result, exception=exception
        )

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        if message.failed and DEAD_LETTER_REASON not in message.options:
            message.options[DEAD_LETTER_REASON] = _skipped_reason(broker, message)


def _skipped_reason(broker: Broker, message: MessageProxy) -> str:
    """Why a message failed before it ran: past its ``max_age`` (``AgeLimit``, which says so only in its log),
    or another middleware's doing."""
    actor = broker.actors.get(message.actor_name)
    default = next((m.max_age for m in broker.middleware if isinstance(m, AgeLimit)), None)
    max_age = message.options.get("max_age") or (actor.options.get("max_age", default) if actor else default)
    age = current_millis() - message.message_timestamp
    if max_age and age >= max_age:
        return f"{age:,} ms old when it came to run, past its max_age of {max_age:,} ms (AgeLimit)"
    return "skipped by a middleware before it ran, and failed"


class _SendWithAck:
    """The broker as Dramatiq's policy sees it: its ``enqueue`` of the retry joins the ack."""

    def __init__(self, broker: Any, message: MessageProxy) -> None:
        self._broker, self._message = broker, message

    def enqueue(self, message: Any, *, delay: int | None = None) -> Any:
        self._broker.redeliver_later(self._message, delay or 0)
        return message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._broker, name)
