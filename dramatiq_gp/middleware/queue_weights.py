"""Queue weights: each worker process shares its threads among queues by ``WORKER_QUEUES`` weight.

Dramatiq runs one consumer per queue, all feeding one in-process priority queue,
so a burst on one queue crowds out the rest. At worker boot this middleware
swaps that queue for a :class:`WeightedQueue` holding one heap per queue
(actor priority still orders each heap), and sets each consumer's prefetch (on
RabbitMQ, the consumer's ``basic.qos`` prefetch count).

* **Weighted** (default): a free worker thread takes its next message by smooth
  weighted round robin among the queues that have one ready, so with
  ``default:3,mail:1`` and both backlogged every run of four starts has three
  ``default`` and one ``mail``; an empty queue's turn goes to the others, and no
  queue with a weight above 0 ever starves (weight 0: only when the others are
  empty). Prefetch grows with a queue's weight, so the heavy queue's buffer does
  not run dry between fetches and hand its turns to a light queue.
* **Strict** (``WORKER_STRICT_PRIORITY=true``): the heaviest queue with a message
  ready goes first, and a lighter queue's message starts only when every heavier
  queue's last fetch came back empty (on RabbitMQ: its consumer waited
  ``worker_timeout``, a second by default, and nothing came). Lighter queues prefetch one
  message, so little of them sits hidden from other replicas.

Weights count messages started, per process.
"""

from __future__ import annotations

import heapq
import logging
import math
import queue
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dramatiq import Broker, Middleware, Worker
from dramatiq.broker import MessageProxy
from dramatiq.common import q_name

from ..brokers.base import KitBroker, kit_broker
from ..errors import one_line_at_start_up
from ..names import is_delay_queue

#: Prefetch per queue is this many messages per worker thread, times the queue's share (on
#: the kit's brokers, their ``prefetch_per_thread``).
PREFETCH_PER_THREAD = 8


class WeightedQueue(queue.Queue[Any]):
    """Dramatiq's work queue with one heap per queue, served by weight (see the module docstring).

    Parameters:
        weights: queue name to weight; a queue not named weighs 1.
        strict: serve by rank instead of by share.
    """

    def __init__(self, weights: Mapping[str, int], *, strict: bool = False) -> None:
        self.weights = dict(weights)
        self.strict = strict
        #: Whether each queue's last fetch returned messages (strict mode).
        self.backlog: dict[str, bool] = {}
        super().__init__()

    # queue.Queue's storage hooks, called with its mutex held.
    def _init(self, maxsize: int) -> None:
        self._heaps: dict[str, list[Any]] = {}
        self._credit: dict[str, int] = {}
        self._count = 0

    def _qsize(self) -> int:
        return self._count

    def _put(self, item: Any) -> None:
        heapq.heappush(self._heaps.setdefault(q_name(item.message.queue_name), []), item)
        self._count += 1

    def _get(self) -> Any:
        # Reached only through a non-blocking get: Dramatiq draining the queue at shutdown.
        name = self._choose(draining=True)
        assert name is not None  # Queue.get checked _qsize() first
        return self._pop(name)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next message by weight; a blocking get waits while none may start (strict mode)."""
        if not block:
            return super().get(block=False)
        with self.not_empty:
            deadline = None if timeout is None else time.monotonic() + timeout
            while (name := self._choose()) is None:
                if deadline is None:
                    self.not_empty.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise queue.Empty
                self.not_empty.wait(remaining)
            item = self._pop(name)
            self.not_full.notify()
            return item

    def fetched(self, queue_name: str, count: int) -> None:
        """A consumer's fetch of ``queue_name`` returned ``count`` messages."""
        if is_delay_queue(queue_name):
            return  # delayed messages are not ready; they join their queue when due
        name = queue_name
        with self.mutex:
            had = self.backlog.get(name, True)
            self.backlog[name] = count > 0
            if had and not count:
                self.not_empty.notify_all()  # lighter queues may go now

    def weight(self, name: str) -> int:
        return self.weights.get(name, 1)

    def _pop(self, name: str) -> Any:
        self._count -= 1
        return heapq.heappop(self._heaps[name])

    def _choose(self, *, draining: bool = False) -> str | None:
        ready = [name for name, heap in self._heaps.items() if heap]
        if not ready:
            return None
        if self.strict:
            best = max(ready, key=self.weight)
            heavier_waiting = any(
                self.backlog.get(name, True) for name in self.weights if self.weight(name) > self.weight(best)
            )
            return None if heavier_waiting and not draining else best
        weighted = [name for name in ready if self.weight(name) > 0] or ready
        # Smooth weighted round robin: the most credited queue goes, and pays the round's total.
        total = 0
        for name in weighted:
            weight = self.weight(name) or 1
            self._credit[name] = self._credit.get(name, 0) + weight
            total += weight
        best = max(weighted, key=self._credit.__getitem__)
        self._credit[best] -= total
        return best


class QueueWeights(Middleware):
    """Installs a :class:`WeightedQueue` in each worker and sizes each consumer's prefetch.

    Hooks: ``before_worker_boot`` (replaces ``worker.work_queue``, a Dramatiq
    internal), ``after_consumer_thread_boot`` (sets each consumer's ``prefetch``),
    and, in strict mode, the broker's ``after_fetch`` (whether a queue still has a
    backlog), so strict mode refuses any broker but the kit's (``RedisBroker``,
    ``RabbitmqBroker``). Weighted mode works on any broker.

    Parameters:
        weights: ``WORKER_QUEUES`` as a mapping; queues with actors but not named get weight 1.
        strict: ``WORKER_STRICT_PRIORITY``.
    """

    def __init__(self, weights: Mapping[str, int], *, strict: bool = False) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.weights = dict(weights)
        self.strict = strict
        self._threads = 8
        self._per_thread = PREFETCH_PER_THREAD
        self._work_queue: WeightedQueue | None = None

    @one_line_at_start_up
    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        if self.strict:
            kit_broker(broker, self)
        consumed = {q for q in broker.get_declared_queues() if not is_delay_queue(q)}
        if worker.consumer_whitelist:  # dramatiq --queues still decides what this process consumes
            consumed &= set(worker.consumer_whitelist)
        unlisted = sorted(consumed - set(self.weights))
        if unlisted:
            self.logger.warning(
                "queues %s have actors but are not in WORKER_QUEUES; consuming them with weight 1",
                ", ".join(unlisted),
            )
        weights = {**dict.fromkeys(unlisted, 1), **{q: w for q, w in self.weights.items() if q in consumed}}
        self.weights = weights
        self._threads = worker.worker_threads
        if isinstance(broker, KitBroker):
            self._per_thread = broker.prefetch_per_thread
            broker.fixed_prefetch = True
            broker.worker_info.update(weights=weights, strict=self.strict)
        self._work_queue = WeightedQueue(weights, strict=self.strict)
        worker.work_queue = self._work_queue  # type: ignore[assignment]
        mode = "strict priority" if self.strict else "weighted"
        self.logger.info("start-up: queues %s (%s)", ", ".join(f"{q}:{w}" for q, w in weights.items()) or "none", mode)

    def after_fetch(self, broker: KitBroker, queue_name: str, messages: Sequence[MessageProxy]) -> None:
        if self.strict and self._work_queue is not None:
            self._work_queue.fetched(queue_name, len(messages))

    def after_consumer_thread_boot(self, broker: Broker, thread: Any) -> None:
        name = thread.queue_name
        if is_delay_queue(name) or name not in self.weights:
            return
        thread.prefetch = self.prefetch(name)

    def prefetch(self, name: str) -> int:
        """How many messages of ``name`` one process holds ahead of its threads."""
        weights = self.weights
        if self.strict:
            top = max(weights.values())
            return max(2, 2 * self._threads) if weights[name] == top else 1
        total = sum(weights.values()) or 1
        share = (weights[name] or 1) / total
        return max(2, math.ceil(self._per_thread * self._threads * share))
