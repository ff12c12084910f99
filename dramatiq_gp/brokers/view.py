"""The operator's view of the queues: what ``dramatiq-gp status``, ``dramatiq-gp dlq`` and the dashboard ask.

One :class:`QueueView` per broker kind answers the operator's questions (which
queues there are, how many messages each holds, and its dead letters: list, show,
requeue, purge), as Dramatiq's ``Broker`` answers the worker's with
``get_declared_queues`` and ``join``. The tools ask it and never which broker they
have: :func:`dramatiq_gp.brokers.kinds.view_for` picks it once, from the settings.

A dead letter is shown with its message id, task type, failed attempts, when it
died (where the broker keeps that) and why: the reason the kit gave it
(``gp_dead_letter_reason`` in its options: an unknown task type, a message on
another actor's queue, an exception its actor throws...; beside it for a message
set aside as it came, which may have no options) or the exception its last attempt
raised (the broker keeps it as that attempt left it, with Dramatiq's traceback).
Every action names a queue by its own name: :func:`dead_letters_of` refuses a
queue's ``.DQ`` and ``.XQ``. Its arguments may hold personal data, so they are shown
only when asked for with ``pii=True`` (``SENTRY_SEND_DEFAULT_PII``, the rule Sentry
follows), and ``[Filtered]`` otherwise.

Requeuing puts a dead letter back at the end of its queue as it is, with its message
id, so idempotent execution still skips it if a copy already completed. It keeps its
retry count: a message that used up its retries gets one more attempt.
"""

from __future__ import annotations

import json
import reprlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import NotAQueue
from ..records import shallow, unreadable
from ..settings import QUEUE_NAME
from .base import DEAD_LETTER_REASON

FILTERED = "[Filtered]"


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter, as ``dramatiq-gp dlq`` and the dashboard show it."""

    #: The handle to show or requeue it by: on Redis its Redis message id (its mark when it is not UTF-8),
    #: on RabbitMQ its message id.
    id: str
    queue: str
    dead_at_ms: int | str  #: when it died, or its mark when that is no time (``inf``) or not kept
    message_id: str | None  #: None for bytes that never were a message (set aside as undecodable)
    task_type: str | None
    attempts: int | str  #: the failed attempts (Dramatiq's ``retries`` as its last attempt left it), or its mark
    reason: str | None
    args: Any
    kwargs: Any

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "queue": self.queue,
            "dead_at_ms": self.dead_at_ms,
            "message_id": self.message_id,
            "task_type": self.task_type,
            "attempts": self.attempts,
            "reason": self.reason,
            "args": self.args,
            "kwargs": self.kwargs,
        }


class QueueView(ABC):
    """The queues of one deployment, as an operator sees them; every method reads or changes them now.

    Each method that reads is bounded by what it was asked for, never by how many
    messages there are, unless its docstring says otherwise.
    """

    #: The kind of server the queues are on, for the lines the tools print: ``"Redis/Valkey"`` or ``"RabbitMQ"``.
    server: str
    #: Whether :meth:`counts` tells how many consumers each queue has (the dashboard shows the column).
    counts_consumers = False
    #: The errors that mean the queues' server is out of reach (the tools answer them with one line).
    unreachable: tuple[type[BaseException], ...] = ()

    def __init__(self, where: str) -> None:
        self._where = where

    def where(self) -> str:
        """Where the queues are, safe for logs (passwords hidden)."""
        return self._where

    @abstractmethod
    def names(self, *, thorough: bool = False) -> list[str]:
        """The queues' names, sorted: those the workers recorded; ``thorough`` adds those found by searching
        the server (slower: ``dramatiq-gp status`` asks it, the dashboard does not)."""

    @abstractmethod
    def counts(self, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Per queue of ``names`` (default: :meth:`names`): ``name``, ``ready``, ``in_flight``, ``delayed``,
        ``dead``; on RabbitMQ also ``consumers`` and ``unknown`` (why its counts cannot be known now)."""

    @abstractmethod
    def ready_since(self, names: Sequence[str]) -> dict[str, int]:
        """Per queue of ``names``, when (ms since the epoch) its oldest ready message became ready: the later of
        when it was sent and when it was due (``eta``), so a delayed or retried message counts from its due time.

        A queue left out has none ready, or its kind cannot tell yet. On Redis it is
        exact; on RabbitMQ an estimate (see :meth:`RabbitmqQueueView.ready_since
        <dramatiq_gp.brokers.rabbitmq_view.RabbitmqQueueView.ready_since>`), to be
        read with :meth:`counts`' ``ready``.
        """

    def dead_count(self, queue: str) -> int:
        """How many dead letters ``queue`` has.

        Raises:
            NotAQueue: ``queue`` is no queue's name (see :func:`dead_letters_of`), as for each method below.
        """
        return self._dead_count(dead_letters_of(queue))

    def dead_letters(self, queue: str, *, offset: int = 0, limit: int = 50, pii: bool = False) -> list[DeadLetter]:
        """A page of ``queue``'s dead letters, from ``offset``."""
        return self._dead_letters(dead_letters_of(queue), offset=offset, limit=limit, pii=pii)

    def dead_letter(self, queue: str, id: str, *, pii: bool = False) -> DeadLetter | None:
        """The dead letter ``id`` of ``queue`` (its handle, or its message id), or None."""
        return self._dead_letter(dead_letters_of(queue), id, pii=pii)

    def requeue(self, queue: str, ids: Sequence[str] | None = None) -> int:
        """Move the dead letters ``ids`` (each a handle or a message id; all of the queue's when None) back to
        ``queue``; how many moved."""
        return self._requeue(dead_letters_of(queue), ids)

    def purge(self, queue: str) -> int:
        """Delete every dead letter of ``queue``; how many there were."""
        return self._purge(dead_letters_of(queue))

    # What each broker kind does, for a queue :func:`dead_letters_of` let through.

    @abstractmethod
    def _dead_count(self, queue: str) -> int: ...

    @abstractmethod
    def _dead_letters(self, queue: str, *, offset: int, limit: int, pii: bool) -> list[DeadLetter]: ...

    @abstractmethod
    def _dead_letter(self, queue: str, id: str, *, pii: bool) -> DeadLetter | None: ...

    @abstractmethod
    def _requeue(self, queue: str, ids: Sequence[str] | None) -> int: ...

    @abstractmethod
    def _purge(self, queue: str) -> int: ...


def dead_letters_of(queue: str) -> str:
    """``queue``, checked to be a queue whose dead letters an operator may list, show, requeue or purge.

    A queue's delay queue (``<queue>.DQ``) and dead-letter queue (``<queue>.XQ``) have no dead
    letters of their own: Dramatiq keeps them all under the queue's own name. Named as queues,
    each broker's layout folds them onto the queue's keys, where a requeue on Redis moved a dead
    letter onto its own set and lost it on the way, and one on RabbitMQ put the dead letters
    back in their dead-letter queue and counted them as requeued.

    Raises:
        NotAQueue: one line naming it and what to give instead.
    """
    if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
        raise NotAQueue(f"{queue!r} is not a queue name (letters, digits, '.', '_', '-')")
    if queue.endswith((".DQ", ".XQ")):
        kind = "delay" if queue.endswith(".DQ") else "dead-letter"
        raise NotAQueue(
            f"{queue!r} is the {kind} queue of queue {queue[:-3]!r}: dead letters are kept under their "
            f"queue's own name, so give {queue[:-3]!r}"
        )
    return queue


def is_queue_name(name: str) -> bool:
    """Whether :func:`dead_letters_of` takes ``name``: a queue's own name."""
    try:
        dead_letters_of(name)
    except NotAQueue:
        return False
    return True


def letter(
    queue: str, id: str, dead_at_ms: int | str, raw: bytes | str, pii: bool, set_aside: str | None = None
) -> DeadLetter:
    """A dead letter as stored (an encoded Dramatiq message, or bytes set aside as undecodable), as it shows.

    ``set_aside``: why the consumer set it aside as it came (malformed), which the
    broker keeps beside it (on Redis in ``<queue>.XQ.why``, on RabbitMQ in a header).
    """
    try:
        message = json.loads(raw)
        options = message["options"] if isinstance(message.get("options"), dict) else {}
    except (ValueError, AttributeError, RecursionError):
        why = set_aside or "cannot decode it (set aside as it came)"
        return DeadLetter(id, queue, dead_at_ms, None, None, 0, why, FILTERED, FILTERED)
    reason = set_aside or options.get(DEAD_LETTER_REASON)
    if not isinstance(reason, str):
        traceback = options.get("traceback")
        reason = _exception_line(traceback) if isinstance(traceback, str) else None
    retries = options.get("retries", 0)
    # A message whose retries is no whole number was set aside as malformed: it still lists, marked.
    attempts = retries if type(retries) is int else unreadable(f"retries={reprlib.repr(retries)}")
    return DeadLetter(
        id,
        queue,
        dead_at_ms,
        _str(message.get("message_id")),
        _str(message.get("actor_name")),
        attempts,
        reason,
        shallow(message.get("args")) if pii else FILTERED,
        shallow(message.get("kwargs")) if pii else FILTERED,
    )


def ready_at(timestamp: Any, options: Any) -> int | None:
    """When a message became ready (ms): the later of its ``message_timestamp`` and its ``eta``, if it has one;
    None when its timestamp is no number (no producer of ours wrote it)."""
    if not _number(timestamp):
        return None
    eta = options.get("eta") if isinstance(options, dict) else None
    return int(max(timestamp, eta)) if _number(eta) else int(timestamp)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # NaN is no time


def _exception_line(traceback: str) -> str:
    """The first line of the exception a traceback ends with: ``Type: message``.

    Not the last line: an exception's message can run on (SQLAlchemy's ends with a
    link, and carries the statement and its parameters in between).
    """
    lines = traceback.rstrip().splitlines()
    if not lines:
        return unreadable("empty traceback")
    last_frame = max((i for i, line in enumerate(lines) if line.startswith('  File "')), default=-1)
    return next((line for line in lines[last_frame + 1 :] if line and not line.startswith(" ")), lines[-1])


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
