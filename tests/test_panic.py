"""Whatever a handler raises is a retried failure; worker threads never die of it."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import dramatiq
import pytest

import dramatiq_gp as gp
from helpers import wait_for

pytestmark = pytest.mark.usefixtures("broker")  # each test on Redis and on RabbitMQ


@gp.event("test.panic.boom")
@dataclass(frozen=True)
class Boom:
    kind: str


def _raise(kind: str) -> None:
    if kind == "exit":
        sys.exit(3)
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "recursion":

        def deeper(n: int) -> int:
            return deeper(n + 1) + 1

        deeper(0)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["exit", "interrupt", "recursion", "plain"])
def test_any_raise_is_a_retried_failure_and_the_pool_keeps_its_threads(kind, make_kit, start_worker):
    attempts: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def handler(event: Boom) -> None:
        with lock:
            attempts.append(event.kind)
            first = len(attempts) == 1
        if first:
            _raise(event.kind)

    class Capture(dramatiq.Middleware):
        def after_process_message(self, broker, message, *, result=None, exception=None):
            if exception is not None:
                errors.append(exception)

    kit = make_kit(
        lambda registry, schedule: registry.listen(Boom, handler),
        env={"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"},
        middleware=[Capture()],
    )
    worker = start_worker(kit, threads=3)
    kit.dispatch(Boom(kind))
    wait_for(lambda: len(attempts) == 2)
    assert attempts == [kind, kind]
    (error,) = errors
    assert isinstance(error, Exception)
    if kind in ("exit", "interrupt"):
        assert isinstance(error, gp.HandlerPanic)
        assert isinstance(error.__cause__, SystemExit | KeyboardInterrupt)
    assert len(worker.workers) == 3
    assert all(thread.is_alive() for thread in worker.workers)


def test_plain_actors_get_the_same_recovery(make_kit, start_worker):
    kit = make_kit(env={"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"})
    attempts: list[int] = []

    @dramatiq.actor(broker=kit.broker)
    def exits_once() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            sys.exit(1)

    worker = start_worker(kit, threads=2)
    exits_once.send()
    wait_for(lambda: len(attempts) == 2)
    assert all(thread.is_alive() for thread in worker.workers)


class _Fatal(BaseException):
    """Stands for an asynchronous exception that lands outside the handler."""


def test_a_worker_thread_killed_outside_the_handler_is_replaced(make_kit, start_worker):
    class KillsItsThread(dramatiq.Middleware):
        def after_ack(self, broker, message):
            if message.args[0]["data"]["kind"] == "first":
                raise _Fatal()

    handled: list[str] = []
    kit = make_kit(
        lambda registry, schedule: registry.listen(Boom, lambda event: handled.append(event.kind), name="victim"),
        middleware=[KillsItsThread()],
    )
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: None  # the dying thread's traceback is expected
    try:
        worker = start_worker(kit, threads=2)
        original = set(worker.workers)
        kit.dispatch(Boom("first"))
        wait_for(lambda: handled == ["first"])
        wait_for(lambda: any(not t.is_alive() for t in original))
        # The dead one is removed, then its replacement added: wait for both.
        wait_for(lambda: len(worker.workers) == 2 and set(worker.workers) != original, timeout=5)
        assert all(t.is_alive() for t in worker.workers)
    finally:
        threading.excepthook = previous_hook
    kit.dispatch(Boom("second"))
    wait_for(lambda: handled == ["first", "second"])
