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

:class:`Outlet` is shaped as APScheduler's ``BaseExecutor``: :meth:`Outlet.fire` is
the one method an outlet must write; the claim and the recovery hook are the base's.
"""

from __future__ import annotations

import logging
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal, cast

from dramatiq import Message

from .. import keys
from ..brokers.base import KitBroker
from ..lua import scripts
from ..records import text

logger = logging.getLogger(__name__)

_SCRIPTS = scripts(__file__)

#: What firing a tick did, as ``claim.lua`` names it: enqueued (or kept to publish); fired
#: already; not fired, its entry being paused; not fired, this process no longer leading.
Outcome = Literal["fired", "deduplicated", "paused", "lease_lost"]


@dataclass(frozen=True, slots=True)
class Tick:
    """One tick of one entry to fire, and the lease value of the leader firing it."""

    entry: str
    #: The scheduled time, in ms since the epoch: with the entry, the tick's identity.
    ms: int
    message: Message[Any]
    #: ``<epoch>/<token>``: the claim fires nothing unless the lease still holds it.
    lease: str


class Outlet(ABC):
    """Fires claimed ticks into a broker's queues: subclasses write :meth:`fire`.

    Parameters:
        broker: the kit's broker, whose ``client`` keeps the claims.
        scheduler_keys: the scheduler's keys.
        tick_ttl_ms: how long a tick's claim key lives (older ticks never fire again).
    """

    def __init__(self, broker: KitBroker, scheduler_keys: keys.SchedulerKeys, tick_ttl_ms: int) -> None:
        self.broker, self.keys, self.tick_ttl_ms = broker, scheduler_keys, tick_ttl_ms
        self._claim_script = broker.client.register_script(_SCRIPTS["claim"])

    @abstractmethod
    def fire(self, tick: Tick) -> Outcome:
        """Claim ``tick`` and put its message into its queue: once, and never one without the other."""

    def recover(self) -> None:  # noqa: B027 -- a hook: most outlets have nothing to recover
        """At a takeover, before anything fires: send what an earlier leader claimed and did not send.

        Nothing here: where the claim enqueues, there is nothing to leave behind.
        """

    def _claim(self, tick: Tick, store: str, field: str, data: bytes, queue: str | None = None) -> Outcome:
        """Run ``claim.lua`` for ``tick``, storing ``data`` as ``field`` of the hash ``store``, and
        pushing ``field`` onto the list ``queue`` if given."""
        result = self._claim_script(
            keys=[
                self.keys.lease,
                self.keys.tick(tick.entry, tick.ms),
                self.keys.last_fired,
                self.keys.paused,
                store,
                *([queue] if queue is not None else []),
            ],
            args=[tick.lease, self.tick_ttl_ms, tick.entry, tick.ms, field, data],
        )
        return cast(Outcome, text(result))


class PushOutlet(Outlet):
    """For queues in the coordination Redis: the claim pushes the message onto its queue.

    The message is announced and reported as any send is (``before_enqueue``, then
    ``after_enqueue`` or ``after_send_failed``), under a fresh ``redis_message_id``.
    """

    def fire(self, tick: Tick) -> Outcome:
        broker, redis_id = self.broker, str(uuid.uuid4())
        message = tick.message.copy(options={"redis_message_id": redis_id})
        broker.emit_before("enqueue", message, None)
        ns, queue = broker.namespace, message.queue_name
        try:
            outcome = self._claim(
                tick, keys.messages(ns, queue), redis_id, message.encode(), queue=keys.queue(ns, queue)
            )
        except BaseException as exc:
            broker.send_failed(message, exc)
            raise
        if outcome == "fired":
            broker.emit_after("enqueue", message, None)
        else:
            broker.send_failed(message, None)
        return outcome


class PublishOutlet(Outlet):
    """For queues on another server (RabbitMQ): the claim keeps the message, then a confirmed publish.

    A tick's message stays in ``<ns>:scheduler:unpublished`` until the broker has
    confirmed it. If the publish fails, or its leader dies first, the next takeover
    publishes it (:meth:`recover`; an error reaching Redis or the broker starts one):
    late rather than never. Published twice (the confirm came, the removal did not),
    its two copies carry the tick's message id, and idempotent execution runs one.
    """

    def fire(self, tick: Tick) -> Outcome:
        field = f"{tick.entry}:{tick.ms}"
        outcome = self._claim(tick, self.keys.unpublished, field, tick.message.encode())
        if outcome == "fired":
            # A failure here leaves it unpublished, for the next takeover (the error starts one).
            self.broker.enqueue(tick.message)
            self.broker.client.hdel(self.keys.unpublished, field)
        return outcome

    def recover(self) -> None:
        """Publish the ticks an earlier leader claimed and did not see confirmed."""
        client = self.broker.client
        for field, data in client.hgetall(self.keys.unpublished).items():
            message = Message.decode(data if isinstance(data, bytes) else data.encode())
            logger.warning(
                "schedule runner: publishing %s, claimed but not confirmed by the leader that claimed it",
                text(field),
            )
            self.broker.enqueue(message)
            client.hdel(self.keys.unpublished, field)


def outlet_for(broker: KitBroker, scheduler_keys: keys.SchedulerKeys, tick_ttl_ms: int) -> Outlet:
    """The outlet for ``broker``'s queues: where they are is the broker's to say, not its class's."""
    outlet = PushOutlet if broker.queues_in_client else PublishOutlet
    return outlet(broker, scheduler_keys, tick_ttl_ms)
