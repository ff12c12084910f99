"""The application the ``default`` and ``bare_default`` variants of the overhead benchmark run.

The driver (:mod:`benchmarks.overhead`) starts it as a user would:
``dramatiq -p 1 -t 8 benchmarks.overhead_app --log-file F``, with the variant in
``GPBENCH_VARIANT`` and its Redis keys under ``VALKEY_NAMESPACE``. ``default`` is
the kit at its defaults (``gp.Kit()``: INFO task log, the kit's own prefetch);
``bare_default`` stock Dramatiq's ``RedisBroker``. One no-op actor, ``noop``, on
the queue ``bench``. ``python -m benchmarks.overhead_app N`` puts ``N`` messages on
that queue, before the worker starts.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import dramatiq

from benchmarks.overhead_worker import QUEUE, _fill

VARIANT = os.environ.get("GPBENCH_VARIANT", "default")

broker: Any
if VARIANT == "bare_default":
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=os.environ["REDIS_URL"], namespace=os.environ["VALKEY_NAMESPACE"])
    dramatiq.set_broker(broker)
else:
    import dramatiq_gp as gp

    kit = gp.Kit()
    broker = kit.broker


@dramatiq.actor(broker=broker, queue_name=QUEUE, actor_name="noop")
def noop(n: int) -> None:
    pass


if __name__ == "__main__":
    _fill(broker, [noop.message(n) for n in range(int(sys.argv[1]))])
    broker.close()
