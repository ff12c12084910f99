"""``async def`` listeners and jobs: they run on Dramatiq's event-loop thread, the stock way.

Dramatiq's ``Actor`` wraps a coroutine function with ``dramatiq.asyncio.async_to_sync``:
the worker thread hands the coroutine to the one ``EventLoopThread`` of the
process (started by an ``AsyncIO`` middleware: :class:`AsyncIO`, Dramatiq's with a daemon
thread, is in :func:`~dramatiq_gp.default_middleware`) and blocks until it finishes. So
every middleware hook still runs in the worker thread, around the call, exactly
as for a plain function; and the coroutine runs in a *copy* of that thread's
context (asyncio copies it when the worker thread schedules the task), so it
sees the message's span, Sentry scope and envelope, and whatever it sets stays
in its own task. Time limits and shutdown notifications interrupt the worker
thread, which cancels the task and waits for it to clean up.

The cost of this path: an async handler holds its worker thread while it awaits,
so it matches a plain function's throughput at the same thread count; it does
not beat it (``python -m benchmarks async_io``).

This module holds what the kit adds: the check that the broker can run a
coroutine at all, and the cancellation of the coroutines still running when the
drain at shutdown times out (:class:`~dramatiq_gp.Lifecycle` has put their
messages back by then).
"""

from __future__ import annotations

import asyncio
import inspect
import threading

from dramatiq import Broker, Worker
from dramatiq.asyncio import EventLoopThread, get_event_loop_thread, set_event_loop_thread
from dramatiq.middleware import AsyncIO as DramatiqAsyncIO

from .errors import RegistrationError

#: How long the shutdown waits for cancelled coroutines to run their clean-up.
CANCEL_WAIT_S = 1.0


class AsyncIO(DramatiqAsyncIO):
    """Dramatiq's ``AsyncIO`` middleware, with its event-loop thread a daemon.

    Dramatiq's loop thread is not a daemon: a worker process told to stop twice
    (the ``dramatiq`` command exits at the second SIGTERM, which a process-group
    signal delivers) would wait for it for ever, where every other thread of the
    kit's is a daemon and the process ends. Otherwise the same: it starts the
    loop in ``before_worker_boot`` and stops it in ``after_worker_shutdown``.

    Hooks: ``before_worker_boot``, ``after_worker_shutdown``. Works on any broker.
    """

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        thread = EventLoopThread(self.logger)
        thread.daemon = True
        thread.start(timeout=1.0)
        set_event_loop_thread(thread)


def is_async(handler: object) -> bool:
    """Whether calling ``handler`` gives a coroutine: an ``async def`` function or a partial of one."""
    return inspect.iscoroutinefunction(handler)


def require_event_loop(broker: Broker, where: str) -> None:
    """Refuse an async handler on a broker that would have no event loop to run it on.

    Raises:
        RegistrationError: ``broker`` has no ``AsyncIO`` (Dramatiq's or the kit's), naming ``where``.
    """
    if not any(isinstance(middleware, DramatiqAsyncIO) for middleware in broker.middleware):
        raise RegistrationError(
            f"{where} is async: add gp.AsyncIO() to the broker's middleware "
            "(gp.default_middleware() and the Kit have it)"
        )


def cancel_coroutines(timeout_s: float = CANCEL_WAIT_S) -> int:
    """Cancel every task on Dramatiq's event loop and wait up to ``timeout_s`` for them to end; how many.

    Called at shutdown once the drain has timed out: the messages of those tasks
    were put back already, so they run again elsewhere; cancelling lets their
    ``finally`` blocks and ``async with`` exits run before the loop stops (a
    stopped loop would drop them silently, mid-await).
    """
    thread = get_event_loop_thread()
    if thread is None or not thread.loop.is_running():
        return 0
    loop = thread.loop
    counted: list[int] = []
    done = threading.Event()

    async def cancel_all() -> None:
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        counted.append(len(tasks))
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        done.set()

    asyncio.run_coroutine_threadsafe(cancel_all(), loop)
    done.wait(timeout_s + 1.0)
    return counted[0] if counted else 0
