"""A relay process for the outbox benchmarks (``python -m benchmarks.outbox_child <mode>``).

``drain``: the kit's relay until nothing is pending. ``naive``: the same rows, one
``enqueue`` round trip per event (the baseline). ``serve``: the relay thread until
stdin closes, recording when each event was enqueued. ``drain`` and ``naive`` wait
for the Redis key ``<namespace>:bench:go`` so that several start together, and
print one JSON line: when they found their first row, when they finished, how
many rows they handled, and the CPU seconds the process used in between.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import sqlalchemy as sa
from dramatiq import Message

import dramatiq_gp as gp
from benchmarks import outbox_common  # noqa: F401  (declares the event type)
from dramatiq_gp.names import EVENT_QUEUE, event_actor
from dramatiq_gp.outbox import OUTBOX_EVENTS

T = OUTBOX_EVENTS.c


def naive_once(kit: gp.Kit, batch: int) -> int:
    """The obvious relay: one round trip to Redis per event."""
    assert kit.engine is not None
    with kit.engine.begin() as conn:
        rows = conn.execute(
            sa.select(T.id, T.event, T.payload)
            .where(T.published_at.is_(None), T.failed_at.is_(None))
            .order_by(T.available_at)
            .limit(batch)
            .with_for_update(skip_locked=True)
        ).all()
        for row in rows:
            envelope = {"id": str(row.id), "event": row.event, "data": row.payload}
            message = Message(
                queue_name=EVENT_QUEUE,
                actor_name=event_actor(row.event),
                args=(envelope,),
                kwargs={},
                options={},
                message_id=str(row.id),
            )
            kit.broker.enqueue(message)
        if rows:
            conn.execute(
                sa.update(OUTBOX_EVENTS).where(T.id.in_([r.id for r in rows])).values(published_at=sa.func.now())
            )
    return len(rows)


def main(mode: str) -> None:
    kit = gp.Kit(registry=gp.Registry())
    assert kit.relay is not None and kit.engine is not None
    if mode == "serve":
        enqueued: list[tuple[str, float]] = []
        enqueue_many = kit.broker.enqueue_many

        def recording(messages: Any, **options: Any) -> Any:
            sent = enqueue_many(messages, **options)
            now = time.time()
            enqueued.extend((m.message_id, now) for m in messages)
            return sent

        kit.broker.enqueue_many = recording  # type: ignore[method-assign]
        kit.relay.start()
        print("ready", flush=True)
        sys.stdin.read()  # until the parent closes our stdin
        kit.relay.stop()
        with open(os.environ["GP_BENCH_RECORD"], "w") as file:
            json.dump(enqueued, file)
        return

    step = (
        (lambda: kit.relay.relay_batches())
        if mode == "drain"
        else (lambda: naive_once(kit, kit.settings.outbox.batch_size))
    )
    go = f"{kit.broker.namespace}:bench:go"
    print("ready", flush=True)
    while not kit.broker.client.exists(go):
        time.sleep(0.001)
    first, cpu = time.time(), time.process_time()
    handled = 0
    while True:
        n = step()
        if not n:
            break
        handled += n
    report = {"first": first, "done": time.time(), "handled": handled, "cpu": time.process_time() - cpu}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
