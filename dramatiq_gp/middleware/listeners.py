"""Listeners as a middleware: a registry's listeners become the worker's actors."""

from __future__ import annotations

from dramatiq import Broker, Middleware, Worker

from ..errors import one_line_at_start_up
from ..registry import Registry, default_registry


class Listeners(Middleware):
    """Declares each listener of a registry as an actor, so the worker consumes its queue.

    Each listener is ``listener:<event>:<name>`` on its own queue; each event gets
    the ``event:<event>`` actor that fans outbox and scheduled events out to them.
    Listeners added later (a registry bound already) are declared as they come.

    Hooks: ``before_worker_boot``, before the consumers start. Works on any
    broker: Dramatiq's ``StubBroker`` too, for tests. With
    :class:`~dramatiq_gp.IdempotentExecution` in the list the listeners take part
    in it; the fan-out goes out in one round trip on :class:`dramatiq_gp.RedisBroker`
    and one message at a time elsewhere.

    Parameters:
        registry: module-level ``@dramatiq_gp.listener`` functions' by default.
    """

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry if registry is not None else default_registry

    @one_line_at_start_up
    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self.registry.bind(broker)
