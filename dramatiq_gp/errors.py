"""The errors dramatiq_gp raises: a shallow tree under :class:`GPError`."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from types import FrameType
from typing import ParamSpec, TypeVar

from dramatiq import cli
from dramatiq.errors import ConnectionClosed
from dramatiq.middleware import MiddlewareError, SkipMessage

P = ParamSpec("P")
R = TypeVar("R")


class GPError(Exception):
    """Base class of every error dramatiq_gp raises on purpose."""


class AlreadyApplied(GPError, SkipMessage):
    """The message's id is in the inbox: its effect committed already, so the ``with`` body did not run.

    The kit's listeners and jobs end such a message as done (it is acked and not
    retried); in a plain Dramatiq actor it is Dramatiq's ``SkipMessage``, which
    acks it too. Code after the ``with`` block does not run either.
    """


class ConfigError(GPError, ValueError):
    """An environment variable or setting has an invalid value.

    The message names the variable and the value (secrets redacted).
    """


class EventError(GPError, TypeError):
    """A class was used as an event but is not one, or was declared twice."""


class DispatchError(GPError, ValueError):
    """A dispatch's ``delay`` or ``at`` is not one it can keep (negative, naive, both given, too far ahead, no outbox
    to hold it), or the outbox table predates delayed events; nothing was written. Also a message sent with a
    ``delay=`` longer than the kit's brokers hold one (7 days); nothing was sent."""


class EventEncodeError(GPError, ValueError):
    """An event payload cannot be encoded as JSON; nothing was sent."""


class PayloadMismatch(GPError, ValueError):
    """An event's payload does not fit this process's class of it (a field missing, or of the wrong type).

    Another version of the application wrote it. Retrying cannot change that, so the
    message is set aside at once (to its dead-letter queue, or the outbox row
    aside), with this error, which names each field and what is wrong with it, never
    its value.
    """


class RegistrationError(GPError, ValueError):
    """A listener was registered with a bad name, handler or option."""


class NotAQueue(GPError, ValueError):
    """An operator's action named something that is not a queue: a bad name, or a queue's ``.DQ`` or ``.XQ``."""


class QuorumLost(GPError, ConnectionClosed):
    """A send to a RabbitMQ queue failed because the queue has likely lost its quorum.

    A quorum queue with a majority of its nodes down cannot be declared, and takes a
    message without confirming it until the majority is back. The message names the
    queue. A :class:`dramatiq.errors.ConnectionClosed`, so what retries a lost
    connection (the outbox relay, a retried task) retries this too.
    """


class ConfirmTimeout(QuorumLost):
    """RabbitMQ did not confirm a send within ``RABBITMQ_CONFIRM_TIMEOUT``.

    The message may still be delivered once the majority is back; a send again
    under the same id is deduplicated by an idempotent actor.
    """


class BrokerUnreachable(GPError, ConnectionError):
    """Redis/Valkey did not answer at start-up."""


class BrokerMismatch(GPError, MiddlewareError):
    """A middleware that needs one of the kit's brokers (:class:`dramatiq_gp.RedisBroker`,
    :class:`dramatiq_gp.RabbitmqBroker`) was given another broker.

    A ``MiddlewareError``, so Dramatiq lets it out of the hook that found it instead
    of logging and swallowing it: nothing may run half-wired.
    """


class UnsafeDirectory(GPError, PermissionError):
    """A directory the kit would share state in is not the user's alone (another user's, open to others, a link).

    Its message names the directory and what is wrong with it, in one line.
    """


class HandlerPanic(GPError):
    """A handler raised a ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``...).

    The worker turns it into this ordinary exception, chained to the original,
    so the attempt fails and is retried like any other error.
    """


def one_line_at_start_up(fn: Callable[P, R]) -> Callable[P, R]:
    """While the ``dramatiq`` command boots a worker process, end it with one line on a :class:`GPError`.

    Dramatiq's worker process catches only ``ImportError`` and connection errors
    while it imports the broker module; anything else reaches ``multiprocessing``,
    which prints ``Process Process-1:`` and the whole traceback before the message
    that matters. Wrapped around the calls an application makes at import (building
    the Kit, declaring events, listeners and schedule entries), a deliberate error
    is logged once (``start-up failed: ...``) and the process exits with Dramatiq's
    code for a failed import (2). Anywhere else, including code that catches the
    error itself outside a booting worker, it is raised as usual.

    Dramatiq internal relied on: the worker process runs ``dramatiq.cli.worker_process``,
    whose frame is on the stack while it imports the broker and extra modules.
    """

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except GPError as exc:
            if not _booting_dramatiq_worker():
                raise
            logging.getLogger("dramatiq_gp").error("start-up failed: %s", exc)
            raise SystemExit(cli.RET_IMPORT) from None

    return call


def _booting_dramatiq_worker() -> bool:
    code = cli.worker_process.__code__
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
