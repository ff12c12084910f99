"""The worker's start-up and shutdown order (SPEC section 1), driven by Dramatiq's hooks.

Start-up: telemetry and the register callback run when the application module
is imported (the dramatiq CLI imports it in each worker process); then, from
``after_process_boot``, telemetry starts and the broker is pinged (exit code 3
with a one-line error if it does not answer); then Dramatiq starts the consumers
and this middleware logs what runs, and the producers (the schedule's
:class:`~dramatiq_gp.SchedulerLease`, the :class:`~dramatiq_gp.OutboxRelay`)
start from their own ``after_worker_boot``.

Shutdown on SIGTERM/SIGINT: the producers stop first, in their own
``before_worker_shutdown`` (they come before this middleware in the list);
Dramatiq drains in-flight tasks (``async def`` ones too: their worker threads
wait for them) for up to ``WORKER_SHUTDOWN_TIMEOUT``; ``after_worker_shutdown``
puts back what did not finish, cancels the coroutines among it (Dramatiq's
``AsyncIO`` middleware, listed before this one, stops its loop after), runs the closers LIFO
(the kit's own first, then the application's) and flushes telemetry. Each step
is logged once at INFO.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import redis
from dramatiq import Broker, Middleware, Worker
from dramatiq.broker import MessageProxy
from dramatiq.cli import RET_CONNECT

from ..aio import CANCEL_WAIT_S, cancel_coroutines
from ..brokers.base import KitBroker
from ..durations import format_duration
from ..errors import BrokerUnreachable
from ..telemetry import Telemetry

Closer = Callable[[], object]

#: Set on a message put back at the drain timeout: its attempt ends later (a cancelled coroutine), and is no failure.
PUT_BACK_ATTR = "_gp_put_back"


class Closers:
    """Named clean-up functions, run last-in first-out: the kit's own, then the application's."""

    def __init__(self) -> None:
        self.kit: list[tuple[str, Closer]] = []
        self.app: list[tuple[str, Closer]] = []

    def run(self, logger: logging.Logger) -> None:
        for name, close in [*reversed(self.kit), *reversed(self.app)]:
            try:
                close()
            except Exception:
                logger.exception("closer %r failed; running the rest", name)
            else:
                logger.info("shutdown: closed %s", name)


class Lifecycle(Middleware):
    """Start-up check, drain bookkeeping, ordered shutdown and closers for one worker process.

    Hooks: ``after_process_boot`` (starts ``telemetry``, pings the broker's Redis,
    exits with code 3 in one line if it does not answer; the dramatiq CLI emits it,
    a programmatic worker should too), ``before_worker_boot`` (makes the drain
    honour ``shutdown_timeout_ms``), ``after_worker_boot``, ``before_`` and
    ``after_process_message`` and ``after_skip_message`` (what is in flight),
    ``before_worker_shutdown`` and ``after_worker_shutdown``. Works on any broker:
    the ping needs one with a Redis ``client``, and returning unfinished tasks at
    once needs one of the kit's brokers (elsewhere they come back after the
    broker's own timeout).

    Parameters:
        telemetry: started at process boot, flushed last at shutdown.
        shutdown_timeout_ms: the drain limit (``WORKER_SHUTDOWN_TIMEOUT``); ``None``
            keeps the dramatiq CLI's ``--worker-shutdown-timeout``.
        display: how to name the broker's address in logs (passwords hidden).
    """

    def __init__(
        self,
        *,
        telemetry: Telemetry | None = None,
        shutdown_timeout_ms: int | None = None,
        display: str | None = None,
    ) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.telemetry = telemetry
        self.shutdown_timeout_ms = shutdown_timeout_ms
        self.display = display
        self.closers = Closers()
        self._in_flight: dict[int, MessageProxy] = {}
        self._drain_timeout_ms = 600_000

    def with_closer(self, name: str, close: Closer) -> Lifecycle:
        """Run ``close()`` at shutdown, after in-flight tasks drained (last added, first run)."""
        self.closers.app.append((name, close))
        return self

    def after_process_boot(self, broker: Broker) -> None:
        # Here, in the worker process and after the fork, not when the app is imported.
        if self.telemetry is not None:
            self.telemetry.start()
        client = getattr(broker, "client", None)
        if not isinstance(client, redis.Redis):
            return
        where = self.display or _address(client)
        try:
            client.ping()
        except redis.RedisError as exc:
            self.logger.error("start-up failed: Redis/Valkey unreachable at %s: %s", where, exc)
            # SystemExit passes through Dramatiq's hook runner and ends this process
            # with the CLI's "broker connection failed" code.
            raise SystemExit(RET_CONNECT) from None
        if isinstance(broker, KitBroker):
            try:
                broker.ping_queues()
            except BrokerUnreachable as exc:
                self.logger.error("start-up failed: %s", exc)
                raise SystemExit(RET_CONNECT) from None
        self.logger.info("start-up: broker reachable at %s", where)

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        stop = worker.stop

        def stop_with_our_timeout(timeout: int = 600_000) -> None:
            if self.shutdown_timeout_ms is not None:
                timeout = self.shutdown_timeout_ms
            self._drain_timeout_ms = timeout
            stop(timeout=timeout)

        # The dramatiq CLI passes its own --worker-shutdown-timeout; WORKER_SHUTDOWN_TIMEOUT wins.
        worker.stop = stop_with_our_timeout  # type: ignore[method-assign]

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        consumed = sorted(q for q in worker.consumers if not q.endswith(".DQ"))
        self.logger.info(
            "start-up: consumers started on %s with %d threads",
            ", ".join(consumed) or "no queues",
            len(worker.workers),
        )

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._in_flight[threading.get_ident()] = message

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self._in_flight.pop(threading.get_ident(), None)

    after_skip_message = after_process_message

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self.logger.info(
            "shutdown: draining in-flight tasks (up to %s)",
            format_duration(timedelta(milliseconds=self._drain_timeout_ms)),
        )

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._return_unfinished(broker)
        # Their messages are back on the queue: end the coroutines among them, so their clean-up
        # runs before the closers (a loop stopped under them would drop them mid-await).
        cancelled = cancel_coroutines()
        if cancelled:
            self.logger.warning("shutdown: cancelled %d coroutine(s) still running at the drain timeout", cancelled)
            # Their worker threads end those attempts (task log, Sentry, metrics) before the closers and the
            # telemetry flush, not racing the process's exit.
            deadline = time.monotonic() + CANCEL_WAIT_S
            while self._in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
        self.logger.info("shutdown: running closers")
        self.closers.run(self.logger)
        if self.telemetry is not None:
            self.logger.info("shutdown: flushing telemetry")
            self.telemetry.flush()

    def _return_unfinished(self, broker: Broker) -> None:
        unfinished = list(self._in_flight.values())
        if not unfinished:
            self.logger.info("shutdown: in-flight tasks drained")
            return
        if not isinstance(broker, KitBroker):
            self.logger.warning(
                "shutdown: %d task(s) still running at the drain timeout come back after %s's own timeout: %s",
                len(unfinished), type(broker).__name__,
                ", ".join(f"{m.actor_name}/{m.message_id}" for m in unfinished),
            )  # fmt: skip
            return
        for message in unfinished:
            setattr(message, PUT_BACK_ATTR, True)
            try:
                broker.settle(message.queue_name, message, "requeue")
            except Exception:
                self.logger.exception(
                    "could not return task %s to its queue; it comes back after the heartbeat timeout",
                    message.message_id,
                )
        self.logger.warning(
            "shutdown: %d task(s) still running at the drain timeout went back to their queues: %s",
            len(unfinished),
            ", ".join(f"{m.actor_name}/{m.message_id}" for m in unfinished),
        )


def _address(client: redis.Redis) -> str:
    """The Redis address of ``client``, without its password."""
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    return f"redis://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
