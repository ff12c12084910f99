"""The errors dramatiq_gp raises: a shallow tree under :class:`GPError`."""

from __future__ import annotations


class GPError(Exception):
    """Base class of every error dramatiq_gp raises on purpose."""


class ConfigError(GPError, ValueError):
    """An environment variable or setting has an invalid value.

    The message names the variable and the value (secrets redacted).
    """


class EventError(GPError, TypeError):
    """A class was used as an event but is not one, or was declared twice."""


class EventEncodeError(GPError, ValueError):
    """An event payload cannot be encoded as JSON; nothing was sent."""


class RegistrationError(GPError, ValueError):
    """A listener was registered with a bad name, handler or option."""


class BrokerUnreachable(GPError, ConnectionError):
    """Redis/Valkey did not answer at start-up."""


class HandlerPanic(GPError):
    """A handler raised a ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``...).

    The worker turns it into this ordinary exception, chained to the original,
    so the attempt fails and is retried like any other error.
    """
