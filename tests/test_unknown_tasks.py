"""Messages for task types nobody handles are skipped with one warning, not dead-lettered or looped."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import dramatiq
import pytest
from dramatiq import Message

import dramatiq_gp as gp
from helpers import messages_of, wait_for


@gp.event("test.unknown.known")
@dataclass(frozen=True)
class Known:
    n: int


def _orphan(actor_name: str, queue: str = "default") -> Message:
    return Message(
        queue_name=queue,
        actor_name=actor_name,
        args=({"id": "x", "event": "e", "data": {}},),
        kwargs={},
        options={},
    )


def test_unknown_task_types_are_acked_and_skipped_with_one_warning_per_type(
    make_kit, start_worker, rdb, namespace, caplog
):
    kit = make_kit(
        lambda registry, schedule: registry.listen(Known, lambda e: None, name="stays"),
        env={"WORKER_UNKNOWN_TASK_GRACE": "0"},
    )
    for _ in range(3):
        kit.broker.enqueue(_orphan("listener:test.unknown.known:removed"))
    kit.broker.enqueue(_orphan("listener:test.unknown.known:also_removed"))
    caplog.set_level(logging.INFO)
    start_worker(kit)
    wait_for(lambda: rdb.hlen(f"{namespace}:default.msgs") == 0)
    time.sleep(0.2)
    warnings = messages_of(caplog, "", logging.WARNING)
    assert len(warnings) == 2, warnings
    assert (
        "'listener:test.unknown.known:removed'" in warnings[0] or "'listener:test.unknown.known:removed'" in warnings[1]
    )
    assert all("no handler registered" in w for w in warnings)
    assert rdb.zcard(f"{namespace}:default.XQ") == 0
    assert messages_of(caplog, "dramatiq", logging.ERROR) == []


def test_an_unknown_task_is_held_through_the_grace_period_for_a_worker_that_knows_it(
    make_kit, start_worker, rdb, namespace
):
    kit = make_kit(
        lambda registry, schedule: registry.listen(Known, lambda e: None, name="stays"),
        env={"WORKER_UNKNOWN_TASK_GRACE": "4s"},
    )
    runs: list[Known] = []
    newer = gp.Registry()
    newer.listen(Known, runs.append, name="added")
    (message,) = newer.fan_out(Known(3), "rolling-deploy")
    kit.broker.enqueue(message)
    start_worker(kit)
    wait_for(lambda: rdb.hlen(f"{namespace}:default.DQ.msgs") == 1)
    assert runs == []
    # A newer deploy brings the listener; the held message is delivered to it.
    kit.registry.listen(Known, runs.append, name="added")
    wait_for(lambda: runs == [Known(3)], timeout=10)


def test_after_the_grace_period_an_unknown_task_is_skipped(make_kit, start_worker, rdb, namespace, caplog):
    kit = make_kit(
        lambda registry, schedule: registry.listen(Known, lambda e: None, name="stays"),
        env={"WORKER_UNKNOWN_TASK_GRACE": "300ms"},
    )
    caplog.set_level(logging.INFO)
    kit.broker.enqueue(_orphan("listener:test.unknown.known:gone"))
    start_worker(kit)
    wait_for(lambda: any("no handler registered" in m for m in messages_of(caplog, "", logging.WARNING)), timeout=5)
    wait_for(lambda: rdb.hlen(f"{namespace}:default.msgs") + rdb.hlen(f"{namespace}:default.DQ.msgs") == 0)
    assert any("holding its messages" in m for m in messages_of(caplog, "dramatiq_gp", logging.INFO))
    assert rdb.zcard(f"{namespace}:default.XQ") == 0


@pytest.mark.parametrize(
    "garbage",
    [b"\x00\xffnot json", b'{"queue_name": "default"}', b'{"queue_name": "default", "actor_name": "noop", "args": 5}'],
    ids=["bytes", "missing-fields", "wrong-shape"],
)
def test_a_message_that_cannot_be_decoded_is_dead_lettered_and_stalls_nothing(
    make_kit, start_worker, rdb, namespace, caplog, garbage
):
    kit = make_kit()
    done: list[int] = []
    actor = dramatiq.actor(done.append, broker=kit.broker, actor_name="noop", queue_name="default")
    actor.send(1)
    rdb.rpush(f"{namespace}:default", "garbage-id")
    rdb.hset(f"{namespace}:default.msgs", "garbage-id", garbage)
    actor.send(2)
    with caplog.at_level(logging.ERROR):
        start_worker(kit)
        wait_for(lambda: sorted(done) == [1, 2])
    assert rdb.zscore(f"{namespace}:default.XQ", "garbage-id") is not None
    assert rdb.hexists(f"{namespace}:default.XQ.msgs", "garbage-id")
    assert not any(rdb.sismember(key, "garbage-id") for key in rdb.scan_iter(f"{namespace}:__acks__.*"))
    (line,) = [m for m in messages_of(caplog, "dramatiq_gp.broker", logging.ERROR) if "cannot decode" in m]
    assert "moved to the dead-letter set" in line
