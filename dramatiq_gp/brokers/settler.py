"""The settler: the settles of a few milliseconds written in one batch, from a thread of its own.

Dramatiq acks each message with a round trip of its own, from the worker thread
that ran it: a request, a wait and a reply per message, the largest per-message
cost left once the middleware is cheap. Here the threads that settle messages (the
worker threads, mostly) hand each settle (a :data:`~.base.Settle`, its
:class:`~.base.SettlePlan` on the message) to the :class:`Settler`, whose thread
(``gp-settler``) writes what came within one window (``WORKER_SETTLE_WINDOW``, 1 ms
by default) in one batch. A longer window saves
little more CPU (measured: the same at 0.2, 1 and 5 ms) and widens what a
``kill -9`` runs again. What a batch is on each broker, and what a kill, a stop or
an unreachable Redis does to the settles waiting here, is ``docs/life-of-a-message.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import redis

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How long the settler waits before retrying a batch Redis did not take.
RETRY_S = 1.0


class Settler(Generic[T]):
    """Collects entries and hands them to ``write`` in batches, at most ``window_s`` after the first.

    ``write`` gets every entry collected so far, in order; it raises one of
    ``retry_on`` (by default ``redis.ConnectionError`` and ``redis.TimeoutError``)
    when the batch did not go through (it is retried: writing it twice does
    nothing more than once) and anything else when the batch can never be written
    (it is given to ``give_up``).
    """

    def __init__(
        self,
        write: Callable[[list[T]], None],
        give_up: Callable[[list[T], BaseException], None],
        *,
        window_s: float,
        retry_on: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError),
    ) -> None:
        self.window_s = window_s
        self._retry_on = retry_on
        self._write = write
        self._give_up = give_up
        self._pending: list[T] = []
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # one batch at a time, in order
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False  # the last attempt found Redis away (logged once per outage)

    def add(self, entry: T) -> None:
        with self._lock:
            self._pending.append(entry)
            first = len(self._pending) == 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gp-settler", daemon=True)
                self._thread.start()
        if first:
            self._wake.set()

    def flush(self, *, retry: bool = True) -> bool:
        """Write every pending entry now; whether they were written.

        With ``retry`` it keeps trying, once a second, until they go through.
        Without, what did not go through goes back to wait for the settler
        thread's next try. Between tries nothing is held, so a flush without
        ``retry`` (a consumer closing, the broker closing) never waits for
        longer than one attempt.
        """
        while True:
            with self._writing:
                with self._lock:
                    batch, self._pending = self._pending, []
                if not batch:
                    return True
                try:
                    self._write(batch)
                except self._retry_on as exc:
                    with self._lock:
                        self._pending[:0] = batch
                    error: BaseException | None = exc
                except Exception as exc:
                    logger.exception("could not settle %d message(s); they run again", len(batch))
                    self._give_up(batch, exc)
                    return True
                else:
                    if self._failing:
                        self._failing = False
                        logger.warning("settles go through again: the %d waiting message(s) are settled", len(batch))
                    return True
            if not self._failing:
                self._failing = True
                logger.warning(
                    "could not settle %d message(s): %s; retrying every %.0f s until they go through",
                    len(batch),
                    error,
                    RETRY_S,
                )
            if not retry:
                self._wake.set()
                return False
            time.sleep(RETRY_S)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            # Whatever the other threads settle meanwhile goes in the same call.
            time.sleep(self.window_s)
            self.flush()
