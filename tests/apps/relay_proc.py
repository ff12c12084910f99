"""A relay-only process for the multi-process outbox tests and benchmarks.

    python -m tests.apps.relay_proc drain   relay until nothing is pending, then exit
    python -m tests.apps.relay_proc serve   run the relay thread until SIGTERM

Reads REDIS_URL, DB_URL, VALKEY_NAMESPACE and OUTBOX_* like a worker. With
GP_TEST_PAUSE_AFTER_ENQUEUE (seconds) it pauses between enqueueing a batch and
committing it, to widen the window a kill -9 must hit to cause duplicates.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import dramatiq_gp as gp
from tests.apps import app_events  # noqa: F401  (the relay must know the event types)


def main(mode: str) -> None:
    kit = gp.Kit(registry=gp.Registry())
    assert kit.relay is not None, "set DB_URL"
    pause = float(os.environ.get("GP_TEST_PAUSE_AFTER_ENQUEUE", "0"))
    if pause:
        enqueue_many = kit.broker.enqueue_many

        def enqueue_then_pause(messages: Any, **options: Any) -> Any:
            sent = enqueue_many(messages, **options)
            time.sleep(pause)
            return sent

        kit.broker.enqueue_many = enqueue_then_pause  # type: ignore[method-assign]
    print("relay ready", flush=True)
    if mode == "drain":
        idle = 0
        while idle < 3:
            if kit.relay.relay_batches():
                idle = 0
            else:
                idle += 1
                time.sleep(0.1)
        return
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    kit.relay.start()
    stop.wait()
    kit.relay.stop()
    kit.relay.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "drain")
