"""Dispatch fans an event out to every listener, each its own message on its own queue."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

import dramatiq_gp as gp
from dramatiq_gp import keys, subscriptions
from dramatiq_gp.subscriptions import Subscriptions
from helpers import ready, wait_for


@gp.event("test.fanout.order_placed")
@dataclass(frozen=True)
class OrderPlaced:
    order_id: int
    total: Decimal
    placed_at: datetime


@gp.event("test.fanout.anything")
@dataclass(frozen=True)
class Anything:
    value: Any


@gp.event("test.fanout.nobody_listens")
@dataclass(frozen=True)
class NobodyListens:
    n: int


ORDER = OrderPlaced(7, Decimal("19.90"), datetime(2026, 11, 29, 10, 0, tzinfo=UTC))


def test_dispatch_fans_out_to_every_listener_each_on_its_own_queue(make_kit, start_worker, rdb, namespace):
    seen: dict[str, list[OrderPlaced]] = defaultdict(list)

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        for queue in ("billing", "mail", "stock"):
            registry.listen(OrderPlaced, lambda event, q=queue: seen[q].append(event), name=f"to_{queue}", queue=queue)

    kit = make_kit(register)
    envelope_id = kit.dispatch(ORDER)

    expected_ids = {m.actor_name: m.message_id for m in kit.registry.fan_out(ORDER, envelope_id)}
    for queue in ("billing", "mail", "stock"):
        (stored,) = [json.loads(v) for v in rdb.hvals(f"{namespace}:{queue}.msgs")]
        assert stored["actor_name"] == f"listener:test.fanout.order_placed:to_{queue}"
        assert stored["message_id"] == expected_ids[stored["actor_name"]]
        assert stored["args"][0]["id"] == envelope_id

    start_worker(kit)
    wait_for(lambda: all(len(seen[q]) == 1 for q in ("billing", "mail", "stock")))
    assert {q: events for q, events in seen.items()} == {q: [ORDER] for q in ("billing", "mail", "stock")}


def test_fan_out_ids_are_deterministic_per_envelope_and_listener(make_kit):
    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        registry.listen(OrderPlaced, lambda e: None, name="a")
        registry.listen(OrderPlaced, lambda e: None, name="b")

    kit = make_kit(register)
    first = [m.message_id for m in kit.registry.fan_out(ORDER, "envelope-1")]
    again = [m.message_id for m in kit.registry.fan_out(ORDER, "envelope-1")]
    other = [m.message_id for m in kit.registry.fan_out(ORDER, "envelope-2")]
    assert first == again
    assert len(set(first)) == 2
    assert not set(first) & set(other)


@pytest.mark.usefixtures("broker")
def test_a_listener_knows_its_envelope_and_every_listener_sees_the_same_id(make_kit, start_worker):
    seen: dict[str, gp.Envelope] = {}

    def remember(name: str):
        def handle(event: OrderPlaced) -> None:
            seen[name] = gp.current_envelope()

        return handle

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        registry.listen(OrderPlaced, remember("a"), name="a")
        registry.listen(OrderPlaced, remember("b"), name="b", queue="other")

    kit = make_kit(register)
    envelope_id = kit.dispatch(ORDER)
    start_worker(kit)
    wait_for(lambda: len(seen) == 2)
    expected = gp.Envelope(id=envelope_id, event="test.fanout.order_placed", scheduled_at=None)
    assert seen == {"a": expected, "b": expected}


def test_current_envelope_outside_a_listener_says_so():
    with pytest.raises(RuntimeError, match="only available inside a listener"):
        gp.current_envelope()


@pytest.mark.usefixtures("broker")
def test_a_failing_listener_is_retried_alone(make_kit, start_worker):
    calls: Counter[str] = Counter()
    lock = threading.Lock()

    def flaky(event: OrderPlaced) -> None:
        with lock:
            calls["flaky"] += 1
            if calls["flaky"] == 1:
                raise RuntimeError("transient")

    def steady(event: OrderPlaced) -> None:
        with lock:
            calls["steady"] += 1

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        registry.listen(OrderPlaced, flaky)
        registry.listen(OrderPlaced, steady, queue="other")

    kit = make_kit(register, env={"WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"})
    kit.dispatch(ORDER)
    start_worker(kit)
    wait_for(lambda: calls["flaky"] == 2)
    time.sleep(0.3)
    assert calls == {"flaky": 2, "steady": 1}


@pytest.mark.usefixtures("broker")
def test_an_event_that_cannot_be_encoded_is_rejected_and_nothing_is_sent(make_kit, rdb, namespace):
    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        registry.listen(Anything, lambda e: None, name="one")
        registry.listen(Anything, lambda e: None, name="two", queue="two")

    kit = make_kit(register)
    with pytest.raises(gp.EventEncodeError, match=r"test\.fanout\.anything"):
        kit.dispatch(Anything(object()))
    assert list(rdb.scan_iter(f"{namespace}:*")) == []  # not even a queue declared
    assert [ready(kit, "default"), ready(kit, "two")] == [0, 0]


def test_dispatching_a_plain_object_names_the_problem(make_kit):
    kit = make_kit()
    with pytest.raises(gp.EventError, match="not an event type"):
        kit.dispatch({"order_id": 1})


@pytest.mark.usefixtures("broker")
def test_an_event_nobody_listens_to_sends_nothing(make_kit, rdb, namespace):
    kit = make_kit()
    assert kit.dispatch(NobodyListens(1))
    assert list(rdb.scan_iter(f"{namespace}:*")) == []


@pytest.mark.usefixtures("broker")
def test_module_level_dispatch_uses_the_current_kit(make_kit, start_worker):
    seen: list[OrderPlaced] = []
    kit = make_kit(lambda registry, schedule: registry.listen(OrderPlaced, seen.append, name="collect"))
    gp.dispatch(ORDER)
    start_worker(kit)
    wait_for(lambda: seen == [ORDER])


def test_a_retired_listener_is_owed_the_events_written_before_its_retirement_and_forgotten_after_a_week(
    rdb, namespace, monkeypatch
):
    registry = gp.Registry()
    registry.listen(Anything, lambda event: None, name="old")
    declared = Subscriptions(rdb, namespace)
    declared.declare(registry.listeners(), timedelta(seconds=1))
    task_type = f"listener:{Anything.__gp_event__.name}:old"
    before = int(time.time() * 1000)
    assert declared.of(Anything.__gp_event__.name) == ((task_type, "default"),)

    time.sleep(1.1)
    other = gp.Registry()
    other.listen(OrderPlaced, lambda event: None, name="other")
    declared.declare(other.listeners(), timedelta(seconds=1))  # any worker's declaration retires it
    after = int(time.time() * 1000)
    assert declared.of(Anything.__gp_event__.name) == ()  # live ones only
    assert declared.of(Anything.__gp_event__.name, before) == ((task_type, "default"),)
    assert declared.of(Anything.__gp_event__.name, after) == ()

    monkeypatch.setattr(subscriptions, "RETIRED_KEPT", timedelta(0))
    time.sleep(0.01)  # kept for 0 ms: forgotten from the next millisecond on
    declared.declare(other.listeners(), timedelta(seconds=1))
    assert declared.of(Anything.__gp_event__.name, before) == ()
    assert rdb.hlen(keys.listeners_retired(namespace)) == 0
