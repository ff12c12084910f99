"""Idempotent execution: duplicates of a message id never reach the handler twice.

Dramatiq's brokers store and run a message id as often as it is enqueued.
The kit's message ids are deterministic (fan-out, outbox, scheduler), so copies
do happen: a relay crashing between enqueue and commit, a fan-out retried, two
leaders overlapping. This middleware makes them harmless:

* one Lua call per fetched batch claims each id (``SET`` with a lease) unless it
  has a done mark (the copy is acked and skipped) or is claimed by a running
  copy (the copy is deferred and looked at again later, so a crashed holder's
  work is not lost); the kit's broker calls :meth:`IdempotentExecution.after_fetch`
  as it fetches, and a message that arrives unclaimed is claimed on its own;
* the outcome rides in the message's settle plan
  (:class:`~dramatiq_gp.brokers.base.SettlePlan`) and is written with the ack (on
  Redis in the same Lua call, on RabbitMQ to Redis just before it; see
  ``docs/life-of-a-message.md``): for a success the claim is freed and the id gets
  a done mark, kept for the retention window in about 20 bytes
  (:mod:`~dramatiq_gp.brokers.done_marks`); on failure the claim is only freed, so
  a retry of the same id runs;
* a thread renews the leases of messages still running, so a long task keeps its
  claim and a dead worker's claim lapses within one lease.

Only actors declared with ``idempotent=True`` take part (the kit's listeners and
jobs do); a plain actor's ids are random, so checking them would buy nothing.

Hooks: ``before_worker_boot`` (refuses any broker but the kit's, whose settle step writes
the outcome), ``after_worker_boot``/``after_worker_shutdown``
(the renewing thread), ``before_process_message``, ``after_process_message``,
``after_ack``/``after_nack``, and the broker's ``after_fetch``. The claims are
``<namespace>:gp:done:<message id>`` on the broker's Redis (the name the kit has
always used: workers of the version before see them, and a ``"done"`` an older
worker left there counts as a done mark), the done marks under ``<namespace>:gp:marks:``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any
from uuid import uuid4

import redis
from dramatiq import Broker, Middleware, Worker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import MiddlewareError, SkipMessage

from .. import keys
from ..brokers import done_marks
from ..brokers.base import KitBroker, SettlePlan, attach_plan, kit_broker, plan_of
from ..errors import one_line_at_start_up
from ..lua import scripts
from ..names import is_delay_queue

_SCRIPTS = scripts(__file__)
_SCRIPTS["claim"] = done_marks.with_library(_SCRIPTS["claim"])
_CLAIMED, _DONE, _RUNNING = 1, 2, 3
_STATE_ATTR = "_gp_claim_state"

#: A deferred copy looks again after 1 s, 2 s, 4 s... up to 30 s.
MIN_DEFER_MS, MAX_DEFER_MS = 1000, 30_000


class ClaimUnavailable(MiddlewareError):
    """Redis could not be asked whether the message already ran; the attempt fails and is retried."""


class IdempotentExecution(Middleware):
    """Skips message ids that already completed and keeps copies of one id from overlapping.

    Parameters:
        retention_ms: how long a completed id is remembered (``WORKER_DEDUP_RETENTION``, default 24 h).
        lease_ms: how long a claim outlives its last renewal (default 60 s).
    """

    def __init__(self, *, retention_ms: int = 86_400_000, lease_ms: int = 60_000) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.retention_ms = retention_ms
        self.lease_ms = lease_ms
        self.key_prefix = self.marks_prefix = ""
        self._running: dict[str, str] = {}
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def actor_options(self) -> set[str]:
        return {"idempotent"}

    @one_line_at_start_up
    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self.bind(kit_broker(broker, self))

    def bind(self, broker: KitBroker) -> None:
        """Keep the claims on ``broker``'s Redis, under its namespace."""
        self.key_prefix = keys.claim_prefix(broker.namespace)
        self.marks_prefix = keys.done_marks(broker.namespace)
        self._claim = broker.client.register_script(_SCRIPTS["claim"])
        self._renew = broker.client.register_script(_SCRIPTS["renew"])

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_forever, name="gp-claim-renewer", daemon=True)
        self._renewer.start()

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._stop.set()

    def after_fetch(self, broker: KitBroker, queue_name: str, messages: Sequence[MessageProxy]) -> None:
        """Claim the ids of the idempotent ones among ``messages`` in one round trip."""
        if is_delay_queue(queue_name):
            return  # delayed messages are only parked in the consumer; they are claimed when due
        wanted, keys, marks = [], [], []
        for message in messages:
            message_id = message.message_id  # once: each read goes through the proxy's __getattr__
            # The script reads a batch's keys joined by line breaks: an id holding one is claimed on its own.
            if "\n" not in message_id and self._applies(broker, message):
                wanted.append(message)
                keys.append(self.key_prefix + message_id)
                marks.append(done_marks.digest(message_id))
        if not wanted:
            return
        # One random prefix per batch, numbered here and in the script: as unique as a uuid4 each, at far less cost.
        batch = uuid4().hex
        try:
            result = self._claim(args=[self.lease_ms, self.marks_prefix, "\n".join(keys), batch, b"".join(marks)])
        except redis.RedisError as exc:
            self.logger.warning(
                "could not claim a batch of %d message(s), claiming them one by one: %s", len(keys), exc
            )
            return
        states, ttls = result[0], iter(result[1:])
        for i, message in enumerate(wanted):
            state = int(states[i : i + 1])  # bytes, or str from a client that decodes responses
            self._record(message, keys[i], f"{batch}{i:x}", marks[i], state, next(ttls) if state == _RUNNING else 0)

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        # Claimed with its batch (most are), its actor found idempotent then; read from the proxy's own
        # attributes, as plan_of reads: a miss through its __getattr__ raises twice.
        state: tuple[int, int] | None = message.__dict__.get(_STATE_ATTR)
        if state is None:
            if not self._applies(broker, message):
                return
            key, batch, mark = self.key_prefix + message.message_id, uuid4().hex, done_marks.digest(message.message_id)
            try:
                result = self._claim(args=[self.lease_ms, self.marks_prefix, key, batch, mark])
            except redis.RedisError as exc:
                raise ClaimUnavailable(f"cannot check whether message {message.message_id} ran: {exc}") from exc
            found = int(result[0])
            state = self._record(message, key, f"{batch}0", mark, found, result[1] if found == _RUNNING else 0)
        if state[0] == _CLAIMED:
            return
        if state[0] == _DONE:
            self.logger.warning(
                "task skipped: already completed (duplicate) task_type=%s task_id=%s",
                message.actor_name,
                message.message_id,
            )
        else:
            # Look again soon (the holder may be nearly done), then less and less often.
            deferrals = message.options.get("gp_deferrals", 0)
            delay_ms = min(MIN_DEFER_MS * 2 ** min(deferrals, 5), MAX_DEFER_MS, max(state[1], MIN_DEFER_MS))
            self.logger.info(
                "task deferred: another copy is running task_type=%s task_id=%s retry_in_ms=%d",
                message.actor_name,
                message.message_id,
                delay_ms,
            )
            kit_broker(broker, self).redeliver_later(message, delay_ms, gp_deferrals=deferrals + 1)
        raise SkipMessage()

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        plan = plan_of(message)
        if plan is not None and plan.token and exception is None:
            plan.outcome, plan.retention_ms = "done", self.retention_ms

    def after_ack(self, broker: Broker, message: MessageProxy) -> None:
        plan = plan_of(message)
        if plan is not None and plan.key:
            self._running.pop(plan.key, None)

    after_nack = after_ack

    def _applies(self, broker: Broker, message: MessageProxy) -> bool:
        actor = broker.actors.get(message.actor_name)
        return actor is not None and bool(actor.options.get("idempotent"))

    def _record(
        self, message: MessageProxy, key: str, token: str, mark: bytes, state: int, pttl: int
    ) -> tuple[int, int]:
        if state == _CLAIMED:
            self._running[key] = token
            attach_plan(message, SettlePlan(key=key, token=token, outcome="release", mark=mark))
        setattr(message, _STATE_ATTR, (state, int(pttl)))
        return state, int(pttl)

    def _renew_forever(self) -> None:
        interval_s = self.lease_ms / 3000
        while not self._stop.wait(interval_s):
            running = dict(self._running)
            if not running:
                continue
            try:
                self._renew(keys=list(running), args=[self.lease_ms, *running.values()])
            except redis.RedisError as exc:
                self.logger.warning("could not renew %d claim(s): %s", len(running), exc)
