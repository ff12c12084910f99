"""The Redis consumer's prefetch, left at Dramatiq's default, follows its throughput.

A fast queue grows its buffer (fewer, larger fetches: the CPU a no-op message
costs), a slow one keeps Dramatiq's twice the threads, so long tasks stay on the
queue for other replicas; ``dramatiq_queue_prefetch`` and ``WORKER_QUEUES`` keep
the prefetch they set.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import dramatiq
import dramatiq.worker
import pytest

from dramatiq_gp.brokers.redis import PREFETCH_GROWTH
from helpers import wait_for

THREADS = 4
DEFAULT = 2 * THREADS  # Dramatiq's default prefetch


def _consumer(worker: dramatiq.Worker, queue_name: str) -> Any:
    return wait_for(lambda: getattr(worker.consumers.get(queue_name), "consumer", None))


def _watch(consumer: Any, until: threading.Event) -> list[int]:
    """The consumer's prefetch, sampled every 10 ms until ``until`` is set."""
    seen: list[int] = []

    def sample() -> None:
        while not until.is_set():
            seen.append(consumer.prefetch)
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    return seen


def test_a_fast_queue_grows_its_prefetch(make_kit, start_worker):
    kit = make_kit()
    done: list[int] = []

    @dramatiq.actor(broker=kit.broker, queue_name="fast")
    def fast(n: int) -> None:
        done.append(n)

    kit.broker.enqueue_many([fast.message(n) for n in range(20_000)])
    worker = start_worker(kit, threads=THREADS)
    stop = threading.Event()
    seen = _watch(_consumer(worker, "fast"), stop)
    wait_for(lambda: len(done) >= 15_000, timeout=60)
    stop.set()
    assert max(seen) > DEFAULT
    assert max(seen) <= DEFAULT * PREFETCH_GROWTH


def test_a_slow_queue_keeps_dramatiqs_prefetch(make_kit, start_worker):
    kit = make_kit()
    done: list[int] = []

    @dramatiq.actor(broker=kit.broker, queue_name="slow")
    def slow(n: int) -> None:
        time.sleep(0.2)
        done.append(n)

    kit.broker.enqueue_many([slow.message(n) for n in range(40)])
    worker = start_worker(kit, threads=THREADS)
    stop = threading.Event()
    seen = _watch(_consumer(worker, "slow"), stop)
    wait_for(lambda: len(done) >= 30, timeout=30)
    stop.set()
    # 0.2 s tasks on 4 threads finish 20 a second: a quarter second ahead is 5, below
    # Dramatiq's default, which the consumer keeps: the rest wait on the queue for any replica.
    assert set(seen) == {DEFAULT}


@pytest.mark.parametrize("how", ["dramatiq_queue_prefetch", "WORKER_QUEUES"])
def test_a_prefetch_set_by_the_user_stays_as_set(how, make_kit, start_worker, monkeypatch):
    if how == "dramatiq_queue_prefetch":
        # Dramatiq reads the variable once, at import, into this global: set it there.
        monkeypatch.setattr(dramatiq.worker, "QUEUE_PREFETCH", 6)
        kit = make_kit()
        expected = 6
    else:
        kit = make_kit(env={"WORKER_QUEUES": "fast"})
        expected = kit.broker.prefetch_per_thread * THREADS
    done: list[int] = []

    @dramatiq.actor(broker=kit.broker, queue_name="fast")
    def fast(n: int) -> None:
        done.append(n)

    kit.broker.enqueue_many([fast.message(n) for n in range(10_000)])
    worker = start_worker(kit, threads=THREADS)
    stop = threading.Event()
    seen = _watch(_consumer(worker, "fast"), stop)
    wait_for(lambda: len(done) >= 8_000, timeout=60)
    stop.set()
    assert set(seen) == {expected}
