"""Where a fired tick goes: the outlet of the broker's queues, chosen once from the broker.

Firing a tick is one Lua call (``outlet/claim.lua``) that checks the lease, claims the
tick and stores its message, atomically (the runner's docstring says why). What it
does with the message depends on where the queues are, which the broker declares
(:attr:`~dramatiq_gp.brokers.base.KitBroker.queues_in_client`):

* :class:`PushOutlet`, queues in the coordination Redis: the call pushes the message
  onto its queue itself, so a claimed tick is an enqueued one;
* :class:`PublishOutlet`, queues on another server (RabbitMQ): the call keeps the
  message in ``<ns>:scheduler:unpublished``, the broker publishes it and waits for
  the confirm, and only then is it removed; at a takeover the new leader publishes
  what it finds there first (:meth:`Outlet.recover`).

**Behind replicas** (``SCHEDULER_CLAIM_REPLICAS``, by default 1 behind Sentinel and 0
otherwise) a claim must reach a replica before its message may run, because
replication is asynchronous: a failover loses the writes its replicas had not
received, a lost claim lets the next leader claim the tick again, and a message
that ran off the lost claim would run a second time. So both outlets claim into
``unpublished``, send ``WAIT <replicas> <timeout>`` on the connection that claimed
(WAIT counts the connection's own last write; the two go in one pipeline, so they
share it), and send the message only if enough replicas acknowledged:

* acknowledged: the claim survives any failover Sentinel makes (it promotes the
  replica that has the most of the stream), so no later leader claims the tick
  again. The message is sent once: :class:`PushOutlet` moves it from
  ``unpublished`` onto its queue in one Lua call (``outlet/release.lua``) that does
  nothing if the field is gone, so of a firing leader and a recovering one only
  one pushes it;
* not acknowledged (no replica, or one lagging past the timeout): the firing ends
  ``not_durable``, nothing is sent, and the claim stays in ``unpublished``. The
  runner retries through a takeover pass (:meth:`Outlet.recover`), which sends
  what is held only after a WAIT on a write made after reading it
  (``outlet/hold.lua``) was acknowledged, i.e. once the claims are on a replica.
  If the primary dies first, the claim either reached the promoted replica
  (then it is held there and recovered: sent once) or did not (then neither the
  claim nor anything it sent exists: the next leader's catch-up fires the tick
  afresh, once). A leader cut off with an old primary cannot send either: its
  WAIT cannot be acknowledged once the replicas follow the new primary.

What WAIT cannot close: the send itself (the push, or the removal after a publish)
may be lost in a failover after a worker took the message from the old primary;
the new leader then sends the tick again, and it runs twice if its done mark was
lost with it. That window is the replication lag after the send (under a
millisecond on a LAN), the same as for any message the Redis broker holds.

:class:`Outlet` is shaped as APScheduler's ``BaseExecutor``: :meth:`Outlet.fire` is
the one method an outlet must write; the claim and the recovery hook are the base's.
"""

from __future__ import annotations

import logging
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import redis
from dramatiq import Message

from .. import keys
from ..brokers.base import KitBroker
from ..errors import GPError
from ..lua import scripts
from ..records import text
from ..telemetry import printable

logger = logging.getLogger(__name__)

_SCRIPTS = scripts(__file__)

#: What firing a tick did, as ``claim.lua`` names it: enqueued (or kept to publish); fired
#: already; not fired, its entry being paused; not fired, this process no longer leading;
#: claimed, but no replica acknowledged the claim in time, so kept unsent (the outlet's own).
Outcome = Literal["fired", "deduplicated", "paused", "lease_lost", "not_durable"]

#: How long a claim waits for its replicas unless told (``SCHEDULER_CLAIM_TIMEOUT``).
DEFAULT_WAIT_MS = 1000


class TickNotDurable(GPError):
    """Claimed ticks no replica acknowledged in time: kept unsent, and sent once one has (the runner retries)."""


def replicas_to_wait_for(client: redis.Redis, configured: int | None) -> int:
    """``configured``, or unset: 1 for a client of a primary found through Sentinel, else 0.

    Behind Sentinel there are replicas to fail over to, by definition; a lone server
    has none, and a WAIT there could never be acknowledged.
    """
    if configured is not None:
        return configured
    from redis.sentinel import SentinelConnectionPool

    return 1 if isinstance(client.connection_pool, SentinelConnectionPool) else 0


@dataclass(frozen=True, slots=True)
class Tick:
    """One tick of one entry to fire, and the lease value of the leader firing it."""

    entry: str
    #: The scheduled time, in ms since the epoch: with the entry, the tick's identity.
    ms: int
    message: Message[Any]
    #: ``<epoch>/<token>``: the claim fires nothing unless the lease still holds it.
    lease: str

    @property
    def field(self) -> str:
        """Its field in ``<ns>:scheduler:unpublished`` while it is claimed and not sent."""
        return f"{self.entry}:{self.ms}"


class Outlet(ABC):
    """Fires claimed ticks into a broker's queues: subclasses write :meth:`fire`.

    Parameters:
        broker: the kit's broker, whose ``client`` keeps the claims.
        scheduler_keys: the scheduler's keys.
        tick_ttl_ms: how long a tick's claim key lives (older ticks never fire again).
        replicas: how many replicas must hold a claim before its message is sent (0: no wait).
        wait_ms: how long a claim waits for them before the firing ends ``not_durable``.
    """

    def __init__(
        self,
        broker: KitBroker,
        scheduler_keys: keys.SchedulerKeys,
        tick_ttl_ms: int,
        *,
        replicas: int = 0,
        wait_ms: int = DEFAULT_WAIT_MS,
    ) -> None:
        self.broker, self.keys, self.tick_ttl_ms = broker, scheduler_keys, tick_ttl_ms
        self.replicas, self.wait_ms = replicas, wait_ms
        self._claim_script = broker.client.register_script(_SCRIPTS["claim"])
        self._hold_script = broker.client.register_script(_SCRIPTS["hold"])

    @abstractmethod
    def fire(self, tick: Tick) -> Outcome:
        """Claim ``tick`` and put its message into its queue: once, and never one without the other."""

    #: Whether :meth:`prepare` announces the message (``before_enqueue``), so that :meth:`fire_prepared`
    #: may claim many at once outside their firings' spans; otherwise each is fired in its span by :meth:`fire`.
    batches = False

    def prepare(self, tick: Tick) -> Tick:
        """``tick`` as :meth:`fire_prepared` takes it; called in the firing's span, so a send hook sees it."""
        return tick

    def fire_prepared(self, ticks: list[Tick]) -> list[Outcome]:
        """:meth:`fire` each prepared tick, in order; an outlet that :attr:`batches` claims them in one round trip."""
        return [self.fire(tick) for tick in ticks]

    @abstractmethod
    def _send_held(self, field: str, data: bytes) -> None:
        """Send the message ``data`` of the claimed tick ``field`` found in ``unpublished``, and remove it there."""

    def recover(self) -> None:
        """At a takeover, before anything fires: send what an earlier leader claimed and did not send.

        Raises:
            TickNotDurable: there are such ticks, and no replica acknowledged them in time.
        """
        for field, data in self._held().items():
            self._send_held(text(field), data if isinstance(data, bytes) else data.encode())

    def _held(self) -> dict[Any, Any]:
        """The claimed ticks kept in ``unpublished``; with replicas to wait for, once enough hold them all."""
        client = self.broker.client
        if not self.replicas:
            return client.hgetall(self.keys.unpublished)
        with client.pipeline(transaction=False) as pipe:
            self._hold_script(keys=[self.keys.unpublished], client=pipe)
            pipe.wait(self.replicas, self.wait_ms)
            flat, acked = pipe.execute()
        held = dict(zip(flat[::2], flat[1::2], strict=True))
        if held and acked < self.replicas:
            raise TickNotDurable(
                f"{len(held)} claimed tick(s) not sent yet: {acked} of the {self.replicas} replica(s) "
                f"SCHEDULER_CLAIM_REPLICAS asks for acknowledged them within {self.wait_ms} ms"
            )
        return held

    def _claim_keys(self, tick: Tick, store: str, queue: str | None) -> list[str]:
        return [
            self.keys.lease,
            self.keys.tick(tick.entry, tick.ms),
            self.keys.last_fired,
            self.keys.paused,
            store,
            *([queue] if queue is not None else []),
        ]

    def _claim(self, tick: Tick, store: str, field: str, data: bytes, queue: str | None = None) -> Outcome:
        """Run ``claim.lua`` for ``tick``, storing ``data`` as ``field`` of the hash ``store``, and
        pushing ``field`` onto the list ``queue`` if given."""
        result = self._claim_script(
            keys=self._claim_keys(tick, store, queue),
            args=[tick.lease, self.tick_ttl_ms, tick.entry, tick.ms, field, data],
        )
        return cast(Outcome, text(result))

    def _claim_durably(self, tick: Tick, data: bytes) -> Outcome:
        """Claim ``tick`` into ``unpublished`` and WAIT for the replicas on the same connection.

        A claim that no replica acknowledged in time is ``not_durable``; the claim is
        made all the same, and its message stays in ``unpublished``.
        """
        with self.broker.client.pipeline(transaction=False) as pipe:
            self._claim_script(
                keys=self._claim_keys(tick, self.keys.unpublished, None),
                args=[tick.lease, self.tick_ttl_ms, tick.entry, tick.ms, tick.field, data],
                client=pipe,
            )
            pipe.wait(self.replicas, self.wait_ms)
            result, acked = pipe.execute()
        outcome = cast(Outcome, text(result))
        return "not_durable" if outcome == "fired" and acked < self.replicas else outcome


class PushOutlet(Outlet):
    """For queues in the coordination Redis: the claim pushes the message onto its queue.

    Behind replicas, the claim keeps it in ``unpublished`` and a second call pushes
    it once a replica holds the claim (see the module's docstring).

    The message is announced and reported as any send is (``before_enqueue``, then
    ``after_enqueue`` or ``after_send_failed``), under a fresh ``redis_message_id``.
    """

    def __init__(self, broker: KitBroker, scheduler_keys: keys.SchedulerKeys, tick_ttl_ms: int, **wait: Any) -> None:
        super().__init__(broker, scheduler_keys, tick_ttl_ms, **wait)
        self._release_script = broker.client.register_script(_SCRIPTS["release"])

    batches = True

    def fire(self, tick: Tick) -> Outcome:
        return self.fire_prepared([self.prepare(tick)])[0]

    def prepare(self, tick: Tick) -> Tick:
        """The tick's message under a fresh ``redis_message_id``, announced (``before_enqueue``)."""
        message = tick.message.copy(options={"redis_message_id": str(uuid.uuid4())})
        self.broker.emit_before("enqueue", message, None)
        return replace(tick, message=message)

    def fire_prepared(self, ticks: list[Tick]) -> list[Outcome]:
        """Without replicas to wait for, every claim (each pushing its message) goes in one pipeline:
        a leader firing a thousand stored entries at 08:00 pays one round trip, not a thousand."""
        if self.replicas:
            return [self._fire_prepared(tick) for tick in ticks]
        broker, ns = self.broker, self.broker.namespace
        try:
            with broker.client.pipeline(transaction=False) as pipe:
                for tick in ticks:
                    message = tick.message
                    self._claim_script(
                        keys=self._claim_keys(
                            tick, keys.messages(ns, message.queue_name), keys.queue(ns, message.queue_name)
                        ),
                        args=[
                            tick.lease,
                            self.tick_ttl_ms,
                            tick.entry,
                            tick.ms,
                            message.options["redis_message_id"],
                            message.encode(),
                        ],
                        client=pipe,
                    )
                outcomes = [cast(Outcome, text(result)) for result in pipe.execute()]
        except BaseException as exc:
            for tick in ticks:
                broker.send_failed(tick.message, exc)
            raise
        for tick, outcome in zip(ticks, outcomes, strict=True):
            if outcome == "fired":
                broker.emit_after("enqueue", tick.message, None)
            else:
                broker.send_failed(tick.message, None)
        return outcomes

    def _fire_prepared(self, tick: Tick) -> Outcome:
        """One prepared tick, claimed, then pushed once a replica holds the claim."""
        broker, message = self.broker, tick.message
        try:
            outcome = self._claim_durably(tick, message.encode())
            if outcome == "fired" and not self._release(tick.field, message):
                outcome = "deduplicated"  # a recovering leader pushed it first
        except BaseException as exc:
            broker.send_failed(message, exc)
            raise
        if outcome == "fired":
            broker.emit_after("enqueue", message, None)
        else:
            broker.send_failed(message, None)
        return outcome

    def _release(self, field: str, message: Message[Any]) -> bool:
        """Push ``message`` (which carries its ``redis_message_id``) if ``field`` is still unsent; whether it was."""
        ns, queue = self.broker.namespace, message.queue_name
        pushed = self._release_script(
            keys=[self.keys.unpublished, keys.messages(ns, queue), keys.queue(ns, queue)],
            args=[field, message.options["redis_message_id"], message.encode()],
        )
        return bool(pushed)

    def _send_held(self, field: str, data: bytes) -> None:
        message = Message.decode(data)
        if "redis_message_id" not in message.options:  # kept by a PublishOutlet (the queues were on RabbitMQ)
            message = message.copy(options={"redis_message_id": str(uuid.uuid4())})
        self.broker.emit_before("enqueue", message, None)
        if self._release(field, message):
            logger.warning(
                "schedule runner: enqueued %s, claimed but not enqueued by the leader that claimed it", printable(field)
            )
            self.broker.emit_after("enqueue", message, None)
        else:
            self.broker.send_failed(message, None)


class PublishOutlet(Outlet):
    """For queues on another server (RabbitMQ): the claim keeps the message, then a confirmed publish.

    A tick's message stays in ``<ns>:scheduler:unpublished`` until the broker has
    confirmed it. If the publish fails, or its leader dies first, the next takeover
    publishes it (:meth:`recover`; an error reaching Redis or the broker starts one):
    late rather than never. Published twice (the confirm came, the removal did not),
    its two copies carry the tick's message id, and idempotent execution runs one.
    Behind replicas, nothing is published before a replica holds the claim.
    """

    def fire(self, tick: Tick) -> Outcome:
        data = tick.message.encode()
        if self.replicas:
            outcome = self._claim_durably(tick, data)
        else:
            outcome = self._claim(tick, self.keys.unpublished, tick.field, data)
        if outcome == "fired":
            # A failure here leaves it unpublished, for the next takeover (the error starts one).
            self.broker.enqueue(tick.message)
            self.broker.client.hdel(self.keys.unpublished, tick.field)
        return outcome

    def _send_held(self, field: str, data: bytes) -> None:
        """Publish a tick an earlier leader claimed and did not see confirmed."""
        logger.warning(
            "schedule runner: publishing %s, claimed but not confirmed by the leader that claimed it", printable(field)
        )
        self.broker.enqueue(Message.decode(data))
        self.broker.client.hdel(self.keys.unpublished, field)


def outlet_for(
    broker: KitBroker,
    scheduler_keys: keys.SchedulerKeys,
    tick_ttl_ms: int,
    *,
    replicas: int | None = None,
    wait_ms: int = DEFAULT_WAIT_MS,
) -> Outlet:
    """The outlet for ``broker``'s queues: where they are is the broker's to say, not its class's.

    ``replicas`` unset: see :func:`replicas_to_wait_for`.
    """
    outlet = PushOutlet if broker.queues_in_client else PublishOutlet
    return outlet(
        broker, scheduler_keys, tick_ttl_ms, replicas=replicas_to_wait_for(broker.client, replicas), wait_ms=wait_ms
    )
