"""What the kit's middleware need of a broker, whatever holds the queues.

:class:`KitBroker` is mixed into each of the kit's brokers, before Dramatiq's broker
class it extends. Beyond Dramatiq's broker it offers:

* ``client`` and ``namespace``: the Redis/Valkey that keeps the coordination state
  (idempotency claims and done marks; on Redis also the queues themselves);
* :meth:`~KitBroker.settle`, :meth:`~KitBroker.settle_soon` and
  :meth:`~KitBroker.redeliver_later`: a message's ack, nack or put-back together
  with its :class:`SettlePlan` (the idempotency outcome, a retry's or deferral's
  copy), so "acked" always implies "recorded" and a retry is never lost; the
  whole path, thread by thread, is ``docs/life-of-a-message.md``;
* :meth:`~KitBroker.enqueue_many`, for the outbox relay;
* the extra middleware hooks of :class:`BrokerHooks`, and ``emit_before`` /
  ``emit_after`` that call only the hooks a middleware overrides.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import redis
from dramatiq import Message, Middleware
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import current_millis, dq_name, q_name
from dramatiq.errors import DecodeError
from dramatiq.middleware import MiddlewareError

from .. import keys
from ..durations import format_duration
from ..errors import BrokerMismatch, DispatchError
from ..errortext import capped
from ..lua import scripts

if TYPE_CHECKING:
    from .settler import Settler

logger = logging.getLogger(__name__)

_SCRIPTS = scripts(__file__)

#: The attribute of a message's proxy that holds its :class:`SettlePlan` (read with :func:`plan_of`).
PLAN_ATTR = "_gp_settle_plan"
#: One message to settle: its queue (the consumer's, a delay queue for a delayed message), it,
#: and the command: ``"ack"``, ``"nack"`` or ``"requeue"``.
Settle = tuple[str, MessageProxy, str]

#: Option on a dead-lettered copy saying why it is there.
DEAD_LETTER_REASON = "gp_dead_letter_reason"

#: How long a message for an unknown task type waits between looks.
UNKNOWN_TASK_RETRY_MS = 30_000
#: The most of a name from a message (its task type, its queue) that a log line or a dead letter's reason
#: carries: 1,000 task types of 50 KB each once made 1,000 log lines of 50 KB.
NAME_SHOWN = 200
#: The distinct task types (or task type and queue) a worker process logs once each; past it, one line says
#: so and the others are set aside without one (their dead letters say why). Each is kept as shown.
WARNED_MAX = 1_000

#: The longest ``delay=`` a message is sent with (``send_with_options``), in ms: 7 days, the longest Dramatiq's
#: Redis broker takes, and ``WORKER_MAX_BACKOFF``'s bound. A delayed message waits unacknowledged in a worker,
#: fetched again after each restart (on RabbitMQ, redelivered after each ``consumer_timeout``): a longer wait
#: belongs in the outbox (``dispatch(..., delay=)``), where it is a row.
MAX_DELAY_MS = 7 * 86_400_000


def check_delay(message: Message[Any], delay: float | None) -> None:
    """Refuse a send whose ``delay`` (ms) is longer than :data:`MAX_DELAY_MS`, or no number, before it is announced.

    Raises:
        DispatchError: naming the actor and the delay; nothing was sent.
    """
    if delay is not None and not delay <= MAX_DELAY_MS:  # NaN too
        raise DispatchError(
            f"{message.actor_name} sent with delay={delay} ms: more than {MAX_DELAY_MS} ms (7 days), the longest a "
            "message waits in a worker; a longer wait belongs in the outbox (dispatch with delay=)"
        )


_warned_lock = threading.Lock()


@dataclass(slots=True)
class SettlePlan:
    """What a message's settle writes besides its ack, nack or requeue.

    Middleware build it on the consumer and worker threads; the broker writes it
    when it settles the message (on the settler thread with a settle window), in
    the same call as the ack on Redis, before the ack on RabbitMQ.
    """

    #: The idempotency claim's key and this attempt's token ("" if none).
    key: str = ""
    token: str = ""
    #: ``"done"`` frees the claim and marks the id completed, ``"release"`` only frees it.
    outcome: str = ""
    #: The id's digest in its done mark (:mod:`.done_marks`), kept so long.
    mark: bytes = b""
    retention_ms: int = 0
    #: A copy for the delay queue, already announced (``before_enqueue``), due after
    #: ``delay_ms``: a retry or a deferral (see :meth:`KitBroker.redeliver_later`).
    copy: Message[Any] | None = None
    delay_ms: int = 0


def plan_of(message: MessageProxy) -> SettlePlan | None:
    """``message``'s :class:`SettlePlan`, or None: most messages have none."""
    # From the proxy's own attributes: a getattr that misses (most messages have no
    # plan) falls through MessageProxy.__getattr__ to the message and raises twice.
    return message.__dict__.get(PLAN_ATTR)


def attach_plan(message: MessageProxy, plan: SettlePlan) -> None:
    """Make ``plan`` the :class:`SettlePlan` of ``message``."""
    setattr(message, PLAN_ATTR, plan)


def shown(name: str) -> str:
    """``name``, from a message (any producer's), as log lines and reasons carry it: at most :data:`NAME_SHOWN`
    characters of it (its head and tail)."""
    return capped(name, NAME_SHOWN)


def keep_failure_reason(message: MessageProxy) -> None:
    """Make sure ``message``, failing for good, says why in its dead letter.

    The kit's ``Retries`` gives the reasons it knows (an exception the actor throws,
    a skip such as ``AgeLimit``'s); one with the traceback of a failed attempt says
    why through it. Anything else that called ``message.fail()`` gave none.
    """
    options = message.options
    if DEAD_LETTER_REASON not in options and "traceback" not in options:
        options[DEAD_LETTER_REASON] = "failed for good by a middleware (message.fail()), with no exception"


def decode_cause(error: DecodeError) -> str:
    """What Dramatiq's decoder ran into: its own ``DecodeError`` wraps the JSON one."""
    cause: BaseException = error
    while isinstance(cause, DecodeError):
        cause = cause.error
    return type(cause).__name__


#: The options Dramatiq and the kit read as numbers. Of another type, a failing message with
#: ``retries: "abc"`` was acked as done, and ``time_limit: "abc"`` silently dropped its limit.
NUMERIC_OPTIONS = frozenset(("retries", "max_retries", "min_backoff", "max_backoff", "time_limit", "max_age", "eta"))


def malformed(message: Message[Any]) -> str:
    """What makes a decoded message unusable, or "" when nothing does.

    Dramatiq's decoder checks only that the fields are there; an id that is not a
    string breaks every key built from it, arguments that are not a dict every call,
    an option of :data:`NUMERIC_OPTIONS` that is not a number the retries and limits.
    It takes the message before its proxy wraps it: read through the proxy's
    ``__getattr__``, the six fields cost five times as much.
    """
    # What the JSON decoder gives a sound message, checked first in one expression: the
    # loop below, which names the culprit, costs about as much again per message.
    if (
        type(message.queue_name) is str
        and type(message.actor_name) is str
        and type(message.message_id) is str
        and type(message.kwargs) is dict
        and type(message.options) is dict
        and type(message.message_timestamp) is int
        and NUMERIC_OPTIONS.isdisjoint(message.options)
    ):
        return ""
    for field, kind in (
        ("queue_name", str),
        ("actor_name", str),
        ("message_id", str),
        ("kwargs", dict),
        ("options", dict),
        ("message_timestamp", int),
    ):
        if not isinstance(getattr(message, field), kind):
            return f"its {field} is not a {kind.__name__}"
    for name in NUMERIC_OPTIONS.intersection(message.options):
        value = message.options[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"its option {name} is a {type(value).__name__}, not a number"
    return ""


def malformed_reason(problem: str) -> str:
    """The reason kept with a message set aside as it came, for ``problem`` (:func:`malformed`'s, or why it
    cannot be decoded)."""
    return f"malformed, set aside as it came: {problem}"


class BrokerHooks(Protocol):
    """What the kit's brokers call on their middleware besides Dramatiq's hooks.

    A middleware defines either method, or both; the broker calls each middleware
    that has it, in list order.
    """

    def after_fetch(self, broker: KitBroker, queue_name: str, messages: Sequence[MessageProxy]) -> None:
        """A consumer fetched ``messages`` (perhaps none) from ``queue_name``; no worker thread has them yet."""

    def after_send_failed(self, broker: KitBroker, message: Message[Any], error: BaseException | None) -> None:
        """``message``, announced by ``before_enqueue``, was not sent; ``error`` says why when it failed."""


class KitBroker(Broker):
    """The protocol the kit's middleware rely on (see the module docstring)."""

    #: The coordination Redis/Valkey, and the prefix of the kit's keys in it.
    client: redis.Redis
    namespace: str
    #: Whether the queues are in ``client`` (Redis), so a Lua call there can enqueue; False on RabbitMQ.
    queues_in_client: bool
    #: This worker process, in Dramatiq's heartbeats and the dashboard's worker records.
    broker_id: str
    #: How long messages for a task type no actor here handles are held (``WORKER_UNKNOWN_TASK_GRACE``).
    unknown_task_grace_ms: int
    #: Messages a weighted queue's consumer holds per worker thread (``QueueWeights``), times the
    #: queue's share: enough that its buffer does not run dry between fetches, which would hand
    #: its turns to a lighter queue.
    prefetch_per_thread = 8
    #: Whether each consumer keeps the prefetch it was given (``QueueWeights`` sized it), rather
    #: than grow it with its throughput when left at Dramatiq's default (the Redis broker).
    fixed_prefetch = False
    #: Collects the settles of ``WORKER_SETTLE_WINDOW`` into one batch; None settles each at once.
    settler: Settler[Settle] | None = None

    #: What this worker process tells the dashboard about itself beyond its host and pid
    #: (``QueueWeights`` adds the weights); published when a consumer starts.
    worker_info: dict[str, Any]
    #: Heartbeats older than this are removed when a consumer starts (0: Dramatiq's maintenance does it).
    heartbeat_retention_ms = 0

    _hook_cache: dict[str, list[Callable[..., Any]]]
    _hooks_for: int

    def hooks(self, name: str) -> list[Callable[..., Any]]:
        """The middleware's ``name`` methods that do something, in list order.

        Dramatiq's own ``emit_before``/``emit_after`` call every middleware's hook,
        the base class's no-ops included, about seventeen calls per signal and half a
        dozen signals per message. The methods that are more than that no-op are
        found once (again when the list changes) and kept.
        """
        if getattr(self, "_hooks_for", -1) != len(self.middleware):
            self._hook_cache, self._hooks_for = {}, len(self.middleware)
        found = self._hook_cache.get(name)
        if found is None:
            found = self._hook_cache[name] = [
                getattr(middleware, name)
                for middleware in self.middleware
                if name in vars(middleware)
                or getattr(type(middleware), name, None) not in (None, getattr(Middleware, name, None))
            ]
        return found

    def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None:
        """Dramatiq's ``emit_before``: each middleware's hook in list order; only a ``MiddlewareError`` gets out."""
        name = "before_" + signal
        for hook in self.hooks(name):
            try:
                hook(self, *args, **kwargs)
            except MiddlewareError:
                raise
            except Exception:
                self.logger.critical(
                    "Unexpected failure in %s of %r.", name, getattr(hook, "__self__", hook), exc_info=True
                )

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        """Dramatiq's ``emit_after``: each middleware's hook in reverse order; no exception gets out."""
        name = "after_" + signal
        for hook in reversed(self.hooks(name)):
            try:
                hook(self, *args, **kwargs)
            except Exception:
                self.logger.critical(
                    "Unexpected failure in %s of %r.", name, getattr(hook, "__self__", hook), exc_info=True
                )

    def _start_worker_record(self) -> None:
        """Set up what :meth:`register_consumer` publishes; the broker's ``client`` must be set."""
        self.worker_info = {}
        self._consumed: set[str] = set()
        self._register_lock = threading.Lock()
        self._started_ms = current_millis()
        self._register = self.client.register_script(_SCRIPTS["register"])

    def register_consumer(self, queue_name: str) -> None:
        """Record ``queue_name`` among the queues consumed, and this worker process, for the dashboard.

        The dashboard reads these rather than scanning the keyspace for queues. A
        failure here is logged, not raised: the consumer's own reads report a lost connection.
        """
        ns = self.namespace
        # Consumers start in threads of their own: one at a time, so the last record written lists every queue.
        with self._register_lock:
            self._consumed.add(queue_name)
            worker = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started_ms": self._started_ms,
                "queues": sorted(self._consumed),
                **self.worker_info,
            }
            now = current_millis()
            prune = now - self.heartbeat_retention_ms if self.heartbeat_retention_ms else 0
            try:
                self._register(
                    keys=[keys.declared_queues(ns), keys.workers(ns), keys.heartbeats(ns), keys.health(ns)],
                    args=[queue_name, self.broker_id, json.dumps(worker), now, prune],
                )
            except redis.RedisError as exc:
                logger.warning("could not record queue %r for the dashboard in Redis: %s", queue_name, exc)

    def queues_where(self) -> str:
        """Where the queues are, when that is not ``client``: "" for a broker whose queues are in it."""
        return ""

    def ping_queues(self) -> None:
        """Reach where the queues are, when that is not ``client`` (whose PING the callers make).

        Raises:
            BrokerUnreachable: naming the address (password redacted).
        """

    def admit(self, consumer: Any, message: MessageProxy, home: str, delayed: bool) -> bool:
        """Whether ``message``, fetched by ``consumer`` from queue ``home`` (its delay queue when ``delayed``), is
        for the worker threads; if not, it is held (:meth:`hold_or_skip_unknown`) or set aside
        (:meth:`set_aside_misrouted`) here.

        A queue is a boundary: only the actors declared on it run from it, its delay
        queue included. A delayed message for a task type unknown here is parked as
        any other, and looked at again when it comes due on its queue.
        """
        actor = self.actors.get(message.actor_name)
        if actor is not None and actor.queue_name == home:
            return True
        if actor is None:
            if delayed:
                return True
            self.hold_or_skip_unknown(consumer, message)
            return False
        self.set_aside_misrouted(consumer, message, actor.queue_name)
        return False

    def hold_or_skip_unknown(self, consumer: Any, message: MessageProxy) -> None:
        """Put back ``message``, whose task type no actor here handles, or skip it once the grace is over.

        A newer worker may know it (a deploy rolls out one process at a time), so for
        ``unknown_task_grace_ms`` it goes back to the delay queue every
        :data:`UNKNOWN_TASK_RETRY_MS` (settled by ``consumer``); then it goes to the
        dead-letter queue, the reason in its options, with one warning per task type.
        """
        now = current_millis()
        since = message.options.get("gp_unknown_since", now)
        waited = now - since
        task_type = shown(message.actor_name)
        if waited < self.unknown_task_grace_ms:
            self._warn_once(
                ("held", task_type),
                "no handler for task type %r here; holding its messages for up to %d s in case "
                "a newer worker handles them (WORKER_UNKNOWN_TASK_GRACE)",
                task_type,
                self.unknown_task_grace_ms // 1000,
                level=logging.INFO,
            )
            delay_ms = min(UNKNOWN_TASK_RETRY_MS, self.unknown_task_grace_ms - waited)
            self.redeliver_later(message, delay_ms, gp_unknown_since=since)
            consumer.ack(message)
            return
        self._warn_once(
            ("skipped", task_type),
            "task skipped: no handler registered for task type %r (task_id=%r); it and further messages "
            "of this type go to the dead-letter set of queue %r",
            task_type,
            shown(message.message_id),
            shown(q_name(message.queue_name)),
        )
        grace = format_duration(timedelta(milliseconds=self.unknown_task_grace_ms))
        reason = f"no handler for task type {task_type!r} within {grace} (WORKER_UNKNOWN_TASK_GRACE)"
        consumer.dead_letter(message, reason)

    def set_aside_misrouted(self, consumer: Any, message: MessageProxy, declared_on: str) -> None:
        """Dead-letter ``message``, which came on ``consumer``'s queue for an actor declared on ``declared_on``.

        A queue is a boundary: who may send to one queue must not run the actors of
        another through it (Dramatiq runs a message whatever queue it came on). One
        warning per task type and queue; the reason goes in the dead letter's options.
        """
        task_type, came_on = shown(message.actor_name), shown(q_name(consumer.queue_name))
        self._warn_once(
            ("misrouted", task_type, came_on),
            "task refused: task type %r is declared on queue %r, not on %r where its message came "
            "(task_id=%r); it and further such messages go to the dead-letter set of queue %r",
            task_type,
            declared_on,
            came_on,
            shown(message.message_id),
            came_on,
        )
        reason = (
            f"task type {task_type!r} is declared on queue {declared_on!r}, not on {came_on!r} where it came: "
            "a worker runs a message only from its actor's queue"
        )
        consumer.dead_letter(message, reason)

    def _warn_once(self, key: tuple[str, ...], msg: str, *args: object, level: int = logging.WARNING) -> None:
        """Log ``msg`` the first time ``key`` (what happened, and to what) happens in this process.

        Only :data:`WARNED_MAX` keys are remembered: a producer can make up task types
        without end, and each kept for ever grew a worker by its size.
        """
        with _warned_lock:
            warned: set[tuple[str, ...]] = self.__dict__.setdefault("_warned", set())
            if key in warned:
                return
            if len(warned) >= WARNED_MAX:
                if self.__dict__.get("_warned_full"):
                    return
                self.__dict__["_warned_full"] = True
                msg, args, level = (
                    "more than %d distinct unknown or misrouted task types seen by this process: further ones "
                    "are set aside without a line of their own (each dead letter says why)",
                    (WARNED_MAX,),
                    logging.WARNING,
                )
            else:
                warned.add(key)
        logger.log(level, msg, *args)

    def send_failed(self, message: Message[Any], error: BaseException | None) -> None:
        """Report that ``message``, announced by ``before_enqueue``, was not sent."""
        for hook in self.hooks("after_send_failed"):
            hook(self, message, error)

    def enqueue_many(
        self, messages: Sequence[Message[Any]], *, encoded: Sequence[bytes] | None = None
    ) -> list[Message[Any]]:
        """Enqueue ``messages``, each sent or the call raising.

        ``encoded``: each message's ``encode()``, where the caller made it (the relay
        encodes every row's message to find one that cannot be). A broker that sends a
        message as it is sends these bytes where no ``before_enqueue`` hook could have
        changed the message, instead of encoding it again.
        """
        raise NotImplementedError

    def redeliver_later(self, message: MessageProxy, delay_ms: int, **options: Any) -> None:
        """Send a copy of ``message`` (with ``options``) to its delay queue, due after ``delay_ms``, when settled.

        The copy rides in the message's :class:`SettlePlan` and goes out when the
        message is settled (:meth:`settle`), never without it, so a retry or a deferral
        cannot be lost. ``before_enqueue`` is emitted now, so a retry's send span is a
        child of the failed attempt's.
        """
        copy = message.copy(
            queue_name=dq_name(q_name(message.queue_name)),
            options={**options, **self._copy_options(), "eta": current_millis() + delay_ms},
        )
        self.emit_before("enqueue", copy, delay_ms)
        plan = plan_of(message)
        if plan is None:
            plan = SettlePlan()
            attach_plan(message, plan)
        plan.copy, plan.delay_ms = copy, delay_ms

    def _copy_options(self) -> dict[str, Any]:
        """Options a copy for the delay queue needs on this broker."""
        return {}

    def settle(self, queue_name: str, message: MessageProxy, command: str) -> None:
        """Ack, nack or requeue ``message`` with its :class:`SettlePlan`, now, on the calling thread."""
        raise NotImplementedError

    def settle_soon(self, queue_name: str, message: MessageProxy, command: str) -> None:
        """:meth:`settle`, in the settler's next batch (at once without a settle window)."""
        if self.settler is None:
            self.settle(queue_name, message, command)
        else:
            self.settler.add((queue_name, message, command))

    def flush_settles(self, *, retry: bool = True) -> bool:
        """Settle now what waits for the settler's window; whether it was written.

        Without ``retry``, what did not go through is left to the settler thread, which retries it.
        """
        return self.settler is None or self.settler.flush(retry=retry)

    def close(self) -> None:
        if not self.flush_settles(retry=False):
            logger.warning(
                "%d settle(s) could not be written as the broker closed; those messages run again "
                "(on Redis after the heartbeat timeout, on RabbitMQ once the connection is gone)",
                self.settler.pending if self.settler else 0,
            )
        super().close()


def kit_broker(broker: Broker, middleware: Middleware) -> KitBroker:
    """``broker``, which ``middleware`` needs to be one of the kit's brokers.

    Raises:
        BrokerMismatch: it is another broker; one line naming both.
    """
    if not isinstance(broker, KitBroker):
        cls = type(broker)
        raise BrokerMismatch(
            f"{type(middleware).__name__} needs dramatiq_gp.RedisBroker or dramatiq_gp.RabbitmqBroker, "
            f"not {cls.__module__}.{cls.__qualname__}: build the broker with gp.RedisBroker(...) or "
            f"gp.RabbitmqBroker(...) (they take Dramatiq's arguments)"
        )
    return broker
