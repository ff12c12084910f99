"""Dramatiq's ``test_exception_from_actor_doesnt_leak`` on the kit's broker with Sentry on.

Run as ``python -m tests.apps.exception_leak`` with ``REDIS_URL``, ``VALKEY_NAMESPACE``
and ``SENTRY_DSN`` set; prints how many exceptions were raised, how many are still
alive with the cyclic garbage collector off, and how many Sentry events were sent.
"""

from __future__ import annotations

import gc
import json
import logging
import weakref

import dramatiq
import sentry_sdk

import dramatiq_gp as gp

logging.basicConfig(level=logging.CRITICAL)  # a captured log record would hold the exception
raised: list[weakref.ref[Exception]] = []


class CustomError(Exception):
    def __init__(self) -> None:
        super().__init__()
        raised.append(weakref.ref(self))


kit = gp.Kit(registry=gp.Registry())


@dramatiq.actor(broker=kit.broker, max_retries=1, min_backoff=1, max_backoff=1)
def failing_actor() -> None:
    raise CustomError()


events = 0


def count(event: object, hint: object) -> None:
    global events
    events += 1
    return None  # nothing needs to leave: the count is the point


kit.broker.emit_after("process_boot")
sentry_sdk.get_client().options["before_send"] = count
gc.disable()  # an exception in a reference cycle now stays alive
worker = dramatiq.Worker(kit.broker, worker_threads=1, worker_timeout=10)
worker.start()
failing_actor.send()
kit.broker.join(failing_actor.queue_name)
worker.join()
worker.stop()
print(json.dumps({"raised": len(raised), "alive": sum(ref() is not None for ref in raised), "events": events}))
