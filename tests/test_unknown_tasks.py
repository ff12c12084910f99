"""Messages for task types nobody handles are held, then dead-lettered with one warning; malformed ones at once;
those for an actor of another queue at once."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import dramatiq
import pytest
import redis
from dramatiq import Message

import dramatiq_gp as gp
from dramatiq_gp.brokers import base
from dramatiq_gp.brokers.kinds import view_for
from dramatiq_gp.status import skipped_status
from helpers import dead, messages_of, wait_for


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


def test_unknown_task_types_are_dead_lettered_with_the_reason_and_one_warning_per_type(
    make_kit, start_worker, rdb, namespace, caplog
):
    kit = make_kit(
        lambda registry, schedule: registry.listen(Known, lambda e: None, name="stays"),
        env={"WORKER_UNKNOWN_TASK_GRACE": "0"},
    )
    removed, also_removed = "listener:test.unknown.known:removed", "listener:test.unknown.known:also_removed"
    for _ in range(3):
        kit.broker.enqueue(_orphan(removed))
    kit.broker.enqueue(_orphan(also_removed))
    caplog.set_level(logging.INFO)
    start_worker(kit)
    wait_for(lambda: rdb.zcard(f"{namespace}:default.XQ") == 4)
    time.sleep(0.2)
    warnings = messages_of(caplog, "", logging.WARNING)
    assert len(warnings) == 2, warnings
    assert all("no handler registered" in w for w in warnings)
    assert sorted(w.split("task type ")[1].split(" ")[0] for w in warnings) == sorted(
        [repr(also_removed), repr(removed)]
    )
    assert messages_of(caplog, "dramatiq", logging.ERROR) == []
    # Kept for inspection, each with why it is there, and counted for `dramatiq-gp status`.
    assert rdb.hlen(f"{namespace}:default.msgs") == 0
    kept = [Message.decode(data.encode()) for data in rdb.hvals(f"{namespace}:default.XQ.msgs")]
    assert sorted(m.actor_name for m in kept) == sorted([removed] * 3 + [also_removed])
    for message in kept:
        assert f"no handler for task type {message.actor_name!r}" in message.options["gp_dead_letter_reason"]
    assert skipped_status(rdb, namespace) == {also_removed: 1, removed: 3}
    assert 0 < rdb.pttl(f"{namespace}:gp:skipped") <= kit.broker.dead_message_ttl


def test_status_shows_the_skipped_task_types(make_kit, start_worker, rdb, namespace, redis_url):
    kit = make_kit(
        lambda registry, schedule: registry.listen(Known, lambda e: None, name="stays"),
        env={"WORKER_UNKNOWN_TASK_GRACE": "0"},
    )
    kit.broker.enqueue(_orphan("listener:test.unknown.known:gone"))
    start_worker(kit)
    wait_for(lambda: rdb.zcard(f"{namespace}:default.XQ") == 1)
    env = {**os.environ, "REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace}
    env.pop("DB_URL", None)
    text = subprocess.run([sys.executable, "-m", "dramatiq_gp", "status"], env=env, capture_output=True, text=True)
    assert text.returncode == 0, text.stderr
    assert "skipped (no handler, kept as dead letters): listener:test.unknown.known:gone: 1" in text.stdout
    assert "queue default: 0 ready, 0 in flight, 0 delayed, 1 dead" in text.stdout
    report = subprocess.run([sys.executable, "-m", "dramatiq_gp", "status", "--json"], env=env, capture_output=True)
    assert json.loads(report.stdout)["skipped_task_types"] == {"listener:test.unknown.known:gone": 1}


def test_join_returns_while_only_held_messages_remain(make_kit, start_worker, rdb, namespace):
    kit = make_kit(lambda registry, schedule: registry.listen(Known, lambda e: None, name="stays"))
    runs: list[int] = []
    dramatiq.actor(runs.append, broker=kit.broker, actor_name="known_actor", queue_name="default").send(1)
    kit.broker.enqueue(_orphan("listener:test.unknown.known:later"))  # held for the default five minutes
    start_worker(kit)
    started = time.monotonic()
    kit.broker.join("default", timeout=15_000)
    assert time.monotonic() - started < 15
    assert runs == [1]
    wait_for(lambda: rdb.hlen(f"{namespace}:default.DQ.msgs") == 1)
    (held,) = rdb.hvals(f"{namespace}:default.DQ.msgs")
    assert Message.decode(held.encode()).actor_name == "listener:test.unknown.known:later"
    # Anything else still pending is waited for.
    dramatiq.actor(lambda: time.sleep(1), broker=kit.broker, actor_name="slow_actor", queue_name="default").send()
    started = time.monotonic()
    kit.broker.join("default", timeout=15_000)
    assert time.monotonic() - started >= 0.5


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
    (kept,) = rdb.hvals(f"{namespace}:default.XQ.msgs")
    assert "within 300ms" in Message.decode(kept.encode()).options["gp_dead_letter_reason"]


def _raw(actor_name: str, **fields: object) -> bytes:
    message = {
        "queue_name": "default",
        "actor_name": actor_name,
        "args": [],
        "kwargs": {},
        "options": {},
        "message_id": "m-1",
        "message_timestamp": 1,
    }
    message.update(fields)
    return json.dumps(message).encode()


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\xffnot json",
        b'{"queue_name": "default"}',
        b'{"queue_name": "default", "actor_name": "noop", "args": 5}',
        _raw("noop"),
        _raw("listener:test.unknown.known:gone"),
        _raw("noop", options={"redis_message_id": "garbage-id"}, message_id=7),
        _raw("noop", options=["redis_message_id"]),
        _raw("noop", options={"redis_message_id": "garbage-id", "retries": "abc"}),
        _raw("noop", options={"redis_message_id": "garbage-id", "time_limit": "abc"}),
        _raw("noop", options={"redis_message_id": "garbage-id", "max_retries": True}),
        _raw("noop", options={"redis_message_id": "another-id"}),
        _raw("noop", queue_name="elsewhere", options={"redis_message_id": "garbage-id"}),
    ],
    ids=[
        "bytes",
        "missing-fields",
        "wrong-shape",
        "no-redis-id",
        "unknown-type-no-redis-id",
        "int-id",
        "options-list",
        "retries-string",
        "time-limit-string",
        "max-retries-bool",
        "not-its-redis-id",
        "not-its-queue",
    ],
)
def test_a_message_that_cannot_be_decoded_or_is_malformed_is_dead_lettered_and_stalls_nothing(
    make_kit, start_worker, rdb, namespace, redis_url, caplog, garbage
):
    kit = make_kit(env={"WORKER_UNKNOWN_TASK_GRACE": "0"})
    done: list[int] = []
    actor = dramatiq.actor(done.append, broker=kit.broker, actor_name="noop", queue_name="default")
    # Fetched in one batch with the garbage: they must run all the same.
    for n in (1, 2, 3):
        actor.send(n)
    rdb.rpush(f"{namespace}:default", "garbage-id")
    rdb.hset(f"{namespace}:default.msgs", "garbage-id", garbage)
    for n in (4, 5, 6):
        actor.send(n)
    with caplog.at_level(logging.ERROR):
        start_worker(kit)
        wait_for(lambda: sorted(done) == [1, 2, 3, 4, 5, 6])
    assert rdb.zscore(f"{namespace}:default.XQ", "garbage-id") is not None
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.hget(f"{namespace}:default.XQ.msgs", "garbage-id") == garbage  # kept as it came
    assert not any(rdb.sismember(key, "garbage-id") for key in rdb.scan_iter(f"{namespace}:__acks__.*"))
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    (line,) = [r.getMessage() for r in errors]
    assert "malformed" in line and "moved to the dead-letter set" in line
    assert "as garbage-id" in line  # where to find it
    assert garbage.decode(errors="ignore") not in line and "not json" not in line  # the bytes stay out of the logs
    assert all(r.exc_info is None for r in errors)


def test_a_message_naming_a_running_messages_redis_id_is_set_aside_and_leaves_that_message_alone(
    make_kit, start_worker, rdb, namespace, caplog
):
    """Settled by the id in its data, it acked the running one: a kill -9 then lost that one."""
    kit = make_kit()
    running, release, done = threading.Event(), threading.Event(), []

    def slow(n: int) -> None:
        running.set()
        release.wait(10)
        done.append(n)

    slow_actor = dramatiq.actor(slow, broker=kit.broker, actor_name="slow", queue_name="default")
    dramatiq.actor(done.append, broker=kit.broker, actor_name="noop", queue_name="default")
    start_worker(kit)
    rid = slow_actor.send(1).options["redis_message_id"]
    assert running.wait(10)

    with caplog.at_level(logging.ERROR):
        rdb.hset(f"{namespace}:default.msgs", "impostor", _raw("noop", args=[2], options={"redis_message_id": rid}))
        rdb.rpush(f"{namespace}:default", "impostor")
        wait_for(lambda: rdb.zscore(f"{namespace}:default.XQ", "impostor") is not None)

    # The running message is still stored and held by this worker: a kill -9 now would return it.
    assert rdb.hexists(f"{namespace}:default.msgs", rid)
    assert any(rdb.sismember(key, rid) for key in rdb.scan_iter(f"{namespace}:__acks__.*"))
    assert done == []
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "redis_message_id is not the id it is stored under" in line and "impostor" in line
    release.set()
    wait_for(lambda: done == [1] and not rdb.hexists(f"{namespace}:default.msgs", rid))


def test_join_counts_a_message_behind_any_number_of_held_ones_and_nothing_else(make_kit, rdb, namespace):
    """Each poll stops at the first message that counts; held messages are skipped, however many."""
    kit = make_kit()
    held = _orphan("listener:test.unknown.known:later").copy(options={"gp_unknown_since": 1})
    stored, delayed = f"{namespace}:default.msgs", f"{namespace}:default.DQ.msgs"
    rdb.hset(delayed, mapping={f"held-{n}": held.encode().decode() for n in range(1_000)})
    kit.broker.join("default", timeout=2_000)  # held alone: nothing to wait for

    for where, id in ((stored, "plain"), (delayed, "plain-delayed")):
        rdb.hset(where, id, _raw("noop").decode())
        with pytest.raises(dramatiq.errors.QueueJoinTimeout):
            kit.broker.join("default", timeout=300)
        rdb.hdel(where, id)
    rdb.hset(stored, "garbage", b"\x00not json")  # undecodable: it counts until it is set aside
    with pytest.raises(dramatiq.errors.QueueJoinTimeout):
        kit.broker.join("default", timeout=300)


def test_a_process_remembers_a_bounded_number_of_unknown_task_types_and_logs_each_name_capped(
    make_kit, start_worker, namespace, caplog, monkeypatch
):
    # 1,000 made-up task types of 50 KB each were all kept, and logged whole: 150 MB more in a worker.
    monkeypatch.setattr(base, "WARNED_MAX", 20, raising=False)  # fewer than 1,000, for speed
    kit = make_kit(env={"WORKER_UNKNOWN_TASK_GRACE": "0", "VALKEY_NAMESPACE": namespace})
    names = [f"made-up-{n:03d}-" + "x" * 50_000 for n in range(30)]
    kit.broker.declare_queue("default")
    kit.broker.enqueue_many([_orphan(name) for name in names])
    caplog.set_level(logging.WARNING, logger="dramatiq_gp.brokers.base")
    start_worker(kit)
    wait_for(lambda: dead(kit) == 30)
    lines = messages_of(caplog, "dramatiq_gp.brokers.base", logging.WARNING)
    assert len(lines) == 21, [line[:80] for line in lines]  # one per type up to the bound, then one saying so
    assert lines[-1].startswith("more than 20 distinct unknown or misrouted task types seen by this process")
    assert max(map(len, lines)) < 1_000
    assert "made-up-000-xxx" in lines[0] and "characters cut" in lines[0]
    warned = kit.broker.__dict__["_warned"]
    assert len(warned) == 20 and sum(len(part) for key in warned for part in key) < 20 * 300
    reasons = {letter.reason for letter in view_for(kit.settings, kit.broker.client).dead_letters("default")}
    assert len(reasons) == 30 and max(map(len, reasons)) < 1_000  # each says why, its name capped too


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_a_message_runs_only_from_a_queue_its_actor_is_declared_on_and_on_another_is_set_aside_with_why(
    broker, make_kit, start_worker, namespace, caplog
):
    # A queue was no boundary: whoever could send to qb ran qa's actor through it.
    kit = make_kit(env={"VALKEY_NAMESPACE": namespace})
    ran: list[tuple[str, str]] = []
    dramatiq.actor(lambda tag: ran.append(("qa", tag)), broker=kit.broker, actor_name="delete_account", queue_name="qa")
    dramatiq.actor(lambda tag: ran.append(("qb", tag)), broker=kit.broker, actor_name="thumbnail", queue_name="qb")

    def send(queue: str, actor: str, tag: str, delay: int | None = None) -> None:
        message = Message(queue_name=queue, actor_name=actor, args=(tag,), kwargs={}, options={}, message_id=tag)
        kit.broker.enqueue(message, delay=delay)

    send("qb", "delete_account", "forged-1")
    send("qb", "delete_account", "forged-2")
    send("qb", "delete_account", "forged-later", delay=50)  # by its delay queue, qb.DQ
    send("qa", "delete_account", "legit")
    send("qb", "thumbnail", "legit")
    send("qb", "thumbnail", "legit-later", delay=50)
    caplog.set_level(logging.WARNING, logger="dramatiq_gp.brokers.base")
    start_worker(kit)
    wait_for(lambda: len(ran) + dead(kit, "qb") == 6)  # each of the six has run or been set aside
    assert sorted(ran) == [("qa", "legit"), ("qb", "legit"), ("qb", "legit-later")]
    letters = view_for(kit.settings, kit.broker.client).dead_letters("qb")
    assert sorted(letter.message_id or "" for letter in letters) == ["forged-1", "forged-2", "forged-later"]
    assert {letter.reason for letter in letters} == {
        "task type 'delete_account' is declared on queue 'qa', not on 'qb' where it came: "
        "a worker runs a message only from its actor's queue"
    }
    (line,) = messages_of(caplog, "dramatiq_gp.brokers.base", logging.WARNING)  # once per task type and queue
    assert line.startswith("task refused: task type 'delete_account' is declared on queue 'qa', not on 'qb'")
    assert dead(kit, "qa") == 0
