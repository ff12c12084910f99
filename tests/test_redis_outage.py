"""A Redis outage in the middle of the worker's own bookkeeping loses no message."""

from __future__ import annotations

import time

import dramatiq

from helpers import wait_for
from servers import OwnRedis


def test_a_retry_that_comes_due_while_redis_is_down_still_runs(tmp_path, make_kit, start_worker):
    server = OwnRedis(tmp_path / "redis")
    server.start()
    try:
        kit = make_kit(env={"REDIS_URL": server.url, "WORKER_MIN_BACKOFF": "1500ms", "WORKER_MAX_BACKOFF": "1500ms"})
        attempts: list[float] = []

        @dramatiq.actor(broker=kit.broker, actor_name="flaky", max_retries=3)
        def flaky() -> None:
            attempts.append(time.monotonic())
            if len(attempts) == 1:
                raise ConnectionError("the first attempt fails")

        flaky.send()
        start_worker(kit)
        wait_for(lambda: len(attempts) == 1)
        time.sleep(0.3)  # the retry now waits in the delay consumer's memory, due within 1.5 s
        server.restart(down_for=2.5)  # it comes due while Redis is away
        wait_for(lambda: len(attempts) == 2, timeout=30)
    finally:
        server.stop()
