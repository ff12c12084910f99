"""Panic recovery: nothing a handler raises takes a worker thread down.

Dramatiq already catches ``BaseException`` around the actor call. Two gaps remain,
and this middleware closes both:

* A ``SystemExit``, ``KeyboardInterrupt`` or other non-``Exception`` raised by a
  handler reaches middleware (Sentry, ``retry_when`` predicates, our task log) as
  something most code does not expect. It is re-raised as
  :class:`~dramatiq_gp.errors.HandlerPanic`, chained to the original, so it is an
  ordinary failed attempt that is retried. Dramatiq's own interrupts
  (``TimeLimitExceeded``, ``Shutdown``) pass through untouched.
* A ``BaseException`` escaping a middleware hook, or an asynchronous time-limit
  exception landing just after the handler returned, ends the thread, and Dramatiq
  never starts another. A supervisor thread notices and starts a replacement.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from dramatiq import Actor, Broker, Middleware, Worker
from dramatiq.threading import Interrupt

from ..errors import HandlerPanic

#: How often the supervisor counts live worker threads.
SUPERVISE_INTERVAL_S = 1.0


def _recovering(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (Exception, Interrupt):
            raise
        except BaseException as exc:
            raise HandlerPanic(f"handler raised {type(exc).__name__}: {exc}") from exc

    call.__gp_recovering__ = True  # type: ignore[attr-defined]
    return call


class PanicRecovery(Middleware):
    """Turns handler ``BaseException``s into retried failures and replaces dead worker threads.

    Hooks: ``after_declare_actor`` (wraps each actor's function),
    ``after_worker_boot`` (starts the supervisor) and ``before_worker_shutdown``.
    Works on any broker; the supervisor uses the worker's ``workers`` and private
    ``_add_worker()`` (see ``docs/internals.md``).
    """

    def __init__(self) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self._stop = threading.Event()

    def after_declare_actor(self, broker: Broker, actor: Actor[Any, Any]) -> None:
        if not getattr(actor.fn, "__gp_recovering__", False):
            actor.fn = _recovering(actor.fn)

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self._stop.clear()
        threading.Thread(target=self._supervise, args=(worker,), name="gp-thread-supervisor", daemon=True).start()

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        # Threads stop on purpose from here on.
        self._stop.set()

    def _supervise(self, worker: Worker) -> None:
        while not self._stop.wait(SUPERVISE_INTERVAL_S):
            dead = [thread for thread in worker.workers if not thread.is_alive()]
            for thread in dead:
                if self._stop.is_set():
                    return
                worker.workers.remove(thread)
                self.logger.error("worker thread %s died; starting a replacement", thread.name)
                worker._add_worker()
