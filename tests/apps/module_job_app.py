"""A worker app whose only work is a module-level ``@gp.job``, built with the Kit or as a middleware list.

Run as ``dramatiq tests.apps.module_job_app`` with ``REDIS_URL``, ``VALKEY_NAMESPACE``
and ``GP_TEST_STYLE`` (``kit`` or ``middleware``); each run of the job counts
itself in ``<namespace>:test:ticks`` and writes how many objects the process has frozen out of
garbage collection (``gp.GcFreeze``) to ``<namespace>:test:frozen`` and its young generation's
threshold to ``<namespace>:test:young``; the ``async def`` one counts
itself in ``<namespace>:test:async_ticks``.
"""

from __future__ import annotations

import asyncio
import gc
import os

import dramatiq
import redis

import dramatiq_gp as gp

namespace = os.environ["VALKEY_NAMESPACE"]
counter = redis.Redis.from_url(os.environ["REDIS_URL"])


@gp.job("test.module.tick", every="1s")
def tick() -> None:
    counter.set(f"{namespace}:test:frozen", gc.get_freeze_count())
    counter.set(f"{namespace}:test:young", gc.get_threshold()[0])
    counter.incr(f"{namespace}:test:ticks")


@gp.job("test.module.async_tick", every="1s")
async def async_tick() -> None:
    await asyncio.sleep(0)
    counter.incr(f"{namespace}:test:async_ticks")


if os.environ["GP_TEST_STYLE"] == "kit":
    broker = gp.Kit(registry=gp.Registry()).broker
else:
    broker = gp.RedisBroker(url=os.environ["REDIS_URL"], namespace=namespace, middleware=gp.default_middleware())
    dramatiq.set_broker(broker)
