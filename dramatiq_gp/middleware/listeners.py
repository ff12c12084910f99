"""Listeners as a middleware: a registry's listeners become the worker's actors, declared to every fan-out."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import redis
from dramatiq import Broker, Middleware, Worker

from ..errors import one_line_at_start_up
from ..registry import Registry, default_registry
from .scheduler_lease import SchedulerLease

#: ``WORKER_LISTENER_RETIREMENT``'s default.
RETIREMENT = timedelta(minutes=10)


class Listeners(Middleware):
    """Declares each listener of a registry as an actor, so the worker consumes its queue, and
    declares them in Redis/Valkey, so every worker's fan-out reaches them.

    Each listener is ``listener:<event>:<name>`` on its own queue; each event gets
    the ``event:<event>`` actor that fans outbox and scheduled events out to them.
    Listeners added later (a registry bound already) are declared as they come.

    On one of the kit's brokers the worker also writes its listeners to Redis/Valkey
    before its consumers start, and keeps them fresh while it runs
    (:mod:`dramatiq_gp.subscriptions`): a fan-out in any process reaches the union of
    what live workers declared, so a listener a rolling deploy adds gets the events
    old workers fan out. One no worker declared for ``retirement`` is retired.

    Hooks: ``before_worker_boot`` (before the consumers start: the actors, and the
    declaration; when that added a listener, it waits until every fanning process
    reads it, a quarter of a second, so an event committed once the worker has
    started reaches it) and ``after_worker_shutdown``
    (stops refreshing; what was declared stays until retired, so a restart misses
    nothing). Works on any broker: Dramatiq's ``StubBroker`` too, for tests, without
    the declaration. With :class:`~dramatiq_gp.IdempotentExecution` in the list the
    listeners take part in it; the fan-out goes out as one batch on the kit's
    brokers and one message at a time elsewhere.

    Parameters:
        registry: module-level ``@dramatiq_gp.listener`` functions' by default.
        retirement: ``WORKER_LISTENER_RETIREMENT``.
    """

    def __init__(self, registry: Registry | None = None, *, retirement: timedelta = RETIREMENT) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.registry = registry if registry is not None else default_registry
        self.retirement = retirement

    @one_line_at_start_up
    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        # A broker built by hand has no Kit to say what was registered (a Kit said it at import).
        lease = next((m for m in broker.middleware if isinstance(m, SchedulerLease)), None)
        self.registry.announce(len(lease.schedule) if lease is not None else 0)
        self.registry.bind(broker)
        subscriptions, listeners = self.registry.subscriptions, self.registry.listeners()
        if subscriptions is None or not listeners:
            return
        try:
            added = subscriptions.declare(listeners, self.retirement)
        except redis.RedisError as exc:
            self.logger.warning("could not declare this worker's listeners in Redis (retrying): %s", exc)
        else:
            if added:
                # Nothing runs yet: the consumers start after this hook, and so does everything that renews.
                subscriptions.wait_until_everyone_sees(time.monotonic())
                self.logger.info("start-up: new listener(s) declared; every worker's fan-out now reaches them")
        subscriptions.keep_declaring(self.registry.listeners, self.retirement)

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        if self.registry.subscriptions is not None:
            self.registry.subscriptions.stop()
