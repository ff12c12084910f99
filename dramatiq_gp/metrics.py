"""The kit's OpenTelemetry instruments, from the global meter.

Created once, on first use, from the global meter provider; until a provider is
installed (in the worker, at process boot) they are the API's proxies, which
start recording once it is. Without a provider they cost next to nothing.

==================================  =========  ================================================
Instrument                          Kind       Attributes
==================================  =========  ================================================
``dramatiq_gp.messages``            counter    ``queue``, ``task_type``, ``outcome``
                                               (``done``, ``retried``, ``failed``, ``skipped``)
``messaging.process.duration``      histogram  ``messaging.destination.name``, ``task_type``,
                                               ``error.type`` (seconds)
``dramatiq_gp.queue.wait``          histogram  ``queue``, ``task_type`` (seconds from enqueue,
                                               or from the due time of a delayed message)
``messaging.client.sent.messages``  counter    ``messaging.destination.name``, ``task_type``
``dramatiq_gp.outbox.published``    counter    events the relay moved to the queue
``dramatiq_gp.outbox.set_aside``    counter    rows set aside as poison
``dramatiq_gp.outbox.backlog``      gauge      pending rows (delayed ones once due)
``dramatiq_gp.outbox.oldest_age``   gauge      seconds since the oldest pending row fell due
``dramatiq_gp.scheduler.leader``    gauge      1 in the process holding the lease, else 0
``dramatiq_gp.scheduler.ticks``     counter    ``entry``, ``outcome`` (``fired``, ``caught_up``,
                                               ``deduplicated``, ``paused``, ``not_durable``)
``dramatiq_gp.scheduler.overlaps``  counter    ``entry``, ``outcome`` (``skipped``, ``waited``): runs
                                               of an ``overlap=`` job that found the previous one running
==================================  =========  ================================================
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation

#: Bucket bounds (seconds) for durations and waits: 1 ms to 5 min.
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


@dataclass(frozen=True)
class Instruments:
    messages: Counter
    process_duration: Histogram
    queue_wait: Histogram
    sent: Counter
    outbox_published: Counter
    outbox_set_aside: Counter
    scheduler_ticks: Counter
    scheduler_overlaps: Counter


_lock = threading.Lock()
_instruments: Instruments | None = None


def meter() -> metrics.Meter:
    return metrics.get_meter("dramatiq_gp")


def instruments() -> Instruments:
    """The kit's counters and histograms (created on first call)."""
    global _instruments
    if _instruments is None:
        with _lock:
            if _instruments is None:
                m = meter()
                _instruments = Instruments(
                    messages=m.create_counter(
                        "dramatiq_gp.messages", unit="{message}", description="Messages processed, by outcome"
                    ),
                    process_duration=m.create_histogram(
                        "messaging.process.duration",
                        unit="s",
                        description="Time spent processing a message",
                        explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
                    ),
                    queue_wait=m.create_histogram(
                        "dramatiq_gp.queue.wait",
                        unit="s",
                        description="Time from enqueue (or due time) to start",
                        explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
                    ),
                    sent=m.create_counter(
                        "messaging.client.sent.messages", unit="{message}", description="Messages sent to a queue"
                    ),
                    outbox_published=m.create_counter(
                        "dramatiq_gp.outbox.published", unit="{event}", description="Events relayed to the queue"
                    ),
                    outbox_set_aside=m.create_counter(
                        "dramatiq_gp.outbox.set_aside", unit="{event}", description="Outbox rows set aside"
                    ),
                    scheduler_ticks=m.create_counter(
                        "dramatiq_gp.scheduler.ticks", unit="{tick}", description="Schedule ticks, by outcome"
                    ),
                    scheduler_overlaps=m.create_counter(
                        "dramatiq_gp.scheduler.overlaps",
                        unit="{run}",
                        description="Job runs that found the entry's previous run still running, by outcome",
                    ),
                )
    return _instruments


def observe(name: str, unit: str, description: str, read: Callable[[], Iterable[Observation]]) -> None:
    """Register a gauge whose value the bound method ``read`` returns at each collection.

    The meter outlives its owner (a relay or a scheduler built and dropped, as tests and
    embedding applications do), so it holds ``read`` weakly: a gauge must not keep a
    dropped relay's engine alive, to be collected later with its connections still open.
    """
    method = weakref.WeakMethod(read)

    def callback(options: CallbackOptions) -> Iterable[Observation]:
        bound = method()
        return bound() if bound is not None else ()

    meter().create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)
