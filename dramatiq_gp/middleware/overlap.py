"""No overlapping runs: a job's run skips, or waits for, the same entry's run still going in any process.

Each tick is a message of its own, so a job slower than its period runs twice at
once unless something holds the entry while a run goes on. That something must
hold across every worker process, survive none of them (a ``kill -9`` must not
hold the entry for good) and cost nothing to the messages that do not ask for it:

* the message carries the request, in the option ``gp_overlap``
  (``{"key": <entry>, "mode": "skip" | "wait"}``; :meth:`Schedule.job`'s
  ``overlap=`` puts it on the entry's actor and on every tick): a run enqueued by
  anyone else (an operator's "run now", a backfill, an entry created at run time)
  honours it too. A message without it costs a look-up in its options, and one in
  its actor's once an actor carries the option;
* before the run, one Lua call takes the entry's lease,
  ``<scheduler namespace>:scheduler:running:<entry>``, set to the message id with
  a TTL (``SCHEDULER_OVERLAP_LEASE``); one thread per process renews the leases of
  the runs still going every third of it, so a crashed run frees the entry within
  one lease. A copy of the holder itself (its retry, or its message delivered
  again after a crash) takes it as its own: it is that same run;
* taken by another run: ``skip`` acks the message unrun (Dramatiq's
  ``SkipMessage``) with a WARNING naming the entry and the run holding it,
  counted in ``dramatiq_gp.scheduler.overlaps``; ``wait`` holds the worker
  thread, looking again every :data:`POLL_S`, until the entry is free. A worker
  stopping gives up the wait and sends the message back to its queue, due in a
  second, so a restart loses nothing;
* after the run, failed or not, or skipped by a later middleware, a
  compare-and-delete frees the entry: a retry must not find its own run's lease.

Listed after :class:`IdempotentExecution`, so a copy of a message id that
already ran, or is running, is settled there and never waits here; and a run
skipped here gets no done mark, since it did not run: a later copy of the same
tick (a backfill) runs. Before :class:`TaskLog` and Dramatiq's ``TimeLimit``, so
the time waited is neither in the task's logged duration nor in its time limit.

Hooks: ``before_worker_boot`` (refuses any broker but the kit's: the leases are on
its Redis/Valkey), ``after_worker_boot`` and ``after_worker_shutdown`` (the renewing
thread), ``before_worker_shutdown`` (waiting threads give up),
``before_process_message``, ``after_process_message`` and ``after_skip_message``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from dramatiq import Actor, Broker, Middleware, Worker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import MiddlewareError, SkipMessage

from ..brokers.base import KitBroker, kit_broker
from ..errors import one_line_at_start_up
from ..keys import SchedulerKeys
from ..lua import scripts
from ..metrics import instruments
from ..records import text
from ..scheduler import OVERLAP_OPTION
from ..telemetry import printable

_SCRIPTS = scripts(__file__)

#: How often a waiting run looks at the lease again, in seconds.
POLL_S = 0.2
#: A wait given up at shutdown sends the message back, due after this.
REQUEUE_MS = 1000


class OverlapUnavailable(MiddlewareError):
    """Redis could not be asked whether the entry is running; the attempt fails and is retried."""


class OverlapGuard(Middleware):
    """Keeps a schedule entry's runs from overlapping, across worker processes, for entries that ask.

    Parameters:
        lease_ms: how long a run's lease outlives its last renewal (``SCHEDULER_OVERLAP_LEASE``, 30 s).
        namespace: the scheduler's keys' prefix (``SCHEDULER_NAMESPACE``); the broker's namespace when ``None``.
    """

    def __init__(self, *, lease_ms: int = 30_000, namespace: str | None = None) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.lease_ms = lease_ms
        self.namespace = namespace
        self.keys: SchedulerKeys | None = None
        # Worker thread → (lease key, message id) of the run it holds; one run per thread at a time.
        self._held: dict[int, tuple[str, str]] = {}
        self._stopping = threading.Event()  # waits end
        self._stop = threading.Event()  # renewals end, after the drain
        self._renewer: threading.Thread | None = None
        # Whether any actor carries the option: until one does, a message without it costs one look-up.
        self._guarded_actors = False

    @property
    def actor_options(self) -> set[str]:
        return {OVERLAP_OPTION}

    def after_declare_actor(self, broker: Broker, actor: Actor[Any, Any]) -> None:
        if OVERLAP_OPTION in actor.options:
            self._guarded_actors = True

    @one_line_at_start_up
    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self.bind(kit_broker(broker, self))

    def bind(self, broker: KitBroker) -> None:
        """Keep the leases on ``broker``'s Redis, under the scheduler's namespace."""
        self.keys = SchedulerKeys(self.namespace or broker.namespace)
        self._acquire = broker.client.register_script(_SCRIPTS["acquire"])
        self._renew = broker.client.register_script(_SCRIPTS["renew"])
        self._release = broker.client.register_script(_SCRIPTS["release"])

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self._stopping.clear()
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_forever, name="gp-overlap-renewer", daemon=True)
        self._renewer.start()

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._stopping.set()

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._stop.set()

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        guard = message.options.get(OVERLAP_OPTION)
        if guard is None:
            if not self._guarded_actors:
                return
            actor = broker.actors.get(message.actor_name)
            guard = actor.options.get(OVERLAP_OPTION) if actor is not None else None
            if guard is None:
                return
        mode = guard["mode"]
        if mode not in ("skip", "wait"):
            return
        entry = guard["key"]
        assert self.keys is not None, "OverlapGuard is bound at worker boot"
        key, message_id = self.keys.running(entry), message.message_id
        waiting_since = None
        while (holder := self._take(key, entry, message_id)) is not None:
            if mode == "skip":
                instruments().scheduler_overlaps.add(1, {"entry": entry, "outcome": "skipped"})
                self.logger.warning(
                    "run skipped: %s is still running (run %s) task_type=%s task_id=%s",
                    printable(entry),
                    printable(holder),
                    message.actor_name,
                    message_id,
                )
                raise SkipMessage()
            if waiting_since is None:
                waiting_since = time.monotonic()
                self.logger.info(
                    "run waiting: %s is still running (run %s) task_type=%s task_id=%s",
                    printable(entry),
                    printable(holder),
                    message.actor_name,
                    message_id,
                )
            if self._stopping.wait(POLL_S):
                self.logger.info(
                    "run put back: the worker is stopping task_type=%s task_id=%s", message.actor_name, message_id
                )
                kit_broker(broker, self).redeliver_later(message, REQUEUE_MS)
                raise SkipMessage()
        self._held[threading.get_ident()] = (key, message_id)
        if waiting_since is not None:
            instruments().scheduler_overlaps.add(1, {"entry": entry, "outcome": "waited"})
            self.logger.info(
                "run started after waiting %.1f s for %s's previous run task_id=%s",
                time.monotonic() - waiting_since,
                printable(entry),
                message_id,
            )

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        if self._held:
            self._free()

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        if self._held:
            self._free()

    def _take(self, key: str, entry: str, message_id: str) -> str | None:
        """None once the lease is this message's, else the message id of the run holding it."""
        try:
            holder = self._acquire(keys=[key], args=[message_id, self.lease_ms])
        except redis.RedisError as exc:
            raise OverlapUnavailable(f"cannot check whether {entry} is running: {exc}") from exc
        return None if holder is None else text(holder)

    def _free(self) -> None:
        held = self._held.pop(threading.get_ident(), None)
        if held is None:
            return
        try:
            self._release(keys=[held[0]], args=[held[1]])
        except redis.RedisError as exc:
            self.logger.warning(
                "could not free %s (its lease lapses within %d ms): %s", printable(held[0]), self.lease_ms, exc
            )

    def _renew_forever(self) -> None:
        while not self._stop.wait(self.lease_ms / 3000):
            held = list(self._held.values())
            if not held:
                continue
            try:
                lost = self._renew(keys=[key for key, _ in held], args=[self.lease_ms, *(run for _, run in held)])
            except redis.RedisError as exc:
                self.logger.warning("could not renew %d running lease(s): %s", len(held), exc)
                continue
            for index in lost:
                self.logger.warning(
                    "lease %s lapsed and another run took it: the runs overlap (task_id=%s)",
                    printable(held[index - 1][0]),
                    held[index - 1][1],
                )
