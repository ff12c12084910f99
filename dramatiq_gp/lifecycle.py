"""The worker's start-up and shutdown order (SPEC section 1), driven by Dramatiq's hooks.

Start-up: telemetry and the register callback run when the :class:`~dramatiq_gp.Kit`
is built (the dramatiq CLI imports it in each worker process); then, from
``after_process_boot``, the broker is pinged (exit code 3 with a one-line error if
it does not answer); then Dramatiq starts the consumers and the kit logs what runs.

Shutdown on SIGTERM/SIGINT: ``before_worker_shutdown`` stops the producers;
Dramatiq drains in-flight tasks for up to ``WORKER_SHUTDOWN_TIMEOUT``;
``after_worker_shutdown`` puts back what did not finish, runs the closers LIFO
(the kit's own first, then the application's) and flushes telemetry. Each step
is logged once at INFO.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

from dramatiq import Broker, Middleware, Worker
from dramatiq.broker import MessageProxy
from dramatiq.cli import RET_CONNECT

from . import broker as gp_broker
from .durations import format_duration
from .errors import BrokerUnreachable
from .telemetry import Telemetry

Closer = Callable[[], object]


class Producer(Protocol):
    """Something that puts work on the queues from its own thread: the relay, the schedule runner."""

    name: str

    def start(self) -> None: ...

    def stop(self) -> None: ...


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
    """Start-up checks, drain bookkeeping and ordered shutdown for one worker process.

    Parameters:
        telemetry: started at process boot, flushed last at shutdown.
        check_connection: pings the broker; raises :class:`BrokerUnreachable`.
        producers: started with the consumers, stopped first at shutdown.
        closers: run after the drain.
        shutdown_timeout_ms: the drain limit; ``None`` keeps the CLI's.
    """

    def __init__(
        self,
        *,
        telemetry: Telemetry,
        check_connection: Callable[[], None],
        producers: Sequence[Producer],
        closers: Closers,
        shutdown_timeout_ms: int | None,
    ) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.telemetry = telemetry
        self.check_connection = check_connection
        self.producers = producers
        self.closers = closers
        self.shutdown_timeout_ms = shutdown_timeout_ms
        self._in_flight: dict[int, MessageProxy] = {}
        self._drain_timeout_ms = 600_000

    def after_process_boot(self, broker: Broker) -> None:
        # Here, in the worker process and after the fork, not when the app is imported.
        self.telemetry.start()
        try:
            self.check_connection()
        except BrokerUnreachable as exc:
            self.logger.error("start-up failed: %s", exc)
            # SystemExit passes through Dramatiq's hook runner and ends this process
            # with the CLI's "broker connection failed" code.
            raise SystemExit(RET_CONNECT) from None

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
        for producer in self.producers:
            producer.start()
            self.logger.info("start-up: %s started", producer.name)

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

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._in_flight.pop(threading.get_ident(), None)

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        names = ", ".join(producer.name for producer in self.producers) or "none running"
        self.logger.info("shutdown: stopping producers (%s)", names)
        for producer in self.producers:
            producer.stop()
        self.logger.info(
            "shutdown: draining in-flight tasks (up to %s)",
            format_duration(timedelta(milliseconds=self._drain_timeout_ms)),
        )

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._return_unfinished(broker)
        self.logger.info("shutdown: running closers")
        self.closers.run(self.logger)
        self.logger.info("shutdown: flushing telemetry")
        self.telemetry.flush()

    def _return_unfinished(self, broker: Broker) -> None:
        unfinished = list(self._in_flight.values())
        if not unfinished:
            self.logger.info("shutdown: in-flight tasks drained")
            return
        assert isinstance(broker, gp_broker.Broker)
        for message in unfinished:
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
