"""The kit's Redis broker: Dramatiq's, with the protocol the kit's middleware relies on.

:class:`RedisBroker` takes the arguments of :class:`dramatiq.brokers.redis.RedisBroker`
and keeps its key layout and ``dispatch.lua``, so stock Dramatiq producers and
tools see the same queues. On top of it:

* :meth:`RedisBroker.enqueue_many` sends a batch in one round trip (Dramatiq has no
  batch API), all or nothing, every message encoded before any is sent.
* Settling a message (ack, nack, requeue) also writes its
  :class:`~.base.SettlePlan` (the idempotency outcome, a retry's or deferral's
  copy) in the same Lua call, ``settle.lua``, whose arguments are laid out as
  :data:`SETTLE_ARGV` says; the messages of one settle window go in one such call,
  from the settler thread (:mod:`.settler`). ``docs/life-of-a-message.md`` follows
  a message through it, and says what a ``kill -9`` at each step does.
* ``emit_before``/``emit_after`` call only the hooks a middleware overrides, with
  Dramatiq's rules for what gets out of them.
* Each consumer runs Dramatiq's queue maintenance (returning the unacknowledged
  messages of dead workers) at least every quarter heartbeat timeout, not only by
  chance, so a ``kill -9``'d worker's messages come back within about a minute.
* Each fetched batch is decoded at once and handed to the middleware's
  ``after_fetch`` (see :class:`BrokerHooks`), so the idempotency claims of a batch
  take one round trip.
* A message for a task type no actor here handles is held back for a grace
  period (a newer worker may know it), then skipped with one warning: it goes to
  the dead-letter set with the reason in its options (``dead_letter.lua``), and is
  counted per task type for ``dramatiq-gp status``. :meth:`RedisBroker.join` does
  not wait for held messages (``unsettled.lua``). A message whose actor is
  declared on another queue is dead-lettered at once, the same way: a worker runs a
  message only from its actor's queue.
* A fetch (``fetch.lua``) returns each message with the Redis id it is stored
  under. A fetched message that cannot be decoded, or is decodable but malformed
  (fields or options of the wrong type, a ``redis_message_id`` or ``queue_name``
  that is not where it is stored), goes to the dead-letter set as it came
  (``set_aside.lua``) with one error line, the reason kept beside it; the rest of
  its batch runs as usual.
* Left at Dramatiq's default (``dramatiq_queue_prefetch`` unset, and no
  ``WORKER_QUEUES``, whose weights size each queue's prefetch), a consumer's
  prefetch follows its throughput: from Dramatiq's twice the threads up to
  :data:`PREFETCH_GROWTH` times that, holding about :data:`PREFETCH_AHEAD_S` of
  work ahead (see :meth:`_Consumer._adapt_prefetch`).

The Lua scripts live beside this module in ``redis/``; every key they touch is
built by :mod:`dramatiq_gp.keys`.

The Dramatiq internals the kit relies on (Dramatiq 2.2; each one explained in
``docs/internals.md`` and pinned by ``tests/test_dramatiq_internals.py``):

1. ``dramatiq.brokers.redis._RedisConsumer``, subclassed here: its constructor,
   ``queued_message_ids``, ``misses``, ``outstanding_message_count``, and
   ``requeue`` by ``options["redis_message_id"]``;
2. ``RedisBroker._max_unpack_size()``, ``_should_do_maintenance()``,
   ``do_requeue()``, ``scripts["dispatch"]``, ``broker_id``;
3. the arguments and results of ``dispatch.lua``'s ``fetch``, and what its
   ``enqueue`` writes (``enqueue.lua`` writes the same);
4. Dramatiq's Redis key layout (:mod:`dramatiq_gp.keys`), and what ack, nack,
   requeue and maintenance do to it;
5. ``Worker.work_queue`` (replaced in ``before_worker_boot`` by
   :class:`~dramatiq_gp.WeightedQueue`), ``_WorkQueueItem``, ``workers``,
   ``consumers`` and their ``prefetch``, ``_add_worker()``, and ``stop`` (rebound
   by :class:`~dramatiq_gp.Lifecycle` for ``WORKER_SHUTDOWN_TIMEOUT``);
6. ``ConsumerThread`` dropping its delayed messages on a connection error (and
   ending when its clean-up after any other error raises), its own thread being
   the one that enqueues a due delayed message, and ``post_process_message``
   retrying an ack or nack until Redis answers;
7. the text of Dramatiq's per-task log lines (replaced by
   :class:`~dramatiq_gp.TaskLog`, or stripped of arguments by the log filter);
8. the ``dramatiq`` command: ``worker_process`` on the stack while a worker
   boots, its SIGTERM handler and the locals of its frame (taken over by
   :class:`~dramatiq_gp.Lifecycle`), ``RET_IMPORT``/``RET_CONNECT``, ``after_process_boot`` emitted by it
   alone, the global broker run without ``module:variable``;
9. the hook semantics: which exceptions ``emit_before``/``emit_after`` let
   through, skips, the ack or nack after ``after_process_message``, and
   ``Retries`` sending the same proxy through ``broker.enqueue``;
10. ``MessageProxy`` and ``Message.copy``/``decode``, ``q_name``/``dq_name``;
11. ``dramatiq.worker.QUEUE_PREFETCH``, ``dramatiq_queue_prefetch`` as the worker read it
    (0 when unset), and the consumer's ``prefetch`` read at each fetch.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from uuid import uuid4

import redis
from dramatiq import Message, get_encoder
from dramatiq import worker as dramatiq_worker
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import RedisBroker as DramatiqRedisBroker
from dramatiq.brokers.redis import _RedisConsumer
from dramatiq.common import compute_backoff, current_millis, q_name
from dramatiq.errors import ConnectionClosed, DecodeError, QueueJoinTimeout
from dramatiq.worker import ConsumerThread

from .. import keys
from ..lua import scripts
from ..names import is_delay_queue
from ..settings import settle_window_ms_from_env
from .base import (
    DEAD_LETTER_REASON,
    KitBroker,
    Settle,
    SettlePlan,
    check_delay,
    decode_cause,
    keep_failure_reason,
    malformed,
    malformed_reason,
    plan_of,
)
from .done_marks import with_library
from .settler import Settler

logger = logging.getLogger(__name__)

_SCRIPTS = scripts(__file__)
#: A consumer left at Dramatiq's default prefetch grows it up to this many times the default
#: (16 per worker thread): fetching 8 at a time, as a default of 2 per thread does in halves,
#: cost the kit 30-40% more CPU per no-op message than fetching 64 (``benchmarks overhead``).
PREFETCH_GROWTH = 8
#: ...but holds no more than about this much work ahead, at the rate its messages finished in
#: the last :data:`PREFETCH_RATE_S`: long tasks stay at the default, not hidden from other replicas.
PREFETCH_AHEAD_S = 0.25
PREFETCH_RATE_S = 0.5

_SCRIPTS["settle"] = with_library(_SCRIPTS["settle"])

#: The arguments of ``redis/settle.lua``, named slot by slot: the one statement of its layout.
#: The script's header cites this table, and ``tests/test_settle_layout.py`` holds both the
#: packing (:meth:`RedisBroker._write_settles`) and the script's reads to it.
#:
#: KEYS: ``head``; then, in the order the batch first needs them, the ``queue`` keys of each
#: of its queues (a message names its queue's first key) and the idempotency key of each
#: message whose plan has one (a message names its key's index, 0 for none).
#: ARGV: ``head``; ``queue`` once for each of its ``queue_count`` queues; then one entry per
#: message: ``plain`` for one without a plan (tag ``"a"`` ack, ``"r"`` requeue; the script
#: also reads an ``"n"`` nack, which the broker never sends plain), ``full`` for a nack or one
#: with a plan (tag ``"A"``, ``"N"``, ``"R"``). ``data`` is the copy's for an ack, the dead
#: letter to keep for a nack.
SETTLE_KEYS: dict[str, tuple[str, ...]] = {
    "head": ("heartbeats", "throughput"),
    "queue": ("acks", "msgs", "queue", "xq", "xq_msgs", "dq", "dq_msgs"),
}
SETTLE_ARGV: dict[str, tuple[str, ...]] = {
    "head": ("now", "worker_id", "queue_count", "marks"),
    "queue": ("first_key", "queue_name"),
    "plain": ("tag", "first_key", "redis_id"),
    "full": (
        "tag",
        "first_key",
        "redis_id",
        "key_index",
        "outcome",
        "token",
        "mark",
        "retention_ms",
        "copy_id",
        "data",
    ),
}


class RedisBroker(KitBroker, DramatiqRedisBroker):
    """Dramatiq's Redis broker with the kit's protocol (see the module docstring).

    Parameters:
        unknown_task_grace_ms: how long messages for a task type no actor here
            handles are held before they are skipped (``WORKER_UNKNOWN_TASK_GRACE``).
        settle_window_ms: how long the acks of finished messages are collected to
            be written in one call; 0 writes each at once, from the worker thread, as
            Dramatiq does (see :mod:`.settler`). Not given: ``WORKER_SETTLE_WINDOW``, as
            the Kit passes it.
        **options: :class:`dramatiq.brokers.redis.RedisBroker`'s (``url``, ``client``,
            ``namespace``, ``middleware``, ``heartbeat_timeout``, ``dead_message_ttl``,
            Redis connection parameters...).
    """

    #: The queues are in ``client``: the scheduler's claim of a tick enqueues it in the same Lua call.
    queues_in_client = True

    def __init__(
        self, *, unknown_task_grace_ms: int = 300_000, settle_window_ms: float | None = None, **options: Any
    ) -> None:
        self._hook_cache: dict[str, list[Callable[..., Any]]] = {}
        self._hooks_for = 0  # how many middleware the cache was built for
        super().__init__(**options)  # type: ignore[no-untyped-call]
        self.unknown_task_grace_ms = unknown_task_grace_ms
        self.settler: Settler[Settle] | None = None
        if settle_window_ms is None:
            settle_window_ms = settle_window_ms_from_env()
        if settle_window_ms > 0:
            self.settler = Settler(self._write_settles, self._give_up_settles, window_s=settle_window_ms / 1000)
        self._scripts = {name: self.client.register_script(source) for name, source in _SCRIPTS.items()}
        self._start_worker_record()
        # Redis ids for batches: unique per broker and call, cheaper than a uuid4 each.
        self._id_prefix = f"{uuid4()}-"
        self._id_counter = itertools.count()

    def _redis_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_counter)}"

    @property
    def consumer_class(self) -> type[_Consumer]:
        return _Consumer

    def join(self, queue_name: str, *, interval: int = 100, timeout: int | None = None) -> None:
        """Wait until ``queue_name`` and its delay queue hold nothing but held messages (tests only).

        Like Dramatiq's, except that messages held for a task type no worker
        handles yet (``WORKER_UNKNOWN_TASK_GRACE``, five minutes by default) do
        not count: they are waiting for a deploy, not for this worker.

        Raises:
            QueueJoinTimeout: ``timeout`` ms passed first.
        """
        stored = [keys.messages(self.namespace, q_name(queue_name)), keys.delay_messages(self.namespace, queue_name)]
        deadline = timeout and time.monotonic() + timeout / 1000
        while self._scripts["unsettled"](keys=stored):
            if deadline and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)  # type: ignore[no-untyped-call]
            time.sleep(interval / 1000)

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        check_delay(message, delay)
        try:
            return super().enqueue(message, delay=delay)
        except redis.ConnectionError as exc:
            self.send_failed(message, exc)
            if isinstance(threading.current_thread(), ConsumerThread):
                # A due delayed message, moved to its queue by Dramatiq's consumer thread. That
                # thread recovers from a BrokerConnectionError (its delayed messages, dropped, are
                # put back by the next consumer) but calls anything else unexpected, and its
                # clean-up then puts them back itself, fails the same way and ends the thread.
                raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
            raise
        except BaseException as exc:
            self.send_failed(message, exc)
            raise

    def enqueue_many(
        self, messages: Sequence[Message[Any]], *, encoded: Sequence[bytes] | None = None
    ) -> list[Message[Any]]:
        """Enqueue ``messages`` in one round trip and one Lua call (``enqueue.lua``), all or none.

        Every message is encoded before anything is sent, so an encoding error
        leaves nothing half-sent. ``encoded`` is not used: each message is sent
        with a ``redis_message_id`` of its own, so its bytes differ.
        """
        if len(messages) == 1:
            return [self.enqueue(messages[0])]
        encode = get_encoder().encode
        prepared: list[Message[Any]] = []
        touched: list[str] = []
        where: dict[str, int] = {}
        args: list[Any] = []
        try:
            for original in messages:
                # What Message.copy does, without its per-field introspection (a relay batch is 500 of these).
                message: Message[Any] = Message(
                    queue_name=original.queue_name,
                    actor_name=original.actor_name,
                    args=original.args,
                    kwargs=original.kwargs,
                    options={**original.options, "redis_message_id": self._redis_id()},
                    message_id=original.message_id,
                    message_timestamp=original.message_timestamp,
                )
                self.emit_before("enqueue", message, None)
                prepared.append(message)
                queue = message.queue_name
                if queue not in where:
                    where[queue] = len(touched) + 1
                    touched += [keys.queue(self.namespace, queue), keys.messages(self.namespace, queue)]
                # What Message.encode does, without Message.asdict's per-field introspection.
                args += [
                    where[queue],
                    message.options["redis_message_id"],
                    encode(
                        {
                            "queue_name": message.queue_name,
                            "actor_name": message.actor_name,
                            "args": message.args,
                            "kwargs": message.kwargs,
                            "options": message.options,
                            "message_id": message.message_id,
                            "message_timestamp": message.message_timestamp,
                        }
                    ),
                ]
            self._scripts["enqueue"](keys=touched, args=args)
        except BaseException as exc:
            for message in prepared:
                self.send_failed(message, exc)
            raise
        for message in prepared:
            self.emit_after("enqueue", message, None)
        return prepared

    def fetch(self, queue_name: str, prefetch: int, *, maintain: bool) -> list[tuple[str, bytes | None]]:
        """Up to ``prefetch`` messages of ``queue_name``, each with the Redis id it is stored under.

        Dramatiq's fetch returns the data alone, and its messages are then settled by
        the ``redis_message_id`` written in the data: a message whose data names
        another message's id acked that one while it ran. ``fetch.lua`` returns the
        ids too. With ``maintain``, the queue's maintenance (``dispatch.lua``'s)
        runs first for sure: Dramatiq runs it on 0.1% of commands, so with few
        consumers a dead worker's messages could wait many minutes past the
        heartbeat timeout.
        """
        ns, now = self.namespace, current_millis()
        unpack = self._max_unpack_size()  # type: ignore[no-untyped-call]
        if maintain or self._should_do_maintenance("fetch"):
            args = [
                "fetch",
                now,
                queue_name,
                self.broker_id,
                self.heartbeat_timeout,
                self.dead_message_ttl,
                1,
                unpack,
                0,
            ]
            self.scripts["dispatch"](keys=[ns], args=args)
        touched = [
            keys.heartbeats(ns),
            keys.queue(ns, queue_name),
            keys.messages(ns, queue_name),
            keys.acks(ns, self.broker_id, queue_name),
        ]
        ids, data = self._scripts["fetch"](keys=touched, args=[now, self.broker_id, min(prefetch, unpack)])
        return [(id if isinstance(id, str) else id.decode(), raw) for id, raw in zip(ids, data, strict=True)]

    def _copy_options(self) -> dict[str, Any]:
        # The copy is written in the same Lua call as the ack (settle.lua): both happen or neither.
        return {"redis_message_id": str(uuid4())}

    def settle(self, queue_name: str, message: MessageProxy, command: str) -> None:
        """Ack, nack or requeue ``message`` on ``queue_name`` with its :class:`~.base.SettlePlan`, now."""
        batch = [(queue_name, message, command)]
        try:
            self._write_settles(batch)
        except BaseException as exc:
            self._give_up_settles(batch, exc)
            if isinstance(exc, redis.ConnectionError):
                raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
            raise

    def _write_settles(self, batch: Sequence[Settle]) -> None:
        """Settle every message of ``batch`` in one Lua call (``settle.lua``), then announce their copies.

        The call's keys and arguments are laid out as :data:`SETTLE_KEYS` and
        :data:`SETTLE_ARGV` say. Writing a batch again changes nothing (an id
        already settled is left alone), so a batch whose reply was lost can be retried.
        """
        ns = self.namespace
        now = current_millis()
        touched = [keys.heartbeats(ns), keys.throughput(ns, now // 60_000)]  # SETTLE_KEYS["head"]
        first_key: dict[str, int] = {}
        names: list[Any] = []  # SETTLE_ARGV["queue"] of each queue
        args: list[Any] = []  # SETTLE_ARGV["plain"] or ["full"] of each message
        for queue_name, message, command in batch:
            q = first_key.get(queue_name)
            if q is None:
                q = first_key[queue_name] = len(touched) + 1
                names += [q, q_name(queue_name)]
                touched += [  # SETTLE_KEYS["queue"]
                    keys.acks(ns, self.broker_id, queue_name),
                    keys.messages(ns, queue_name),
                    keys.queue(ns, queue_name),
                    keys.dead(ns, queue_name),
                    keys.dead_messages(ns, queue_name),
                    keys.delay_queue(ns, queue_name),
                    keys.delay_messages(ns, queue_name),
                ]
            plan = plan_of(message)
            if plan is None:
                if command != "nack":  # SETTLE_ARGV["plain"]
                    args += [command[0], q, message.options["redis_message_id"]]
                    continue
                plan = SettlePlan()  # a nack always carries its dead letter's data
            key_index = 0
            if plan.key:
                touched.append(plan.key)
                key_index = len(touched)
            copy = plan.copy
            # A dead letter keeps the last attempt's options (its traceback, its retries), not the
            # message as fetched: without them, one that failed at its first attempt says nothing of why.
            if command == "nack":
                keep_failure_reason(message)
            data = message.encode() if command == "nack" else (copy.encode() if copy else b"")
            args += [  # SETTLE_ARGV["full"]
                command[0].upper(),
                q,
                message.options["redis_message_id"],
                key_index,
                plan.outcome,
                plan.token,
                plan.mark,
                plan.retention_ms,
                copy.options["redis_message_id"] if copy else "",
                data,
            ]
        # SETTLE_ARGV["head"], then the queues, then the messages.
        head: list[Any] = [now, self.broker_id, len(names) // 2, keys.done_marks(ns)]
        self._scripts["settle"](keys=touched, args=[*head, *names, *args])
        for _, message, command in batch:
            plan = plan_of(message)
            if plan is None or plan.copy is None:
                continue
            if command == "requeue":
                self.send_failed(plan.copy, None)
            else:
                self.emit_after("enqueue", plan.copy, plan.delay_ms)

    def _give_up_settles(self, batch: Sequence[Settle], error: BaseException) -> None:
        """A batch that can never be written: its copies reported as not sent."""
        for _, message, _ in batch:
            plan = plan_of(message)
            if plan is not None and plan.copy is not None:
                self.send_failed(plan.copy, error)

    def set_aside_malformed(self, queue_name: str, redis_id: str, reason: str) -> int:
        """Dead-letter the fetched message stored under ``redis_id``, which cannot be decoded or is malformed.

        It never reaches a worker thread, and it is moved as it came; ``reason`` is
        kept beside it (:func:`dramatiq_gp.keys.dead_reasons`), for the operator's tools.

        Left unacknowledged, it would come back after every heartbeat timeout for
        ever; in Dramatiq's dead-letter set (``<queue>.XQ``) it is kept for
        inspection and expires with the others.
        """
        ns = self.namespace
        touched = [
            keys.acks(ns, self.broker_id, queue_name),
            keys.messages(ns, queue_name),
            keys.dead(ns, queue_name),
            keys.dead_messages(ns, queue_name),
            keys.dead_reasons(ns, queue_name),
        ]
        args = [redis_id, current_millis(), reason, self.dead_message_ttl]
        return int(self._scripts["set_aside"](keys=touched, args=args))

    def dead_letter(self, queue_name: str, message: MessageProxy, reason: str) -> None:
        """Move a fetched ``message`` to its queue's dead-letter set, ``reason`` in its options.

        It is counted per task type (:func:`dramatiq_gp.keys.skipped`) for ``dramatiq-gp
        status``; the count expires with the dead letters (``dead_message_ttl``).
        """
        ns = self.namespace
        touched = [
            keys.acks(ns, self.broker_id, queue_name),
            keys.messages(ns, queue_name),
            keys.dead(ns, queue_name),
            keys.dead_messages(ns, queue_name),
            keys.skipped(ns),
        ]
        kept = message.copy(options={DEAD_LETTER_REASON: reason})
        args = [
            message.options["redis_message_id"],
            kept.encode(),
            current_millis(),
            message.actor_name,
            self.dead_message_ttl,
        ]
        try:
            self._scripts["dead_letter"](keys=touched, args=args)
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]


class _Consumer(_RedisConsumer):
    """Dramatiq's Redis consumer, reading a fetched batch at once.

    Decoding the whole batch lets unknown task types be set aside before they
    reach a worker thread, and hands the batch to the middleware's ``after_fetch``
    (the idempotency claims) in one call rather than one Redis round trip per message.
    """

    broker: RedisBroker

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)  # type: ignore[no-untyped-call]
        self._ready: deque[MessageProxy] = deque()
        self._freed = threading.Event()
        self._woken = False
        self._maintain_every_s = self.broker.heartbeat_timeout / 4000
        self._maintain_at = 0.0  # the first fetch maintains: a crashed predecessor's messages come back now
        self._least_prefetch = self._most_prefetch = int(self.prefetch)
        if not (dramatiq_worker.QUEUE_PREFETCH or is_delay_queue(self.queue_name) or self.broker.fixed_prefetch):
            self._most_prefetch *= PREFETCH_GROWTH
        #: Messages settled here; read by :meth:`_adapt_prefetch` (a count lost to a race between
        #: worker threads only makes the estimate a little lower).
        self._settled = 0
        self._rate_from = (time.monotonic(), 0)
        if is_delay_queue(self.queue_name):
            self._return_dropped_delayed()
        else:
            self.broker.register_consumer(self.queue_name)

    def _return_dropped_delayed(self) -> None:
        """Put back the delayed messages this process fetched but no longer holds.

        On a connection error Dramatiq's consumer thread drops the delayed messages
        it holds in memory and builds a new consumer; their ids stay in this
        process's unacknowledged set, where nothing would look at them until the
        process exits (a Redis restart stranded retries that way). A new delay-queue
        consumer starts with nothing in memory, so every id in that set is one of
        those: back to the delay queue they go, to be fetched again.
        """
        # A settle still pending for one of them would find it gone and leave it to run again.
        if not self.broker.flush_settles(retry=False):
            raise ConnectionClosed(redis.ConnectionError("settles are waiting for Redis"))  # type: ignore[no-untyped-call]
        try:
            dropped = self.broker.client.smembers(
                keys.acks(self.broker.namespace, self.broker.broker_id, self.queue_name)
            )
            if dropped:
                self.broker.do_requeue(self.queue_name, *dropped)
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        if dropped:
            logger.info(
                "returned %d delayed message(s) dropped after a connection error to %r", len(dropped), self.queue_name
            )

    def __next__(self) -> MessageProxy | None:
        try:
            while not self._ready:
                self._freed.clear()
                if self._woken:
                    return None
                if self._room() < self._refill_at:
                    # Fetch again once half the buffer is free, woken by the settle that frees
                    # it: not after a backoff (a busy queue's buffer would run dry), and not at
                    # every settle (a round trip, and a wake-up, per message).
                    self._freed.wait(self.timeout / 1000)
                    return None
                now = time.monotonic()
                if self._most_prefetch > self._least_prefetch:
                    self._adapt_prefetch(now)
                room = self._room()
                maintain = now >= self._maintain_at
                if maintain:
                    self._maintain_at = now + self._maintain_every_s
                batch = self.broker.fetch(self.queue_name, room, maintain=maintain)
                accepted = self._accept(batch)
                for hook in self.broker.hooks("after_fetch"):
                    hook(self.broker, self.queue_name, accepted)
                if not batch:
                    # As Dramatiq does: poll less and less often while idle, up to the timeout.
                    self.misses, backoff_ms = compute_backoff(self.misses, max_backoff=self.timeout)
                    self._freed.wait(backoff_ms / 1000)
                    return None
                self.misses = 0
                self._ready.extend(accepted)
            return self._ready.popleft()
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

    def wake(self) -> None:
        """End the wait for messages now, and wait no more: the worker is stopping this consumer."""
        self._woken = True
        self._freed.set()

    def _adapt_prefetch(self, now: float) -> None:
        """Hold about :data:`PREFETCH_AHEAD_S` of work ahead, within the least and most prefetch.

        A no-op task moves best with a large buffer, fetched in large batches; a
        minute-long task is better left on the queue, where another replica's free
        thread takes it. The rate is what finished here in the last
        :data:`PREFETCH_RATE_S`, so the prefetch grows within a second of a burst and
        falls back once tasks slow down.
        """
        since, settled_then = self._rate_from
        if now - since < PREFETCH_RATE_S:
            return
        settled = self._settled
        ahead = int((settled - settled_then) / (now - since) * PREFETCH_AHEAD_S)
        self.prefetch = min(self._most_prefetch, max(self._least_prefetch, ahead))
        self._rate_from = (now, settled)

    @property
    def _refill_at(self) -> int:
        return max(1, int(self.prefetch) // 2)

    def _room(self) -> int:
        return int(self.prefetch - self.outstanding_message_count)

    def _wake_if_room(self) -> None:
        # Set only when not set: ``Event.set`` takes a lock and notifies each time, and until the
        # consumer runs out of fetched messages every settle would set it again. Skipping is safe:
        # the consumer clears it before it reads the room, which this settle has already freed.
        if self._room() >= self._refill_at and not self._freed.is_set():
            self._freed.set()

    def _accept(self, batch: list[tuple[str, bytes | None]]) -> list[MessageProxy]:
        """The messages of ``batch`` for the worker threads; the others are set aside or held here."""
        delayed, home = is_delay_queue(self.queue_name), q_name(self.queue_name)
        accepted = []
        for redis_id, data in batch:
            if data is None:  # Dramatiq #266
                continue
            try:
                decoded = Message.decode(data)
                problem = _malformed(decoded, redis_id, self.queue_name)
            except DecodeError as exc:
                problem = f"cannot decode it ({decode_cause(exc)})"
            if problem:
                self._set_aside(redis_id, problem)
                continue
            message = MessageProxy(decoded)
            self.queued_message_ids.add(message.message_id)
            try:
                if self.broker.admit(self, message, home, delayed):
                    accepted.append(message)
            except ConnectionClosed:
                raise
            except Exception as exc:
                # One odd message must not take the consumer, and the batch fetched with it, down.
                self.queued_message_ids.discard(message.message_id)
                self._set_aside(redis_id, f"cannot set it aside or hold it ({type(exc).__name__}: {exc})")
        return accepted

    def _set_aside(self, redis_id: str, problem: str) -> None:
        moved = self.broker.set_aside_malformed(self.queue_name, redis_id, malformed_reason(problem))
        # The bytes stay out of the line (they may be a payload); they are kept in the dead-letter set.
        logger.error(
            "a message on queue %r is malformed: %s; %s",
            self.queue_name,
            problem,
            f"moved to the dead-letter set as {redis_id}" if moved else "could not find it to set it aside",
        )

    def dead_letter(self, message: MessageProxy, reason: str) -> None:
        try:
            self.broker.dead_letter(self.queue_name, message, reason)
        finally:
            self.queued_message_ids.discard(message.message_id)
            self._settled += 1
            self._wake_if_room()

    def ack(self, message: MessageProxy) -> None:
        self._post(message, "ack")

    def nack(self, message: MessageProxy) -> None:
        self._post(message, "nack")

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        plain = []
        for message in messages:
            if plan_of(message) is None:
                plain.append(message)
            else:
                self.broker.settle(self.queue_name, message, "requeue")
        try:
            super().requeue(plain)  # type: ignore[no-untyped-call]
        except redis.ConnectionError as exc:
            # Dramatiq's consumer thread closes its consumer after any error, putting back its
            # delayed messages here, and survives only a BrokerConnectionError; those messages
            # stay in this process's unsettled set, and the next delay-queue consumer puts them back.
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

    def _post(self, message: MessageProxy, command: str) -> None:
        try:
            self.broker.settle_soon(self.queue_name, message, command)
        finally:
            self.queued_message_ids.discard(message.message_id)
            self._settled += 1
            self._wake_if_room()

    def close(self) -> None:
        """Write the pending settles first: a graceful stop leaves nothing to run again.

        Dramatiq also closes a consumer after a connection error, to build another;
        what Redis did not take then stays with the settler, which retries it.
        """
        self.broker.flush_settles(retry=False)
        super().close()


def _malformed(message: Message[Any], redis_id: str, queue_name: str) -> str:
    """:func:`~.base.malformed`, and a message that does not say where it is stored.

    It is settled by the ``redis_message_id`` and ``queue_name`` written in it: a
    message naming another message's id would ack that one while it runs, and one
    naming another queue would never be settled (and run again at every restart).
    Only Dramatiq's brokers write the id (one without it was written by something else).
    """
    problem = malformed(message)
    if problem:
        return problem
    claimed = message.options.get("redis_message_id")
    if not isinstance(claimed, str):
        return "it has no options.redis_message_id (it was not written by a Dramatiq broker)"
    if claimed != redis_id:
        return "its options.redis_message_id is not the id it is stored under"
    if message.queue_name != queue_name:
        return "its queue_name is not the queue it is stored in"
    return ""
