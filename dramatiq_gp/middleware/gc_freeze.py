"""Garbage collection: what a worker holds at boot is left out of every later collection.

A worker process keeps, for as long as it runs, the objects its imports made:
modules, classes, functions, the registries of its ORM and SDKs, the kit's own.
CPython's full collections walk all of them again each time, and a busy worker
allocates enough to run one every few thousand messages. Once the worker has
booted, one collection clears what start-up left behind and ``gc.freeze()`` moves
the rest to the permanent generation, which collections skip. On the overhead
benchmark's RabbitMQ worker that took the kit's collections from 14.6 µs to 5.7 µs
of CPU per message (``docs/rabbitmq.md``, "What it costs").

The youngest generation's threshold is then raised to :data:`YOUNG_THRESHOLD`
container objects (CPython's default is 700 before 3.13, 2,000 since; never lowered). A worker's objects
per message live about as long as the batch they came in, or, with tracing, as
the span processor's queue of finished spans (512 spans before an export): a few
thousand objects, enough at 700 to run a young collection every 50 messages or
so, each one walking and promoting what is still in flight, and every tenth of
those an older one. At 10,000 the queue fits and a steady worker runs next to
none: on the overhead benchmark's traced worker, collections went from 17 young,
1.5 middle and 0.15 full per thousand messages to none, about 6 µs of CPU per
message. Cyclic garbage waits longer for its collection: a task that leaves a
cycle behind each time has about 14 times as many pending, with what they hold.

What is frozen is never collected, even if it becomes garbage later: at boot,
that is what a worker keeps anyway. It is done once per process, so a second
worker started in the same process (as in tests) freezes nothing more.
"""

from __future__ import annotations

import gc
import threading

from dramatiq import Broker, Middleware, Worker

_frozen = threading.Event()
#: The young generation's threshold once frozen (see the module docstring), unless it already is higher.
YOUNG_THRESHOLD = 10_000


class GcFreeze(Middleware):
    """Collects once, freezes what is left and raises the young threshold when the worker has booted.

    See the module docstring.

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
        young, *older = gc.get_threshold()
        gc.set_threshold(max(young, YOUNG_THRESHOLD), *older)
