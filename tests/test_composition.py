"""Dramatiq's results, pipelines and groups on the kit's brokers, with the kit's whole middleware list."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import dramatiq
import pytest
import redis
from dramatiq import group, pipeline
from dramatiq.middleware import GroupCallbacks
from dramatiq.rate_limits.backends import RedisBackend as RateLimiterBackend
from dramatiq.results import ResultFailure, Results
from dramatiq.results.backends import RedisBackend

from helpers import wait_for

TIMEOUT_MS = 10_000


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """Requested before ``start_worker``, so it is closed after the worker stops."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.mark.usefixtures("broker")
def test_results_pipelines_and_groups_work_as_in_dramatiq(client, make_kit, start_worker, namespace):
    # Results under the test's namespace, so they are deleted with it; a barrier expires on its own.
    results = RedisBackend(client=client, namespace=f"{namespace}:results", use_namespace_prefix_keys=True)
    kit = make_kit(
        middleware=[Results(backend=results), GroupCallbacks(RateLimiterBackend(client=client), barrier_ttl=60_000)]
    )
    completed = threading.Event()

    @dramatiq.actor(broker=kit.broker, actor_name="add", store_results=True)
    def add(x: int, y: int = 0) -> int:
        return x + y

    @dramatiq.actor(broker=kit.broker, actor_name="refuse", store_results=True, max_retries=0)
    def refuse() -> None:
        raise ValueError("refused")

    @dramatiq.actor(broker=kit.broker, actor_name="group_done")
    def group_done() -> None:
        completed.set()

    sent = add.send(1, 2)
    refused = refuse.send()
    piped = pipeline([add.message(1, 2), add.message(3)], broker=kit.broker).run()
    grouped = group([add.message(n, n) for n in range(3)], broker=kit.broker)
    grouped.add_completion_callback(group_done.message())
    grouped.run()
    start_worker(kit)

    assert sent.get_result(backend=results, block=True, timeout=TIMEOUT_MS) == 3
    with pytest.raises(ResultFailure, match="refused"):
        refused.get_result(backend=results, block=True, timeout=TIMEOUT_MS)
    assert piped.get_result(block=True, timeout=TIMEOUT_MS) == 6  # (1 + 2) piped into add(3, ...)
    assert list(grouped.get_results(block=True, timeout=TIMEOUT_MS)) == [0, 2, 4]
    wait_for(completed.is_set)
