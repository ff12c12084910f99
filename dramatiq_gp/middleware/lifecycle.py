"""The worker's start-up and shutdown order (docs/lifecycle.md), driven by Dramatiq's hooks.

Start-up: telemetry and the register callback run when the application module
is imported (the dramatiq CLI imports it in each worker process); then, from
``after_process_boot``, telemetry starts and the broker is pinged (exit code 3
with a one-line error if it does not answer); then Dramatiq starts the consumers
and this middleware logs what runs, and the producers (the schedule's
:class:`~dramatiq_gp.SchedulerLease`, the :class:`~dramatiq_gp.OutboxRelay`)
start from their own ``after_worker_boot``.

Shutdown on SIGTERM/SIGINT starts in the signal handler, so the whole stop fits
``WORKER_SHUTDOWN_TIMEOUT`` counted from the signal (see :meth:`Lifecycle.take_over_stop_signal`):
the producers (:class:`Producer`) start stopping on threads of their own, in
their ``before_worker_shutdown``, beside the drain; Dramatiq drains in-flight
tasks (``async def`` ones too: their worker threads wait for them) until the
deadline, and the consumers, woken, end their wait for messages at once;
``after_worker_shutdown`` puts back what did not finish, cancels the coroutines
among it (Dramatiq's ``AsyncIO`` middleware, listed before this one, stops its
loop after), waits for the producers, runs the closers LIFO (the kit's own
first, then the application's) and flushes telemetry. Each step is logged once
at INFO.

Dramatiq internals relied on (pinned in ``tests/test_dramatiq_internals.py``):
the worker process's SIGTERM handler is ``dramatiq.cli.worker_process``'s
``termhandler``, and that function's frame holds ``args``
(``worker_shutdown_timeout``), ``worker`` and ``broker`` while it waits for the
signal; ``ConsumerThread.stop()`` and its ``consumer`` attribute.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from types import FrameType
from typing import Any

import redis
from dramatiq import ActorNotFound, Broker, Middleware, Worker, cli
from dramatiq.broker import MessageProxy
from dramatiq.cli import RET_CONNECT, RET_IMPORT
from dramatiq.middleware import TimeLimit
from dramatiq.worker import ConsumerThread

from ..aio import CANCEL_WAIT_S, cancel_coroutines
from ..brokers.base import KitBroker
from ..durations import format_duration
from ..errors import BrokerUnreachable, UnsafeDirectory
from ..health import WEDGED_AFTER_S, HealthCheck, Monitor
from ..names import is_delay_queue
from ..telemetry import Telemetry

Closer = Callable[[], object]

#: Set on a message put back at the drain timeout: its attempt ends later (a cancelled coroutine), and is no failure.
PUT_BACK_ATTR = "_gp_put_back"

#: A stop signal this soon after the first is the same stop delivered twice: to the whole process group
#: (systemd's default KillMode, ``kill -TERM -<pgid>``) and forwarded by the ``dramatiq`` parent. Later,
#: a second signal kills the process at once, as in Dramatiq.
DUPLICATE_SIGNAL_S = 1.0

#: How long past the drain deadline the producers may still take to stop before the closers run without them.
PRODUCER_MARGIN_S = 0.2

#: How long a producer's own ``after_worker_shutdown`` waits for its stop, in a list without :class:`Lifecycle`.
STOP_WAIT_S = 30.0


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


class Producer(Middleware):
    """A middleware whose thread sends messages (the schedule runner, the outbox relay); it stops beside the drain.

    ``before_worker_shutdown`` starts :meth:`stop_producing` on a thread of its own
    and returns, so in-flight tasks start draining at once instead of after it;
    :class:`Lifecycle` waits for that thread before the closers, up to the drain
    deadline (plus :data:`PRODUCER_MARGIN_S`), since they close what it uses.
    """

    name = "producer"
    logger: logging.Logger
    _stopping: threading.Thread | None = None

    def producing(self) -> bool:
        """Whether this process started one, so that there is something to stop."""
        raise NotImplementedError

    def stop_producing(self) -> None:
        raise NotImplementedError

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        if not self.producing():
            return
        self.logger.info("shutdown: stopping %s", self.name)
        self._stopping = threading.Thread(target=self._stop, name=f"gp-stop-{self.name}", daemon=True)
        self._stopping.start()

    def _stop(self) -> None:
        try:
            self.stop_producing()
        except Exception:
            self.logger.exception("shutdown: %s failed to stop cleanly", self.name)
        else:
            self.logger.info("shutdown: %s stopped", self.name)

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        # Lifecycle's own hook (run before this one) has waited; without it, nothing else would.
        if not any(isinstance(m, Lifecycle) for m in broker.middleware):
            self.join(STOP_WAIT_S)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the stop; whether it has ended."""
        if self._stopping is None:
            return True
        self._stopping.join(max(0.0, timeout))
        return not self._stopping.is_alive()


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

    It also judges the process's health (:mod:`dramatiq_gp.health`): alive unless a
    thread stopped or a task ran well past its time limit; ready once booted, while
    Redis/Valkey, the broker and every health check answer, and until the drain starts.

    Parameters:
        telemetry: started at process boot, flushed last at shutdown.
        shutdown_timeout_ms: the drain limit (``WORKER_SHUTDOWN_TIMEOUT``); ``None``
            keeps the dramatiq CLI's ``--worker-shutdown-timeout``.
        display: how to name the broker's address in logs (passwords hidden).
        health_checks: the application's checks (the seed's ``HealthCheckFunc``): each a
            function, or a ``(name, function)`` pair, healthy unless it raises or returns ``False``.
        health_interval: how often the checks run and the health is reported (``WORKER_HEALTH_INTERVAL``).
        health_port: serve ``/livez`` and ``/readyz`` there (``WORKER_HEALTH_PORT``), on ``health_host``.
    """

    def __init__(
        self,
        *,
        telemetry: Telemetry | None = None,
        shutdown_timeout_ms: int | None = None,
        display: str | None = None,
        health_checks: Iterable[HealthCheck | tuple[str, HealthCheck]] = (),
        health_interval: timedelta = timedelta(seconds=5),
        health_port: int | None = None,
        health_host: str = "0.0.0.0",
    ) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.telemetry = telemetry
        self.shutdown_timeout_ms = shutdown_timeout_ms
        self.display = display
        self.closers = Closers()
        self.health_checks: list[tuple[str, HealthCheck]] = [
            check if isinstance(check, tuple) else (getattr(check, "__name__", repr(check)), check)
            for check in health_checks
        ]
        self.health_interval, self.health_port, self.health_host = health_interval, health_port, health_host
        self.health: Monitor | None = None
        #: Thread → the message it runs and when it started (monotonic), for the drain and the health.
        self._in_flight: dict[int, tuple[MessageProxy, float]] = {}
        self._drain_timeout_ms = 600_000
        self._signalled_at: float | None = None
        self._drain_deadline: float | None = None

    def with_closer(self, name: str, close: Closer) -> Lifecycle:
        """Run ``close()`` at shutdown, after in-flight tasks drained (last added, first run)."""
        self.closers.app.append((name, close))
        return self

    def with_health_check(self, name: str, check: HealthCheck) -> Lifecycle:
        """Count this process ready only while ``check()`` returns without raising (and not ``False``)."""
        self.health_checks.append((name, check))
        return self

    def after_process_boot(self, broker: Broker) -> None:
        # Here, in the worker process and after the fork, not when the app is imported.
        client = getattr(broker, "client", None)
        try:
            if self.telemetry is not None:
                self.telemetry.start()
            self._start_health(broker, client if isinstance(client, redis.Redis) else None)
        except UnsafeDirectory as exc:  # another user's, or open to others: nothing written there
            self.logger.error("start-up failed: %s", exc)
            raise SystemExit(RET_IMPORT) from None
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
        queues = ""
        if isinstance(broker, KitBroker):
            try:
                broker.ping_queues()
            except BrokerUnreachable as exc:
                self.logger.error("start-up failed: %s", exc)
                raise SystemExit(RET_CONNECT) from None
            queues = broker.queues_where()
        if queues:  # the queues are elsewhere; Redis/Valkey keeps the coordination state
            self.logger.info("start-up: broker reachable at %s; Redis/Valkey at %s", queues, where)
        else:
            self.logger.info("start-up: broker reachable at %s", where)

    def _start_health(self, broker: Broker, client: redis.Redis | None) -> None:
        """Report alive and booting from now on; the kit's own checks (Redis, the broker's queues) run first."""
        checks: list[tuple[str, HealthCheck]] = [("redis", client.ping)] if client is not None else []
        if isinstance(broker, KitBroker) and broker.queues_where():
            checks.append(("broker", broker.ping_queues))
        self.health = Monitor(
            namespace=getattr(broker, "namespace", "dramatiq"),
            interval_s=self.health_interval.total_seconds(),
            checks=[*checks, *self.health_checks],
            client=client,
            broker_id=str(getattr(broker, "broker_id", os.getpid())),
            port=self.health_port,
            host=self.health_host,
        )
        self.health.booting()

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        stop = worker.stop

        def stop_with_our_timeout(timeout: int = 600_000) -> None:
            if self.shutdown_timeout_ms is not None:
                timeout = self.shutdown_timeout_ms
            self._drain_timeout_ms = timeout
            # Counted from the stop signal, when there was one: the orchestrator's grace period is.
            started = self._signalled_at if self._signalled_at is not None else time.monotonic()
            self._drain_deadline = started + timeout / 1000
            stop(timeout=max(0, int((self._drain_deadline - time.monotonic()) * 1000)))

        # The dramatiq CLI passes its own --worker-shutdown-timeout; WORKER_SHUTDOWN_TIMEOUT wins.
        worker.stop = stop_with_our_timeout  # type: ignore[method-assign]

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        consumed = sorted(q for q in worker.consumers if not is_delay_queue(q))
        self.logger.info(
            "start-up: consumers started on %s with %d threads",
            ", ".join(consumed) or "no queues",
            len(worker.workers),
        )
        for thread in worker.consumers.values():
            _wake_when_stopped(thread)
        self.take_over_stop_signal()
        if self.health is not None:
            self.health.start(lambda: self._stuck(broker, worker))

    def _stuck(self, broker: Broker, worker: Worker) -> list[str]:
        """Why this process is not alive: a worker or consumer thread that stopped, a task far past its limit."""
        stuck = [
            f"thread {thread.name} stopped"
            for thread in [*worker.workers, *worker.consumers.values()]
            if not thread.is_alive()
        ]
        limits = next((m for m in broker.middleware if isinstance(m, TimeLimit)), None)
        now = time.monotonic()
        for message, started in list(self._in_flight.values()):
            if limits is None:
                break
            try:
                actor = broker.get_actor(message.actor_name)
            except ActorNotFound:
                continue
            # As TimeLimit reads it.
            limit_s = (message.options.get("time_limit") or actor.options.get("time_limit", limits.time_limit)) / 1000
            if now - started > limit_s + WEDGED_AFTER_S:
                stuck.append(
                    f"task {message.actor_name} ({message.message_id}) running for {now - started:.0f} s, "
                    f"past its time limit of {limit_s:g} s"
                )
        return stuck

    def take_over_stop_signal(self) -> None:
        """Stop in the ``dramatiq`` worker process's SIGTERM handler, at once, and only once per stop.

        Dramatiq's handler only ends a loop that checks it once a second, and a
        second signal kills the process: delivered to the process group, a deploy's
        one SIGTERM arrives twice (sent, and forwarded by the ``dramatiq`` parent), and
        the worker died without draining or releasing its lease. Here the first
        signal runs Dramatiq's handler and then the whole stop (``worker.stop`` with
        the CLI's timeout, ``broker.close``) before the process exits; a repeat within
        :data:`DUPLICATE_SIGNAL_S` is ignored, a later one still kills at once.
        Elsewhere (a worker started in code, a handler of the application's) the
        signal is left alone.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGHUP):
            dramatiqs = signal.getsignal(signum)
            if callable(dramatiqs) and getattr(dramatiqs, "__qualname__", "") == _TERMHANDLER:
                signal.signal(signum, self._stop_signal_handler(dramatiqs))

    def _stop_signal_handler(self, dramatiqs: Callable[[int, FrameType | None], Any]) -> Callable[..., None]:
        def on_stop_signal(signum: int, frame: FrameType | None) -> None:
            now = time.monotonic()
            if self._signalled_at is not None:
                if now - self._signalled_at >= DUPLICATE_SIGNAL_S:
                    dramatiqs(signum, frame)  # a second stop: Dramatiq's exits at once
                return
            self._signalled_at = now
            if self.health is not None:
                self.health.draining()
            dramatiqs(signum, frame)  # "Stopping worker process...": its loop will not stop the worker again
            cli_frame = _worker_process_frame(frame)
            if cli_frame is None:
                return
            local = cli_frame.f_locals
            local["worker"].stop(timeout=local["args"].worker_shutdown_timeout)
            local["broker"].close()
            # Ends worker_process from its one-second sleep, as its own return would, with exit code 0.
            raise SystemExit(0)

        return on_stop_signal

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._in_flight[threading.get_ident()] = (message, time.monotonic())

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
        if self.health is not None:
            self.health.draining()
        self.logger.info(
            "shutdown: draining in-flight tasks (up to %s)",
            format_duration(timedelta(milliseconds=self._drain_timeout_ms)),
        )

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._return_unfinished(broker)
        self._wait_for_producers(broker)
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
        if self.health is not None:
            self.health.stop()
        self.logger.info("shutdown: running closers")
        self.closers.run(self.logger)
        if self.telemetry is not None:
            self.logger.info("shutdown: flushing telemetry")
            self.telemetry.flush()

    def _wait_for_producers(self, broker: Broker) -> None:
        deadline = (self._drain_deadline or time.monotonic()) + PRODUCER_MARGIN_S
        for producer in broker.middleware:
            if isinstance(producer, Producer) and not producer.join(deadline - time.monotonic()):
                self.logger.warning(
                    "shutdown: %s still stopping at the drain deadline; closing without it", producer.name
                )

    def _return_unfinished(self, broker: Broker) -> None:
        unfinished = [message for message, _ in self._in_flight.values()]
        if not unfinished:
            self.logger.info("shutdown: in-flight tasks drained")
            return
        if not isinstance(broker, KitBroker):
            self.logger.warning(
                "shutdown: %d task(s) still running at the drain timeout come back after %s's own timeout: %s",
                len(unfinished),
                type(broker).__name__,
                ", ".join(f"{m.actor_name}/{m.message_id}" for m in unfinished),
            )
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


_TERMHANDLER = "worker_process.<locals>.termhandler"


def _worker_process_frame(frame: FrameType | None) -> FrameType | None:
    """The frame of ``dramatiq.cli.worker_process`` waiting for the signal, with its worker built."""
    while frame is not None:
        if frame.f_code is cli.worker_process.__code__:
            return frame if {"args", "worker", "broker"} <= frame.f_locals.keys() else None
        frame = frame.f_back
    return None


def _wake_when_stopped(thread: ConsumerThread) -> None:
    """Make ``thread.stop()`` also end its consumer's wait for messages (a kit consumer's ``wake``).

    Dramatiq stops the consumers after the drain and waits for each to notice, which
    it does when its wait for messages ends: up to ``worker_timeout`` (1 s) later.
    """
    stop = thread.stop

    def stop_and_wake() -> None:
        stop()
        wake = getattr(thread.consumer, "wake", None)
        if wake is not None:
            wake()

    thread.stop = stop_and_wake  # type: ignore[method-assign]


def _address(client: redis.Redis) -> str:
    """The Redis address of ``client``, without its password."""
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    return f"redis://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
