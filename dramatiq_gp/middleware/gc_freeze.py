"""Garbage collection: what a worker holds at boot is left out of every later collection.

A worker process keeps, for as long as it runs, the objects its imports made:
modules, classes, functions, the registries of its ORM and SDKs, the kit's own.
CPython's full collections walk all of them again each time, and a busy worker
allocates enough to run one every few thousand messages. Once the worker has
booted, one collection clears what start-up left behind and ``gc.freeze()`` moves
the rest to the permanent generation, which collections skip. On the overhead
benchmark's RabbitMQ worker that took the kit's collections from 14.6 µs to 5.7 µs
of CPU per message (``docs/rabbitmq.md``, "What it costs").

What is frozen is never collected, even if it becomes garbage later: at boot,
that is what a worker keeps anyway. It is done once per process, so a second
worker started in the same process (as in tests) freezes nothing more.
"""

from __future__ import annotations

import gc
import threading

from dramatiq import Broker, Middleware, Worker

_frozen = threading.Event()


class GcFreeze(Middleware):
    """Collects once and freezes what is left when the worker has booted (see the module docstring).

    Hooks: ``after_worker_boot``. First in :func:`default_middleware`'s list, so
    it runs after every other middleware's ``after_worker_boot`` (Dramatiq runs
    after-hooks in reverse) and freezes what they started too. Works on any broker.
    """

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        if _frozen.is_set():
            return
        _frozen.set()
        gc.collect()
        gc.freeze()
