"""The layout of ``settle.lua``'s keys and arguments is stated once, and both sides keep to it.

:data:`dramatiq_gp.brokers.redis.SETTLE_KEYS` and :data:`~dramatiq_gp.brokers.redis.SETTLE_ARGV`
name each slot in order. The script's header must declare the same layout, the script must read
each field from the slot the tables give it, and the broker must pack a batch the way the tables
say: a field added, dropped or moved on one side only fails here.
"""

from __future__ import annotations

import re
from typing import Any

import dramatiq
import pytest
from dramatiq import Message

from dramatiq_gp import keys
from dramatiq_gp.brokers import done_marks
from dramatiq_gp.brokers.base import SettlePlan, attach_plan, plan_of
from dramatiq_gp.brokers.redis import _SCRIPTS, SETTLE_ARGV, SETTLE_KEYS, RedisBroker
from helpers import close_broker

LUA = _SCRIPTS["settle"]
OPTIONAL_TONUMBER = r"(?:tonumber\()?"


def test_settle_lua_declares_the_layout_of_settle_keys_and_settle_argv_in_its_header():
    declared: dict[tuple[str, str], tuple[str, ...]] = {}
    for side, part, fields in re.findall(r"^-- (KEYS|ARGV) (\w+): +(.+)$", LUA, re.M):
        declared[side, part] = tuple(field.strip() for field in fields.split(","))
    expected = {("KEYS", part): fields for part, fields in SETTLE_KEYS.items()}
    expected |= {("ARGV", part): fields for part, fields in SETTLE_ARGV.items()}
    assert declared == expected
    assert "dramatiq_gp.brokers.redis.SETTLE_KEYS and SETTLE_ARGV" in LUA


def test_settle_lua_reads_each_field_from_the_slot_the_layout_gives_it():
    head, queue, plain, full = (SETTLE_ARGV[part] for part in ("head", "queue", "plain", "full"))
    # A plain entry is the start of a full one, so the script reads its fields alike.
    assert full[: len(plain)] == plain

    # KEYS: the head by number, a queue's keys from its first key on.
    [(head_names, head_slots)] = re.findall(r"^local ([\w, ]+) = (KEYS\[\d+\](?:, KEYS\[\d+\])*)$", LUA, re.M)
    assert tuple(head_names.split(", ")) == SETTLE_KEYS["head"]
    assert [int(n) for n in re.findall(r"KEYS\[(\d+)\]", head_slots)] == list(range(1, len(SETTLE_KEYS["head"]) + 1))
    [(queue_names, queue_slots)] = re.findall(r"local ([\w, ]+) = ((?:\s*KEYS\[first_key(?: \+ \d+)?\],?)+)", LUA)
    assert tuple(queue_names.split(", ")) == SETTLE_KEYS["queue"]
    offsets = [int(n or 0) for n in re.findall(r"KEYS\[first_key(?: \+ (\d+))?\]", queue_slots)]
    assert offsets == list(range(len(SETTLE_KEYS["queue"])))

    # ARGV: the head by number (Lua counts from 1) ...
    read = {name: int(slot) for name, slot in re.findall(rf"(\w+) = {OPTIONAL_TONUMBER}ARGV\[(\d+)\]", LUA)}
    assert read == {name: slot for slot, name in enumerate(head, 1)}
    assert len(re.findall(r"ARGV\[\d+\]", LUA)) == len(head)  # and nothing else by number
    # ... each queue's entry from right after the head, ...
    pattern = rf"(\w+) = {OPTIONAL_TONUMBER}ARGV\[(\d+) \+ (\d+) \* j\]"
    read_queue = {name: (int(base), int(step)) for name, base, step in re.findall(pattern, LUA)}
    assert read_queue == {name: (len(head) + 1 + k, len(queue)) for k, name in enumerate(queue)}
    [(start, step)] = re.findall(r"local i = (\d+) \+ (\d+) \* queue_count", LUA)
    assert (int(start), int(step)) == (len(head) + 1, len(queue))
    # ... and each message's entry from i, moving on by the length of a plain or a full one.
    pattern = rf"(\w+) = {OPTIONAL_TONUMBER}ARGV\[i(?: \+ (\d+))?\]"
    read_entry = {name: int(offset or 0) for name, offset in re.findall(pattern, LUA)}
    assert read_entry == {name: k for k, name in enumerate(full)}
    assert len(re.findall(r"ARGV\[i\b", LUA)) == len(full)  # and nothing else from an entry
    assert sorted(int(n) for n in re.findall(r"\bi = i \+ (\d+)", LUA)) == sorted([len(plain), len(full)])


@pytest.fixture
def broker(redis_url, namespace):
    broker = RedisBroker(url=redis_url, namespace=namespace, middleware=[], settle_window_ms=0)

    for queue in ("default", "other"):  # a worker takes a message only from its actor's queue
        dramatiq.actor(lambda n: None, broker=broker, actor_name=f"probe-{queue}", queue_name=queue)

    yield broker
    close_broker(broker)


def _fetch(broker: RedisBroker, queue_name: str, count: int) -> list[Any]:
    """``count`` messages of ``queue_name``, sent and fetched: held in this worker's acks set."""
    for n in range(count):
        broker.enqueue(
            Message(queue_name=queue_name, actor_name=f"probe-{queue_name}", args=(n,), kwargs={}, options={})
        )
    consumer = broker.consume(queue_name, prefetch=count, timeout=100)
    fetched = [message for message in (next(consumer) for _ in range(count)) if message is not None]
    assert len(fetched) == count
    return fetched


def _entries(args: list[Any]) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """``args`` of a settle call read with :data:`SETTLE_ARGV`: the head, the queues, the messages."""
    head = dict(zip(SETTLE_ARGV["head"], args, strict=False))
    at = len(SETTLE_ARGV["head"])
    queues = []
    for _ in range(head["queue_count"]):
        queues.append(dict(zip(SETTLE_ARGV["queue"], args[at:], strict=False)))
        at += len(SETTLE_ARGV["queue"])
    messages = []
    while at < len(args):
        layout = SETTLE_ARGV["full"] if str(args[at]).isupper() else SETTLE_ARGV["plain"]
        assert at + len(layout) <= len(args), "an entry runs past the end of ARGV"
        messages.append(dict(zip(layout, args[at:], strict=False)))
        at += len(layout)
    return head, queues, messages


def test_the_broker_packs_a_batch_as_the_layout_says_and_the_script_writes_each_field(broker, namespace, rdb):
    ns, worker = namespace, broker.broker_id
    plain_ack, planned_ack, failed = _fetch(broker, "default", 3)
    [put_back] = _fetch(broker, "other", 1)

    rdb.set(f"{ns}:test:done", "t1")
    mark = done_marks.digest(planned_ack.message_id)
    attach_plan(
        planned_ack, SettlePlan(key=f"{ns}:test:done", token="t1", outcome="done", mark=mark, retention_ms=60_000)
    )
    broker.redeliver_later(planned_ack, 30_000)  # its copy, in its plan
    rdb.set(f"{ns}:test:claim", "t2")
    attach_plan(put_back, SettlePlan(key=f"{ns}:test:claim", token="t2", outcome="release"))
    failed.options["traceback"] = "the last attempt's"

    script = broker._scripts["settle"]
    calls: list[tuple[list[str], list[Any]]] = []

    def recorded(*, keys: list[str], args: list[Any]) -> Any:
        calls.append((list(keys), list(args)))
        return script(keys=keys, args=args)

    broker._scripts["settle"] = recorded
    batch = [("default", plain_ack, "ack"), ("default", planned_ack, "ack"), ("default", failed, "nack")]
    broker._write_settles([*batch, ("other", put_back, "requeue")])

    [(touched, args)] = calls
    head, queues, entries = _entries(args)
    assert (head["worker_id"], head["queue_count"], head["marks"]) == (worker, 2, keys.done_marks(ns))
    assert dict(zip(SETTLE_KEYS["head"], touched, strict=False)) == {
        "heartbeats": keys.heartbeats(ns),
        "throughput": keys.throughput(ns, head["now"] // 60_000),
    }
    first_key = {}
    for queue in queues:
        name = queue["queue_name"]
        first_key[name] = queue["first_key"]
        stored = touched[queue["first_key"] - 1 :][: len(SETTLE_KEYS["queue"])]
        assert dict(zip(SETTLE_KEYS["queue"], stored, strict=True)) == {
            "acks": keys.acks(ns, worker, name),
            "msgs": keys.messages(ns, name),
            "queue": keys.queue(ns, name),
            "xq": keys.dead(ns, name),
            "xq_msgs": keys.dead_messages(ns, name),
            "dq": keys.delay_queue(ns, name),
            "dq_msgs": keys.delay_messages(ns, name),
        }
    assert set(first_key) == {"default", "other"}

    copy = plan_of(planned_ack).copy
    rid = "redis_message_id"
    assert entries == [
        {"tag": "a", "first_key": first_key["default"], "redis_id": plain_ack.options[rid]},
        {
            "tag": "A",
            "first_key": first_key["default"],
            "redis_id": planned_ack.options[rid],
            "key_index": touched.index(f"{ns}:test:done") + 1,
            "outcome": "done",
            "token": "t1",
            "mark": mark,
            "retention_ms": 60_000,
            "copy_id": copy.options[rid],
            "data": copy.encode(),
        },
        {
            "tag": "N",
            "first_key": first_key["default"],
            "redis_id": failed.options[rid],
            "key_index": 0,
            "outcome": "",
            "token": "",
            "mark": b"",
            "retention_ms": 0,
            "copy_id": "",
            "data": failed.encode(),
        },
        {
            "tag": "R",
            "first_key": first_key["other"],
            "redis_id": put_back.options[rid],
            "key_index": touched.index(f"{ns}:test:claim") + 1,
            "outcome": "release",
            "token": "t2",
            "mark": b"",
            "retention_ms": 0,
            "copy_id": "",
            "data": b"",
        },
    ]

    # And the script took each field from where it was packed.
    assert rdb.scard(keys.acks(ns, worker, "default")) == rdb.scard(keys.acks(ns, worker, "other")) == 0
    assert rdb.hkeys(keys.messages(ns, "default")) == []
    assert rdb.lrange(keys.delay_queue(ns, "default"), 0, -1) == [copy.options[rid]]
    assert rdb.hget(keys.delay_messages(ns, "default"), copy.options[rid]) == copy.encode().decode()
    assert rdb.exists(f"{ns}:test:done", f"{ns}:test:claim") == 0  # both claims freed
    assert done_marks.is_done(rdb, ns, planned_ack.message_id)
    assert not done_marks.is_done(rdb, ns, put_back.message_id)
    assert rdb.zrange(keys.dead(ns, "default"), 0, -1) == [failed.options[rid]]
    kept = Message.decode(rdb.hget(keys.dead_messages(ns, "default"), failed.options[rid]).encode())
    assert kept.options["traceback"] == "the last attempt's"
    assert rdb.lrange(keys.queue(ns, "other"), 0, -1) == [put_back.options[rid]]
    assert not rdb.exists(f"{ns}:test:claim")
    counts = rdb.hgetall(keys.throughput(ns, head["now"] // 60_000))
    assert counts == {"default:done": "1", "default:retried": "1", "default:dead": "1"}
