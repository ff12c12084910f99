"""An exception's text in log records, capped; and the same record without it, for telemetry with PII off.

An exception's message is whatever the code that raised it put in: a card
number, an e-mail address, a row's values in a database error. Over OTLP, unless
``SENTRY_SEND_DEFAULT_PII`` is on, an exception is its type and its frames
(:func:`without_messages`), as Sentry's events leave out the frames' locals.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

#: The most of an exception's text one log line carries (a task's ``error=`` field), and of a traceback.
MAX_ERROR_CHARS, MAX_TRACEBACK_CHARS = 2_000, 20_000


def capped(text: str, limit: int) -> str:
    """``text``, or its head and tail around a note of how much was cut, when it is longer than ``limit``.

    A 10 MB exception message made two 10 MB log lines; the whole text goes to
    Sentry, when it is on, which keeps its own limits.
    """
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half:,} characters cut ...] {text[-half:]}"


class ErrorText(str):
    """``Type: message`` of an exception, capped at :data:`MAX_ERROR_CHARS`, that keeps the type apart.

    A string wherever a line is written; :func:`without_messages` puts the type alone in its place.
    """

    type_name: str

    def __new__(cls, exception: BaseException) -> ErrorText:
        text = super().__new__(cls, capped(f"{type(exception).__name__}: {exception}", MAX_ERROR_CHARS))
        text.type_name = type(exception).__name__
        return text


_TEXTS = (ErrorText, BaseException)


def _without_message(value: Any) -> Any:
    if isinstance(value, ErrorText):
        return value.type_name
    if isinstance(value, BaseException):
        return type(value).__name__
    return value


#: What ``traceback`` writes between an exception and its cause, or the one it was raised while handling.
_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def stack_without_messages(exception: BaseException) -> str:
    """What ``traceback.format_exception`` writes, each exception's line its type alone (no message, no notes).

    The causes and contexts come first, as there; an exception group's members are not listed.
    """
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    current: BaseException | None = exception
    joint = ""
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append((current, joint))
        if current.__cause__ is not None:
            current, joint = current.__cause__, _CAUSE
        elif current.__context__ is not None and not current.__suppress_context__:
            current, joint = current.__context__, _CONTEXT
        else:
            current = None
    parts: list[str] = []
    for link, joint in reversed(chain):
        if link.__traceback__ is not None:
            parts.append("Traceback (most recent call last):\n")
            parts.extend(traceback.format_tb(link.__traceback__))
        kind = type(link)
        module = "" if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}."
        parts.append(f"{module}{kind.__qualname__}\n")
        parts.append(joint)
    return capped("".join(parts), MAX_TRACEBACK_CHARS)


def without_messages(record: logging.LogRecord) -> logging.LogRecord:
    """``record``, or a copy whose arguments and ``error`` field show an exception (or :class:`ErrorText`) as its type.

    The record itself is left alone: the other handlers write it whole. Its
    ``exc_info`` is kept, for the handler to format with :func:`stack_without_messages`.
    The ``error`` field is the task log's (``extra``); other fields are not looked at:
    this runs for every record sent, two per task.
    """
    args, msg, error = record.args, record.msg, record.__dict__.get("error")
    changes_args = False
    if type(args) is tuple:
        for arg in args:
            if isinstance(arg, _TEXTS):
                changes_args = True
                break
    if not (changes_args or isinstance(error, ErrorText) or isinstance(msg, BaseException)):
        return record
    copy = logging.makeLogRecord(record.__dict__)
    if changes_args:
        copy.args = tuple(_without_message(a) for a in args)  # type: ignore[union-attr]
    copy.msg = _without_message(msg)
    if isinstance(error, ErrorText):
        copy.error = error.type_name
    return copy
