"""The outbox relay as a middleware: one relay thread in every worker process.

SQLAlchemy and psycopg are imported when the relay is built, at worker boot, so
importing this module costs a worker without a database nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dramatiq import Broker, Worker

from ..brokers.base import KitBroker, kit_broker
from ..errors import one_line_at_start_up
from ..settings import OutboxSettings, Settings
from .lifecycle import Producer

if TYPE_CHECKING:
    import sqlalchemy as sa

    from ..outbox import Relay


class OutboxRelay(Producer):
    """Moves committed outbox events to the queue (see :mod:`dramatiq_gp.outbox.relay`).

    Hooks: ``before_worker_boot`` (refuses a broker not of the kit's, which sends
    a batch before the relay marks it published: :class:`dramatiq_gp.RedisBroker`
    in one round trip, all or none, :class:`dramatiq_gp.RabbitmqBroker` published at
    once and every message confirmed),
    ``after_worker_boot`` (starts the relay thread) and
    ``before_worker_shutdown`` (stops it once its current round commits, on a
    thread of its own beside the drain: see :class:`~dramatiq_gp.middleware.lifecycle.Producer`).

    Parameters:
        engine: the database holding ``outbox_events``.
        settings: ``OUTBOX_*``; read from the environment when not given.
    """

    name = "outbox relay"

    @one_line_at_start_up
    def __init__(self, engine: sa.Engine, *, settings: OutboxSettings | None = None) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.engine = engine
        self.settings = settings if settings is not None else Settings.from_env().outbox
        self.relay: Relay | None = None

    def bind(self, broker: KitBroker) -> Relay:
        """The relay of this process, sending to ``broker`` (built once)."""
        if self.relay is None:
            from ..outbox import Relay

            self.relay = Relay(engine=self.engine, broker=broker, settings=self.settings)
        return self.relay

    @one_line_at_start_up
    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self.bind(kit_broker(broker, self))

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        assert self.relay is not None
        self.relay.start()
        self.logger.info("start-up: %s started", self.name)

    def producing(self) -> bool:
        return self.relay is not None

    def stop_producing(self) -> None:
        assert self.relay is not None
        self.relay.stop()
        self.relay.close()
